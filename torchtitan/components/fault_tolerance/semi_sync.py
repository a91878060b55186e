"""Semi-synchronous training across replica groups: torchft's LocalSGD and DiLoCo.

Each group takes ``sync_steps`` optimizer steps on its own data without talking to the others;
then the groups form a quorum and synchronise:

* ``local_sgd``: the parameters are averaged over the groups.
* ``diloco``: the pseudo-gradient (parameters at the last sync minus now) is averaged and the
  outer optimizer (SGD with Nesterov momentum, ``outer_lr`` / ``outer_momentum``) applies it to
  the parameters of the last sync.

Both hook the optimizer step: torchft registers them on a ``torch.optim.Optimizer``, so the
Trainer's step (all optimizers of all model parts, the LR schedules...) runs inside
:class:`_HookedStep`, an optimizer whose ``step`` is that function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchtitan.config.job_config import FaultTolerance as FTConfig
from torchtitan.tools.logging import logger

__all__ = ["SemiSync"]


class _HookedStep(torch.optim.Optimizer):
    """An optimizer whose ``step()`` runs ``step_fn``; torch runs its step pre/post hooks
    around it (that is where torchft's LocalSGD / DiLoCo act)."""

    def __init__(self, params: list[nn.Parameter], step_fn: Callable[[], Any]) -> None:
        super().__init__(params, {})
        self._step_fn = step_fn
        self.result: Any = None

    def step(self, closure: Any = None) -> None:  # noqa: ARG002 (torch's signature)
        self.result = self._step_fn()


class SemiSync:
    """The Trainer's optimizer step with LocalSGD or DiLoCo around it."""

    def __init__(
        self, manager: Any, cfg: FTConfig, model_parts: list[nn.Module], step_fn: Callable[[], Any]
    ) -> None:
        from torchft.local_sgd import DiLoCo, LocalSGD

        model = nn.ModuleList(model_parts)  # one fragment: all parts sync together
        params = [p for p in model.parameters() if p.requires_grad]
        self._hooked = _HookedStep(params, step_fn)
        if cfg.semi_sync_method == "local_sgd":
            self.algorithm = LocalSGD(manager, model, self._hooked, sync_every=cfg.sync_steps)
        else:
            outer = torch.optim.SGD(
                params, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True
            )
            self.algorithm = DiLoCo(
                manager, [model], self._hooked, outer, sync_every=cfg.sync_steps,
                pin_memory=torch.cuda.is_available(),
                fragment_sync_delay=cfg.fragment_sync_delay,
                fragment_update_alpha=cfg.fragment_update_alpha,
            )
        self.algorithm.__enter__()  # registers its optimizer hooks; removed in close()
        logger.info(
            f"Fault tolerance: {cfg.semi_sync_method}, groups synchronise every "
            f"{cfg.sync_steps} steps"
        )

    def step(self) -> Any:
        self._hooked.step()
        return self._hooked.result

    def close(self) -> None:
        self.algorithm.__exit__(None, None, None)
