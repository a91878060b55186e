"""Resolve a :class:`JobConfig`: dataclass defaults < TOML file < command-line flags.

``ConfigManager().parse_args(argv)`` does the work; ``parse_args_or_exit`` is the
entry point for programs that run a job (one ``error: ...`` line and exit code 2 on a bad
config, including settings whose feature is planned but not built yet);
``python -m torchtitan.config_manager`` (= ``python -m torchtitan.config.manager``)
prints the resolved config. See docs/config.md for the flag syntax.

The work is split by job: :mod:`~torchtitan.config.cli` (flags),
:mod:`~torchtitan.config.toml_io` (TOML in and out), :mod:`~torchtitan.config.custom`
(custom config classes), :mod:`~torchtitan.config.validation` (range rules),
:mod:`~torchtitan.config.planned` (planned-feature settings), :mod:`~torchtitan.config.help`
(``--help``), :mod:`~torchtitan.config.registry` (bundled configs by name).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torchtitan.config.legacy as legacy
import torchtitan.config.registry as registry
from torchtitan.config.cli import apply_ops, parse_flags, peek, take_manager_flags
from torchtitan.config.custom import load_custom_module
from torchtitan.config.errors import ConfigError, print_error
from torchtitan.config.fields import leaf_fields
from torchtitan.config.help import print_help
from torchtitan.config.job_config import JobConfig
from torchtitan.config.planned import planned_message, planned_settings, reject_planned_settings
from torchtitan.config.toml_io import (
    build,
    config_save_path,
    config_to_toml,
    read_toml,
    save_config,
)
from torchtitan.config.validation import validate

__all__ = [
    "ConfigError",
    "ConfigManager",
    "config_save_path",
    "config_to_toml",
    "main",
    "parse_args_or_exit",
    "reject_planned_settings",
    "save_config",
    "validate",
]

PROG = "python -m torchtitan.config_manager"


class ConfigManager:
    """Builds the JobConfig for a run: defaults < TOML < CLI flags."""

    def __init__(self, prog: str | None = None) -> None:
        self.prog = prog
        self.config: JobConfig | None = None

    def parse_args(self, args: list[str] | None = None) -> JobConfig:
        """Resolve ``args`` (default ``sys.argv[1:]``) into a validated JobConfig.

        Raises ConfigError for anything wrong with the config; ``--help`` prints
        the flag list and raises SystemExit(0). Planned-feature settings are accepted
        here (so such configs still print and round-trip); programs that run a job
        refuse them with :func:`reject_planned_settings`.
        """
        argv = list(sys.argv[1:] if args is None else args)
        want_help = any(a in ("-h", "--help") for a in argv)
        argv = [a for a in argv if a not in ("-h", "--help")]
        argv, manager = take_manager_flags(argv)
        config_file = self._config_file(manager)

        toml_data: dict = {}
        where = config_file or ""
        if config_file is not None:
            toml_data = read_toml(config_file)
            try:
                legacy.migrate_toml(toml_data, config_file)
            except legacy.LegacyValueError as exc:
                raise ConfigError(f"{config_file}: {exc}") from exc
            job = toml_data.get("job")
            if isinstance(job, dict) and "config_file" in job:
                legacy.warn(
                    f"{config_file}: config key job.config_file is ignored inside a config "
                    "file (give the file with --job.config_file)"
                )

        cls = self._config_class(argv, toml_data)
        base = build(cls, toml_data, where)
        base.job.config_file = config_file
        if want_help:
            print_help(cls, base, self.prog)
        cfg = apply_ops(base, parse_flags(argv, leaf_fields(cls)))
        validate(cfg)
        self.config = cfg
        return cfg

    @staticmethod
    def _config_file(manager: dict[str, str]) -> str | None:
        module, config = manager.get("module"), manager.get("config")
        if module is not None and config is None:
            raise ConfigError("--module needs --config NAME too (e.g. --config llama3_8b)")
        if config is None:
            return manager.get("config_file")
        if "config_file" in manager:
            raise ConfigError("give either --job.config_file or --module/--config, not both")
        return str(registry.resolve_config(module, config))

    @staticmethod
    def _config_class(argv: list[str], toml_data: dict) -> type:
        name = peek(argv, ("job.custom_config_module", "experimental.custom_args_module"))
        if name is None:
            name = (
                toml_data.get("job", {}).get("custom_config_module")
                if isinstance(toml_data.get("job"), dict)
                else None
            )
        if not name:
            return JobConfig
        if not isinstance(name, str):
            raise ConfigError(f"job.custom_config_module = {name!r} must be a module name")
        return load_custom_module(name)


def parse_args_or_exit(argv: list[str] | None = None, reject_planned: bool = True) -> JobConfig:
    """Parse like ConfigManager, but print one ``error:`` line and exit 2 on a bad config.

    For programs that run a job: unless ``reject_planned`` is False, a setting whose
    feature is planned but not implemented yet is a bad config too.
    """
    try:
        cfg = ConfigManager().parse_args(argv)
        if reject_planned:
            reject_planned_settings(cfg)
        return cfg
    except ConfigError as exc:
        print_error(exc)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    """``python -m torchtitan.config_manager [--json] [flags]``: print the resolved config.

    Planned-feature settings are printed with one ``warning:`` line each on stderr (the
    trainer refuses them).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    try:
        cfg = ConfigManager(prog=PROG).parse_args(args)
    except ConfigError as exc:
        print_error(exc)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    if as_json:
        print(json.dumps(dataclasses.asdict(cfg), indent=2))
    else:
        print(config_to_toml(cfg), end="")
    for setting in planned_settings(cfg):
        print(f"warning: {planned_message(*setting)}; the trainer refuses it", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
