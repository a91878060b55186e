"""DeepSeek-V3 model arguments: the shared decoder's fields plus MLA, MoE and YaRN's."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.models.common.decoder import DecoderArgs
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.rope import YaRNScalingArgs, yarn_get_mscale


@dataclass
class DeepSeekV3ModelArgs(DecoderArgs):
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

    tie_word_embeddings: bool = False
    """Must stay False (no DeepSeek model ties them)."""

    def __post_init__(self) -> None:
        if isinstance(self.moe_args, dict):  # args recorded in a checkpoint marker as JSON
            self.moe_args = MoEArgs(**self.moe_args)

    # --- derived shapes -----------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def ffn_hidden_dim(self) -> int:
        return self.inter_dim

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def rope_scaling(self) -> YaRNScalingArgs | None:
        return self.yarn

    @property
    def attention_head_dims(self) -> tuple[int, int]:
        return self.qk_head_dim, self.v_head_dim

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
        super().validate()
        if self.tie_word_embeddings:
            raise ValueError("DeepSeek-V3 tie_word_embeddings=True is not supported")
        self.require_positive("vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers",
                              "n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                              "v_head_dim", "max_seq_len", "original_seq_len")
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
