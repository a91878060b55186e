"""HF ``config.json`` (``DeepseekV3ForCausalLM``, or ``DeepseekV2ForCausalLM`` for softmax
routing) <-> ``DeepSeekV3ModelArgs``."""

from __future__ import annotations

import math
from typing import Any

from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.rope import yarn_get_mscale
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs

_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")


def _rope_params(config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings from ``rope_parameters`` (transformers v5) or ``rope_scaling``."""
    rope = dict(config.get("rope_parameters") or {})
    legacy = dict(config.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) == "default" and legacy:
        rope = {**legacy, "rope_theta": rope.get("rope_theta", config.get("rope_theta"))}
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return rope


def model_args_from_hf_config(config: dict[str, Any]) -> DeepSeekV3ModelArgs:
    """Build ``DeepSeekV3ModelArgs`` from an HF DeepSeek-V3 (or V2) ``config.json`` dict.

    Raises ValueError naming the field when the HF model is not representable.
    """
    model_type = config.get("model_type", "deepseek_v3")
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"HF config model_type={model_type!r} is not deepseek_v3 or deepseek_v2")
    v2 = model_type == "deepseek_v2"
    if config.get("attention_bias"):
        raise ValueError("HF config attention_bias=true is not supported by torchtitan's DeepSeek-V3")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"HF config hidden_act={config['hidden_act']!r} is not supported (silu)")
    if config.get("tie_word_embeddings"):
        raise ValueError("HF config tie_word_embeddings=true is not supported by DeepSeek-V3")
    n_heads = int(config["num_attention_heads"])
    rope = _rope_params(config)
    rope_args: dict[str, Any] = {"rope_theta": float(rope["rope_theta"])}
    if rope["rope_type"] == "yarn":
        original = int(rope["original_max_position_embeddings"])
        factor = rope.get("factor") or config["max_position_embeddings"] / original
        ms, ms_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:
            attention_factor = (
                yarn_get_mscale(factor, ms) / yarn_get_mscale(factor, ms_all)
                if ms and ms_all else yarn_get_mscale(factor)
            )
        if rope.get("truncate", True) is False:
            raise ValueError("HF config rope_parameters.truncate=false is not supported")
        rope_args.update(
            rope_factor=float(factor), original_seq_len=original,
            beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(ms_all or 0.0), rope_attention_factor=float(attention_factor),
        )
    elif rope["rope_type"] != "default":
        raise ValueError(f"HF config rope type {rope['rope_type']!r} is not supported (default or yarn)")
    n_experts = int(config.get("n_routed_experts") or config.get("num_experts") or 0)
    groups, limited = config.get("n_group"), config.get("topk_group")
    if v2:
        method = config.get("topk_method", "greedy")
        if method != "greedy":
            raise ValueError(
                f"HF DeepSeek-V2 topk_method={method!r} is not supported: its groups are scored "
                "by their best expert, torchtitan's (DeepSeek-V3's) by the sum of the best two"
            )
        groups = limited = None
        score_func, route_norm = "softmax", False  # V2 ignores norm_topk_prob
    else:
        score_func, route_norm = "sigmoid", bool(config.get("norm_topk_prob", True))
        if groups is not None and int(groups) <= 1:
            groups = limited = None
    moe = MoEArgs(
        num_experts=n_experts,
        num_shared_experts=int(config.get("n_shared_experts") or 0),
        top_k=int(config["num_experts_per_tok"]),
        score_func=score_func,
        route_norm=route_norm,
        route_scale=float(config.get("routed_scaling_factor", 1.0)),
        num_expert_groups=None if groups is None else int(groups),
        num_limited_groups=None if limited is None else int(limited),
        load_balance_coeff=None if v2 else 1e-3,
    )
    args = DeepSeekV3ModelArgs(
        vocab_size=int(config["vocab_size"]),
        dim=int(config["hidden_size"]),
        inter_dim=int(config["intermediate_size"]),
        moe_inter_dim=int(config["moe_intermediate_size"]),
        n_layers=int(config["num_hidden_layers"]),
        n_dense_layers=int(config.get("first_k_dense_replace") or 0),
        n_heads=n_heads,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        moe_args=moe,
        q_lora_rank=int(config.get("q_lora_rank") or 0),
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        **rope_args,
    )
    args.validate()
    return args


def _hf_mscales(factor: float, mscale_all_dim: float, attention_factor: float) -> dict[str, float]:
    """HF YaRN's ``mscale`` / ``mscale_all_dim`` (the keys published configs carry) that give
    ``attention_factor``; ``attention_factor`` itself only where they cannot express it, so an
    HF -> torchtitan -> HF round trip gives back the same keys and values."""
    out: dict[str, float] = {}
    if mscale_all_dim:
        out["mscale_all_dim"] = mscale_all_dim
        ms = mscale_all_dim
        if factor > 1:  # invert attention_factor = get_mscale(f, ms) / get_mscale(f, ms_all)
            ln = 0.1 * math.log(factor)
            ms = round((attention_factor * (ln * mscale_all_dim + 1.0) - 1.0) / ln, 12)
        ratio = yarn_get_mscale(factor, ms) / yarn_get_mscale(factor, mscale_all_dim)
        if ms > 0 and math.isclose(ratio, attention_factor, rel_tol=1e-9):
            out["mscale"] = ms
            return out
    elif math.isclose(attention_factor, yarn_get_mscale(factor), rel_tol=1e-9):
        return out  # HF's default when neither mscale is given
    out["attention_factor"] = attention_factor
    return out


def hf_config_from_model_args(
    args: DeepSeekV3ModelArgs, dtype: str = "float32", rope_interleave: bool = True
) -> dict[str, Any]:
    """An HF ``config.json`` dict equivalent to ``args``: ``DeepseekV3ForCausalLM`` for sigmoid
    routing; ``DeepseekV2ForCausalLM`` for softmax routing without groups or renormalisation
    (DeepSeek-V2-Lite, the ``16B`` flavor). ValueError for what neither can express."""
    moe = args.moe_args
    v2 = moe.score_func == "softmax"
    if v2 and (moe.num_expert_groups is not None or moe.route_norm):
        raise ValueError(
            "HF DeepseekV2 cannot express softmax routing with expert groups or route_norm "
            "(its groups are scored differently); no HF export for this model"
        )
    if v2 and not rope_interleave:
        raise ValueError("HF DeepseekV2 always uses interleaved RoPE (rope_interleave=True)")
    config: dict[str, Any] = {
        "architectures": ["DeepseekV2ForCausalLM" if v2 else "DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v2" if v2 else "deepseek_v3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.inter_dim,
        "moe_intermediate_size": args.moe_inter_dim,
        "num_hidden_layers": args.n_layers,
        "first_k_dense_replace": args.n_dense_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_shared_experts": moe.num_shared_experts,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "routed_scaling_factor": moe.route_scale,
        "norm_topk_prob": moe.route_norm,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
    }
    if v2:
        config.update(topk_method="greedy", n_group=None, topk_group=None)
    else:
        config.update(
            n_group=moe.num_expert_groups or 1, topk_group=moe.num_limited_groups or 1,
            rope_interleave=rope_interleave, num_nextn_predict_layers=0,
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.yarn is not None:
        rope.update(
            rope_type="yarn", factor=args.rope_factor,
            original_max_position_embeddings=args.original_seq_len,
            beta_fast=args.beta_fast, beta_slow=args.beta_slow,
            **_hf_mscales(args.rope_factor, args.mscale, args.rope_attention_factor),
        )
    config["rope_parameters"] = rope
    config["rope_scaling"] = rope if args.yarn is not None else None  # older readers
    config["rope_theta"] = args.rope_theta
    return config
