"""Hugging Face ``LlamaForCausalLM`` <-> torchtitan Llama state dicts and configs.

Our attention applies RoPE to interleaved pairs ``(2i, 2i+1)`` (complex multiplication); HF's
``rotate_half`` pairs ``(i, i + head_dim/2)``. ``wq``/``wk`` rows are therefore permuted per head
when converting (the same permutation Meta's and HF's own conversion scripts use), which makes
the two models compute identical logits.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from torchtitan.models.common.rope import RoPEScalingArgs
from torchtitan.models.llama3.args import TransformerModelArgs

# ours -> HF; "{}" is the layer index.
_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER_MAP = {v: k for k, v in _LAYER_MAP.items()}
_HF_TOP_MAP = {v: k for k, v in _TOP_MAP.items()}
_OURS_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Buffers some HF versions saved; recomputed by both models, safe to drop.
_HF_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder ``wq``/``wk`` rows from interleaved RoPE pairs to HF's half-split layout."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.view(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`permute_to_hf`."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.view(n_heads, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


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
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.effective_n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": args.tie_word_embeddings,
        "dtype": dtype,  # transformers >= 4.56 reads "dtype" ("torch_dtype" is deprecated)
    }
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


class Llama3StateDictAdapter:
    """Converts Llama state dicts between torchtitan FQNs and HF ``LlamaForCausalLM`` names.

    ``to_hf``/``from_hf`` take and return plain (full, unsharded) tensors keyed by name.
    """

    args_from_hf_config = staticmethod(model_args_from_hf_config)

    def __init__(self, model_args: TransformerModelArgs, hf_assets_path: str | None = None):
        self.model_args = model_args
        self.hf_assets_path = hf_assets_path

    @property
    def n_heads(self) -> int:
        return self.model_args.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.model_args.effective_n_kv_heads

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our FQNs -> HF names (wq/wk permuted); ValueError naming any unknown key."""
        hf: dict[str, torch.Tensor] = {}
        unknown: list[str] = []
        for key, value in state_dict.items():
            if key in _TOP_MAP:
                if key == "output.weight" and self.model_args.tie_word_embeddings:
                    continue  # HF ties lm_head to embed_tokens itself
                hf[_TOP_MAP[key]] = value
                continue
            m = _OURS_LAYER_RE.match(key)
            if m is None or m.group(2) not in _LAYER_MAP:
                unknown.append(key)
                continue
            layer, rest = m.groups()
            if rest == "attention.wq.weight":
                value = permute_to_hf(value, self.n_heads)
            elif rest == "attention.wk.weight":
                value = permute_to_hf(value, self.n_kv_heads)
            hf[f"model.layers.{layer}.{_LAYER_MAP[rest]}"] = value
        if unknown:
            raise ValueError(
                f"cannot map {len(unknown)} key(s) to HF Llama names, e.g. {unknown[:3]}"
            )
        return hf

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names -> our FQNs (wq/wk permuted); ValueError naming any unknown key."""
        sd: dict[str, torch.Tensor] = {}
        unknown: list[str] = []
        for key, value in hf_state_dict.items():
            if _HF_IGNORED.search(key):
                continue
            if key in _HF_TOP_MAP:
                sd[_HF_TOP_MAP[key]] = value
                continue
            m = _HF_LAYER_RE.match(key)
            if m is None or m.group(2) not in _HF_LAYER_MAP:
                unknown.append(key)
                continue
            layer, rest = m.groups()
            ours = _HF_LAYER_MAP[rest]
            if ours == "attention.wq.weight":
                value = permute_from_hf(value, self.n_heads)
            elif ours == "attention.wk.weight":
                value = permute_from_hf(value, self.n_kv_heads)
            sd[f"layers.{layer}.{ours}"] = value
        if unknown:
            raise ValueError(
                f"cannot map {len(unknown)} HF key(s) to torchtitan Llama FQNs, e.g. {unknown[:3]}"
            )
        if "output.weight" not in sd and "tok_embeddings.weight" in sd:
            if self.model_args.tie_word_embeddings:
                sd["output.weight"] = sd["tok_embeddings.weight"]
        return sd

    def hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        """HF ``config.json`` contents for this model."""
        return hf_config_from_model_args(self.model_args, dtype)
