"""2024-era configs and command lines still work: legacy-schema TOML files (kept verbatim in
tests/assets/legacy_2024_configs/) and the flags of the 2024-era and config-registry-era
debugging guides, parsed as written."""

from __future__ import annotations

import shlex

import pytest

from tests.conftest import ASSETS, REPO_ROOT
from torchtitan.config import ConfigManager
from torchtitan.config.manager import main

REPO = REPO_ROOT
LEGACY = ASSETS / "legacy_2024_configs"


def parse(*args: str):
    return ConfigManager().parse_args(list(args))


@pytest.mark.parametrize(
    "asset", ["legacy_2024_job_config.toml", "legacy_2024_job_config_with_cp.toml"]
)
def test_2024_era_toml_configs_load_unchanged(asset):
    cfg = parse("--job.config_file", str(LEGACY / asset))
    assert cfg.job.description == "Llama 3 debug training"
    assert cfg.job.use_for_integration_test is True
    assert cfg.profiling.enable_profiling is True
    assert cfg.profiling.save_traces_folder == "profile_trace"
    assert cfg.metrics.log_freq == 1 and cfg.metrics.enable_tensorboard is True
    assert cfg.metrics.disable_color_printing is False  # enable_color_printing = true
    assert (cfg.model.name, cfg.model.flavor) == ("llama3", "debugmodel")
    assert cfg.model.tokenizer_path == "./test/assets/test_tiktoken.model"  # need not exist
    assert cfg.optimizer.lr == 8e-4
    assert cfg.training.local_batch_size == 8  # batch_size
    assert cfg.lr_scheduler.warmup_steps == 2  # training.warmup_steps
    assert (cfg.training.seq_len, cfg.training.steps, cfg.training.max_norm) == (2048, 10, 1.0)
    assert cfg.parallelism.data_parallel_replicate_degree == 1
    assert cfg.parallelism.data_parallel_shard_degree == -1
    assert cfg.parallelism.tensor_parallel_degree == 1
    assert cfg.parallelism.pipeline_parallel_degree == 1
    assert cfg.parallelism.enable_async_tensor_parallel is False
    assert cfg.compile.enable is False
    assert cfg.training.dataset == "c4_test"
    assert cfg.checkpoint.enable is False  # enable_checkpoint
    assert cfg.checkpoint.interval == 5
    assert cfg.checkpoint.last_save_model_only is False  # model_weights_only = false
    assert cfg.checkpoint.async_mode == "disabled"
    assert cfg.activation_checkpoint.mode == "selective"
    assert cfg.activation_checkpoint.selective_ac_option == "2"
    assert cfg.model.converters == []  # enable_float8_linear = false


def test_bool_override_block_and_its_cli_overrides():
    path = str(LEGACY / "memory_snapshot_on.toml")
    assert parse("--job.config_file", path).profiling.enable_memory_snapshot is True
    for off in ("--profiling.no_enable_memory_snapshot", "--profiling.no-enable-memory-snapshot"):
        assert parse("--job.config_file", path, off).profiling.enable_memory_snapshot is False


# Flags of the guides' command lines, verbatim (the part after ./run_train.sh / the tool).
COMMAND_LINES = {
    "2024-era": [
        "--profiling.enable_memory_snapshot --profiling.save_memory_snapshot_folder memory_snapshot",
        "--training.seed 42",
        "--training.deterministic",
        "--checkpoint.enable_checkpoint --checkpoint.create_seed_checkpoint "
        "--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 1 "
        "--parallelism.tensor_parallel_degree 1 --parallelism.pipeline_parallel_degree 1 "
        "--parallelism.context_parallel_degree 1 --parallelism.expert_parallel_degree 1",
    ],
    "config-registry-era": [
        "--profiling.enable_memory_snapshot --profiling.save_memory_snapshot_folder memory_snapshot",
        "--debug.seed 42",
        "--debug.deterministic",
        "--debug.deterministic_warn_only",
        "--checkpoint.enable --checkpoint.create_seed_checkpoint "
        "--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 1 "
        "--parallelism.tensor_parallel_degree 1 --parallelism.pipeline_parallel_degree 1 "
        "--parallelism.context_parallel_degree 1 --parallelism.expert_parallel_degree 1",
        "--checkpoint.enable --checkpoint.load_only",
        "--parallelism.tensor_parallel_degree 8 \\\n--parallelism.data_parallel_shard_degree 2",
    ],
}
CASES = [(era, flags) for era, lines in COMMAND_LINES.items() for flags in lines]
CASE_IDS = [f"{era}-{i}" for i, (era, _) in enumerate(CASES)]


def _check(cfg, flags: str) -> None:
    if "enable_memory_snapshot" in flags:
        assert cfg.profiling.enable_memory_snapshot is True
        assert cfg.profiling.save_memory_snapshot_folder == "memory_snapshot"
    if "seed 42" in flags:
        assert cfg.debug.seed == 42
    if flags.endswith(".deterministic"):
        assert cfg.debug.deterministic is True
    if "deterministic_warn_only" in flags:
        assert cfg.debug.deterministic_warn_only is True
    if "create_seed_checkpoint" in flags:
        assert cfg.checkpoint.enable and cfg.checkpoint.create_seed_checkpoint
        p = cfg.parallelism
        assert (
            p.data_parallel_replicate_degree,
            p.data_parallel_shard_degree,
            p.tensor_parallel_degree,
            p.pipeline_parallel_degree,
            p.context_parallel_degree,
            p.expert_parallel_degree,
        ) == (1, 1, 1, 1, 1, 1)
    if "load_only" in flags:
        assert cfg.checkpoint.enable and cfg.checkpoint.load_only
    if "tensor_parallel_degree 8" in flags:
        assert cfg.parallelism.tensor_parallel_degree == 8
        assert cfg.parallelism.data_parallel_shard_degree == 2


@pytest.mark.parametrize(("era", "flags"), CASES, ids=CASE_IDS)
def test_guide_command_lines_parse(tmp_path, era, flags):
    debug = tmp_path / "debug_model.toml"
    debug.write_text("[training]\nsteps = 10\nlocal_batch_size = 2\n")
    argv = shlex.split(flags.replace("\\\n", " "))  # the shell's line continuation
    cfg = parse("--job.config_file", str(debug), *argv)
    _check(cfg, flags)


def test_guide_config_tool_commands(capsys, monkeypatch):
    """The guides' config-manager commands, against the bundled configs."""
    monkeypatch.chdir(REPO)
    commands = [
        "--job.config_file ./torchtitan/models/llama3/train_configs/llama3_8b.toml "
        "--profiling.enable_memory_snapshot",
        "--module llama3 --config llama3_8b --profiling.enable_memory_snapshot",
        "--job.config_file ./train_configs/debug_model.toml --profiling.enable_memory_snapshot "
        "--profiling.save_memory_snapshot_folder memory_snapshot",
    ]
    for command in commands:
        assert main(shlex.split(command)) == 0, command
        out = capsys.readouterr().out
        assert "\nenable_memory_snapshot = true\n" in out
