"""Configs and flags written for older torchtitan schemas load, with one warning per key."""

from __future__ import annotations

import dataclasses
import logging
import re
import typing
from pathlib import Path

import pytest

from torchtitan.config import ConfigError, ConfigManager, JobConfig, legacy
from torchtitan.config.cli import parse_flags
from torchtitan.config.fields import get_field, leaf_fields

FIELDS = leaf_fields(JobConfig)
SPECIAL_VALUES = {"job.custom_config_module": "tests.assets.custom_job_config"}


def parse(*args: str):
    return ConfigManager().parse_args(list(args))


def write(tmp_path, text: str) -> str:
    path = tmp_path / "old.toml"
    path.write_text(text)
    return str(path)


def toml_literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    return repr(value)


def sample(key: str):
    """A valid, non-default value for the field ``key``."""
    if key in SPECIAL_VALUES:
        return SPECIAL_VALUES[key]
    tp = FIELDS[key].tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, type(int | None)) and len(args) == 1:
        tp = args[0]
    default = get_field(JobConfig(), key)
    if tp is bool:
        return not default
    if tp is int:
        return 3
    if tp is float:
        return 0.25
    if tp is str:
        return "abc"
    if typing.get_origin(tp) is typing.Literal:
        return next(c for c in reversed(typing.get_args(tp)) if c != default)
    if typing.get_origin(tp) is list:
        return ["a", "b"]
    raise AssertionError(f"no sample for {key}: {tp}")


def cli_tokens(flag: str, value) -> list[str]:
    section, _, name = flag.rpartition(".")
    if isinstance(value, bool):
        return [f"--{flag}"] if value else [f"--{section}.no_{name}"]
    if isinstance(value, list):
        return [f"--{flag}", ",".join(value)]
    return [f"--{flag}", str(value)]


def toml_doc(key: str, value) -> str:
    section, _, name = key.rpartition(".")
    return f"[{section}]\n{name} = {toml_literal(value)}\n"


RENAMES = [r for r in legacy.RULES if r.transform is None and r.new is not None]
DROPPED = [r for r in legacy.RULES if r.new is None]


