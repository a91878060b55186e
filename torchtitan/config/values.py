"""Converting one value to a field's type: command-line strings and TOML values.

Both raise nothing on their own for a value of the wrong type: :func:`from_cli` raises
ValueError (TypeError for a type the command line cannot express) and :func:`from_toml`
returns ``(ok, value)``; the callers turn that into a :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import contextlib
import json
import typing
from typing import Any, Literal

from torchtitan.config.fields import is_list, is_nested_list, is_union, split_optional

__all__ = ["from_cli", "from_toml", "parse_nested", "split_commas"]


def parse_nested(text: str) -> list[list[str]]:
    """``a,b;c`` or JSON ``[["a","b"],["c"]]`` -> ``[["a", "b"], ["c"]]``."""
    text = text.strip()
    if text.startswith("["):
        value = json.loads(text)
        if not (
            isinstance(value, list)
            and all(isinstance(p, list) and all(isinstance(s, str) for s in p) for p in value)
        ):
            raise ValueError("expected a JSON list of lists of strings")
        return value
    return [[s.strip() for s in part.split(",") if s.strip()] for part in text.split(";")]


def split_commas(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _convert_scalar(text: str, tp: Any) -> Any:
    """Convert one CLI string to ``tp`` (raises ValueError when it does not fit)."""
    if typing.get_origin(tp) is Literal:
        for choice in typing.get_args(tp):
            if str(choice) == text:
                return choice
        raise ValueError(text)
    if tp is bool:
        low = text.lower()
        if low in ("true", "false"):
            return low == "true"
        raise ValueError(text)
    if tp is int:
        return int(text)
    if tp is float:
        return float(text)
    if tp is str or tp is Any:
        return text
    if is_union(tp):
        for arg in typing.get_args(tp):
            with contextlib.suppress(ValueError, TypeError):
                return _convert_scalar(text, arg)
        raise ValueError(text)
    raise TypeError(f"type {tp} cannot be given on the command line")


def from_cli(text: str, tp: Any) -> Any:
    """A command-line string as a value of type ``tp``."""
    inner, optional = split_optional(tp)
    if optional and text == "None":
        return None
    if is_nested_list(inner):
        return parse_nested(text)
    if is_list(inner):
        (item,) = typing.get_args(inner) or (str,)
        return [_convert_scalar(s, item) for s in split_commas(text)]
    return _convert_scalar(text, inner)


def _check_toml_scalar(value: Any, tp: Any, lenient: bool = True) -> tuple[bool, Any]:
    if typing.get_origin(tp) is Literal:
        return value in typing.get_args(tp) and type(value) is not bool, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if tp is str:
        if lenient and isinstance(value, int) and not isinstance(value, bool):
            return True, str(value)  # e.g. selective_ac_option = 2
        return isinstance(value, str), value
    if is_union(tp):
        for arg in typing.get_args(tp):
            ok, conv = _check_toml_scalar(value, arg, lenient)
            if ok:
                return True, conv
        return False, value
    return True, value  # types we do not know how to check: accept as written


def from_toml(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, converted value) for a TOML value destined for a field of type ``tp``."""
    inner, optional = split_optional(tp)
    if optional and value == "None":
        return True, None
    if is_nested_list(inner):
        ok = isinstance(value, list) and all(
            isinstance(p, list) and all(isinstance(s, str) for s in p) for p in value
        )
        return ok, value
    if is_list(inner):
        (item,) = typing.get_args(inner) or (Any,)
        if isinstance(value, str):  # legacy: "a,b" strings for list fields
            value = split_commas(value)
        if not isinstance(value, list):
            return False, value
        out = []
        for v in value:
            ok, conv = _check_toml_scalar(v, item, lenient=False)
            if not ok:
                return False, value
            out.append(conv)
        return True, out
    return _check_toml_scalar(value, inner)
