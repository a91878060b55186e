"""Resolve a :class:`JobConfig`: dataclass defaults < TOML file < command-line flags.

``ConfigManager().parse_args(argv)`` does the work; ``parse_args_or_exit`` is the
entry point for programs that run a job (one ``error: ...`` line and exit code 2 on a bad
config, including settings whose feature is planned but not built yet);
``python -m torchtitan.config_manager`` (= ``python -m torchtitan.config.manager``)
checks the config as the trainer would before building the model
(:mod:`torchtitan.preflight`) and prints it, or ``--check`` also checks this machine's files
and devices, as ``./run_train.sh`` does. See docs/config.md for the flag syntax.

The work is split by job: :mod:`~torchtitan.config.cli` (flags),
:mod:`~torchtitan.config.toml_io` (TOML in and out), :mod:`~torchtitan.config.custom`
(custom config classes), :mod:`~torchtitan.config.validation` (range rules),
:mod:`~torchtitan.config.planned` (planned-feature settings), :mod:`~torchtitan.config.help`
(``--help``), :mod:`~torchtitan.config.registry` (bundled configs by name).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torchtitan.config.legacy as legacy
import torchtitan.config.registry as registry
from torchtitan.config.cli import apply_ops, parse_flags, peek, take_manager_flags
from torchtitan.config.custom import load_custom_module
from torchtitan.config.errors import ConfigError, print_error
from torchtitan.config.fields import leaf_fields
from torchtitan.config.help import print_help
from torchtitan.config.inert import warn_inert_flags
from torchtitan.config.job_config import JobConfig
from torchtitan.config.planned import reject_planned_settings
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


logger = logging.getLogger(__name__)


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
        source = self._config_source(manager)
        if callable(source):
            return self._from_function(source, manager, argv, want_help)
        config_file = source

        toml_data: dict = {}
        where = config_file or ""
        if config_file is not None:
            toml_data = read_toml(config_file)
            if not toml_data:
                logger.warning(f"{config_file} sets nothing (an empty TOML): every setting not "
                               "given as a flag is its default")
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
        ops = parse_flags(argv, leaf_fields(cls))
        cfg = apply_ops(base, ops)
        validate(cfg)
        warn_inert_flags(cfg, (key for _, key, _ in ops))
        self.config = cfg
        return cfg

    @staticmethod
    def _config_source(manager: dict[str, str]) -> str | Callable[[], Any] | None:
        """The TOML path, or the Python config function, that ``--job.config_file`` /
        ``--module --config`` name (None: defaults only)."""
        module, config = manager.get("module"), manager.get("config")
        if module is not None and config is None:
            raise ConfigError("--module needs --config NAME too (e.g. --config llama3_8b)")
        if config is None:
            return manager.get("config_file")
        if "config_file" in manager:
            raise ConfigError("give either --job.config_file or --module/--config, not both")
        source = registry.resolve_config_source(module, config)
        return source if callable(source) else str(source)

    def _from_function(
        self, fn: Callable[[], Any], manager: dict[str, str], argv: list[str], want_help: bool
    ) -> JobConfig:
        """A Python config function's JobConfig, with the CLI flags applied on top."""
        name = f"{manager['module']}.{manager['config']}"
        try:
            base = fn()
        except Exception as exc:
            raise ConfigError(f"config function {name}() failed: {exc}") from exc
        if not isinstance(base, JobConfig):
            raise ConfigError(
                f"config function {name}() must return a JobConfig (or a subclass), got "
                f"{type(base).__name__}"
            )
        cls = type(base)
        if want_help:
            print_help(cls, base, self.prog)
        ops = parse_flags(argv, leaf_fields(cls))
        cfg = apply_ops(base, ops)
        validate(cfg)
        warn_inert_flags(cfg, (key for _, key, _ in ops))
        self.config = cfg
        return cfg

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


def _take_tool_flags(args: list[str]) -> tuple[list[str], dict]:
    """Pull the tool-only flags (--json, --check, --world_size N) out of ``args``."""
    flags: dict = {"json": False, "check": False, "world_size": None}
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--json", "--check"):
            flags[a[2:]] = True
        elif a.split("=", 1)[0] in ("--json", "--check"):
            raise ConfigError(f"{a.split('=', 1)[0]} takes no value (got {a!r})")
        elif a.split("=", 1)[0] in ("--world_size", "--world-size"):
            value = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            i += 0 if "=" in a else 1
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--world_size expects a positive integer, got {value!r}")
            flags["world_size"] = int(value)
        else:
            rest.append(a)
        i += 1
    return rest, flags


def main(argv: list[str] | None = None) -> int:
    """``python -m torchtitan.config_manager [--json] [--check] [--world_size N] [flags]``.

    Resolves the config and checks it as the trainer would before building the model
    (:func:`torchtitan.preflight.check_run`: planned features, the layout at ``--world_size``
    ranks -- default ``$NGPU``, else the product of the degrees -- batch arithmetic, the model
    shape against the layout, the pipeline plan). A config that would fail prints one
    ``error:`` line and exits 2 (so does a planned-but-unbuilt setting: the trainer refuses
    it). Otherwise it prints the config (TOML, or JSON with ``--json``). ``--check`` also checks what
    depends on this machine (the tokenizer and dataset files, device-only features; not under
    ``COMM_MODE``), exactly as ``./run_train.sh`` does before torchrun starts, and prints one
    ``ok:`` line instead of the config.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        args, tool = _take_tool_flags(args)
        cfg = ConfigManager(prog=PROG).parse_args(args)
    except ConfigError as exc:
        print_error(exc)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    from torchtitan.preflight import USER_ERRORS, check_run, default_world_size, summary

    ngpu = os.environ.get("NGPU", "")
    world_size = tool["world_size"] or (int(ngpu) if ngpu.isdigit() else default_world_size(cfg.parallelism))
    on_this_machine = tool["check"] and not os.environ.get("COMM_MODE", "").strip()
    try:
        parallel_dims = check_run(cfg, world_size, on_this_machine=on_this_machine)
    except USER_ERRORS as exc:
        print_error(exc)
        return 2
    if tool["check"]:
        print(summary(cfg, parallel_dims))
        return 0
    if tool["json"]:
        print(json.dumps(dataclasses.asdict(cfg), indent=2))
    else:
        print(config_to_toml(cfg), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
