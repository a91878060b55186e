"""Convert Hugging Face safetensors (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3/V2) into a torchtitan DCP checkpoint.

    python scripts/convert_hf_to_dcp.py HF_DIR OUT_DIR

``HF_DIR`` holds ``config.json`` and ``*.safetensors`` (a ``save_pretrained`` folder or a hub
snapshot); its ``model_type`` picks the torchtitan model (``--model`` overrides). ``OUT_DIR`` becomes a committed model-only DCP checkpoint; start training from it
with ``--checkpoint.enable --checkpoint.initial_load_path OUT_DIR``. Runs in one process, no
GPU and no process group needed; memory is about the size of the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from torchtitan.components.checkpoint import hf, save  # noqa: E402
from torchtitan.models import get_model_spec  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import model_args_from_hf_config  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# HF config.json model_type -> torchtitan model.name
HF_MODEL_TYPES = {
    "llama": "llama3",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v2": "deepseek_v3",
}


def adapter_for(config: dict, model: str | None = None) -> object:
    """The state-dict adapter (with its model args) for an HF ``config.json`` dict."""
    model_type = config.get("model_type", "llama")
    name = model or HF_MODEL_TYPES.get(model_type)
    if name is None:
        raise ValueError(
            f"HF config model_type={model_type!r} has no torchtitan model; known: "
            f"{', '.join(sorted(HF_MODEL_TYPES))} (or pass --model)"
        )
    spec = get_model_spec(name)
    if spec.state_dict_adapter is None:
        raise ValueError(f"model {name!r} has no HF state-dict adapter")
    cls = spec.state_dict_adapter.resolve()
    if hasattr(cls, "from_hf_config"):  # conversion depends on more than the model args
        return cls.from_hf_config(config)
    # Adapters expose args_from_hf_config; the Llama one predates it (module function).
    args_from = getattr(cls, "args_from_hf_config", model_args_from_hf_config)
    return cls(args_from(config))


def convert_hf_to_dcp(
    hf_dir: str, out_dir: str, dtype: str | None = None, model: str | None = None
) -> dict[str, torch.Tensor]:
    """Convert ``hf_dir`` into a DCP checkpoint at ``out_dir``; returns the converted weights."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} not found: HF_DIR must hold config.json")
    with open(config_path) as f:
        config = json.load(f)
    state = adapter_for(config, model).from_hf(hf.load_safetensors_folder(hf_dir))
    if dtype is not None:
        state = {k: v.to(_DTYPES[dtype]) for k, v in state.items()}
    info = {"step": 0, "model_only": True, "states": [], "converted_from": os.path.abspath(hf_dir)}
    save.save_dcp_single_process(state, out_dir, info)
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("hf_dir", help="folder with config.json and *.safetensors")
    parser.add_argument("out_dir", help="DCP checkpoint folder to write")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="cast the weights (default: keep the stored dtype)")
    parser.add_argument("--model", default=None,
                        help="torchtitan model.name (default: from config.json's model_type)")
    ns = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        state = convert_hf_to_dcp(ns.hf_dir, ns.out_dir, ns.dtype, ns.model)
    except (FileNotFoundError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n = sum(v.numel() for v in {t.data_ptr(): t for t in state.values()}.values())
    print(
        f"wrote {ns.out_dir}: {len(state)} tensors, {n:,} parameters in "
        f"{time.perf_counter() - start:.1f} s; train from it with --checkpoint.enable "
        f"--checkpoint.initial_load_path {ns.out_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
