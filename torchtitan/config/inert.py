"""Flags that would do nothing: a command-line setting whose feature is switched off.

``--validation.freq 5`` without ``--validation.enable``, ``--checkpoint.interval 100``
without ``--checkpoint.enable``, ``--parallelism.pipeline_parallel_schedule GPipe`` on one
pipeline stage: the run would go on as if the flag had not been given. Each such flag gets a
warning line that says which switch is off (:func:`warn_inert_flags`). Only flags are checked:
a TOML file sets whole sections, switched on or not, by design (the bundled configs do).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from torchtitan.config.validation import unknown_rule_keys

__all__ = ["INERT_RULES", "inert_flags", "warn_inert_flags"]

logger = logging.getLogger(__name__)


def _switch(section: str, key: str) -> tuple[Callable[[Any], bool], Callable[[Any], str]]:
    return (lambda cfg: bool(getattr(getattr(cfg, section), key)),
            lambda cfg: f"{section}.{key} is off (add --{section}.{key})")


def _converts(name: str) -> tuple[Callable[[Any], bool], Callable[[Any], str]]:
    def active(cfg: Any) -> bool:
        from torchtitan.components.converters import requested_converters

        try:
            return name in requested_converters(cfg.model.converters)
        except ValueError:  # a bad converter list is refused on its own, later
            return True

    return active, lambda cfg: f"model.converters={list(cfg.model.converters)} does not include {name}"


def _checkpoints(cfg: Any) -> bool:
    return cfg.checkpoint.enable or cfg.checkpoint.create_seed_checkpoint


def _with_checkpoints(active: Callable[[Any], bool], why: Callable[[Any], str]
                      ) -> tuple[Callable[[Any], bool], Callable[[Any], str]]:
    """A checkpoint setting that acts only with checkpoints on and ``active``; the line names
    checkpoint.enable first when that is what is off."""
    return (lambda cfg: _checkpoints(cfg) and active(cfg),
            lambda cfg: why(cfg) if _checkpoints(cfg) else _switch("checkpoint", "enable")[1](cfg))


def _degree(key: str) -> tuple[Callable[[Any], bool], Callable[[Any], str]]:
    return (lambda cfg: getattr(cfg.parallelism, key) > 1,
            lambda cfg: f"parallelism.{key}={getattr(cfg.parallelism, key)}")


def _ac_mode(mode: str) -> tuple[Callable[[Any], bool], Callable[[Any], str]]:
    return (lambda cfg: cfg.activation_checkpoint.mode == mode,
            lambda cfg: f"activation_checkpoint.mode={cfg.activation_checkpoint.mode!r}, "
                        f"not {mode!r}")


def _classic_ddp_compiled(cfg: Any) -> bool:
    p = cfg.parallelism
    others = (p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree)
    return (cfg.compile.enable and p.data_parallel_replicate_degree > 1
            and p.data_parallel_shard_degree in (1, -1) and all(d == 1 for d in others))


_PIPELINE = ("module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
             "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage",
             "pipeline_parallel_split_points", "pipeline_parallel_schedule",
             "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
             "pipeline_parallel_microbatches")
_FAULT_TOLERANCE = ("process_group", "process_group_timeout_ms", "replica_id", "group_size",
                    "min_replica_size", "semi_sync_method", "lighthouse",
                    "quorum_timeout_seconds", "startup_wait_seconds", "sync_steps",
                    "num_fragments", "module_fqns_per_model_fragment", "fragment_sync_delay",
                    "fragment_update_alpha", "outer_lr", "outer_momentum", "should_quantize")

INERT_RULES: list[tuple[tuple[str, ...], Callable[[Any], bool], Callable[[Any], str]]] = [
    (tuple(f"validation.{k}" for k in ("dataset", "dataset_path", "local_batch_size", "seq_len",
                                       "freq", "steps")), *_switch("validation", "enable")),
    (tuple(f"checkpoint.{k}" for k in ("interval", "keep_latest_k", "async_mode", "load_step",
                                       "last_save_model_only", "last_save_in_hf",
                                       "enable_first_step_checkpoint", "load_only")),
     _checkpoints,
     _switch("checkpoint", "enable")[1]),
    (("checkpoint.export_dtype",), *_with_checkpoints(
        lambda cfg: cfg.checkpoint.last_save_model_only or cfg.checkpoint.last_save_in_hf,
        lambda cfg: "it is the dtype of a last save holding the model only, and "
                    "checkpoint.last_save_model_only and checkpoint.last_save_in_hf are off (the "
                    "full checkpoints keep the float32 weights training resumes from)")),
    (("checkpoint.last_save_in_hf_allow_lossy",), *_with_checkpoints(
        lambda cfg: cfg.checkpoint.last_save_in_hf, _switch("checkpoint", "last_save_in_hf")[1])),
    (("profiling.save_traces_folder", "profiling.profiler_active", "profiling.profiler_warmup"),
     *_switch("profiling", "enable_profiling")),
    (("profiling.profile_freq",),
     lambda cfg: cfg.profiling.enable_profiling or cfg.profiling.enable_memory_snapshot,
     lambda cfg: "profiling.enable_profiling and profiling.enable_memory_snapshot are off"),
    (("profiling.save_memory_snapshot_folder",), *_switch("profiling", "enable_memory_snapshot")),
    (("metrics.save_tb_folder",), *_switch("metrics", "enable_tensorboard")),
    (("metrics.save_for_all_ranks",),
     lambda cfg: cfg.metrics.enable_tensorboard or cfg.metrics.enable_wandb,
     lambda cfg: "metrics.enable_tensorboard and metrics.enable_wandb are off"),
    (("compile.components", "compile.backend"), *_switch("compile", "enable")),
    (tuple(f"parallelism.{k}" for k in _PIPELINE), *_degree("pipeline_parallel_degree")),
    (("parallelism.context_parallel_rotate_method", "parallelism.context_parallel_load_balancer"),
     *_degree("context_parallel_degree")),
    (("parallelism.enable_async_tensor_parallel", "parallelism.disable_loss_parallel"),
     *_degree("tensor_parallel_degree")),
    (("parallelism.enable_compiled_autograd",), _classic_ddp_compiled,
     lambda cfg: "it only picks how compile treats classic DDP (compile.enable with "
                 "data_parallel_replicate_degree > 1 and no FSDP, TP, PP or CP)"),
    (("activation_checkpoint.selective_ac_option",), *_ac_mode("selective")),
    (("activation_checkpoint.memory_budget", "activation_checkpoint.visualize_memory_budget_pareto"),
     *_ac_mode("memory_budget")),
    (("float8.recipe_name", "float8.filter_fqns", "float8.emulate", "float8.moe_fqns_prototype",
      "float8.enable_fsdp_float8_all_gather", "float8.precompute_float8_dynamic_scale_for_fsdp",
      "float8.weight_grad_views"),
     *_converts("float8")),
    (("mx.recipe_name", "mx.filter_fqns", "mx.moe_fqns_prototype"), *_converts("mx")),
    (tuple(f"fault_tolerance.{k}" for k in _FAULT_TOLERANCE), *_switch("fault_tolerance", "enable")),
    # not memory_estimation.disable_fake_mode: scripts/estimate_memory.py reads it on its own
]
"""(flags, whether their feature is on for a config, why not): a flag in the first group does
something only when the second holds."""


def inert_flags(cfg: Any, flag_keys: Iterable[str]) -> list[str]:
    """One line per switch that is off, naming the given flags (dotted keys) it silences."""
    given = list(dict.fromkeys(flag_keys))
    lines = []
    for keys, active, why in INERT_RULES:
        silenced = [k for k in given if k in keys]
        if silenced and not active(cfg):
            flags = ", ".join(f"--{k}" for k in silenced)
            verb = "has" if len(silenced) == 1 else "have"
            lines.append(f"{flags} {verb} no effect: {why(cfg)}")
    return lines


def warn_inert_flags(cfg: Any, flag_keys: Iterable[str]) -> None:
    """Log :func:`inert_flags` as warnings."""
    for line in inert_flags(cfg, flag_keys):
        logger.warning(line)


_UNKNOWN = unknown_rule_keys([k for keys, _, _ in INERT_RULES for k in keys])
if _UNKNOWN:
    raise RuntimeError(f"torchtitan/config/inert.py names fields JobConfig does not have: {_UNKNOWN}")
