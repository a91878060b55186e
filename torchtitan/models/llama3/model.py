"""Llama decoder-only transformer: the shared decoder with grouped-query attention (RoPE on
interleaved pairs) and a dense SwiGLU feed-forward in every block (no parallelism in here)."""

from __future__ import annotations

from torchtitan.models.common.attention import GroupedQueryAttention
from torchtitan.models.common.decoder import Decoder, TransformerBlock
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.llama3.args import TransformerModelArgs

__all__ = ["Attention", "FeedForward", "Transformer", "TransformerBlock"]


class Attention(GroupedQueryAttention):
    """Llama's grouped-query attention (head_dim = dim / n_heads)."""

    def __init__(self, model_args: TransformerModelArgs):
        super().__init__(
            model_args.dim, model_args.n_heads, model_args.effective_n_kv_heads,
            model_args.head_dim,
        )


class Transformer(Decoder):
    """Llama transformer: ``forward(tokens [B, S]) -> logits [B, S, vocab_size]``."""

    def build_block(self, layer_id: int, args: TransformerModelArgs) -> TransformerBlock:
        return TransformerBlock(
            layer_id, args, Attention(args),
            feed_forward=FeedForward(args.dim, args.ffn_hidden_dim),
        )
