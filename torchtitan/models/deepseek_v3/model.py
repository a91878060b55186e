"""DeepSeek-V3 decoder in plain PyTorch (no parallelism in here): multi-head latent attention
(MLA) with YaRN RoPE, dense SwiGLU layers, then mixture-of-experts layers (the shared
``torchtitan.models.common.moe.MoE``: sigmoid routing with a load-balancing bias, group-limited
choice, shared experts).

Module layout as the Llama model (``tok_embeddings / layers (ModuleDict "0".."N-1") / norm /
output``, a complex ``freqs_cis`` buffer ``[max_seq_len, qk_rope_head_dim // 2]``), so FSDP,
pipeline splitting, context parallel and checkpointing treat both alike. Tensor parallelism
shards ``wq``/``wq_b``/``wkv_b`` column-wise and ``wo`` row-wise from outside; head counts at
run time come from the weight shapes.

RoPE pairs dimensions ``(2i, 2i+1)`` of the rope part (complex multiplication), as DeepSeek's
checkpoints and HF's ``rope_interleave=True`` do.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.decoder import keep_float32_buffers
from torchtitan.models.common.document_mask import attend, batch_attention_mask
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.rope import apply_rotary_emb, precompute_freqs_cis
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan.models.llama3.model import FeedForward

_LATENT_NORM_EPS = 1e-6
"""Epsilon of ``q_norm``/``kv_norm`` (HF builds them with its default, whatever rms_norm_eps)."""


class Attention(nn.Module):
    """Multi-head latent attention: queries from ``wq`` (or the LoRA ``wq_a -> q_norm ->
    wq_b``); keys/values from the latent ``wkv_a -> kv_norm -> wkv_b``; the rope part of the
    key (``qk_rope_head_dim``, taken from ``wkv_a``) is shared by all heads."""

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
        out = _attend(q, k, v, self.softmax_scale, attention_mask)
        return self.wo(out.reshape(bs, seqlen, -1))


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: Any = None
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
    out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale=scale)
    return out.transpose(1, 2)[..., :v_dim]


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(norm(x)); out = h + ffn(norm(h))`` where the FFN is
    ``feed_forward`` (dense layers) or ``moe``."""

    def __init__(self, layer_id: int, args: DeepSeekV3ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(args.moe_args, args.dim, args.moe_inter_dim)
        else:
            self.feed_forward = FeedForward(args.dim, args.inter_dim)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        if self.moe_enabled:
            self.moe.init_weights(self.weight_init_std, buffer_device)
        else:
            self.feed_forward.init_weights(self.weight_init_std)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_mask: Any = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, attention_mask=attention_mask)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class DeepSeekV3Model(nn.Module):
    """``forward(tokens [B, S]) -> logits [B, S, vocab_size]``."""

    def __init__(self, model_args: DeepSeekV3ModelArgs):
        super().__init__()
        model_args.validate()
        self.model_args = model_args
        self.vocab_size = model_args.vocab_size
        self.n_layers = model_args.n_layers
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(
            model_args.vocab_size, model_args.dim
        )
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, model_args) for i in range(model_args.n_layers)}
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)

    def _precompute_freqs_cis(self, device: torch.device | None = None) -> torch.Tensor:
        a = self.model_args
        return precompute_freqs_cis(
            a.qk_rope_head_dim, a.max_seq_len, a.rope_theta, a.yarn, device=device
        )

    def _param_device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return self.freqs_cis.device

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Recompute ``freqs_cis`` (and zero the MoE buffers) on ``buffer_device`` (default:
        the parameters' device); initialise every present parameter: embedding normal std 1,
        blocks depth-scaled, output trunc-normal std ``dim**-0.5`` cut at 3 std."""
        device = torch.device(buffer_device) if buffer_device is not None else self._param_device()
        self.freqs_cis = self._precompute_freqs_cis(device=device)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights(buffer_device=device)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.model_args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        # A dtype cast such as .to(torch.bfloat16) would drop the RoPE table's imaginary part,
        # and round the MoE routing bias and token counts (kept in float32, as HF keeps
        # e_score_correction_bias).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Casting complex values to real")
            result = super()._apply(keep_float32_buffers(self, fn), recurse)
        if not self.freqs_cis.is_complex():
            self.freqs_cis = self._precompute_freqs_cis(device=self.freqs_cis.device)
        return result

    def forward(
        self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Token ids ``[B, S]`` (or hidden states ``[B, S, D]`` when ``tok_embeddings`` is None)
        to logits ``[B, S, V]`` (or hidden states when ``output`` is None).

        ``document_ids`` (``[B, S]``, from ``document_mask.document_ids``) are required by
        ``attn_mask_type="block_causal"``; the mask is built once here for every layer."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        mask = batch_attention_mask(self.model_args, tokens, document_ids, h.device)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, attention_mask=mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
