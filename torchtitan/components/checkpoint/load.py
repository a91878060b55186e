"""Loading checkpoints: the shared model shape check, and DCP loading with resharding into the
current layout (which checkpoint to load is :mod:`load_plan`).

Every rank checks the checkpoint's index against its own state before reading any tensor, and
all ranks agree on errors so a job fails cleanly instead of hanging.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.checkpoint.common import (
    DATALOADER,
    MODEL,
    CheckpointError,
    ModelWrapper,
    agree,
    quiet_dcp,
    rank,
)
from torchtitan.components.checkpoint.integrity import first_line, is_fatal_interrupt
from torchtitan.tools.logging import logger

Shape = tuple[int, ...]


def tensor_shapes(state_dict: Mapping[str, Any]) -> dict[str, Shape | None]:
    """``FQN -> shape`` of a (possibly sharded: global shapes) state dict; None for non-tensors."""
    return {k: tuple(v.shape) if torch.is_tensor(v) else None for k, v in state_dict.items()}


def check_model_shapes(
    expected: Mapping[str, Shape | None], held: Mapping[str, Shape | None], source: str
) -> None:
    """Raise one CheckpointError line unless checkpoint ``source`` holds every key of
    ``expected`` (the model's ``FQN -> shape``) with that shape. ``held`` maps the checkpoint's
    keys to their shapes. None on either side: not a tensor, only its presence is checked.
    Extra keys in ``held`` are ignored. Used for DCP and HF loads alike."""
    missing = [k for k in expected if k not in held]
    if missing:
        raise CheckpointError(
            f"{source} has no weights for {missing[:3]} ({len(missing)} of {len(expected)} "
            "missing): it was saved from a different model; check model.name/flavor"
        )
    for key, want in expected.items():
        have = held[key]
        if have is not None and want is not None and tuple(have) != tuple(want):
            raise CheckpointError(
                f"{source}: {key} has shape {tuple(have)} but the model expects {tuple(want)}; "
                "check model.flavor (and the tokenizer's vocab size)"
            )


# --- DCP --------------------------------------------------------------------------------------


def read_dcp_metadata(path: str) -> Any:
    """DCP ``Metadata`` of checkpoint folder ``path`` (``state_dict_metadata``: key -> meta)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path).read_metadata()


def dcp_shapes(metadata: Any) -> dict[str, Shape | None]:
    """``key -> shape`` of a DCP checkpoint's index (None for non-tensor entries)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        k: tuple(m.size) if isinstance(m, TensorStorageMetadata) else None
        for k, m in metadata.state_dict_metadata.items()
    }


NON_MODEL_PREFIXES = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")


def dcp_model_keys(metadata: Any, extra_non_model: Iterable[str] = ()) -> list[str]:
    """Keys of ``metadata`` that hold model weights (tensors outside the non-model states)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefixes = NON_MODEL_PREFIXES + tuple(f"{p}." for p in extra_non_model)
    return [
        k
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and not k.startswith(prefixes)
    ]


def load_dcp_model_tensors(
    path: str, dtype: torch.dtype | None = None, extra_non_model: Iterable[str] = ()
) -> dict[str, torch.Tensor]:
    """Read every model weight of a DCP checkpoint into full CPU tensors (one process, no PG)."""
    metadata = read_dcp_metadata(path)
    meta = metadata.state_dict_metadata
    keys = dcp_model_keys(metadata, extra_non_model)
    sd = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in keys}
    if not sd:
        raise ValueError(f"{path} holds no model weights")
    with quiet_dcp():
        dcp.load(sd, checkpoint_id=path, no_dist=True)
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    return sd


def _flat_keys(state: Any, prefix: str) -> list[str]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict({prefix: state})
    return list(flat)


def _drop_absent_optional(obj: Stateful, state_name: str, meta: Mapping[str, Any]) -> dict[str, Any]:
    """``obj``'s state dict without the entries it lists in ``optional_state_keys`` that the
    checkpoint lacks (in whole or part): such entries are not loaded, and ``obj`` sees them
    missing (e.g. per-rank RNG states saved by another number of ranks)."""
    template = obj.state_dict()
    for key in getattr(obj, "optional_state_keys", ()):
        if key in template and any(
            k not in meta for k in _flat_keys(template[key], f"{state_name}.{key}")
        ):
            del template[key]
    return template


def dataloader_mismatch(name: str, detail: str) -> str:
    return (
        f"{name}: the saved dataloader state does not fit this run ({detail}); resume with "
        "--checkpoint.exclude_from_loading dataloader to restart the data stream"
    )


