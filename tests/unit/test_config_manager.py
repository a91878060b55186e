"""ConfigManager: precedence, flag syntax, custom configs, save/print, the config tool."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtitan.config import ConfigError, ConfigManager, JobConfig, registry
from torchtitan.config import manager as cm
from torchtitan.config.manager import config_save_path, config_to_toml, main, save_config

REPO = Path(__file__).resolve().parents[2]


def parse(*args: str) -> JobConfig:
    return ConfigManager().parse_args(list(args))


def write(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


DEBUG_TOML = """
[job]
description = "tiny debug job"

[profiling]
enable_memory_snapshot = true
profile_freq = 5

[model]
converters = ["float8"]

[training]
steps = 20
local_batch_size = 4
seq_len = 256

[parallelism]
data_parallel_shard_degree = 2

[training.dataloader]
num_workers = 2
"""


# ------------------------------------------------------------------ precedence


def test_defaults_without_any_flag():
    cfg = parse()
    assert cfg == JobConfig()
    assert cfg.job.config_file is None


def test_toml_overrides_defaults_and_cli_overrides_toml(tmp_path):
    path = write(tmp_path, DEBUG_TOML)
    cfg = parse("--job.config_file", path)
    assert cfg.job.config_file == path
    assert cfg.training.steps == 20
    assert cfg.training.seq_len == 256
    assert cfg.training.dataloader.num_workers == 2
    assert cfg.profiling.enable_memory_snapshot is True
    assert cfg.model.converters == ["float8"]
    assert cfg.training.max_norm == JobConfig().training.max_norm  # untouched default

    cfg = parse(
        f"--job.config_file={path}",
        "--training.steps",
        "7",
        "--training.seq_len=128",
        "--training.dataloader.num_workers",
        "1",
    )
    assert (cfg.training.steps, cfg.training.seq_len) == (7, 128)
    assert cfg.training.dataloader.num_workers == 1
    assert cfg.training.local_batch_size == 4  # from TOML


def test_flag_order_does_not_matter_for_config_file(tmp_path):
    path = write(tmp_path, DEBUG_TOML)
    cfg = parse("--training.steps", "9", "--job.config_file", path)
    assert cfg.training.steps == 9
    assert cfg.training.local_batch_size == 4


def test_last_repeated_flag_wins():
    assert parse("--training.steps", "3", "--training.steps", "4").training.steps == 4


def test_a_second_config_file_or_config_name_warns(caplog):
    """run_train.sh passes CONFIG_FILE as --job.config_file before the user's flags: a second
    one wins, with a warning, as every repeated flag does."""
    debug = str(REPO / "train_configs" / "debug_model.toml")
    qwen = str(REPO / "train_configs" / "qwen3_debugmodel.toml")
    with caplog.at_level("WARNING"):
        cfg = ConfigManager().parse_args(["--job.config_file", debug, f"--job.config_file={qwen}"])
    assert cfg.model.name == "qwen3"
    assert [m for m in caplog.messages if "more than once" in m] == [
        f"--job.config_file is set more than once on the command line (--job.config_file "
        f"{debug}, then --job.config_file {qwen}); the last one is used: {qwen}"
    ]


def test_a_key_set_twice_to_different_values_warns_once(caplog):
    with caplog.at_level("WARNING"):
        cfg = parse(
            "--training.steps", "3", "--training.steps=4",
            "--training.batch_size", "2", "--training.local-batch-size", "5",
            "--compile.enable", "--compile.no_enable",
            "--activation_checkpoint.mode", "none", "--activation_checkpoint.mode", "none",
            "--training.seq_len", "64",
        )  # fmt: skip
    assert (cfg.training.steps, cfg.training.local_batch_size, cfg.compile.enable) == (4, 5, False)
    repeated = [m for m in caplog.messages if "more than once" in m]
    assert repeated == [
        "--training.steps is set more than once on the command line "
        "(--training.steps 3, then --training.steps 4); the last one is used: 4",
        "--training.local_batch_size is set more than once on the command line "
        "(--training.batch_size 2, then --training.local-batch-size 5); the last one is used: 5",
        "--compile.enable is set more than once on the command line "
        "(--compile.enable on, then --compile.no_enable off); the last one is used: off",
    ]


# --------------------------------------------------------------------- booleans


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], True),
        (["--profiling.enable_memory_snapshot"], True),
        (["--profiling.no_enable_memory_snapshot"], False),
        (["--profiling.no-enable-memory-snapshot"], False),
        (["--profiling.no-enable_memory_snapshot"], False),
        (["--profiling.no_enable_memory_snapshot", "--profiling.enable-memory-snapshot"], True),
    ],
)
def test_boolean_actions_override_toml(tmp_path, flags, expected):
    path = write(tmp_path, DEBUG_TOML)
    assert parse("--job.config_file", path, *flags).profiling.enable_memory_snapshot is expected


def test_boolean_default_true_can_be_turned_off():
    cfg = parse("--checkpoint.no_initial_load_model_only")
    assert cfg.checkpoint.initial_load_model_only is False
    assert parse("--checkpoint.initial-load-model-only").checkpoint.initial_load_model_only


@pytest.mark.parametrize("bad", ["=False", "=True", "=false", "=1"])
def test_boolean_with_inline_value_is_rejected(bad):
    with pytest.raises(ConfigError, match="--profiling.no_enable_memory_snapshot"):
        parse(f"--profiling.enable_memory_snapshot{bad}")


@pytest.mark.parametrize("word", ["False", "True", "yes"])
def test_boolean_followed_by_value_is_rejected(word):
    with pytest.raises(ConfigError, match="boolean flag and takes no value"):
        parse("--profiling.enable_memory_snapshot", word)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--model.use_flex_attn"], True),  # bare, last
        (["--model.use_flex_attn", "--training.steps", "3"], True),  # bare, a flag follows
        (["--model.no_use_flex_attn"], False),
        (["--model.use_flex_attn", "False"], False),
        (["--model.use_flex_attn=true"], True),
        (["--model.use_flex_attn", "None"], None),  # back to the flavor's choice
    ],
)
def test_optional_boolean_works_as_a_flag_and_takes_a_value(flags, expected):
    """``bool | None`` (None: the flavor decides) is also a bare flag, as in upstream."""
    assert parse(*flags).model.use_flex_attn is expected


def test_hyphen_and_underscore_spellings_everywhere():
    cfg = parse(
        "--lr-scheduler.warmup-steps",
        "3",
        "--memory-estimation.enable",
        "--activation_checkpoint.mode",
        "full",
        "--training.dataloader.pin-memory",
        "--parallelism.data-parallel-shard-degree=4",
    )
    assert cfg.lr_scheduler.warmup_steps == 3
    assert cfg.memory_estimation.enable is True
    assert cfg.activation_checkpoint.mode == "full"
    assert cfg.training.dataloader.pin_memory is True
    assert cfg.parallelism.data_parallel_shard_degree == 4


# ----------------------------------------------------------- lists, None, types


def test_list_flags_take_one_comma_separated_token():
    cfg = parse(
        "--model.converters",
        "float8,mx",
        "--checkpoint.exclude_from_loading",
        "optimizer,dataloader",
    )
    assert cfg.model.converters == ["float8", "mx"]
    assert cfg.checkpoint.exclude_from_loading == ["optimizer", "dataloader"]
    assert parse("--model.converters=float8").model.converters == ["float8"]
    assert parse("--float8.filter_fqns", "").float8.filter_fqns == []


def test_list_of_lists_json_and_semicolon_forms():
    want = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    cfg = parse("--parallelism.module_fqns_per_model_part", json.dumps(want))
    assert cfg.parallelism.module_fqns_per_model_part == want
    cfg = parse(
        "--parallelism.module_fqns_per_model_part=tok_embeddings,layers.0;layers.1,norm,output"
    )
    assert cfg.parallelism.module_fqns_per_model_part == want


def test_list_of_lists_in_toml(tmp_path):
    path = write(tmp_path, '[parallelism]\nmodule_fqns_per_model_part = [["a", "b"], ["c"]]\n')
    assert parse("--job.config_file", path).parallelism.module_fqns_per_model_part == [
        ["a", "b"],
        ["c"],
    ]


def test_optional_fields_take_a_value_or_None(tmp_path):
    cfg = parse(
        "--debug.seed",
        "42",
        "--lr_scheduler.decay_ratio",
        "0.2",
        "--float8.recipe_name",
        "rowwise",
        "--training.dataset_path",
        "/no/such/data",
    )
    assert cfg.debug.seed == 42
    assert cfg.lr_scheduler.decay_ratio == 0.2
    assert cfg.float8.recipe_name == "rowwise"
    assert cfg.training.dataset_path == "/no/such/data"  # never opened while parsing
    path = write(tmp_path, "[debug]\nseed = 7\n[lr_scheduler]\ndecay_ratio = 0.5\n")
    cfg = parse(
        "--job.config_file", path, "--debug.seed", "None", "--lr_scheduler.decay_ratio=None"
    )
    assert cfg.debug.seed is None and cfg.lr_scheduler.decay_ratio is None
    cfg = parse("--parallelism.pipeline_parallel_schedule_csv", "None")
    assert cfg.parallelism.pipeline_parallel_schedule_csv is None


def test_negative_numbers_as_values():
    cfg = parse("--parallelism.data_parallel_shard_degree", "-1", "--training.max_norm", "-1.5")
    assert cfg.parallelism.data_parallel_shard_degree == -1
    assert cfg.training.max_norm == -1.5


def test_toml_types_are_converted(tmp_path):
    path = write(
        tmp_path,
        "[optimizer]\nlr = 1\n[activation_checkpoint]\nselective_ac_option = 3\n"
        '[checkpoint]\nexclude_from_loading = "optimizer,dataloader"\n',
    )
    cfg = parse("--job.config_file", path)
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.activation_checkpoint.selective_ac_option == "3"
    assert cfg.checkpoint.exclude_from_loading == ["optimizer", "dataloader"]


def test_parsing_never_opens_referenced_files(tmp_path):
    path = write(
        tmp_path,
        '[model]\nhf_assets_path = "/nonexistent/assets"\n'
        'tokenizer_path = "/nonexistent/tok.model"\n'
        '[training]\ndataset_path = "/nonexistent/data.jsonl"\n'
        '[checkpoint]\ninitial_load_path = "/nonexistent/ckpt"\n',
    )
    cfg = parse("--job.config_file", path)
    assert cfg.model.tokenizer_path == "/nonexistent/tok.model"
    assert cfg.checkpoint.initial_load_path == "/nonexistent/ckpt"


# -------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--parallelism.data_parallel_shard_degree", "0"], "data_parallel_shard_degree"),
        (["--parallelism.data_parallel_shard_degree", "-2"], "or -1"),
        (["--parallelism.context_parallel_degree", "0"], "context_parallel_degree must be >= 1"),
        (["--checkpoint.keep_latest_k", "-1"], "keep_latest_k must be >= 0"),
        (["--lr_scheduler.decay_ratio", "1.5"], "decay_ratio must be in [0, 1]"),
        (["--lr_scheduler.min_lr_factor", "-0.1"], "min_lr_factor must be in [0, 1]"),
        (["--validation.steps", "0"], "validation.steps"),
        (["--optimizer.lr", "nan"], "optimizer.lr"),
        (["--training.dataloader.persistent_workers"], "num_workers > 0"),
        (["--activation_checkpoint.selective_ac_option", "0"], "selective_ac_option"),
    ],
)
def test_validation_errors(flags, needle):
    with pytest.raises(ConfigError) as info:
        parse(*flags)
    assert needle in str(info.value)


def test_valid_edge_values_pass():
    cfg = parse(
        "--parallelism.data_parallel_shard_degree",
        "-1",
        "--checkpoint.keep_latest_k",
        "0",
        "--lr_scheduler.decay_ratio",
        "1",
        "--lr_scheduler.warmup_steps",
        "0",
        "--training.global_batch_size",
        "-1",
        "--activation_checkpoint.selective_ac_option",
        "op",
        "--training.dataloader.num_workers",
        "2",
        "--training.dataloader.prefetch_factor",
        "4",
    )
    assert cfg.training.dataloader.prefetch_factor == 4


def test_validation_also_applies_to_toml_values(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 0\n")
    with pytest.raises(ConfigError, match=r"training.steps must be > 0, got 0"):
        parse("--job.config_file", path)


# ---------------------------------------------------------------- custom config


@pytest.mark.parametrize("spelling", ["--job.custom_config_module", "--job.custom-config-module"])
def test_custom_config_module_subclass_cli(spelling):
    cfg = parse(
        spelling,
        "tests.assets.custom_job_config",
        "--custom_section.how_many",
        "9",
        "--custom-section.tags",
        "a,b",
        "--custom_section.verbose",
        "--training.my_knob",
        "0.25",
        "--training.steps",
        "4",
    )
    assert type(cfg).__module__ == "tests.assets.custom_job_config"
    assert isinstance(cfg, JobConfig)
    assert cfg.custom_section.how_many == 9
    assert cfg.custom_section.tags == ["a", "b"]
    assert cfg.custom_section.verbose is True
    assert cfg.training.my_knob == 0.25 and cfg.training.steps == 4
    assert cfg.job.custom_config_module == "tests.assets.custom_job_config"


def test_custom_config_module_from_toml(tmp_path):
    path = write(
        tmp_path,
        '[job]\ncustom_config_module = "tests.assets.custom_job_config"\n'
        "[custom_section]\nhow_many = 5\n[training]\nmy_knob = 0.75\n",
    )
    cfg = parse("--job.config_file", path)
    assert cfg.custom_section.how_many == 5 and cfg.training.my_knob == 0.75
    with pytest.raises(ConfigError, match="did you mean --custom_section.how_many"):
        parse("--job.config_file", path, "--custom_section.how_man", "1")


def test_custom_config_module_merged_like_upstream(tmp_path):
    cfg = parse(
        "--job.custom_config_module",
        "tests.assets.custom_job_config_merge",
        "--widgets.color",
        "red",
        "--training.extra_steps",
        "4",
        "--training.steps",
        "5",
    )
    assert cfg.widgets.color == "red"
    assert (cfg.training.extra_steps, cfg.training.steps) == (4, 5)
    assert isinstance(cfg, JobConfig)


def test_custom_config_module_from_file_path(tmp_path):
    path = REPO / "tests" / "assets" / "custom_job_config_merge.py"
    cfg = parse("--job.custom_config_module", str(path), "--widgets.color", "green")
    assert cfg.widgets.color == "green"


def test_unknown_section_without_custom_module(tmp_path):
    path = write(tmp_path, "[custom_section]\nhow_many = 5\n")
    with pytest.raises(ConfigError, match=r"unknown section \[custom_section\]"):
        parse("--job.config_file", path)


# ------------------------------------------------------------- save / round trip


ROUND_TRIP_FLAGS = [
    "--training.steps",
    "17",
    "--optimizer.lr",
    "3.3e-05",
    "--model.converters",
    "float8,mx",
    "--parallelism.module_fqns_per_model_part",
    "a,b;c",
    "--parallelism.pipeline_parallel_schedule_csv",
    "None",
    "--debug.seed",
    "1234",
    "--job.description",
    'quotes " and \\ and ünïcode',
    "--profiling.enable_memory_snapshot",
    "--checkpoint.no_last_save_model_only",
    "--float8.filter_fqns",
    "",
    "--training.dataloader.num_workers",
    "3",
    "--job.save_config_file",
    "resolved.toml",
]


def _without_config_file(cfg):
    return dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, config_file=None))


@pytest.mark.parametrize("custom", [False, True])
def test_round_trip_saved_config_resolves_identically(tmp_path, custom):
    source = write(tmp_path, DEBUG_TOML)
    extra = (
        [
            "--job.custom_config_module",
            "tests.assets.custom_job_config",
            "--custom_section.tags",
            "x,y",
        ]
        if custom
        else []
    )
    cfg = parse("--job.config_file", source, *ROUND_TRIP_FLAGS, *extra)
    saved = save_config(cfg, tmp_path / "out" / "resolved.toml")
    assert saved.is_file() and not (tmp_path / "out" / "resolved.toml.tmp").exists()
    again = parse("--job.config_file", str(saved))
    assert again.job.config_file == str(saved)
    assert _without_config_file(again) == _without_config_file(cfg)
    assert type(again) is not JobConfig if custom else type(again) is JobConfig
    assert config_to_toml(again) == config_to_toml(cfg)


def test_toml_text_is_readable_and_omits_unset_values():
    text = config_to_toml(parse("--training.steps", "5"))
    assert "\n[training]\n" in text and "\n[training.dataloader]\n" in text
    assert "steps = 5\n" in text
    assert "# seed = None" in text  # unset optional shown as a comment
    assert "\nconfig_file" not in text and "# config_file" not in text
    assert 'pipeline_parallel_schedule_csv = ""' in text


def test_config_save_path():
    assert config_save_path(parse()) is None
    cfg = parse("--job.dump_folder", "/tmp/run1", "--job.save_config_file", "cfg.toml")
    assert config_save_path(cfg) == Path("/tmp/run1/cfg.toml")


# ----------------------------------------------------------------- the CLI tool


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_tool_prints_toml_and_json(capsys, tmp_path):
    path = write(tmp_path, DEBUG_TOML)
    no_float8 = ("--model.converters", "")  # float8 on CPU needs float8.emulate: the tool checks
    code, out, err = run_main(capsys, "--job.config_file", path, "--training.steps", "3", *no_float8)
    assert code == 0 and err == ""
    assert "[training]\n" in out and "steps = 3\n" in out
    code, out, _ = run_main(capsys, "--json", "--job.config_file", path, *no_float8)
    data = json.loads(out)
    assert code == 0
    assert data["training"]["steps"] == 20
    assert data["debug"]["seed"] is None


def test_tool_acceptance_memory_snapshot_forms(capsys):
    debug = REPO / "train_configs" / "debug_model.toml"
    cases = {
        "--profiling.enable_memory_snapshot": "true",
        "--profiling.no_enable_memory_snapshot": "false",
        "--profiling.no-enable-memory-snapshot": "false",
    }
    for flag, want in cases.items():
        code, out, _ = run_main(
            capsys, "--job.config_file", str(debug), "--profiling.enable_memory_snapshot", flag
        )
        assert code == 0
        assert f"\nenable_memory_snapshot = {want}\n" in out
    code, out, err = run_main(
        capsys, "--job.config_file", str(debug), "--profiling.enable_memory_snapshot=False"
    )
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--profiling.no_enable_memory_snapshot" in err


def _docstring(cls_name: str, field: str) -> str:
    tree = ast.parse((REPO / "torchtitan" / "config" / "job_config.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    for a, b in zip(cls.body, cls.body[1:]):
        if isinstance(a, ast.AnnAssign) and a.target.id == field:
            return b.value.value
    raise AssertionError(f"{cls_name}.{field} has no docstring")


@pytest.mark.slow
def test_help_lists_flags_types_defaults_and_docstrings_fast():
    env = dict(os.environ, COLUMNS="250")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan.config_manager", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=30,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 0, proc.stderr
    # CPU time is what --help costs; wall time also counts other jobs sharing the cores.
    assert cpu < 2.0, f"--help used {cpu:.2f}s of CPU"
    assert wall < 10.0, f"--help took {wall:.2f}s"
    out = proc.stdout
    assert "--profiling.enable_memory_snapshot, --profiling.no_enable_memory_snapshot" in out
    assert "--training.steps INT" in out
    assert "--model.converters A,B,..." in out
    assert "--optimizer.implementation {for-loop,foreach,fused}" in out
    assert "--training.dataloader.num_workers INT" in out
    assert "profiling options" in out and "training.dataloader options" in out
    assert _docstring("Profiling", "enable_memory_snapshot")[:40] in out
    assert _docstring("Training", "steps")[:40] in out
    assert "(default: 10000)" in out
    for section in dataclasses.fields(JobConfig):
        assert f"--{section.name}." in out


@pytest.mark.slow
def test_config_manager_module_alias_accepts_module_and_config():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan.config.manager",
            "--module=llama3",
            "--config=llama3_debugmodel",
            "--training.steps",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no runpy double-import warning
    data = json.loads(proc.stdout)
    assert data["training"]["steps"] == 2
    assert data["job"]["config_file"] == str(REPO / "train_configs" / "debug_model.toml")


# --------------------------------------------------------------------- registry


@pytest.mark.parametrize(
    ("module", "config", "file"),
    [
        ("llama3", "llama3_debugmodel", "debug_model.toml"),
        ("llama3", "llama3_8b", "llama3_8b.toml"),
        ("llama3", "llama3_70b", "llama3_70b.toml"),
        ("llama3", "llama3_405b", "llama3_405b.toml"),
        ("llama2", "llama2_7b", "llama2_7b.toml"),
        ("llama2", "llama2_13b", "llama2_13b.toml"),
        ("llama3", "llama2_70b", "llama2_70b.toml"),
        ("llama4", "llama4_debugmodel", "debug_model.toml"),
        (None, "llama3_8b", "llama3_8b.toml"),
    ],
)
def test_registry_maps_names_to_train_configs(module, config, file):
    assert registry.CONFIG_DIR == REPO / "train_configs"
    assert registry.config_path(module, config) == REPO / "train_configs" / file


def test_registry_unknown_name_lists_available(tmp_path):
    (tmp_path / "debug_model.toml").write_text("")
    (tmp_path / "llama3_8b.toml").write_text("")
    assert registry.available_configs("llama3", tmp_path) == ["llama3_8b", "llama3_debugmodel"]
    assert registry.resolve_config("llama3", "llama3_8b", tmp_path) == tmp_path / "llama3_8b.toml"
    with pytest.raises(ConfigError, match="available: llama3_8b, llama3_debugmodel"):
        registry.resolve_config("llama3", "llama3_9b", tmp_path)
    with pytest.raises(ConfigError, match="invalid config name"):
        registry.config_path("llama3", "../etc/passwd")


def test_registry_family_debug_config_preferred(tmp_path):
    (tmp_path / "debug_model.toml").write_text("")
    assert registry.config_path("qwen9", "qwen9_debugmodel", tmp_path) == tmp_path / "debug_model.toml"
    (tmp_path / "qwen9_debugmodel.toml").write_text('[model]\nname = "qwen9"\n')
    assert registry.config_path("qwen9", "qwen9_debugmodel", tmp_path) == (
        tmp_path / "qwen9_debugmodel.toml"
    )
    assert registry.config_path("llama3", "llama3_debugmodel", tmp_path) == (
        tmp_path / "debug_model.toml"
    )
    assert "qwen9_debugmodel" in registry.available_configs("qwen9", tmp_path)


@pytest.mark.parametrize("argv, message", [
    (["--module", "qwen3", "--config", "llama3_8b"],
     "--module qwen3 --config llama3_8b: llama3_8b.toml trains model.name='llama3', not 'qwen3'; "
     "qwen3's configs: qwen3_debugmodel, qwen3_debugmodel_moe (or --module llama3)"),
    (["--module", "nosuch", "--config", "nosuch_debugmodel"],
     "--module 'nosuch' is neither a model family (llama3, llama2, qwen3, deepseek_v3, gpt_oss) "
     "nor an importable module of config functions"),
])
def test_a_module_and_a_config_of_another_family_are_refused(capsys, argv, message):
    """``MODULE=qwen3 CONFIG=llama3_8b`` (or a module that does not exist) trained Llama 3."""
    assert main(argv) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("module", ["qwen3", "deepseek_v3", "gpt_oss", "llama3"])
def test_debugmodel_of_a_module_is_its_own_debug_config(capsys, module):
    """``--module qwen3 --config debugmodel`` gave Llama 3's debug config."""
    assert main(["--module", module, "--config", "debugmodel"]) == 0
    assert f'\nname = "{module}"\n' in capsys.readouterr().out


