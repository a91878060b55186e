"""Qwen3 / Qwen3-MoE decoder-only transformer in plain PyTorch (no parallelism in here).

Same module layout as the Llama model (``tok_embeddings``, ``layers`` as a ModuleDict keyed
``"0".."N-1"``, ``norm``, ``output``), so the pipeline splitter, FSDP and activation
checkpointing helpers apply unchanged. Per block: ``attention`` (GQA with an explicit
``head_dim``, RMSNorm over ``head_dim`` on queries and keys before RoPE) and either
``feed_forward`` (dense SwiGLU) or ``moe`` (the shared :class:`~torchtitan.models.common.moe.MoE`
layer). RoPE uses HF's rotate-half pairing ``(i, i + head_dim/2)``, so HF weights load without
any permutation. Head counts at runtime come from the weight shapes (``-1`` in views), which
lets tensor parallelism shard heads from outside.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from torchtitan.models.common.decoder import keep_float32_buffers
from torchtitan.models.common.document_mask import attend, batch_attention_mask
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.rope import precompute_freqs_cis
from torchtitan.models.llama3.model import FeedForward
from torchtitan.models.qwen3.args import Qwen3ModelArgs


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


class Attention(nn.Module):
    """Grouped-query self-attention with QK-norm and RoPE; causal unless given a mask (from
    ``document_mask.build_attention_mask``)."""

    def __init__(self, args: Qwen3ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.effective_n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)

    def init_weights(self, init_std: float) -> None:
        """wq/wk/wv: trunc-normal std 0.02; wo: std ``init_std``; QK-norms to ones."""
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_mask: Any = None
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))
        xk = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb_half(xq, xk, freqs_cis)
        out = attend(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), attention_mask,
            n_rep=self.n_rep,
        )
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(out)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn_or_moe(norm(h))``."""

    def __init__(self, layer_id: int, args: Qwen3ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe: MoE | None = None
        self.feed_forward: FeedForward | None = None
        if args.is_moe_layer(layer_id):
            self.moe = MoE(args.moe_args, args.dim, args.moe_hidden_dim)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        if self.moe is not None:
            self.moe.init_weights(self.weight_init_std, buffer_device)
        else:
            self.feed_forward.init_weights(self.weight_init_std)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_mask: Any = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, attention_mask=attention_mask)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Qwen3Model(nn.Module):
    """Qwen3 transformer: ``forward(tokens [B, S]) -> logits [B, S, vocab_size]``.

    A pipeline splitter may delete entries of ``layers`` and set ``tok_embeddings``, ``norm``
    or ``output`` to ``None``; forward and init_weights skip what is missing.
    """

    def __init__(self, model_args: Qwen3ModelArgs):
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
        if model_args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)

    def _precompute_freqs_cis(self, device: torch.device | None = None) -> torch.Tensor:
        a = self.model_args
        return precompute_freqs_cis(a.head_dim, a.max_seq_len, a.rope_theta, device=device)

    def _param_device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return self.freqs_cis.device

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Recompute ``freqs_cis`` (and the MoE buffers) on ``buffer_device`` (default: the
        parameters' device) and initialise every present parameter like the Llama model
        (embedding std 1, or dim**-0.5 when tied; depth-scaled blocks; output dim**-0.5)."""
        device = torch.device(buffer_device) if buffer_device is not None else self._param_device()
        self.freqs_cis = self._precompute_freqs_cis(device=device)
        final_out_std = self.model_args.dim**-0.5
        cutoff = 3 * final_out_std
        tied = self.model_args.tie_word_embeddings
        if self.tok_embeddings is not None:
            if tied:
                nn.init.trunc_normal_(
                    self.tok_embeddings.weight, mean=0.0, std=final_out_std, a=-cutoff, b=cutoff
                )
            else:
                nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights(buffer_device=device)
        if self.norm is not None:
            self.norm.reset_parameters()
        shared = tied and self.tok_embeddings is not None and self.output is not None
        if self.output is not None and not shared:
            nn.init.trunc_normal_(
                self.output.weight, mean=0.0, std=final_out_std, a=-cutoff, b=cutoff
            )

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        # Keep weight tying and the complex RoPE table intact across to()/to_empty() (see the
        # Llama model): meta->device builds new Parameters per module, and a dtype cast would
        # drop the table's imaginary part.
        was_tied = (
            self.tok_embeddings is not None
            and self.output is not None
            and self.output.weight is self.tok_embeddings.weight
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Casting complex values to real")
            result = super()._apply(keep_float32_buffers(self, fn), recurse)
        if was_tied and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
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

