"""DeepSeek-V3 family (torchtitan/models/deepseek_v3): registry, exact parameter counts against
transformers' DeepseekV3ForCausalLM built on meta, FLOPs per token, module layout, bad settings,
training on CPU, the TP plan's numerics and the HF config round trip."""

from __future__ import annotations

import copy

import pytest
import torch

from torchtitan.models import get_model_spec
from torchtitan.models.common.moe import MoE, MoEArgs
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs, deepseekv3_args
from torchtitan.models.deepseek_v3.hf_config import (
    hf_config_from_model_args,
    model_args_from_hf_config,
)

transformers = pytest.importorskip("transformers")


def _meta_model(args: DeepSeekV3ModelArgs) -> DeepSeekV3Model:
    with torch.device("meta"):
        return DeepSeekV3Model(args)


def _hf_meta_count(args: DeepSeekV3ModelArgs) -> int:
    """Parameters of transformers' DeepseekV3ForCausalLM of the same shape, built on meta
    (routing settings do not change shapes, so the V2-shaped flavors are counted with it too)."""
    moe = args.moe_args
    cfg = transformers.DeepseekV3Config(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.inter_dim,
        moe_intermediate_size=args.moe_inter_dim, num_hidden_layers=args.n_layers,
        first_k_dense_replace=args.n_dense_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_heads, n_shared_experts=moe.num_shared_experts,
        n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k, n_group=1, topk_group=1,
        q_lora_rank=args.q_lora_rank or None, kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_head_dim, qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim,
    )
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(cfg)
    return sum(p.numel() for p in hf.parameters())


# Exact counts (no MTP layer: the published 671B's multi-token-prediction module is not part of
# DeepseekV3ForCausalLM either, which is what these are checked against).
EXPECTED_PARAMS = {
    "16B": 15_706_484_224,
    "236B": 235_741_434_880,
    "671B": 671_026_404_352,
}


@pytest.mark.parametrize("flavor", sorted(EXPECTED_PARAMS))
def test_parameter_counts_equal_transformers(flavor):
    args = deepseekv3_args[flavor]
    ours = sum(p.numel() for p in _meta_model(copy.deepcopy(args)).parameters())
    assert ours == EXPECTED_PARAMS[flavor]
    assert _hf_meta_count(args) == ours


def test_flavor_shapes():
    v3 = deepseekv3_args["671B"]
    assert (v3.dim, v3.n_layers, v3.n_dense_layers, v3.n_heads, v3.vocab_size) == (7168, 61, 3, 128, 129280)
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_nope_head_dim, v3.qk_rope_head_dim, v3.v_head_dim) == (
        1536, 512, 128, 64, 128)
    moe = v3.moe_args
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.num_expert_groups,
            moe.num_limited_groups, moe.route_scale, moe.score_func, moe.route_norm) == (
        256, 8, 1, 8, 4, 2.5, "sigmoid", True)
    assert (v3.inter_dim, v3.moe_inter_dim) == (18432, 2048)
    lite = deepseekv3_args["16B"]
    assert (lite.dim, lite.n_layers, lite.moe_args.num_experts, lite.moe_args.top_k, lite.q_lora_rank) == (
        2048, 27, 64, 6, 0)


def test_flops_count_activated_experts_and_mla():
    args = copy.deepcopy(deepseekv3_args["671B"])
    model = _meta_model(args)
    nparams, flops = args.get_nparams_and_flops(model, seq_len=4096)
    routed = 58 * 3 * 256 * 7168 * 2048  # 58 MoE layers x (w1, w2, w3) x 256 experts
    embedding = 129280 * 7168
    active = nparams - routed + routed * 8 // 256
    assert active == 37_552_282_624  # the published "37B activated" (the MTP layer excluded)
    attention = 6 * 61 * 128 * 4096 * (192 + 128)
    assert flops == 6 * (active - embedding) + attention


def test_layout_init_and_forward():
    args = copy.deepcopy(deepseekv3_args["debugmodel"])
    args.vocab_size, args.max_seq_len, args.n_layers = 256, 32, 3
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()
    assert list(model.layers) == ["0", "1", "2"]
    assert hasattr(model.layers["0"], "feed_forward") and not hasattr(model.layers["0"], "moe")
    assert isinstance(model.layers["1"].moe, MoE) and not hasattr(model.layers["1"], "feed_forward")
    assert model.freqs_cis.shape == (32, 8) and model.freqs_cis.is_complex()  # rope dim 16
    keys = set(model.state_dict())
    assert {"layers.1.moe.experts.w1", "layers.1.moe.router.gate.weight", "layers.1.moe.expert_bias",
            "layers.1.moe.shared_experts.w2.weight", "layers.0.attention.wkv_b.weight",
            "layers.0.attention.wq_a.weight", "layers.0.attention.q_norm.weight"} <= keys
    assert model.layers["1"].moe.experts.w1.shape == (8, 256, 256)
    assert model.layers["1"].moe.shared_experts.w1.weight.shape == (512, 256)  # 2 shared experts
    logits = model(torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256) and torch.isfinite(logits).all()
    model.to(torch.bfloat16)
    assert model.freqs_cis.is_complex() and model.layers["1"].moe.expert_bias.dtype == torch.float32


