"""Export the model weights of a torchtitan DCP checkpoint as a Hugging Face model folder.

    python scripts/convert_dcp_to_hf.py CKPT_DIR OUT_DIR --flavor 8B \\
        --tokenizer ./assets/hf/Llama-3.1-8B [--dtype bfloat16]

``CKPT_DIR`` is one ``step-N`` folder (any parallel layout: DCP reassembles full tensors). It is
verified first as the trainer verifies a checkpoint before loading it (the files, sizes and
CRC32s its ``.committed`` lists): a damaged one is refused, nothing written. ``--model`` is
found from the checkpoint's weight names (the registered family whose key map holds them all
and fits them best); one that disagrees is refused naming the right one.
``OUT_DIR`` (a new or empty folder: an earlier export's files would mix with these) receives the same files as ``checkpoint.last_save_in_hf``: ``model.safetensors`` (or
shards plus an index), ``config.json`` (architecture, ``dtype``, the flavor's context length as
``max_position_embeddings``, BOS/EOS ids), ``generation_config.json`` (stops at EOS and, for
Llama 3, ``<|eot_id|>``) and the tokenizer files, ready for ``AutoModelForCausalLM`` and
``AutoTokenizer.from_pretrained(OUT_DIR)``. ``--tokenizer`` is the run's
``model.hf_assets_path`` (or tokenizer file); without it no tokenizer files are written.

Every weight's shape is checked against the flavor (dim, layers, kv heads, FFN width, vocab),
and so are the heads and the rest of the architecture that torchtitan records in the
checkpoint's ``.committed`` marker. Without ``--flavor`` that recorded architecture is used, so
custom flavors export as they are; ``--experimental.custom_import MODULE`` imports a module
that registers a model or flavors first (as in training). The vocabulary size of debug flavors
(sized by their tokenizer) is read from the checkpoint's embedding.

What HF's format cannot hold is refused unless ``--allow-lossy``: a trained (non-zero) routing
bias of Qwen3-MoE or DeepSeek-V2, whose HF models route without one.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import os
import re
import sys
import time
from typing import Any

import torch

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from torchtitan.components.checkpoint import fs, hf, load  # noqa: E402
from torchtitan.models import get_model_spec, hf_lookup, list_model_specs  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Fields of the architecture that must agree between --flavor and the recorded model args.
_ARCH_FIELDS = ("dim", "n_layers", "n_heads", "effective_n_kv_heads", "ffn_hidden_dim",
                "norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings")
_LAYER = re.compile(r"^layers\.(\d+)\.")


def _args_from_record(spec: Any, record: dict[str, Any]) -> Any:
    """The model-args object recorded in a checkpoint's marker (``hf.model_info``)."""
    cls = type(next(iter(spec.model_args.values())))
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in record.items() if k in names}
    scaling = values.get("rope_scaling")
    if isinstance(scaling, dict):
        from torchtitan.models.common.rope import RoPEScalingArgs

        values["rope_scaling"] = RoPEScalingArgs(**scaling)
    return cls(**values)


def _check_against_record(args: Any, recorded: Any, flavor: str) -> None:
    for name in _ARCH_FIELDS:
        want, have = getattr(recorded, name, None), getattr(args, name, None)
        if want != have:
            raise ValueError(
                f"the checkpoint was trained with {name}={want} (recorded in its "
                f"{fs.COMMIT_MARKER}), flavor {flavor} has {have}; pass the flavor it was "
                "trained with, or omit --flavor to use the recorded architecture"
            )


