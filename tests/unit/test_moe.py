"""MoE building blocks (torchtitan/models/common/moe.py): routing, grouped experts, balancing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torchtitan.models.common.moe import (
    MoE,
    MoEArgs,
    TokenChoiceTopKRouter,
    moe_layers,
    update_load_balance_bias,
)


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    args = MoEArgs(**{"num_experts": 6, "top_k": 2, **kw})
    moe = MoE(args, dim=16, hidden_dim=24)
    moe.init_weights(init_std=0.05)
    return moe


def test_grouped_gemm_equals_per_expert_loop_including_empty_experts():
    grouped = _moe(num_shared_experts=1)
    loop = copy.deepcopy(grouped)
    loop.experts.use_grouped_mm = False
    # A routing bias (it steers the choice only) so experts 4 and 5 receive no tokens at all.
    with torch.no_grad():
        for m in (grouped, loop):
            m.expert_bias[4:] = -100.0
    x = torch.randn(3, 5, 16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_g, out_l = grouped(x1), loop(x2)
    assert grouped.tokens_per_expert[4:].sum() == 0 and grouped.tokens_per_expert.sum() == 30
    torch.testing.assert_close(out_g, out_l, rtol=1e-5, atol=1e-6)
    out_g.pow(2).sum().backward()
    out_l.pow(2).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    for (name, pg), (_, pl) in zip(grouped.named_parameters(), loop.named_parameters()):
        torch.testing.assert_close(pg.grad, pl.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert grouped.experts.w1.grad[4:].abs().max() == 0  # no tokens, no gradient


def test_expanded_gradient_reaches_grouped_gemm():
    moe = _moe()
    moe(torch.randn(2, 4, 16)).sum().backward()  # sum() gives a stride-0 gradient
    assert moe.experts.w2.grad is not None


def test_router_top_k_normalisation_scale_and_groups():
    args = MoEArgs(num_experts=8, top_k=2, score_func="sigmoid", route_norm=True,
                   route_scale=2.5, num_expert_groups=4, num_limited_groups=1)
    router = TokenChoiceTopKRouter(4, args)
    torch.manual_seed(1)
    x = torch.randn(10, 4)
    weights, selected, counts, scores = router(x)
    torch.testing.assert_close(weights.sum(-1), torch.full((10,), 2.5))
    assert (selected // 2)[:, 0].eq((selected // 2)[:, 1]).all()  # both picks in one group
    assert counts.sum() == 20 and counts.tolist() == torch.bincount(selected.flatten(), minlength=8).tolist()
    # A large bias on expert 7 changes the choice but not the weights' source (the scores).
    bias = torch.zeros(8)
    bias[7] = 100.0
    _, biased, _, _ = router(x, bias)
    assert (biased == 7).any(dim=-1).all()


def test_group_limit_holds_with_negative_biased_scores():
    """Experts outside the chosen groups never win, even when the bias makes every allowed
    score negative (masking them with 0 instead of -inf would pick them)."""
    args = MoEArgs(num_experts=8, top_k=2, score_func="sigmoid", num_expert_groups=4,
                   num_limited_groups=1)
    router = TokenChoiceTopKRouter(4, args)
    torch.manual_seed(1)
    bias = torch.full((8,), -5.0)
    _, selected, _, _ = router(torch.randn(10, 4), bias)
    assert (selected // 2)[:, 0].eq((selected // 2)[:, 1]).all()


def test_force_load_balance_routes_round_robin():
    moe = _moe(force_load_balance=True)
    moe(torch.randn(3, 4, 16))
    assert moe.tokens_per_expert.tolist() == [4.0] * 6  # 12 tokens x top 2 over 6 experts


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(top_k=7), "top_k=7 must be between 1 and num_experts=6"),
        (dict(num_expert_groups=4, num_limited_groups=1), "num_expert_groups=4 must divide"),
        (dict(num_expert_groups=3), "must be set together"),
        (dict(score_func="relu"), "score_func='relu'"),
    ],
)
def test_bad_settings_one_line(kw, message):
    with pytest.raises(ValueError, match=message):
        MoEArgs(**{"num_experts": 6, "top_k": 2, **kw}).validate()


def test_bias_update_evens_a_skewed_load():
    """Varied tokens that mostly prefer experts 0 and 1: the bias spreads them out."""
    moe = _moe(num_experts=4, top_k=1, load_balance_coeff=1e-2, score_func="sigmoid")
    g = torch.Generator().manual_seed(3)
    direction = moe.router.gate.weight[0].detach() + moe.router.gate.weight[1].detach()
    direction = direction / direction.norm() * 4
    imbalance = []
    for _ in range(150):  # training forwards (grad enabled) count their tokens
        moe((torch.randn(256, 16, generator=g) + direction)[None])
        imbalance.append(float(update_load_balance_bias(moe_layers([moe]))["moe/max_load"]))
    assert imbalance[0] > 2.5  # max/mean load: 1.0 is perfect balance, 4.0 all on one expert
    assert sum(imbalance[-50:]) / 50 < 1.5
    assert moe.tokens_per_expert.sum() == 0  # counts reset after each update
    assert moe.expert_bias[:2].max() < moe.expert_bias[2:].min()  # favoured experts pushed down
    assert "expert_bias" in moe.state_dict() and "tokens_per_expert" not in moe.state_dict()


def test_load_figures_name_each_layer_and_average_over_layers():
    """One lagging layer sets moe/max_load; moe/mean_max_load and the per-layer figures show
    that the others are balanced."""
    model = nn.ModuleDict({"layers": nn.ModuleDict(
        {str(i): nn.ModuleDict({"moe": _moe(num_experts=4, top_k=1)}) for i in range(3)})})
    layers = moe_layers([model])
    for layer, counts in zip(layers, ([10, 10, 10, 10], [12, 8, 10, 10], [40, 0, 0, 0])):
        layer.tokens_per_expert.copy_(torch.tensor(counts, dtype=torch.float32))
    figures = {k: float(v) for k, v in update_load_balance_bias(layers).items()}
    assert figures == pytest.approx({
        "moe/max_load": 4.0, "moe/mean_max_load": (1.0 + 1.2 + 4.0) / 3, "moe/min_load": 0.0,
        "moe/dropped_tokens": 0.0, "moe/max_load/layers.0": 1.0, "moe/max_load/layers.1": 1.2,
        "moe/max_load/layers.2": 4.0,
    })


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_activation_checkpointing_recompute_does_not_count_tokens_twice(backend):
    """Eager, and a compiled block inside AC's wrapper (full AC + compile): its recompute
    re-runs the whole compiled graph, buffer updates included."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    moe = _moe(num_experts=4, top_k=2)
    block = checkpoint_wrapper(moe)  # what activation_checkpoint.mode full applies
    if backend is not None:
        block._checkpoint_wrapped_module.compile(backend=backend)
    block(torch.randn(1, 8, 16, requires_grad=True)).sum().backward()
    assert moe.tokens_per_expert.sum() == 16  # 8 tokens x top 2, once (not again in backward)
    assert moe.router.gate.weight.grad is not None


