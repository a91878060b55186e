"""CheckpointManager: when to save, what goes into a checkpoint, what to load.

Layout: ``{dump_folder}/{checkpoint.folder}/step-N``. A checkpoint holds the model weights at the
top level (FQN keys merged over all model parts, so FSDP/TP/PP layouts share one layout) plus
``optimizer``, ``lr_scheduler``, ``dataloader`` and ``train_state`` (any ``states`` given).
Writing and committing is save.py, choosing and reading load.py / hf.py, the folder layout fs.py.
See docs/checkpoint.md.
"""

from __future__ import annotations

import os
import time
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.checkpoint import fs, hf, integrity, space
from torchtitan.components.checkpoint.common import (
    DATALOADER,
    EXPORT_DTYPES,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    TRAIN_STATE,
    CheckpointError,
    ModelWrapper,
    agree,
    rank,
    world_size,
)
from torchtitan.components.checkpoint.guard import SaveGuard
from torchtitan.components.checkpoint.hooks import SaveHooks, hooks_from_env
from torchtitan.components.checkpoint.load import load_dcp
from torchtitan.components.checkpoint.load_plan import (
    LoadPlan,
    check_seed_folder,
    plan_load,
    refuse_fresh_start,
)
from torchtitan.components.checkpoint.lock import FolderLock
from torchtitan.components.checkpoint.messages import seed_flags, setup_line
from torchtitan.components.checkpoint.save import CheckpointSaver, InFlightSave
from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.tools.interrupts import uninterruptible
from torchtitan.tools.logging import logger


def parse_exclude(raw: list[str] | str, valid: list[str]) -> list[str]:
    """``checkpoint.exclude_from_loading`` as names, each one of ``valid`` (the pre-flight
    checks it with the Trainer's states); ``CheckpointError`` naming the unknown ones."""
    items = raw.split(",") if isinstance(raw, str) else [p for r in raw for p in r.split(",")]
    names = [p.strip() for p in items if p.strip()]
    bad = [n for n in names if n not in valid]
    if bad:
        raise CheckpointError(
            f"checkpoint.exclude_from_loading has unknown name(s) {bad}; valid names: {valid}"
        )
    return names


