"""Building blocks shared by model families (plain PyTorch, no parallelism)."""

from torchtitan.models.common.attention import repeat_kv
from torchtitan.models.common.rope import (
    RoPEScalingArgs,
    apply_rope_scaling,
    apply_rotary_emb,
    precompute_freqs_cis,
    rope_frequencies,
)

__all__ = [
    "RoPEScalingArgs",
    "apply_rope_scaling",
    "apply_rotary_emb",
    "precompute_freqs_cis",
    "repeat_kv",
    "rope_frequencies",
]