def test_counts_accumulate_over_microbatches_and_reduce_over_ranks():
    moe = _moe(num_experts=4, top_k=1)
    moe(torch.randn(1, 8, 16))
    moe(torch.randn(1, 8, 16))
    assert moe.tokens_per_expert.sum() == 16  # two microbatches
    with torch.no_grad():  # validation forwards do not move the balance
        moe(torch.randn(1, 8, 16))
    assert moe.tokens_per_expert.sum() == 16
    seen = []

    def reduce_sum(t):  # stands in for an all-reduce over 2 data-parallel ranks
        seen.append(t.sum().item())
        return t * 2

    update_load_balance_bias([moe], reduce_sum)
    assert seen == [16.0]


def test_aux_loss_adds_gradient_but_not_output():
    plain, aux = _moe(), _moe(aux_loss_coeff=0.1)
    x = torch.randn(2, 4, 16)
    torch.testing.assert_close(plain(x), aux(x))
    plain(x).pow(2).sum().backward()
    aux(x).pow(2).sum().backward()
    assert not torch.equal(plain.router.gate.weight.grad, aux.router.gate.weight.grad)


def test_compiled_float32_moe_equals_eager():
    """torch.compile traces grouped GEMM with its meta kernel, which accepts bf16 only: float32
    MoE layers fall back to the per-expert loop while compiling instead of failing."""
    moe = _moe(num_shared_experts=1)
    x = torch.randn(2, 5, 16)
    compiled = torch.compile(moe, backend="eager")
    torch.testing.assert_close(compiled(x), moe(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grouped", [True, False])
def test_experts_run_in_the_autocast_dtype_with_float32_weights(grouped):
    """Autocast covers matmuls but not torch._grouped_mm: the experts cast their weights to
    the autocast dtype themselves, so their GEMMs run in bf16 like every other matmul."""
    from torchtitan.models.common.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(dim=32, hidden_dim=48, num_experts=4, use_grouped_mm=grouped)
    experts.init_weights(0.02)
    x = torch.randn(24, 32)
    counts = torch.tensor([5, 0, 12, 7])
    reference = experts(x, counts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(x, counts)
    assert reference.dtype == torch.float32 and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=2e-3)
    out.float().square().sum().backward()
    assert all(w.dtype == w.grad.dtype == torch.float32 for w in experts.parameters())
