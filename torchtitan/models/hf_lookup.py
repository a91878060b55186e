"""Which registered family an HF ``model_type``, a set of HF weight names or a set of our FQNs
belongs to, read from the registry (``ModelSpec.hf_model_types`` and each family's
``HFStateDictAdapter`` key map), so a new family is found without editing any table.

Several families may share an adapter (``llama2`` is Llama 3's model with other flavors);
the family whose folder holds the adapter is then the one named (``llama3``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torchtitan.models import get_model_spec, list_model_specs
from torchtitan.models.common.hf_adapter import HFStateDictAdapter, covers
from torchtitan.models.spec import ModelSpec


def adapter_class(spec: ModelSpec) -> type | None:
    """The spec's HF adapter class (imported on first use), or None."""
    adapter = spec.state_dict_adapter
    if adapter is None:
        return None
    resolve = getattr(adapter, "resolve", None)
    return resolve() if resolve is not None else adapter


def _owns_adapter(spec: ModelSpec) -> bool:
    adapter = spec.state_dict_adapter
    where = getattr(adapter, "target", None) or getattr(adapter, "__module__", "")
    return where.startswith(f"torchtitan.models.{spec.name}.")


def _preferred(specs: list[ModelSpec]) -> ModelSpec | None:
    """The adapter's own family first, then by name."""
    return min(specs, key=lambda s: (not _owns_adapter(s), s.name), default=None)


def _specs() -> list[ModelSpec]:
    return [get_model_spec(name) for name in list_model_specs()]


def hf_model_types() -> list[str]:
    """Every HF ``model_type`` a registered family reads, sorted."""
    return sorted({t for spec in _specs() for t in spec.hf_model_types})


def spec_for_hf_model_type(model_type: str) -> ModelSpec | None:
    """The family that reads HF ``model_type`` (None: no registered family does)."""
    return _preferred([s for s in _specs() if model_type in s.hf_model_types])


def _fits(keys: Iterable[str], hf: bool) -> list[tuple[float, ModelSpec]]:
    """(share of the adapter's patterns used, spec) of every family that holds ``keys``."""
    keys = list(keys)
    scores: dict[type, float | None] = {}
    fits: list[tuple[float, ModelSpec]] = []
    for spec in _specs():
        cls = adapter_class(spec)
        if cls is None:
            continue
        if cls not in scores:
            scores[cls] = covers(cls, keys, hf)
        if scores[cls] is not None:
            fits.append((scores[cls], spec))
    return fits


def _best_fit(keys: Iterable[str], hf: bool) -> ModelSpec | None:
    fits = _fits(keys, hf)
    best = max((score for score, _ in fits), default=None)
    return _preferred([spec for score, spec in fits if score == best])


def spec_for_hf_keys(keys: Iterable[str]) -> ModelSpec | None:
    """The family whose HF key map holds every one of ``keys`` (HF weight names) and fits them
    best (the largest share of its patterns used: Llama's weights fit Qwen3's map too, but
    fill Llama's); None when no family's map holds them all or no layer weight is there."""
    return _best_fit(keys, hf=True)


def spec_for_fqns(keys: Iterable[str]) -> ModelSpec | None:
    """The family whose FQNs ``keys`` are (the same rule on our side of the key maps)."""
    return _best_fit(keys, hf=False)


def fqns_fit(spec: ModelSpec, keys: Iterable[str]) -> bool:
    """Whether ``spec``'s adapter fits our FQNs ``keys`` as well as any family's does (True
    when its adapter is not a declarative ``HFStateDictAdapter``: nothing to compare)."""
    cls = adapter_class(spec)
    if not isinstance(cls, type) or not issubclass(cls, HFStateDictAdapter):
        return True
    fits = _fits(keys, hf=False)
    best = max((score for score, _ in fits), default=None)
    return best is None or any(s is spec and score == best for score, s in fits)


def same_adapter(a: ModelSpec | None, b: Any) -> bool:
    """Whether ``a`` converts with the adapter class of ``b`` (a spec or an adapter)."""
    if a is None or b is None:
        return False
    other = adapter_class(b) if isinstance(b, ModelSpec) else type(b)
    return adapter_class(a) is other
