"""DeepSeek-V3 family (MLA + MoE): flavors and registry entry ``deepseek_v3``.

Flavors: ``debugmodel`` (CPU-trainable: V3 features at small widths, q LoRA, sigmoid routing
with bias, groups, shared experts, YaRN), ``debugmodel_flex_attn`` (the same with FlexAttention
and document masking, upstream's name), ``16B`` (DeepSeek-V2-Lite's shape, softmax routing), ``236B`` (DeepSeek-V2's shape) and
``671B`` (DeepSeek-V3). See docs/models.md.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.spec import ModelSpec, lazy

__all__ = ["DeepSeekV3Model", "DeepSeekV3ModelArgs", "deepseekv3_args"]

_DEBUG = DeepSeekV3ModelArgs(
    vocab_size=2048,
    dim=256,
    inter_dim=1024,
    moe_inter_dim=256,
    n_layers=6,
    n_dense_layers=1,
    n_heads=8,
    moe_args=MoEArgs(
        num_experts=8,
        num_shared_experts=2,
        top_k=3,
        score_func="sigmoid",
        route_norm=True,
        route_scale=1.0,
        num_expert_groups=4,
        num_limited_groups=2,
    ),
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    rope_factor=40.0,
    original_seq_len=4096,
    mscale=0.70,
    use_tokenizer_vocab=True,
)

deepseekv3_args: dict[str, DeepSeekV3ModelArgs] = {
    "debugmodel": _DEBUG,
    # upstream's name: FlexAttention (GPU; SDPA with the same mask on CPU) + document masking
    "debugmodel_flex_attn": replace(
        copy.deepcopy(_DEBUG), use_flex_attn=True, attn_mask_type="block_causal"
    ),
    "16B": DeepSeekV3ModelArgs(  # DeepSeek-V2-Lite / upstream torchtitan's 16B
        vocab_size=102400,
        dim=2048,
        inter_dim=10944,
        moe_inter_dim=1408,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        moe_args=MoEArgs(
            num_experts=64,
            num_shared_experts=2,
            top_k=6,
            score_func="softmax",
            route_norm=False,
            route_scale=1.0,
        ),
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_factor=40.0,
        original_seq_len=4096,
        mscale=0.707,
    ),
    "236B": DeepSeekV3ModelArgs(  # DeepSeek-V2's shape
        vocab_size=102400,
        dim=5120,
        inter_dim=12288,
        moe_inter_dim=1536,
        n_layers=60,
        n_dense_layers=1,
        n_heads=128,
        moe_args=MoEArgs(
            num_experts=160,
            num_shared_experts=2,
            top_k=6,
            score_func="softmax",
            route_norm=False,
            route_scale=16.0,
            num_expert_groups=8,
            num_limited_groups=3,
        ),
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_factor=40.0,
        original_seq_len=4096,
        mscale=1.0,
    ),
    "671B": DeepSeekV3ModelArgs(  # DeepSeek-V3 / R1 (without the multi-token-prediction layer)
        vocab_size=129280,
        dim=7168,
        inter_dim=18432,
        moe_inter_dim=2048,
        n_layers=61,
        n_dense_layers=3,
        n_heads=128,
        moe_args=MoEArgs(
            num_experts=256,
            num_shared_experts=1,
            top_k=8,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            num_expert_groups=8,
            num_limited_groups=4,
        ),
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_factor=40.0,
        original_seq_len=4096,
        mscale=1.0,
    ),
}


def _register() -> None:
    from torchtitan.models import register_model_spec

    register_model_spec(
        ModelSpec(
            name="deepseek_v3",
            model_cls=DeepSeekV3Model,
            model_args=deepseekv3_args,
            parallelize_fn=lazy("torchtitan.models.deepseek_v3.parallelize:parallelize_deepseekv3"),
            state_dict_adapter=lazy(
                "torchtitan.models.deepseek_v3.state_dict_adapter:DeepSeekV3StateDictAdapter"
            ),
            hf_model_types=("deepseek_v3", "deepseek_v2"),
        )
    )


_register()
