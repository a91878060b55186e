"""Resolve a :class:`JobConfig`: dataclass defaults < TOML file < command-line flags.

``ConfigManager().parse_args(argv)`` does the work; ``parse_args_or_exit`` is the
entry point for programs (one ``error: ...`` line and exit code 2 on a bad config);
``python -m torchtitan.config_manager`` (= ``python -m torchtitan.config.manager``)
prints the resolved config. See docs/config.md for the flag syntax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import importlib.util
import io
import json
import math
import sys
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any, Literal, Union

import tyro
from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo

from torchtitan.config import legacy, registry
from torchtitan.config.job_config import JobConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "ConfigManager",
    "config_save_path",
    "config_to_toml",
    "main",
    "parse_args_or_exit",
    "save_config",
]

PROG = "python -m torchtitan.config_manager"
_DESCRIPTION = (
    "Resolve a torchtitan JobConfig: defaults < TOML (--job.config_file FILE, or "
    "--module M --config NAME for a bundled config) < flags. Booleans are actions "
    "(--x.flag / --x.no_flag); lists take one comma-separated value (a,b); None sets "
    "an optional field to None. Tool-only flag: --json prints JSON instead of TOML."
)


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line meant for people."""


# --------------------------------------------------------------------------- types


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, accepts None)."""
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        inner = args[0] if len(args) == 1 else Union[tuple(args)]  # noqa: UP007
        return inner, optional
    return tp, False


def _is_list(tp: Any, item: Any = None) -> bool:
    if typing.get_origin(tp) is not list:
        return False
    args = typing.get_args(tp)
    return item is None or (len(args) == 1 and args[0] == item)


def _is_nested_list(tp: Any) -> bool:
    args = typing.get_args(tp)
    return _is_list(tp) and len(args) == 1 and _is_list(args[0], str)


def _type_name(tp: Any) -> str:
    inner, optional = _split_optional(tp)
    if typing.get_origin(inner) is Literal:
        name = "one of " + ", ".join(repr(c) for c in typing.get_args(inner))
    elif _is_nested_list(inner):
        name = "list of lists of str"
    elif _is_list(inner):
        (item,) = typing.get_args(inner) or (Any,)
        name = f"comma-separated list of {getattr(item, '__name__', item)}"
    elif _is_union(inner):
        name = " or ".join(_type_name(a) for a in typing.get_args(inner))
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or None" if optional else name


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@dataclasses.dataclass(frozen=True)
class _Field:
    key: str  # dotted: "training.dataloader.num_workers"
    tp: Any

    @property
    def is_bool(self) -> bool:
        return self.tp is bool


def _fields(cls: type, prefix: str = "") -> dict[str, _Field]:
    """Every settable leaf field of ``cls`` by dotted key (nested dataclasses flattened)."""
    out: dict[str, _Field] = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            out.update(_fields(tp, key + "."))
        else:
            out[key] = _Field(key, tp)
    return out


def _parse_nested(text: str) -> list[list[str]]:
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


def _split_commas(text: str) -> list[str]:
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
    if _is_union(tp):
        for arg in typing.get_args(tp):
            with contextlib.suppress(ValueError, TypeError):
                return _convert_scalar(text, arg)
        raise ValueError(text)
    raise TypeError(f"type {tp} cannot be given on the command line")


def _from_cli(text: str, tp: Any) -> Any:
    inner, optional = _split_optional(tp)
    if optional and text == "None":
        return None
    if _is_nested_list(inner):
        return _parse_nested(text)
    if _is_list(inner):
        (item,) = typing.get_args(inner) or (str,)
        return [_convert_scalar(s, item) for s in _split_commas(text)]
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
    if _is_union(tp):
        for arg in typing.get_args(tp):
            ok, conv = _check_toml_scalar(value, arg, lenient)
            if ok:
                return True, conv
        return False, value
    return True, value  # types we do not know how to check: accept as written


def _from_toml(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, converted value) for a TOML value destined for a field of type ``tp``."""
    inner, optional = _split_optional(tp)
    if optional and value == "None":
        return True, None
    if _is_nested_list(inner):
        ok = isinstance(value, list) and all(
            isinstance(p, list) and all(isinstance(s, str) for s in p) for p in value
        )
        return ok, value
    if _is_list(inner):
        (item,) = typing.get_args(inner) or (Any,)
        if isinstance(value, str):  # legacy: "a,b" strings for list fields
            value = _split_commas(value)
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


