"""Hugging Face ``LlamaForCausalLM`` <-> torchtitan Llama state dicts and configs.

Our attention applies RoPE to interleaved pairs ``(2i, 2i+1)`` (complex multiplication); HF's
``rotate_half`` pairs ``(i, i + head_dim/2)``. ``wq``/``wk`` rows are therefore permuted per head
when converting (the same permutation Meta's and HF's own conversion scripts use), which makes
the two models compute identical logits.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.models.common.hf_adapter import (
    BLOCK_NORMS,
    GQA_ATTENTION,
    LAYER,
    TOP_KEYS,
    HFStateDictAdapter,
    RopeHalfSplit,
    decoder_hf_config,
    interleaved_to_half,
    layer_keys,
    swiglu,
)
from torchtitan.models.common.rope import RoPEScalingArgs
from torchtitan.models.llama3.args import TransformerModelArgs

_ROPE = RopeHalfSplit(period=lambda args: args.head_dim)


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder ``wq``/``wk`` rows from interleaved RoPE pairs to HF's half-split layout."""
    return interleaved_to_half(w, w.shape[0] // n_heads)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`permute_to_hf`."""
    return interleaved_to_half(w, w.shape[0] // n_heads, inverse=True)


def _ffn_args(dim: int, intermediate_size: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) that make our SwiGLU width equal ``intermediate_size``."""
    base = int(2 * (4 * dim) / 3)
    if base <= intermediate_size:
        return intermediate_size, None
    return intermediate_size, intermediate_size / base


def model_args_from_hf_config(config: dict[str, Any]) -> TransformerModelArgs:
    """Build ``TransformerModelArgs`` from an HF Llama ``config.json`` dict.

    Raises ValueError naming the field when the HF model is not representable (biases,
    a head_dim different from hidden_size / num_attention_heads, an unknown RoPE type).
    """
    dim = int(config["hidden_size"])
    n_heads = int(config["num_attention_heads"])
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ValueError(f"HF config {flag}=true is not supported by torchtitan's Llama")
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) != dim // n_heads:
        raise ValueError(
            f"HF config head_dim={head_dim} differs from hidden_size/num_attention_heads="
            f"{dim // n_heads}; torchtitan's Llama needs them equal"
        )
    rope = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling") or {}
    rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling_src = rope if rope.get("rope_type", "default") != "default" else legacy
    rope_type = scaling_src.get("rope_type", scaling_src.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
        scaling = RoPEScalingArgs(
            scale_factor=float(scaling_src["factor"]),
            low_freq_factor=float(scaling_src["low_freq_factor"]),
            high_freq_factor=float(scaling_src["high_freq_factor"]),
            original_max_position_embeddings=int(scaling_src["original_max_position_embeddings"]),
        )
    elif rope_type not in ("default", None):
        raise ValueError(f"HF config rope type {rope_type!r} is not supported (default or llama3)")
    multiple_of, ffn_mult = _ffn_args(dim, int(config["intermediate_size"]))
    args = TransformerModelArgs(
        dim=dim,
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        vocab_size=int(config["vocab_size"]),
        multiple_of=multiple_of,
        ffn_dim_multiplier=ffn_mult,
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        max_seq_len=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    if args.ffn_hidden_dim != int(config["intermediate_size"]):
        raise ValueError(
            f"HF config intermediate_size={config['intermediate_size']} cannot be expressed "
            f"with multiple_of/ffn_dim_multiplier (got {args.ffn_hidden_dim})"
        )
    return args


def hf_config_from_model_args(args: TransformerModelArgs, dtype: str = "float32") -> dict[str, Any]:
    """An HF ``config.json`` dict (LlamaForCausalLM) equivalent to ``args``."""
    config = decoder_hf_config(args, "LlamaForCausalLM", "llama", args.ffn_hidden_dim, dtype,
                               attention_bias=False, mlp_bias=False)
    s = args.rope_scaling
    if s is not None:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.scale_factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return config


class Llama3StateDictAdapter(HFStateDictAdapter):
    """Llama state dicts between torchtitan FQNs and HF ``LlamaForCausalLM`` names."""

    hf_name = "Llama"
    key_map = {**TOP_KEYS, **layer_keys({**GQA_ATTENTION, **BLOCK_NORMS,
                                         **swiglu("feed_forward", "mlp")})}
    transforms = {
        f"layers.{LAYER}.attention.wq.weight": _ROPE,
        f"layers.{LAYER}.attention.wk.weight": _ROPE,
    }
    # Buffers some HF versions saved; recomputed by both models, safe to drop.
    hf_ignored = r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$"
    args_from_hf_config = staticmethod(model_args_from_hf_config)
    hf_config_from_args = staticmethod(hf_config_from_model_args)
