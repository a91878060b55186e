"""Llama 2 family (registry entry ``llama2``): the Llama 3 model class with Llama 2 shapes.

Llama 2 uses RoPE theta 10000, no RoPE scaling, a 32000-token sentencepiece vocabulary, and
multi-head attention except for 70B (grouped-query, 8 key/value heads).
"""

from __future__ import annotations

from torchtitan.models.llama3 import llama_model_spec
from torchtitan.models.llama3.args import TransformerModelArgs

__all__ = ["llama2_args"]

llama2_args: dict[str, TransformerModelArgs] = {
    "debugmodel": TransformerModelArgs(
        dim=256,
        n_layers=8,
        n_heads=16,
        vocab_size=32000,
        multiple_of=256,
        rope_theta=10000,
        max_seq_len=2048,
        use_tokenizer_vocab=True,
    ),
    "7B": TransformerModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        vocab_size=32000,
        multiple_of=256,
        norm_eps=1e-5,
        rope_theta=10000,
        max_seq_len=4096,
    ),
    "13B": TransformerModelArgs(
        dim=5120,
        n_layers=40,
        n_heads=40,
        vocab_size=32000,
        multiple_of=256,
        norm_eps=1e-5,
        rope_theta=10000,
        max_seq_len=4096,
    ),
    "70B": TransformerModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=32000,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        norm_eps=1e-5,
        rope_theta=10000,
        max_seq_len=4096,
    ),
}


def _register() -> None:
    from torchtitan.models import register_model_spec

    register_model_spec(llama_model_spec("llama2", llama2_args))


_register()
