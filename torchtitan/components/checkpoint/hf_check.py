"""Does an HF folder belong to this model? ``config.json`` against the flavor, and the weights'
family (from their names) against ``config.json`` or the model. Families are the registry's
(``models/hf_lookup.py``: each ``ModelSpec``'s ``hf_model_types`` and its adapter's key map).

The comparison is made in HF's own terms: the folder's ``config.json`` and the flavor are both
turned into the ``config.json`` torchtitan would export (the adapter's ``args_from_hf_config`` and
``hf_config``), so equivalent spellings (``rope_scaling`` vs ``rope_parameters``, defaults left
out) agree, and a difference is reported under its HF name.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from typing import Any

from torchtitan.components.checkpoint.common import CheckpointError
from torchtitan.models import hf_lookup

CONFIG = "config.json"

_NOT_COMPARED = frozenset({"architectures", "dtype", "max_position_embeddings"})
"""Fields no adapter compares (the adapter's ``not_compared`` adds its family's own)."""


def read_config(folder: str) -> dict[str, Any] | None:
    """``folder``'s ``config.json`` (None when there is none); CheckpointError naming the file
    when it is not a JSON object."""
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is unreadable ({err})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return config


def _family(model_type: str) -> str | None:
    spec = hf_lookup.spec_for_hf_model_type(model_type)
    return None if spec is None else spec.name


def hf_kind_of_keys(keys: Iterable[str]) -> str | None:
    """The HF ``model_type`` of the family HF tensor names ``keys`` belong to (the registry's
    key maps; None: none)."""
    spec = hf_lookup.spec_for_hf_keys(keys)
    return spec.hf_model_types[0] if spec is not None and spec.hf_model_types else None


def model_of_fqns(keys: Iterable[str]) -> str | None:
    """The torchtitan model (``model.name``) whose FQNs ``keys`` are (None: none)."""
    spec = hf_lookup.spec_for_fqns(keys)
    return None if spec is None else spec.name


def model_type_of(sd_adapter: Any) -> str:
    """The HF ``model_type`` of ``sd_adapter``'s model ("" when HF cannot express it)."""
    try:
        return str(sd_adapter.hf_config().get("model_type", ""))
    except ValueError:
        return ""


def other_kind(model_type: str, hf_keys: Iterable[str]) -> str | None:
    """The weights' family (as ``hf_kind_of_keys``) when ``model_type``'s family is another
    registered one, else None."""
    want = hf_lookup.spec_for_hf_model_type(model_type)
    have = hf_lookup.spec_for_hf_keys(hf_keys)
    if want is None or have is None or hf_lookup.same_adapter(want, have):
        return None
    return have.hf_model_types[0] if have.hf_model_types else have.name


def check_config_matches_weights(config: dict[str, Any], hf_keys: Iterable[str], source: str) -> None:
    """CheckpointError naming ``source`` (the config.json) when the weights' names are another
    family's than its ``model_type``'s (e.g. a qwen3 config.json over Llama weights)."""
    model_type = config.get("model_type", "llama")
    have = other_kind(model_type, hf_keys)
    if have is not None:
        raise CheckpointError(
            f"{source}: model_type is {model_type}, but the weights are a {have} model's (this "
            f"{CONFIG} does not belong to them)"
        )


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (a == b and type(a) is type(b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _normalized(config: dict[str, Any], adapter_cls: type) -> dict[str, Any]:
    args = adapter_cls.args_from_hf_config(config)
    return _comparable(adapter_cls(args).hf_config(), adapter_cls)


def _comparable(hf_config: dict[str, Any], adapter_cls: type) -> dict[str, Any]:
    skip = _NOT_COMPARED | getattr(adapter_cls, "not_compared", frozenset())
    config = {k: v for k, v in hf_config.items() if k not in skip}
    if "rope_parameters" in config:  # rope_scaling is its copy for older readers
        config.pop("rope_scaling", None)
    return _flat(config)


def compare_with_flavor(config: dict[str, Any], sd_adapter: Any, source: str) -> None:
    """CheckpointError ``<source>: <field> is <value>, the flavor has <value>`` for the first
    architecture field where HF ``config`` and ``sd_adapter``'s model args disagree."""
    try:
        flavor_hf = sd_adapter.hf_config()
    except ValueError as err:
        raise CheckpointError(f"{source}: the flavor has no HF equivalent ({err})") from None
    model_type = config.get("model_type", "llama")
    want_type = flavor_hf.get("model_type")
    if _family(model_type) != _family(want_type):
        raise CheckpointError(
            f"{source}: model_type is {model_type}, the flavor is a "
            f"{_family(want_type) or want_type} model ({want_type})"
        )
    try:
        have = _normalized(config, type(sd_adapter))
    except KeyError as err:
        raise CheckpointError(f"{source} has no {err.args[0]}") from None
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{source}: {err}") from None
    want = _comparable(flavor_hf, type(sd_adapter))
    diffs = [k for k in dict.fromkeys([*want, *have]) if not _same(have.get(k), want.get(k))]
    if diffs:
        key = diffs[0]
        also = f" (also different: {', '.join(diffs[1:4])})" if len(diffs) > 1 else ""
        raise CheckpointError(
            f"{source}: {key} is {json.dumps(have.get(key))}, the flavor has "
            f"{json.dumps(want.get(key))}{also}"
        )


def adapter_for_folder(sd_adapter: Any, config: dict[str, Any] | None) -> Any:
    """``sd_adapter``, or a copy that reads the folder's own weight layout (DeepSeek's
    ``rope_interleave`` comes from the imported folder, not ``model.hf_assets_path``)."""
    layout = getattr(sd_adapter, "with_hf_layout", None)
    return layout(config) if config is not None and layout is not None else sd_adapter
