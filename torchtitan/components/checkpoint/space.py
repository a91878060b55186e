"""Start-up checks of the checkpoint folder: found before the first step, not at the first save.

* the folder must be creatable and writable (a probe file is written and removed by rank 0;
  every rank gets the same one-line error);
* its free space is compared with what the run's saves will hold at once: an estimate of one
  checkpoint (the model's weights in their dtype plus the optimizer's state, two tensors of
  the weights' size for Adam/AdamW) times the checkpoints the run writes and keeps together
  (``keep_latest_k``, and the newest is kept until the next one is complete). A warning names
  the save that would fail with "no space left".
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from torchtitan.components.checkpoint.common import ModelWrapper, agree, rank
from torchtitan.tools.logging import byte_size, logger

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


def checkpoint_sizes(model: ModelWrapper, optimizer_copies: int = OPTIMIZER_COPIES,
                     state_itemsize: int | None = None) -> tuple[int, int, int]:
    """(elements, weight bytes, optimizer-state bytes) of one full checkpoint of ``model``
    (all ranks, all pipeline stages): each weight in its dtype plus ``optimizer_copies`` tensors
    of its shape in ``state_itemsize`` bytes per element (None: the weight's own, as torch's
    Adam keeps them). A collective when several ranks run."""
    mine: dict[str, tuple[int, int, int]] = {}
    for part in model.model_parts:
        for name, p in part.named_parameters():
            n = p.numel()  # DTensor: the global numel
            mine[name] = (n, n * p.element_size(),
                          n * optimizer_copies * (state_itemsize or p.element_size()))
    merged: dict[str, Any] = dict(mine)
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        for d in everyone:
            merged.update(d or {})
    elements, weights, state = (sum(v[i] for v in merged.values()) for i in range(3))
    return int(elements), int(weights), int(state)


def optimizer_state_itemsize(optimizers: Any) -> int | None:
    """Bytes per element of the optimizers' moments when they are not the weights' dtype
    (``optimizer.state_dtype``), else None."""
    for opt in getattr(optimizers, "optimizers", None) or ():
        dtype = getattr(opt, "state_dtype", None)
        if dtype is not None:
            return dtype.itemsize
    return None


class SaveSteps(Sequence[int]):
    """The steps a run saves at, in order, without listing them (a run may have billions)."""

    def __init__(self, first: bool, every: range, last: int | None):
        self._first, self._every, self._last = first, every, last

    def __len__(self) -> int:
        return int(self._first) + len(self._every) + int(self._last is not None)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        if self._first:
            if i == 0:
                return 1
            i -= 1
        return self._every[i] if i < len(self._every) else self._last


def save_steps(start: int, last: int, interval: int, first_step: bool = False) -> SaveSteps:
    """The steps after ``start`` up to ``last`` that save: every ``interval``-th, step 1 when
    ``first_step`` (``checkpoint.enable_first_step_checkpoint``), and the last."""
    every = range((start // interval + 1) * interval, last + 1, interval)
    first = first_step and start < 1 <= last and not (every and every[0] == 1)
    end = last if last > start and not (every and every[-1] == last) else None
    return SaveSteps(first, every, end)


def first_failing_save(free: int, count: int, size: int, last_size: int, keep_latest_k: int,
                       existing: int) -> int | None:
    """Index of the first of this run's ``count`` saves (``size`` bytes each, the last
    ``last_size``) that would not fit in ``free`` bytes, or None; counted, not simulated.
    With ``keep_latest_k`` = k > 0 a save is complete before the checkpoints beyond k are
    deleted, so k + 1 coexist; ``existing`` complete checkpoints in the folder count towards
    k (their bytes are not in ``free``); with k = 0 every save stays."""
    if count <= 0:
        return None
    window = count if keep_latest_k <= 0 else max(1, keep_latest_k + 1 - existing)
    # Before the last save, the i-th (from 0) holds min(i + 1, window) full checkpoints.
    fitting = free // size if size > 0 else count
    if fitting < min(window, count - 1):
        return fitting
    if (min(count, window) - 1) * size + last_size > free:
        return count - 1
    return None


def warn_if_short(folder: str, estimate: int, saves: Sequence[int], keep_latest_k: int = 0,
                  existing: int = 0, last_bytes: int | None = None) -> None:
    """Rank 0: warn when ``folder``'s file system cannot hold the checkpoints this run writes
    (at ``saves``, ``estimate`` bytes each, the last ``last_bytes`` when it holds only the
    model) and keeps at once; otherwise one info line with the figures."""
    if rank() != 0 or not saves:
        return
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    last = estimate if last_bytes is None else last_bytes
    failing = first_failing_save(free, len(saves), estimate, last, keep_latest_k, existing)
    kept = ("keeps them all (checkpoint.keep_latest_k=0)" if keep_latest_k <= 0
            else f"keeps the latest {keep_latest_k} (checkpoint.keep_latest_k)")
    count = f"{len(saves)} checkpoint{'s' if len(saves) > 1 else ''}"
    if failing is None:
        logger.info(
            f"Checkpoint: one checkpoint is ~{byte_size(estimate)}; this run saves {count} "
            f"and {kept}; {byte_size(free)} free in {folder}"
        )
        return
    step = saves[failing]
    if failing == 0:
        logger.warning(
            f"Checkpoint: {folder} has {byte_size(free)} free, less than one checkpoint "
            f"(~{byte_size(estimate if len(saves) > 1 else last)}: weights + optimizer state); the save at step {step} will "
            "fail with 'no space left' unless space is freed (older checkpoints are never touched)"
        )
    elif keep_latest_k == 1 and existing == 0 and failing == 1:
        logger.warning(
            f"Checkpoint: {folder} has {byte_size(free)} free, room for one checkpoint "
            f"(~{byte_size(estimate)}) but not two: the save at step {step} will fail with 'no "
            "space left', since a checkpoint is kept until the next one is complete"
        )
    else:
        logger.warning(
            f"Checkpoint: this run saves {count} of ~{byte_size(estimate)} (steps "
            f"{_steps_text(saves)}) and {kept}, but {folder} has "
            f"{byte_size(free)} free: the save at step {step} will fail with 'no space left' "
            "(older checkpoints are never touched); free space, raise checkpoint.interval or "
            "set checkpoint.keep_latest_k"
        )


def _steps_text(saves: list[int]) -> str:
    if len(saves) <= 4:
        return ", ".join(map(str, saves))
    return f"{saves[0]}, {saves[1]}, ..., {saves[-1]}"
