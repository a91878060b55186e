"""``job.custom_config_module``: load a user's JobConfig extension and merge it with ours."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path

from torchtitan.config.errors import ConfigError
from torchtitan.config.fields import hints
from torchtitan.config.job_config import JobConfig

__all__ = ["load_custom_module", "merge_classes"]


def load_custom_module(name: str) -> type:
    """Import ``name`` (a dotted module or a .py file) and return its JobConfig class."""
    try:
        if name.endswith(".py"):
            path = Path(name)
            if not path.is_file():
                raise ConfigError(f"job.custom_config_module: file not found: {name}")
            spec = importlib.util.spec_from_file_location(f"_custom_job_config_{path.stem}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # needed for type hints and docstrings
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(name)
    except ConfigError:
        raise
    except Exception as exc:  # any import failure is a config problem for the user
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"job.custom_config_module: cannot import {name!r}: {msg}") from exc
    custom = getattr(module, "JobConfig", None)
    if not (isinstance(custom, type) and dataclasses.is_dataclass(custom)):
        raise ConfigError(
            f"job.custom_config_module: {name!r} defines no dataclass named JobConfig"
        )
    return merge_classes(JobConfig, custom)


def merge_classes(base: type, custom: type) -> type:
    """``custom`` if it subclasses ``base``; otherwise a dataclass with both field sets
    (same-named sections merged recursively, the custom definition winning)."""
    if issubclass(custom, base):
        return custom
    base_hints, custom_hints = hints(base), hints(custom)
    merged_fields = []
    for f in dataclasses.fields(custom):
        b, c = base_hints.get(f.name), custom_hints[f.name]
        if dataclasses.is_dataclass(b) and dataclasses.is_dataclass(c):
            sub = merge_classes(b, c)
            merged_fields.append((f.name, sub, dataclasses.field(default_factory=sub)))
    return dataclasses.make_dataclass(base.__name__, merged_fields, bases=(custom, base))
