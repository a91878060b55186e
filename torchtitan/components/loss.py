"""Losses. The trainer normalises by the global count of valid tokens (see train.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_loss_sum(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in float32; labels equal to ``IGNORE_INDEX`` do not count."""
    return F.cross_entropy(
        pred.flatten(0, 1).float(),
        labels.flatten(0, 1),
        reduction="sum",
        ignore_index=IGNORE_INDEX,
    )


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in float32 over valid labels."""
    return F.cross_entropy(
        pred.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX
    )


def build_cross_entropy_loss(compile_loss: bool = False, backend: str = "inductor") -> Callable:
    """The summed cross-entropy loss, optionally compiled."""
    fn = cross_entropy_loss_sum
    if compile_loss:
        fn = torch.compile(fn, backend=backend)
    return fn
