"""gpt-oss model arguments: the shared decoder's fields plus gpt-oss's."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.models.common.decoder import DecoderArgs
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.rope import YaRNScalingArgs, yarn_get_mscale

LAYER_TYPES = ("sliding_attention", "full_attention")


def gpt_oss_moe(num_experts: int, load_balance_coeff: float | None = None) -> MoEArgs:
    """gpt-oss routing and experts: a biased router, softmax over the top-4 logits (softmax
    over all, renormalised over the top 4: the same weights), biased clamped-SwiGLU experts."""
    return MoEArgs(
        num_experts=num_experts, top_k=4, score_func="softmax", route_norm=True,
        router_bias=True, expert_linear_bias=True, expert_activation="clamped_swiglu",
        swiglu_alpha=1.702, swiglu_limit=7.0, load_balance_coeff=load_balance_coeff,
    )


@dataclass
class GptOssModelArgs(DecoderArgs):
    """Shape and behaviour of a gpt-oss decoder (transformers' ``GptOssConfig``): grouped-query
    attention with biases and learned per-head sinks, alternating sliding-window and full
    causal layers (``layer_types``), rotate-half RoPE with YaRN scaling, and MoE in every
    block."""

    dim: int = 2880
    n_layers: int = 24
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 201088
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    max_seq_len: int = 131072
    """Rows of the RoPE table; set from training.seq_len by update_from_config."""
    sliding_window_size: int | None = 128
    """Window of the ``sliding_attention`` layers (None: every layer attends fully)."""
    layer_types: list[str] | None = None
    """Per layer ``sliding_attention`` or ``full_attention`` (HF ``layer_types``; None: even
    layers sliding, odd layers full, as HF's default)."""
    attention_bias: bool = True
    attention_sinks: bool = True
    moe_hidden_dim: int = 2880
    """Width of each expert (HF ``intermediate_size``)."""
    moe_args: MoEArgs = field(default_factory=lambda: gpt_oss_moe(32))

    # YaRN (HF rope_parameters)
    rope_factor: float = 32.0
    """YaRN factor; YaRN is on when > 1, at every sequence length (as HF)."""
    original_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    rope_truncate: bool = False
    """HF ``truncate``: gpt-oss keeps the YaRN ramp bounds fractional."""

    def __post_init__(self) -> None:
        if isinstance(self.moe_args, dict):  # args recorded as JSON (checkpoint markers)
            self.moe_args = MoEArgs(**self.moe_args)
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)

    def layer_type(self, layer_id: int) -> str:
        """``sliding_attention`` or ``full_attention``."""
        if self.layer_types is not None:
            return self.layer_types[layer_id]
        return LAYER_TYPES[layer_id % 2]

    def attention_window(self, layer_id: int) -> int | None:
        if self.layer_type(layer_id) == "sliding_attention":
            return self.sliding_window_size
        return None

    @property
    def rope_scaling(self) -> YaRNScalingArgs | None:
        """YaRN with HF's attention factor ``0.1 * ln(factor) + 1`` on cos and sin (so on
        q.k squared); None when ``rope_factor <= 1``."""
        if self.rope_factor <= 1:
            return None
        return YaRNScalingArgs(
            factor=self.rope_factor, original_max_position_embeddings=self.original_seq_len,
            beta_fast=self.beta_fast, beta_slow=self.beta_slow,
            attention_factor=yarn_get_mscale(self.rope_factor), truncate=self.rope_truncate,
        )

    def validate(self) -> None:
        """Raise ValueError (one line) naming the offending field if no model can be built."""
        super().validate()
        self.require_positive("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                              "vocab_size", "max_seq_len", "moe_hidden_dim")
        if self.head_dim % 2:
            raise ValueError(f"model head_dim={self.head_dim} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.tie_word_embeddings:
            raise ValueError("gpt-oss tie_word_embeddings=True is not supported (untied)")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layers:
                raise ValueError(
                    f"model layer_types has {len(self.layer_types)} entries for "
                    f"n_layers={self.n_layers}"
                )
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"model layer_types {bad} must be one of {', '.join(LAYER_TYPES)}")
        if self.rope_factor > 1 and self.beta_fast <= self.beta_slow:
            raise ValueError(
                f"model beta_fast={self.beta_fast} must be greater than beta_slow={self.beta_slow}"
            )
        self.moe_args.validate()
