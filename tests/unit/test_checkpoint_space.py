"""The start-up estimate of one checkpoint's size: weights plus Adam's two moments, in the
moments' own dtype (``optimizer.state_dtype``)."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.components.adamw_bf16_state import AdamBF16State
from torchtitan.components.checkpoint.common import ModelWrapper
from torchtitan.components.checkpoint.space import (
    checkpoint_sizes,
    first_failing_save,
    optimizer_state_itemsize,
    save_steps,
    warn_if_short,
)
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.job_config import Optimizer


def checkpoint_bytes(model: ModelWrapper, **kw) -> int:
    _, weights, state = checkpoint_sizes(model, **kw)
    return weights + state


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False))


def test_float32_moments_are_two_weight_sized_copies():
    model = _model()
    weights = (8 * 16 + 16 * 4) * 4
    opts = OptimizersContainer([model], Optimizer(implementation="for-loop"))
    assert optimizer_state_itemsize(opts) is None
    assert checkpoint_bytes(ModelWrapper([model])) == 3 * weights
    assert checkpoint_sizes(ModelWrapper([model])) == (8 * 16 + 16 * 4, weights, 2 * weights)


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


def test_save_steps_are_the_interval_the_first_step_and_the_last():
    assert list(save_steps(0, 10, 4)) == [4, 8, 10]
    assert list(save_steps(0, 8, 4)) == [4, 8]
    assert list(save_steps(0, 3, 1, first_step=True)) == [1, 2, 3]
    assert list(save_steps(0, 10, 100, first_step=True)) == [1, 10]
    assert list(save_steps(5, 12, 4)) == [8, 12]  # resumed at step 5
    assert list(save_steps(8, 8, 4)) == []  # nothing left to train
    assert len(save_steps(0, 10**6, 500)) == 2000
    assert list(save_steps(0, 4, 1, first_step=True)) == [1, 2, 3, 4]  # step 1 once
    assert list(save_steps(3, 7, 2)[::2]) == [4, 7]


def test_a_run_of_billions_of_steps_is_counted_without_listing_them():
    """``--training.steps 100000000000 --checkpoint.interval 1`` once hung the start-up
    building a set of every save step (and ran the host out of memory)."""
    saves = save_steps(0, 10**11, 1, first_step=True)
    assert len(saves) == 10**11 and saves[0] == 1 and saves[-1] == 10**11 and saves[5] == 6
    gib = 1024**3
    assert first_failing_save(10 * gib, len(saves), gib, gib, 0, 0) == 10
    assert first_failing_save(10 * gib, len(saves), gib, gib, 9, 0) is None


def _simulated(free, sizes, keep_latest_k, existing):
    window = len(sizes) if keep_latest_k <= 0 else max(1, keep_latest_k + 1 - existing)
    held = 0
    for i, size in enumerate(sizes):
        held += size - (sizes[i - window] if i >= window else 0)
        if held > free:
            return i
    return None


def test_the_counted_first_failing_save_is_the_simulated_one():
    for count in range(1, 7):
        for size, last in ((4, 4), (4, 1), (4, 9), (0, 3)):
            sizes = [size] * (count - 1) + [last]
            for free in range(0, 30):
                for k in range(0, 5):
                    for existing in range(0, 3):
                        assert first_failing_save(free, count, size, last, k, existing) == \
                            _simulated(free, sizes, k, existing), (count, size, last, free, k)


def _uniform(sizes):
    return len(sizes), sizes[0], sizes[-1]


def test_the_first_save_that_does_not_fit():
    gib = 1024**3
    sizes = [gib] * 5
    # keep all: every save stays
    assert first_failing_save(5 * gib, *_uniform(sizes), keep_latest_k=0, existing=0) is None
    assert first_failing_save(int(2.5 * gib), *_uniform(sizes), keep_latest_k=0, existing=0) == 2
    # keep the latest k: k + 1 at once (the newest stays until the next is complete)
    assert first_failing_save(2 * gib, *_uniform(sizes), keep_latest_k=1, existing=0) is None
    assert first_failing_save(int(1.5 * gib), *_uniform(sizes), keep_latest_k=1, existing=0) == 1
    assert first_failing_save(3 * gib, *_uniform(sizes), keep_latest_k=3, existing=0) == 3
    # checkpoints already in the folder count towards k and get deleted as new ones come
    assert first_failing_save(gib, *_uniform(sizes), keep_latest_k=2, existing=3) is None
    assert first_failing_save(3 * gib, *_uniform(sizes), keep_latest_k=3, existing=1) is None
    assert first_failing_save(2 * gib, *_uniform(sizes), keep_latest_k=3, existing=1) == 2
    assert first_failing_save(gib, *_uniform(sizes), keep_latest_k=3, existing=1) == 1
    # a small last save (model only) fits where a full one would not
    assert first_failing_save(3 * gib, *_uniform([gib, gib, gib // 4]), keep_latest_k=0, existing=0) is None
    assert first_failing_save(int(0.5 * gib), *_uniform([gib]), keep_latest_k=0, existing=0) == 0


def test_warnings_name_the_save_that_would_fail(tmp_path, monkeypatch, caplog):
    """Said at start-up: the first save that runs out of room, whether the folder cannot hold
    one checkpoint, the newest one plus the next, or every checkpoint a keep-all run writes."""
    import logging
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    gib = 1024**3
    cases = [
        (gib // 2, [5, 10], 1, None, "has 512 MiB free, less than one checkpoint (~1.0 GiB: "
         "weights + optimizer state); the save at step 5 will fail"),
        (3 * gib // 2, [5, 10], 1, None, "room for one checkpoint (~1.0 GiB) but not two: the "
         "save at step 10 will fail"),
        (3 * gib, list(range(2, 21, 2)), 0, None, "this run saves 10 checkpoints of ~1.0 GiB "
         "(steps 2, 4, ..., 20) and keeps them all (checkpoint.keep_latest_k=0), but "
         f"{tmp_path} has 3.0 GiB free: the save at step 8 will fail with 'no space left'"),
        (3 * gib, [4, 8, 12, 16], 3, None, "(steps 4, 8, 12, 16) and keeps the latest 3 "
         "(checkpoint.keep_latest_k), but"),
        (3 * gib, [2, 4, 6], 0, gib // 2, None),  # the last save holds only the model
        (3 * gib, [5, 10], 1, None, None),
    ]
    for free, saves, keep, last, needle in cases:
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: usage(4 * gib, 0, free))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="torchtitan"):
            warn_if_short(str(tmp_path), gib, saves, keep, existing=0, last_bytes=last)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        if needle is None:
            assert warnings == [], warnings
            assert f"one checkpoint is ~1.0 GiB; this run saves {len(saves)} checkpoints" in caplog.text
        else:
            assert len(warnings) == 1 and needle in warnings[0], warnings
