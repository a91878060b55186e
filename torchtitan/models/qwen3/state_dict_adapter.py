"""Hugging Face ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` <-> torchtitan Qwen3 state dicts
and configs.

Key names are those of the Hub safetensors (what ``save_pretrained`` writes and
``from_pretrained`` reads): routed experts one by one, ``model.layers.{i}.mlp.experts.{j}.
{gate,up,down}_proj.weight``, the router as ``model.layers.{i}.mlp.gate.weight``. ``from_hf``
also accepts transformers 5's in-memory fused layout (``mlp.experts.gate_up_proj`` ``[E, 2I, D]``
and ``mlp.experts.down_proj`` ``[E, D, I]``, i.e. ``model.state_dict()``). Our RoPE already uses
HF's rotate-half pairing, so no weight is permuted.

HF Qwen3-MoE has no routing bias: ``from_hf`` gives every MoE layer a zero ``expert_bias``
(routing then equals HF's), and ``to_hf`` drops it; ``dropped_by_export`` says when it is not
zero (a model trained with ``load_balance_coeff`` then routes differently in transformers, so
exports refuse it unless asked to be lossy).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3.args import Qwen3ModelArgs

# ours -> HF; inside "model.layers.{i}."
_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
}
_TOP_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_EXPERT_MAP = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_HF_LAYER_MAP = {v: k for k, v in _LAYER_MAP.items()}
_HF_TOP_MAP = {v: k for k, v in _TOP_MAP.items()}
_HF_EXPERT_MAP = {v: k for k, v in _EXPERT_MAP.items()}
_OURS_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_HF_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def model_args_from_hf_config(config: dict[str, Any]) -> Qwen3ModelArgs:
    """``Qwen3ModelArgs`` from an HF Qwen3 / Qwen3-MoE ``config.json`` dict; ValueError naming
    the field when the model is not representable (biases, sliding window, RoPE scaling)."""
    model_type = config.get("model_type", "qwen3")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"HF config model_type={model_type!r} is not a Qwen3 model")
    if config.get("attention_bias"):
        raise ValueError("HF config attention_bias=true is not supported by torchtitan's Qwen3")
    if config.get("use_sliding_window"):
        raise ValueError("HF config use_sliding_window=true is not supported by torchtitan's Qwen3")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"HF config hidden_act={config['hidden_act']!r} is not supported (silu)")
    rope = dict(config.get("rope_parameters") or {})
    scaling = rope if rope.get("rope_type", "default") != "default" else config.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"HF config RoPE scaling {scaling!r} is not supported by torchtitan's Qwen3")
    dim = int(config["hidden_size"])
    n_heads = int(config["num_attention_heads"])
    moe_args, moe_hidden = None, 768
    n_experts = config.get("num_experts", config.get("num_local_experts"))
    if model_type == "qwen3_moe" and n_experts:
        moe_args = MoEArgs(
            num_experts=int(n_experts),
            top_k=int(config["num_experts_per_tok"]),
            score_func="softmax",
            route_norm=bool(config.get("norm_topk_prob", False)),
        )
        moe_hidden = int(config["moe_intermediate_size"])
    return Qwen3ModelArgs(
        dim=dim,
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=int(config.get("head_dim") or dim // n_heads),
        vocab_size=int(config["vocab_size"]),
        hidden_dim=int(config["intermediate_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        max_seq_len=int(config.get("max_position_embeddings", 40960)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        moe_args=moe_args,
        moe_hidden_dim=moe_hidden,
        decoder_sparse_step=int(config.get("decoder_sparse_step") or 1),
        mlp_only_layers=list(config.get("mlp_only_layers") or []),
    )


def hf_config_from_model_args(args: Qwen3ModelArgs, dtype: str = "float32") -> dict[str, Any]:
    """An HF ``config.json`` dict (Qwen3ForCausalLM, or Qwen3MoeForCausalLM with experts)."""
    config: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
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
        "use_sliding_window": False,
        "tie_word_embeddings": args.tie_word_embeddings,
        "dtype": dtype,
    }
    m = args.moe_args
    if m is not None:
        _check_hf_moe(m)
        config.update({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": args.moe_hidden_dim,
            "norm_topk_prob": m.route_norm,
            "decoder_sparse_step": args.decoder_sparse_step,
            "mlp_only_layers": list(args.mlp_only_layers),
        })
    return config


def _check_hf_moe(m: MoEArgs) -> None:
    """HF Qwen3-MoE routes with softmax, top-k, optional renormalisation, nothing else."""
    unsupported = {
        "num_shared_experts": (m.num_shared_experts, 0),
        "score_func": (m.score_func, "softmax"),
        "route_scale": (m.route_scale, 1.0),
        "num_expert_groups": (m.num_expert_groups, None),
    }
    for name, (value, hf_value) in unsupported.items():
        if value != hf_value:
            raise ValueError(
                f"moe {name}={value!r} cannot be expressed in HF Qwen3-MoE (which has {hf_value!r})"
            )


class Qwen3StateDictAdapter:
    """Converts Qwen3 state dicts between torchtitan FQNs and HF Hub names.

    ``to_hf``/``from_hf`` take and return plain (full, unsharded) tensors keyed by name.
    """

    args_from_hf_config = staticmethod(model_args_from_hf_config)

    def __init__(self, model_args: Qwen3ModelArgs, hf_assets_path: str | None = None):
        self.model_args = model_args
        self.hf_assets_path = hf_assets_path

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our FQNs -> HF Hub names (experts split one by one); ValueError naming unknown keys."""
        if self.model_args.moe_args is not None:
            _check_hf_moe(self.model_args.moe_args)
        hf: dict[str, torch.Tensor] = {}
        unknown: list[str] = []
        for key, value in state_dict.items():
            if key in _TOP_MAP:
                if key == "output.weight" and self.model_args.tie_word_embeddings:
                    continue  # HF ties lm_head to embed_tokens itself
                hf[_TOP_MAP[key]] = value
                continue
            m = _OURS_LAYER_RE.match(key)
            if m is None:
                unknown.append(key)
                continue
            layer, rest = m.groups()
            prefix = f"model.layers.{layer}."
            if rest in _LAYER_MAP:
                hf[prefix + _LAYER_MAP[rest]] = value
            elif rest in ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3"):
                proj = _EXPERT_MAP[rest.rsplit(".", 1)[1]]
                for j in range(value.shape[0]):
                    hf[f"{prefix}mlp.experts.{j}.{proj}.weight"] = value[j]
            elif rest != "moe.expert_bias":  # HF has none (see dropped_by_export)
                unknown.append(key)
        if unknown:
            raise ValueError(
                f"cannot map {len(unknown)} key(s) to HF Qwen3 names, e.g. {unknown[:3]}"
            )
        return hf

    def dropped_by_export(self, state_dict: dict[str, torch.Tensor]) -> str:
        """What ``to_hf`` loses of ``state_dict``: a non-zero routing bias ("" when nothing)."""
        biases = [v for k, v in state_dict.items() if k.endswith(".moe.expert_bias")]
        biased = [v for v in biases if v.numel() and v.abs().max() > 0]
        if not biased:
            return ""
        top = max(float(v.abs().max()) for v in biased)
        return (
            f"the load-balancing expert_bias of {len(biased)} MoE layer(s) is not zero (max "
            f"|bias| {top:.3g}), but HF Qwen3-MoE has no routing bias: the exported model would "
            "route tokens to other experts"
        )

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names (Hub per-expert or transformers' fused layout) -> our FQNs; ValueError
        naming unknown keys or missing experts."""
        sd: dict[str, torch.Tensor] = {}
        unknown: list[str] = []
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for key, value in hf_state_dict.items():
            if _HF_IGNORED.search(key):
                continue
            if key in _HF_TOP_MAP:
                sd[_HF_TOP_MAP[key]] = value
                continue
            m = _HF_LAYER_RE.match(key)
            if m is None:
                unknown.append(key)
                continue
            layer, rest = m.groups()
            prefix = f"layers.{layer}."
            e = _HF_EXPERT_RE.match(rest)
            if rest in _HF_LAYER_MAP:
                sd[prefix + _HF_LAYER_MAP[rest]] = value
            elif e is not None:
                experts.setdefault((layer, _HF_EXPERT_MAP[e.group(2)]), {})[int(e.group(1))] = value
            elif rest == "mlp.experts.gate_up_proj":
                w1, w3 = value.chunk(2, dim=1)
                sd[prefix + "moe.experts.w1"], sd[prefix + "moe.experts.w3"] = w1, w3
            elif rest == "mlp.experts.down_proj":
                sd[prefix + "moe.experts.w2"] = value
            else:
                unknown.append(key)
        if unknown:
            raise ValueError(
                f"cannot map {len(unknown)} HF key(s) to torchtitan Qwen3 FQNs, e.g. {unknown[:3]}"
            )
        n_experts = self.model_args.moe_args.num_experts if self.model_args.moe_args else 0
        for (layer, w), per_expert in experts.items():
            missing = sorted(set(range(n_experts)) - set(per_expert))
            if missing or len(per_expert) != n_experts:
                raise ValueError(
                    f"HF layer {layer} has experts {sorted(per_expert)[:4]}... but the model has "
                    f"{n_experts} (missing {missing[:4]}); check model.flavor"
                )
            sd[f"layers.{layer}.moe.experts.{w}"] = torch.stack(
                [per_expert[j] for j in range(n_experts)]
            )
        for i in range(self.model_args.n_layers):
            if self.model_args.is_moe_layer(i) and f"layers.{i}.moe.experts.w1" in sd:
                sd[f"layers.{i}.moe.expert_bias"] = torch.zeros(n_experts)
        if "output.weight" not in sd and "tok_embeddings.weight" in sd:
            if self.model_args.tie_word_embeddings:
                sd["output.weight"] = sd["tok_embeddings.weight"]
        return sd

    def hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        """HF ``config.json`` contents for this model."""
        return hf_config_from_model_args(self.model_args, dtype)
