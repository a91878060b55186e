"""Hugging Face ``GptOssForCausalLM`` <-> torchtitan gpt-oss state dicts and configs.

Key names are those transformers saves (and the Hub's bf16 checkpoints hold): per layer
``self_attn.{q,k,v,o}_proj.{weight,bias}``, ``self_attn.sinks``, ``mlp.router.{weight,bias}``
and the experts fused into four tensors: ``mlp.experts.gate_up_proj`` ``[E, D, 2I]`` (``x @ W``
layout, gate and up *interleaved* on the last dim: gate at even, up at odd columns),
``gate_up_proj_bias`` ``[E, 2I]`` (interleaved too), ``down_proj`` ``[E, I, D]`` and
``down_proj_bias`` ``[E, D]``. Ours: ``w1`` (gate) / ``w3`` (up) ``[E, I, D]`` with biases
``b1`` / ``b3`` ``[E, I]``, ``w2`` ``[E, D, I]``, ``b2`` ``[E, D]``. RoPE is HF's rotate-half
in both, so no weight is permuted.

The Hub's original checkpoints store the experts MXFP4-packed (``gate_up_proj_blocks`` /
``_scales``, ``down_proj_blocks`` / ``_scales``): ``from_hf`` dequantizes them to bf16 with
transformers' own decoder (``integrations.mxfp4.convert_moe_packed_tensors``, CPU-capable).
HF gpt-oss has no load-balancing bias: imports give zeros, exports refuse a non-zero one unless
asked to be lossy.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from torchtitan.models.common.hf_adapter import (
    BLOCK_NORMS,
    GQA_ATTENTION,
    LAYER,
    TOP_KEYS,
    HFStateDictAdapter,
    Transform,
    canonical_key,
    decoder_hf_config,
    fill,
    layer_keys,
    require_moe_settings,
    routing_bias_dropped,
)
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.gpt_oss.args import GptOssModelArgs, gpt_oss_moe

_OURS = f"layers.{LAYER}.moe.experts"
_HF = f"model.layers.{LAYER}.mlp.experts"
# our (gate, up) pairs <-> HF's interleaved tensor
_FUSED = {f"{_HF}.gate_up_proj": (f"{_OURS}.w1", f"{_OURS}.w3"),
          f"{_HF}.gate_up_proj_bias": (f"{_OURS}.b1", f"{_OURS}.b3")}
_MXFP4 = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$")


class _SwapLastDims(Transform):
    """``down_proj`` is stored ``[E, I, D]`` (``x @ W``); our ``w2`` is ``[E, D, I]``."""

    def to_hf(self, adapter: HFStateDictAdapter, w: torch.Tensor) -> torch.Tensor:
        return w.transpose(-2, -1).contiguous()

    from_hf = to_hf


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Our ``[E, I, D]`` gate/up weights (or ``[E, I]`` biases) -> HF's interleaved
    ``[E, D, 2I]`` (``[E, 2I]``)."""
    if gate.dim() == 3:
        gate, up = gate.transpose(1, 2), up.transpose(1, 2)
    return torch.stack([gate, up], dim=-1).flatten(-2).contiguous()


