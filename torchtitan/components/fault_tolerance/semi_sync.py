"""Semi-synchronous training across replica groups: torchft's LocalSGD and DiLoCo.

Each group takes ``sync_steps`` optimizer steps on its own data without talking to the others;
then the groups form a quorum and synchronise:

* ``local_sgd``: the parameters are averaged over the groups.
* ``diloco``: the pseudo-gradient (parameters at the last sync minus now) is averaged and the
  outer optimizer (SGD with Nesterov momentum, ``outer_lr`` / ``outer_momentum``) applies it to
  the parameters of the last sync. With several fragments (``num_fragments``, see
  ``fragments``) one fragment does so every ``sync_steps / num_fragments`` steps, in turn.

Both hook the optimizer step: torchft registers them on a ``torch.optim.Optimizer``, so the
Trainer's step (all optimizers of all model parts, the LR schedules...) runs inside
:class:`_HookedStep`, an optimizer whose ``step`` is that function.

Checkpoints hold the position in the sync interval and, for DiLoCo, the parameters of the last
sync and the outer momentum (as DTensors shaped like the parameters, so they reshard), so a
full restart continues the interval exactly. A run that starts from weights without that state
(a seed checkpoint, HF weights, a synchronous run's checkpoint) starts a new interval from them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchtitan.components.fault_tolerance.fragments import (
    PLACEHOLDER,
    ROUTING_BIASES,
    build_fragments,
)
from torchtitan.components.fault_tolerance.live_state import to_local
from torchtitan.config.job_config import FaultTolerance as FTConfig
from torchtitan.distributed.comm_mode.local_tensor_load import checkpoint_fqn
from torchtitan.tools.logging import logger

LOCAL_STEP, ORIGINAL, OUTER_MOMENTUM = "local_step", "original_parameters", "outer_momentum"

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
        self, manager: Any, cfg: FTConfig, model_parts: list[nn.Module],
        step_fn: Callable[[], Any], units_per_fragment: list[list[str]],
        after_sync: Callable[[], None] | None = None,
    ) -> None:
        from torchft.local_sgd import DiLoCo, LocalSGD

        self.fragments = fragments = build_fragments(model_parts, units_per_fragment)
        params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
        # (fragment, torchft's name, checkpoint FQN, parameter) of every trained parameter and
        # routing bias
        self._named = [
            (f, name, _checkpoint_key(fragment, name), p)
            for f, fragment in enumerate(fragments)
            for name, p in fragment.named_parameters()
            if (p.requires_grad or name.startswith(f"{ROUTING_BIASES}.")) and name != PLACEHOLDER
        ]
        self._hooked = _HookedStep(params, step_fn)
        self._after_sync = after_sync
        self._cfg = cfg
        self._restored = False
        self.outers: list[torch.optim.SGD] = []
        if cfg.semi_sync_method == "local_sgd":
            (model,) = fragments
            self.algorithm = LocalSGD(manager, model, self._hooked, sync_every=cfg.sync_steps)
        else:
            momentum = cfg.outer_momentum
            self.outers = [
                torch.optim.SGD(
                    fragment.parameters(), lr=cfg.outer_lr, momentum=momentum,
                    nesterov=momentum > 0,
                )
                for fragment in fragments
            ]
            self.algorithm = DiLoCo(
                manager, fragments, self._hooked, self.outers, sync_every=cfg.sync_steps,
                pin_memory=torch.cuda.is_available(),
                fragment_sync_delay=cfg.fragment_sync_delay,
                fragment_update_alpha=cfg.fragment_update_alpha,
                should_quantize=cfg.should_quantize,
            )
        self.algorithm.__enter__()  # registers its optimizer hooks; removed in close()
        n = len(fragments)
        logger.info(
            f"Fault tolerance: {cfg.semi_sync_method}, groups synchronise every "
            f"{cfg.sync_steps} steps"
            + (f", one of {n} fragments every {cfg.sync_steps // n} steps" if n > 1 else "")
        )

    def step(self) -> Any:
        """The optimizer step, then (every ``sync_steps / num_fragments`` steps) the sync that
        torchft runs in the step's post-hook; ``after_sync`` follows a sync (torchft restarts
        its step count there), e.g. to recompute float8 scales of the new weights."""
        self._hooked.step()
        if self._after_sync is not None and self.algorithm._local_step == 0:
            self._after_sync()
        return self._hooked.result

    def close(self) -> None:
        self.algorithm.__exit__(None, None, None)

    # --- checkpoints ----------------------------------------------------------------------
    # torchft keeps this state in private attributes (``_local_step``, the fragment's
    # ``original_parameters``); tests/integration/test_fault_tolerance.py resumes mid-interval
    # and fails if they move.
    def state_dict(self) -> dict[str, Any]:
        """The position in the sync interval; DiLoCo: the last sync's parameters and the
        outer momentum (zeros before the first sync: the same first outer step)."""
        state: dict[str, Any] = {LOCAL_STEP: torch.tensor(self.algorithm._local_step)}
        if not self.outers:
            return state
        fragments = self.algorithm._fragments
        state[ORIGINAL] = {
            fqn: _like(p, fragments[f].original_parameters[name])
            for f, name, fqn, p in self._named
        }
        momentum = {}
        for f, _, fqn, p in self._named:
            buf = self.outers[f].state.get(p, {}).get("momentum_buffer")
            momentum[fqn] = buf if buf is not None else torch.zeros_like(p.detach())
        state[OUTER_MOMENTUM] = momentum
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        local_step = int(state[LOCAL_STEP])
        # torchft's counter runs to sync_steps / num_fragments (one fragment sync each time)
        interval = getattr(self.algorithm, "_sync_every", self._cfg.sync_steps)
        delay = self._cfg.fragment_sync_delay
        if local_step >= interval or (delay and local_step >= interval - delay):
            # saved while a sync's all-reduce was in flight, which a checkpoint cannot hold,
            # or with a longer interval: every group (a full restart loads the same
            # checkpoint) restarts the interval
            logger.warning(
                f"Fault tolerance: the checkpoint was saved {local_step} steps into a sync "
                f"interval, which cannot continue in a {interval}-step interval with "
                f"fragment_sync_delay={delay}; the interval starts again from the last sync's "
                "parameters"
            )
            local_step = 0
        self.algorithm._local_step = local_step
        if self.outers:
            fragments = self.algorithm._fragments
            with torch.no_grad():
                for f, name, fqn, p in self._named:
                    fragments[f].original_parameters[name].copy_(to_local(state[ORIGINAL][fqn]))
                    self.outers[f].state[p]["momentum_buffer"] = state[OUTER_MOMENTUM][fqn]
        self._restored = True

    def after_checkpoint_load(self) -> None:
        """Weights loaded without semi-sync state start a new interval (DiLoCo measures the
        next pseudo-gradient from them, not from the weights before the load)."""
        if self.outers and not self._restored:
            self.algorithm._save_parameters()


def _checkpoint_key(fragment: nn.Module, name: str) -> str:
    """A fragment parameter's model FQN without AC / compile wrapper names (a routing bias:
    its buffer's)."""
    if name.startswith(f"{ROUTING_BIASES}."):
        name = fragment.get_submodule(ROUTING_BIASES).fqns[name.split(".", 1)[1]]
    return checkpoint_fqn(name)


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a shard, kept on the CPU by torchft) as a tensor laid out like ``param``: on
    its device, a DTensor when it is one."""
    from torch.distributed.tensor import DTensor

    local = local.to(to_local(param).device)
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(),
        run_check=False,
    )
