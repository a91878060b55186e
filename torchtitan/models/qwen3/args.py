"""Qwen3 model arguments (dense and MoE), parameter counting and FLOPs per token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from torch import nn

from torchtitan.models.common.document_mask import validate_mask_settings
from torchtitan.models.common.moe import GroupedExperts, MoEArgs
from torchtitan.models.llama3.args import _tokenizer_vocab_size
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config.job_config import JobConfig


@dataclass
class Qwen3ModelArgs:
    """Shape and behaviour of a Qwen3 / Qwen3-MoE decoder-only transformer.

    Differences from Llama: an explicit ``head_dim`` (``n_heads * head_dim`` need not equal
    ``dim``), RMSNorm over ``head_dim`` on queries and keys before RoPE (QK-norm), RoPE in HF's
    rotate-half layout, and optionally mixture-of-experts feed-forwards (``moe_args``).
    """

    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int | None = 8
    """Key/value heads for grouped-query attention (None: n_heads)."""
    head_dim: int = 128
    vocab_size: int = 151936
    hidden_dim: int = 12288
    """Width of the dense SwiGLU feed-forward (HF ``intermediate_size``)."""
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960
    """Rows of the RoPE table; set from training.seq_len by update_from_config."""
    depth_init: bool = True
    """Output-projection init std 0.02/sqrt(2*(layer_id+1)) if True, else 0.02/sqrt(2*n_layers)."""
    tie_word_embeddings: bool = False
    use_tokenizer_vocab: bool = False
    """Take vocab_size from the tokenizer (debug flavors); real flavors keep theirs."""
    moe_args: MoEArgs | None = None
    """Routing and expert settings of the MoE layers (None: a dense model)."""
    moe_hidden_dim: int = 768
    """Width of each routed expert (HF ``moe_intermediate_size``); unused when dense."""
    decoder_sparse_step: int = 1
    """Layer ``i`` is MoE when ``(i + 1) % decoder_sparse_step == 0`` (HF semantics) ..."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """... and ``i`` is not listed here (those layers use the dense feed-forward)."""
    use_flex_attn: bool = False
    """FlexAttention kernel (compiled) on GPUs; on CPU, which has no FlexAttention backward,
    SDPA with the same mask (one info line). See models/common/document_mask.py."""
    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """``block_causal``: tokens attend only within their document of a packed sequence
    (documents split at the tokenizer's BOS/EOS); ``causal``: across the whole sequence."""
    sliding_window_size: int | None = None
    """Attend to at most this many positions back (including oneself); None: unlimited."""

    def __post_init__(self) -> None:
        # Records of the args (checkpoint markers, JSON) hold moe_args as a plain dict.
        if isinstance(self.moe_args, dict):
            self.moe_args = MoEArgs(**self.moe_args)
        self.mlp_only_layers = [int(i) for i in self.mlp_only_layers]

    @property
    def effective_n_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Width of the dense feed-forward (same name as the Llama args)."""
        return self.hidden_dim

    @property
    def rope_scaling(self) -> None:
        """Qwen3 uses plain RoPE (no frequency scaling)."""
        return None

    @property
    def is_moe(self) -> bool:
        return self.moe_args is not None

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` uses the MoE feed-forward (HF Qwen3-MoE's rule)."""
        return (
            self.moe_args is not None
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    def validate(self) -> None:
        """Raise ValueError (one line) naming the offending field if these args cannot build a
        model."""
        validate_mask_settings(self)
        for name in ("dim", "n_layers", "n_heads", "head_dim", "vocab_size", "hidden_dim",
                     "max_seq_len", "decoder_sparse_step"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {name}={getattr(self, name)} must be positive")
        if self.head_dim % 2:
            raise ValueError(f"model head_dim={self.head_dim} must be even for RoPE")
        if self.effective_n_kv_heads <= 0 or self.n_heads % self.effective_n_kv_heads:
            raise ValueError(
                f"model n_heads={self.n_heads} must be divisible by "
                f"n_kv_heads={self.effective_n_kv_heads}"
            )
        if self.moe_args is not None:
            self.moe_args.validate()
            if self.moe_hidden_dim <= 0:
                raise ValueError(f"model moe_hidden_dim={self.moe_hidden_dim} must be positive")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(
                f"model mlp_only_layers={bad} are not layers of a {self.n_layers}-layer model"
            )

    def update_from_config(self, job_config: JobConfig, tokenizer: Any | None = None) -> None:
        """``max_seq_len`` from ``training.seq_len``, ``force_load_balance`` from
        ``debug.moe_force_load_balance`` and, for debug flavors, the vocab size from the
        tokenizer. Mutates ``self``: copy the registry's flavor first."""
        self.max_seq_len = job_config.training.seq_len
        if self.moe_args is not None:  # dense flavors: build_run warns that it does nothing
            self.moe_args.force_load_balance = job_config.debug.moe_force_load_balance
        self.validate()
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
        """Parameter count (all experts) and training FLOPs per token
        ``6 * N_active + 12 * L * H * head_dim * T``.

        ``N_active`` counts what one token multiplies with: every parameter except the token
        embedding (a lookup; with tied embeddings the shared matrix does the output matmul, so
        it stays) and except the routed experts a token is not sent to (only ``top_k`` of
        ``num_experts`` run; the router and shared experts always do). Works on meta models
        and pipeline parts.
        """
        nparams = sum(p.numel() for p in model.parameters())
        emb = getattr(model, "tok_embeddings", None)
        out = getattr(model, "output", None)
        tied = emb is not None and out is not None and out.weight is emb.weight
        embedding_params = 0 if tied or emb is None else emb.weight.numel()
        inactive = 0
        if self.moe_args is not None:
            unused = self.moe_args.num_experts - self.moe_args.top_k
            for module in model.modules():
                if isinstance(module, GroupedExperts):
                    per_expert = sum(w.numel() for w in (module.w1, module.w2, module.w3))
                    inactive += per_expert // module.num_experts * unused
        n_active = nparams - embedding_params - inactive
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return nparams, float(6 * n_active + attention)
