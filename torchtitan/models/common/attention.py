"""Attention helpers: grouped-query key/value expansion (masks and kernels:
document_mask.py)."""

from __future__ import annotations

import torch


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
