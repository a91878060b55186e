"""Which checkpoint to load: the run's folder (newest verified, or ``checkpoint.load_step``),
else ``checkpoint.initial_load_path``; decided on rank 0, logged with the reason, broadcast as a
:class:`LoadPlan`. A folder whose checkpoints all fail verification is never started over in
silence (:func:`refuse_fresh_start`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from torchtitan.components.checkpoint import fs
from torchtitan.components.checkpoint.common import CheckpointError, broadcast, rank
from torchtitan.components.checkpoint.hf_files import check_hf_folder
from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.tools.logging import logger

__all__ = [
    "LoadPlan",
    "check_seed_folder",
    "decide_initial_load",
    "plan_load",
    "refuse_fresh_start",
]


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


def check_seed_folder(folder: str) -> None:
    """``checkpoint.create_seed_checkpoint``: refuse a folder that already holds trained
    checkpoints. A run started there resumes from the newest of them, never from the seed it
    was told to use."""
    trained = [e.step for e in fs.complete_checkpoints(folder) if e.step > 0]
    if trained:
        raise CheckpointError(
            f"checkpoint.create_seed_checkpoint: {folder} already holds "
            f"{fs.step_dir_name(max(trained))}, and a run there resumes from it, not from a "
            "seed: write the seed checkpoint to an empty folder (another --job.dump_folder or "
            "--checkpoint.folder)"
        )


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
                + _subfolder_hint(path)
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


def _subfolder_hint(path: str) -> str:
    """``; its subfolder X holds them (...)`` when ``path`` is e.g. a run's dump folder whose
    checkpoint folder holds complete steps; else empty."""
    if not os.path.isdir(path):
        return ""
    for name in sorted(os.listdir(path)):
        sub = os.path.join(path, name)
        if os.path.isdir(sub) and any(e.complete for e in fs.scan_checkpoints(sub)):
            return (f"; its subfolder {name}/ holds complete steps (a run's dump folder?): "
                    f"--checkpoint.initial_load_path {sub}")
    return ""
