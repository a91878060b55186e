"""The start-up estimate of one checkpoint's size: weights plus Adam's two moments, in the
moments' own dtype (``optimizer.state_dtype``)."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.components.adamw_bf16_state import AdamBF16State
from torchtitan.components.checkpoint.common import ModelWrapper
from torchtitan.components.checkpoint.space import checkpoint_bytes, optimizer_state_itemsize
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.job_config import Optimizer


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False))


def test_float32_moments_are_two_weight_sized_copies():
    model = _model()
    weights = (8 * 16 + 16 * 4) * 4
    opts = OptimizersContainer([model], Optimizer(implementation="for-loop"))
    assert optimizer_state_itemsize(opts) is None
    assert checkpoint_bytes(ModelWrapper([model])) == 3 * weights


def test_bfloat16_moments_count_two_bytes_each():
    model = _model()
    n = 8 * 16 + 16 * 4
    opts = OptimizersContainer([model], Optimizer(state_dtype="bfloat16"))
    assert any(isinstance(o, AdamBF16State) for o in opts.optimizers)
    itemsize = optimizer_state_itemsize(opts)
    assert itemsize == 2
    assert checkpoint_bytes(ModelWrapper([model]), state_itemsize=itemsize) == n * (4 + 2 * 2)
    bf16 = _model().to(torch.bfloat16)  # bf16 weights: moments as large as the weights
    assert checkpoint_bytes(ModelWrapper([bf16]), state_itemsize=2) == n * 2 * 3


def test_room_for_one_checkpoint_but_not_two_warns(tmp_path, monkeypatch, caplog):
    """A folder with room for exactly one checkpoint: the first save works and the second
    fails, because the first is kept until the second is complete. Said at start-up."""
    import logging
    import shutil
    from collections import namedtuple

    from torchtitan.components.checkpoint.space import warn_if_short

    usage = namedtuple("usage", "total used free")
    gib = 1024**3
    for free, needle in ((gib // 2, "less than one checkpoint"),
                         (3 * gib // 2, "room for one checkpoint (~1.00 GiB) but not two"),
                         (3 * gib, None)):
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: usage(4 * gib, 0, free))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="torchtitan"):
            warn_if_short(str(tmp_path), gib)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        if needle is None:
            assert warnings == [] and "one checkpoint is ~1.00 GiB; 3.0 GiB free" in caplog.text
        else:
            assert len(warnings) == 1 and needle in warnings[0], warnings
