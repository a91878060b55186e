"""Qwen3 family (dense and MoE): flavors and registry entry ``qwen3``.

Published sizes follow the Hub ``config.json`` of the Qwen3 release (April 2025): head_dim 128,
vocab 151936, RoPE theta 1e6, RMSNorm eps 1e-6, context 40960; 0.6B/1.7B/4B tie the input and
output embeddings. The MoE sizes route softmax top-8 of 128 experts with renormalised weights
(``norm_topk_prob``) and no shared experts; every layer is MoE.
"""

from __future__ import annotations

from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.spec import ModelSpec, lazy

__all__ = ["Qwen3Model", "Qwen3ModelArgs", "qwen3_args", "qwen3_model_spec"]


def _dense(dim: int, n_layers: int, n_heads: int, hidden_dim: int, tied: bool) -> Qwen3ModelArgs:
    return Qwen3ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim=128,
        hidden_dim=hidden_dim, tie_word_embeddings=tied,
    )


def _moe(dim: int, n_layers: int, n_heads: int, hidden_dim: int, moe_hidden_dim: int) -> Qwen3ModelArgs:
    return Qwen3ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=4, head_dim=128,
        hidden_dim=hidden_dim, moe_hidden_dim=moe_hidden_dim,
        moe_args=MoEArgs(num_experts=128, top_k=8, score_func="softmax", route_norm=True),
    )


qwen3_args: dict[str, Qwen3ModelArgs] = {
    # Small, CPU-trainable; the vocabulary comes from the tokenizer. n_heads * head_dim (512)
    # differs from dim (256) on purpose, as in every published size.
    "debugmodel": Qwen3ModelArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, vocab_size=2256,
        hidden_dim=768, max_seq_len=2048, tie_word_embeddings=True, use_tokenizer_vocab=True,
    ),
    "debugmodel_moe": Qwen3ModelArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, vocab_size=2256,
        hidden_dim=768, moe_hidden_dim=256, max_seq_len=2048, use_tokenizer_vocab=True,
        moe_args=MoEArgs(num_experts=8, top_k=2, score_func="softmax", route_norm=True),
    ),
    "0.6B": _dense(1024, 28, 16, 3072, tied=True),
    "1.7B": _dense(2048, 28, 16, 6144, tied=True),
    "4B": _dense(2560, 36, 32, 9728, tied=True),
    "8B": _dense(4096, 36, 32, 12288, tied=False),
    "14B": _dense(5120, 40, 40, 17408, tied=False),
    "32B": _dense(5120, 64, 64, 25600, tied=False),
    "30B-A3B": _moe(2048, 48, 32, hidden_dim=6144, moe_hidden_dim=768),
    "235B-A22B": _moe(4096, 94, 64, hidden_dim=12288, moe_hidden_dim=1536),
}


def qwen3_model_spec(name: str = "qwen3", flavors: dict[str, Qwen3ModelArgs] | None = None) -> ModelSpec:
    """The Qwen3 spec: model class, TP plan, HF adapter and flavors; the decoder defaults for
    the pipeline split, tokenizer, data and loss."""
    return ModelSpec(
        name=name,
        model_cls=Qwen3Model,
        model_args=qwen3_args if flavors is None else flavors,
        parallelize_fn=lazy("torchtitan.models.qwen3.parallelize:parallelize_qwen3"),
        state_dict_adapter=lazy(
            "torchtitan.models.qwen3.state_dict_adapter:Qwen3StateDictAdapter"
        ),
        hf_model_types=("qwen3", "qwen3_moe"),
    )


def _register() -> None:
    from torchtitan.models import register_model_spec

    register_model_spec(qwen3_model_spec())


_register()