# ------------------------------------------------------------------- tyro registry


def _list_rule(item: type) -> PrimitiveConstructorSpec:
    return PrimitiveConstructorSpec(
        nargs=1,
        metavar="A,B,...",
        instance_from_str=lambda args: [item(s) for s in _split_commas(args[0])],
        is_instance=lambda v: isinstance(v, list) and all(isinstance(i, item) for i in v),
        str_from_instance=lambda v: [",".join(str(i) for i in v)],
    )


_REGISTRY = ConstructorRegistry()


@_REGISTRY.primitive_rule
def _comma_lists(info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec | None:
    """list[str|int|float] take one comma-separated token; list[list[str]] takes a;b or JSON."""
    for item in (str, int, float):
        if info.type == list[item]:
            return _list_rule(item)
    if info.type == list[list[str]]:
        return PrimitiveConstructorSpec(
            nargs=1,
            metavar="A,B;C or JSON",
            instance_from_str=lambda args: _parse_nested(args[0]),
            is_instance=lambda v: isinstance(v, list) and all(isinstance(p, list) for p in v),
            str_from_instance=lambda v: [json.dumps(v)],
        )
    return None


# ----------------------------------------------------------------- error messages


def _suggest(word: str, candidates: list[str]) -> str | None:
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


def _unknown_flag(name: str, fields: dict[str, _Field]) -> str:
    names = list(fields)
    guess = _suggest(name, names)
    if guess is None:
        last = name.rsplit(".", 1)[-1]
        same = [k for k in names if k.rsplit(".", 1)[-1] == last]
        guess = same[0] if same else _suggest(last, [k.rsplit(".", 1)[-1] for k in names])
        if guess is not None and guess not in names:
            guess = next(k for k in names if k.rsplit(".", 1)[-1] == guess)
    hint = f" (did you mean --{guess}?)" if guess else ""
    return f"unknown flag --{name}{hint}; run with --help to list the flags"


def _unknown_key(key: str, cls: type, where: str) -> str:
    section, _, name = key.rpartition(".")
    owner = _lookup_class(cls, section)
    local = [f.name for f in dataclasses.fields(owner)] if owner else []
    guess = _suggest(name, local)
    if guess is not None:
        hint = f" (did you mean {section}.{guess}?)" if section else f" (did you mean [{guess}]?)"
    else:
        others = [k for k in _fields(cls) if k.rsplit(".", 1)[-1] == name]
        hint = f" (did you mean {others[0]}?)" if others else ""
    if not section:
        return f"{where}: unknown section [{name}]{hint}"
    return f"{where}: unknown key {name!r} in [{section}]{hint}"


def _lookup_class(cls: type, dotted: str) -> type | None:
    if not dotted:
        return cls
    for part in dotted.split("."):
        tp = _hints(cls).get(part)
        if tp is None or not dataclasses.is_dataclass(tp):
            return None
        cls = tp
    return cls


# -------------------------------------------------------------- config classes


def _load_custom_module(name: str) -> type:
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
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(name)
    except ConfigError:
        raise
    except Exception as exc:  # any import failure is a config problem for the user
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"job.custom_config_module: cannot import {name!r}: {msg}") from exc
    custom = getattr(module, "JobConfig", None)
    if not (isinstance(custom, type) and dataclasses.is_dataclass(custom)):
        raise ConfigError(
            f"job.custom_config_module: {name!r} defines no dataclass named JobConfig"
        )
    return _merge_classes(JobConfig, custom)


def _merge_classes(base: type, custom: type) -> type:
    """``custom`` if it subclasses ``base``; otherwise a dataclass with both field sets
    (same-named sections merged recursively, the custom definition winning)."""
    if issubclass(custom, base):
        return custom
    base_hints, custom_hints = _hints(base), _hints(custom)
    merged_fields = []
    for f in dataclasses.fields(custom):
        b, c = base_hints.get(f.name), custom_hints[f.name]
        if dataclasses.is_dataclass(b) and dataclasses.is_dataclass(c):
            sub = _merge_classes(b, c)
            merged_fields.append((f.name, sub, dataclasses.field(default_factory=sub)))
    return dataclasses.make_dataclass(base.__name__, merged_fields, bases=(custom, base))


# -------------------------------------------------------------------- TOML input