def load_dcp(
    path: str,
    model: ModelWrapper,
    states: Mapping[str, Stateful],
    exclude: list[str],
    model_only: bool,
) -> list[str]:
    """Load DCP checkpoint ``path`` into ``model`` and ``states`` (resharding as needed), except
    the ``exclude``d names (and every state but the model when ``model_only``). Returns the
    names loaded. Every rank must call it; an error on any rank raises on all."""
    error: str | None = None
    try:
        sd, loaded, to_load = _load_template(path, model, states, exclude, model_only)
    except CheckpointError as err:
        error, sd, loaded, to_load = str(err), {}, [], []
    agree(error)
    if not sd:
        return loaded
    try:
        with quiet_dcp():
            dcp.load(sd, checkpoint_id=path, no_dist=not dist.is_initialized())
    except BaseException as err:  # DCP's CheckpointException is a BaseException, many lines
        if is_fatal_interrupt(err):
            raise
        raise CheckpointError(f"loading {path} failed: {first_line(err)}") from None
    if MODEL in loaded:
        model.load_state_dict({k: v for k, v in sd.items() if k not in states})
    name = os.path.basename(path)
    for state_name in to_load:
        try:
            states[state_name].load_state_dict(sd[state_name])
        except ValueError as err:
            if state_name == DATALOADER:
                error = dataloader_mismatch(name, str(err))
            else:
                error = (
                    f"{path}: cannot restore {state_name}: {err}; skip it with "
                    f"--checkpoint.exclude_from_loading {state_name}"
                )
            break
        loaded.append(state_name)
    agree(error)
    return loaded


def _load_template(
    path: str,
    model: ModelWrapper,
    states: Mapping[str, Stateful],
    exclude: list[str],
    model_only: bool,
) -> tuple[dict[str, Any], list[str], list[str]]:
    """The state dict to load into, after checking it against the checkpoint's metadata."""
    try:
        metadata = read_dcp_metadata(path)
    except Exception as err:  # noqa: BLE001 - any read failure is a bad checkpoint
        raise CheckpointError(f"cannot read the DCP metadata of {path}: {err}") from err
    meta = metadata.state_dict_metadata
    name = os.path.basename(path)
    sd: dict[str, Any] = {}
    loaded: list[str] = []
    if MODEL not in exclude:
        model_sd = model.state_dict()
        check_model_shapes(tensor_shapes(model_sd), dcp_shapes(metadata), path)
        sd.update(model_sd)
        loaded.append(MODEL)
    elif rank() == 0:
        logger.info(f"Checkpoint: not loading {MODEL} (checkpoint.exclude_from_loading)")
    to_load: list[str] = []
    fresh: list[str] = []
    skipped: list[str] = []
    for state_name, obj in states.items():
        if state_name in exclude:
            if rank() == 0:
                logger.info(f"Checkpoint: not loading {state_name} (checkpoint.exclude_from_loading)")
            continue
        if model_only:
            skipped.append(state_name)
            continue
        if not any(k.startswith(state_name + ".") for k in meta):
            fresh.append(state_name)
            continue
        template = _drop_absent_optional(obj, state_name, meta)
        missing = [k for k in _flat_keys(template, state_name) if k not in meta]
        if missing:
            if state_name == DATALOADER:
                raise CheckpointError(dataloader_mismatch(name, f"it has no {missing[0]!r}"))
            raise CheckpointError(
                f"{path}: the saved {state_name} state does not match this run (no "
                f"{missing[0]!r}); skip it with --checkpoint.exclude_from_loading {state_name}"
            )
        sd[state_name] = template
        to_load.append(state_name)
    if rank() == 0 and fresh:
        older = _older_full_step(path)
        logger.warning(
            f"Checkpoint: {name} has no {', '.join(fresh)} state (a model-only save); "
            "these start fresh"
            + (f" (step-{older} beside it holds them: --checkpoint.load_step {older} resumes "
               "from there)" if older is not None else "")
        )
    if rank() == 0 and skipped:
        logger.info(
            f"Checkpoint: loading model weights only (checkpoint.initial_load_model_only); "
            f"{', '.join(skipped)} start fresh"
        )
    return sd, loaded, to_load


def _older_full_step(path: str) -> int | None:
    """The newest complete step older than ``path`` in the same folder that is no model-only
    save (its commit marker says so), or None."""
    from torchtitan.components.checkpoint import fs

    folder, here = os.path.split(os.path.normpath(path))
    entries = fs.scan_checkpoints(folder)
    step = next((e.step for e in entries if os.path.basename(e.path) == here), None)
    if step is None:
        return None
    older = [e.step for e in entries if e.step < step and e.complete
             and e.marker is not None and e.marker.get("model_only") is False]
    return older[-1] if older else None
