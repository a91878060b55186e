"""Expert parallelism equals the same layout without it (real gloo ranks, Qwen3 MoE debug flavor
built with 2 of its 4 layers: both are MoE layers, and a pipeline stage holds one).

Every run starts from one seed checkpoint and sees the same global batch per step
(tests/distributed/trainer_runs.py), and each EP layout is compared with the layout of the same
data-parallel degree without EP: EP2 x FSDP2 vs FSDP2 (experts: 4 per rank, no FSDP left for them),
EP2 x FSDP4 vs FSDP4 (experts also FSDP-sharded over the 2 remaining ranks), EP2 x PP2 x FSDP2 vs
FSDP2, EP2 x HSDP (dp_replicate 2 x dp_shard 2) vs HSDP 2x2, and EP with context parallel vs CP2 x
FSDP2: EP2 x CP2 x FSDP2 (ep takes the cp ranks), EP4 x CP2 x FSDP2 (ep = dp_shard x cp) and EP2 x
CP4 (experts FSDP-sharded over the other cp ranks). Under TP the TP ranks split the MoE tokens (etp
1): TP2 and EP2 x TP2 at dp 1, EP2 x TP2 x FSDP2 (ep = the TP ranks), EP4 x TP2 x FSDP2 (ep = tp x
dp_shard) and DDP2 x TP2 x EP2 vs FSDP2; or every expert is split over tp (expert TP): EP2 x TP2 x
FSDP2 with ETP2 vs FSDP2, and ETP2 x TP2 x PP2 (dp 1, one global batch) vs FSDP2; or both (1 < etp
< tp): TP4 x ETP2 (two token groups of two ranks, each expert split over a group) and EP2 x TP4 x
ETP2 (ep = the two groups), at dp 1, and on 8 ranks with HSDP (dp_replicate 2) vs FSDP2. Per-step
loss and grad norm over 4 AdamW steps (5 for the HSDP 2x2 and CP layouts; clipping at 0.5 active)
agree within rtol 1e-5 (losses) and 1e-4 (grad norms, see NORM_TOL), and so do the load-balancing
biases: the all-to-all moves tokens exactly and only the order of fp32 sums changes; an expert
gradient off by the ep factor moves the grad norm by 3e-3 from step 1 and the loss by 3e-5 from
step 3 (relative, EP2 x FSDP2 vs FSDP2). A checkpoint saved at EP2 x FSDP2 resumes at FSDP4,
at EP2 x TP4 x ETP2, at EP4 x TP2 (ep = tp x dp_shard) and at one device. Layer-level tests
send no tokens from one rank to the other rank's experts, check expert TP's output and every
gradient shard against the whole layer, and the auxiliary loss over sequence shards.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import launch
from tests.distributed.trainer_runs import (
    BASE_ARGS,
    NORM_TOL,
    ONE_BATCH,
    REAL_DATA,
    STEPS,
    TOL,
    dp,
    from_seed,
    resume_args,
    run_sequence,
    seed_args,
)

pytestmark = pytest.mark.slow  # launches gloo ranks

MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
N_LAYERS = 2  # of the flavor's 4 (run_sequence): half the collectives of every run


def _ep(n: int) -> list[str]:
    return ["--parallelism.expert_parallel_degree", str(n)]


TP2 = ["--parallelism.tensor_parallel_degree", "2"]
TP4 = ["--parallelism.tensor_parallel_degree", "4"]
ETP2 = ["--parallelism.expert_tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
REP2 = ["--parallelism.data_parallel_replicate_degree", "2"]
FIVE_STEPS = ["--training.steps", "5"]  # the HSDP / CP layouts and their references


def _cp(n: int) -> list[str]:
    return ["--parallelism.context_parallel_degree", str(n)]


HSDP2x2 = [*REP2, *dp(2), "--training.local_batch_size", "2", *FIVE_STEPS]
CP2_FSDP2 = [*_cp(2), *dp(2), *FIVE_STEPS]
TWO_RANKS = {
    "fsdp2": dp(2),
    "ep2_fsdp2": [*dp(2), *_ep(2)],
    # the TP ranks split the MoE tokens: experts whole (gradients summed over tp), or spread
    # over ep = the TP ranks (no FSDP)
    "tp2": [*dp(1), *TP2, *ONE_BATCH],
    "ep2_tp2_dp1": [*dp(1), *TP2, *_ep(2), *ONE_BATCH],
    # op-level SAC (the experts' FSDP unit sits inside the checkpointed block), full AC with
    # per-block compile, and 2 microbatches per step (gradient accumulation)
    "ep2_sac": [*dp(2), *_ep(2), "--activation_checkpoint.mode", "selective",
                "--activation_checkpoint.selective_ac_option", "op"],
    "ep2_ac_compile": [*dp(2), *_ep(2), "--activation_checkpoint.mode", "full",
                       "--compile.enable", "--compile.backend", "aot_eager"],
    "ep2_accum": [*dp(2), *_ep(2), "--training.local_batch_size", "2"],
}
FOUR_RANKS = {
    "fsdp4": [*dp(4), "--training.local_batch_size", "2"],
    "ep2_fsdp4": [*dp(4), *_ep(2), "--training.local_batch_size", "2"],
    "ep2_tp2": [*dp(2), *TP2, *_ep(2)],  # ep = the TP ranks; experts FSDP over dp_shard
    "ep4_tp2": [*dp(2), *TP2, *_ep(4)],  # ep = tp x dp_shard
    "ddp2_tp2_ep2": [*REP2, *dp(1), *TP2, *_ep(2)],  # DDP (FSDP2's replicate), ep = tp
    "ep2_tp2_etp2": [*dp(2), *TP2, *_ep(2), *ETP2],  # experts: (ep, tp) = (Shard 0, hidden)
    "etp2_pp2": [*dp(1), *TP2, *PP2, *ETP2, *ONE_BATCH],  # no EP
    # 2 token groups of 2 TP ranks, each expert split over a group's 2 ranks; then ep = the
    # 2 groups (experts on the (ep, etp) mesh as (Shard 0, hidden))
    "tp4_etp2": [*dp(1), *TP4, *ETP2, *ONE_BATCH],
    "ep2_tp4_etp2": [*dp(1), *TP4, *ETP2, *_ep(2), *ONE_BATCH],
    "ep2_pp2": [*dp(2), *PP2, *_ep(2)],
    "hsdp2x2": HSDP2x2,
    "ep2_hsdp2x2": [*HSDP2x2, *_ep(2)],  # experts: HSDP over (dp_replicate 2, dp_shard_mod_ep 1)
    "cp2_fsdp2": CP2_FSDP2,
    "ep2_cp2_fsdp2": [*CP2_FSDP2, *_ep(2)],  # ep = the cp ranks; experts FSDP over dp_shard
    "ep4_cp2_fsdp2": [*CP2_FSDP2, *_ep(4)],  # ep = dp_shard x cp
    # ep = 2 of the 4 cp ranks; experts FSDP over the other 2 (dp 1: the same global batch)
    "ep2_cp4": [*_cp(4), *dp(1), "--training.local_batch_size", "8", *FIVE_STEPS, *_ep(2)],
}
EIGHT_RANKS = {
    # HSDP with both token groups and expert TP: dp_replicate 2 x TP4 x ETP2, ep = the 2 token
    # groups of each replica; experts replicated over dp_replicate, sharded on (ep, etp)
    "ep2_hsdp2x1_tp4_etp2": [*REP2, *dp(1), *TP4, *ETP2, *_ep(2)],
}
PAIRS = [
    ("ep2_fsdp2", "fsdp2"),
    ("ep2_sac", "fsdp2"),
    ("ep2_ac_compile", "fsdp2"),
    ("ep2_accum", "fsdp2"),
    ("ep2_fsdp4", "fsdp4"),
    ("tp2", "fsdp2"),  # dp 1 vs 2, one global batch
    ("ep2_tp2_dp1", "fsdp2"),
    ("ep2_tp2", "fsdp2"),  # dp 2 in both: the same data
    ("ep4_tp2", "fsdp2"),
    ("ddp2_tp2_ep2", "fsdp2"),  # dp 2 in both
    ("ep2_pp2", "fsdp2"),
    ("ep2_tp2_etp2", "fsdp2"),
    ("etp2_pp2", "fsdp2"),  # dp 1 vs 2, one global batch
    ("tp4_etp2", "fsdp2"),
    ("ep2_tp4_etp2", "fsdp2"),
    ("ep2_hsdp2x2", "hsdp2x2"),
    ("ep2_cp2_fsdp2", "cp2_fsdp2"),
    ("ep4_cp2_fsdp2", "cp2_fsdp2"),
    ("ep2_cp4", "cp2_fsdp2"),  # dp 1 vs 2, one global batch: equal within the same bounds
    ("ep2_hsdp2x1_tp4_etp2", "fsdp2"),  # dp 2 in both
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ep")


@pytest.fixture(scope="module")
def runs(root) -> dict[str, list[dict[str, list[float]]]]:
    seed_dir = str(root / "seed" / "checkpoint" / "step-0")
    saved = str(root / "ep2_fsdp2_saved")
    # EP2 x FSDP2 trains 2 steps and saves (also as HF safetensors); others resume from it.
    # Its routing bias trains (as in the runs it is compared with), and HF Qwen3-MoE has none:
    # the export drops it, as asked.
    save = [*BASE_ARGS, *MOE, "--job.dump_folder", saved, "--checkpoint.enable",
            "--checkpoint.last_save_in_hf", "--checkpoint.last_save_in_hf_allow_lossy",
            "--checkpoint.initial_load_path", seed_dir, "--training.steps", "2",
            "--checkpoint.interval", "2", *dp(2), *_ep(2)]
    # The real dataloader at EP2 x FSDP2: 4 steps straight (saving at 2), then resumed at 2.
    real = [REAL_DATA, *BASE_ARGS, *MOE, "--job.dump_folder", str(root / "real"),
            "--checkpoint.enable", "--checkpoint.initial_load_path", seed_dir,
            "--checkpoint.interval", "2", *dp(2), *_ep(2)]
    out: dict[str, list[dict[str, list[float]]]] = {}
    for world, layouts, first, last in (
        (1, {"one": []}, [[*seed_args(str(root / "seed")), *MOE]], {}),
        (2, TWO_RANKS, [], {"saved": save, "real": real,
                            "real_resumed": [*real, "--checkpoint.load_step", "2"]}),
        (4, FOUR_RANKS, [], {"resumed_fsdp4": resume_args(
            saved, 2, *MOE, *dp(4), "--training.local_batch_size", "2"),
            "resumed_etp": resume_args(saved, 2, *MOE, *dp(1), *TP4, *ETP2, *_ep(2),
                                       *ONE_BATCH),
            # ep = the TP ranks, which split the MoE tokens
            "resumed_ep4_tp2": resume_args(saved, 2, *MOE, *dp(2), *TP2, *_ep(4))}),
        (8, EIGHT_RANKS, [], {}),
        (1, {}, [], {"resumed_one": resume_args(saved, 2, *MOE)}),
    ):
        argvs = first + [
            from_seed(seed_dir, str(root / name), *MOE, *flags) for name, flags in layouts.items()
        ] + list(last.values())
        per_rank = launch(run_sequence, world, argvs, N_LAYERS, timeout_s=400)
        for i, name in enumerate([*layouts, *last]):
            out[name] = [rank[len(first) + i] for rank in per_rank]
    return out


def test_moe_reference_trains(runs):
    losses = runs["one"][0]["loss"]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    torch.testing.assert_close(runs["fsdp2"][0]["loss"], losses, **TOL)


@pytest.mark.parametrize("ep_layout, reference", PAIRS, ids=[p[0] for p in PAIRS])
def test_expert_parallel_matches_the_layout_without_it(ep_layout, reference, runs):
    expected = runs[reference][0]
    assert len(expected["loss"]) == (5 if reference in ("hsdp2x2", "cp2_fsdp2") else STEPS)
    if ep_layout == "ep2_accum":
        assert runs[ep_layout][0]["accumulation"] == [2] and expected["accumulation"] == [1]
    for rank, run in enumerate(runs[ep_layout]):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(
                run[key], expected[key], **(TOL if key == "loss" else NORM_TOL),
                msg=lambda m, k=key, r=rank: f"{ep_layout} rank {r} {k}: {m}",
            )
        if "pp2" not in ep_layout:  # a pipeline stage holds only some MoE layers
            # the load-balancing biases moved by the same token counts (summed over every
            # rank that routed other tokens)
            torch.testing.assert_close(run["expert_bias"], expected["expert_bias"], rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    "resumed", ["resumed_fsdp4", "resumed_etp", "resumed_ep4_tp2", "resumed_one"]
)
def test_ep_checkpoint_resumes_under_another_layout(resumed, runs):
    uninterrupted = runs["ep2_fsdp2"][0]
    torch.testing.assert_close(runs["saved"][0]["loss"], uninterrupted["loss"][:2], **TOL)
    for rank, run in enumerate(runs[resumed]):
        assert run["first_step"] == [3]
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(
                run[key], uninterrupted[key][2:], **(TOL if key == "loss" else NORM_TOL),
                msg=lambda m, k=key, r=rank: f"{resumed} rank {r} {k}: {m}",
            )


def dispatch_vs_local_experts() -> dict[str, float]:
    """One MoE layer, 8 experts over 2 ranks; rank 0's routing bias keeps all of its tokens
    away from rank 1's experts (zero-size splits). Output and gradients vs the same layer with
    all experts local, on this rank's tokens."""
    import copy

    import torch.distributed as dist

    from torchtitan.distributed.expert_parallel import apply_expert_parallel, moe_grad_hooks
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.common.moe import MoE, MoEArgs

    rank = dist.get_rank()
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, etp=1, world_size=2)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    ref = MoE(MoEArgs(num_experts=8, top_k=2), dim=16, hidden_dim=24)
    ref.init_weights(0.05)
    if rank == 0:
        with torch.no_grad():
            ref.expert_bias[4:] = -100.0  # experts 4-7 live on rank 1
    holder = torch.nn.Module()
    holder.moe = copy.deepcopy(ref)
    apply_expert_parallel(holder, dims)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(rank))
    out_ref = ref(x)
    out_ep = holder.moe(x)
    out_ref.pow(2).sum().backward()
    out_ep.pow(2).sum().backward()
    for hook in moe_grad_hooks([holder], dims):  # experts: both ranks' tokens, averaged
        hook()  # like FSDP does
    sent_away = int(holder.moe.tokens_per_expert[4:].sum())
    dist.all_reduce(ref.experts.w1.grad)  # the reference: both ranks' gradients, summed ...
    expected_w1 = ref.experts.w1.grad[4 * rank : 4 * rank + 4] / 2  # ... and averaged
    return {
        "out": (out_ep - out_ref).abs().max().item(),
        "router_grad": (holder.moe.router.gate.weight.grad - ref.router.gate.weight.grad)
        .abs().max().item(),
        "w1_grad": (holder.moe.experts.w1.grad.to_local() - expected_w1).abs().max().item(),
        "sent_to_rank1": float(sent_away),
    }