def _read_toml(path_text: str) -> dict:
    path = Path(path_text)
    if not path.exists():
        raise ConfigError(f"config file not found: {path_text}")
    if path.is_dir():
        raise ConfigError(f"config file {path_text} is a directory, expected a .toml file")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path_text}: invalid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path_text}: not UTF-8 text ({exc.reason})") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path_text}: {exc.strerror}") from exc


def _build(cls: type, data: dict, where: str, root: type | None = None, prefix: str = "") -> Any:
    """Instantiate ``cls`` from a TOML table, checking every key and value."""
    root = root or cls
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in names:
            if not prefix and not isinstance(value, dict):
                others = [k for k in _fields(root) if k.rsplit(".", 1)[-1] == name]
                hint = (
                    f" (did you mean {others[0]} under [{others[0].rsplit('.', 1)[0]}]?)"
                    if others
                    else ""
                )
                raise ConfigError(f"{where}: key {name!r} must be inside a [section]{hint}")
            raise ConfigError(_unknown_key(key, root, where))
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {key} must be a table [{key}], got {value!r}")
            kwargs[name] = _build(tp, value, where, root, key + ".")
            continue
        if isinstance(value, dict):
            raise ConfigError(f"{where}: [{key}] is a table, but {key} expects {_type_name(tp)}")
        ok, converted = _from_toml(value, tp)
        if not ok:
            raise ConfigError(
                f"{where}: {key} = {value!r} has the wrong type (expected {_type_name(tp)})"
            )
        kwargs[name] = converted
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ConfigError(f"{where}: [{prefix.rstrip('.') or 'root'}] {exc}") from exc


# --------------------------------------------------------------------- CLI input


def _flag_name(token: str) -> tuple[str, str | None]:
    """``--a-b.c-d=v`` -> (``a_b.c_d``, ``v``); the name is normalised to underscores."""
    body = token[2:]
    name, eq, value = body.partition("=")
    return name.replace("-", "_"), (value if eq else None)


def _looks_like_flag(token: str) -> bool:
    return token.startswith("--") and len(token) > 2


