"""FSDP2 / HSDP / DDP / TP / FSDP x TP train the same model as one device (real gloo ranks).

Every layout starts from the same full state dict, sees the same global batch (dp ranks take
slices, tp ranks share them), and runs 6 AdamW steps with ``clip_grad_norm_`` acting on every
step. Tolerances (fp32 reduction-order noise; measured max differences in brackets):
  * per-step loss and grad norm: rtol 1e-5, atol 1e-5 [<= 2e-6]. Sharded matmuls, reduce-scatters
    and all-reduces sum in a different order than one device, which moves fp32 results by a few
    ulps (~1e-7 relative) per op; a few hundred ops and 6 steps stay well inside 1e-5.
  * final parameters: atol 1e-4 [<= 2e-5]. AdamW divides by sqrt(v): where a gradient element is
    tiny, its last-bit noise is amplified to an update difference up to ~lr; 1e-4 leaves margin
    while a real bug (e.g. dp ranks reading the same slice) moves them by ~1e-1. Clipping and
    AdamW are scale-invariant, so a wrong gradient scale (summed instead of averaged) shows up
    only in the grad norms, which is why those are compared too.
One launch per world size runs all its layouts (process start-up dominates the cost).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import (
    MAX_NORM,
    STEPS,
    Layout,
    RunResult,
    run_layouts,
    train_reference,
)
from tests.distributed.launcher import launch

pytestmark = [
    pytest.mark.slow,  # every test reads results of 2- or 4-rank gloo launches
    pytest.mark.usefixtures("one_thread"),  # the reference, as the workers (OMP_NUM_THREADS=1)
]

LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
PARAM_ATOL = 1e-4

LAYOUTS_2 = [
    Layout("fsdp", dp_shard=2),
    Layout(
        "fsdp_reshard_never_cpu_offload",
        dp_shard=2,
        overrides={
            "parallelism.fsdp_reshard_after_forward": "never",
            "training.enable_cpu_offload": True,
        },
    ),
    Layout("fsdp_tied_embeddings", dp_shard=2, tied=True),
    Layout("fsdp_summed_grads", dp_shard=2, sum_grads=True),
    Layout("ddp", dp_replicate=2),
    Layout("tp", tp=2),
    Layout("tp_no_loss_parallel", tp=2, overrides={"parallelism.disable_loss_parallel": True}),
    Layout("tp_tied_embeddings", tp=2, tied=True),
    # TP + compiled blocks: the embedding's in-flight reduce-scatter output is waited for
    # before the first compiled block (fed to it, backward fails)
    Layout(
        "tp_compile_op_sac",
        tp=2,
        overrides={
            "compile.enable": True,
            "compile.backend": "aot_eager",
            "activation_checkpoint.mode": "selective",
            "activation_checkpoint.selective_ac_option": "op",
        },
    ),
    # TP + full AC + compile: the checkpoint wrapper stays outside the compiled block
    Layout(
        "tp_compile_full_ac",
        tp=2,
        overrides={
            "compile.enable": True,
            "compile.backend": "aot_eager",
            "activation_checkpoint.mode": "full",
        },
    ),
    # FSDP + per-block inductor compile + op-level SAC (the GPU production combination); runs
    # last so that a cold compile (~10-20 s) delays no other layout
    Layout(
        "fsdp_compile_op_sac",
        dp_shard=2,
        overrides={
            "compile.enable": True,
            "compile.backend": "aot_eager",
            "activation_checkpoint.mode": "selective",
            "activation_checkpoint.selective_ac_option": "op",
        },
    ),
]
LAYOUTS_4 = [
    Layout("hsdp_2x2", dp_replicate=2, dp_shard=2),
    Layout("fsdp2_x_tp2", dp_shard=2, tp=2),
    Layout("hsdp_summed_grads", dp_replicate=2, dp_shard=2, sum_grads=True),
    Layout("fsdp2_x_tp2_tied_embeddings", dp_shard=2, tp=2, tied=True),
    Layout(
        "fsdp2_x_tp2_op_sac",
        dp_shard=2,
        tp=2,
        overrides={
            "activation_checkpoint.mode": "selective",
            "activation_checkpoint.selective_ac_option": "op",
        },
    ),
]


@pytest.fixture(scope="module")
def reference() -> dict[bool, RunResult]:
    refs = {tied: train_reference(tied=tied) for tied in (False, True)}
    for ref in refs.values():  # equality below is only meaningful if training moves the loss
        assert max(ref.losses) - min(ref.losses) > 0.1
        assert all(n > MAX_NORM for n in ref.grad_norms)  # clipping acts on every step
    return refs


@pytest.fixture(scope="module")
def results_2() -> dict[str, list[RunResult]]:
    return _by_layout(launch(run_layouts, 2, LAYOUTS_2, timeout_s=180))


@pytest.fixture(scope="module")
def results_4() -> dict[str, list[RunResult]]:
    return _by_layout(launch(run_layouts, 4, LAYOUTS_4, timeout_s=180))


def _by_layout(per_rank: list[dict[str, RunResult]]) -> dict[str, list[RunResult]]:
    return {name: [rank_result[name] for rank_result in per_rank] for name in per_rank[0]}


def _check(layout: Layout, runs: list[RunResult], reference: dict[bool, RunResult]) -> None:
    ref = reference[layout.tied]
    for rank, run in enumerate(runs):  # every rank reports the same global numbers
        assert len(run.losses) == STEPS
        torch.testing.assert_close(
            run.losses,
            ref.losses,
            **LOSS_TOL,
            msg=lambda m, r=rank: f"{layout.name} rank {r} losses: {m}",
        )
        torch.testing.assert_close(
            run.grad_norms,
            ref.grad_norms,
            **LOSS_TOL,
            msg=lambda m, r=rank: f"{layout.name} rank {r} grad norms: {m}",
        )
    final = runs[0].final_state
    assert final is not None and set(final) == set(ref.final_state)
    for key, value in ref.final_state.items():
        torch.testing.assert_close(
            final[key],
            value,
            rtol=0,
            atol=PARAM_ATOL,
            msg=lambda m, k=key: f"{layout.name} {k}: {m}",
        )


@pytest.mark.parametrize("layout", LAYOUTS_2, ids=lambda x: x.name)
def test_two_ranks_match_single_device(layout, results_2, reference):
    _check(layout, results_2[layout.name], reference)


@pytest.mark.parametrize("layout", LAYOUTS_4, ids=lambda x: x.name)
def test_four_ranks_match_single_device(layout, results_4, reference):
    _check(layout, results_4[layout.name], reference)
