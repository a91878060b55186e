"""TOML in and out: read a config file, build the config dataclass from it, write it back.

``build`` checks every key and value of the file against the config class and raises a
one-line :class:`ConfigError` naming the file and key; ``config_to_toml`` writes a config
that ``build`` reads back to the same config.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import typing
from pathlib import Path
from typing import Any, Literal

from torchtitan.config.errors import ConfigError, suggest
from torchtitan.config.fields import (
    choice_hint,
    hints,
    leaf_fields,
    lookup_class,
    split_optional,
    type_name,
)
from torchtitan.config.values import from_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["build", "config_save_path", "config_to_toml", "read_toml", "save_config"]


# -------------------------------------------------------------------------- input


def read_toml(path_text: str) -> dict:
    """Parse a TOML file; every failure (missing, not UTF-8, bad syntax) is a ConfigError."""
    path = Path(path_text)
    if not path.exists():
        raise ConfigError(f"config file not found: {path_text}")
    if path.is_dir():
        raise ConfigError(f"config file {path_text} is a directory, expected a .toml file")
    try:
        # utf-8-sig: a byte-order mark, which some Windows editors write, is not a TOML error
        return tomllib.loads(path.read_bytes().decode("utf-8-sig"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path_text}: invalid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path_text}: not UTF-8 text ({exc.reason})") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path_text}: {exc.strerror}") from exc


def _unknown_key(key: str, cls: type, where: str) -> str:
    section, _, name = key.rpartition(".")
    owner = lookup_class(cls, section)
    local = [f.name for f in dataclasses.fields(owner)] if owner else []
    guess = suggest(name, local)
    if guess is not None:
        hint = f" (did you mean {section}.{guess}?)" if section else f" (did you mean [{guess}]?)"
    else:
        others = [k for k in leaf_fields(cls) if k.rsplit(".", 1)[-1] == name]
        hint = f" (did you mean {others[0]}?)" if others else ""
    if not section:
        return f"{where}: unknown section [{name}]{hint}"
    return f"{where}: unknown key {name!r} in [{section}]{hint}"


def build(cls: type, data: dict, where: str, root: type | None = None, prefix: str = "") -> Any:
    """Instantiate ``cls`` from a TOML table, checking every key and value."""
    root = root or cls
    cls_hints = hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in names:
            if not prefix and not isinstance(value, dict):
                others = [k for k in leaf_fields(root) if k.rsplit(".", 1)[-1] == name]
                hint = (
                    f" (did you mean {others[0]} under [{others[0].rsplit('.', 1)[0]}]?)"
                    if others
                    else ""
                )
                raise ConfigError(f"{where}: key {name!r} must be inside a [section]{hint}")
            raise ConfigError(_unknown_key(key, root, where))
        tp = cls_hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {key} must be a table [{key}], got {value!r}")
            kwargs[name] = build(tp, value, where, root, key + ".")
            continue
        if isinstance(value, dict):
            raise ConfigError(f"{where}: [{key}] is a table, but {key} expects {type_name(tp)}")
        ok, converted = from_toml(value, tp)
        if not ok:
            choice = isinstance(value, str) and typing.get_origin(split_optional(tp)[0]) is Literal
            problem = "is not a valid value" if choice else "has the wrong type"
            raise ConfigError(
                f"{where}: {key} = {value!r} {problem} (expected {type_name(tp)})"
                f"{choice_hint(value, tp)}"
            )
        kwargs[name] = converted
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ConfigError(f"{where}: [{prefix.rstrip('.') or 'root'}] {exc}") from exc


# ------------------------------------------------------------------------- output


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return (
            repr(value)
            if not isinstance(value, float) or math.isfinite(value)
            else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
        )
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _write_table(obj: Any, name: str, out: list[str]) -> None:
    scalars: list[str] = []
    tables: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        if name == "job" and f.name == "config_file":
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            tables.append((f"{name}.{f.name}" if name else f.name, value))
        elif value is None:
            if _default_of(f) is None:
                scalars.append(f"# {f.name} = None")
            else:
                scalars.append(f'{f.name} = "None"')
        else:
            scalars.append(f"{f.name} = {_toml_value(value)}")
    if name:
        out.append(f"\n[{name}]")
    out.extend(scalars)
    for sub_name, sub in tables:
        _write_table(sub, sub_name, out)


def config_to_toml(cfg: Any) -> str:
    """The config as TOML that loads back to the same config.

    ``job.config_file`` is left out (the file is the config). A None field whose
    default is None is written as a comment; one whose default is not None is
    written as the string "None", which optional fields read as None.
    """
    out = ["# torchtitan job config (resolved)"]
    _write_table(cfg, "", out)
    return "\n".join(out) + "\n"


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write :func:`config_to_toml` to ``path`` (atomically; parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(config_to_toml(cfg))
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a failed write (a full disk) leaves nothing behind
        raise
    return path


def config_save_path(cfg: Any) -> Path | None:
    """Where ``job.save_config_file`` asks the config to be saved (inside dump_folder)."""
    name = cfg.job.save_config_file
    if not name:
        return None
    return Path(cfg.job.dump_folder) / name
