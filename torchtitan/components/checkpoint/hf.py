"""Hugging Face interop: safetensors folders (read/write, sharded or not), loading HF weights
into the (possibly sharded) model, and exporting a checkpoint's weights as HF safetensors.

Key names and the wq/wk permutation are the model's state-dict adapter's business
(``to_hf`` / ``from_hf`` / ``hf_config``, e.g. torchtitan/models/llama3/state_dict_adapter.py).
Imports are checked by ``hf_files`` (missing, truncated, corrupt shards) and ``hf_check``
(``config.json`` against the flavor); exports verify the checkpoint's checksums first and refuse
to drop what HF cannot hold (a trained routing bias) unless asked.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from torchtitan.components.checkpoint import fs, hf_check, hf_files, integrity
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
from torchtitan.tools.logging import logger


class LossyExportError(CheckpointError):
    """The HF format cannot hold part of the model (the exported model would compute other
    outputs); raised unless the export is asked to be lossy."""


def load_safetensors_folder(
    folder: str, warn: Callable[[str], None] = logger.warning
) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``folder`` (HF layout, sharded or not),
    checked first (``hf_files``: index, shards present and whole); CheckpointError otherwise."""
    return hf_files.load_folder(folder, warn)


def _file_mode() -> int:
    """0o666 less this process's umask (what ``open()`` gives a new file)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


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
    mode = _file_mode()  # safetensors writes 0600 files; other tools expect a normal file's mode
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, "model.safetensors"), metadata=meta)
        os.chmod(os.path.join(folder, "model.safetensors"), mode)
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    total = 0
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(folder, name), metadata=meta)
        os.chmod(os.path.join(folder, name), mode)
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names + ["model.safetensors.index.json"]


def load_hf(path: str, model: ModelWrapper, sd_adapter: Any, exclude: list[str]) -> list[str]:
    """Load the HF safetensors at ``path`` into ``model`` (full tensors, sharded like the model's
    parameters); returns the names loaded for the log line. A folder's ``config.json`` must
    agree with the flavor, and its shards must be present and whole (one CheckpointError line
    naming the file or field otherwise)."""
    if MODEL in exclude:
        raise CheckpointError(
            "checkpoint.initial_load_in_hf loads model weights only, but exclude_from_loading has model"
        )
    config = hf_check.read_config(path) if os.path.isdir(path) else None
    config_path = os.path.join(path, hf_check.CONFIG)
    if config is not None:
        hf_check.compare_with_flavor(config, sd_adapter, config_path)
    else:
        logger.warning(
            f"Checkpoint: {path} has no {hf_check.CONFIG}: only the weights' names and shapes "
            "are checked against the flavor"
        )
    hf_sd = load_safetensors_folder(path)
    if config is not None:
        hf_check.check_config_matches_weights(config, hf_sd, config_path)
    elif kind := hf_check.other_kind(hf_check.model_type_of(sd_adapter), hf_sd):
        raise CheckpointError(
            f"HF checkpoint {path} holds a {kind} model's weights, the flavor is a "
            f"{hf_check.model_type_of(sd_adapter)} model"
        )
    adapter = hf_check.adapter_for_folder(sd_adapter, config)
    try:
        sd = adapter.from_hf(hf_sd)
    except ValueError as err:
        raise CheckpointError(f"HF checkpoint {path}: {err}") from None
    expected = model.state_dict()
    check_model_shapes(tensor_shapes(expected), tensor_shapes(sd), f"HF checkpoint {path}")
    model.load_full_state_dict({k: sd[k] for k in expected})
    return [f"{MODEL} (HF safetensors)"]


def verify_for_export(path: str) -> bool:
    """The trainer's checks of DCP checkpoint ``path`` before an export reads it: the files its
    ``.committed`` lists, with their sizes and CRC32s; CheckpointError naming the file. Returns
    False when there was nothing to verify against (no marker or no checksums: another tool's
    or an older torchtitan's checkpoint)."""
    reason, marker = fs.verify_checkpoint(path)
    if not reason:
        reason = integrity.content_problem(path) if marker is not None else ""
    if reason:
        raise CheckpointError(f"cannot export {path}: {reason}; not exporting a damaged checkpoint")
    return marker is not None and isinstance(marker.get("checksums"), dict)


def _written_files_problem(tmp: str) -> str:
    """The first data file of an uncommitted save whose CRC32 differs from the one its rank
    recorded right after writing it ("" when all match)."""
    for name in sorted(os.listdir(tmp)):
        if not name.startswith(fs.CHECKSUM_SIDECAR) or name.endswith(".part"):
            continue
        with open(os.path.join(tmp, name)) as f:
            sums = json.load(f)
        for rel, want in sorted(sums.items()):
            have = fs.file_checksum(os.path.join(tmp, rel))
            if have != want:
                return f"file {rel} has checksum {have}, its writer recorded {want}"
    return ""


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
    allow_lossy: bool = False,
    warn: Callable[[str], None] = logger.warning,
) -> list[str]:
    """Write an HF model folder from full FQN-keyed ``weights``: safetensors, ``config.json``
    and, with a ``tokenizer``, ``generation_config.json`` and the tokenizer files (so
    ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(out)`` work offline). Shared by
    ``checkpoint.last_save_in_hf`` and scripts/convert_dcp_to_hf.py; returns the file names.
    LossyExportError (nothing written) when HF cannot hold part of the model, unless
    ``allow_lossy`` (then one warning)."""
    from torchtitan.components import hf_assets

    dropped = getattr(sd_adapter, "dropped_by_export", lambda _sd: "")(weights)
    if dropped and not allow_lossy:
        raise LossyExportError(f"{dropped}; refusing to export a model that computes differently")
    if dropped:
        warn(f"HF export: {dropped} (exported anyway, as asked)")
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


