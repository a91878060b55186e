"""Llama decoder-only transformer in plain PyTorch (no parallelism in here).

Tensor parallelism shards ``wq/wk/wv`` column-wise and ``wo`` row-wise from outside; the head
counts used at runtime therefore come from the weight shapes (``-1`` in views). A pipeline
splitter may delete entries of ``layers`` and set ``tok_embeddings``, ``norm`` or ``output``
to ``None``; forward and init_weights skip what is missing.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.document_mask import attend, batch_attention_mask
from torchtitan.models.common.rope import apply_rotary_emb, precompute_freqs_cis
from torchtitan.models.llama3.args import TransformerModelArgs


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE; causal unless given a mask (a boolean SDPA mask
    or a FlexAttention BlockMask from ``document_mask.build_attention_mask``)."""

    def __init__(self, model_args: TransformerModelArgs):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.n_kv_heads = model_args.effective_n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = model_args.head_dim
        self.wq = nn.Linear(model_args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, model_args.dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        """wq/wk/wv: trunc-normal std 0.02; wo: trunc-normal std ``init_std``."""
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_mask: Any = None
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        out = attend(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), attention_mask,
            n_rep=self.n_rep,
        )
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        """w1: trunc-normal std 0.02; w2/w3: trunc-normal std ``init_std``."""
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, layer_id: int, model_args: TransformerModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.num_layers = model_args.n_layers
        self.attention_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.attention = Attention(model_args)
        self.ffn_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.feed_forward = FeedForward(model_args.dim, model_args.ffn_hidden_dim)
        depth = layer_id + 1 if model_args.depth_init else model_args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self, init_std: float | None = None) -> None:
        """Norms to ones; projections as in Attention/FeedForward (default: depth-scaled std)."""
        std = self.weight_init_std if init_std is None else init_std
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(std)
        self.feed_forward.init_weights(std)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_mask: Any = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, attention_mask=attention_mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama transformer: ``forward(tokens [B, S]) -> logits [B, S, vocab_size]``."""

    def __init__(self, model_args: TransformerModelArgs):
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
        args = self.model_args
        return precompute_freqs_cis(
            args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling, device=device
        )

    def _param_device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return self.freqs_cis.device

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Recompute ``freqs_cis`` on ``buffer_device`` (default: the parameters' device) and
        initialise every present parameter (embedding std 1, or dim**-0.5 when tied; depth-scaled
        blocks; output trunc-normal std dim**-0.5 cut at 3 std)."""
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
                layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        shared = tied and self.tok_embeddings is not None and self.output is not None
        if self.output is not None and not shared:
            nn.init.trunc_normal_(
                self.output.weight, mean=0.0, std=final_out_std, a=-cutoff, b=cutoff
            )

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        # Keep weight tying and the complex RoPE table intact across to()/to_empty():
        # meta->device conversion builds new Parameters per module (breaking the tie), and a
        # dtype cast such as .to(torch.bfloat16) would drop the table's imaginary part.
        was_tied = (
            self.tok_embeddings is not None
            and self.output is not None
            and self.output.weight is self.tok_embeddings.weight
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Casting complex values to real")
            result = super()._apply(fn, recurse)
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
        ``attn_mask_type="block_causal"`` (and give the sequence length to pipeline stages
        without the embedding); the mask is built once here for every layer."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        mask = batch_attention_mask(self.model_args, tokens, document_ids, h.device)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, attention_mask=mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