def warnings_text(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_every_rename_targets_a_real_field():
    for rule in legacy.RULES:
        if rule.new is not None:
            assert rule.new in FIELDS, rule
        assert rule.old not in FIELDS, f"{rule.old} is still a field; it cannot be legacy"


@pytest.mark.parametrize("rule", RENAMES, ids=[r.old for r in RENAMES])
def test_renamed_key_in_toml(tmp_path, caplog, rule):
    value = sample(rule.new)
    path = write(tmp_path, toml_doc(rule.old, value))
    with caplog.at_level(logging.WARNING):
        cfg = parse("--job.config_file", path)
    assert get_field(cfg, rule.new) == value
    lines = [m for m in warnings_text(caplog) if rule.old in m]
    assert len(lines) == 1 and rule.new in lines[0] and "\n" not in lines[0]


def _rounds(rules: list[legacy.Rule]) -> list[list[legacy.Rule]]:
    """Split rules into groups with distinct new keys, so each group fits in one command line."""
    rounds: list[list[legacy.Rule]] = []
    for rule in rules:
        for group in rounds:
            if all(r.new != rule.new for r in group):
                group.append(rule)
                break
        else:
            rounds.append([rule])
    return rounds


@pytest.mark.parametrize("group", _rounds(RENAMES), ids=lambda g: f"{len(g)}-flags")
def test_renamed_flags_on_cli(caplog, group):
    tokens = [t for rule in group for t in cli_tokens(rule.old, sample(rule.new))]
    with caplog.at_level(logging.WARNING):
        cfg = parse(*tokens)
    messages = warnings_text(caplog)
    for rule in group:
        assert get_field(cfg, rule.new) == sample(rule.new), rule.old
        assert any(f"--{rule.old}" in m and f"--{rule.new}" in m for m in messages), rule.old


def _dropped_key(rule: legacy.Rule) -> str:
    return rule.old[:-2] + ".linear.nvfp4.recipe_name" if rule.old.endswith(".*") else rule.old


@pytest.mark.parametrize("rule", DROPPED, ids=[r.old for r in DROPPED])
def test_dropped_key_in_toml_is_ignored_with_warning(tmp_path, caplog, rule):
    key = _dropped_key(rule)
    value = True if rule.flag_kind == "bool" else "something"
    value = getattr(rule.transform, "accepted", value)  # only upstream's default is dropped
    path = write(tmp_path, toml_doc(key, value) + "[comm]\ntrace_buf_size = 4\n")
    with caplog.at_level(logging.WARNING):
        cfg = parse("--job.config_file", path)
    assert cfg.comm.trace_buf_size == 4
    assert _without_file(cfg) == _without_file(
        parse("--job.config_file", write(tmp_path, "[comm]\ntrace_buf_size = 4\n"))
    )
    assert any(key in m and "ignored" in m for m in warnings_text(caplog))


def test_dropped_flags_on_cli_are_ignored_with_warning(caplog):
    tokens = []
    for rule in DROPPED:
        key = _dropped_key(rule)
        if hasattr(rule.transform, "accepted"):  # only upstream's default is dropped
            tokens += [f"--{key}", str(rule.transform.accepted).lower()]
        else:
            tokens += [f"--{key}"] if rule.flag_kind == "bool" else [f"--{key}", "something"]
    with caplog.at_level(logging.WARNING):
        cfg = parse(*tokens, "--training.steps", "4")
    assert _without_file(cfg) == _without_file(parse("--training.steps", "4"))
    messages = warnings_text(caplog)
    for rule in DROPPED:
        key = _dropped_key(rule)
        assert any(f"--{key}" in m and "ignored" in m for m in messages), key


@pytest.mark.parametrize(
    ("tokens", "toml", "message"),
    [
        (["--parallelism.expert_parallel_comm_backend", "deepep"],
         '[parallelism]\nexpert_parallel_comm_backend = "deepep"\n',
         "parallelism.expert_parallel_comm_backend='deepep' is not built in (tokens travel by the "
         "standard all-to-all); remove it or set 'standard'"),
        (["--parallelism.pipeline_parallel_expert_parallel_overlap"],
         "[parallelism]\npipeline_parallel_expert_parallel_overlap = true\n",
         "parallelism.pipeline_parallel_expert_parallel_overlap=True is not built in"),
    ],
)
def test_upstream_features_this_build_lacks_are_refused_when_set(tmp_path, tokens, toml, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(*tokens)
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse("--job.config_file", write(tmp_path, toml))


def _without_file(cfg):
    return dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, config_file=None))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("metrics.rank_0_only", "metrics.save_for_all_ranks"),
        ("metrics.enable_color_printing", "metrics.disable_color_printing"),
        ("training.enable_loss_parallel", "parallelism.disable_loss_parallel"),
    ],
)
@pytest.mark.parametrize("value", [True, False])
def test_inverted_keys(tmp_path, caplog, old, new, value):
    cfg = parse("--job.config_file", write(tmp_path, toml_doc(old, value)))
    assert get_field(cfg, new) is (not value)
    cfg = parse(*cli_tokens(old, value))
    assert get_field(cfg, new) is (not value)
    assert any("opposite" in m for m in warnings_text(caplog))


@pytest.mark.parametrize(("value", "impl"), [(True, "fused"), (False, "foreach")])
def test_optimizer_fused(tmp_path, value, impl):
    assert (
        parse(
            "--job.config_file", write(tmp_path, toml_doc("optimizer.fused", value))
        ).optimizer.implementation
        == impl
    )
    assert parse(*cli_tokens("optimizer.fused", value)).optimizer.implementation == impl


@pytest.mark.parametrize(
    ("doc", "converters"),
    [
        ("[float8]\nenable_float8_linear = true\n", ["float8"]),
        ("[float8]\nenable_float8_linear = false\n", []),
        ('[model]\nconverters = ["mx"]\n[float8]\nenable_float8_linear = true\n', ["mx", "float8"]),
        ('[model]\nconverters = ["float8"]\n[float8]\nenable_float8_linear = true\n', ["float8"]),
        ("[training]\nenable_float8_linear = true\n", ["float8"]),
        ("[training]\nenable_fp8_linear = true\n", ["float8"]),
        ('[training]\nfp8_linear = "dynamic"\n', ["float8"]),
        ('[training]\nfp8_linear = ""\n', []),
    ],
)
def test_old_float8_switches_become_a_converter(tmp_path, doc, converters):
    assert parse("--job.config_file", write(tmp_path, doc)).model.converters == converters


