"""Hugging Face interop: safetensors folders (read/write, sharded or not), loading HF weights
into the (possibly sharded) model, and exporting a checkpoint's weights as HF safetensors.

Key names and the wq/wk permutation are the model's state-dict adapter's business
(``to_hf`` / ``from_hf`` / ``hf_config``, e.g. torchtitan/models/llama3/state_dict_adapter.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from typing import Any

import torch

from torchtitan.components.checkpoint import fs
from torchtitan.components.checkpoint.common import (
    EXPORT_DTYPES,
    MODEL,
    CheckpointError,
    ModelWrapper,
)
from torchtitan.components.checkpoint.load import (
    check_model_shapes,
    load_dcp_model_tensors,
    tensor_shapes,
)


def load_safetensors_folder(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``folder`` (HF layout, sharded or not)."""
    from safetensors.torch import load_file

    if os.path.isfile(folder) and folder.endswith(".safetensors"):
        return load_file(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: no such HF checkpoint folder")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        sd.update(load_file(os.path.join(folder, name)))
    return sd


def save_safetensors_folder(
    state_dict: dict[str, torch.Tensor], folder: str, max_shard_bytes: int = 5 * 2**30
) -> list[str]:
    """Write ``state_dict`` as HF safetensors (``model.safetensors``, or shards plus
    ``model.safetensors.index.json`` when larger than ``max_shard_bytes``); returns file names."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(state_dict):
        t = state_dict[key].detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    total = 0
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(folder, name), metadata=meta)
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names + ["model.safetensors.index.json"]


def load_hf(path: str, model: ModelWrapper, sd_adapter: Any, exclude: list[str]) -> list[str]:
    """Load the HF safetensors at ``path`` into ``model`` (full tensors, sharded like the model's
    parameters); returns the names loaded for the log line."""
    if MODEL in exclude:
        raise CheckpointError(
            "checkpoint.initial_load_in_hf loads model weights only, but exclude_from_loading has model"
        )
    sd = sd_adapter.from_hf(load_safetensors_folder(path))
    expected = model.state_dict()
    check_model_shapes(tensor_shapes(expected), tensor_shapes(sd), f"HF checkpoint {path}")
    model.load_full_state_dict({k: sd[k] for k in expected})
    return [f"{MODEL} (HF safetensors)"]


MODEL_ARGS_KEY = "model_args"
"""Key of the commit marker (``.committed``) that records the model's architecture."""


def model_info(sd_adapter: Any | None) -> dict[str, Any]:
    """``{"model_args": {...}}`` for a checkpoint's commit marker: the architecture (heads,
    kv heads, layers, ...) that the weights' shapes alone cannot tell, so exports can check
    a flavor against it or need no flavor at all; ``{}`` when unknown."""
    args = getattr(sd_adapter, "model_args", None)
    if args is None or not dataclasses.is_dataclass(args):
        return {}
    return {MODEL_ARGS_KEY: json.loads(json.dumps(dataclasses.asdict(args), default=str))}


def hf_export_config(sd_adapter: Any, export_dtype: str, tokenizer: Any | None = None) -> dict:
    """``config.json`` of an HF export: the adapter's architecture config (``dtype``,
    ``max_position_embeddings`` of the flavor) plus the tokenizer's BOS/EOS/pad ids."""
    config = dict(sd_adapter.hf_config(export_dtype))
    if tokenizer is not None:
        from torchtitan.components.hf_assets import special_ids

        ids = special_ids(tokenizer)
        config["bos_token_id"], config["eos_token_id"] = ids["bos_token_id"], ids["eos_token_id"]
        if tokenizer.pad_id >= 0:
            config["pad_token_id"] = tokenizer.pad_id
    return config


def write_hf_folder(
    out: str,
    weights: dict[str, torch.Tensor],
    sd_adapter: Any,
    export_dtype: str,
    tokenizer: Any | None = None,
) -> list[str]:
    """Write an HF model folder from full FQN-keyed ``weights``: safetensors, ``config.json``
    and, with a ``tokenizer``, ``generation_config.json`` and the tokenizer files (so
    ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(out)`` work offline). Shared by
    ``checkpoint.last_save_in_hf`` and scripts/convert_dcp_to_hf.py; returns the file names."""
    from torchtitan.components import hf_assets

    files = save_safetensors_folder(sd_adapter.to_hf(weights), out)
    config = hf_export_config(sd_adapter, export_dtype, tokenizer)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    files.append("config.json")
    if tokenizer is not None:
        with open(os.path.join(out, "generation_config.json"), "w") as f:
            json.dump(hf_assets.generation_config(tokenizer), f, indent=2)
        files.append("generation_config.json")
        max_len = config.get("max_position_embeddings", 2048)
        files += hf_assets.save_tokenizer_files(tokenizer, out, max_len)
    return files


def export_hf(
    tmp: str,
    sd_adapter: Any,
    export_dtype: str,
    extra_non_model: Iterable[str] = (),
    tokenizer: Any | None = None,
) -> None:
    """Write ``tmp/hf``: the model weights of DCP checkpoint ``tmp`` as an HF folder
    (:func:`write_hf_folder`; rank 0; reads the full weights into host memory)."""
    weights = load_dcp_model_tensors(
        tmp, dtype=EXPORT_DTYPES[export_dtype], extra_non_model=extra_non_model
    )
    write_hf_folder(os.path.join(tmp, fs.HF_SUBFOLDER), weights, sd_adapter, export_dtype, tokenizer)
