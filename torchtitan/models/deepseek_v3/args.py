"""DeepSeek-V3 model arguments, parameter counting and FLOPs per token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from torch import nn

from torchtitan.models.common.document_mask import validate_mask_settings
from torchtitan.models.common.moe import MoE, MoEArgs
from torchtitan.models.common.rope import YaRNScalingArgs, yarn_get_mscale
from torchtitan.models.llama3.args import _tokenizer_vocab_size
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.config.job_config import JobConfig


@dataclass
class DeepSeekV3ModelArgs:
    """Shape and behaviour of a DeepSeek-V2/V3 decoder: multi-head latent attention (MLA),
    ``n_dense_layers`` dense SwiGLU layers, then mixture-of-experts layers.

    Field names follow upstream torchtitan (and DeepSeek's reference ``ModelArgs``).
    """

    vocab_size: int = 102400
    dim: int = 2048
    inter_dim: int = 10944
    """Hidden size of the dense SwiGLU layers."""
    moe_inter_dim: int = 1408
    """Hidden size of each routed expert (and of each shared expert)."""
    n_layers: int = 27
    n_dense_layers: int = 1
    """The first ``n_dense_layers`` layers are dense (HF ``first_k_dense_replace``)."""
    n_heads: int = 16
    norm_eps: float = 1e-6
    """Epsilon of the block and final RMSNorms (the MLA-internal norms use 1e-6, as HF)."""
    moe_args: MoEArgs = field(default_factory=MoEArgs)

    # Multi-head latent attention
    q_lora_rank: int = 0
    """0: queries from one projection ``wq``; else ``wq_a -> q_norm -> wq_b`` of this rank."""
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    # RoPE and YaRN
    max_seq_len: int = 4096
    """Rows of the RoPE table; set from training.seq_len by update_from_config."""
    rope_theta: float = 10000.0
    rope_factor: float = 1.0
    """YaRN scaling factor; YaRN is on when > 1 (as in HF, whatever the sequence length)."""
    original_seq_len: int = 4096
    """YaRN ``original_max_position_embeddings``."""
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    """Softmax scale ``*= (0.1 * mscale * ln(rope_factor) + 1) ** 2`` (HF ``mscale_all_dim``)."""
    rope_attention_factor: float = 1.0
    """Multiplies the rotation (HF YaRN ``attention_factor``; 1 when HF ``mscale`` equals
    ``mscale_all_dim``, as in every published DeepSeek config)."""

    depth_init: bool = True
    """Output-projection init std 0.02/sqrt(2*(layer_id+1)) if True, else 0.02/sqrt(2*n_layers)."""
    tie_word_embeddings: bool = False
    """Must stay False (no DeepSeek model ties them)."""
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

    def __post_init__(self) -> None:
        if isinstance(self.moe_args, dict):  # args recorded in a checkpoint marker as JSON
            self.moe_args = MoEArgs(**self.moe_args)

    # --- derived shapes (names shared with the Llama args where callers read them) ------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def effective_n_kv_heads(self) -> int:
        """MLA expands keys and values for every head (tensor parallel splits heads)."""
        return self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return self.inter_dim

    @property
    def yarn(self) -> YaRNScalingArgs | None:
        """The YaRN scaling of the RoPE table, or None when ``rope_factor <= 1``."""
        if self.rope_factor <= 1:
            return None
        return YaRNScalingArgs(
            factor=self.rope_factor,
            original_max_position_embeddings=self.original_seq_len,
            beta_fast=self.beta_fast,
            beta_slow=self.beta_slow,
            attention_factor=self.rope_attention_factor,
        )

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times YaRN's ``mscale ** 2`` when YaRN is on."""
        scale = self.qk_head_dim**-0.5
        if self.rope_factor > 1 and self.mscale:
            scale *= yarn_get_mscale(self.rope_factor, self.mscale) ** 2
        return scale

    def validate(self) -> None:
        """Raise ValueError (one line) naming the offending field if no model can be built."""
        validate_mask_settings(self)
        if self.tie_word_embeddings:
            raise ValueError("DeepSeek-V3 tie_word_embeddings=True is not supported")
        for name in ("vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "max_seq_len", "original_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {name}={getattr(self, name)} must be positive")
        if self.q_lora_rank < 0:
            raise ValueError(f"model q_lora_rank={self.q_lora_rank} must be >= 0 (0: no q LoRA)")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(
                f"model n_dense_layers={self.n_dense_layers} must be between 0 and "
                f"n_layers={self.n_layers}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE)")
        if self.rope_factor > 1 and self.beta_fast <= self.beta_slow:
            raise ValueError(
                f"model beta_fast={self.beta_fast} must be greater than beta_slow={self.beta_slow}"
            )
        self.moe_args.validate()

    def update_from_config(self, job_config: JobConfig, tokenizer: Any | None = None) -> None:
        """``max_seq_len`` from ``training.seq_len``, ``moe_args.force_load_balance`` from
        ``debug.moe_force_load_balance`` and, for debug flavors, the tokenizer's vocab size.

        Mutates ``self``: copy the registry's flavor first (``ModelSpec.get_model_args``).
        """
        self.max_seq_len = job_config.training.seq_len
        self.moe_args.force_load_balance = job_config.debug.moe_force_load_balance
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
        """Total parameter count and training FLOPs per token of the *activated* network.

        ``6 * (N_active - N_embedding) + 6 * L * H * T * (qk_head_dim + v_head_dim)``: routed
        experts count with ``top_k / num_experts`` of their parameters (shared experts, the
        router and everything else in full), the token embedding (a lookup) not at all; the
        attention term is QK^T (``qk_head_dim``) plus AV (``v_head_dim``), forward + backward,
        over the full length ``T``. Works on meta-device models.
        """
        nparams = sum(p.numel() for p in model.parameters())
        embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
        routed = 0
        for module in model.modules():
            if isinstance(module, MoE):
                routed += sum(p.numel() for p in module.experts.parameters())
        moe = self.moe_args
        active = nparams - routed + routed * moe.top_k / moe.num_experts
        attention = 6 * self.n_layers * self.n_heads * seq_len * (self.qk_head_dim + self.v_head_dim)
        return nparams, float(6 * (active - embedding) + attention)