def test_float8_flag_appends_to_cli_and_toml_converters(tmp_path):
    path = write(tmp_path, '[model]\nconverters = ["mx"]\n')
    cfg = parse("--job.config_file", path, "--float8.enable_float8_linear")
    assert cfg.model.converters == ["mx", "float8"]
    cfg = parse("--model.converters", "a", "--float8.enable_float8_linear")
    assert cfg.model.converters == ["a", "float8"]
    assert parse("--float8.no_enable_float8_linear").model.converters == []


def test_newer_quantize_section_maps_to_float8(tmp_path, caplog):
    doc = (
        '[quantize.linear.float8]\nrecipe_name = "rowwise"\nfilter_fqns = ["output", "x"]\n'
        '[quantize.grouped_mm.float8]\nfqns = ["experts"]\n'
        '[quantize.linear.mx]\nrecipe_name = "mxfp8_cublas"\nfilter_fqns = ["output", "y"]\n'
        'mxfp8_dim1_cast_kernel_choice = "cuda"\n'
        '[quantize.grouped_mm.mx]\nfqns = ["experts"]\nrecipe_name = "mxfp8"\n'
        '[quantize.future]\nsetting = 1\n'
    )
    with caplog.at_level(logging.WARNING):
        cfg = parse("--job.config_file", write(tmp_path, doc))
    assert cfg.float8.recipe_name == "rowwise"
    assert cfg.float8.filter_fqns == ["output", "x"]
    assert cfg.float8.moe_fqns_prototype == ["experts"]
    assert cfg.mx.recipe_name == "mxfp8_cublas"  # upstream's name: the mx converter maps it
    assert cfg.mx.filter_fqns == ["output", "y"]
    assert cfg.mx.moe_fqns_prototype == ["experts"]
    warned = warnings_text(caplog)
    for key in ("quantize.linear.mx.mxfp8_dim1_cast_kernel_choice",
                "quantize.grouped_mm.mx.recipe_name", "quantize.future.setting"):
        assert any(key in m and "ignored" in m for m in warned), (key, warned)


def test_new_key_wins_over_old_key(tmp_path, caplog):
    doc = "[training]\nbatch_size = 2\nlocal_batch_size = 5\n"
    with caplog.at_level(logging.WARNING):
        cfg = parse("--job.config_file", write(tmp_path, doc))
    assert cfg.training.local_batch_size == 5
    assert any("training.batch_size" in m and "also set" in m for m in warnings_text(caplog))


def test_cli_overrides_legacy_toml_value(tmp_path):
    path = write(tmp_path, "[training]\nbatch_size = 2\n")
    assert (
        parse(
            "--job.config_file", path, "--training.local_batch_size", "6"
        ).training.local_batch_size
        == 6
    )
    assert (
        parse("--job.config_file", path, "--training.batch_size", "7").training.local_batch_size
        == 7
    )


def test_tokenizer_path_still_works_but_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = parse("--job.config_file", write(tmp_path, '[model]\ntokenizer_path = "t.model"\n'))
        cfg2 = parse("--model.tokenizer_path", "u.model")
    assert (cfg.model.tokenizer_path, cfg2.model.tokenizer_path) == ("t.model", "u.model")
    msgs = warnings_text(caplog)
    assert sum("model.tokenizer_path" in m and "hf_assets_path" in m for m in msgs) == 2


def test_custom_args_module_is_the_old_custom_config_module(tmp_path):
    path = write(
        tmp_path,
        '[experimental]\ncustom_args_module = "tests.assets.custom_job_config"\n'
        "[custom_section]\nhow_many = 8\n",
    )
    cfg = parse("--job.config_file", path)
    assert cfg.custom_section.how_many == 8
    assert cfg.job.custom_config_module == "tests.assets.custom_job_config"


def test_legacy_bool_flags_reject_values():
    with pytest.raises(ConfigError, match="--checkpoint.no_enable_checkpoint"):
        parse("--checkpoint.enable_checkpoint=False")


def test_legacy_value_checked_against_new_type():
    with pytest.raises(ConfigError, match="expected int"):
        parse("--training.batch_size", "eight")


