"""Validation loop: mean token loss over a finite validation set."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed.utils import dist_reduce


class Validator:
    """Runs the model over a validation dataloader every ``freq`` steps."""

    def __init__(
        self,
        build_dataloader: Callable[[], Iterable],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        freq: int,
        steps: int,
        device: torch.device,
        dp_mesh: DeviceMesh | None,
        train_context: Callable,
    ) -> None:
        self.build_dataloader = build_dataloader
        self.loss_fn = loss_fn
        self.freq = freq
        self.steps = steps
        self.device = device
        self.dp_mesh = dp_mesh
        self.train_context = train_context

    def should_validate(self, step: int) -> bool:
        return step % self.freq == 0

    @torch.no_grad()
    def validate(self, model_parts: list[nn.Module]) -> float:
        """Mean loss per valid token over ``steps`` batches (or the whole set when steps == -1)."""
        model = model_parts[0]
        for part in model_parts:
            part.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        # Each dp rank may hold a different number of batches, so every rank keeps stepping
        # until all are exhausted (a rank out of data contributes nothing).
        iterator = iter(self.build_dataloader())
        step = 0
        while self.steps < 0 or step < self.steps:
            batch = next(iterator, None)
            if not self._any_rank_has(batch is not None):
                break
            step += 1
            if batch is None:
                continue
            inputs, labels = (t.to(self.device) for t in batch)
            with self.train_context():
                pred = model(inputs)
                loss_sum += self.loss_fn(pred, labels).double()
            tokens += (labels != IGNORE_INDEX).sum()
        for part in model_parts:
            part.train()
        total_loss = dist_reduce(loss_sum, "sum", self.dp_mesh)
        total_tokens = dist_reduce(tokens, "sum", self.dp_mesh)
        return total_loss / max(total_tokens, 1.0)

    def _any_rank_has(self, has_batch: bool) -> bool:
        if self.dp_mesh is None:
            return has_batch
        return dist_reduce(float(has_batch), "max", self.dp_mesh) > 0
