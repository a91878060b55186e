"""Context parallelism through the Trainer equals the same layout without CP (real gloo ranks).

Every run starts from one seed checkpoint and sees the same global batch per step
(tests/distributed/trainer_runs.py); each CP layout is compared with the layout that has the
same data-parallel degree but cp = 1, so the data is identical: CP2 vs one device (both
rotate methods; and with full activation checkpointing + per-block compile), CP2 x FSDP2 vs
FSDP2, CP2 x TP2 vs TP2, CP2 x PP2 vs PP2, CP2 x DDP2 (HSDP over replicate x cp) vs DDP2.
Head-tail load balancing is on (causal attention), except in CP2 with
``context_parallel_load_balancer none`` vs one device; which positions each rank holds under
either setting is checked directly. Masked attention (block-causal documents, a sliding
window), which CP runs against all-gathered keys/values: CP2, CP2 unbalanced, CP2 with a window
+ full AC + compile, CP2 x PP2 and CP2 x TP2 (with a window) vs one device with the same mask. Per-step loss and grad norm over 4 AdamW steps, and a
validation loss after them, agree within rtol/atol 1e-5: ring attention merges per-block
softmax results through their log-sum-exp in fp32, so CP changes only the order of fp32 sums
(measured differences are around 1e-6); a lost block, a wrong causal mask or a wrong token
normalisation moves the loss by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import launch
from tests.distributed.trainer_runs import (
    BASE_ARGS,
    REAL_DATA,
    STEPS,
    from_seed,
    resume_args,
    run_sequence,
    seed_args,
)

pytestmark = pytest.mark.slow  # launches gloo ranks

TOL = dict(rtol=1e-5, atol=1e-5)
VALIDATION = ["--validation.enable", "--validation.dataset", "c4_test",
              "--validation.local_batch_size", "2", "--validation.seq_len", "64",
              "--validation.steps", "2", "--validation.freq", "100"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
NO_DP = ["--parallelism.data_parallel_shard_degree", "1"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
ALLTOALL = ["--parallelism.context_parallel_rotate_method", "alltoall"]
DOCS = ["--model.attn_mask_type", "block_causal"]
WINDOW = ["--model.sliding_window_size", "8"]

ONE_RANK = {"one": [], "one_docs": DOCS, "one_docs_window": [*DOCS, *WINDOW]}
TWO_RANKS = {
    "cp2_allgather": [*CP2, *NO_DP],
    "cp2_alltoall": [*CP2, *NO_DP, *ALLTOALL],
    "fsdp2": FSDP2,
    "tp2": [*TP2, *NO_DP],
    "pp2": [*PP2, *NO_DP],
    "ddp2": [*NO_DP, "--parallelism.data_parallel_replicate_degree", "2"],
    "cp2_ac_compile": [*CP2, *NO_DP, "--activation_checkpoint.mode", "full",
                       "--compile.enable", "--compile.backend", "aot_eager"],
    "cp2_unbalanced": [*CP2, *NO_DP, "--parallelism.context_parallel_load_balancer", "none"],
    "cp2_docs": [*CP2, *NO_DP, *DOCS],
    "cp2_docs_window_ac_compile": [*CP2, *NO_DP, *DOCS, *WINDOW, "--activation_checkpoint.mode",
                                   "full", "--compile.enable", "--compile.backend", "aot_eager"],
    "cp2_docs_unbalanced": [*CP2, *NO_DP, *DOCS,
                            "--parallelism.context_parallel_load_balancer", "none"],
}
FOUR_RANKS = {
    "cp2_fsdp2": [*CP2, *FSDP2],
    "cp2_tp2": [*CP2, *TP2, *NO_DP],
    "cp2_pp2": [*CP2, *PP2, *NO_DP],
    "cp2_ddp2": [*CP2, *NO_DP, "--parallelism.data_parallel_replicate_degree", "2"],
    "cp2_pp2_docs": [*CP2, *PP2, *NO_DP, *DOCS],
    "cp2_tp2_docs_window": [*CP2, *TP2, *NO_DP, *DOCS, *WINDOW],
}
PAIRS = [
    ("cp2_allgather", "one"),
    ("cp2_alltoall", "one"),
    ("cp2_fsdp2", "fsdp2"),
    ("cp2_tp2", "tp2"),
    ("cp2_pp2", "pp2"),
    ("cp2_ddp2", "ddp2"),
    ("cp2_ac_compile", "one"),
    ("cp2_unbalanced", "one"),
    ("cp2_docs", "one_docs"),
    ("cp2_docs_window_ac_compile", "one_docs_window"),
    ("cp2_docs_unbalanced", "one_docs"),
    ("cp2_pp2_docs", "one_docs"),
    ("cp2_tp2_docs_window", "one_docs_window"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, list[float]]]]:
    root = tmp_path_factory.mktemp("cp")
    seed_dir = str(root / "seed" / "checkpoint" / "step-0")
    out: dict[str, list[dict[str, list[float]]]] = {}
    saved = str(root / "cp2_fsdp2_saved")
    # CP2 x FSDP2 trains 2 steps and saves; FSDP4 and one device resume from that checkpoint.
    save = [*BASE_ARGS, "--job.dump_folder", saved, "--checkpoint.enable",
            "--checkpoint.initial_load_path", seed_dir, "--training.steps", "2",
            "--checkpoint.interval", "2", *CP2, *FSDP2]
    resume_fsdp4 = resume_args(saved, 2, "--parallelism.data_parallel_shard_degree", "4",
                               "--training.local_batch_size", "2")
    resume_one = resume_args(saved, 2)
    # The real dataloader under CP: 4 steps straight (saving at 2), then resumed from step 2.
    real = str(root / "cp2_real_data")
    real_flags = [REAL_DATA, *BASE_ARGS, "--job.dump_folder", real, "--checkpoint.enable",
                  "--checkpoint.initial_load_path", seed_dir, "--checkpoint.interval", "2",
                  *CP2, *NO_DP]
    real_resumed = [*real_flags, "--checkpoint.load_step", "2"]
    for world, layouts, first, last in (
        (1, ONE_RANK, [seed_args(str(root / "seed"))], {}),
        (2, TWO_RANKS, [], {"real_data": real_flags, "real_data_resumed": real_resumed}),
        (4, FOUR_RANKS, [], {"saved": save, "resumed_fsdp4": resume_fsdp4}),
        (1, {}, [], {"resumed_one": resume_one}),
    ):
        argvs = first + [
            from_seed(seed_dir, str(root / name), *VALIDATION, *flags)
            for name, flags in layouts.items()
        ] + list(last.values())
        per_rank = launch(run_sequence, world, argvs, timeout_s=300)
        for i, name in enumerate([*layouts, *last]):
            out[name] = [rank[len(first) + i] for rank in per_rank]
    return out


def test_reference_trains(runs):
    losses = runs["one"][0]["loss"]
    assert len(losses) == STEPS and losses[-1] < losses[0]


@pytest.mark.parametrize("masked, plain", [("one_docs", "one"), ("one_docs_window", "one_docs")])
def test_masked_references_differ(masked, plain, runs):
    """The data has documents and the window is shorter than the sequence, so the masked CP
    pairs test the masks: their references differ from the less-masked ones."""
    diff = max(abs(a - b) for a, b in zip(runs[masked][0]["loss"], runs[plain][0]["loss"]))
    assert diff > 1e-3, f"{masked} vs {plain}: max loss difference {diff}"


@pytest.mark.parametrize("cp_layout, reference", PAIRS, ids=[p[0] for p in PAIRS])
def test_context_parallel_matches_the_layout_without_it(cp_layout, reference, runs):
    expected = runs[reference][0]
    for rank, run in enumerate(runs[cp_layout]):
        for key in ("loss", "grad_norm", "val"):
            torch.testing.assert_close(
                run[key], expected[key], **TOL,
                msg=lambda m, k=key, r=rank: f"{cp_layout} rank {r} {k}: {m}",
            )


def ring_attention_vs_sdpa(rotate_method: str) -> dict[str, float]:
    """On each cp rank: causal SDPA on its head-tail slice under the CP context vs the same
    slice of full-sequence SDPA (output and the query/key/value gradients)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.distributed.context_parallel import context_parallel_context

    torch.manual_seed(0)
    full = [torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3)]
    F.scaled_dot_product_attention(*full, is_causal=True).pow(2).sum().backward()
    ref_out = F.scaled_dot_product_attention(*full, is_causal=True).detach()
    world, rank = dist.get_world_size(), dist.get_rank()
    chunks = 2 * world  # head-tail: rank r holds chunks r and 2*world-1-r

    def my_slice(t: torch.Tensor) -> torch.Tensor:
        parts = t.chunk(chunks, dim=2)
        return torch.cat([parts[rank], parts[chunks - 1 - rank]], dim=2)

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    q, k, v = (t.detach().clone() for t in full)
    with context_parallel_context(mesh, [q, k, v], [2, 2, 2], {q, k, v}, rotate_method):
        for t in (q, k, v):
            t.requires_grad_()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.pow(2).sum().backward()
    errors = {"out": (out.detach() - my_slice(ref_out)).abs().max().item()}
    for name, mine, ref in zip("qkv", (q, k, v), full):
        errors[f"grad_{name}"] = (mine.grad - my_slice(ref.grad)).abs().max().item()
    errors["local_seq"] = float(out.shape[2])
    return errors


