"""Planned-but-unimplemented settings: their keys still load, a non-default value is refused
(one ``error:`` line, exit 2) by programs that run a job; the config tool still prints them."""

from __future__ import annotations

import subprocess
import sys
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


def test_defaults_use_no_planned_feature():
    assert planned_settings(JobConfig()) == []
    reject_planned_settings(JobConfig())


def test_one_clear_line_naming_key_value_and_feature():
    cfg = parse("--optimizer.early_step_in_backward")
    with pytest.raises(ConfigError) as info:
        reject_planned_settings(cfg)
    assert str(info.value) == (
        "optimizer.early_step_in_backward=True is planned but not implemented yet (optimizer "
        "steps in backward); remove it or leave the default"
    )


def test_several_planned_settings_are_named_in_the_same_line(monkeypatch):
    from torchtitan.config import planned

    monkeypatch.setitem(planned.PLANNED_FIELDS, "training.gc_debug", "a second planned area")
    cfg = parse("--optimizer.early_step_in_backward", "--training.gc_debug")
    with pytest.raises(ConfigError) as info:
        reject_planned_settings(cfg)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "optimizer.early_step_in_backward=True is planned but not implemented"
    )
    assert message.endswith("(also planned: training.gc_debug=True)")


@pytest.mark.parametrize("key", sorted(PLANNED_FIELDS))
def test_planned_key_loads_from_toml_and_the_trainer_entry_refuses_it(tmp_path, capsys, key):
    section, _, name = key.rpartition(".")
    value = non_default(key)
    path = tmp_path / "job.toml"
    path.write_text(f"[{section}]\n{name} = {toml_value(value)}\n")
    cfg = parse("--job.config_file", str(path))  # the key still loads
    assert planned_settings(cfg) == [(key, value, PLANNED_FIELDS[key])]
    with pytest.raises(SystemExit) as info:
        parse_args_or_exit(["--job.config_file", str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {key}=")
    assert f"({PLANNED_FIELDS[key]}); remove it or leave the default" in err[0]


def test_planned_keys_at_their_default_are_accepted(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(
        '[float8]\nenable_fsdp_float8_all_gather = false\nfilter_fqns = ["output"]\n'
        "[optimizer]\nearly_step_in_backward = false\n"
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


def test_config_tool_refuses_a_config_with_planned_settings(capsys, tmp_path):
    """The tool checks like the trainer: a config the trainer refuses is not printed."""
    path = tmp_path / "planned.toml"
    path.write_text("[optimizer]\nearly_step_in_backward = true\n")
    code = main(["--job.config_file", str(path)])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err.splitlines() == [
        "error: optimizer.early_step_in_backward=True is planned but not implemented yet "
        "(optimizer steps in backward); remove it or leave the default"
    ]


def test_trainer_entry_accepts_the_405b_config_now_that_float8_is_built():
    cfg = parse_args_or_exit(["--job.config_file", str(REPO / "train_configs" / "llama3_405b.toml")])
    assert cfg.model.converters == ["float8"] and cfg.float8.enable_fsdp_float8_all_gather


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--optimizer.early_step_in_backward"], "optimizer.early_step_in_backward=True is"),
    ],
)
def test_train_command_refuses_planned_settings(argv, needle):
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan.train", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
