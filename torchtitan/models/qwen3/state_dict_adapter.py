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

from typing import Any

from torchtitan.models.common.hf_adapter import (
    BLOCK_NORMS,
    FUSED_EXPERTS,
    GQA_ATTENTION,
    LAYER,
    MOE_EXPERTS,
    MOE_ROUTER,
    TOP_KEYS,
    HFStateDictAdapter,
    decoder_hf_config,
    layer_keys,
    require_moe_settings,
    routing_bias_dropped,
    swiglu,
)
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3.args import Qwen3ModelArgs


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
    config = decoder_hf_config(args, "Qwen3ForCausalLM", "qwen3", args.hidden_dim, dtype,
                               attention_bias=False, use_sliding_window=False)
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
    require_moe_settings(m, {"num_shared_experts": 0, "score_func": "softmax", "route_scale": 1.0,
                             "num_expert_groups": None}, "Qwen3-MoE")


class Qwen3StateDictAdapter(HFStateDictAdapter):
    """Qwen3 state dicts between torchtitan FQNs and HF Hub names."""

    hf_name = "Qwen3"
    key_map = {**TOP_KEYS, **layer_keys({
        **GQA_ATTENTION, **BLOCK_NORMS, **swiglu("feed_forward", "mlp"), **MOE_ROUTER,
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    })}
    expert_map = MOE_EXPERTS
    fused_hf_keys = FUSED_EXPERTS
    export_drops = {f"layers.{LAYER}.moe.expert_bias": routing_bias_dropped(
        "HF Qwen3-MoE has no routing bias")}
    import_zeros = {f"layers.{LAYER}.moe.expert_bias": f"layers.{LAYER}.moe.experts.w1"}
    args_from_hf_config = staticmethod(model_args_from_hf_config)
    hf_config_from_args = staticmethod(hf_config_from_model_args)

    def check_exportable(self) -> None:
        if self.model_args.moe_args is not None:
            _check_hf_moe(self.model_args.moe_args)

    def missing_experts_message(self, layer: int, hf_proj: str, present: list[int], n: int) -> str:
        missing = sorted(set(range(n)) - set(present))
        return (
            f"HF layer {layer} has experts {present[:4]}... but the model has {n} (missing "
            f"{missing[:4]}); check model.flavor"
        )
