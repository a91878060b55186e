"""argparse helpers for the scripts: value types (a bad number is one ``error:`` line naming
the option, exit code 2, before anything runs) and :class:`OneLineParser`."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, like the trainer's:
    ``error: <message> (see --help)`` and exit code 2 (argparse prints its usage line first)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An integer option that must be ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def non_negative_float(text: str) -> float:
    """A finite float option ``>= 0`` (tolerances, timeouts)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def available_device(text: str) -> str:
    """A torch device this machine has (``cpu``, ``cuda``, ``cuda:1``, ...)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (cpu, cuda, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has no CUDA device")
    return text