def _check_weights(args: Any, spec: Any, weights: dict[str, torch.Tensor], source: str) -> None:
    """Every weight's shape against a meta build of ``args`` (layers, dims, heads, vocab)."""
    layers = {int(m.group(1)) for k in weights if (m := _LAYER.match(k))}
    if layers and len(layers) != args.n_layers:
        raise ValueError(f"{source} has {len(layers)} layers, the flavor has {args.n_layers}")
    dim = int(weights["tok_embeddings.weight"].shape[1])
    if dim != args.dim:
        raise ValueError(f"the checkpoint's dim is {dim}, the flavor has {args.dim}")
    wk = weights.get("layers.0.attention.wk.weight")
    if wk is not None and int(wk.shape[0]) != args.effective_n_kv_heads * args.head_dim:
        raise ValueError(
            f"the checkpoint's attention has {int(wk.shape[0]) // args.head_dim} kv heads of "
            f"dim {args.head_dim} (dim/n_heads), the flavor has {args.effective_n_kv_heads} "
            f"(n_heads={args.n_heads}, n_kv_heads={args.effective_n_kv_heads})"
        )
    with torch.device("meta"):
        model = spec.model_cls(args)
    expected = load.tensor_shapes(model.state_dict())
    load.check_model_shapes(expected, load.tensor_shapes(weights), source)
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise ValueError(f"{source} has weights the flavor does not: {extra[:3]}")


def resolve_args(
    spec: Any, flavor: str | None, weights: dict[str, torch.Tensor], ckpt_dir: str
) -> Any:
    """The model args to export with: ``flavor``'s (checked against the recorded architecture
    when there is one) or the recorded ones; vocab from the embedding for tokenizer-sized
    flavors; every weight checked. ValueError with one line otherwise."""
    marker = fs.read_marker(ckpt_dir) or {}
    record = marker.get(hf.MODEL_ARGS_KEY)
    recorded = _args_from_record(spec, record) if record else None
    if flavor is None:
        if recorded is None:
            raise ValueError(
                f"{ckpt_dir} records no model architecture in {fs.COMMIT_MARKER} (saved by "
                f"another tool or an older torchtitan): pass --flavor (one of {', '.join(spec.flavors)})"
            )
        args = recorded
    else:
        args = spec.get_model_args(flavor)
        if recorded is not None:
            _check_against_record(args, recorded, flavor)
    emb = weights.get("tok_embeddings.weight")
    if emb is None:
        raise ValueError("the checkpoint has no tok_embeddings.weight: is it a Llama checkpoint?")
    args = copy.deepcopy(args)
    vocab = int(emb.shape[0])
    if vocab != args.vocab_size and not (args.use_tokenizer_vocab or recorded is not None):
        raise ValueError(f"the checkpoint's vocab size is {vocab}, flavor {flavor} has {args.vocab_size}")
    args.vocab_size = vocab
    _check_weights(args, spec, weights, ckpt_dir)
    out = weights.get("output.weight")
    if args.tie_word_embeddings and out is not None and not torch.equal(out, emb):
        raise ValueError(f"flavor {flavor} ties output to tok_embeddings, but the checkpoint's differ")
    return args


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def pick_model(ckpt_dir: str, model: str | None) -> str:
    """``model``, or the registered family the checkpoint's weight names belong to; ValueError
    in one line when another family's adapter fits them better (``this checkpoint is a qwen3
    model; pass --model qwen3``). Models the registry does not know yet, or whose adapter is
    not declarative, are taken at their word."""
    keys = load.dcp_model_keys(load.read_dcp_metadata(ckpt_dir))
    found = hf_lookup.spec_for_fqns(keys)
    if model is None:
        if found is None:
            raise ValueError(f"cannot tell the model of {ckpt_dir} from its weight names; pass --model")
        return found.name
    if found is not None and model in list_model_specs():
        if not hf_lookup.fqns_fit(get_model_spec(model), keys):
            raise ValueError(f"this checkpoint is a {found.name} model; pass --model {found.name}")
    return model


_PADDING_AT_MOST = 1024
"""Embedding rows past the tokenizer's ids that padding explains (Qwen3 pads 151,669 ids to
151,936 rows); more suggests another tokenizer than the run's."""


