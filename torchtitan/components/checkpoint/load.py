"""Loading checkpoints: which one to load (the plan), the shared model shape check, and DCP
loading with resharding into the current layout.

Rank 0 plans (scans the folder, logs why) and broadcasts a ``LoadPlan``; every rank then checks
the checkpoint's index against its own state before reading any tensor, and all ranks agree on
errors so a job fails cleanly instead of hanging.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.checkpoint import fs
from torchtitan.components.checkpoint.common import (
    DATALOADER,
    MODEL,
    CheckpointError,
    ModelWrapper,
    agree,
    broadcast,
    quiet_dcp,
    rank,
)
from torchtitan.components.checkpoint.hf_files import check_hf_folder
from torchtitan.components.checkpoint.integrity import first_line, is_fatal_interrupt
from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.tools.logging import logger

Shape = tuple[int, ...]


@dataclass(frozen=True)
class LoadPlan:
    """What ``CheckpointManager.load`` loads, decided on rank 0 and broadcast."""

    path: str
    """A ``step-N`` DCP folder, or an HF safetensors folder/file when ``hf``."""
    step: int | None
    """The step of a checkpoint of this run's folder; None for ``initial_load_path``."""
    reason: str
    """Why this one, for the log line."""
    model_only: bool
    """Load only the model weights (every other state starts fresh)."""
    hf: bool
    """``path`` holds HF safetensors (model weights only)."""
    fallbacks: tuple[tuple[int, str], ...] = ()
    """Older complete checkpoints ``(step, path)``, newest first, tried in turn when ``path``
    fails its content check (only when the newest was chosen automatically)."""
    damaged: tuple[tuple[str, str], ...] = ()
    """``(path, reason)`` of the checkpoints of the folder that did not verify."""


def refuse_fresh_start(folder: str, damaged: list[tuple[str, str]]) -> CheckpointError:
    """The error when ``folder`` holds checkpoints and none of them can be loaded: starting from
    scratch would let the new run overwrite and purge them, so it needs an explicit choice."""
    listing = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in damaged)
    loadable = [
        parsed[0]
        for p, why in damaged
        if (why == fs.UNVERIFIED or _marker_only_damage(p, why))
        and (parsed := fs.parse_step_dir(os.path.basename(p)))
    ]
    choice = (
        f"load one whose data looks whole anyway with --checkpoint.load_step {max(loadable)}, or "
        if loadable
        else "restore them from a copy, or "
    )
    return CheckpointError(
        f"{folder} holds checkpoints but none of them verifies ({listing}); refusing to start "
        f"from scratch, which would overwrite them: {choice}start from scratch leaving them "
        "untouched with --checkpoint.start_fresh"
    )


# --- planning ---------------------------------------------------------------------------------


def plan_load(
    folder: str, step: int, cfg: CheckpointConfig, resume: bool = True
) -> LoadPlan | None:
    """Rank 0 decides what to load (and logs why); the plan is broadcast to every rank.
    ``resume=False``: only ``initial_load_path`` (``folder`` is not looked at)."""
    plan: LoadPlan | None = None
    error = None
    if rank() == 0:
        try:
            plan = _decide(folder, step, cfg) if resume else decide_initial_load(cfg)
        except CheckpointError as err:
            error = str(err)
    plan, error = broadcast((plan, error))
    if error is not None:
        raise CheckpointError(error)
    return plan


def _decide(folder: str, step: int, cfg: CheckpointConfig) -> LoadPlan | None:
    entries = fs.scan_checkpoints(folder)
    complete = [e for e in entries if e.complete]
    damaged = tuple(
        (e.path, e.reason) for e in entries if not e.complete and not e.path.endswith(fs.TMP_SUFFIX)
    )
    fallbacks: tuple[tuple[int, str], ...] = ()
    if step >= 0:
        match = [e for e in entries if e.step == step and not e.path.endswith(fs.TMP_SUFFIX)]
        if match and not match[0].complete and (
            match[0].unverified or _marker_only_damage(match[0].path, match[0].reason)
        ):
            logger.warning(
                f"Checkpoint: {match[0].path}: {match[0].reason}; loading it anyway because "
                f"checkpoint.load_step={step} asks for it"
                + ("" if match[0].unverified else f" (DCP's index {fs.DCP_METADATA} is present; "
                   "file sizes and checksums cannot be checked)")
            )
        elif not match or not match[0].complete:
            why = match[0].reason if match else "it does not exist"
            have = [e.step for e in complete]
            raise CheckpointError(
                f"checkpoint.load_step={step}: cannot load {os.path.join(folder, fs.step_dir_name(step))}: "
                f"{why}; complete checkpoints in {folder}: {have or 'none'}"
            )
        entry = match[0]
        reason = f"asked for by checkpoint.load_step={step}"
    else:
        newest = complete[-1].step if complete else -1
        for e in entries:
            if e.unverified:
                logger.warning(
                    f"Checkpoint: skipping {e.path}: {e.reason}; load it anyway with "
                    f"--checkpoint.load_step {e.step}"
                )
            elif not e.complete and e.step >= newest:
                logger.warning(f"Checkpoint: skipping incomplete checkpoint {e.path}: {e.reason}")
            elif not e.complete and not e.path.endswith(fs.TMP_SUFFIX):
                logger.warning(f"Checkpoint: ignoring incomplete checkpoint {e.path}: {e.reason}")
        if cfg.start_fresh:
            names = [os.path.basename(e.path) for e in entries if not e.path.endswith(fs.TMP_SUFFIX)]
            logger.warning(
                f"Checkpoint: checkpoint.start_fresh: not loading from {folder}"
                + (f"; {', '.join(names)} stay untouched (never loaded, purged or overwritten)" if names else "")
            )
            return _decide_initial(folder, cfg)
        if not complete:
            if damaged:
                raise refuse_fresh_start(folder, list(damaged))
            return _decide_initial(folder, cfg)
        entry = complete[-1]
        reason = f"the newest complete checkpoint in {folder}"
        fallbacks = tuple((e.step, e.path) for e in reversed(complete[:-1]))
    if cfg.initial_load_path:
        logger.info(
            f"Checkpoint: checkpoint.initial_load_path={cfg.initial_load_path} is ignored "
            f"because {folder} already has {fs.step_dir_name(entry.step)} (resuming wins)"
        )
    return LoadPlan(
        path=entry.path,
        step=entry.step,
        reason=reason,
        model_only=False,
        hf=False,
        fallbacks=fallbacks,
        damaged=damaged,
    )