def test_sdpa_padding_equals_plain_attention():
    """Zero-padding v to the q/k head dim (for the flash kernels) changes nothing."""
    from torchtitan.models.deepseek_v3.model import _attend

    q, k, v = torch.randn(2, 7, 3, 12), torch.randn(2, 7, 3, 12), torch.randn(2, 7, 3, 5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=0.3
    ).transpose(1, 2)
    torch.testing.assert_close(_attend(q, k, v, 0.3), ref, rtol=1e-5, atol=1e-6)
    q2, k2, v2 = torch.randn(2, 7, 3, 4), torch.randn(2, 7, 3, 4), torch.randn(2, 7, 3, 6)
    ref2 = torch.nn.functional.scaled_dot_product_attention(
        q2.transpose(1, 2), k2.transpose(1, 2), v2.transpose(1, 2), is_causal=True, scale=0.3
    ).transpose(1, 2)
    torch.testing.assert_close(_attend(q2, k2, v2, 0.3), ref2, rtol=1e-5, atol=1e-6)


def test_softmax_scale_uses_yarn_mscale():
    args = DeepSeekV3ModelArgs(rope_factor=40.0, mscale=0.707)
    assert args.softmax_scale == pytest.approx(192**-0.5 * (0.1 * 0.707 * 3.6888794541 + 1) ** 2)
    assert DeepSeekV3ModelArgs(rope_factor=1.0, mscale=0.707).softmax_scale == 192**-0.5


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(n_dense_layers=9), "n_dense_layers=9 must be between 0 and n_layers=6"),
        (dict(qk_rope_head_dim=63), "qk_rope_head_dim=63 must be even"),
        (dict(q_lora_rank=-1), "q_lora_rank=-1 must be >= 0"),
        (dict(attn_mask_type="sliding"), "attn_mask_type='sliding' must be 'causal' or 'block_causal'"),
        (dict(moe_args=MoEArgs(num_experts=8, top_k=9)), "top_k=9 must be between 1"),
        (dict(beta_fast=1.0), "beta_fast=1.0 must be greater than beta_slow"),
    ],
)
def test_bad_settings_one_line(change, message):
    args = copy.deepcopy(deepseekv3_args["debugmodel"])
    for key, value in change.items():
        setattr(args, key, value)
    with pytest.raises(ValueError, match=message) as info:
        _meta_model(args)
    assert "\n" not in str(info.value)


def test_registry_and_update_from_config():
    from torchtitan.config.manager import ConfigManager

    spec = get_model_spec("deepseek_v3")
    assert spec.flavors == ["debugmodel", "debugmodel_flex_attn", "16B", "236B", "671B"]
    flex = spec.get_model_args("debugmodel_flex_attn")
    assert (flex.use_flex_attn, flex.attn_mask_type) == (True, "block_causal")
    assert spec.get_model_args("debugmodel").attn_mask_type == "causal"
    cfg = ConfigManager().parse_args([
        "--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel",
        "--training.seq_len", "128", "--debug.moe_force_load_balance",
    ])
    assert cfg.model.name == "deepseek_v3" and cfg.job.config_file.endswith("deepseek_v3_debugmodel.toml")
    args = spec.get_model_args(cfg.model.flavor)

    class Tok:
        vocab_size = 2256

    args.update_from_config(cfg, tokenizer=Tok())
    assert (args.max_seq_len, args.vocab_size, args.moe_args.force_load_balance) == (128, 2256, True)
    assert deepseekv3_args["debugmodel"].moe_args.force_load_balance is False  # registry untouched


@pytest.mark.parametrize("flavor", ["debugmodel", "16B", "671B"])
def test_hf_config_round_trip(flavor):
    args = copy.deepcopy(deepseekv3_args[flavor])
    back = model_args_from_hf_config(hf_config_from_model_args(args))
    for name in ("dim", "inter_dim", "moe_inter_dim", "n_layers", "n_dense_layers", "n_heads",
                 "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "rope_theta", "rope_factor", "original_seq_len", "beta_fast", "beta_slow", "mscale",
                 "rope_attention_factor", "norm_eps", "vocab_size"):
        assert getattr(back, name) == pytest.approx(getattr(args, name)), name
    for name in ("num_experts", "num_shared_experts", "top_k", "score_func", "route_norm",
                 "route_scale", "num_expert_groups", "num_limited_groups"):
        assert getattr(back.moe_args, name) == getattr(args.moe_args, name), name


def test_hf_config_refuses_what_hf_cannot_express():
    args = copy.deepcopy(deepseekv3_args["236B"])  # softmax routing with groups
    with pytest.raises(ValueError, match="cannot express softmax routing with expert groups"):
        hf_config_from_model_args(args)
    with pytest.raises(ValueError, match="topk_method='group_limited_greedy' is not supported"):
        model_args_from_hf_config({**hf_config_from_model_args(deepseekv3_args["16B"]),
                                   "topk_method": "group_limited_greedy"})



def test_tp_degree_must_divide_the_dense_ffn():
    from torchtitan.distributed.parallel_dims import ParallelismError
    from torchtitan.models.deepseek_v3.parallelize import check_deepseekv3_tp

    args = copy.deepcopy(deepseekv3_args["debugmodel"])
    args.inter_dim = 1000
    model = _meta_model(args)
    check_deepseekv3_tp(model, 2)
    with pytest.raises(ParallelismError, match=r"^parallelism.tensor_parallel_degree=3 must divide "
                       r"the model's dense FFN inter_dim=1000 \(w1/w3 are split column-wise\)$"):
        check_deepseekv3_tp(model, 3)
