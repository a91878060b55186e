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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.distributed.comm_mode.local_tensor_load import checkpoint_fqn
from torchtitan.distributed.utils import all_finite, scalar_values


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


def _ranks_union(names: list[str]) -> list[str]:
    """``names`` from every rank (each holds its own shards or pipeline stages), in rank
    order without repeats; this rank's alone outside a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return names
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    return list(dict.fromkeys(n for rank in gathered for n in (rank or [])))


def _named(names: list[str], total: int) -> str:
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{len(names)} of {total} parameters ({shown})"


def where_non_finite(model_parts: Sequence[nn.Module], weight_copies: Any,
                     loss_finite: bool, probe: Callable[[], str] | None = None,
                     grads_rescaled: bool = False) -> str:
    """Where the current step's non-finite values are, as one sentence for the error line:
    weights that were already non-finite before the step (a bad checkpoint or initial
    weights), else whether the forward (a non-finite loss from finite weights) or the backward
    (a finite loss; named: the last parameter in model order with a non-finite gradient:
    the backward runs from the output, so it went wrong there or just after) produced them. Run on
    every rank together (the names are gathered); ``weight_copies``: the run's
    :class:`~torchtitan.components.weight_copies.WeightCopies` (their gradients) or None;
    ``probe``: where a forward re-run finds the first non-finite output (a sentence);
    ``grads_rescaled``: clipping rescaled every gradient by the (non-finite) norm."""
    grad_of = weight_copies.grad_of if weight_copies is not None else (lambda p: p.grad)
    params = [(checkpoint_fqn(name), p) for part in model_parts
              for name, p in part.named_parameters()]
    bad_weights = [name for name, p in params if not all_finite(p.detach())]
    bad_grads = [name for name, p in params
                 if (g := grad_of(p)) is not None and not all_finite(g)]
    bad_weights, bad_grads = _ranks_union(bad_weights), _ranks_union(bad_grads)
    total = len(_ranks_union([name for name, _ in params]))
    if bad_weights:
        return f"The weights were already non-finite before this step: {_named(bad_weights, total)}."
    if not loss_finite:
        found = probe() if probe is not None else ""
        return ("The weights were finite, so the forward pass produced it (an overflow or bad "
                "input)." + (f" {found}" if found else ""))
    if bad_grads and grads_rescaled:
        return ("The loss was finite; the backward made the grad norm non-finite, and clipping "
                "rescaled every gradient by it, so they cannot say where (clipping inside the "
                "optimizer step, optimizer.clip_in_step, leaves them as the backward made them).")
    if bad_grads:
        return (f"The loss was finite; the backward made the gradients of "
                f"{_named(bad_grads, total)} non-finite, nearest the output (in model order) "
                f"{bad_grads[-1]}: the backward went wrong there or just after it.")
    return ""


def non_finite_message(bad: StepFigures, step: int, optimizer_skipped: bool, run: Any = None,
                       microbatches: Sequence[Any] = ()) -> str:
    """The first part of the error line (the Trainer adds where to resume from): what became
    non-finite, at which step, what happened to the weights since, and, stopped at that step
    (its gradients are still there) with its ``run`` (:class:`~torchtitan.build.RunParts`)
    and ``microbatches``, where the non-finite values are (:func:`where_non_finite`, a
    collective: every rank stops together)."""
    where = f"loss became {bad.loss} (grad norm {bad.grad_norm}) at step {bad.step}"
    if optimizer_skipped and bad.step == step:
        found = ""
        if run is not None:
            from torchtitan.components.forward_probe import describe_forward
            from torchtitan.step import gradients_rescaled

            found = where_non_finite(
                run.model_parts, run.weight_copies, math.isfinite(bad.loss),
                lambda: describe_forward(run, microbatches), gradients_rescaled(run))
        return f"{where}; the optimizer step was skipped." + (f" {found}" if found else "")
    return (
        f"{where}; found at step {step} (the finite check runs at log steps and before saves "
        f"and validation), nothing after step {bad.step - 1} was saved."
    )
