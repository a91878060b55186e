"""Llama model arguments (the shared decoder's fields plus Llama's FFN sizing and RoPE scaling)."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.models.common.decoder import DecoderArgs
from torchtitan.models.common.decoder import tokenizer_vocab_size as _tokenizer_vocab_size
from torchtitan.models.common.rope import RoPEScalingArgs
from torchtitan.tools.logging import logger

__all__ = ["TransformerModelArgs", "_tokenizer_vocab_size", "logger"]


@dataclass
class TransformerModelArgs(DecoderArgs):
    """Shape and behaviour of a Llama (2/3/3.1/3.2) decoder-only transformer."""

    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (None: n_heads, i.e. multi-head attention)."""
    multiple_of: int = 256
    """The SwiGLU hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    rope_scaling: RoPEScalingArgs | None = None
    """Llama 3.1 RoPE frequency scaling (None: no scaling)."""

    @property
    def head_dim(self) -> int:
        """Per-head dimension ``dim // n_heads``."""
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size: 2/3 of 4*dim, times ffn_dim_multiplier, rounded up to multiple_of."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def validate(self) -> None:
        """Raise ValueError naming the offending field if these args cannot build a model."""
        super().validate()
        if self.dim % self.n_heads != 0:
            raise ValueError(f"model dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"model head_dim={self.head_dim} (dim / n_heads) must be even for RoPE"
            )
        if self.n_heads % self.effective_n_kv_heads != 0:
            raise ValueError(
                f"model n_heads={self.n_heads} must be divisible by "
                f"n_kv_heads={self.effective_n_kv_heads}"
            )
        self.require_positive("n_layers", "vocab_size", "max_seq_len", "multiple_of")
