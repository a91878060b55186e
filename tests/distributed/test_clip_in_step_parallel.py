"""Clipping inside the fused AdamW step (``optimizer.clip_in_step``) under FSDP2, TP2 and PP2
on two gloo ranks equals one device rescaling the gradients (``--optimizer.no_clip_in_step``),
from one seed checkpoint, with a max_norm that clips every step: the divisor is the global
norm's (over every mesh and stage), and DTensor parameters take it in the fused kernel."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.trainer_runs import NORM_TOL, TOL, TWO_RANK_LAYOUTS, lever_runs

pytestmark = pytest.mark.slow  # launches gloo ranks

# eps near the clipped gradients' size: Adam's update then depends on the clip factor (with a
# tiny eps the factor cancels in m / sqrt(v), and a wrong one would not show)
FUSED = ["--optimizer.implementation", "fused", "--training.max_norm", "0.05",
         "--optimizer.eps", "1e-3"]
TWO_RANKS = {name: TWO_RANK_LAYOUTS[name] for name in ("fsdp2", "tp2", "pp2")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, list[float]]]]:
    return lever_runs(tmp_path_factory.mktemp("clip_in_step"), FUSED,
                      ["--optimizer.no_clip_in_step"], TWO_RANKS)


def test_every_step_clips(runs):
    assert min(runs["plain"][0]["grad_norm"]) > 0.05


@pytest.mark.parametrize("layout", ["one", *TWO_RANKS])
def test_clip_in_step_matches_rescaling(layout, runs):
    reference = runs["plain"][0]
    for rank, run in enumerate(runs[layout]):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(
                run[key], reference[key], **(TOL if key == "loss" else NORM_TOL),
                msg=lambda m, k=key, r=rank: f"{layout} rank {r} {k}: {m}",
            )