def _take_manager_flags(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Pull --job.config_file, --module and --config out of argv."""
    wanted = {"job.config_file": "config_file", "module": "module", "config": "config"}
    rest: list[str] = []
    found: dict[str, str] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        name, value = _flag_name(token) if _looks_like_flag(token) else ("", None)
        if name in wanted:
            if value is None:
                if i + 1 >= len(argv) or _looks_like_flag(argv[i + 1]):
                    raise ConfigError(f"--{name} expects a value")
                value = argv[i + 1]
                i += 1
            found[wanted[name]] = value
        else:
            rest.append(token)
        i += 1
    return rest, found


def _peek(argv: list[str], names: tuple[str, ...]) -> str | None:
    """Last value given to any of ``names`` in argv (without consuming it)."""
    value = None
    for i, token in enumerate(argv):
        if not _looks_like_flag(token):
            continue
        name, inline = _flag_name(token)
        if name in names:
            if inline is not None:
                value = inline
            elif i + 1 < len(argv):
                value = argv[i + 1]
    return value


def _bool_misuse(flag: str, got: str) -> str:
    section, _, name = flag.rpartition(".")
    off = f"--{section}.no_{name}" if section else f"--no_{name}"
    return (
        f"--{flag} is a boolean flag and takes no value (got {got!r}): "
        f"use --{flag} to turn it on and {off} to turn it off"
    )


def _parse_cli(argv: list[str], fields: dict[str, _Field]) -> list[tuple[str, str, Any]]:
    """Validate argv and turn it into ordered ("set"|"append", key, value) operations."""
    ops: list[tuple[str, str, Any]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not _looks_like_flag(token):
            raise ConfigError(
                f"unexpected argument {token!r}: every setting is a --section.key flag"
            )
        name, inline = _flag_name(token)
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
            if rule.new is None:  # dropped: swallow a value if one follows
                value = None
                if inline is None and i < len(argv) and not _looks_like_flag(argv[i]):
                    i += 1
            elif kind == "bool":
                if inline is not None:
                    raise ConfigError(_bool_misuse(target, inline))
                if i < len(argv) and not _looks_like_flag(argv[i]):
                    raise ConfigError(_bool_misuse(target, argv[i]))
                value: Any = not negated
            else:
                value, i = _value(argv, i, inline, name)
                if rule.transform is None and rule.new in fields:
                    value = _convert(value, fields[rule.new], f"--{name}")
            legacy.warn(legacy.describe(rule, target, flag=True))
            try:
                ops.extend(rule.ops(value))
            except legacy.LegacyValueError as exc:
                raise ConfigError(str(exc)) from exc
            continue

        field = fields.get(target)
        if field is None:
            raise ConfigError(_unknown_flag(name, fields))
        if target in legacy.DEPRECATED:
            legacy.warn(f"deprecated flag --{target}: {legacy.DEPRECATED[target]}")
        if field.is_bool:
            if inline is not None:
                raise ConfigError(_bool_misuse(target, inline))
            if i < len(argv) and not _looks_like_flag(argv[i]):
                raise ConfigError(_bool_misuse(target, argv[i]))
            ops.append(("set", target, not negated))
            continue
        if negated:  # --x.no_key for a key that is not a boolean
            raise ConfigError(_unknown_flag(name, fields))
        text, i = _value(argv, i, inline, target)
        ops.append(("set", target, _convert(text, field, f"--{target}")))
    return ops


def _value(argv: list[str], i: int, inline: str | None, name: str) -> tuple[str, int]:
    if inline is not None:
        return inline, i
    if i >= len(argv) or _looks_like_flag(argv[i]):
        raise ConfigError(f"--{name} expects a value")
    return argv[i], i + 1


def _convert(text: str, field: _Field, flag: str) -> Any:
    try:
        return _from_cli(text, field.tp)
    except TypeError as exc:
        raise ConfigError(f"{flag}: {exc}; set it in the TOML file instead") from exc
    except ValueError as exc:
        raise ConfigError(
            f"{flag}: invalid value {text!r} (expected {_type_name(field.tp)})"
        ) from exc


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _tyro_args(ops: list[tuple[str, str, Any]], base: Any, fields: dict[str, _Field]) -> list[str]:
    """Canonical tyro tokens for the final value of every key the CLI touched."""
    values: dict[str, Any] = {}
    for op, key, value in ops:
        if op == "append":
            current = list(values.get(key, _get(base, key)))
            if value not in current:
                current.append(value)
            value = current
        values[key] = value
    args: list[str] = []
    for key, value in values.items():
        tp = fields[key].tp
        inner, _ = _split_optional(tp)
        if tp is bool:
            section, _, name = key.rpartition(".")
            off = f"--{section}.no_{name}" if section else f"--no_{name}"
            args.append(f"--{key}" if value else off)
        elif value is None:
            args.append(f"--{key}=None")
        elif _is_nested_list(inner):
            args.append(f"--{key}={json.dumps(value)}")
        elif _is_list(inner):
            args.append(f"--{key}={','.join(str(v) for v in value)}")
        else:
            args.append(f"--{key}={value}")
    return args


def _run_tyro(cls: type, base: Any, args: list[str], prog: str | None) -> Any:
    kwargs = dict(
        default=base,
        args=args,
        registry=_REGISTRY,
        use_underscores=True,
        prog=prog,
        description=_DESCRIPTION,
    )
    if "--help" in args:
        return tyro.cli(cls, **kwargs)  # prints help and raises SystemExit(0)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
            return tyro.cli(cls, **kwargs)
    except SystemExit as exc:
        # tyro draws a box: a title row, then the message; keep the first message row.
        rows = [ln.strip(" │╭╮╰╯─┃┏┗━-+|") for ln in err.getvalue().splitlines()]
        rows = [r for r in rows[1:] if r and not r.startswith(("usage", "For full"))]
        detail = rows[0] if rows else "tyro rejected the flags"
        raise ConfigError(f"cannot parse flags: {detail}") from exc


# -------------------------------------------------------------------- validation


def _ge(n: float) -> tuple[Any, str]:
    return (lambda v: v >= n), f"must be >= {n}"


def _gt(n: float) -> tuple[Any, str]:
    return (lambda v: v > n), f"must be > {n}"


def _unit(lo_open: bool = False, hi_open: bool = False) -> tuple[Any, str]:
    def ok(v: float) -> bool:
        return (0 < v if lo_open else 0 <= v) and (v < 1 if hi_open else v <= 1)

    return ok, f"must be in {'(' if lo_open else '['}0, 1{')' if hi_open else ']'}"


def _opt(check: tuple[Any, str]) -> tuple[Any, str]:
    fn, msg = check
    return (lambda v: v is None or fn(v)), msg + " (or None)"


def _or_minus_one(check: tuple[Any, str]) -> tuple[Any, str]:
    fn, msg = check
    return (lambda v: v == -1 or fn(v)), msg + " or -1"


_CHECKS: dict[str, tuple[Any, str]] = {
    "parallelism.data_parallel_replicate_degree": _ge(1),
    "parallelism.data_parallel_shard_degree": (
        lambda v: v == -1 or v >= 1,
        "must be >= 1, or -1 to use the ranks left over by the other degrees",
    ),
    "parallelism.tensor_parallel_degree": _ge(1),
    "parallelism.pipeline_parallel_degree": _ge(1),
    "parallelism.context_parallel_degree": _ge(1),
    "parallelism.expert_parallel_degree": _ge(1),
    "parallelism.expert_tensor_parallel_degree": _ge(1),
    "parallelism.pipeline_parallel_microbatch_size": _ge(1),
    "parallelism.pipeline_parallel_first_stage_less_layers": _ge(0),
    "parallelism.pipeline_parallel_last_stage_less_layers": _ge(0),
    "parallelism.pipeline_parallel_layers_per_stage": _opt(_ge(1)),
    "training.steps": _gt(0),
    "training.local_batch_size": _gt(0),
    "training.global_batch_size": _or_minus_one(_gt(0)),
    "training.seq_len": _gt(0),
    "training.gc_freq": _gt(0),
    "training.dataloader.num_workers": _ge(0),
    "training.dataloader.prefetch_factor": _opt(_gt(0)),
    "optimizer.lr": _ge(0),
    "optimizer.eps": _ge(0),
    "optimizer.weight_decay": _ge(0),
    "optimizer.beta1": _unit(hi_open=True),
    "optimizer.beta2": _unit(hi_open=True),
    "lr_scheduler.warmup_steps": _ge(0),
    "lr_scheduler.decay_ratio": _opt(_unit()),
    "lr_scheduler.min_lr_factor": _unit(),
    "checkpoint.interval": _gt(0),
    "checkpoint.keep_latest_k": _ge(0),
    "checkpoint.load_step": _ge(-1),
    "metrics.log_freq": _gt(0),
    "profiling.profile_freq": _gt(0),
    "profiling.profiler_active": _gt(0),
    "profiling.profiler_warmup": _ge(0),
    "comm.init_timeout_seconds": _gt(0),
    "comm.train_timeout_seconds": _gt(0),
    "comm.trace_buf_size": _ge(0),
    "activation_checkpoint.memory_budget": _unit(),
    "validation.local_batch_size": _gt(0),
    "validation.seq_len": _gt(0),
    "validation.freq": _gt(0),
    "validation.steps": _or_minus_one(_gt(0)),
    "fault_tolerance.replica_id": _ge(0),
    "fault_tolerance.group_size": _ge(0),
    "fault_tolerance.min_replica_size": _ge(1),
    "fault_tolerance.process_group_timeout_ms": _gt(0),
}


def validate(cfg: Any) -> None:
    """Check what the config alone can tell (ranges, formats); raise ConfigError.

    Checks that need the world size (degrees multiplying up to it, batch
    divisibility) happen where the mesh is built.
    """
    for key, (ok, msg) in _CHECKS.items():
        try:
            value = _get(cfg, key)
        except AttributeError:
            continue
        bad = isinstance(value, float) and math.isnan(value)
        if bad or not ok(value):
            raise ConfigError(f"{key} {msg}, got {value!r}")
    ac = getattr(cfg, "activation_checkpoint", None)
    option = getattr(ac, "selective_ac_option", "op")
    if option != "op" and not (option.isdigit() and int(option) > 0):
        raise ConfigError(
            f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer "
            f"(checkpoint every Nth block), got {option!r}"
        )
    dl = getattr(getattr(cfg, "training", None), "dataloader", None)
    if dl is not None and dl.num_workers == 0:
        for name in ("persistent_workers", "prefetch_factor"):
            if getattr(dl, name) not in (None, False):
                raise ConfigError(
                    f"training.dataloader.{name} needs training.dataloader.num_workers > 0"
                )


# ------------------------------------------------------------------------ manager


class ConfigManager:
    """Builds the JobConfig for a run: defaults < TOML < CLI flags."""

    def __init__(self, prog: str | None = None) -> None:
        self.prog = prog
        self.config: JobConfig | None = None

    def parse_args(self, args: list[str] | None = None) -> JobConfig:
        """Resolve ``args`` (default ``sys.argv[1:]``) into a validated JobConfig.

        Raises ConfigError for anything wrong with the config; ``--help`` prints
        the flag list and raises SystemExit(0).
        """
        argv = list(sys.argv[1:] if args is None else args)
        want_help = any(a in ("-h", "--help") for a in argv)
        argv = [a for a in argv if a not in ("-h", "--help")]
        argv, manager = _take_manager_flags(argv)
        config_file = self._config_file(manager)

        toml_data: dict = {}
        where = config_file or ""
        if config_file is not None:
            toml_data = _read_toml(config_file)
            try:
                legacy.migrate_toml(toml_data, config_file)
            except legacy.LegacyValueError as exc:
                raise ConfigError(f"{config_file}: {exc}") from exc

        cls = self._config_class(argv, toml_data)
        base = _build(cls, toml_data, where)
        base.job.config_file = config_file
        fields = _fields(cls)

        if want_help:
            return _run_tyro(cls, base, ["--help"], self.prog)
        ops = _parse_cli(argv, fields)
        # tyro parses the (validated, canonicalised) flags on top of the TOML values;
        # with no flags there is nothing to parse and the TOML result is final.
        cfg = _run_tyro(cls, base, _tyro_args(ops, base, fields), self.prog) if ops else base
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
        name = _peek(argv, ("job.custom_config_module", "experimental.custom_args_module"))
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
        return _load_custom_module(name)


def parse_args_or_exit(argv: list[str] | None = None) -> JobConfig:
    """Parse like ConfigManager, but print one ``error:`` line and exit 2 on a bad config."""
    try:
        return ConfigManager().parse_args(argv)
    except ConfigError as exc:
        _print_error(exc)
        raise SystemExit(2) from None


def _print_error(exc: Exception) -> None:
    message = " ".join(str(exc).split("\n")).strip()
    print(f"error: {message}", file=sys.stderr)


# ------------------------------------------------------------------- TOML output


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return (
            repr(value)
            if not isinstance(value, float) or math.isfinite(value)
            else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
        )
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _write_table(obj: Any, name: str, out: list[str]) -> None:
    scalars: list[str] = []
    tables: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        if name == "job" and f.name == "config_file":
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            tables.append((f"{name}.{f.name}" if name else f.name, value))
        elif value is None:
            if _default_of(f) is None:
                scalars.append(f"# {f.name} = None")
            else:
                scalars.append(f'{f.name} = "None"')
        else:
            scalars.append(f"{f.name} = {_toml_value(value)}")
    if name:
        out.append(f"\n[{name}]")
    out.extend(scalars)
    for sub_name, sub in tables:
        _write_table(sub, sub_name, out)


def config_to_toml(cfg: Any) -> str:
    """The config as TOML that loads back to the same config.

    ``job.config_file`` is left out (the file is the config). A None field whose
    default is None is written as a comment; one whose default is not None is
    written as the string "None", which optional fields read as None.
    """
    out = ["# torchtitan job config (resolved)"]
    _write_table(cfg, "", out)
    return "\n".join(out) + "\n"


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write :func:`config_to_toml` to ``path`` (atomically; parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(config_to_toml(cfg))
    tmp.replace(path)
    return path


def config_save_path(cfg: Any) -> Path | None:
    """Where ``job.save_config_file`` asks the config to be saved (inside dump_folder)."""
    name = cfg.job.save_config_file
    if not name:
        return None
    return Path(cfg.job.dump_folder) / name


# --------------------------------------------------------------------------- tool


def main(argv: list[str] | None = None) -> int:
    """``python -m torchtitan.config_manager [--json] [flags]``: print the resolved config."""
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    try:
        cfg = ConfigManager(prog=PROG).parse_args(args)
    except ConfigError as exc:
        _print_error(exc)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    if as_json:
        print(json.dumps(dataclasses.asdict(cfg), indent=2))
    else:
        print(config_to_toml(cfg), end="")
    return 0


if __name__ == "__main__":
    from torchtitan.config.manager import main as _main

    raise SystemExit(_main())
