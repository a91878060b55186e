"""Attention sinks (models/common/attention_sinks.py) and the shared pieces gpt-oss adds to
models/common: per-layer windows, biased attention, biased clamped-SwiGLU experts, a biased
router. Each kernel path is checked against the definition (scores with a sink column)."""

from __future__ import annotations

import copy

import pytest
import torch

from torchtitan.models.common.attention import GroupedQueryAttention
from torchtitan.models.common.attention_sinks import (
    reference_attention_with_sinks,
    sdpa_with_sinks,
)
from torchtitan.models.common.document_mask import (
    attend,
    block_mask,
    boolean_mask,
    build_attention_mask,
    mask_mod,
)
from torchtitan.models.common.grouped_experts import clamped_swiglu
from torchtitan.models.common.moe import MoE, MoEArgs

B, H, S, D = 2, 4, 24, 16


def _qkv(dtype=torch.float64, grad=True):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g, dtype=dtype) for _ in range(3))
    sinks = 2 * torch.randn(H, generator=g, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v, sinks)]


def _docs():
    ids = torch.zeros(B, S, dtype=torch.int32)
    ids[0, 7:] = 1
    ids[1, 15:] = 1
    return ids


MASKS = {
    "causal": lambda: None,
    "window": lambda: boolean_mask(None, S, 5, "cpu"),
    "block_causal_window": lambda: boolean_mask(_docs(), S, 5, "cpu"),
    "block_causal": lambda: boolean_mask(_docs(), S, None, "cpu"),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_sdpa_sinks_equal_the_definition_with_gradients(name):
    mask = MASKS[name]()
    ref_in, ours_in = _qkv(), _qkv()
    ref = reference_attention_with_sinks(*ref_in[:3], mask, ref_in[3])
    ours = sdpa_with_sinks(*ours_in[:3], mask, ours_in[3])
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(ref, ref_in, grad), torch.autograd.grad(ours, ours_in, grad)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    # negative control: without the sinks the output moves by O(1)
    plain = attend(*[t.detach() for t in ref_in[:3]], mask if mask is not None else None)
    assert (plain - ref.detach()).abs().max() > 0.1


def test_flex_sinks_rescale_by_lse_equals_the_definition():
    """FlexAttention's path (lse rescale), forward on CPU (no FlexAttention backward there)."""
    q, k, v, sinks = _qkv(torch.float32, grad=False)
    docs = _docs()
    flex_mask = block_mask(mask_mod(docs, 5), B, S, S, "cpu", compiled=False)
    ref = reference_attention_with_sinks(q, k, v, boolean_mask(docs, S, 5, "cpu"), sinks)
    ours = attend(q, k, v, flex_mask, compiled_flex=False, sinks=sinks)
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-6)


def test_grouped_query_attention_with_sinks_and_biases_under_a_sharded_mask():
    """The sink key is appended after the context-parallel gather: a rank's queries against
    every key equal the same rows of the whole attention."""
    torch.manual_seed(0)
    attn = GroupedQueryAttention(32, 4, 2, 8, bias=True, sinks=True)
    attn.init_weights(0.02)
    with torch.no_grad():
        attn.sinks.normal_(0, 2)
        attn.wq.bias.normal_(0, 0.5)
    from torchtitan.models.common.document_mask import SequenceShard
    from torchtitan.models.common.rope import precompute_freqs_cis

    x = torch.randn(B, S, 32)
    freqs = precompute_freqs_cis(8, S)
    whole = attn(x, freqs, attention_mask=boolean_mask(None, S, 6, "cpu"))
    mine = torch.arange(S // 2, S)  # this rank holds the second half of each sequence
    xk = attn.wk(x).view(B, S, -1, 8)
    xv = attn.wv(x).view(B, S, -1, 8)
    _, xk = attn.rotary(xk, xk, freqs)

    def gather(k, v):  # every key/value of the whole sequence, in order
        return xk.transpose(1, 2), xv.transpose(1, 2)

    shard = SequenceShard(mine, torch.arange(S), gather)
    mask = build_attention_mask(mask_type="causal", doc_ids=None, seq_len=S, batch_size=B,
                                device=torch.device("cpu"), sliding_window=6, shard=shard)
    part = attn(x[:, mine], freqs[mine], attention_mask=mask)
    torch.testing.assert_close(part, whole[:, mine], rtol=0, atol=1e-6)




def test_clamped_swiglu_is_transformers_gate():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = transformers.GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2)
    hf = GptOssExperts(cfg)
    gate_up = 6 * torch.randn(5, 12)  # well past the clamp limit 7 on both sides
    ours = clamped_swiglu(gate_up[..., ::2], gate_up[..., 1::2], alpha=1.702, limit=7.0)
    torch.testing.assert_close(ours, hf._apply_gate(gate_up), rtol=0, atol=0)


def _biased_moe(**kw) -> MoE:
    torch.manual_seed(0)
    args = MoEArgs(num_experts=6, top_k=2, router_bias=True, expert_linear_bias=True,
                   expert_activation="clamped_swiglu", route_norm=True, **kw)
    moe = MoE(args, dim=16, hidden_dim=24)
    moe.init_weights(init_std=0.3)
    with torch.no_grad():
        for p in (moe.router.gate.bias, moe.experts.b1, moe.experts.b2, moe.experts.b3):
            p.normal_(0, 0.5)
    return moe


def test_biased_clamped_experts_grouped_gemm_equals_the_loop():
    grouped = _biased_moe()
    loop = copy.deepcopy(grouped)
    loop.experts.use_grouped_mm = False
    x = torch.randn(2, 9, 16)
    out_g, out_l = grouped(x), loop(x)
    torch.testing.assert_close(out_g, out_l, rtol=1e-5, atol=1e-6)
    out_g.square().sum().backward()
    out_l.square().sum().backward()
    for (name, pg), pl in zip(grouped.named_parameters(), loop.parameters()):
        torch.testing.assert_close(pg.grad, pl.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert grouped.experts.b2.grad.abs().sum() > 0 and grouped.router.gate.bias.grad.abs().sum() > 0


def test_partial_output_leaves_the_down_bias_to_add_down_bias():
    moe = _biased_moe()
    x = torch.randn(7, 16)
    counts = torch.tensor([2, 0, 3, 1, 1, 0])
    whole = moe.experts(x, counts)
    moe.experts.output_is_partial = True
    partial = moe.experts(x, counts)
    torch.testing.assert_close(moe.experts.add_down_bias(partial, counts), whole)
    assert (partial - whole).abs().max() > 0.1


def test_moe_args_refuse_an_unknown_activation():
    with pytest.raises(ValueError, match="expert_activation='gelu' must be"):
        MoEArgs(expert_activation="gelu").validate()