def test_all_to_all_dispatch_with_zero_token_splits():
    results = launch(dispatch_vs_local_experts, 2)
    assert results[0].pop("sent_to_rank1") == 0.0  # rank 0 routed nothing to rank 1's experts
    results[1].pop("sent_to_rank1")
    for rank, errors in enumerate(results):
        assert max(errors.values()) < 1e-5, f"rank {rank}: {errors}"


def expert_tp_vs_local_experts() -> dict[str, float]:
    """One MoE layer with a shared expert at EP2 x TP2 with expert TP (4 ranks): the experts'
    and shared expert's hidden dims are split over tp. The TP peers see the same tokens (the
    TP-gathered sequence). Output and gradients vs the whole layer on this rank's tokens."""
    import copy

    import torch.distributed as dist

    from torchtitan.distributed.expert_parallel import apply_expert_parallel, moe_grad_hooks
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.common.moe import MoE, MoEArgs

    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=2, etp=2, world_size=4)
    dims.build_mesh("cpu")
    ep, tp = dims.mesh_local_rank("ep"), dims.mesh_local_rank("tp")
    torch.manual_seed(0)
    ref = MoE(MoEArgs(num_experts=8, top_k=2, num_shared_experts=1), dim=16, hidden_dim=24)
    ref.init_weights(0.05)
    holder = torch.nn.Module()
    holder.moe = copy.deepcopy(ref)
    apply_expert_parallel(holder, dims)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(ep))
    x_ref, x_etp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out_etp = ref(x_ref), holder.moe(x_etp)
    out_ref.pow(2).sum().backward()
    out_etp.pow(2).sum().backward()
    for hook in moe_grad_hooks([holder], dims):
        hook()
    experts, shared = holder.moe.experts, holder.moe.shared_experts
    shapes_ok = (tuple(experts.w1.to_local().shape) == (4, 12, 16)
                 and tuple(experts.w2.to_local().shape) == (4, 16, 12)
                 and tuple(shared.w1.weight.to_local().shape) == (12, 16)
                 and tuple(shared.w2.weight.to_local().shape) == (16, 12))
    # the reference expert gradient: both ep ranks' tokens (each counted by its 2 TP peers in
    # the world sum), averaged over the 2 ep ranks as FSDP and the scaler do
    for w in (ref.experts.w1, ref.experts.w2):
        dist.all_reduce(w.grad)
        w.grad /= 4
    rows, cols = slice(4 * ep, 4 * ep + 4), slice(12 * tp, 12 * tp + 12)
    return {
        "out": (out_etp - out_ref).abs().max().item(),
        "input_grad": (x_etp.grad - x_ref.grad).abs().max().item(),
        "router_grad": (holder.moe.router.gate.weight.grad - ref.router.gate.weight.grad)
        .abs().max().item(),
        "w1_grad": (experts.w1.grad.to_local() - ref.experts.w1.grad[rows, cols]).abs().max().item(),
        "w2_grad": (experts.w2.grad.to_local() - ref.experts.w2.grad[rows, :, cols]).abs().max().item(),
        "shared_w1_grad": (shared.w1.weight.grad.to_local() - ref.shared_experts.w1.weight.grad[cols])
        .abs().max().item(),
        "shared_w2_grad": (shared.w2.weight.grad.to_local()
                           - ref.shared_experts.w2.weight.grad[:, cols]).abs().max().item(),
        "shapes_wrong": float(not shapes_ok),
    }


