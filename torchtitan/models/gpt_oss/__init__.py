"""gpt-oss family (OpenAI's open-weight MoE): flavors and registry entry ``gpt_oss``.

Published sizes follow the Hub ``config.json`` of gpt-oss-20b / gpt-oss-120b (transformers'
``GptOssConfig``): hidden 2880, 64 query heads and 8 KV heads of dim 64, q/k/v/o biases,
learned attention sinks, even layers with a 128-token sliding window and odd layers full,
RoPE theta 150000 with YaRN (factor 32, original context 4096, beta 32/1, no truncation),
top-4 softmax routing with a biased router over experts 2880 wide with biases and the clamped
SwiGLU (alpha 1.702, limit 7), RMSNorm eps 1e-5, vocab 201088, untied embeddings.
"""

from __future__ import annotations

from torchtitan.models.gpt_oss.args import GptOssModelArgs, gpt_oss_moe
from torchtitan.models.gpt_oss.model import GptOssModel
from torchtitan.models.spec import ModelSpec, lazy

__all__ = ["GptOssModel", "GptOssModelArgs", "gpt_oss_args", "gpt_oss_model_spec"]

gpt_oss_args: dict[str, GptOssModelArgs] = {
    # CPU-trainable: two windowed (32 tokens) and two full layers, 8 experts of width 256;
    # the routing bias balances the load; the vocabulary comes from the tokenizer.
    "debugmodel": GptOssModelArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=2256,
        moe_hidden_dim=256, max_seq_len=2048, sliding_window_size=32,
        moe_args=gpt_oss_moe(8, load_balance_coeff=1e-3), use_tokenizer_vocab=True,
    ),
    # The releases: FlexAttention on GPUs (sinks through its log-sum-exp); no routing bias,
    # as in HF (a flavor copy may set moe_args.load_balance_coeff)
    "20B": GptOssModelArgs(n_layers=24, moe_args=gpt_oss_moe(32), use_flex_attn=True),
    "120B": GptOssModelArgs(n_layers=36, moe_args=gpt_oss_moe(128), use_flex_attn=True),
}


def gpt_oss_model_spec() -> ModelSpec:
    """The gpt-oss spec: model class, TP plan, HF adapter and flavors; the decoder defaults
    for the pipeline split, tokenizer, data and loss."""
    return ModelSpec(
        name="gpt_oss",
        model_cls=GptOssModel,
        model_args=gpt_oss_args,
        parallelize_fn=lazy("torchtitan.models.gpt_oss.parallelize:parallelize_gpt_oss"),
        state_dict_adapter=lazy(
            "torchtitan.models.gpt_oss.state_dict_adapter:GptOssStateDictAdapter"
        ),
        hf_model_types=("gpt_oss",),
    )


def _register() -> None:
    from torchtitan.models import register_model_spec

    register_model_spec(gpt_oss_model_spec())


_register()
