"""Data parallelism through ``Trainer.train_step`` equals one rank on the same global batch.

A seed checkpoint gives every run the same weights (tests/distributed/trainer_runs.py). One
rank reads each step's global batch as two gradient-accumulation microbatches (rows 0-3,
then 4-7), two data-parallel ranks (FSDP, then DDP) read one half each. Rank 0's rows carry
many ignored labels and rank 1's none, so the per-rank token counts differ: the loss
normalisation (summed token loss x n_loss_ranks / global valid tokens) is only right if the
number of loss ranks and the global token count are both used. Per-step loss and grad norm
(clipping at 0.5 is active) agree within rtol/atol 1e-5 (fp32 reduction-order noise).

DDP also composes with tensor and pipeline parallelism (4 ranks: two replicas of TP2 or PP2;
classic DDP cannot, so these replicate through FSDP2's ``replicate``): DDP2 x TP2, DDP2 x PP2
(zero-bubble, two microbatches accumulated per rank) and DDP2 x PP2 resumed from DDP2 x TP2's
step-2 checkpoint equal the one-rank run too. With ``mixed_precision_param = bfloat16`` (no
FSDP, so autocast) one rank and DDP2 x TP2 agree to bf16 noise and differ from float32.
DDP2 x TP2 also steps the optimizer in backward (``optimizer.early_step_in_backward``).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import launch
from tests.distributed.trainer_runs import (
    BASE_ARGS,
    NORM_TOL,
    STEPS,
    TOL,
    from_seed,
    resume_args,
    run_sequence,
    seed_args,
)

pytestmark = pytest.mark.slow  # launches gloo ranks

@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, list[float]]]]:
    root = tmp_path_factory.mktemp("dp")
    seed_dir = str(root / "seed" / "checkpoint" / "step-0")
    seed = seed_args(str(root / "seed"))
    one = launch(run_sequence, 1, [seed, from_seed(seed_dir, str(root / "one")),
                                   from_seed(seed_dir, str(root / "one_bf16"), *BF16),
                                   from_seed(seed_dir, str(root / "one_no_clip"), *NO_CLIP)],
                 timeout_s=180)
    layouts = {
        "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
        "ddp2": ["--parallelism.data_parallel_shard_degree", "1",
                 "--parallelism.data_parallel_replicate_degree", "2"],
    }
    argvs = [from_seed(seed_dir, str(root / name), *flags) for name, flags in layouts.items()]
    per_rank = launch(run_sequence, 2, argvs, timeout_s=240)
    out = {"one": [one[0][1]], "one_bf16": [one[0][2]], "one_no_clip": [one[0][3]]}
    for i, name in enumerate(layouts):
        out[name] = [rank[i] for rank in per_rank]
    saved = str(root / "ddp2_tp2")
    composed = {  # the TP run saves at step 2; PP2 resumes from it in the same ranks
        "ddp2_tp2": [*BASE_ARGS, *DDP2, *TP2, "--job.dump_folder", saved, "--checkpoint.enable",
                     "--checkpoint.initial_load_path", seed_dir, "--checkpoint.interval", "2"],
        "ddp2_pp2_accumulating": from_seed(seed_dir, str(root / "pp"), *DDP2, *PP2,
                                           "--parallelism.pipeline_parallel_schedule",
                                           "ZBVZeroBubble", "--training.local_batch_size", "2"),
        "ddp2_pp2_resumed": resume_args(saved, 2, *DDP2, *PP2, "--checkpoint.load_only"),
        "ddp2_tp2_bf16": from_seed(seed_dir, str(root / "bf16"), *DDP2, *TP2, *BF16),
        "ddp2_tp2_early_step": from_seed(seed_dir, str(root / "early"), *DDP2, *TP2, *NO_CLIP,
                                         "--optimizer.early_step_in_backward"),
    }
    per_rank = launch(run_sequence, 4, list(composed.values()), timeout_s=300)
    for i, name in enumerate(composed):
        out[name] = [rank[i] for rank in per_rank]
    return out


DDP2 = ["--parallelism.data_parallel_shard_degree", "1",
        "--parallelism.data_parallel_replicate_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
BF16 = ["--training.mixed_precision_param", "bfloat16"]  # the debug config's is float32
NO_CLIP = ["--training.max_norm", "0"]  # stepping in backward needs it


def test_one_rank_accumulates_what_two_ranks_split(runs):
    assert runs["one"][0]["accumulation"] == [2]
    assert runs["fsdp2"][0]["accumulation"] == [1] and runs["ddp2"][0]["accumulation"] == [1]
    losses = runs["one"][0]["loss"]
    assert len(losses) == STEPS and losses[-1] < losses[0]


@pytest.mark.parametrize("layout", ["fsdp2", "ddp2"])
def test_two_data_parallel_ranks_match_one_rank(layout, runs):
    reference = runs["one"][0]
    for rank, run in enumerate(runs[layout]):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(
                run[key], reference[key], **TOL,
                msg=lambda m, k=key, r=rank: f"{layout} rank {r} {k}: {m}",
            )


@pytest.mark.parametrize("layout", ["ddp2_tp2", "ddp2_pp2_accumulating", "ddp2_pp2_resumed"])
def test_ddp_composed_with_tp_or_pp_matches_one_rank(layout, runs):
    reference = runs["one"][0]
    first = runs[layout][0]["first_step"][0]
    assert first == (3 if layout.endswith("resumed") else 1)
    expected_accumulation = 2 if layout.endswith("accumulating") else 1
    for rank, run in enumerate(runs[layout]):
        assert run["accumulation"] == [expected_accumulation]
        for key, tol in (("loss", TOL), ("grad_norm", NORM_TOL)):
            torch.testing.assert_close(
                run[key], reference[key][first - 1:], **tol,
                msg=lambda m, k=key, r=rank: f"{layout} rank {r} {k}: {m}",
            )


def test_mixed_precision_without_fsdp_is_autocast_on_every_layout(runs):
    """mixed_precision_param=bfloat16 without FSDP: one rank and DDP2 x TP2 both autocast
    (float32 parameters), so they agree to bf16 noise, and both differ from float32."""
    fp32, bf16 = runs["one"][0]["loss"], runs["one_bf16"][0]["loss"]
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) > 1e-5  # bf16 matmuls ran
    for rank, run in enumerate(runs["ddp2_tp2_bf16"]):
        torch.testing.assert_close(run["loss"], bf16, rtol=0, atol=5e-4,
                                   msg=lambda m, r=rank: f"rank {r}: {m}")


def test_ddp_with_tp_steps_in_backward_after_the_all_reduce(runs):
    """FSDP2's replicate fires the post-accumulate-grad hooks on the all-reduced gradients, so
    optimizer.early_step_in_backward works under DDP x TP (classic DDP refuses it): equal to
    one rank's usual step. A hook on the unreduced gradient would let the replicas drift."""
    reference = runs["one_no_clip"][0]
    for rank, run in enumerate(runs["ddp2_tp2_early_step"]):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(run[key], reference[key], **TOL,
                                       msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}")