@pytest.mark.parametrize("rotate_method", ["allgather", "alltoall"])
def test_cpu_ring_attention_matches_full_attention(rotate_method):
    for rank, errors in enumerate(launch(ring_attention_vs_sdpa, 2, rotate_method)):
        assert errors.pop("local_seq") == 8.0  # each rank really holds half the sequence
        assert max(errors.values()) < 1e-5, f"rank {rank}: {errors}"


@pytest.mark.parametrize("resumed", ["resumed_fsdp4", "resumed_one"])
def test_cp_checkpoint_resumes_under_another_layout(resumed, runs):
    """Saved at CP2 x FSDP2 after step 2: the steps after it equal the uninterrupted run."""
    uninterrupted = runs["cp2_fsdp2"][0]
    saved = runs["saved"][0]
    torch.testing.assert_close(saved["loss"], uninterrupted["loss"][:2], **TOL)
    for rank, run in enumerate(runs[resumed]):
        assert run["first_step"] == [3]
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(
                run[key], uninterrupted[key][2:], **TOL,
                msg=lambda m, k=key, r=rank: f"{resumed} rank {r} {k}: {m}",
            )


def test_cp_real_dataloader_resumes_exactly(runs):
    """The dataloader position (shared by the two CP ranks of one dp rank) and the rest of the
    state resume: steps 3-4 after a resume equal steps 3-4 of the run that never stopped."""
    straight, resumed = runs["real_data"], runs["real_data_resumed"]
    for rank in range(2):
        assert resumed[rank]["first_step"] == [3]
        assert resumed[rank]["loss"] == straight[rank]["loss"][2:]  # bitwise
        assert resumed[rank]["grad_norm"] == straight[rank]["grad_norm"][2:]


def _positions_held(load_balance: bool) -> list[int]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.distributed.context_parallel import context_parallel_context

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    positions = torch.arange(8).view(1, 8)
    with context_parallel_context(mesh, [positions], [1], {positions}, "allgather", load_balance):
        pass
    return positions.flatten().tolist()


def test_load_balancer_decides_which_positions_each_rank_holds():
    assert launch(_positions_held, 2, True) == [[0, 1, 6, 7], [2, 3, 4, 5]]  # head-tail
    assert launch(_positions_held, 2, False) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # contiguous
