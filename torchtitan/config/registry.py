"""Bundled training configs by name: ``(module, config)`` -> ``train_configs/<file>.toml``.

This is the mapping behind ``--module llama3 --config llama3_8b`` and
``MODULE=llama3 CONFIG=llama3_8b ./run_train.sh``:

* ``<module>_debugmodel`` -> ``<module>_debugmodel.toml`` when the family has its own debug
  config (``deepseek_v3_debugmodel.toml``), else the shared ``debug_model.toml``
* any other name -> ``<config>.toml`` (``llama3_8b``, ``llama3_70b``, ``llama2_7b``, ...)

``python -m torchtitan.config.registry MODULE CONFIG`` prints the resolved path
(or one ``error:`` line and exit code 2), for shell scripts.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchtitan.config.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "train_configs"
"""The repository's ``train_configs/`` folder."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")

_EXPLICIT: dict[tuple[str, str], str] = {}
"""Registered exceptions to the generic rule: (module, config) -> file name or path."""


def register_config(module: str, config: str, path: str | Path) -> None:
    """Register a config name whose file does not follow the generic rule."""
    _EXPLICIT[(module, config)] = str(path)


def _check_name(kind: str, name: str) -> None:
    if not _NAME.match(name) or ".." in name:
        raise ConfigError(f"invalid {kind} name {name!r}: use a plain name such as llama3_8b")


def config_path(module: str | None, config: str, config_dir: Path | None = None) -> Path:
    """The TOML path for ``config`` of ``module`` (the file need not exist)."""
    folder = config_dir or CONFIG_DIR
    if module is not None:
        _check_name("module", module)
    _check_name("config", config)
    explicit = _EXPLICIT.get((module or "", config))
    if explicit is not None:
        return folder / explicit
    if config == "debugmodel" or config.endswith("_debugmodel"):
        # a family's own debug config when it has one (qwen3_debugmodel.toml), else Llama 3's
        own = folder / f"{config if config != 'debugmodel' else f'{module}_debugmodel'}.toml"
        return own if own.is_file() else folder / "debug_model.toml"
    name = config[:-5] if config.endswith(".toml") else config
    return folder / f"{name}.toml"


def available_configs(module: str | None = None, config_dir: Path | None = None) -> list[str]:
    """Config names that resolve to an existing file (for error messages and listings)."""
    folder = config_dir or CONFIG_DIR
    names: set[str] = set()
    if folder.is_dir():
        for path in folder.glob("*.toml"):
            if _checks_module(module) and _model_name(path) != module:
                continue  # another family's config
            names.add("llama3_debugmodel" if path.stem == "debug_model" else path.stem)
    for (mod, config), rel in _EXPLICIT.items():
        if (module is None or mod == module) and (folder / rel).is_file():
            names.add(config)
    return sorted(names)


def resolve_config(module: str | None, config: str, config_dir: Path | None = None) -> Path:
    """Like :func:`config_path`, but raise ConfigError when the file does not exist."""
    path = config_path(module, config, config_dir)
    if not path.is_file():
        names = ", ".join(available_configs(module, config_dir)) or "none found"
        where = f"module {module!r}" if module else "any module"
        functions = (
            f" and no function {config}() in " + " or ".join(config_function_modules(module))
            if module else ""
        )
        raise ConfigError(
            f"unknown config {config!r} for {where}: no file {path}{functions}; available: {names}"
        )
    return path


def resolve_config_source(
    module: str | None, config: str, config_dir: Path | None = None
) -> Path | Callable[[], Any]:
    """``--module/--config``: the bundled TOML file of that name (TOML is the primary format),
    else a Python function returning a JobConfig (:func:`find_config_function`)."""
    path = config_path(module, config, config_dir)
    if path.is_file():
        _check_module(module, config, path, config_dir)
        return path
    fn = find_config_function(module, config)
    if fn is not None:
        return fn
    return resolve_config(module, config, config_dir)  # raises, listing what exists


def _checks_module(module: str | None) -> bool:
    """Whether ``--module`` names a model family whose configs must train it: a built-in
    family, or a name that is no importable module (a user's module of config functions, e.g.
    ``my_project.configs``, may pick any bundled TOML)."""
    from torchtitan.models import _BUILTIN_FAMILIES  # a constant: no family is imported

    if module is None:
        return False
    if module in _BUILTIN_FAMILIES:
        return True
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def _model_name(path: Path) -> str | None:
    """``[model] name`` of a TOML config (Llama 3 when unset), None when it cannot be read."""
    from torchtitan.config.toml_io import read_toml

    try:
        data = read_toml(str(path))
    except ConfigError:
        return None  # the config manager reports it when it reads the file
    model = data.get("model")
    return str(model.get("name", "llama3")) if isinstance(model, dict) else "llama3"


def _check_module(module: str | None, config: str, path: Path, config_dir: Path | None) -> None:
    """``--module qwen3 --config llama3_8b`` trained Llama 3 without a word: refuse a config
    of another family than the module names."""
    from torchtitan.models import _BUILTIN_FAMILIES

    if not _checks_module(module):
        return
    if module not in _BUILTIN_FAMILIES:
        raise ConfigError(
            f"--module {module!r} is neither a model family ({', '.join(_BUILTIN_FAMILIES)}) "
            "nor an importable module of config functions"
        )
    name = _model_name(path)
    if name is None or name == module:
        return
    mine = ", ".join(available_configs(module, config_dir)) or "none bundled"
    raise ConfigError(
        f"--module {module} --config {config}: {path.name} trains model.name={name!r}, not "
        f"{module!r}; {module}'s configs: {mine} (or --module {name})"
    )


def config_function_modules(module: str) -> list[str]:
    """Where ``--module M --config F`` looks for a Python config function ``F``: the model
    family's ``torchtitan.models.M.config_registry`` (upstream's layout), then ``M`` itself as
    an importable module (e.g. ``my_project.configs``)."""
    return [f"torchtitan.models.{module}.config_registry", module]


def find_config_function(module: str | None, config: str) -> Callable[[], Any] | None:
    """The function named ``config`` in one of :func:`config_function_modules`, or None.

    A module that does not exist is skipped; one that fails to import raises ConfigError.
    """
    if module is None or not config.isidentifier():
        return None
    for name in config_function_modules(module):
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except (ImportError, ValueError):  # a parent package is missing
            continue
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # the user's module: report, don't crash
            raise ConfigError(f"--module {module}: importing {name} failed: {exc}") from exc
        fn = getattr(mod, config, None)
        if callable(fn):
            return fn
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m torchtitan.config.registry MODULE CONFIG``: print the config's path."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] in ("-h", "--help"):
        print("usage: python -m torchtitan.config.registry MODULE CONFIG", file=sys.stderr)
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    try:
        print(resolve_config(args[0] or None, args[1]))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
