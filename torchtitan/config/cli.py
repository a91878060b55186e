"""Command-line flags: parse and check them, then apply them to the config built from TOML.

This is the only command-line parser (tyro only renders ``--help``). Syntax:
``--section.key VALUE`` or ``--section.key=VALUE``; booleans are actions
(``--x.flag`` / ``--x.no_flag`` / ``--x.no-flag``) and reject a value; lists take one
comma-separated token; ``None`` sets an optional field to None; hyphens and underscores
are interchangeable; old keys are renamed through :mod:`torchtitan.config.legacy`.
"""

from __future__ import annotations

import logging
from typing import Any

import torchtitan.config.legacy as legacy
from torchtitan.config.errors import ConfigError, suggest
from torchtitan.config.fields import Field, choice_hint, get_field, replace_field, type_name
from torchtitan.config.values import from_cli

__all__ = ["apply_ops", "looks_like_flag", "parse_flags", "peek", "take_manager_flags"]

# One operation: ("set", key, value) or ("append", key, item) -- the legacy module's Op.
Op = tuple[str, str, Any]

logger = logging.getLogger(__name__)


def flag_name(token: str) -> tuple[str, str | None]:
    """``--a-b.c-d=v`` -> (``a_b.c_d``, ``v``); the name is normalised to underscores."""
    body = token[2:]
    name, eq, value = body.partition("=")
    return name.replace("-", "_"), (value if eq else None)


def looks_like_flag(token: str) -> bool:
    return token.startswith("--") and len(token) > 2


