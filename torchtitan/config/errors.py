"""ConfigError and the helpers that turn config problems into one line for people."""

from __future__ import annotations

import difflib
import sys

__all__ = ["ConfigError", "print_error", "suggest"]


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line meant for people."""


def suggest(word: str, candidates: list[str]) -> str | None:
    """The closest candidate to ``word`` (for "did you mean ...?"), or None."""
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


def print_error(exc: Exception) -> None:
    """Print ``exc`` as one ``error: ...`` line on stderr."""
    message = " ".join(str(exc).split("\n")).strip()
    print(f"error: {message}", file=sys.stderr)