class CheckpointManager:
    """Saves and loads the whole training state with ``torch.distributed.checkpoint``.

    Args:
        dataloader: Stateful dataloader (None: not checkpointed).
        model_parts: the model, or its pipeline parts.
        optimizers / lr_schedulers: Stateful containers (None: not checkpointed).
        states: further Stateful objects by name, e.g. ``{"train_state": trainer}``.
        checkpoint_config: the ``[checkpoint]`` section.
        dump_folder: ``job.dump_folder``; checkpoints go to ``{dump_folder}/{folder}``.
        sd_adapter: HF state-dict adapter (``to_hf``/``from_hf``/``hf_config``), needed only for
            ``initial_load_in_hf`` / ``last_save_in_hf``.
        save_hooks: called at each phase of every save (hooks.py); None: the object named by
            ``TORCHTITAN_CHECKPOINT_HOOKS`` if set, else no hooks.
        tokenizer: the run's tokenizer; ``last_save_in_hf`` then also writes the tokenizer
            files, ``generation_config.json`` and BOS/EOS ids in ``config.json``.
        writer_id: set when several jobs share the folder by design (fault-tolerant replica
            groups): each holds its own writer lock.
    """

    def __init__(
        self,
        dataloader: Stateful | None,
        model_parts: list[nn.Module] | nn.Module,
        optimizers: Stateful | None,
        lr_schedulers: Stateful | None,
        states: dict[str, Stateful] | None,
        checkpoint_config: CheckpointConfig,
        dump_folder: str,
        sd_adapter: Any | None = None,
        save_hooks: SaveHooks | None = None,
        tokenizer: Any | None = None,
        writer_id: str = "",
    ) -> None:
        self.config = cfg = checkpoint_config
        self.enable = bool(cfg.enable or cfg.create_seed_checkpoint)
        self.folder = os.path.join(dump_folder, cfg.folder)
        self.model = ModelWrapper(model_parts)
        self.guard = SaveGuard(self.model)
        self.loaded: list[str] = []
        """The states the last ``load`` restored (empty: nothing was loaded)."""
        self._rewound_to: int | None = None
        """The older step a ``load(step)`` rewound to, until its newer folders are set aside."""
        self.sd_adapter = sd_adapter
        self.tokenizer = tokenizer
        self.states: dict[str, Stateful] = {}
        for name, obj in (
            (OPTIMIZER, optimizers),
            (LR_SCHEDULER, lr_schedulers),
            (DATALOADER, dataloader),
        ):
            if obj is not None:
                self.states[name] = obj
        for name, obj in (states or {}).items():
            if name in self.states or name == MODEL:
                raise CheckpointError(f"checkpoint state name {name!r} is reserved")
            self.states[name] = obj
        self.exclude = self._parse_exclude(cfg.exclude_from_loading)
        if cfg.interval <= 0:
            raise CheckpointError(f"checkpoint.interval={cfg.interval} must be a positive step count")
        if cfg.keep_latest_k < 0:
            raise CheckpointError(
                f"checkpoint.keep_latest_k={cfg.keep_latest_k} must be >= 0 (0 keeps every checkpoint)"
            )
        if cfg.export_dtype not in EXPORT_DTYPES:
            raise CheckpointError(
                f"checkpoint.export_dtype={cfg.export_dtype!r}: use one of {sorted(EXPORT_DTYPES)}"
            )
        if (cfg.initial_load_in_hf or cfg.last_save_in_hf) and sd_adapter is None and (
            self.enable or cfg.initial_load_path
        ):
            which = "initial_load_in_hf" if cfg.initial_load_in_hf else "last_save_in_hf"
            raise CheckpointError(
                f"checkpoint.{which} needs an HF state-dict adapter, and this model has none"
            )
        self.async_mode = cfg.async_mode
        if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
            raise CheckpointError(
                f"checkpoint.async_mode={self.async_mode!r}: use disabled, async or async_with_pinned_mem"
            )
        if self.async_mode == "async_with_pinned_mem" and not torch.cuda.is_available():
            logger.warning(
                "checkpoint.async_mode=async_with_pinned_mem needs CUDA (pinned host memory); "
                "using async (staged copies in ordinary memory) instead"
            )
            self.async_mode = "async"
        self.saver = CheckpointSaver(
            self.folder,
            cfg.keep_latest_k,
            self.async_mode,
            background=self.enable and not cfg.load_only and self.async_mode != "disabled",
            hooks=save_hooks if save_hooks is not None else hooks_from_env(),
        )
        if self.enable and cfg.enable_ft_dataloader_checkpoints and rank() == 0:
            logger.warning(
                "checkpoint.enable_ft_dataloader_checkpoints is not needed: the data position is "
                "global (the same in every fault-tolerant replica group), so the shared "
                "checkpoint holds it"
            )
        if self.enable:
            setup_line(self.config, self.folder, self.async_mode, self.sd_adapter,
                       self.model.model_parts)
        self.lock = FolderLock(self.folder, writer_id)
        self._sizes: tuple[int, int, int] | None = None  # for check_space
        if self.enable and not cfg.load_only:
            space.check_writable(self.folder)
            self.lock.acquire()  # one writer per folder (lock.py)
            self._sizes = space.checkpoint_sizes(
                self.model, state_itemsize=space.optimizer_state_itemsize(optimizers))

    def check_space(self, start: int, last: int) -> None:
        """Rank 0 warns when the folder's free space cannot hold the checkpoints that training
        from step ``start`` to ``last`` writes and keeps at once (space.py); else one info line."""
        if self._sizes is None or rank() != 0:
            return
        cfg = self.config
        elements, weights, state = self._sizes
        saves = space.save_steps(start, last, cfg.interval, cfg.enable_first_step_checkpoint)
        exported = elements * EXPORT_DTYPES[cfg.export_dtype].itemsize
        last_bytes = exported if cfg.last_save_model_only else weights + state
        if cfg.last_save_in_hf:
            last_bytes += exported
        existing = len(fs.complete_checkpoints(self.folder))
        space.warn_if_short(self.folder, weights + state, saves, cfg.keep_latest_k, existing,
                            last_bytes)

    # --- configuration ---------------------------------------------------------------------
    def _parse_exclude(self, raw: list[str] | str) -> list[str]:
        return parse_exclude(raw, [MODEL, *self.states])

    # --- saving ----------------------------------------------------------------------------
    @property
    def in_flight(self) -> InFlightSave | None:
        """The async save still being written in the background, if any."""
        return self.saver.in_flight

    def _should_save(self, step: int, last_step: bool, force: bool) -> bool:
        cfg = self.config
        if not self.enable:
            if force:
                logger.warning("Checkpoint: checkpoint.enable is off, so no checkpoint is written")
            return False
        if cfg.load_only:
            if force:
                logger.warning("Checkpoint: checkpoint.load_only is set, so no checkpoint is written")
            return False
        return self.is_due(step, last_step, force)

    def is_due(self, step: int, last_step: bool = False, force: bool = False) -> bool:
        """Whether ``save(step, last_step, force)`` would write (before the weight guard)."""
        cfg = self.config
        if not self.enable or cfg.load_only:
            return False
        return force or last_step or (step == 1 and cfg.enable_first_step_checkpoint) or (
            step % cfg.interval == 0
        )

    def _model_state(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        sd = self.model.state_dict()
        if dtype is not None:
            sd = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in sd.items()}
        return sd

    def _full_state(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        sd = self._model_state()
        for name, obj in self.states.items():
            sd[name] = overrides[name] if overrides and name in overrides else obj.state_dict()
        return sd

    def has_step(self, step: int) -> bool:
        """Whether a complete ``step-N`` of ``step`` is in the folder."""
        return any(e.step == step for e in fs.complete_checkpoints(self.folder))

    def newest_safe(self, at_most: int | None = None) -> fs.CheckpointEntry | None:
        """The newest complete checkpoint of the folder (``step <= at_most``); every save went
        through the weight guard, so it is the one to resume from after a divergence."""
        complete = [
            e for e in fs.complete_checkpoints(self.folder) if at_most is None or e.step <= at_most
        ]
        return complete[-1] if complete else None

    def resume_hint(self, step: int) -> str:
        """Where to resume from after training failed at ``step`` (for the error message)."""
        if not self.enable:
            return "checkpointing is off (--checkpoint.enable), so there is no checkpoint to resume from"
        entry = self.newest_safe(at_most=step)
        if entry is None:
            return (
                f"{self.folder} holds no checkpoint at or before step {step} to resume from: "
                "start again from scratch"
            )
        return (
            f"the newest safe checkpoint is {entry.path}: resume from it with --checkpoint.load_step "
            f"{entry.step} (with a lower --optimizer.lr add --optimizer.override_checkpoint_lr)"
        )

    def save(
        self,
        curr_step: int,
        last_step: bool = False,
        force: bool = False,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        """Save after step ``curr_step`` when due (interval, first step, last step) or ``force``.
        ``overrides``: state dicts to record instead of the live ones (by state name).

        Skipped, with a warning, when the weights are non-finite or exploded (guard.py)."""
        if not self._should_save(curr_step, last_step, force):
            return
        problem = self.guard.problem()
        if problem:
            if rank() == 0:
                safe = self.newest_safe(at_most=curr_step)
                logger.warning(
                    f"Checkpoint: not saving step-{curr_step}: {problem}; the newest safe "
                    f"checkpoint stays {safe.path if safe else 'none'}"
                )
            return
        self.set_aside_abandoned()  # this save starts the rewound trajectory in the folder
        cfg = self.config
        model_only = last_step and cfg.last_save_model_only
        if model_only:
            sd = self._model_state(EXPORT_DTYPES[cfg.export_dtype])
            for name in (TRAIN_STATE,):  # tiny, lets a finished run restart as finished
                if name in self.states:
                    sd[name] = self.states[name].state_dict()
        else:
            sd = self._full_state(overrides)
        states = sorted(k for k in sd if k in self.states)
        info = {"step": curr_step, "model_only": model_only, "states": states}
        info.update(hf.model_info(self.sd_adapter))  # the architecture, for HF export checks
        if self.async_mode != "disabled" and not (last_step or force):
            self.saver.save_async(curr_step, sd, info)
            return
        self.saver.wait()
        export = None
        if last_step and cfg.last_save_in_hf:
            export = partial(
                hf.export_hf,
                sd_adapter=self.sd_adapter,
                export_dtype=cfg.export_dtype,
                extra_non_model=list(self.states),
                tokenizer=self.tokenizer,
                allow_lossy=cfg.last_save_in_hf_allow_lossy,
            )
        self.saver.save_sync(curr_step, sd, info, export=export)

    def maybe_wait_for_staging(self) -> None:
        """Call before the optimizer step: waits until an async save has copied the weights
        (pinned-memory mode) and commits a background write that has finished."""
        self.saver.maybe_wait_for_staging()

    def save_seed_checkpoint(self) -> None:
        """Write the freshly initialised model weights as ``step-0`` (needs world size 1)."""
        ws = world_size()
        if ws != 1:
            raise CheckpointError(
                f"checkpoint.create_seed_checkpoint needs a single process (NGPU=1 and every "
                f"parallelism.*_degree 1); this run has world size {ws}"
            )
        check_seed_folder(self.folder)
        path = os.path.join(self.folder, fs.step_dir_name(0))
        if os.path.exists(path):
            logger.warning(f"Checkpoint: replacing the existing seed checkpoint {path}")
        info = {"step": 0, "model_only": True, "states": [], "seed": True}
        info.update(hf.model_info(self.sd_adapter))
        self.saver.save_sync(0, self._model_state(), info)
        logger.info(
            f"Checkpoint: seed checkpoint written to {path}; start runs from it with "
            f"{seed_flags(self.folder, self.config)} (any parallel layout, resharded on load)"
        )

    # --- loading ---------------------------------------------------------------------------
    def load(self, step: int = -1) -> bool:
        """Load the newest complete checkpoint (or ``step-<step>``), else ``initial_load_path``;
        with checkpoint.enable off, ``initial_load_path`` only (if set; nothing is saved).
        Loading an older ``step`` than the newest is a rewind: the newer step folders are set
        aside by :meth:`set_aside_abandoned` (the Trainer calls it before training on) or by the
        first save, never by the load alone (a reader of an old step changes nothing).

        Returns True when something was loaded. Raises CheckpointError with a one-line reason.
        """
        resume = self.enable  # off: initial_load_path alone is loaded (never the folder)
        if not resume and not self.config.initial_load_path:
            if rank() == 0:
                logger.info("Checkpoint: checkpoint.enable is off; nothing is loaded")
            return False
        plan = plan_load(self.folder, step, self.config, resume=resume)
        self._protect_existing(plan)
        if plan is None:
            self.guard.start()
            return False
        begin = time.perf_counter()
        if not plan.hf:
            plan = self._verified(plan, explicit=step >= 0)
        if plan.hf:
            loaded = hf.load_hf(plan.path, self.model, self.sd_adapter, self.exclude)
        else:
            loaded = load_dcp(plan.path, self.model, self.states, self.exclude, plan.model_only)
        self.loaded = list(loaded)
        if rank() == 0:
            logger.info(
                f"Checkpoint: loaded {', '.join(loaded)} from {plan.path} ({plan.reason}) "
                f"in {time.perf_counter() - begin:.2f} s"
            )
        if step >= 0 and plan.step == step and not self.config.load_only:
            self._rewound_to = step
        self.guard.start()
        return True

    def set_aside_abandoned(self) -> None:
        """After a rewind (``load`` of an older step): rename the ``step-N`` folders newer than
        the loaded step, the abandoned trajectory (never deleted), so no later restart resumes
        from them and this run's saves of those steps meet no old folder. Collective; a no-op
        without a pending rewind."""
        step, self._rewound_to = self._rewound_to, None
        if step is None:
            return
        error = None
        if rank() == 0:
            try:
                with uninterruptible():  # all or none, even on a Ctrl-C at start-up
                    moved = fs.set_aside_newer(self.folder, step)
            except OSError as err:
                error = f"cannot set aside the checkpoints newer than step-{step} in {self.folder}: {err}"
            else:
                if moved:
                    logger.warning(
                        f"Checkpoint: rewound to step-{step} (checkpoint.load_step): the newer "
                        f"{', '.join(os.path.basename(old) for old, _ in moved)} belong to the "
                        f"abandoned trajectory, renamed {', '.join(os.path.basename(new) for _, new in moved)} "
                        "(never loaded or purged: delete them once you no longer need them)"
                    )
        agree(error)

    def _protect_existing(self, plan: LoadPlan | None) -> None:
        """Never purge what this run cannot vouch for: damaged checkpoints, and under
        ``start_fresh`` every checkpoint that was there before."""
        if plan is not None:
            self.saver.protected.update(os.path.abspath(p) for p, _ in plan.damaged)
        if self.config.start_fresh:
            self.saver.protected.update(
                os.path.abspath(e.path)
                for e in fs.scan_checkpoints(self.folder)
                if not e.path.endswith(fs.TMP_SUFFIX)
            )

    def _verified(self, plan: LoadPlan, explicit: bool) -> LoadPlan:
        """``plan`` once its files match their checksums; else the newest older checkpoint that
        does (with a warning naming the file), or an error when none is left."""
        damaged = list(plan.damaged)
        candidates = [(plan.step, plan.path), *plan.fallbacks]
        for i, (step, path) in enumerate(candidates):
            problem = integrity.verify_content(path)
            if not problem:
                if i == 0:
                    return plan
                return LoadPlan(
                    path=path,
                    step=step,
                    reason=f"the newest checkpoint in {self.folder} whose files match their checksums",
                    model_only=plan.model_only,
                    hf=False,
                )
            self.saver.protected.add(os.path.abspath(path))
            damaged.append((path, problem))
            if explicit or step is None:
                raise CheckpointError(f"cannot load {path}: {problem}; it is left untouched")
            if rank() == 0:
                following = candidates[i + 1][1] if i + 1 < len(candidates) else None
                logger.warning(
                    f"Checkpoint: skipping damaged checkpoint {path}: {problem}; "
                    + (f"falling back to {following}" if following else "no older checkpoint is left")
                )
        raise refuse_fresh_start(self.folder, damaged)

    # --- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        """Finish and commit an in-flight async save, wait for purging to end, release the lock."""
        try:
            self.saver.close()
        finally:
            self.lock.release()