def test_expert_tensor_parallel_splits_hidden_dims_and_equals_the_whole_layer():
    for rank, errors in enumerate(launch(expert_tp_vs_local_experts, 4)):
        assert max(errors.values()) < 1e-5, f"rank {rank}: {errors}"


def test_moe_ep_resume_is_bit_exact(runs):
    """Weights, optimizer, the routing bias (it moves every step) and the data position resume:
    steps 3-4 after a resume equal the run that never stopped, bit for bit."""
    for rank in range(2):
        straight, resumed = runs["real"][rank], runs["real_resumed"][rank]
        assert resumed["first_step"] == [3]
        assert resumed["loss"] == straight["loss"][2:]
        assert resumed["grad_norm"] == straight["grad_norm"][2:]


def test_hf_export_of_an_ep_run_has_every_expert_whole(runs, root):
    """``checkpoint.last_save_in_hf`` at EP2 x FSDP2: the HF folder holds all 8 experts of
    every layer as whole per-expert matrices, equal to the step's DCP checkpoint (which the
    resume tests show holds the trained weights), and trained away from the seed. (The trained
    routing bias, which HF Qwen3-MoE cannot hold, is dropped: last_save_in_hf_allow_lossy.)"""
    from torchtitan.components.checkpoint.hf import load_safetensors_folder
    from torchtitan.components.checkpoint.load import load_dcp_model_tensors

    step = root / "ep2_fsdp2_saved" / "checkpoint" / "step-2"
    hf = load_safetensors_folder(str(step / "hf"))
    dcp = load_dcp_model_tensors(str(step))
    seed = load_dcp_model_tensors(str(root / "seed" / "checkpoint" / "step-0"))
    stacked = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    experts = [k for k in hf if ".mlp.experts." in k]
    assert len(experts) == N_LAYERS * 8 * 3  # layers x experts x projections
    for key in experts:
        layer, expert, proj = int(key.split(".")[2]), int(key.split(".")[5]), key.split(".")[6]
        name = next(k for k in dcp if k.startswith(f"layers.{layer}.")
                    and k.endswith(f"experts.{stacked[proj]}"))
        assert dcp[name].shape[0] == 8
        assert torch.equal(hf[key], dcp[name][expert]), key
        assert not torch.equal(hf[key], seed[name][expert]), key


