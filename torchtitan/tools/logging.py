"""Project-wide logger: one format, rank-aware, configured once."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Iterator

logger = logging.getLogger("torchtitan")


@contextlib.contextmanager
def logger_level(target: logging.Logger, level: int) -> Iterator[None]:
    """``target`` at ``level`` for the block, its own level restored after."""
    old = target.level
    target.setLevel(level)
    try:
        yield
    finally:
        target.setLevel(old)


def init_logger(level: int = logging.INFO) -> None:
    """Configure the ``torchtitan`` logger (idempotent)."""
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        rank = os.environ.get("RANK")
        # torchrun already prefixes each line with "[rankN]:"; other launchers do not.
        under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        multi_rank = os.environ.get("WORLD_SIZE", "1") != "1"
        prefix = f"[rank{rank}] " if rank is not None and multi_rank and not under_torchrun else ""
        handler.setFormatter(
            logging.Formatter(f"{prefix}[titan] %(asctime)s - %(levelname)s - %(message)s")
        )
        logger.addHandler(handler)
    logger.propagate = False
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")


def warn_once(message: str, _seen: set[str] = set()) -> None:  # noqa: B006 - deliberate cache
    """Log a warning only the first time this exact message is seen."""
    if message not in _seen:
        _seen.add(message)
        logger.warning(message)


COLOR_ENV = "TORCHTITAN_COLOR"
"""``1`` / ``0``: colour the step line or not. The launcher sets it from its own console, since
torchrun's ranks write into pipes; unset, a rank colours when its stdout is a terminal."""


def console_wants_color() -> bool:
    """Whether the step line may carry ANSI colours: never with ``NO_COLOR`` set (the common
    convention), else ``TORCHTITAN_COLOR`` when set, else whether stdout is a terminal (a log
    file or a pipe gets plain text)."""
    if os.environ.get("NO_COLOR"):
        return False
    forced = os.environ.get(COLOR_ENV)
    if forced is not None and forced.strip().lower() in _COLOR_ON:
        return True
    if forced is not None and forced.strip().lower() in _COLOR_OFF:
        return False
    if forced:
        _unknown_color(forced)
    return sys.stdout.isatty()


_COLOR_ON = ("1", "true", "yes", "on", "always")
_COLOR_OFF = ("0", "false", "no", "off", "never")


@functools.cache
def _unknown_color(value: str) -> None:
    logger.warning(f"{COLOR_ENV}={value!r} is neither 1 nor 0 (nor true/false, yes/no, on/off): "
                   "ignored; colours follow whether the console is a terminal")


def byte_size(n: float) -> str:
    """``n`` bytes for a log line: ``1051.3 GiB``, ``1.5 GiB``, ``12 MiB``, ``3 KiB``."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.{1 if unit == 'GiB' else 0}f} {unit}"
    return f"{int(n)} bytes"
