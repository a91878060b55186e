"""Attention helpers: grouped-query key/value expansion and causal SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Repeat each key/value head ``n_rep`` times: ``[B, S, Hkv, D] -> [B, S, Hkv * n_rep, D]``."""
    if n_rep == 1:
        return x
    bs, seqlen, n_kv_heads, head_dim = x.shape
    return (
        x[:, :, :, None, :]
        .expand(bs, seqlen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, seqlen, n_kv_heads * n_rep, head_dim)
    )


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal scaled-dot-product attention on ``[B, H, S, D]`` tensors (same head count)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