def aux_loss_over_sequence_shards() -> dict[str, float]:
    """One MoE layer with DeepSeek-V3's sequence-level auxiliary loss, each rank holding half of
    every sequence's positions: as the TP ranks that split the MoE tokens (router / expert
    gradients summed over tp after backward) and as context parallel (gradients averaged over
    cp, as FSDP does). Worst |gradient - one device's| over all parameters, per layout."""
    import copy

    import torch.distributed as dist

    from torchtitan.distributed.expert_parallel import apply_moe_sequence_sum, moe_grad_hooks
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.common.moe import MoE, MoEArgs, sequence_balance_loss

    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = MoE(MoEArgs(num_experts=8, top_k=2, aux_loss_coeff=1.0, num_shared_experts=1),
              dim=16, hidden_dim=24)
    ref.init_weights(0.05)
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(7))
    ref(x).pow(2).sum().backward()
    half = x[:, 6 * rank : 6 * rank + 6]
    out: dict[str, float] = {}
    with torch.no_grad():  # the statistic does depend on the split
        weights, selected, _, scores = ref.router(half.reshape(-1, 16), ref.expert_bias)
        local = sequence_balance_loss(scores, selected, 2, ref.args)
        weights, selected, _, scores = ref.router(x.reshape(-1, 16), ref.expert_bias)
        out["aux_split_vs_whole"] = abs(local - sequence_balance_loss(scores, selected, 2, ref.args)).item()
    for name, degrees in (("tp", dict(tp=2, cp=1)), ("cp", dict(tp=1, cp=2))):
        dims = ParallelDims(dp_replicate=1, dp_shard=1, pp=1, ep=1, etp=1, world_size=2, **degrees)
        dims.build_mesh("cpu")
        holder = torch.nn.Module()
        holder.moe = copy.deepcopy(ref)
        holder.moe.zero_grad()
        apply_moe_sequence_sum(holder, dims)
        if name == "tp":  # the TP ranks hold one loss: their gradients add up
            holder.moe(half).pow(2).sum().backward()
            for hook in moe_grad_hooks([holder], dims):
                hook()
        else:  # each cp rank's loss counts cp times its share; FSDP averages over cp
            (holder.moe(half).pow(2).sum() * 2).backward()
            for p in holder.moe.parameters():
                dist.all_reduce(p.grad)
                p.grad /= 2
        out[name] = max((p.grad - q.grad).abs().max().item() / q.grad.abs().max().item()
                        for p, q in zip(holder.moe.parameters(), ref.parameters()))
    return out