def take_manager_flags(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Pull --job.config_file, --module and --config out of argv (the last of each wins, with
    one warning when they differ, as for every flag)."""
    wanted = {"job.config_file": "config_file", "module": "module", "config": "config"}
    rest: list[str] = []
    found: dict[str, str] = {}
    ops: list[Op] = []
    sources: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, value = flag_name(token) if looks_like_flag(token) else ("", None)
        if name in wanted:
            if value is None:
                if i + 1 >= len(argv) or looks_like_flag(argv[i + 1]):
                    raise ConfigError(f"--{name} expects a value")
                value = argv[i + 1]
                i += 1
            found[wanted[name]] = value
            ops.append(("set", name, value))
            sources.append(token.partition("=")[0])
        else:
            rest.append(token)
        i += 1
    _warn_repeated(ops, sources)
    return rest, found


def peek(argv: list[str], names: tuple[str, ...]) -> str | None:
    """Last value given to any of ``names`` in argv (without consuming it)."""
    value = None
    for i, token in enumerate(argv):
        if not looks_like_flag(token):
            continue
        name, inline = flag_name(token)
        if name in names:
            if inline is not None:
                value = inline
            elif i + 1 < len(argv):
                value = argv[i + 1]
    return value


def _guess(name: str, names: list[str]) -> str | None:
    guess = suggest(name, names)
    if guess is None:
        last = name.rsplit(".", 1)[-1]
        same = [k for k in names if k.rsplit(".", 1)[-1] == last]
        guess = same[0] if same else suggest(last, [k.rsplit(".", 1)[-1] for k in names])
        if guess is not None and guess not in names:
            guess = next(k for k in names if k.rsplit(".", 1)[-1] == guess)
    return guess


_FALSE = ("false", "0", "no", "off")


def _unknown_flag(name: str, fields: dict[str, Field], value: str | None = None) -> str:
    """``unknown flag --x (did you mean --y?)``. A ``no_`` prefix, or a false value given to
    a boolean (``--flag=False``), is kept in the suggestion: ``--section.no_flag``."""
    section, _, last = name.rpartition(".")
    negated = last.startswith("no_")
    if negated:
        name = f"{section}.{last[3:]}" if section else last[3:]
    guess = _guess(name, list(fields))
    field = fields.get(guess) if guess else None
    if field is not None and field.is_bool:
        if negated or (value is not None and value.strip().lower() in _FALSE):
            head, _, tail = guess.rpartition(".")
            guess = f"{head}.no_{tail}" if head else f"no_{tail}"
    elif negated and guess is not None:
        guess = None  # only booleans have a no_ form
    shown = f"{section}.{last}" if section else last
    hint = f" (did you mean --{guess}?)" if guess else ""
    return f"unknown flag --{shown}{hint}; run with --help to list the flags"


def _bool_misuse(flag: str, got: str) -> str:
    section, _, name = flag.rpartition(".")
    off = f"--{section}.no_{name}" if section else f"--no_{name}"
    return (
        f"--{flag} is a boolean flag and takes no value (got {got!r}): "
        f"use --{flag} to turn it on and {off} to turn it off"
    )


def _value(argv: list[str], i: int, inline: str | None, name: str) -> tuple[str, int]:
    if inline is not None:
        return inline, i
    if i >= len(argv) or looks_like_flag(argv[i]):
        raise ConfigError(f"--{name} expects a value")
    return argv[i], i + 1


def _convert(text: str, field: Field, flag: str) -> Any:
    try:
        return from_cli(text, field.tp)
    except TypeError as exc:
        raise ConfigError(f"{flag}: {exc}; set it in the TOML file instead") from exc
    except ValueError as exc:
        raise ConfigError(
            f"{flag}: invalid value {text!r} (expected {type_name(field.tp)})"
            f"{choice_hint(text, field.tp)}"
        ) from exc


def _no_value(argv: list[str], i: int, inline: str | None, target: str) -> None:
    """A boolean action flag: reject ``--x=v`` and ``--x v``."""
    if inline is not None:
        raise ConfigError(_bool_misuse(target, inline))
    if i < len(argv) and not looks_like_flag(argv[i]):
        raise ConfigError(_bool_misuse(target, argv[i]))


def parse_flags(argv: list[str], fields: dict[str, Field]) -> list[Op]:
    """Check argv and turn it into ordered ("set"|"append", key, value) operations.

    Every value is already converted to its field's type; anything wrong raises ConfigError.
    """
    ops: list[Op] = []
    sources: list[str] = []  # the flag each operation came from, for _warn_repeated
    flag = ""
    i = 0
    while i < len(argv):
        sources.extend([flag] * (len(ops) - len(sources)))
        token = argv[i]
        flag = token.partition("=")[0]
        i += 1
        if not looks_like_flag(token):
            hint = (f" (a config file is given as --job.config_file {token})"
                    if token.endswith(".toml") else "")
            raise ConfigError(
                f"unexpected argument {token!r}: every setting is a --section.key flag{hint}"
            )
        name, inline = flag_name(token)
        if name == "help" and inline is not None:
            raise ConfigError(f"--help takes no value (got {token!r}); run with --help alone")
        target, negated = name, False
        rule = legacy.find_rule(name)
        if rule is None and name not in fields:
            section, _, last = name.rpartition(".")
            if last.startswith("no_"):
                positive = f"{section}.{last[3:]}" if section else last[3:]
                if positive in fields or legacy.find_rule(positive) is not None:
                    target, negated = positive, True
                    rule = legacy.find_rule(positive)

        if rule is not None:
            kind = rule.flag_kind
            if kind == "auto":
                new = fields.get(rule.new or "")
                kind = "bool" if new is not None and new.is_bool else "value"
            if negated and kind != "bool":
                raise ConfigError(_unknown_flag(name, fields))
            if rule.new is None:  # dropped: swallow a value if one follows (a rule may check it)
                value = (not negated) if kind == "bool" else None
                if inline is not None:
                    value = inline
                elif i < len(argv) and not looks_like_flag(argv[i]):
                    value = argv[i]
                    i += 1
            elif kind == "bool":
                _no_value(argv, i, inline, target)
                value: Any = not negated
            else:
                value, i = _value(argv, i, inline, name)
                if rule.transform is None and rule.new in fields:
                    value = _convert(value, fields[rule.new], f"--{name}")
            try:
                ops.extend(rule.ops(value))
            except legacy.LegacyValueError as exc:  # refused: no "is ignored" line before it
                raise ConfigError(str(exc)) from exc
            legacy.warn(legacy.describe(rule, target, flag=True))
            continue

        field = fields.get(target)
        if field is None:
            raise ConfigError(_unknown_flag(name, fields, inline))
        if target in legacy.DEPRECATED:
            legacy.warn(f"deprecated flag --{target}: {legacy.DEPRECATED[target]}")
        if field.is_bool:
            _no_value(argv, i, inline, target)
            ops.append(("set", target, not negated))
            continue
        if field.is_optional_bool and (
            negated or (inline is None and (i >= len(argv) or looks_like_flag(argv[i])))
        ):  # ``bool | None`` also works as a bare flag: --x.key (True), --x.no_key (False)
            _no_value(argv, i, inline, target)
            ops.append(("set", target, not negated))
            continue
        if negated:  # --x.no_key for a key that is not a boolean
            raise ConfigError(_unknown_flag(name, fields))
        text, i = _value(argv, i, inline, target)
        ops.append(("set", target, _convert(text, field, f"--{target}")))
    sources.extend([flag] * (len(ops) - len(sources)))
    _warn_repeated(ops, sources)
    return ops


def _warn_repeated(ops: list[Op], sources: list[str]) -> None:
    """One warning per key that two flags set to different values (the last one wins)."""
    seen: dict[str, list[tuple[str, Any]]] = {}
    for (op, key, value), source in zip(ops, sources):
        if op == "set":
            seen.setdefault(key, []).append((source, value))
    for key, sets in seen.items():
        if len({repr(value) for _, value in sets}) < 2:
            continue
        given = ", then ".join(f"{source} {_shown(value)}" for source, value in sets)
        logger.warning(
            f"--{key} is set more than once on the command line ({given}); "
            f"the last one is used: {_shown(sets[-1][1])}"
        )


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def apply_ops(cfg: Any, ops: list[Op]) -> Any:
    """``cfg`` with the parsed flags applied in order (the last of repeated flags wins).

    ``append`` adds an item to the list the earlier operations left (once).
    """
    for op, key, value in ops:
        if op == "append":
            current = list(get_field(cfg, key))
            if value not in current:
                current.append(value)
            value = current
        try:
            cfg = replace_field(cfg, key, value)
        except (TypeError, ValueError, AssertionError) as exc:
            section = key.rpartition(".")[0] or "root"
            raise ConfigError(f"--{key}: [{section}] {exc}") from exc
    return cfg
