"""The chunked loss (``--training.loss_implementation chunked``: the output projection fused
with cross-entropy, the logits never whole) equals the plain logits path under every
parallelism that touches the output layer: one device, FSDP2, TP2 (vocabulary-parallel:
the weight sharded over the vocabulary, max / sum of exponentials / label logit all-reduced,
the hidden states' gradient reduce-scattered), PP2 (the last stage returns the loss) and CP2
(each rank's part of the sequence), on two gloo ranks from one seed checkpoint, with
validation through the same path. Chunks of 50 tokens split every microbatch unevenly.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.trainer_runs import NORM_TOL, STEPS, TOL, TWO_RANK_LAYOUTS, lever_runs

pytestmark = pytest.mark.slow  # launches gloo ranks

CHUNKED = ["--training.loss_implementation", "chunked", "--training.loss_chunk_size", "50"]
VALIDATION = ["--validation.enable", "--validation.dataset", "c4_test",
              "--validation.local_batch_size", "2", "--validation.seq_len", "64",
              "--validation.steps", "2", "--validation.freq", "100"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, list[float]]]]:
    return lever_runs(tmp_path_factory.mktemp("chunked_loss"), [*VALIDATION, *CHUNKED],
                      ["--training.loss_implementation", "logits"], TWO_RANK_LAYOUTS)


def test_logits_path_trains(runs):
    losses = runs["plain"][0]["loss"]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("layout", ["one", *TWO_RANK_LAYOUTS])
def test_chunked_loss_matches_logits(layout, runs):
    reference = runs["plain"][0]
    for rank, run in enumerate(runs[layout]):
        # FSDP2's validation batches are other rows (two data-parallel ranks)
        for key in ("loss", "grad_norm") + (() if layout == "fsdp2" else ("val",)):
            torch.testing.assert_close(
                run[key], reference[key], **(NORM_TOL if key == "grad_norm" else TOL),
                msg=lambda m, k=key, r=rank: f"{layout} rank {r} {k}: {m}",
            )