def test_registry_register_config(tmp_path):
    (tmp_path / "special.toml").write_text("[training]\nsteps = 2\n")
    registry.register_config("mymodel", "mymodel_special", "special.toml")
    try:
        assert registry.resolve_config("mymodel", "mymodel_special", tmp_path) == (
            tmp_path / "special.toml"
        )
    finally:
        registry._EXPLICIT.pop(("mymodel", "mymodel_special"))


def test_module_config_flags_resolve_through_registry(tmp_path, monkeypatch):
    (tmp_path / "debug_model.toml").write_text("[training]\nsteps = 3\n")
    monkeypatch.setattr(registry, "CONFIG_DIR", tmp_path)
    cfg = parse("--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "64")
    assert cfg.job.config_file == str(tmp_path / "debug_model.toml")
    assert (cfg.training.steps, cfg.training.seq_len) == (3, 64)
    cfg = parse("--module=llama3", "--config=llama3_debugmodel")
    assert cfg.training.steps == 3


def test_help_via_parse_args_exits_zero(capsys):
    with pytest.raises(SystemExit) as info:
        ConfigManager(prog="prog").parse_args(["--help"])
    assert info.value.code == 0
    assert "--training.steps" in capsys.readouterr().out


def test_manager_keeps_last_config():
    manager = ConfigManager()
    cfg = manager.parse_args(["--training.steps", "3"])
    assert manager.config is cfg
    assert cm.validate(cfg) is None


def test_help_shows_defaults_from_the_selected_config(capsys, tmp_path, monkeypatch):
    (tmp_path / "debug_model.toml").write_text("[training]\nsteps = 37\n")
    monkeypatch.setattr(registry, "CONFIG_DIR", tmp_path)
    code = main(["--module", "llama3", "--config", "llama3_debugmodel", "--help"])
    out = capsys.readouterr().out
    assert code == 0
    assert "(default: 37)" in out and "--training.steps" in out


@pytest.mark.parametrize("path, model, flavor", [
    ("torchtitan/models/deepseek_v3/train_configs/debug_model.toml", "deepseek_v3", "debugmodel"),
    ("torchtitan/models/deepseek_v3/train_configs/deepseek_v3_671b.toml", "deepseek_v3", "671B"),
    ("torchtitan/models/qwen3/train_configs/qwen3_debugmodel_moe.toml", "qwen3", "debugmodel_moe"),
])
def test_upstream_per_family_config_paths(path, model, flavor):
    """Upstream's READMEs point CONFIG_FILE at torchtitan/models/<family>/train_configs/."""
    from torchtitan.config.manager import ConfigManager

    root = Path(__file__).resolve().parents[2]
    cfg = ConfigManager().parse_args(["--job.config_file", str(root / path)])
    assert (cfg.model.name, cfg.model.flavor) == (model, flavor)


def test_an_empty_toml_warns_that_it_sets_nothing(tmp_path, caplog):
    """A config file that parses to nothing (emptied by a failed write, a wrong file) runs on
    the defaults, and says so; a real config does not."""
    empty = tmp_path / "empty.toml"
    empty.write_text("# nothing here yet\n")
    with caplog.at_level("WARNING"):
        cfg = ConfigManager().parse_args(["--job.config_file", str(empty)])
    assert cfg.training.steps == JobConfig().training.steps
    assert [m for m in caplog.messages if "sets nothing" in m] == [
        f"{empty} sets nothing (an empty TOML): every setting not given as a flag is its default"]
    caplog.clear()
    with caplog.at_level("WARNING"):
        ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml")])
    assert not [m for m in caplog.messages if "sets nothing" in m]
