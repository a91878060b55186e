"""Planned-but-unimplemented settings: their keys still load, a non-default value is refused
(one ``error:`` line, exit 2) by programs that run a job; the config tool still prints them."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from torchtitan.config import ConfigError, ConfigManager, JobConfig, reject_planned_settings
from torchtitan.config.fields import field_default, leaf_fields, split_optional
from torchtitan.config.manager import main, parse_args_or_exit
from torchtitan.config.planned import PLANNED_FIELDS, planned_settings

REPO = Path(__file__).resolve().parents[2]
BUNDLED = sorted((REPO / "train_configs").glob("*.toml"))
USES_PLANNED: set[str] = set()  # bundled configs that set a planned field
ERA_2024_TOMLS = sorted((REPO / "tests" / "assets" / "legacy_2024_configs").glob("*.toml"))
assert ERA_2024_TOMLS, "tests/assets/legacy_2024_configs/ holds the 2024-era TOML fixtures"
FIELDS = leaf_fields(JobConfig)


def non_default(key: str):
    """Some valid value other than the default for planned field ``key``."""
    default = field_default(JobConfig, key)
    tp, _ = split_optional(FIELDS[key].tp)
    if tp is bool:
        return not default
    if tp is int:
        return default + 1
    if tp is float:
        return default / 2 if default else 0.25
    if typing.get_origin(tp) is typing.Literal:
        return next(c for c in typing.get_args(tp) if c != default)
    if typing.get_origin(tp) is list:
        return ["planned_fqn"]
    return "planned_value"


def toml_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(f'"{v}"' for v in value) + "]"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def parse(*args: str) -> JobConfig:
    return ConfigManager().parse_args(list(args))


PLANNED_KEY, PLANNED_AREA = "training.gc_debug", "a planned area"
"""Every planned feature is built today: the tests plant one to check the mechanism."""


@pytest.fixture
def planned(monkeypatch):
    from torchtitan.config import planned as planned_module

    monkeypatch.setitem(planned_module.PLANNED_FIELDS, PLANNED_KEY, PLANNED_AREA)
    return planned_module.PLANNED_FIELDS


def test_defaults_use_no_planned_feature(planned):
    assert planned_settings(JobConfig()) == []
    reject_planned_settings(JobConfig())


def test_nothing_is_planned_now():
    """An entry here is a key that loads but whose feature is refused; none is left."""
    assert PLANNED_FIELDS == {}


def test_one_clear_line_naming_key_value_and_feature(planned):
    cfg = parse("--training.gc_debug")
    with pytest.raises(ConfigError) as info:
        reject_planned_settings(cfg)
    assert str(info.value) == (
        "training.gc_debug=True is planned but not implemented yet (a planned area); remove it "
        "or leave the default"
    )


def test_several_planned_settings_are_named_in_the_same_line(planned, monkeypatch):
    monkeypatch.setitem(planned, "debug.deterministic", "a second planned area")
    cfg = parse("--training.gc_debug", "--debug.deterministic")
    with pytest.raises(ConfigError) as info:
        reject_planned_settings(cfg)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("training.gc_debug=True is planned but not implemented")
    assert message.endswith("(also planned: debug.deterministic=True)")


def test_planned_key_loads_from_toml_and_the_trainer_entry_refuses_it(tmp_path, capsys, planned):
    key = PLANNED_KEY
    section, _, name = key.rpartition(".")
    value = non_default(key)
    path = tmp_path / "job.toml"
    path.write_text(f"[{section}]\n{name} = {toml_value(value)}\n")
    cfg = parse("--job.config_file", str(path))  # the key still loads
    assert planned_settings(cfg) == [(key, value, PLANNED_AREA)]
    with pytest.raises(SystemExit) as info:
        parse_args_or_exit(["--job.config_file", str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {key}=")
    assert f"({PLANNED_AREA}); remove it or leave the default" in err[0]


def test_planned_keys_at_their_default_are_accepted(tmp_path, planned):
    path = tmp_path / "job.toml"
    path.write_text(
        '[float8]\nenable_fsdp_float8_all_gather = false\nfilter_fqns = ["output"]\n'
        "[training]\ngc_debug = false\n"
    )
    cfg = parse_args_or_exit(["--job.config_file", str(path)])
    assert cfg.float8.filter_fqns == ["output"]


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.name)
def test_bundled_configs_and_planned_settings(path):
    cfg = parse("--job.config_file", str(path))
    found = [key for key, _, _ in planned_settings(cfg)]
    assert bool(found) is (path.name in USES_PLANNED), found


@pytest.mark.parametrize("path", ERA_2024_TOMLS, ids=lambda p: p.name)
def test_2024_era_tomls_pass_the_trainer_entry(path):
    cfg = parse_args_or_exit(["--job.config_file", str(path)])
    assert cfg.model.converters == []


def test_config_tool_refuses_a_config_with_planned_settings(capsys, tmp_path, planned):
    """The tool checks like the trainer: a config the trainer refuses is not printed."""
    path = tmp_path / "planned.toml"
    path.write_text("[training]\ngc_debug = true\n")
    code = main(["--job.config_file", str(path)])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err.splitlines() == [
        "error: training.gc_debug=True is planned but not implemented yet (a planned area); "
        "remove it or leave the default"
    ]


def test_trainer_entry_accepts_the_405b_config_now_that_float8_is_built():
    cfg = parse_args_or_exit(["--job.config_file", str(REPO / "train_configs" / "llama3_405b.toml")])
    assert cfg.model.converters == ["float8"] and cfg.float8.enable_fsdp_float8_all_gather
