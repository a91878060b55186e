"""The decoder every family builds on (plain PyTorch, no parallelism).

:class:`Decoder` holds what all families share: token embeddings, ``layers`` (an
``nn.ModuleDict`` keyed ``"0".."N-1"``, so FQNs stay stable when a pipeline stage drops
layers), the final norm, the output projection, the complex RoPE table ``freqs_cis``, weight
tying, initialisation and the dtype rules. :class:`DecoderArgs` holds the shared fields, the
config update and the parameter/FLOPs count. A family declares the rest: its args (fields,
``validate``, the RoPE width and scaling, the attention widths), its block (``build_block``:
attention plus a dense :class:`FeedForward` or an ``MoE``) and its flavors.

A pipeline splitter may delete entries of ``layers`` and set ``tok_embeddings``, ``norm`` or
``output`` to ``None``; ``forward`` and ``init_weights`` skip what is missing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from torchtitan.components.chunked_loss import DEFAULT_CHUNK_SIZE, linear_cross_entropy_sum
from torchtitan.models.common.document_mask import (
    SequenceShard,
    batch_attention_mask,
    validate_mask_settings,
)
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.rope import RoPEScalingArgs, YaRNScalingArgs, precompute_freqs_cis
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config.job_config import JobConfig


def tokenizer_vocab_size(tokenizer: Any) -> int:
    """Vocabulary size of a tokenizer (``vocab_size``, ``get_vocab_size()`` or ``n_words``)."""
    for attr in ("vocab_size", "get_vocab_size", "n_words"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value() if callable(value) else value)
    raise TypeError(f"cannot read the vocabulary size of tokenizer {type(tokenizer).__name__}")


@dataclass
class DecoderArgs:
    """Fields every decoder family has (a family redeclares a field to change its default)."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    vocab_size: int = 128256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    """Rows of the RoPE table; set from training.seq_len by update_from_config."""
    depth_init: bool = True
    """Output-projection init std 0.02/sqrt(2*(layer_id+1)) if True, else 0.02/sqrt(2*n_layers)."""
    tie_word_embeddings: bool = False
    """The output projection shares its weight with the token embedding."""
    use_tokenizer_vocab: bool = False
    """Take vocab_size from the tokenizer (debug flavors); real flavors keep theirs."""
    use_flex_attn: bool = False
    """FlexAttention kernel (compiled) on GPUs; on CPU, which has no FlexAttention backward,
    SDPA with the same mask (one info line). See models/common/document_mask.py."""
    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """``block_causal``: tokens attend only within their document of a packed sequence
    (documents split at the tokenizer's BOS/EOS); ``causal``: across the whole sequence."""
    sliding_window_size: int | None = None
    """Attend to at most this many positions back (including oneself); None: unlimited."""

    # --- what a family may override ----------------------------------------------------------
    @property
    def effective_n_kv_heads(self) -> int:
        """Key/value heads: ``n_kv_heads`` where the family has grouped-query attention and
        sets it, else ``n_heads``."""
        n_kv_heads = getattr(self, "n_kv_heads", None)
        return self.n_heads if n_kv_heads is None else n_kv_heads

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of a query/key head (the RoPE table has half as many
        columns)."""
        return self.head_dim

    @property
    def rope_scaling(self) -> RoPEScalingArgs | YaRNScalingArgs | None:
        """Frequency scaling of the RoPE table (None: plain RoPE)."""
        return None

    def attention_window(self, layer_id: int) -> int | None:
        """Sliding window of block ``layer_id`` (None: unlimited): ``sliding_window_size`` in
        every block unless the family alternates windowed and full layers."""
        return self.sliding_window_size

    @property
    def attention_head_dims(self) -> tuple[int, int]:
        """(query/key, value) width of one attention head, for the attention FLOPs."""
        return self.head_dim, self.head_dim

    def validate(self) -> None:
        """Raise ValueError (one line) naming the offending field; families extend it."""
        validate_mask_settings(self)

    def require_positive(self, *names: str) -> None:
        """ValueError ``model NAME=V must be positive`` for the first of ``names`` that is not."""
        for name in names:
            if getattr(self, name) <= 0:
                raise ValueError(f"model {name}={getattr(self, name)} must be positive")

    # --- shared -------------------------------------------------------------------------------
    def update_from_config(self, job_config: JobConfig, tokenizer: Any | None = None) -> None:
        """``max_seq_len`` from ``training.seq_len``, ``moe_args.force_load_balance`` from
        ``debug.moe_force_load_balance`` (families with MoE layers) and, for debug flavors, the
        tokenizer's vocab size; then validate.

        Mutates ``self``: copy the registry's flavor first (``ModelSpec.get_model_args``).
        """
        self.max_seq_len = job_config.training.seq_len
        moe_args = getattr(self, "moe_args", None)
        if moe_args is not None:  # dense flavors: build_run warns that it does nothing
            moe_args.force_load_balance = job_config.debug.moe_force_load_balance
        self.validate()
        if tokenizer is None:
            return
        tok_vocab = tokenizer_vocab_size(tokenizer)
        if self.use_tokenizer_vocab:
            self.vocab_size = tok_vocab
        elif tok_vocab > self.vocab_size:
            logger.warning(
                f"tokenizer vocab size {tok_vocab} is larger than the model's vocab_size "
                f"{self.vocab_size}: token ids >= {self.vocab_size} will fail in the embedding; "
                "check model.hf_assets_path / model.tokenizer_path against model.flavor"
            )

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, float]:
        """Parameter count (every expert included) and training FLOPs per token
        ``6 * N_active + 6 * L * H * T * (qk_dim + v_dim)``.

        ``N_active`` counts what one token multiplies with: every parameter except the token
        embedding (a lookup; with tied embeddings the shared matrix does the output matmul, so
        it stays) and except the routed experts a token is not sent to (``top_k`` of
        ``num_experts`` run; the router and shared experts always do). The attention term is
        QK^T plus AV over the full length ``T``, forward and backward (``attention_head_dims``).
        Works on meta-device models and pipeline parts.
        """
        nparams = sum(p.numel() for p in model.parameters())
        output = getattr(model, "output", None)
        tied_weight = output.weight if output is not None else None
        embeddings = {
            id(m.weight): m.weight.numel()
            for m in model.modules()
            if isinstance(m, nn.Embedding) and m.weight is not tied_weight
        }
        inactive = 0
        for m in model.modules():
            if isinstance(m, MoE):
                routed = sum(p.numel() for p in m.experts.parameters())
                inactive += routed * (m.args.num_experts - m.args.top_k) // m.args.num_experts
        n_active = nparams - sum(embeddings.values()) - inactive
        qk_dim, v_dim = self.attention_head_dims
        attention = 6 * self.n_layers * self.n_heads * seq_len * (qk_dim + v_dim)
        return nparams, float(6 * n_active + attention)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(norm(x)); out = h + ffn(norm(h))``, the FFN being
    ``feed_forward`` (dense) or ``moe`` (only the one given is an attribute).

    ``attention`` is the family's: ``init_weights(std)`` and ``forward(x, freqs_cis,
    attention_mask=None)``.
    """

    def __init__(
        self,
        layer_id: int,
        args: DecoderArgs,
        attention: nn.Module,
        *,
        feed_forward: FeedForward | None = None,
        moe: MoE | None = None,
    ):
        super().__init__()
        if (feed_forward is None) == (moe is None):
            raise ValueError("a block has either a feed_forward or a moe layer")
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = attention
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if moe is not None:
            self.moe = moe
        else:
            self.feed_forward = feed_forward
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    @property
    def moe_enabled(self) -> bool:
        return "moe" in self._modules

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Norms to ones; attention and FFN with the depth-scaled std (MoE buffers zeroed on
        ``buffer_device``)."""
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


def keep_float32_buffers(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``fn`` (as given to ``Module._apply``) except that the buffers a submodule names in its
    ``float32_buffers`` stay float32 through a dtype cast, with their float32 values (a cast
    down and back would round them): e.g. MoE token counts, inexact in bf16 above 256."""
    kept = {
        id(buf)
        for module in model.modules()
        for name in getattr(module, "float32_buffers", ())
        if (buf := getattr(module, name, None)) is not None
    }

    def apply(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        if id(t) in kept and out.is_floating_point() and out.dtype != torch.float32:
            source = t if t.dtype == torch.float32 else out
            out = source.to(device=out.device, dtype=torch.float32)
        return out

    return apply


class OutputHead(nn.Linear):
    """The output projection. ``head(h)`` gives logits; ``head(h, labels)`` gives the summed
    token cross-entropy, fused with the projection a chunk of tokens at a time (the
    ``[tokens, vocab]`` logits never exist: ``components/chunked_loss.py``).

    ``fuse_loss`` (set by the trainer) says the trainer calls the model with ``labels``, so
    that parallelisms shard this layer for the fused loss; ``loss_chunk_size`` and
    ``loss_compile_backend`` (None: eager) tune it."""

    fuse_loss: bool = False
    loss_chunk_size: int = DEFAULT_CHUNK_SIZE
    loss_compile_backend: str | None = None

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        if self.bias is not None:
            raise ValueError("the fused output loss supports an output projection without bias")
        return linear_cross_entropy_sum(
            h, self.weight, labels, self.loss_chunk_size, self.loss_compile_backend
        )


class Decoder(nn.Module):
    """Decoder-only transformer: ``forward(tokens [B, S]) -> logits [B, S, vocab_size]``
    (with ``labels``: the summed token loss, :class:`OutputHead`).

    A family subclasses it and declares ``build_block(layer_id, args)``.
    """

    def __init__(self, model_args: DecoderArgs):
        super().__init__()
        model_args.validate()
        self.model_args = model_args
        self.vocab_size = model_args.vocab_size
        self.n_layers = model_args.n_layers
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(
            model_args.vocab_size, model_args.dim
        )
        self.layers = nn.ModuleDict(
            {str(i): self.build_block(i, model_args) for i in range(model_args.n_layers)}
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output: nn.Linear | None = OutputHead(model_args.dim, model_args.vocab_size, bias=False)
        if model_args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.sequence_shard: SequenceShard | None = None
        """This rank's part of every sequence while context parallel splits it (masked
        attention): set by the context-parallel step context, None otherwise."""

    def build_block(self, layer_id: int, args: Any) -> nn.Module:
        """Block ``layer_id`` (the family's attention and FFN in a :class:`TransformerBlock`)."""
        raise NotImplementedError(f"{type(self).__name__} must declare build_block")

    def _precompute_freqs_cis(self, device: torch.device | None = None) -> torch.Tensor:
        a = self.model_args
        return precompute_freqs_cis(a.rope_dim, a.max_seq_len, a.rope_theta, a.rope_scaling,
                                    device=device)

    def _param_device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return self.freqs_cis.device

    def _is_tied(self) -> bool:
        return (
            self.tok_embeddings is not None
            and self.output is not None
            and self.output.weight is self.tok_embeddings.weight
        )

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Recompute ``freqs_cis`` (and zero the MoE buffers) on ``buffer_device`` (default:
        the parameters' device) and initialise every present parameter: embedding normal std 1
        (trunc-normal std dim**-0.5 cut at 3 std when tied), depth-scaled blocks, norms ones,
        output trunc-normal std dim**-0.5 cut at 3 std."""
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
        # Keep weight tying, the complex RoPE table and float32 MoE buffers across
        # to()/to_empty(): meta->device conversion builds new Parameters per module (breaking
        # the tie), a dtype cast would drop the table's imaginary part, and bf16 would round the
        # routing bias and token counts (kept float32, as HF keeps e_score_correction_bias).
        was_tied = self._is_tied()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Casting complex values to real")
            result = super()._apply(keep_float32_buffers(self, fn), recurse)
        if was_tied and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        if not self.freqs_cis.is_complex():
            self.freqs_cis = self._precompute_freqs_cis(device=self.freqs_cis.device)
        return result

    def forward(
        self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids ``[B, S]`` (or hidden states ``[B, S, D]`` when ``tok_embeddings`` is None)
        to logits ``[B, S, V]`` (or hidden states when ``output`` is None); with ``labels``
        ``[B, S]``, the summed token cross-entropy (float32, ``IGNORE_INDEX`` labels left out)
        computed without materialising the logits.

        ``document_ids`` (``[B, S]``, from ``document_mask.document_ids``) are required by
        ``attn_mask_type="block_causal"`` (and give the sequence length to pipeline stages
        without the embedding); the mask is built once here for all layers with the same
        window (``DecoderArgs.attention_window``)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        masks: dict[int | None, Any] = {}
        for key, layer in self.layers.items():
            window = self.model_args.attention_window(int(key))
            if window not in masks:
                masks[window] = batch_attention_mask(
                    self.model_args, tokens, document_ids, h.device, sliding_window=window,
                    shard=self.sequence_shard,
                )
            h = layer(h, self.freqs_cis, attention_mask=masks[window])
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        return self.output(h) if labels is None else self.output(h, labels)