def halves_from_interleaved(w: torch.Tensor) -> torch.Tensor:
    """HF's interleaved ``[E, D, 2I]`` (``[E, 2I]``) -> gate rows then up rows, ``[E, 2I, D]``
    (``[E, 2I]``), which the base adapter's fused import splits in two along dim 1."""
    halves = torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1)
    return halves.transpose(1, 2).contiguous() if w.dim() == 3 else halves


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 experts (e2m1 pairs in ``blocks`` ``[E, rows, G, 16]``, e8m0 ``scales``
    ``[E, rows, G]``) -> bf16 ``[E, G * 32, rows]`` (``x @ W`` layout), by transformers."""
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError:
        raise ValueError(
            "the HF checkpoint's experts are MXFP4-packed (*_blocks / *_scales): dequantizing "
            "them needs transformers (pip install transformers), or import a bf16 checkpoint"
        ) from None
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)


def model_args_from_hf_config(config: dict[str, Any]) -> GptOssModelArgs:
    """``GptOssModelArgs`` from an HF gpt-oss ``config.json`` dict; ValueError naming the field
    it cannot represent."""
    if config.get("model_type", "gpt_oss") != "gpt_oss":
        raise ValueError(f"HF config model_type={config['model_type']!r} is not a gpt-oss model")
    if config.get("tie_word_embeddings"):
        raise ValueError("HF config tie_word_embeddings=true is not supported by gpt-oss")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("yarn", "default"):
        raise ValueError(f"HF config rope type {rope_type!r} is not supported (yarn or default)")
    yarn = rope_type == "yarn"
    if yarn and rope.get("attention_factor") is not None:
        raise ValueError("HF config rope attention_factor is not supported (0.1 ln(factor) + 1)")
    n_layers = int(config["num_hidden_layers"])
    layer_types = config.get("layer_types")
    moe = gpt_oss_moe(int(config["num_local_experts"]))
    moe.top_k = int(config.get("num_experts_per_tok", config.get("experts_per_token", 4)))
    moe.swiglu_alpha = float(config.get("swiglu_alpha", 1.702))
    moe.swiglu_limit = float(config.get("swiglu_limit", 7.0))
    return GptOssModelArgs(
        dim=int(config["hidden_size"]),
        n_layers=n_layers,
        n_heads=int(config["num_attention_heads"]),
        n_kv_heads=int(config["num_key_value_heads"]),
        head_dim=int(config.get("head_dim") or 64),
        vocab_size=int(config["vocab_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 150000.0))),
        max_seq_len=int(config.get("max_position_embeddings", 131072)),
        sliding_window_size=config.get("sliding_window"),
        layer_types=None if layer_types is None else list(layer_types),
        attention_bias=bool(config.get("attention_bias", True)),
        moe_hidden_dim=int(config["intermediate_size"]),
        moe_args=moe,
        rope_factor=float(rope.get("factor", 32.0)) if yarn else 1.0,
        original_seq_len=int(rope.get("original_max_position_embeddings", 4096)),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        rope_truncate=bool(rope.get("truncate", True)),
    )


def hf_config_from_model_args(args: GptOssModelArgs, dtype: str = "float32") -> dict[str, Any]:
    """An HF ``config.json`` dict (GptOssForCausalLM) equivalent to ``args``."""
    _check_hf_moe(args.moe_args)
    if not args.attention_sinks:
        raise ValueError("model attention_sinks=False cannot be expressed in HF gpt-oss")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_factor > 1:
        rope.update(rope_type="yarn", factor=args.rope_factor, beta_fast=args.beta_fast,
                    beta_slow=args.beta_slow, truncate=args.rope_truncate,
                    original_max_position_embeddings=args.original_seq_len)
    m = args.moe_args
    return decoder_hf_config(
        args, "GptOssForCausalLM", "gpt_oss", args.moe_hidden_dim, dtype,
        num_local_experts=m.num_experts,
        num_experts_per_tok=m.top_k,
        sliding_window=args.sliding_window_size,
        layer_types=[args.layer_type(i) for i in range(args.n_layers)],
        rope_parameters=rope,
        # with rope_scaling: what transformers 4.x reads (rope_theta beside it)
        rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"},
        swiglu_alpha=m.swiglu_alpha,
        swiglu_limit=m.swiglu_limit,
        attention_bias=args.attention_bias,
        tie_word_embeddings=False,
    )


def _check_hf_moe(m: MoEArgs) -> None:
    """HF gpt-oss: biased router, softmax over the top-k logits, biased clamped-SwiGLU experts."""
    require_moe_settings(m, {
        "num_shared_experts": 0, "score_func": "softmax", "route_norm": True, "route_scale": 1.0,
        "num_expert_groups": None, "router_bias": True, "expert_linear_bias": True,
        "expert_activation": "clamped_swiglu",
    }, "gpt-oss")


class GptOssStateDictAdapter(HFStateDictAdapter):
    """gpt-oss state dicts between torchtitan FQNs and HF names."""

    hf_name = "gpt-oss"
    key_map = {**TOP_KEYS, **layer_keys({
        **GQA_ATTENTION, **BLOCK_NORMS,
        **{f"attention.w{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkvo"},
        "attention.sinks": "self_attn.sinks",
        "moe.router.gate.weight": "mlp.router.weight",
        "moe.router.gate.bias": "mlp.router.bias",
        "moe.experts.w2": "mlp.experts.down_proj",
        "moe.experts.b2": "mlp.experts.down_proj_bias",
    })}
    fused_hf_keys = _FUSED
    transforms = {f"{_OURS}.w2": _SwapLastDims()}
    export_drops = {f"layers.{LAYER}.moe.expert_bias": routing_bias_dropped(
        "HF gpt-oss has no load-balancing bias")}
    import_zeros = {f"layers.{LAYER}.moe.expert_bias": f"{_OURS}.w2"}
    args_from_hf_config = staticmethod(model_args_from_hf_config)
    hf_config_from_args = staticmethod(hf_config_from_model_args)

    @classmethod
    def our_patterns(cls) -> set[str]:
        return super().our_patterns() | {p for pair in _FUSED.values() for p in pair}

    @classmethod
    def is_extra_hf_key(cls, key: str) -> bool:
        return super().is_extra_hf_key(key) or _MXFP4.search(key) is not None

    def check_exportable(self) -> None:
        hf_config_from_model_args(self.model_args)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The base mapping, with each layer's gate/up weights and biases interleaved into
        HF's fused tensors."""
        rest, fused = dict(state_dict), {}
        for key in list(rest):
            pattern, idx = canonical_key(key)
            for hf, (gate, up) in _FUSED.items():
                if pattern == gate:
                    layer = idx[0]
                    fused[fill(hf, layer)] = interleave_gate_up(
                        rest.pop(key), rest.pop(fill(up, layer)))
        return {**super().to_hf(rest), **fused}

    def prepare_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """MXFP4 experts dequantized; the interleaved gate/up tensors split into halves."""
        out = dict(hf_state_dict)
        for key in [k for k in out if k.endswith("_blocks") and _MXFP4.search(k)]:
            base = key[: -len("_blocks")]
            if f"{base}_scales" not in out:
                raise ValueError(f"HF checkpoint has {key} but no {base}_scales")
            out[base] = dequantize_mxfp4(out.pop(key), out.pop(f"{base}_scales"))
        for key in list(out):
            if canonical_key(key)[0] in _FUSED:
                out[key] = halves_from_interleaved(out[key])
        return out


__all__ = [
    "GptOssStateDictAdapter",
    "dequantize_mxfp4",
    "hf_config_from_model_args",
    "model_args_from_hf_config",
]
