"""Shared by every checkpoint module: the error type, state names, the model wrapper and the
small process-group helpers (each a no-op without an initialised process group)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
TRAIN_STATE = "train_state"

EXPORT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names the folder and what to do."""


class ModelWrapper(Stateful):
    """All model parts as one Stateful with a single FQN-keyed state dict."""

    def __init__(self, model_parts: list[nn.Module] | nn.Module):
        self.model_parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.model_parts:
            merged.update(get_model_state_dict(part))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.model_parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full (unsharded) tensors, sharding them like each part's parameters."""
        opts = StateDictOptions(full_state_dict=True, strict=False)
        for part in self.model_parts:
            keys = set(get_model_state_dict(part))
            set_model_state_dict(part, {k: v for k, v in state_dict.items() if k in keys}, options=opts)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    from torchtitan.distributed.utils import world_size_from_env

    return world_size_from_env()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (identity without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(error: str | None) -> None:
    """Raise CheckpointError on every rank if any rank has an ``error`` (keeps ranks in step:
    a rank must never enter a collective that another rank skipped after an error)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        first = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
        if first is None:
            return
        if error is not None:
            raise CheckpointError(error)
        bad_rank, msg = first
        raise CheckpointError(f"rank {bad_rank}: {msg}")
    if error is not None:
        raise CheckpointError(error)


# DCP warns on every single-process save/load that it assumes one process; we pass no_dist on
# purpose. A process-wide filter, because async saves run in a background thread.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """The same filter, scoped (survives frameworks that reset the process-wide filters)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield
