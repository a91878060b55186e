"""Data parallelism through ``Trainer.train_step`` equals one rank on the same global batch.

A seed checkpoint gives every run the same weights (tests/distributed/trainer_runs.py). One
rank reads each step's global batch as two gradient-accumulation microbatches (rows 0-3,
then 4-7), two data-parallel ranks (FSDP, then DDP) read one half each. Rank 0's rows carry
many ignored labels and rank 1's none, so the per-rank token counts differ: the loss
normalisation (summed token loss x n_loss_ranks / global valid tokens) is only right if the
number of loss ranks and the global token count are both used. Per-step loss and grad norm
(clipping at 0.5 is active) agree within rtol/atol 1e-5 (fp32 reduction-order noise).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import launch
from tests.distributed.trainer_runs import STEPS, from_seed, run_sequence, seed_args

pytestmark = pytest.mark.slow  # launches gloo ranks

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, list[float]]]]:
    root = tmp_path_factory.mktemp("dp")
    seed_dir = str(root / "seed" / "checkpoint" / "step-0")
    seed = seed_args(str(root / "seed"))
    one = launch(run_sequence, 1, [seed, from_seed(seed_dir, str(root / "one"))], timeout_s=180)
    layouts = {
        "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
        "ddp2": ["--parallelism.data_parallel_shard_degree", "1",
                 "--parallelism.data_parallel_replicate_degree", "2"],
    }
    argvs = [from_seed(seed_dir, str(root / name), *flags) for name, flags in layouts.items()]
    per_rank = launch(run_sequence, 2, argvs, timeout_s=240)
    out = {"one": [one[0][1]]}
    for i, name in enumerate(layouts):
        out[name] = [rank[i] for rank in per_rank]
    return out


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
