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

import re
import sys
from pathlib import Path

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
        own = folder / f"{config}.toml"
        return own if config != "debugmodel" and own.is_file() else folder / "debug_model.toml"
    name = config[:-5] if config.endswith(".toml") else config
    return folder / f"{name}.toml"


def available_configs(module: str | None = None, config_dir: Path | None = None) -> list[str]:
    """Config names that resolve to an existing file (for error messages and listings)."""
    folder = config_dir or CONFIG_DIR
    names: set[str] = set()
    if folder.is_dir():
        for path in folder.glob("*.toml"):
            if path.stem == "debug_model":
                names.add(f"{module or 'llama3'}_debugmodel")
            else:
                names.add(path.stem)
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
        raise ConfigError(
            f"unknown config {config!r} for {where}: no file {path}; available: {names}"
        )
    return path


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
