"""Every TOML block and command line in the user's seed documents parses as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from torchtitan.config import ConfigManager
from torchtitan.config.manager import main

REPO = Path(__file__).resolve().parents[2]
SEEDS = REPO.parent / "shared" / "seeds"
ASSETS = REPO / "tests" / "assets" / "seed_configs"

# seed file prefix -> asset copy of its TOML block
SEED_BLOCKS = {
    "000": "seed000_bool_override.toml",
    "002": "seed000_bool_override.toml",  # the same block, repeated in seed 002
    "003": "seed003_config.toml",
    "004": "seed004_config.toml",
}


def toml_blocks(text: str) -> list[str]:
    """Fenced blocks tagged ```toml, or untagged ones starting with '# torchtitan Config.toml'."""
    blocks = []
    for match in re.finditer(r"```([a-z]*)\n(.*?)```", text, re.S):
        lang, body = match.groups()
        if lang == "toml" or body.lstrip().startswith("# torchtitan Config.toml"):
            blocks.append(body)
    return blocks


def seed_text(prefix: str) -> str:
    (path,) = SEEDS.glob(f"{prefix}_*.txt")
    return path.read_text()


# Test ids name the document, not its file number.
BLOCK_NAMES = {
    "000": "2024-era-debugging-doc",
    "002": "debugging-doc-repeat",
    "003": "2024-era-training-notes",
    "004": "2024-era-api-readme",
}

needs_seeds = pytest.mark.skipif(not SEEDS.is_dir(), reason="../shared/seeds is not present")


@needs_seeds
@pytest.mark.parametrize(
    ("prefix", "asset"),
    sorted(SEED_BLOCKS.items()),
    ids=[BLOCK_NAMES[k] for k in sorted(SEED_BLOCKS)],
)
def test_asset_copies_equal_the_docs_toml_blocks(prefix, asset):
    assert toml_blocks(seed_text(prefix)) == [(ASSETS / asset).read_text()]


@needs_seeds
def test_no_docs_toml_block_is_left_uncopied():
    for path in sorted(SEEDS.glob("*.txt")):
        if toml_blocks(path.read_text()):
            assert path.name[:3] in SEED_BLOCKS, path.name


def parse(*args: str):
    return ConfigManager().parse_args(list(args))


@pytest.mark.parametrize(
    "asset",
    ["seed003_config.toml", "seed004_config.toml"],
    ids=["2024-era-training-notes", "2024-era-api-readme"],
)
def test_2024_era_toml_configs_load_unchanged(asset):
    cfg = parse("--job.config_file", str(ASSETS / asset))
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


def test_docs_bool_override_block_and_its_cli_overrides():
    path = str(ASSETS / "seed000_bool_override.toml")
    assert parse("--job.config_file", path).profiling.enable_memory_snapshot is True
    for off in ("--profiling.no_enable_memory_snapshot", "--profiling.no-enable-memory-snapshot"):
        assert parse("--job.config_file", path, off).profiling.enable_memory_snapshot is False


# Flags of the seeds' command lines, verbatim (the part after ./run_train.sh / the tool).
SEED_FLAGS = {
    "000": [
        "--profiling.enable_memory_snapshot --profiling.save_memory_snapshot_folder memory_snapshot",
        "--training.seed 42",
        "--training.deterministic",
        "--checkpoint.enable_checkpoint --checkpoint.create_seed_checkpoint "
        "--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 1 "
        "--parallelism.tensor_parallel_degree 1 --parallelism.pipeline_parallel_degree 1 "
        "--parallelism.context_parallel_degree 1 --parallelism.expert_parallel_degree 1",
    ],
    "001": [
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
CASES = [(seed, flags) for seed, lines in SEED_FLAGS.items() for flags in lines]
# Test ids name the document, not its file number.
DOC_NAMES = {"000": "2024-era-debugging-doc", "001": "config-registry-debugging-doc"}
CASE_IDS = [f"{DOC_NAMES[seed]}-{i}" for i, (seed, _) in enumerate(CASES)]


@needs_seeds
@pytest.mark.parametrize(("seed", "flags"), CASES, ids=CASE_IDS)
def test_command_lines_appear_verbatim_in_the_docs(seed, flags):
    assert flags in seed_text(seed)


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


@pytest.mark.parametrize(("seed", "flags"), CASES, ids=CASE_IDS)
def test_docs_command_lines_parse(tmp_path, seed, flags):
    debug = tmp_path / "debug_model.toml"
    debug.write_text("[training]\nsteps = 10\nlocal_batch_size = 2\n")
    argv = shlex.split(flags.replace("\\\n", " "))  # the shell's line continuation
    cfg = parse("--job.config_file", str(debug), *argv)
    _check(cfg, flags)


def test_docs_config_tool_commands(capsys, monkeypatch):
    """The seeds' config-manager commands, with the bundled configs when they exist."""
    monkeypatch.chdir(REPO)
    commands = [
        "--job.config_file ./torchtitan/models/llama3/train_configs/llama3_8b.toml "
        "--profiling.enable_memory_snapshot",
        "--module llama3 --config llama3_8b --profiling.enable_memory_snapshot",
        "--job.config_file ./train_configs/debug_model.toml --profiling.enable_memory_snapshot "
        "--profiling.save_memory_snapshot_folder memory_snapshot",
    ]
    ran = 0
    for command in commands:
        argv = shlex.split(command)
        target = argv[1] if argv[0] == "--job.config_file" else "train_configs/llama3_8b.toml"
        if not (REPO / target).is_file():
            continue
        assert main(argv) == 0, command
        out = capsys.readouterr().out
        assert "\nenable_memory_snapshot = true\n" in out
        ran += 1
    if ran == 0:
        pytest.skip("bundled train_configs not written yet")
