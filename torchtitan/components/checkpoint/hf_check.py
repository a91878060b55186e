"""Does an HF folder belong to this model? ``config.json`` against the flavor, and the weights'
family (from their names) against ``config.json`` or the model.

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

CONFIG = "config.json"

HF_MODEL_TYPES = {
    "llama": "llama3",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v2": "deepseek_v3",
}
"""HF ``model_type`` -> torchtitan ``model.name``."""

# HF model_type -> what the weights' names can tell apart.
_KIND = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
         "deepseek_v3": "deepseek", "deepseek_v2": "deepseek"}
# Not the architecture: the context length (a run picks its own), the export dtype, the RoPE
# layout of DeepSeek (the import follows the folder's), DeepSeek's MTP layer (dropped on import).
_NOT_COMPARED = {"architectures", "dtype", "max_position_embeddings", "rope_interleave",
                 "num_nextn_predict_layers"}


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


def hf_kind_of_keys(keys: Iterable[str]) -> str | None:
    """``llama`` / ``qwen3`` / ``qwen3_moe`` / ``deepseek`` from HF tensor names (None: none)."""
    keys = list(keys)
    if any("kv_a_proj_with_mqa" in k for k in keys):
        return "deepseek"
    if any(".self_attn.q_norm." in k for k in keys):
        moe = any(".mlp.experts." in k or k.endswith(".mlp.gate.weight") for k in keys)
        return "qwen3_moe" if moe else "qwen3"
    if any(".self_attn.q_proj." in k for k in keys):
        return "llama"
    return None


def model_of_fqns(keys: Iterable[str]) -> str | None:
    """The torchtitan model (``llama3`` / ``qwen3`` / ``deepseek_v3``) whose FQNs ``keys`` are."""
    keys = list(keys)
    if any(".attention.wkv_a." in k for k in keys):
        return "deepseek_v3"
    if any(".attention.q_norm." in k for k in keys):
        return "qwen3"
    if any(".attention.wq." in k for k in keys):
        return "llama3"
    return None


def model_type_of(sd_adapter: Any) -> str:
    """The HF ``model_type`` of ``sd_adapter``'s model ("" when HF cannot express it)."""
    try:
        return str(sd_adapter.hf_config().get("model_type", ""))
    except ValueError:
        return ""


def other_kind(model_type: str, hf_keys: Iterable[str]) -> str | None:
    """The weights' family (``hf_kind_of_keys``) when it is not ``model_type``'s, else None."""
    want, have = _KIND.get(model_type), hf_kind_of_keys(hf_keys)
    return have if want is not None and have is not None and want != have else None


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
    return _comparable(adapter_cls(args).hf_config())


def _comparable(hf_config: dict[str, Any]) -> dict[str, Any]:
    config = {k: v for k, v in hf_config.items() if k not in _NOT_COMPARED}
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
    if HF_MODEL_TYPES.get(model_type) != HF_MODEL_TYPES.get(want_type):
        raise CheckpointError(
            f"{source}: model_type is {model_type}, the flavor is a "
            f"{HF_MODEL_TYPES.get(want_type, want_type)} model ({want_type})"
        )
    try:
        have = _normalized(config, type(sd_adapter))
    except KeyError as err:
        raise CheckpointError(f"{source} has no {err.args[0]}") from None
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{source}: {err}") from None
    want = _comparable(flavor_hf)
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
