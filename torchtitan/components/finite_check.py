"""The finite check of the loss and grad norm, run only where the host needs their values.

A step's loss and grad norm stay 0-dim tensors on the device, so the host never waits for the
device between log steps. :class:`FiniteCheck` keeps those of the steps since the last check
and copies them to the host together (one transfer) when the Trainer checks: at log steps
(``metrics.should_log``), before checkpoint saves and validation, at the last step, and every
step under fault tolerance. It reports the first step whose loss or grad norm was not finite,
whichever later step found it; nothing is saved in between, since every save checks first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchtitan.distributed.utils import scalar_values


@dataclass(frozen=True)
class StepFigures:
    """A step's global mean loss and grad norm on the host."""

    step: int
    loss: float
    grad_norm: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


class FiniteCheck:
    """The unchecked steps' loss and grad norm, kept on the device until :meth:`check`."""

    def __init__(self) -> None:
        self._steps: list[int] = []
        self._values: list[torch.Tensor | float] = []
        self.last: StepFigures | None = None
        """The newest checked step's figures (the log line's loss and grad norm)."""

    @property
    def pending(self) -> bool:
        return bool(self._steps)

    def add(self, step: int, loss: torch.Tensor | float, grad_norm: torch.Tensor | float) -> None:
        """Remember step ``step``'s figures (no host copy)."""
        self._steps.append(step)
        self._values += [loss, grad_norm]

    def check(self) -> StepFigures | None:
        """Copy the pending figures to the host and forget them: the first non-finite step's
        figures, or None when all are finite (``last`` then holds the newest step's)."""
        if not self._steps:
            return None
        values = scalar_values(self._values)
        figures = [
            StepFigures(step, values[2 * i], values[2 * i + 1]) for i, step in enumerate(self._steps)
        ]
        self._steps.clear()
        self._values.clear()
        self.last = figures[-1]
        return next((f for f in figures if not f.finite), None)


def non_finite_message(bad: StepFigures, step: int, optimizer_skipped: bool) -> str:
    """The first half of the error line (the Trainer adds where to resume from): what became
    non-finite, at which step, and what happened to the weights since."""
    where = f"loss became {bad.loss} (grad norm {bad.grad_norm}) at step {bad.step}"
    if optimizer_skipped and bad.step == step:
        return f"{where}; the optimizer step was skipped."
    return (
        f"{where}; found at step {step} (the finite check runs at log steps and before saves "
        f"and validation), nothing after step {bad.step - 1} was saved."
    )
