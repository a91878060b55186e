"""Every rank's RNG state goes into the checkpoint (train_state.rng.rank<R>) and comes back on
the same layout; on another layout, or from a checkpoint without it, one warning and the
generators are left alone.

Two gloo ranks seed and advance their generators differently, save through the real
CheckpointManager and the Trainer's own state_dict/load_state_dict, scramble their generators,
load, and must draw exactly what they would have drawn right after the save.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.launcher import launch
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.checkpoint.load import read_dcp_metadata
from torchtitan.components.rng_state import RNGState
from torchtitan.config.job_config import Checkpoint
from torchtitan.train import Trainer

LAYOUT_2 = "ParallelDims(dp_replicate=2, world_size=2)"


class _TrainState(Trainer):
    """The Trainer's Stateful half (state_dict / load_state_dict) without building a run."""

    def __init__(self, rank: int, layout: str) -> None:  # noqa: D107 - no super().__init__
        self.step, self.ntokens_seen = 3, 96
        self.rng_state = RNGState(rank, layout)


def _manager(root: str, trainer: _TrainState) -> CheckpointManager:
    torch.manual_seed(0)  # the same model on every rank
    return CheckpointManager(
        None, [nn.Linear(4, 4)], None, None, {"train_state": trainer},
        Checkpoint(enable=True, interval=100, keep_latest_k=0), root,
    )


def save_and_restore(root: str) -> dict:
    rank = dist.get_rank()
    trainer = _TrainState(rank, LAYOUT_2)
    manager = _manager(root, trainer)
    torch.manual_seed(1000 + rank)
    torch.rand(5 + rank)  # each rank's stream also advanced differently
    manager.save(3, force=True)
    expected = torch.rand(4)  # what this rank draws right after the save
    torch.manual_seed(7)  # scrambled: the same on both ranks
    fresh = _TrainState(rank, LAYOUT_2)
    fresh.step = 0
    assert _manager(root, fresh).load()
    return {"expected": expected, "got": torch.rand(4), "step": fresh.step}


@pytest.mark.slow
def test_each_rank_gets_its_own_rng_state_back(tmp_path):
    out = launch(save_and_restore, 2, str(tmp_path), timeout_s=120)
    assert not torch.equal(out[0]["expected"], out[1]["expected"])  # the ranks' states differ
    for r in out:
        assert torch.equal(r["got"], r["expected"]), out
        assert r["step"] == 3
    keys = read_dcp_metadata(str(tmp_path / "checkpoint" / "step-3")).state_dict_metadata
    assert {"train_state.rng.rank0.cpu", "train_state.rng.rank1.cpu", "train_state.rng.layout"} <= set(keys)

    # one process (another layout): the generators are left alone, with one warning
    titan = logging.getLogger("torchtitan")
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    titan.addHandler(handler)
    try:
        single = _TrainState(0, "ParallelDims(world_size=1)")
        single.step = 0
        manager = _manager(str(tmp_path), single)
        torch.manual_seed(11)
        before = torch.get_rng_state()
        assert manager.load()
        after = torch.get_rng_state()
    finally:
        titan.removeHandler(handler)
    assert single.step == 3 and torch.equal(before, after)
    rng_lines = [line for line in lines if "RNG states not restored" in line]
    assert rng_lines == [
        f"Checkpoint: RNG states not restored (it was saved under {LAYOUT_2}, this run is "
        "ParallelDims(world_size=1)); random streams continue from this run's seed"
    ], lines