def _marker_only_damage(path: str, reason: str) -> bool:
    """The commit marker is unreadable but DCP's own index (written last) is there."""
    return (
        fs.COMMIT_MARKER in reason
        and "unreadable" in reason
        and os.path.exists(os.path.join(path, fs.DCP_METADATA))
    )


def decide_initial_load(cfg: CheckpointConfig) -> LoadPlan | None:
    """The plan for ``checkpoint.initial_load_path`` alone, on this rank (no collectives):
    used when checkpoint.enable is off, so nothing is resumed or saved."""
    return _decide_initial(None, cfg)


def _decide_initial(folder: str | None, cfg: CheckpointConfig) -> LoadPlan | None:
    if not cfg.initial_load_path:
        logger.info(f"Checkpoint: no checkpoint in {folder}; starting from scratch")
        return None
    why = (
        f"{folder} has no checkpoint, so checkpoint.initial_load_path"
        if folder is not None
        else "checkpoint.initial_load_path without checkpoint.enable: loaded, nothing saved"
    )
    path = cfg.initial_load_path
    if not os.path.exists(path):
        raise CheckpointError(
            f"checkpoint.initial_load_path={path} does not exist; fix the path or unset it"
        )
    if os.path.isfile(path):
        folder_of = os.path.dirname(os.path.abspath(path))
        hf_hint = (" with --checkpoint.initial_load_in_hf" if path.endswith(".safetensors")
                   and not cfg.initial_load_in_hf else "")
        raise CheckpointError(
            f"checkpoint.initial_load_path={path} is a file; give the folder that holds the "
            f"checkpoint ({folder_of}){hf_hint}"
        )
    if cfg.initial_load_in_hf:
        check_hf_folder(path)
        return LoadPlan(
            path=path,
            step=None,
            reason=f"{why} (HF) is used" if folder is not None else f"{why} (HF)",
            model_only=True,
            hf=True,
        )
    reason_text, marker = fs.verify_checkpoint(path)
    if reason_text:
        # Perhaps a checkpoint root folder: its newest complete step, else its newest unverified
        entries = fs.scan_checkpoints(path)
        inner = [e for e in entries if e.complete] or [e for e in entries if e.unverified]
        if not inner:
            if os.path.isdir(path) and any(n.endswith(".safetensors") for n in os.listdir(path)):
                raise CheckpointError(
                    f"checkpoint.initial_load_path={path} holds HF *.safetensors weights, not a "
                    "DCP checkpoint: add --checkpoint.initial_load_in_hf to load them"
                )
            raise CheckpointError(
                f"checkpoint.initial_load_path={path} is not a complete DCP checkpoint "
                f"({reason_text}) and holds no complete step-N folder"
            )
        path, marker = inner[-1].path, inner[-1].marker
    if marker is None:  # named by the user, so loaded; but say that it cannot be checked
        logger.warning(f"Checkpoint: initial_load_path {path}: {fs.UNVERIFIED}")
    return LoadPlan(
        path=path,
        step=None,
        reason=f"{why} is used" if folder is not None else why,
        model_only=bool(cfg.initial_load_model_only),
        hf=False,
    )


# --- the shared model check -------------------------------------------------------------------


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
        logger.warning(
            f"Checkpoint: {name} has no {', '.join(fresh)} state (a model-only save); "
            "these start fresh"
        )
    if rank() == 0 and skipped:
        logger.info(
            f"Checkpoint: loading model weights only (checkpoint.initial_load_model_only); "
            f"{', '.join(skipped)} start fresh"
        )
    return sd, loaded, to_load
