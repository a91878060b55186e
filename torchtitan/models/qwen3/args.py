"""Qwen3 model arguments (dense and MoE): the shared decoder's fields plus Qwen3's."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.models.common.decoder import DecoderArgs
from torchtitan.models.common.moe import MoEArgs


@dataclass
class Qwen3ModelArgs(DecoderArgs):
    """Shape and behaviour of a Qwen3 / Qwen3-MoE decoder-only transformer.

    Differences from Llama: an explicit ``head_dim`` (``n_heads * head_dim`` need not equal
    ``dim``), RMSNorm over ``head_dim`` on queries and keys before RoPE (QK-norm), RoPE in HF's
    rotate-half layout without scaling, and optionally mixture-of-experts feed-forwards
    (``moe_args``).
    """

    n_layers: int = 36
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960
    """Rows of the RoPE table; set from training.seq_len by update_from_config."""
    n_kv_heads: int | None = 8
    """Key/value heads for grouped-query attention (None: n_heads)."""
    head_dim: int = 128
    hidden_dim: int = 12288
    """Width of the dense SwiGLU feed-forward (HF ``intermediate_size``)."""
    moe_args: MoEArgs | None = None
    """Routing and expert settings of the MoE layers (None: a dense model)."""
    moe_hidden_dim: int = 768
    """Width of each routed expert (HF ``moe_intermediate_size``); unused when dense."""
    decoder_sparse_step: int = 1
    """Layer ``i`` is MoE when ``(i + 1) % decoder_sparse_step == 0`` (HF semantics) ..."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """... and ``i`` is not listed here (those layers use the dense feed-forward)."""

    def __post_init__(self) -> None:
        # Records of the args (checkpoint markers, JSON) hold moe_args as a plain dict.
        if isinstance(self.moe_args, dict):
            self.moe_args = MoEArgs(**self.moe_args)
        self.mlp_only_layers = [int(i) for i in self.mlp_only_layers]

    @property
    def ffn_hidden_dim(self) -> int:
        """Width of the dense feed-forward (same name as the Llama args)."""
        return self.hidden_dim

    @property
    def is_moe(self) -> bool:
        return self.moe_args is not None

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` uses the MoE feed-forward (HF Qwen3-MoE's rule)."""
        return (
            self.moe_args is not None
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    def validate(self) -> None:
        """Raise ValueError (one line) naming the offending field if these args cannot build a
        model."""
        super().validate()
        self.require_positive("dim", "n_layers", "n_heads", "head_dim", "vocab_size",
                              "hidden_dim", "max_seq_len", "decoder_sparse_step")
        if self.head_dim % 2:
            raise ValueError(f"model head_dim={self.head_dim} must be even for RoPE")
        if self.effective_n_kv_heads <= 0 or self.n_heads % self.effective_n_kv_heads:
            raise ValueError(
                f"model n_heads={self.n_heads} must be divisible by "
                f"n_kv_heads={self.effective_n_kv_heads}"
            )
        if self.moe_args is not None:
            self.moe_args.validate()
            if self.moe_hidden_dim <= 0:
                raise ValueError(f"model moe_hidden_dim={self.moe_hidden_dim} must be positive")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(
                f"model mlp_only_layers={bad} are not layers of a {self.n_layers}-layer model"
            )
