"""Every bundled TOML in train_configs/ uses only the current JobConfig schema, with valid types."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path

import pytest

from torchtitan.config.job_config import JobConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "train_configs"
LINKED_DIR = REPO / "torchtitan" / "models" / "llama3" / "train_configs"
EXPECTED = {
    "debug_model.toml": ("llama3", "debugmodel"),
    "llama3_8b.toml": ("llama3", "8B"),
    "llama3_70b.toml": ("llama3", "70B"),
    "llama3_405b.toml": ("llama3", "405B"),
    "llama2_7b.toml": ("llama2", "7B"),
    "llama2_13b.toml": ("llama2", "13B"),
    "llama2_70b.toml": ("llama2", "70B"),
}
CONFIGS = sorted(CONFIG_DIR.glob("*.toml"))


def _type_ok(tp, value) -> bool:
    """Whether a TOML value fits a (resolved) dataclass field type."""
    origin = typing.get_origin(tp)
    if tp is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(arg, value) for arg in typing.get_args(tp))
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin is list:
        (item,) = typing.get_args(tp) or (typing.Any,)
        return isinstance(value, list) and all(_type_ok(item, v) for v in value)
    if tp is type(None):
        return False  # TOML has no null
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def schema_errors(table: dict, cls: type, where: str = "") -> list[str]:
    """Unknown sections/keys and type mismatches of a TOML table against a dataclass."""
    errors = []
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in table.items():
        name = f"{where}{key}"
        if key not in fields:
            errors.append(f"unknown key '{name}' (valid: {', '.join(sorted(fields))})")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                errors.append(f"'{name}' must be a [section], got {value!r}")
            else:
                errors.extend(schema_errors(value, tp, f"{name}."))
        elif not _type_ok(tp, value):
            errors.append(f"'{name}' = {value!r} does not fit type {tp}")
    return errors


def test_bundled_set_is_complete():
    assert {p.name for p in CONFIGS} >= set(EXPECTED)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_matches_schema(path):
    with open(path, "rb") as f:
        data = tomllib.load(f)
    assert schema_errors(data, JobConfig) == []
    if path.name in EXPECTED:
        assert (data["model"]["name"], data["model"]["flavor"]) == EXPECTED[path.name]


def test_schema_check_catches_typos_and_bad_types():
    data = {
        "training": {"stesp": 10, "seq_len": "2048", "dataloader": {"num_workers": 1.5}},
        "activation_checkpoint": {"mode": "some"},
        "bogus": {},
    }
    errors = schema_errors(data, JobConfig)
    assert len(errors) == 5, errors
    assert errors[0].startswith("unknown key 'training.stesp'")
    assert "'training.seq_len' = '2048'" in errors[1]
    assert "'training.dataloader.num_workers' = 1.5" in errors[2]
    assert "'activation_checkpoint.mode' = 'some'" in errors[3]
    assert errors[4].startswith("unknown key 'bogus'")


def test_debug_model_is_a_short_cpu_run():
    with open(CONFIG_DIR / "debug_model.toml", "rb") as f:
        cfg = tomllib.load(f)
    training = cfg["training"]
    assert (training["local_batch_size"], training["seq_len"], training["steps"]) == (8, 512, 30)
    assert training["dataset"] == "c4_test"
    assert training["mixed_precision_param"] == "float32"
    assert cfg["model"]["hf_assets_path"] == "./tests/assets/tokenizer"
    assert cfg["compile"]["enable"] is False
    assert cfg["checkpoint"]["enable"] is False


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_llama3_model_dir_path_resolves_to_same_file(name):
    assert (LINKED_DIR / name).samefile(CONFIG_DIR / name)


def test_model_dir_link_is_relative():
    # An absolute link would break in every other clone.
    assert LINKED_DIR.is_symlink()
    assert not Path(LINKED_DIR.readlink()).is_absolute()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_manager_loads_bundled_config(path):
    from torchtitan.config.manager import ConfigManager

    cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
    with open(path, "rb") as f:
        data = tomllib.load(f)
    assert cfg.model.flavor == data["model"]["flavor"]
    assert cfg.training.steps == data["training"]["steps"]
