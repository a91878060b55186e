"""Export the model weights of a torchtitan DCP checkpoint as Hugging Face Llama safetensors.

    python scripts/convert_dcp_to_hf.py CKPT_DIR OUT_DIR --flavor 8B [--dtype bfloat16]

``CKPT_DIR`` is one ``step-N`` folder (any parallel layout: DCP reassembles full tensors).
``OUT_DIR`` receives ``model.safetensors`` (or shards plus an index) and ``config.json``, ready
for ``LlamaForCausalLM.from_pretrained(OUT_DIR)``; copy the tokenizer files next to them
yourself. The flavor gives the architecture (RoPE, norm eps); the vocabulary size is read from
the checkpoint's embedding, so debug flavors with tokenizer-sized vocabularies work too.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from torchtitan.components.checkpoint import fs, hf, load  # noqa: E402
from torchtitan.models.llama3 import llama3_args  # noqa: E402
from torchtitan.models.llama3.args import TransformerModelArgs  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _args_for(flavor: str, weights: dict[str, torch.Tensor]) -> TransformerModelArgs:
    if flavor not in llama3_args:
        raise ValueError(f"--flavor {flavor!r} is not a llama3 flavor; choose one of {sorted(llama3_args)}")
    args = copy.deepcopy(llama3_args[flavor])
    emb = weights.get("tok_embeddings.weight")
    if emb is None:
        raise ValueError("the checkpoint has no tok_embeddings.weight: is it a Llama checkpoint?")
    args.vocab_size = int(emb.shape[0])
    if int(emb.shape[1]) != args.dim:
        raise ValueError(f"the checkpoint's dim is {emb.shape[1]}, flavor {flavor} has {args.dim}")
    out = weights.get("output.weight")
    if args.tie_word_embeddings and out is not None and not torch.equal(out, emb):
        raise ValueError(f"flavor {flavor} ties output to tok_embeddings, but the checkpoint's differ")
    return args


def convert_dcp_to_hf(ckpt_dir: str, out_dir: str, flavor: str, dtype: str = "float32") -> list[str]:
    """Write ``out_dir`` (safetensors + config.json) from DCP ``ckpt_dir``; returns file names."""
    if not os.path.exists(os.path.join(ckpt_dir, fs.DCP_METADATA)):
        raise FileNotFoundError(f"{ckpt_dir} has no {fs.DCP_METADATA}: not a DCP checkpoint folder")
    weights = load.load_dcp_model_tensors(ckpt_dir, dtype=_DTYPES[dtype])
    args = _args_for(flavor, weights)
    adapter = Llama3StateDictAdapter(args)
    files = hf.save_safetensors_folder(adapter.to_hf(weights), out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(adapter.hf_config(dtype), f, indent=2)
    return files + ["config.json"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("ckpt_dir", help="a step-N DCP checkpoint folder")
    parser.add_argument("out_dir", help="HF folder to write")
    parser.add_argument("--flavor", required=True, help="llama3 flavor the checkpoint was trained with")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    ns = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        files = convert_dcp_to_hf(ns.ckpt_dir, ns.out_dir, ns.flavor, ns.dtype)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(files)} to {ns.out_dir} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