def convert_dcp_to_hf(
    ckpt_dir: str,
    out_dir: str,
    flavor: str | None = None,
    dtype: str = "float32",
    tokenizer_path: str | None = None,
    model: str | None = None,
    allow_lossy: bool = False,
) -> list[str]:
    """Write ``out_dir`` (see the module docstring) from DCP ``ckpt_dir``; returns file names."""
    if not os.path.exists(os.path.join(ckpt_dir, fs.DCP_METADATA)):
        raise FileNotFoundError(f"{ckpt_dir} has no {fs.DCP_METADATA}: not a DCP checkpoint folder")
    fs.check_output_folder(out_dir, "OUT_DIR")
    if not hf.verify_for_export(ckpt_dir):
        _warn(f"{ckpt_dir} records no checksums in a {fs.COMMIT_MARKER}: its files cannot be verified")
    model = pick_model(ckpt_dir, model)
    spec = get_model_spec(model)
    if spec.state_dict_adapter is None:
        raise ValueError(f"model {model} has no HF state-dict adapter")
    if flavor is not None and flavor not in spec.model_args:
        raise ValueError(f"--flavor {flavor!r} is not a {model} flavor; choose one of {spec.flavors}")
    tokenizer = None
    if tokenizer_path is not None:  # before the weights: a wrong path fails in seconds
        from torchtitan.components.tokenizer import build_tokenizer
        from torchtitan.config.job_config import Model

        tokenizer = build_tokenizer(Model(hf_assets_path=tokenizer_path, tokenizer_path=None))
    weights = load.load_dcp_model_tensors(ckpt_dir, dtype=_DTYPES[dtype])
    args = resolve_args(spec, flavor, weights, ckpt_dir)
    if tokenizer is not None:
        ids, vocab = tokenizer.vocab_size, args.vocab_size
        if ids > vocab:
            raise ValueError(
                f"the tokenizer {tokenizer_path} has {ids} ids, the checkpoint's "
                f"vocabulary only {vocab}: is it the run's tokenizer?"
            )
        if vocab - ids > _PADDING_AT_MOST:
            _warn(f"the tokenizer {tokenizer_path} has {ids} ids, the checkpoint's vocabulary "
                  f"{vocab}: {vocab - ids} embedding rows no token of it reaches (more than "
                  "padding); is it the run's tokenizer?")
    adapter = spec.state_dict_adapter(args)
    return hf.write_hf_folder(out_dir, weights, adapter, dtype, tokenizer, allow_lossy, _warn)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("ckpt_dir", help="a step-N DCP checkpoint folder")
    parser.add_argument("out_dir", help="HF folder to write")
    parser.add_argument("--flavor", default=None,
                        help="flavor the checkpoint was trained with (default: the recorded architecture)")
    parser.add_argument("--model", default=None,
                        help="model.name (default: found from the checkpoint's weight names)")
    parser.add_argument("--allow-lossy", action="store_true",
                        help="export even what HF cannot hold exactly (a trained routing bias is dropped)")
    parser.add_argument("--tokenizer", default=None,
                        help="the run's model.hf_assets_path (folder) or tokenizer file")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--experimental.custom_import", dest="custom_import", default="",
                        help="module to import first (registers custom models or flavors)")
    ns = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        if ns.custom_import:
            sys.path.insert(0, os.getcwd())  # as for `python -m torchtitan.train`
            importlib.import_module(ns.custom_import)
        files = convert_dcp_to_hf(
            ns.ckpt_dir, ns.out_dir, ns.flavor, ns.dtype, ns.tokenizer, ns.model, ns.allow_lossy
        )
    except hf.LossyExportError as err:
        print(f"error: {err} (pass --allow-lossy to export it anyway)", file=sys.stderr)
        return 2
    except (OSError, ValueError, ImportError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(files)} to {ns.out_dir} in {time.perf_counter() - start:.1f} s")
    if ns.tokenizer is None:
        print(
            "warning: no --tokenizer: config.json has no bos/eos ids and no tokenizer files or "
            "generation_config.json were written (AutoTokenizer cannot load this folder)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
