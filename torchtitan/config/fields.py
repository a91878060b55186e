"""Walking the JobConfig dataclasses: dotted keys, field types and defaults, get/replace by key.

A config class is a tree of dataclasses (one per TOML section); a *leaf* field is one whose
type is not itself a dataclass. Leaves are named by dotted keys such as
``training.dataloader.num_workers``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache
from typing import Any, Literal, Union

__all__ = [
    "Field",
    "choice_hint",
    "field_default",
    "get_field",
    "hints",
    "is_list",
    "is_nested_list",
    "is_union",
    "leaf_fields",
    "lookup_class",
    "replace_field",
    "split_optional",
    "type_name",
]


def is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def split_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, accepts None)."""
    if is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        inner = args[0] if len(args) == 1 else Union[tuple(args)]  # noqa: UP007
        return inner, optional
    return tp, False


def is_list(tp: Any, item: Any = None) -> bool:
    if typing.get_origin(tp) is not list:
        return False
    args = typing.get_args(tp)
    return item is None or (len(args) == 1 and args[0] == item)


def is_nested_list(tp: Any) -> bool:
    args = typing.get_args(tp)
    return is_list(tp) and len(args) == 1 and is_list(args[0], str)


def type_name(tp: Any) -> str:
    """How a field type reads in an error message: ``int or None``, ``one of 'a', 'b'``."""
    inner, optional = split_optional(tp)
    if typing.get_origin(inner) is Literal:
        name = "one of " + ", ".join(repr(c) for c in typing.get_args(inner))
    elif is_nested_list(inner):
        name = "list of lists of str"
    elif is_list(inner):
        (item,) = typing.get_args(inner) or (Any,)
        name = f"comma-separated list of {getattr(item, '__name__', item)}"
    elif is_union(inner):
        name = " or ".join(type_name(a) for a in typing.get_args(inner))
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or None" if optional else name


def choice_hint(value: Any, tp: Any) -> str:
    """``; did you mean 'selective'?`` for a string that is none of a Literal field's choices
    but close to one (another case, a typo); else ""."""
    from torchtitan.config.errors import suggest

    inner, _ = split_optional(tp)
    if typing.get_origin(inner) is not Literal or not isinstance(value, str):
        return ""
    choices = [c for c in typing.get_args(inner) if isinstance(c, str)]
    same = [c for c in choices if c.lower() == value.strip().lower()]
    guess = same[0] if same else suggest(value, choices)
    return f"; did you mean {guess!r}?" if guess else ""


@cache
def hints(cls: type) -> dict[str, Any]:
    """Resolved type hints of a dataclass (cached)."""
    return typing.get_type_hints(cls)


@dataclasses.dataclass(frozen=True)
class Field:
    key: str  # dotted: "training.dataloader.num_workers"
    tp: Any

    @property
    def is_bool(self) -> bool:
        return self.tp is bool

    @property
    def is_optional_bool(self) -> bool:
        """``bool | None`` (None: decided elsewhere, e.g. by the model flavor)."""
        return split_optional(self.tp) == (bool, True)


def leaf_fields(cls: type, prefix: str = "") -> dict[str, Field]:
    """Every settable leaf field of ``cls`` by dotted key (nested dataclasses flattened)."""
    out: dict[str, Field] = {}
    cls_hints = hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = cls_hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            out.update(leaf_fields(tp, key + "."))
        else:
            out[key] = Field(key, tp)
    return out


def lookup_class(cls: type, dotted: str) -> type | None:
    """The dataclass of section ``dotted`` ("" is ``cls`` itself), or None if there is none."""
    if not dotted:
        return cls
    for part in dotted.split("."):
        tp = hints(cls).get(part)
        if tp is None or not dataclasses.is_dataclass(tp):
            return None
        cls = tp
    return cls


def get_field(cfg: Any, key: str) -> Any:
    """The value of dotted ``key`` in ``cfg`` (AttributeError if there is no such field)."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def replace_field(cfg: Any, key: str, value: Any) -> Any:
    """A copy of ``cfg`` with dotted ``key`` set to ``value``.

    Every dataclass on the path is rebuilt with :func:`dataclasses.replace`, so their
    ``__post_init__`` checks run as they would for a config built from scratch.
    """
    head, _, rest = key.partition(".")
    if rest:
        value = replace_field(getattr(cfg, head), rest, value)
    return dataclasses.replace(cfg, **{head: value})


def field_default(cls: type, key: str) -> Any:
    """The default of dotted ``key`` in config class ``cls`` (a fresh copy for factories)."""
    section, _, name = key.rpartition(".")
    owner = lookup_class(cls, section)
    if owner is None:
        raise KeyError(key)
    for f in dataclasses.fields(owner):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return dataclasses.MISSING
    raise KeyError(key)
