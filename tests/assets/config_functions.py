"""Python config functions for tests: ``--module tests.assets.config_functions --config NAME``
(the newer upstream config-registry style, next to TOML files)."""

from torchtitan.config.job_config import JobConfig


def tiny_debug() -> JobConfig:
    """A few steps of the tiny Llama 3 on the synthetic corpus, built in code."""
    cfg = JobConfig()
    cfg.job.description = "tiny debug run from a config function"
    cfg.model.flavor = "debugmodel_tiny"
    cfg.model.hf_assets_path = "./tests/assets/tokenizer"
    cfg.training.dataset = "c4_test"
    cfg.training.seq_len = 64
    cfg.training.local_batch_size = 2
    cfg.training.steps = 3
    cfg.training.mixed_precision_param = "float32"
    cfg.lr_scheduler.warmup_steps = 1
    cfg.metrics.log_freq = 1
    cfg.profiling.enable_memory_snapshot = True
    return cfg


def not_a_config() -> dict:
    return {"training": {"steps": 3}}


def broken() -> JobConfig:
    raise RuntimeError("the cluster table is unreachable")
