"""Grouped-query self-attention with RoPE (masks and kernels: document_mask.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchtitan.models.common.document_mask import attend, repeat_kv
from torchtitan.models.common.rope import apply_rotary_emb

__all__ = ["GroupedQueryAttention", "repeat_kv"]


class GroupedQueryAttention(nn.Module):
    """Grouped-query self-attention with RoPE, optionally with QK-norm (RMSNorm over
    ``head_dim`` on queries and keys before RoPE), biases on the four projections (``bias``)
    and learned attention sinks (``sinks``: one logit per query head in the softmax
    denominator, ``attention_sinks.py``); causal unless given a mask (a boolean SDPA mask or a
    FlexAttention BlockMask from ``document_mask.build_attention_mask``).

    ``rotary`` is the family's RoPE pairing (default: interleaved pairs ``(2i, 2i+1)``). Head
    counts at run time come from the weight shapes (``-1`` in views), so tensor parallelism
    can shard ``wq/wk/wv`` column-wise and ``wo`` row-wise from outside; ``sinks`` is then
    sharded by head (a DTensor: its local part is used).
    """

    rotary = staticmethod(apply_rotary_emb)
    sdpa_backend: Any = None
    """The SDPA kernel (``torch.nn.attention.SDPBackend``) this run forces; None: PyTorch's
    choice (``tools/attention_kernels.set_attention_backend``)."""

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int,
        qk_norm_eps: float | None = None, bias: bool = False, sinks: bool = False,
    ):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.n_rep = n_heads // n_kv_heads
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.sinks = nn.Parameter(torch.empty(n_heads)) if sinks else None
        self.qk_norm = qk_norm_eps is not None
        if self.qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)

    def init_weights(self, init_std: float) -> None:
        """wq/wk/wv: trunc-normal std 0.02; wo: trunc-normal std ``init_std``; biases zeros;
        sinks trunc-normal std 0.02; QK-norms ones."""
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        if self.sinks is not None:
            nn.init.trunc_normal_(self.sinks, mean=0.0, std=0.02)
        if self.qk_norm:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_mask: Any = None
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.qk_norm:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = self.rotary(xq, xk, freqs_cis)
        out = attend(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), attention_mask,
            n_rep=self.n_rep, sinks=_local(self.sinks), backend=self.sdpa_backend,
        )
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(out)


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a (possibly tensor-parallel, head-sharded) parameter."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
