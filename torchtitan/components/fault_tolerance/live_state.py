"""The state a rejoining replica group receives from a healthy one.

Replica groups have the same layout, so rank ``r`` of one group holds the same shards as rank
``r`` of another: the state travels as plain local tensors (torchft's transports need no
device meshes) and is re-wrapped on arrival into the receiver's own DTensors, using its current
state as the template. It is what a checkpoint holds: model, optimizers, LR schedulers, the
data-stream position (the same on every rank: the rejoined group continues the global stream
where the healthy groups are) and the trainer's step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["LiveState", "OptimizerLiveState", "StateWithout", "like_template", "to_local"]


def to_local(value: Any) -> Any:
    """``value`` with every DTensor replaced by its local shard (nested dicts/lists)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, Mapping):
        return {k: to_local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_local(v) for v in value)
    return value


def like_template(received: Any, template: Any) -> Any:
    """``received`` (local tensors) rebuilt in the shapes of ``template``: a DTensor where the
    template has one (same mesh and placements), tensors moved to the template's device."""
    if isinstance(template, DTensor) and isinstance(received, torch.Tensor):
        local = received.to(template.to_local().device)
        return DTensor.from_local(
            local, template.device_mesh, template.placements,
            shape=template.shape, stride=template.stride(), run_check=False,
        )
    if isinstance(template, torch.Tensor) and isinstance(received, torch.Tensor):
        return received.to(template.device)
    if isinstance(received, Mapping):
        tmpl = template if isinstance(template, Mapping) else {}
        return {k: like_template(v, tmpl.get(k)) for k, v in received.items()}
    if isinstance(received, (list, tuple)):
        tmpl = template if isinstance(template, (list, tuple)) else [None] * len(received)
        return type(received)(like_template(v, t) for v, t in zip(received, tmpl))
    return received


class LiveState:
    """``save()`` / ``load(state)`` of named Stateful parts, for torchft's live recovery."""

    def __init__(self, parts: dict[str, Any], after_load: Callable[[], None] | None = None):
        self.parts = parts
        self.after_load = after_load
        self.loads = 0
        """How many times a peer's state was loaded (the Trainer checks it after a quorum)."""

    def save(self) -> dict[str, Any]:
        return {name: to_local(part.state_dict()) for name, part in self.parts.items()}

    def load(self, state: dict[str, Any]) -> None:
        for name, part in self.parts.items():
            template = getattr(part, "template", part.state_dict)()
            part.load_state_dict(like_template(state[name], template))
        self.loads += 1
        if self.after_load is not None:
            self.after_load()


class OptimizerLiveState:
    """The optimizers' part of the live state: ``{}`` while no optimizer has stepped.

    torch's ``get_optimizer_state_dict`` initialises an empty optimizer state with a zero-lr
    step, which would count as Adam's first step on both sides of a recovery at step 0 (its
    bias correction then differs from a run without fault tolerance).
    """

    def __init__(self, optimizers: Any) -> None:
        self.optimizers = optimizers

    def _fresh(self) -> bool:
        return all(not opt.state for opt in self.optimizers.optimizers)

    def state_dict(self) -> dict[str, Any]:
        return {} if self._fresh() else self.optimizers.state_dict()

    def template(self) -> dict[str, Any]:
        return {} if self._fresh() else self.optimizers.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:  # the peer has not stepped yet: neither have we
            for opt in self.optimizers.optimizers:
                opt.state.clear()
            return
        if self._fresh():  # the DTensor layout of the state to load into
            like = self.optimizers.state_dict()
            state = like_template(to_local(state), like)
        self.optimizers.load_state_dict(state)


class StateWithout:
    """A Stateful's state without some top-level keys (state that travels another way)."""

    def __init__(self, part: Any, *keys: str) -> None:
        self.part, self.keys = part, keys

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.part.state_dict().items() if k not in self.keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.part.load_state_dict(state)
