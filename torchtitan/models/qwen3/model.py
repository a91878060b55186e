"""Qwen3 / Qwen3-MoE decoder-only transformer: the shared decoder (no parallelism in here).

Per block: ``attention`` (grouped-query with an explicit ``head_dim`` and RMSNorm over
``head_dim`` on queries and keys before RoPE) and either ``feed_forward`` (dense SwiGLU) or
``moe`` (the shared :class:`~torchtitan.models.common.moe.MoE` layer). RoPE uses HF's
rotate-half pairing ``(i, i + head_dim/2)``, so HF weights load without any permutation.
"""

from __future__ import annotations

import torch

from torchtitan.models.common.attention import GroupedQueryAttention
from torchtitan.models.common.decoder import Decoder, TransformerBlock
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.moe import MoE
from torchtitan.models.qwen3.args import Qwen3ModelArgs

__all__ = ["Attention", "Qwen3Model", "TransformerBlock", "apply_rotary_emb_half"]


def apply_rotary_emb_half(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in HF's rotate-half layout on ``[B, S, H, head_dim]`` tensors: ``x * cos +
    rotate_half(x) * sin`` with the angles of the first ``S`` rows of the complex table
    ``freqs_cis`` ``[>=S, head_dim/2]``. Computed in float32, cast back to the inputs' dtypes."""
    seqlen = xq.shape[1]
    if freqs_cis.shape[0] < seqlen:
        raise ValueError(
            f"sequence length {seqlen} exceeds the RoPE table ({freqs_cis.shape[0]} positions); "
            "raise the model's max_seq_len (it is set from training.seq_len)"
        )
    freqs = freqs_cis[:seqlen]
    cos = torch.cat([freqs.real, freqs.real], dim=-1).view(1, seqlen, 1, -1)
    sin = torch.cat([freqs.imag, freqs.imag], dim=-1).view(1, seqlen, 1, -1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).type_as(x)

    return rotate(xq), rotate(xk)


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
