"""Start-up checks of the checkpoint folder: found before the first step, not at the first save.

* the folder must be creatable and writable (a probe file is written and removed by rank 0;
  every rank gets the same one-line error);
* its free space is compared with an estimate of one checkpoint (the model's weights in their
  dtype plus the optimizer's state, two tensors of the weights' size for Adam/AdamW): a
  warning when it is short, since the first save would then fail with "no space left".
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch.distributed as dist

from torchtitan.components.checkpoint.common import ModelWrapper, agree, rank
from torchtitan.tools.logging import logger

OPTIMIZER_COPIES = 2
"""Adam/AdamW keep two tensors (exp_avg, exp_avg_sq) per weight."""


def check_writable(folder: str) -> None:
    """Raise CheckpointError on every rank unless rank 0 can create ``folder`` and write in it."""
    error = None
    if rank() == 0:
        probe = os.path.join(folder, f".write-test-{os.getpid()}")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as err:
            from torchtitan.components.checkpoint.integrity import describe_os_error

            error = (
                f"the checkpoint folder {folder} is not writable: {describe_os_error(err)}; fix "
                "job.dump_folder / checkpoint.folder or the permissions (checked before training "
                "so the first save does not fail)"
            )
    agree(error)


def checkpoint_bytes(model: ModelWrapper, optimizer_copies: int = OPTIMIZER_COPIES,
                     state_itemsize: int | None = None) -> int:
    """Estimated size of one full checkpoint of ``model`` (all ranks, all pipeline stages):
    each weight plus ``optimizer_copies`` tensors of its shape, in ``state_itemsize`` bytes
    per element (None: the weight's own, as torch's Adam keeps them)."""
    mine: dict[str, int] = {}
    for part in model.model_parts:
        for name, p in part.named_parameters():
            state = optimizer_copies * (state_itemsize or p.element_size())
            mine[name] = p.numel() * (p.element_size() + state)  # DTensor: the global numel
    merged: dict[str, Any] = dict(mine)
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        for d in everyone:
            merged.update(d or {})
    return int(sum(merged.values()))


def optimizer_state_itemsize(optimizers: Any) -> int | None:
    """Bytes per element of the optimizers' moments when they are not the weights' dtype
    (``optimizer.state_dtype``), else None."""
    for opt in getattr(optimizers, "optimizers", None) or ():
        dtype = getattr(opt, "state_dtype", None)
        if dtype is not None:
            return dtype.itemsize
    return None


def warn_if_short(folder: str, estimate: int) -> None:
    """Rank 0: warn when ``folder``'s file system has less room than two checkpoints (the
    newest one stays until the next is complete)."""
    if rank() != 0:
        return
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    gib = 1024**3
    if free < estimate:
        logger.warning(
            f"Checkpoint: {folder} has {free / gib:.2f} GiB free, less than one checkpoint "
            f"(~{estimate / gib:.2f} GiB: weights + optimizer state); saves will fail with "
            "'no space left' unless space is freed (older checkpoints are never touched)"
        )
    elif free < 2 * estimate:
        logger.warning(
            f"Checkpoint: {folder} has {free / gib:.2f} GiB free, room for one checkpoint "
            f"(~{estimate / gib:.2f} GiB) but not two: the second save will fail with 'no space "
            "left', since a checkpoint is kept until the next one is complete"
        )
    else:
        logger.info(
            f"Checkpoint: one checkpoint is ~{estimate / gib:.2f} GiB; {free / gib:.1f} GiB free in {folder}"
        )
