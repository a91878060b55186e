"""Convert Hugging Face safetensors (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3/V2) into a torchtitan DCP checkpoint.

    python scripts/convert_hf_to_dcp.py HF_DIR OUT_DIR [--model NAME --flavor FLAVOR]

``HF_DIR`` holds ``config.json`` and ``*.safetensors`` (a ``save_pretrained`` folder or a hub
snapshot); its ``model_type`` picks the torchtitan model (``--model`` overrides). ``OUT_DIR`` (new, empty, or an earlier checkpoint, which is moved aside to
``OUT_DIR.superseded-<time>``) becomes a committed model-only DCP checkpoint; start training from it
with ``--checkpoint.enable --checkpoint.initial_load_path OUT_DIR``. Runs in one process, no
GPU and no process group needed; memory is about the size of the weights.

Before anything is written: the index's shards must all be there and whole (header offsets
against file sizes), the weights must be those of ``config.json``'s family, every tensor of the
model that ``config.json`` describes must be present with its shape and no other, and with
``--flavor`` ``config.json`` must agree with that flavor. A failure is one ``error:`` line naming
the file or field, exit code 2. The architecture is recorded in the checkpoint's ``.committed``,
so scripts/convert_dcp_to_hf.py exports it back without ``--flavor``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from torchtitan.components.checkpoint import CheckpointError, fs, hf, hf_check, load, save  # noqa: E402
from torchtitan.models import get_model_spec, hf_lookup  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _model_name(config: dict, model: str | None) -> str:
    if model is not None:
        return model
    model_type = config.get("model_type", "llama")
    spec = hf_lookup.spec_for_hf_model_type(model_type)
    if spec is None:
        raise ValueError(
            f"HF config model_type={model_type!r} has no torchtitan model; known: "
            f"{', '.join(hf_lookup.hf_model_types())} (or pass --model)"
        )
    return spec.name


def adapter_for(config: dict, model: str | None = None) -> object:
    """The state-dict adapter (with its model args) for an HF ``config.json`` dict."""
    spec = get_model_spec(_model_name(config, model))
    if spec.state_dict_adapter is None:
        raise ValueError(f"model {spec.name!r} has no HF state-dict adapter")
    cls = hf_lookup.adapter_class(spec)
    if hasattr(cls, "from_hf_config"):  # model args and the folder's weight layout
        return cls.from_hf_config(config)
    return cls(cls.args_from_hf_config(config))


def _check_flavor(config: dict, config_path: str, model: str | None, flavor: str) -> None:
    spec = get_model_spec(_model_name(config, model))
    args = spec.get_model_args(flavor)
    if getattr(args, "use_tokenizer_vocab", False) and "vocab_size" in config:
        args.vocab_size = int(config["vocab_size"])  # sized by the run's tokenizer
    hf_check.compare_with_flavor(config, spec.state_dict_adapter(args), config_path)


def _check_complete(state: dict[str, torch.Tensor], args: object, model_cls: type, hf_dir: str) -> None:
    """Every tensor of the model ``args`` describes, with its shape, and nothing else."""
    with torch.device("meta"):
        expected = load.tensor_shapes(model_cls(args).state_dict())
    source = f"HF checkpoint {hf_dir}"
    load.check_model_shapes(expected, load.tensor_shapes(state), source)
    extra = sorted(set(state) - set(expected))
    if extra:
        raise CheckpointError(
            f"{source} has weights its config.json's model does not: {extra[:3]} ({len(extra)}); "
            "is config.json the weights' own?"
        )


def _refuse_a_training_step(out_dir: str) -> None:
    """A checkpoint a conversion wrote may be replaced (it is set aside); a training run's step
    may not: converting over it would make that run resume from the HF weights."""
    marker = fs.read_marker(out_dir) if os.path.isdir(out_dir) else None
    if marker is not None and not marker.get("converted_from") and (
            marker.get("states") or not marker.get("model_only", True)):
        raise ValueError(
            f"OUT_DIR {out_dir} is a training run's checkpoint (step {marker.get('step', '?')}, "
            "with its training state): converting over it would make the run resume from the HF "
            "weights; give a folder of its own and load it with --checkpoint.initial_load_path"
        )


def convert_hf_to_dcp(
    hf_dir: str,
    out_dir: str,
    dtype: str | None = None,
    model: str | None = None,
    flavor: str | None = None,
) -> dict[str, torch.Tensor]:
    """Convert ``hf_dir`` into a DCP checkpoint at ``out_dir`` (after the checks of the module
    docstring; nothing is written when one fails); returns the converted weights."""
    config_path = os.path.join(hf_dir, hf_check.CONFIG)
    fs.check_output_folder(out_dir, "OUT_DIR", checkpoint_ok=True)
    _refuse_a_training_step(out_dir)
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} not found: HF_DIR must hold config.json")
    config = hf_check.read_config(hf_dir) or {}
    if flavor is not None:
        _check_flavor(config, config_path, model, flavor)
    try:
        adapter = adapter_for(config, model)
    except KeyError as err:
        raise CheckpointError(f"{config_path} has no {err.args[0]}") from None
    except ValueError as err:
        raise CheckpointError(f"{config_path}: {err}") from None
    hf_sd = hf.load_safetensors_folder(hf_dir, warn=_warn)
    hf_check.check_config_matches_weights(config, hf_sd, config_path)
    try:
        state = adapter.from_hf(hf_sd)
    except ValueError as err:
        raise CheckpointError(f"HF checkpoint {hf_dir}: {err}") from None
    spec = get_model_spec(_model_name(config, model))
    _check_complete(state, adapter.model_args, spec.model_cls, hf_dir)
    if dtype is not None:
        state = {k: v.to(_DTYPES[dtype]) for k, v in state.items()}
    info = {"step": 0, "model_only": True, "states": [], "converted_from": os.path.abspath(hf_dir)}
    info.update(hf.model_info(adapter))
    aside = save.save_dcp_single_process(state, out_dir, info)
    if aside is not None:
        _warn(f"the checkpoint that was at {out_dir} is now {aside}")
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("hf_dir", help="folder with config.json and *.safetensors")
    parser.add_argument("out_dir", help="DCP checkpoint folder to write")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="cast the weights (default: keep the stored dtype)")
    parser.add_argument("--model", default=None,
                        help="torchtitan model.name (default: from config.json's model_type)")
    parser.add_argument("--flavor", default=None,
                        help="the model.flavor you will train: config.json must agree with it")
    ns = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        state = convert_hf_to_dcp(ns.hf_dir, ns.out_dir, ns.dtype, ns.model, ns.flavor)
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
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
