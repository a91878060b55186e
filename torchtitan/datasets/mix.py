"""Dataset mixes: ``training.dataset = "c4_test:0.7,mine=/data/x.jsonl:0.3"``.

A single name (``c4_test``) is one source. A comma-separated list of ``NAME[=PATH]:WEIGHT``
entries is a mix: every packed sequence of the global stream comes from one source, drawn with
probability ``weight / sum(weights)`` by a counter-based hash of ``(seed, sequence index)``,
so the choice of sequence ``j`` needs no RNG state: it is the same on every rank and worker,
and after any resume. Pure Python (no torch): the config validation parses with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SourceSpec", "is_mix", "parse_dataset_spec", "pick_source", "uniform"]

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class SourceSpec:
    name: str
    path: str | None
    weight: float


def is_mix(spec: str) -> bool:
    return "," in spec or ":" in spec


def parse_dataset_spec(spec: str, path: str | None = None, key: str = "training.dataset") -> list[SourceSpec]:
    """The sources of ``spec``; ``ValueError`` (one line naming ``key``) for a bad mix."""
    if not is_mix(spec):
        if not spec.strip():
            raise ValueError(f"{key} is empty: name a dataset (e.g. c4_test)")
        return [SourceSpec(spec, path, 1.0)]
    if path:
        raise ValueError(
            f"{key}={spec!r} is a mix and the dataset_path {path!r} would apply to no entry: "
            "give each entry its own path as NAME=PATH:WEIGHT"
        )
    out: list[SourceSpec] = []
    for entry in spec.split(","):
        head, sep, weight = entry.strip().rpartition(":")
        name, _, entry_path = head.partition("=")
        name = name.strip()
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not sep or not name or not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"{key} entry {entry.strip()!r} is not NAME[=PATH]:WEIGHT with a weight > 0 "
                "(e.g. 'c4_test:0.7,mine=/data/x.jsonl:0.3')"
            )
        if any(s.name == name for s in out):
            raise ValueError(f"{key} names {name!r} twice; give each source one entry")
        out.append(SourceSpec(name, entry_path.strip() or None, value))
    return out


def uniform(seed: int, index: int) -> float:
    """A number in [0, 1) from ``(seed, index)`` alone (splitmix64 of the pair)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def pick_source(weights: list[float], seed: int, index: int) -> int:
    """The source of sequence ``index``: ``i`` with probability ``weights[i] / sum(weights)``."""
    if len(weights) == 1:
        return 0
    u = uniform(seed, index) * sum(weights)
    for i, w in enumerate(weights):
        u -= w
        if u < 0:
            return i
    return len(weights) - 1