def test_unknown_key_is_still_an_error_in_an_old_section(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'pipeline_parallel_degre'"):
        parse("--job.config_file", write(tmp_path, "[experimental]\npipeline_parallel_degre = 2\n"))


def test_table_lists_every_rule():
    rows = legacy.table()
    assert len(rows) == len(legacy.RULES)
    assert ("checkpoint.interval_type", "(dropped)") in [(a, b) for a, b, _ in rows]


# The CLI argument table of a 2024-era torchtitan README, fed in row by row.
README_2024_FLAGS = [
    ("--job.config_file", "str"),
    ("--job.dump_folder", "str"),
    ("--job.description", "str"),
    ("--job.use_for_integration_test", "store_true"),
    ("--profiling.enable_profiling", "store_true"),
    ("--profiling.save_traces_folder", "str"),
    ("--profiling.profile_freq", "int"),
    ("--profiling.enable_memory_snapshot", "store_true"),
    ("--profiling.save_memory_snapshot_folder", "str"),
    ("--metrics.log_freq", "int"),
    ("--metrics.enable_color_printing", "store_true"),
    ("--metrics.enable_tensorboard", "store_true"),
    ("--metrics.save_tb_folder", "str"),
    ("--metrics.rank_0_only", "store_true"),
    ("--model.name", "str"),
    ("--model.flavor", "str"),
    ("--model.norm_type", "str"),
    ("--model.tokenizer_path", "str"),
    ("--optimizer.name", "str"),
    ("--optimizer.lr", "float"),
    ("--optimizer.fused", "store_true"),
    ("--training.dataset", "str"),
    ("--training.dataset_path", "str"),
    ("--training.batch_size", "int"),
    ("--training.seq_len", "int"),
    ("--training.warmup_steps", "int"),
    ("--training.max_norm", "Union[float, int]"),
    ("--training.steps", "int"),
    ("--training.data_parallel_replicate_degree", "int"),
    ("--training.data_parallel_shard_degree", "int"),
    ("--training.enable_cpu_offload", "bool"),
    ("--training.tensor_parallel_degree", "int"),
    ("--training.enable_loss_parallel", "store_true"),
    ("--experimental.enable_async_tensor_parallel", "store_true"),
    ("--checkpoint.enable_checkpoint", "store_true"),
    ("--checkpoint.folder", "str"),
    ("--checkpoint.interval_type", "str"),
    ("--checkpoint.interval", "int"),
    ("--checkpoint.model_weights_only", "store_true"),
    ("--memory_estimation.enabled", "store_true"),
    ("--memory_estimation.disable_fake_mode", "store_true"),
]
SAMPLE_BY_TYPE = {"str": "AdamW", "int": "2", "float": "0.001", "Union[float, int]": "1.0"}


@pytest.mark.parametrize(
    ("flag", "kind"), README_2024_FLAGS[1:], ids=[f for f, _ in README_2024_FLAGS[1:]]
)
def test_2024_readme_flag_table_each_flag_is_accepted(flag, kind):
    """Each row on its own passes flag validation."""
    tokens = [flag] if kind in ("store_true", "bool") else [flag, SAMPLE_BY_TYPE[kind]]
    ops = parse_flags(tokens, FIELDS)
    dropped = flag in ("--model.norm_type", "--checkpoint.interval_type")
    assert (ops == []) is dropped
    assert all(key in FIELDS for _, key, _ in ops)


def test_2024_readme_flags_all_together(tmp_path):
    tokens = []
    for flag, kind in README_2024_FLAGS[1:]:
        tokens += [flag] if kind in ("store_true", "bool") else [flag, SAMPLE_BY_TYPE[kind]]
    cfg = parse("--job.config_file", write(tmp_path, "[training]\nsteps = 5\n"), *tokens)
    assert cfg.training.local_batch_size == 2 and cfg.lr_scheduler.warmup_steps == 2
    assert cfg.parallelism.tensor_parallel_degree == 2
    assert cfg.metrics.save_for_all_ranks is False and cfg.metrics.disable_color_printing is False
    assert cfg.optimizer.implementation == "fused"
    assert cfg.parallelism.disable_loss_parallel is False
    assert cfg.checkpoint.enable and cfg.checkpoint.last_save_model_only
    assert cfg.memory_estimation.enable and cfg.training.enable_cpu_offload


def test_docs_list_every_legacy_key():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    missing = [r.old for r in legacy.RULES if f"| `{r.old}` |" not in docs]
    assert not missing, f"docs/config.md lacks legacy keys: {missing}"