def test_auxiliary_loss_over_sequence_shards_equals_one_device():
    for rank, result in enumerate(launch(aux_loss_over_sequence_shards, 2)):
        assert result.pop("aux_split_vs_whole") > 1e-3
        assert max(result.values()) < 1e-5, f"rank {rank}: {result}"


def moe_input_shapes_under_tp() -> dict[int, list[int]]:
    """Qwen3 MoE debug model at TP2: the input each MoE layer receives, per
    expert_tensor_parallel_degree (1: this rank's sequence shard; 2: the gathered sequence)."""
    from tests.distributed.harness import parallelized_model
    from torchtitan.models import get_model_spec
    from torchtitan.models.common.moe import moe_layers

    spec = get_model_spec("qwen3")
    args = spec.get_model_args("debugmodel_moe")
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    shapes = {}
    for etp in (1, 2):
        model, _ = parallelized_model(
            spec, args, 2, tensor_parallel_degree=2, data_parallel_shard_degree=1,
            expert_tensor_parallel_degree=etp,
        )
        seen = []
        moe_layers([model])[0].register_forward_pre_hook(
            lambda _m, inputs, seen=seen: seen.append(list(inputs[0].shape))
        )
        with torch.no_grad():
            model(tokens)
        shapes[etp] = seen[0]
    return shapes


def test_moe_layers_under_tp_run_the_local_sequence_shard_unless_expert_tp():
    for shapes in launch(moe_input_shapes_under_tp, 2):
        assert shapes[1][:2] == [2, 16] and shapes[2][:2] == [2, 32], shapes
