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

from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.hf_config import (
    hf_config_from_model_args,
    model_args_from_hf_config,
)

# ours -> HF; layer-relative names.
_LAYER_MAP = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_EXPERT_MAP = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_TOP_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER_MAP = {v: k for k, v in _LAYER_MAP.items()}
_HF_TOP_MAP = {v: k for k, v in _TOP_MAP.items()}
_HF_EXPERT_MAP = {v: k for k, v in _EXPERT_MAP.items()}
_OURS_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_HF_IGNORED = re.compile(r"(rotary_emb\.inv_freq|rotary_emb\.original_inv_freq)$")
_FP8_BLOCK = 128


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


def _permute_rope_rows(w: torch.Tensor, start: int, rope_dim: int, period: int, to_hf: bool):
    """Reorder the rope rows ``[start, start + rope_dim)`` of every ``period`` rows between our
    interleaved pairs and HF's half-split (``rope_interleave=False``) layout."""
    out = w.clone()
    blocks = out.view(-1, period, *w.shape[1:])
    rope = blocks[:, start : start + rope_dim]
    shape = (2, rope_dim // 2) if not to_hf else (rope_dim // 2, 2)
    reordered = rope.reshape(rope.shape[0], *shape, *w.shape[1:]).transpose(1, 2)
    blocks[:, start : start + rope_dim] = reordered.reshape(rope.shape)
    return out


class DeepSeekV3StateDictAdapter:
    """Converts DeepSeek-V3 state dicts between torchtitan FQNs and HF names.

    ``to_hf``/``from_hf`` take and return plain (full, unsharded) tensors keyed by name.
    ``rope_interleave`` is the HF config's (True for every published DeepSeek checkpoint); when
    not given it is read from ``hf_assets_path/config.json`` if there is one, else True.
    """

    args_from_hf_config = staticmethod(model_args_from_hf_config)

    def __init__(
        self,
        model_args: DeepSeekV3ModelArgs,
        hf_assets_path: str | None = None,
        rope_interleave: bool | None = None,
    ):
        self.model_args = model_args
        self.hf_assets_path = hf_assets_path
        if rope_interleave is None:
            rope_interleave = _config_rope_interleave(hf_assets_path)
        self.rope_interleave = rope_interleave

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> DeepSeekV3StateDictAdapter:
        """The adapter (model args and RoPE layout) for an HF ``config.json`` dict."""
        return cls(model_args_from_hf_config(config), rope_interleave=rope_interleave_of(config))

    def with_hf_layout(self, config: dict[str, Any]) -> DeepSeekV3StateDictAdapter:
        """This adapter (same model args) for weights stored as HF ``config`` says: the RoPE
        layout of the folder being imported, not of ``hf_assets_path``."""
        return type(self)(self.model_args, self.hf_assets_path, rope_interleave_of(config))

    # --- rope layout ---------------------------------------------------------------------
    def _convert_rope(self, ours_name: str, w: torch.Tensor, to_hf: bool) -> torch.Tensor:
        if self.rope_interleave:
            return w
        a = self.model_args
        if ours_name in ("attention.wq.weight", "attention.wq_b.weight"):
            return _permute_rope_rows(w, a.qk_nope_head_dim, a.qk_rope_head_dim, a.qk_head_dim, to_hf)
        if ours_name == "attention.wkv_a.weight":
            return _permute_rope_rows(w, a.kv_lora_rank, a.qk_rope_head_dim, w.shape[0], to_hf)
        return w

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our FQNs -> HF names (experts split per expert); ValueError naming unknown keys."""
        hf: dict[str, torch.Tensor] = {}
        unknown: list[str] = []
        v2 = self.model_args.moe_args.score_func == "softmax"  # DeepseekV2: no routing bias
        for key, value in state_dict.items():
            if key in _TOP_MAP:
                hf[_TOP_MAP[key]] = value
                continue
            if v2 and key.endswith(".moe.expert_bias"):
                continue  # see dropped_by_export
            m = _OURS_LAYER_RE.match(key)
            if m is None:
                unknown.append(key)
                continue
            layer, rest = m.groups()
            prefix = f"model.layers.{layer}."
            if rest.startswith("moe.experts.") and rest[len("moe.experts."):] in _EXPERT_MAP:
                proj = _EXPERT_MAP[rest[len("moe.experts."):]]
                for j, expert in enumerate(value.unbind(0)):
                    hf[f"{prefix}mlp.experts.{j}.{proj}.weight"] = expert
            elif rest in _LAYER_MAP:
                hf[prefix + _LAYER_MAP[rest]] = self._convert_rope(rest, value, to_hf=True)
            else:
                unknown.append(key)
        if unknown:
            raise ValueError(
                f"cannot map {len(unknown)} key(s) to HF DeepSeek-V3 names, e.g. {unknown[:3]}"
            )
        return hf

    def dropped_by_export(self, state_dict: dict[str, torch.Tensor]) -> str:
        """What ``to_hf`` loses of ``state_dict``: DeepseekV2's missing routing bias when the
        trained one is not zero ("" when nothing is lost)."""
        if self.model_args.moe_args.score_func != "softmax":
            return ""
        biased = [v for k, v in state_dict.items() if k.endswith(".moe.expert_bias")
                  and v.numel() and v.abs().max() > 0]
        if not biased:
            return ""
        top = max(float(v.abs().max()) for v in biased)
        return (
            f"the load-balancing expert_bias of {len(biased)} MoE layer(s) is not zero (max "
            f"|bias| {top:.3g}), but HF DeepseekV2 routes without a bias: the exported model "
            "would route tokens to other experts"
        )

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names -> our FQNs (per-expert or fused experts stacked; FP8 dequantized; the
        multi-token-prediction layer dropped; a missing routing bias (DeepSeek-V2) zero);
        ValueError naming unknown keys."""
        hf_state_dict = self._dequantized(hf_state_dict)
        n_layers = self.model_args.n_layers
        mtp_layers = {
            int(m.group(1))
            for k in hf_state_dict
            if (m := _HF_LAYER_RE.match(k)) and int(m.group(1)) >= n_layers and "eh_proj" in k
        }
        sd: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        unknown: list[str] = []
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
            if int(layer) in mtp_layers:
                continue
            if int(layer) >= n_layers:
                unknown.append(f"{key} (the model has {n_layers} layers)")
                continue
            prefix = f"layers.{layer}."
            if e := _HF_EXPERT_RE.match(rest):
                experts.setdefault((layer, _HF_EXPERT_MAP[e.group(2)]), {})[int(e.group(1))] = value
            elif rest == "mlp.experts.gate_up_proj":  # transformers' fused in-memory layout
                w1, w3 = value.chunk(2, dim=1)
                sd[prefix + "moe.experts.w1"], sd[prefix + "moe.experts.w3"] = w1, w3
            elif rest == "mlp.experts.down_proj":
                sd[prefix + "moe.experts.w2"] = value
            elif rest in _HF_LAYER_MAP:
                ours = _HF_LAYER_MAP[rest]
                sd[prefix + ours] = self._convert_rope(ours, value, to_hf=False)
            else:
                unknown.append(key)
        if unknown:
            raise ValueError(
                f"cannot map {len(unknown)} HF key(s) to torchtitan DeepSeek-V3 FQNs, e.g. "
                f"{unknown[:3]}"
            )
        n_experts = self.model_args.moe_args.num_experts
        for (layer, w), by_index in experts.items():
            missing = sorted(set(range(n_experts)) - set(by_index))
            extra = sorted(set(by_index) - set(range(n_experts)))
            if missing or extra:
                what = f"lacks expert(s) {missing[:3]}" if missing else f"has expert(s) {extra[:3]}"
                raise ValueError(
                    f"HF layer {layer} {what} ({_EXPERT_MAP[w]}); the model has {n_experts} "
                    "experts: check model.flavor"
                )
            sd[f"layers.{layer}.moe.experts.{w}"] = torch.stack([by_index[j] for j in range(n_experts)])
        for key in list(sd):
            if key.endswith(".moe.router.gate.weight"):
                bias = key.replace("router.gate.weight", "expert_bias")
                if bias not in sd:  # DeepSeek-V2 routes without a bias
                    sd[bias] = torch.zeros(n_experts, dtype=torch.float32)
        return sd

    @staticmethod
    def _dequantized(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        scales = [k for k in sd if k.endswith(".weight_scale_inv")]
        if not scales:
            return sd
        out = dict(sd)
        for key in scales:
            weight_key = key[: -len("_scale_inv")]
            out[weight_key] = dequantize_fp8(out[weight_key], out.pop(key))
        return out

    def hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        """HF ``config.json`` contents for this model."""
        return hf_config_from_model_args(self.model_args, dtype, self.rope_interleave)
