"""gpt-oss decoder: the shared decoder (no parallelism in here).

Per block: grouped-query ``attention`` with biases, learned per-head sinks and rotate-half
RoPE (HF's pairing, so HF weights load without permutation), windowed or full by layer
(``GptOssModelArgs.attention_window``), and ``moe`` (the shared MoE layer with a biased router
and biased clamped-SwiGLU experts).
"""

from __future__ import annotations

from torchtitan.models.common.attention import GroupedQueryAttention
from torchtitan.models.common.decoder import Decoder, TransformerBlock
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.rope import apply_rotary_emb_half
from torchtitan.models.gpt_oss.args import GptOssModelArgs

__all__ = ["Attention", "GptOssModel"]


class Attention(GroupedQueryAttention):
    """gpt-oss attention: biases, sinks, rotate-half RoPE."""

    rotary = staticmethod(apply_rotary_emb_half)

    def __init__(self, args: GptOssModelArgs):
        super().__init__(args.dim, args.n_heads, args.n_kv_heads, args.head_dim,
                         bias=args.attention_bias, sinks=args.attention_sinks)


class GptOssModel(Decoder):
    """``forward(tokens [B, S]) -> logits [B, S, vocab_size]``; every block is MoE."""

    def build_block(self, layer_id: int, args: GptOssModelArgs) -> TransformerBlock:
        moe = MoE(args.moe_args, args.dim, args.moe_hidden_dim)
        return TransformerBlock(layer_id, args, Attention(args), moe=moe)
