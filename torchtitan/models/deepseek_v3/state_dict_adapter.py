"""Hugging Face DeepSeek-V3 (and V2) <-> torchtitan DeepSeek-V3 state dicts and configs.

Key names are those of the Hub checkpoints, which transformers' ``save_pretrained`` also writes
(it fuses the experts in memory only): per-expert ``model.layers.{i}.mlp.experts.{j}.
gate_proj/up_proj/down_proj.weight``, ``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
``mlp.shared_experts.*`` and ``self_attn.q_proj`` / ``q_a_proj, q_a_layernorm, q_b_proj`` /
``kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj``. ``from_hf`` also reads the fused
in-memory layout (``mlp.experts.gate_up_proj`` / ``down_proj``), dequantizes FP8 Hub weights
(``weight_scale_inv``, 128x128 blocks) and drops the multi-token-prediction layer.

RoPE: DeepSeek checkpoints store the rope part of ``q``/``k`` with interleaved pairs, which is
what our complex rotation uses and what HF reads with ``rope_interleave=True``; for
``rope_interleave=False`` checkpoints the rope rows are permuted (as for Llama). An import takes
the layout from the imported folder's ``config.json`` (``with_hf_layout``).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from torchtitan.models.common.hf_adapter import (
    BLOCK_NORMS,
    FUSED_EXPERTS,
    LAYER,
    MOE_EXPERTS,
    MOE_ROUTER,
    TOP_KEYS,
    HFStateDictAdapter,
    RopeHalfSplit,
    canonical_key,
    layer_keys,
    routing_bias_dropped,
    swiglu,
)
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.hf_config import (
    hf_config_from_model_args,
    model_args_from_hf_config,
)

_FP8_BLOCK = 128
# Hub keys an import reads without mapping: FP8 scales and the multi-token-prediction layer's own.
_EXTRA_HF = re.compile(
    r"(\.weight_scale_inv|\.(eh_proj|enorm|hnorm)\.weight|\.shared_head\.\w+\.weight"
    r"|^model\.layers\.\d+\.embed_tokens\.weight)$"
)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """DeepSeek's FP8 Hub weights: ``weight`` (float8) times ``scale_inv`` per 128x128 block."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(_FP8_BLOCK, 0)[:rows]
    scale = scale.repeat_interleave(_FP8_BLOCK, 1)[:, :cols]
    return (weight.float() * scale).to(torch.bfloat16)


def rope_interleave_of(config: dict[str, Any]) -> bool:
    """The RoPE layout of an HF config: ``rope_interleave`` (default True); DeepseekV2 reads
    interleaved pairs whatever it says."""
    if config.get("model_type") == "deepseek_v2":
        return True
    return bool(config.get("rope_interleave", True))


def _config_rope_interleave(hf_assets_path: str | None) -> bool:
    """``rope_interleave`` of the ``config.json`` in ``hf_assets_path`` (True if absent)."""
    path = os.path.join(hf_assets_path, "config.json") if hf_assets_path else None
    if path is None or not os.path.isfile(path):
        return True
    with open(path) as f:
        return rope_interleave_of(json.load(f))


def _half_split(adapter: DeepSeekV3StateDictAdapter) -> bool:
    return not adapter.rope_interleave


# the rope part of each query head; of wkv_a, the rows after the latent
_Q_ROPE = RopeHalfSplit(period=lambda a: a.qk_head_dim, start=lambda a: a.qk_nope_head_dim,
                        width=lambda a: a.qk_rope_head_dim, applies=_half_split)
_KV_ROPE = RopeHalfSplit(period=None, start=lambda a: a.kv_lora_rank,
                         width=lambda a: a.qk_rope_head_dim, applies=_half_split)


class DeepSeekV3StateDictAdapter(HFStateDictAdapter):
    """DeepSeek-V3 state dicts between torchtitan FQNs and HF names.

    ``rope_interleave`` is the HF config's (True for every published DeepSeek checkpoint); when
    not given it is read from ``hf_assets_path/config.json`` if there is one, else True.
    """

    hf_name = "DeepSeek-V3"
    key_map = {**TOP_KEYS, **layer_keys({
        **BLOCK_NORMS,
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wq_a.weight": "self_attn.q_a_proj.weight",
        "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
        "attention.wq_b.weight": "self_attn.q_b_proj.weight",
        "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        **swiglu("feed_forward", "mlp"),
        **MOE_ROUTER,
        "moe.expert_bias": "mlp.gate.e_score_correction_bias",
        **swiglu("moe.shared_experts", "mlp.shared_experts"),
    })}
    expert_map = MOE_EXPERTS
    fused_hf_keys = FUSED_EXPERTS
    transforms = {
        f"layers.{LAYER}.attention.wq.weight": _Q_ROPE,
        f"layers.{LAYER}.attention.wq_b.weight": _Q_ROPE,
        f"layers.{LAYER}.attention.wkv_a.weight": _KV_ROPE,
    }
    # DeepseekV2 (softmax routing) has no routing bias; an import of one gives zeros
    export_drops = {f"layers.{LAYER}.moe.expert_bias": routing_bias_dropped(
        "HF DeepseekV2 routes without a bias")}
    import_zeros = {f"layers.{LAYER}.moe.expert_bias": f"layers.{LAYER}.moe.router.gate.weight"}
    hf_ignored = r"(rotary_emb\.inv_freq|rotary_emb\.original_inv_freq)$"
    # the RoPE layout (an import follows the folder's) and the MTP layer (dropped on import)
    not_compared = HFStateDictAdapter.not_compared | {"rope_interleave", "num_nextn_predict_layers"}
    args_from_hf_config = staticmethod(model_args_from_hf_config)

    def __init__(
        self,
        model_args: DeepSeekV3ModelArgs,
        hf_assets_path: str | None = None,
        rope_interleave: bool | None = None,
    ):
        super().__init__(model_args, hf_assets_path)
        if rope_interleave is None:
            rope_interleave = _config_rope_interleave(hf_assets_path)
        self.rope_interleave = rope_interleave

    def with_hf_layout(self, config: dict[str, Any]) -> DeepSeekV3StateDictAdapter:
        """This adapter (same model args) for weights stored as HF ``config`` says: the RoPE
        layout of the folder being imported, not of ``hf_assets_path``."""
        return type(self)(self.model_args, self.hf_assets_path, rope_interleave_of(config))

    def hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        """HF ``config.json`` contents for this model."""
        return hf_config_from_model_args(self.model_args, dtype, self.rope_interleave)

    def active_export_drops(self) -> dict:
        return self.export_drops if self.model_args.moe_args.score_func == "softmax" else {}

    @classmethod
    def is_extra_hf_key(cls, key: str) -> bool:
        return super().is_extra_hf_key(key) or _EXTRA_HF.search(key) is not None

    def prepare_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """FP8 weights dequantized; the multi-token-prediction layer (a layer past the model's
        with ``eh_proj``) dropped."""
        out = dict(hf_state_dict)
        for key in [k for k in out if k.endswith(".weight_scale_inv")]:
            weight_key = key[: -len("_scale_inv")]
            out[weight_key] = dequantize_fp8(out[weight_key], out.pop(key))
        n_layers = self.model_args.n_layers
        layer = {k: idx[0] for k in out if (idx := canonical_key(k)[1])}
        mtp = {i for k, i in layer.items() if i >= n_layers and "eh_proj" in k}
        return {k: v for k, v in out.items() if layer.get(k) not in mtp}