def lossy_export_ahead(sd_adapter: Any | None, model_parts: Iterable[torch.nn.Module]) -> str:
    """Why ``last_save_in_hf`` will skip ``hf/`` once these model parts are trained ("" when
    it will not): MoE layers train a load-balancing routing bias (``load_balance_coeff``) that
    the adapter's HF format has no place for (asked with a non-zero stand-in bias)."""
    dropped_by_export = getattr(sd_adapter, "dropped_by_export", None)
    trained = {
        f"{name}.expert_bias": torch.ones(1)
        for part in model_parts
        for name, module in part.named_modules()
        if getattr(module, "uses_load_balance_bias", False)
    }
    if dropped_by_export is None or not trained or not dropped_by_export(trained):
        return ""
    return (
        "checkpoint.last_save_in_hf will skip hf/ at the end: this model trains a "
        "load-balancing routing bias (load_balance_coeff) that its HF format has no place for; "
        "add --checkpoint.last_save_in_hf_allow_lossy to export it anyway (transformers then "
        "routes some tokens to other experts)"
    )


def export_hf(
    tmp: str,
    sd_adapter: Any,
    export_dtype: str,
    extra_non_model: Iterable[str] = (),
    tokenizer: Any | None = None,
    allow_lossy: bool = False,
) -> None:
    """Write ``tmp/hf``: the model weights of DCP checkpoint ``tmp`` as an HF folder
    (:func:`write_hf_folder`; rank 0; reads the full weights into host memory). The data files
    are verified against the checksums their ranks recorded first. A damaged write, or a lossy
    export unless ``allow_lossy``, skips ``hf/`` with one warning (the DCP checkpoint is still
    committed: it runs before the commit, where raising would lose the save)."""
    final = tmp[: -len(fs.TMP_SUFFIX)] if tmp.endswith(fs.TMP_SUFFIX) else tmp
    problem = _written_files_problem(tmp)
    if not problem:
        weights = load_dcp_model_tensors(
            tmp, dtype=EXPORT_DTYPES[export_dtype], extra_non_model=extra_non_model
        )
        try:
            out = os.path.join(tmp, fs.HF_SUBFOLDER)
            write_hf_folder(out, weights, sd_adapter, export_dtype, tokenizer, allow_lossy)
            return
        except LossyExportError as err:
            problem = (
                f"{err}; export it anyway with python scripts/convert_dcp_to_hf.py {final} "
                "OUT_DIR --allow-lossy (or train with --checkpoint.last_save_in_hf_allow_lossy)"
            )
    logger.warning(f"Checkpoint: not writing {os.path.join(final, fs.HF_SUBFOLDER)}: {problem}")
