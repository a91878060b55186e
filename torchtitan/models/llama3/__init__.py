"""Llama 3 / 3.1 / 3.2 family: flavors and registry entry ``llama3``."""

from __future__ import annotations

from torchtitan.models.common.rope import RoPEScalingArgs
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.spec import ModelSpec, lazy

__all__ = ["Transformer", "TransformerModelArgs", "llama3_args", "llama_model_spec"]


def llama_model_spec(name: str, flavors: dict[str, TransformerModelArgs]) -> ModelSpec:
    """The spec of a Llama-architecture family: the Llama model class and HF adapter with the
    family's own flavors; the decoder defaults for everything else (parallelize with the
    default TP plan, pipeline split, tokenizer, data, loss)."""
    return ModelSpec(
        name=name,
        model_cls=Transformer,
        model_args=flavors,
        state_dict_adapter=lazy(
            "torchtitan.models.llama3.state_dict_adapter:Llama3StateDictAdapter"
        ),
        hf_model_types=("llama",),
    )


# Llama 3.1 (8B/70B/405B) RoPE scaling; Llama 3.2 1B uses the same with factor 32.
_LLAMA31_ROPE = RoPEScalingArgs(
    scale_factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
_LLAMA32_ROPE = RoPEScalingArgs(
    scale_factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

llama3_args: dict[str, TransformerModelArgs] = {
    "debugmodel": TransformerModelArgs(
        dim=256,
        n_layers=8,
        n_heads=16,
        vocab_size=2256,
        multiple_of=256,
        rope_theta=500000,
        max_seq_len=2048,
        use_tokenizer_vocab=True,
    ),
    # upstream's name: FlexAttention (GPU; SDPA with the same mask on CPU) + document masking
    "debugmodel_flex_attn": TransformerModelArgs(
        dim=256,
        n_layers=8,
        n_heads=16,
        vocab_size=2256,
        multiple_of=256,
        rope_theta=500000,
        max_seq_len=2048,
        use_tokenizer_vocab=True,
        use_flex_attn=True,
        attn_mask_type="block_causal",
    ),
    "debugmodel_tiny": TransformerModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=2256,
        multiple_of=64,
        rope_theta=500000,
        max_seq_len=2048,
        use_tokenizer_vocab=True,
    ),
    "1B": TransformerModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000,
        rope_scaling=_LLAMA32_ROPE,
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    "8B": TransformerModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000,
        rope_scaling=_LLAMA31_ROPE,
        max_seq_len=131072,
    ),
    "70B": TransformerModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000,
        rope_scaling=_LLAMA31_ROPE,
        max_seq_len=131072,
    ),
    "405B": TransformerModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000,
        rope_scaling=_LLAMA31_ROPE,
        max_seq_len=131072,
    ),
}


def _register() -> None:
    from torchtitan.models import register_model_spec

    register_model_spec(llama_model_spec("llama3", llama3_args))


_register()
