"""``job.custom_config_module``: load a user's JobConfig extension and merge it with ours."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import io
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchtitan.config.errors import ConfigError
from torchtitan.config.fields import hints
from torchtitan.config.job_config import JobConfig

__all__ = ["ModuleExited", "import_user_module", "load_custom_module", "merge_classes"]


class ModuleExited(Exception):
    """A user's module called ``sys.exit`` (or ran argparse on our command line) on import."""


def import_user_module(setting: str, name: str, importer: Callable[[], Any] | None = None) -> Any:
    """Import the module a setting names (``importer`` or ``importlib.import_module(name)``).

    A relative name and a module that exits while importing (``sys.exit``, or argparse
    parsing the trainer's flags and printing its usage) raise ``ModuleExited`` with one line
    naming ``setting``; what the module printed is kept out of the console then (it read as
    if the trainer's own flags were wrong), and written out as usual otherwise."""
    if name.startswith("."):
        raise ModuleExited(
            f"{setting}={name!r} is a relative module name: give the module's full dotted name "
            "on the Python path (e.g. my_pkg.register_model)"
        )
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            module = importer() if importer is not None else importlib.import_module(name)
    except SystemExit as exc:
        said = [line for line in printed.getvalue().splitlines() if line.strip()]
        last = said[-1].strip() if said else ""
        last = last if len(last) <= 100 else last[:97] + "..."
        because = f" after printing {last!r}" if last else ""
        raise ModuleExited(
            f"{setting}={name!r} exited while importing (sys.exit({exc.code!r}){because}): a "
            "module to import must not exit or parse the command line (e.g. argparse at import "
            "time: move it under `if __name__ == '__main__':`)"
        ) from None
    except BaseException:
        sys.stderr.write(printed.getvalue())
        raise
    sys.stderr.write(printed.getvalue())
    return module


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
            import_user_module("job.custom_config_module", name,
                               lambda: spec.loader.exec_module(module))  # type: ignore[union-attr]
        else:
            module = import_user_module("job.custom_config_module", name)
    except ConfigError:
        raise
    except ModuleExited as exc:
        raise ConfigError(str(exc)) from None
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
