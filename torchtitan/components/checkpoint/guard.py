"""Keep poisoned weights out of checkpoints.

Policy: before every save the largest absolute weight of the whole model (all ranks, all parts)
is measured. The save is *skipped*, with a warning naming the newest safe checkpoint, when it is
non-finite or more than ``GROWTH_LIMIT`` times the value measured when this run started training
(after loading). A healthy run changes its largest weight by a small factor over a whole
training; a diverging one (``--optimizer.lr 1e30``) jumps by many orders of magnitude one step
before its loss turns NaN. So the newest checkpoint on disk is always one a restart can use, and
``keep_latest_k`` never purges a good checkpoint to make room for a poisoned one.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.components.checkpoint.common import ModelWrapper
from torchtitan.tools.logging import logger

GROWTH_LIMIT = 1000.0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class SaveGuard:
    """Measures the model's largest absolute weight; says why a save would be poisoned."""

    def __init__(self, model: ModelWrapper, growth_limit: float = GROWTH_LIMIT) -> None:
        self.model = model
        self.growth_limit = growth_limit
        self.reference: float | None = None
        self.enabled = True

    def max_abs_weight(self) -> float | None:
        """max |w| over every parameter of every rank (``inf`` when any is NaN/inf); None when
        the values cannot be measured (fake tensors, simulated ranks)."""
        if not self.enabled:
            return None
        try:
            from torch._subclasses.fake_tensor import FakeTensor

            local = [
                _local(p.detach())
                for part in self.model.model_parts
                for p in part.parameters()
                if _local(p).numel()
            ]
            if not local or any(isinstance(t, FakeTensor) or t.is_meta for t in local):
                self.enabled = False
                return None
            with torch.no_grad():
                norms = torch._foreach_norm(local, math.inf)
                value = torch.stack([n.float().cpu() for n in norms]).max()
            value = value if torch.isfinite(value) else torch.tensor(math.inf)
            if dist.is_initialized() and dist.get_world_size() > 1:
                if dist.get_backend() == "fake":
                    self.enabled = False
                    return None
                buf = value.reshape(1).double()
                dist.all_reduce(buf, op=dist.ReduceOp.MAX)
                value = buf[0]
            return float(value)
        except Exception as err:  # noqa: BLE001 - never let the guard break a save
            logger.debug(f"Checkpoint: weight check unavailable: {err}")
            self.enabled = False
            return None

    def start(self) -> None:
        """Take the reference (call once training is about to start, after loading)."""
        self.reference = self.max_abs_weight()

    def problem(self) -> str:
        """Why the current weights must not be saved ("" when they are fine)."""
        value = self.max_abs_weight()
        if value is None:
            return ""
        if self.reference is None or not math.isfinite(self.reference):
            self.reference = value if math.isfinite(value) else None
        if not math.isfinite(value):
            return "the weights are not finite (NaN or inf)"
        ref = self.reference or value
        if ref > 0 and value > self.growth_limit * ref:
            return (
                f"the weights exploded (largest |w| {value:.3g}, {value / ref:.3g}x the {ref:.3g} "
                f"at the start of this run; the limit is {self.growth_limit:g}x)"
            )
        return ""
