"""Llama model arguments, parameter counting and FLOPs per token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from torch import nn

from torchtitan.models.common.document_mask import validate_mask_settings
from torchtitan.models.common.rope import RoPEScalingArgs
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config.job_config import JobConfig


def _tokenizer_vocab_size(tokenizer: Any) -> int:
    """Vocabulary size of a tokenizer (``vocab_size``, ``get_vocab_size()`` or ``n_words``)."""
    for attr in ("vocab_size", "get_vocab_size", "n_words"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value() if callable(value) else value)
    raise TypeError(f"cannot read the vocabulary size of tokenizer {type(tokenizer).__name__}")


@dataclass
class TransformerModelArgs:
    """Shape and behaviour of a Llama (2/3/3.1/3.2) decoder-only transformer."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (None: n_heads, i.e. multi-head attention)."""
    vocab_size: int = 128256
    multiple_of: int = 256
    """The SwiGLU hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RoPEScalingArgs | None = None
    """Llama 3.1 RoPE frequency scaling (None: no scaling)."""
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

    @property
    def effective_n_kv_heads(self) -> int:
        """Number of key/value heads (``n_kv_heads`` or ``n_heads``)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """Per-head dimension ``dim // n_heads``."""
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size: 2/3 of 4*dim, times ffn_dim_multiplier, rounded up to multiple_of."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def validate(self) -> None:
        """Raise ValueError naming the offending field if these args cannot build a model."""
        validate_mask_settings(self)
        if self.dim % self.n_heads != 0:
            raise ValueError(f"model dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"model head_dim={self.head_dim} (dim / n_heads) must be even for RoPE"
            )
        if self.n_heads % self.effective_n_kv_heads != 0:
            raise ValueError(
                f"model n_heads={self.n_heads} must be divisible by "
                f"n_kv_heads={self.effective_n_kv_heads}"
            )
        for name in ("n_layers", "vocab_size", "max_seq_len", "multiple_of"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {name}={getattr(self, name)} must be positive")

    def update_from_config(self, job_config: JobConfig, tokenizer: Any | None = None) -> None:
        """Set ``max_seq_len`` from ``training.seq_len`` and, for debug flavors, the vocab size.

        Mutates ``self``: copy the registry's flavor first (``ModelSpec.get_model_args``).
        """
        self.max_seq_len = job_config.training.seq_len
        if tokenizer is None:
            return
        tok_vocab = _tokenizer_vocab_size(tokenizer)
        if self.use_tokenizer_vocab:
            self.vocab_size = tok_vocab
        elif tok_vocab > self.vocab_size:
            logger.warning(
                f"tokenizer vocab size {tok_vocab} is larger than the model's vocab_size "
                f"{self.vocab_size}: token ids >= {self.vocab_size} will fail in the embedding; "
                "check model.hf_assets_path / model.tokenizer_path against model.flavor"
            )

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, float]:
        """Parameter count and training FLOPs per token ``6*N + 12*L*H*Q*T``.

        ``N`` is the parameter count without the token embedding (a lookup, not a matmul);
        with tied embeddings the shared matrix does the output matmul, so it stays in ``N``.
        Works on meta-device models.
        """
        nparams = sum(p.numel() for p in model.parameters())
        tied = _is_tied(model)
        embedding_params = 0
        if not tied:
            seen: set[int] = set()
            for module in model.modules():
                if isinstance(module, nn.Embedding) and id(module.weight) not in seen:
                    seen.add(id(module.weight))
                    embedding_params += module.weight.numel()
        n_l, n_h, q, t = self.n_layers, self.n_heads, self.head_dim, seq_len
        flops_per_token = 6 * (nparams - embedding_params) + 12 * n_l * n_h * q * t
        return nparams, float(flops_per_token)


def _is_tied(model: nn.Module) -> bool:
    emb = getattr(model, "tok_embeddings", None)
    out = getattr(model, "output", None)
    return emb is not None and out is not None and out.weight is emb.weight
