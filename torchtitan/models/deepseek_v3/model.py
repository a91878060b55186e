"""DeepSeek-V3 decoder: the shared decoder (no parallelism in here) with multi-head latent
attention (MLA) and YaRN RoPE, dense SwiGLU layers, then mixture-of-experts layers (the shared
``torchtitan.models.common.moe.MoE``: sigmoid routing with a load-balancing bias, group-limited
choice, shared experts). The RoPE table is ``[max_seq_len, qk_rope_head_dim // 2]``. Tensor parallelism
shards ``wq``/``wq_b``/``wkv_b`` column-wise and ``wo`` row-wise from outside; head counts at
run time come from the weight shapes.

RoPE pairs dimensions ``(2i, 2i+1)`` of the rope part (complex multiplication), as DeepSeek's
checkpoints and HF's ``rope_interleave=True`` do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.decoder import Decoder, TransformerBlock
from torchtitan.models.common.document_mask import attend
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.rope import apply_rotary_emb
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs

_LATENT_NORM_EPS = 1e-6
"""Epsilon of ``q_norm``/``kv_norm`` (HF builds them with its default, whatever rms_norm_eps)."""


class Attention(nn.Module):
    """Multi-head latent attention: queries from ``wq`` (or the LoRA ``wq_a -> q_norm ->
    wq_b``); keys/values from the latent ``wkv_a -> kv_norm -> wkv_b``; the rope part of the
    key (``qk_rope_head_dim``, taken from ``wkv_a``) is shared by all heads."""

    sdpa_backend: Any = None
    """The SDPA kernel this run forces; None: PyTorch's (``tools/attention_kernels.py``)."""

    def __init__(self, args: DeepSeekV3ModelArgs):
        super().__init__()
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_head_dim
        self.v_head_dim = args.v_head_dim
        self.softmax_scale = args.softmax_scale
        n_heads, dim = args.n_heads, args.dim
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(dim, n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(dim, self.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(self.q_lora_rank, eps=_LATENT_NORM_EPS)
            self.wq_b = nn.Linear(self.q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_lora_rank, eps=_LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(
            self.kv_lora_rank, n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.wo = nn.Linear(n_heads * self.v_head_dim, dim, bias=False)
        self.k_pe_shared = nn.Identity()
        """Marks the rope key that every head uses: tensor parallel sums its gradient over the
        ranks (each holds some of the heads); an identity otherwise."""

    def init_weights(self, init_std: float) -> None:
        """Projections trunc-normal std 0.02, ``wo`` std ``init_std``; norms ones."""
        linears = [self.wkv_a, self.wkv_b]
        if self.q_lora_rank == 0:
            linears.append(self.wq)
        else:
            linears += [self.wq_a, self.wq_b]
            self.q_norm.reset_parameters()
        for linear in linears:
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        self.kv_norm.reset_parameters()
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_mask: Any = None
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bs, seqlen, -1, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = apply_rotary_emb(q_pe, self.k_pe_shared(k_pe).unsqueeze(2), freqs_cis)
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(bs, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        out = _attend(q, k, v, self.softmax_scale, attention_mask, self.sdpa_backend)
        return self.wo(out.reshape(bs, seqlen, -1))


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: Any = None,
    backend: Any = None,
) -> torch.Tensor:
    """Attention (causal, or with a mask from ``document_mask``) on ``[B, S, H, D]`` tensors
    whose value head dim may differ from the query's: the narrower side is zero-padded (exact:
    zeros add nothing to q.k or to the output) so the flash kernels, and context parallel's
    ring attention over them, apply; ``[B, S, H, Dv]``."""
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if v_dim < qk_dim:
        v = F.pad(v, (0, qk_dim - v_dim))
    elif qk_dim < v_dim:
        q, k = F.pad(q, (0, v_dim - qk_dim)), F.pad(k, (0, v_dim - qk_dim))
    out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale=scale,
                 backend=backend)
    return out.transpose(1, 2)[..., :v_dim]


class DeepSeekV3Model(Decoder):
    """``forward(tokens [B, S]) -> logits [B, S, vocab_size]``; the first ``n_dense_layers``
    blocks have a dense SwiGLU ``feed_forward``, the others an ``moe``."""

    def build_block(self, layer_id: int, args: DeepSeekV3ModelArgs) -> TransformerBlock:
        if layer_id >= args.n_dense_layers:
            moe = MoE(args.moe_args, args.dim, args.moe_inter_dim)
            return TransformerBlock(layer_id, args, Attention(args), moe=moe)
        ffn = FeedForward(args.dim, args.inter_dim)
        return TransformerBlock(layer_id, args, Attention(args), feed_forward=ffn)
