"""Qwen3 / Qwen3-MoE decoder-only transformer: the shared decoder (no parallelism in here).

Per block: ``attention`` (grouped-query with an explicit ``head_dim`` and RMSNorm over
``head_dim`` on queries and keys before RoPE) and either ``feed_forward`` (dense SwiGLU) or
``moe`` (the shared :class:`~torchtitan.models.common.moe.MoE` layer). RoPE uses HF's
rotate-half pairing ``(i, i + head_dim/2)``, so HF weights load without any permutation.
"""

from __future__ import annotations

from torchtitan.models.common.attention import GroupedQueryAttention
from torchtitan.models.common.decoder import Decoder, TransformerBlock
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.rope import apply_rotary_emb_half
from torchtitan.models.qwen3.args import Qwen3ModelArgs

__all__ = ["Attention", "Qwen3Model", "TransformerBlock", "apply_rotary_emb_half"]


class Attention(GroupedQueryAttention):
    """Qwen3's grouped-query attention: QK-norm and rotate-half RoPE."""

    rotary = staticmethod(apply_rotary_emb_half)

    def __init__(self, args: Qwen3ModelArgs):
        super().__init__(
            args.dim, args.n_heads, args.effective_n_kv_heads, args.head_dim,
            qk_norm_eps=args.norm_eps,
        )


class Qwen3Model(Decoder):
    """Qwen3 transformer: ``forward(tokens [B, S]) -> logits [B, S, vocab_size]``."""

    def build_block(self, layer_id: int, args: Qwen3ModelArgs) -> TransformerBlock:
        if args.is_moe_layer(layer_id):
            moe = MoE(args.moe_args, args.dim, args.moe_hidden_dim)
            return TransformerBlock(layer_id, args, Attention(args), moe=moe)
        ffn = FeedForward(args.dim, args.hidden_dim)
        return TransformerBlock(layer_id, args, Attention(args), feed_forward=ffn)
