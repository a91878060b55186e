"""Malformed configs and flags: exactly one ``error: ...`` line on stderr and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan.config.manager import ConfigError, ConfigManager, main, parse_args_or_exit

REPO = Path(__file__).resolve().parents[2]

# (id, TOML text or None, argv with {toml} for the TOML path, substrings the message must contain)
CASES = [
    (
        "toml-syntax",
        "[training]\nsteps = = 3\n",
        ["--job.config_file", "{toml}"],
        ["invalid TOML", "line 2", "job.toml"],
    ),
    (
        "toml-unclosed-table",
        "[training\nsteps = 3\n",
        ["--job.config_file={toml}"],
        ["invalid TOML", "line 1"],
    ),
    (
        "toml-duplicate-key",
        "[training]\nsteps = 3\nsteps = 4\n",
        ["--job.config_file", "{toml}"],
        ["invalid TOML", "line 3"],
    ),
    (
        "unknown-section",
        "[trainig]\nsteps = 3\n",
        ["--job.config_file", "{toml}"],
        ["unknown section [trainig]", "did you mean [training]"],
    ),
    (
        "typo-key",
        "[training]\nstpes = 3\n",
        ["--job.config_file", "{toml}"],
        ["unknown key 'stpes' in [training]", "did you mean training.steps"],
    ),
    (
        "key-in-wrong-section",
        "[parallelism]\nsteps = 3\n",
        ["--job.config_file", "{toml}"],
        ["unknown key 'steps' in [parallelism]", "training.steps"],
    ),
    (
        "toml-choice-in-another-case",
        "[activation_checkpoint]\nmode = \"Selective\"\n",
        ["--job.config_file", "{toml}"],
        ["activation_checkpoint.mode = 'Selective' is not a valid value (expected one of 'none',",
         "; did you mean 'selective'?"],
    ),
    (
        "flag-choice-with-a-typo",
        None,
        ["--training.loss_implementation", "chunk"],
        ["--training.loss_implementation: invalid value 'chunk' (expected one of 'auto', "
         "'logits', 'chunked'); did you mean 'chunked'?"],
    ),
    (
        "toml-choice-of-the-wrong-type",
        "[training]\nloss_implementation = 3\n",
        ["--job.config_file", "{toml}"],
        ["training.loss_implementation = 3 has the wrong type (expected one of 'auto'"],
    ),
    (
        "root-level-key",
        "steps = 3\n",
        ["--job.config_file", "{toml}"],
        ["must be inside a [section]", "training.steps"],
    ),
    (
        "section-not-table",
        "training = 5\n",
        ["--job.config_file", "{toml}"],
        ["training must be a table"],
    ),
    (
        "toml-wrong-type-int",
        '[training]\nsteps = "ten"\n',
        ["--job.config_file", "{toml}"],
        ["training.steps", "'ten'", "expected int"],
    ),
    (
        "toml-wrong-type-bool",
        '[profiling]\nenable_memory_snapshot = "yes"\n',
        ["--job.config_file", "{toml}"],
        ["profiling.enable_memory_snapshot", "'yes'", "bool"],
    ),
    (
        "toml-wrong-literal",
        '[optimizer]\nname = "SGD"\n',
        ["--job.config_file", "{toml}"],
        ["optimizer.name", "'SGD'", "one of 'AdamW', 'Adam'"],
    ),
    (
        "toml-wrong-list",
        "[model]\nconverters = [1, 2]\n",
        ["--job.config_file", "{toml}"],
        ["model.converters", "list of str"],
    ),
    (
        "toml-table-for-scalar",
        "[training.steps]\nx = 1\n",
        ["--job.config_file", "{toml}"],
        ["[training.steps] is a table"],
    ),
    (
        "legacy-bad-value",
        '[optimizer]\nfused = "yes"\n',
        ["--job.config_file", "{toml}"],
        ["optimizer.fused", "'yes'", "true or false"],
    ),
    (
        "toml-negative-degree",
        "[parallelism]\ntensor_parallel_degree = -2\n",
        ["--job.config_file", "{toml}"],
        ["parallelism.tensor_parallel_degree must be >= 1", "-2"],
    ),
    (
        "missing-file",
        None,
        ["--job.config_file", "/no/such/config.toml"],
        ["config file not found", "/no/such/config.toml"],
    ),
    ("directory", None, ["--job.config_file", "{dir}"], ["is a directory"]),
    (
        "not-utf8",
        b'[job]\ndescription = "\xff\xfe"\n',
        ["--job.config_file", "{toml}"],
        ["not UTF-8"],
    ),
    ("config-file-no-value", None, ["--job.config_file"], ["--job.config_file expects a value"]),
    (
        "unknown-flag",
        None,
        ["--training.stpes", "3"],
        ["unknown flag --training.stpes", "did you mean --training.steps"],
    ),
    ("flag-without-section", None, ["--steps", "3"], ["did you mean --training.steps"]),
    ("unknown-section-flag", None, ["--trainig.steps", "3"], ["did you mean --training.steps"]),
    (  # the 2024-era debugging guide's advice, without the section
        "negated-flag-without-section",
        None,
        ["--no_enable_memory_snapshot"],
        ["unknown flag --no_enable_memory_snapshot",
         "did you mean --profiling.no_enable_memory_snapshot?"],
    ),
    (
        "bool-without-section-equals-false",
        None,
        ["--enable_memory_snapshot=False"],
        ["did you mean --profiling.no_enable_memory_snapshot?"],
    ),
    (
        "negated-typo",
        None,
        ["--profiling.no-enable-memory-snapshott"],
        ["did you mean --profiling.no_enable_memory_snapshot?"],
    ),
    (
        "bool-equals-false",
        None,
        ["--profiling.enable_memory_snapshot=False"],
        ["takes no value", "--profiling.no_enable_memory_snapshot"],
    ),
    (
        "bool-space-true",
        None,
        ["--profiling.enable_memory_snapshot", "True"],
        ["takes no value", "--profiling.enable_memory_snapshot to turn it on"],
    ),
    ("no-prefix-on-non-bool", None, ["--training.no_steps"], ["unknown flag --training.no_steps"]),
    (
        "cli-wrong-type",
        None,
        ["--training.steps", "abc"],
        ["--training.steps", "'abc'", "expected int"],
    ),
    ("cli-wrong-float", None, ["--optimizer.lr", "fast"], ["--optimizer.lr", "expected float"]),
    (
        "cli-wrong-literal",
        None,
        ["--optimizer.implementation", "turbo"],
        ["'turbo'", "one of 'for-loop', 'foreach', 'fused'"],
    ),
    ("cli-optional-wrong", None, ["--debug.seed", "x"], ["--debug.seed", "int or None"]),
    (
        "cli-bad-json-list",
        None,
        ["--parallelism.module_fqns_per_model_part", "[[1]]"],
        ["module_fqns_per_model_part", "list of lists of str"],
    ),
    ("missing-value", None, ["--training.steps"], ["--training.steps expects a value"]),
    (
        "value-is-a-flag",
        None,
        ["--training.steps", "--debug.deterministic"],
        ["--training.steps expects a value"],
    ),
    ("stray-positional", None, ["train.toml"], ["unexpected argument 'train.toml'"]),
    (
        "negative-degree",
        None,
        ["--parallelism.tensor_parallel_degree", "-2"],
        ["parallelism.tensor_parallel_degree must be >= 1, got -2"],
    ),
    (
        "zero-pp-degree",
        None,
        ["--parallelism.pipeline_parallel_degree", "0"],
        ["pipeline_parallel_degree must be >= 1"],
    ),
    (
        "zero-dp-shard",
        None,
        ["--parallelism.data_parallel_shard_degree", "0"],
        ["data_parallel_shard_degree", "-1"],
    ),
    ("zero-steps", None, ["--training.steps", "0"], ["training.steps must be > 0, got 0"]),
    ("zero-batch", None, ["--training.local_batch_size", "0"], ["local_batch_size must be > 0"]),
    ("negative-seq-len", None, ["--training.seq_len", "-5"], ["training.seq_len must be > 0"]),
    ("negative-lr", None, ["--optimizer.lr", "-0.001"], ["optimizer.lr must be >= 0"]),
    (
        "zero-global-batch",
        None,
        ["--training.global_batch_size", "0"],
        ["global_batch_size must be > 0 or -1"],
    ),
    ("warmup-negative", None, ["--lr_scheduler.warmup_steps", "-1"], ["warmup_steps must be >= 0"]),
    ("decay-ratio", None, ["--lr_scheduler.decay_ratio", "2"], ["decay_ratio must be in [0, 1]"]),
    ("min-lr-factor", None, ["--lr_scheduler.min_lr_factor", "1.5"], ["min_lr_factor"]),
    ("profile-freq", None, ["--profiling.profile_freq", "0"], ["profile_freq must be > 0"]),
    ("log-freq", None, ["--metrics.log_freq", "0"], ["log_freq must be > 0"]),
    ("gc-freq", None, ["--training.gc_freq", "0"], ["gc_freq must be > 0"]),
    ("ckpt-interval", None, ["--checkpoint.interval", "0"], ["checkpoint.interval must be > 0"]),
    ("keep-latest-k", None, ["--checkpoint.keep_latest_k", "-3"], ["keep_latest_k must be >= 0"]),
    (
        "selective-ac",
        None,
        ["--activation_checkpoint.selective_ac_option", "every"],
        ["selective_ac_option", "'every'"],
    ),
    (
        "unknown-bundled-config",
        None,
        ["--module", "llama3", "--config", "llama3_9000b"],
        ["unknown config 'llama3_9000b'", "available:"],
    ),
    ("module-without-config", None, ["--module", "llama3"], ["--module needs --config"]),
    (
        "config-file-and-module",
        None,
        ["--job.config_file", "x.toml", "--module", "llama3", "--config", "llama3_8b"],
        ["either --job.config_file or --module/--config"],
    ),
    (  # inf passes lr >= 0; every float setting must be finite
        "infinite-lr",
        None,
        ["--optimizer.lr", "inf"],
        ["optimizer.lr must be a finite number, got inf"],
    ),
    (  # max_norm has no range rule (<= 0 disables clipping), NaN would disable it silently
        "nan-max-norm",
        "[training]\nmax_norm = nan\n",
        ["--job.config_file", "{toml}"],
        ["training.max_norm must be a finite number, got nan"],
    ),
    (
        "custom-module-missing",
        None,
        ["--job.custom_config_module", "no_such_pkg.cfg"],
        ["job.custom_config_module", "no_such_pkg"],
    ),
    (
        "custom-module-no-jobconfig",
        None,
        ["--job.custom_config_module", "json"],
        ["defines no dataclass named JobConfig"],
    ),
]


def _materialise(tmp_path: Path, toml, argv: list[str]) -> list[str]:
    path = tmp_path / "job.toml"
    if isinstance(toml, bytes):
        path.write_bytes(toml)
    elif toml is not None:
        path.write_text(toml)
    return [a.replace("{toml}", str(path)).replace("{dir}", str(tmp_path)) for a in argv]


def test_at_least_twenty_distinct_cases():
    assert len({c[0] for c in CASES}) == len(CASES) >= 20


@pytest.mark.parametrize(
    ("toml", "argv", "needles"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_malformed_input_gives_one_error_line_and_exit_2(
    tmp_path, capsys, monkeypatch, toml, argv, needles
):
    monkeypatch.chdir(tmp_path)
    code = main(_materialise(tmp_path, toml, argv))
    out = capsys.readouterr()
    assert code == 2
    assert out.out == ""
    lines = out.err.splitlines()
    assert len(lines) == 1, out.err
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_parse_args_or_exit_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args_or_exit(["--training.steps", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: training.steps must be > 0, got 0\n"


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


SUBPROCESS_CASES = [
    ("bad-toml", "[training]\nsteps = = 3\n", ["--job.config_file", "{toml}"], "invalid TOML"),
    ("unknown-flag", None, ["--training.stpes", "3"], "did you mean --training.steps"),
    (
        "bool-false",
        None,
        ["--profiling.enable_memory_snapshot=False"],
        "--profiling.no_enable_memory_snapshot",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("toml", "argv", "needle"),
    [c[1:] for c in SUBPROCESS_CASES],
    ids=[c[0] for c in SUBPROCESS_CASES],
)
def test_subprocess_error_is_one_line_without_traceback(tmp_path, toml, argv, needle):
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan.config_manager", *_materialise(tmp_path, toml, argv)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and needle in proc.stderr
    assert "Traceback" not in proc.stderr and "╭" not in proc.stderr


def test_flags_are_parsed_once_without_tyro(monkeypatch):
    """tyro only renders --help: a parse with flags never reaches it, so there is no
    second parser whose errors would need translating."""
    import tyro

    def fail(*args, **kwargs):
        raise AssertionError("tyro.cli called for a parse without --help")

    monkeypatch.setattr(tyro, "cli", fail)
    cfg = ConfigManager().parse_args(
        ["--training.steps", "3", "--profiling.enable_memory_snapshot", "--model.converters=a,b"]
    )
    assert (cfg.training.steps, cfg.model.converters) == (3, ["a", "b"])
    assert cfg.profiling.enable_memory_snapshot is True
    with pytest.raises(ConfigError, match="did you mean --training.steps"):
        ConfigManager().parse_args(["--training.stpes", "3"])


def test_post_init_failure_of_a_flag_is_a_config_error():
    """A custom section's own check (``__post_init__``) also runs for flag values."""
    import dataclasses

    @dataclasses.dataclass
    class Section:
        n: int = 1

        def __post_init__(self):
            if self.n == 13:
                raise ValueError("n must not be 13")

    @dataclasses.dataclass
    class Cfg:
        section: Section = dataclasses.field(default_factory=Section)

    from torchtitan.config.cli import apply_ops

    assert apply_ops(Cfg(), [("set", "section.n", 2)]).section.n == 2
    with pytest.raises(ConfigError, match=r"--section.n: \[section\] n must not be 13"):
        apply_ops(Cfg(), [("set", "section.n", 13)])
