import math

import pytest
import torch

from torchtitan.components.lr_scheduler import build_lr_schedulers, lr_factor
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config.job_config import LRScheduler, Optimizer


def _lrs(cfg: LRScheduler, steps: int, peak: float = 1.0) -> list[float]:
    model = torch.nn.Linear(2, 2)
    opts = build_optimizers([model], Optimizer(lr=peak, implementation="for-loop"))
    scheds = build_lr_schedulers(opts, cfg, steps)
    out = []
    for _ in range(steps):
        out.append(scheds.get_last_lr())
        opts.step()
        scheds.step()
    return out


def test_warmup_then_linear_decay_to_zero():
    lrs = _lrs(LRScheduler(warmup_steps=2, decay_ratio=None, decay_type="linear"), steps=6)
    # warmup: 1/3, 2/3; then decay over the remaining 4 steps: 1, 3/4, 1/2, 1/4
    assert lrs == pytest.approx([1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25])


def test_warmup_stable_decay():
    lrs = _lrs(LRScheduler(warmup_steps=2, decay_ratio=0.5, decay_type="linear"), steps=8)
    # 8 steps: warmup 2, stable until step index 4, decay over the last 4.
    assert lrs == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25])


def test_warmup_and_decay_that_overlap_are_warned(caplog):
    """warmup 3 + decay 0.9 x 4 steps: the decay was cut from 4 steps to 1 without a word."""
    lrs = _lrs(LRScheduler(warmup_steps=3, decay_ratio=0.9, decay_type="linear"), steps=4)
    assert lrs == pytest.approx([1 / 4, 2 / 4, 3 / 4, 1.0])
    assert ("lr_scheduler.warmup_steps=3 + decay_ratio=0.9 x training.steps=4 (4 decay steps) "
            "exceed training.steps: the decay is cut to the 1 step after the warm-up"
            in caplog.text)
    caplog.clear()
    _lrs(LRScheduler(warmup_steps=2, decay_ratio=0.5, decay_type="linear"), steps=8)
    _lrs(LRScheduler(warmup_steps=2, decay_ratio=0.8, decay_type="linear"), steps=1)  # said once
    assert "exceed training.steps" not in caplog.text


def test_min_lr_factor_and_shapes():
    kw = dict(warmup_steps=0, decay_steps=10, training_steps=10, min_lr_factor=0.1)
    assert lr_factor(10, decay_type="linear", **kw) == pytest.approx(0.1)
    assert lr_factor(5, decay_type="linear", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(5, decay_type="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(5, decay_type="sqrt", **kw) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.5)))
    assert lr_factor(2, decay_type="cosine", **kw) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2))
    )


def test_state_dict_roundtrip_restores_lr():
    model = torch.nn.Linear(2, 2)
    opts = build_optimizers([model], Optimizer(lr=1.0, implementation="for-loop"))
    cfg = LRScheduler(warmup_steps=3, decay_ratio=None)
    scheds = build_lr_schedulers(opts, cfg, 10)
    for _ in range(5):
        opts.step()
        scheds.step()
    state = scheds.state_dict()
    model2 = torch.nn.Linear(2, 2)
    opts2 = build_optimizers([model2], Optimizer(lr=1.0, implementation="for-loop"))
    scheds2 = build_lr_schedulers(opts2, cfg, 10)
    scheds2.load_state_dict(state)
    assert scheds2.get_last_lr() == pytest.approx(scheds.get_last_lr())
    assert opts2.param_groups[0]["lr"] == pytest.approx(opts.param_groups[0]["lr"])
