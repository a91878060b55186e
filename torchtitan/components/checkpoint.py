"""DCP checkpointing: atomic, verified, resharding-friendly saves and exact resume.

Layout: ``{dump_folder}/{checkpoint.folder}/step-N``. A checkpoint holds the model weights at the
top level (FQN keys merged over all model parts, so FSDP/TP/PP layouts share one layout) plus
``optimizer``, ``lr_scheduler``, ``dataloader`` and ``train_state`` (any ``states`` given).
Each save is written to ``step-N.tmp`` and committed by rank 0 (marker + rename) only after every
rank finished writing; loading picks the newest complete checkpoint. See docs/checkpoint.md.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components import checkpoint_utils as cu
from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.tools.logging import logger

MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
TRAIN_STATE = "train_state"

_EXPORT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

TEST_KILL_ENV = "TORCHTITAN_TEST_KILL_DURING_SAVE"
"""Test hook: ``"N"`` or ``"N:write"`` SIGKILLs the process while saving step N (``write``: after
DCP wrote the data files but before ``.metadata``; default: after ``.metadata``, before commit)."""


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


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (identity without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _agree(error: str | None) -> None:
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
        rank, msg = first
        raise CheckpointError(f"rank {rank}: {msg}")
    if error is not None:
        raise CheckpointError(error)


# DCP warns on every single-process save/load that it assumes one process; we pass no_dist on
# purpose. A process-wide filter, because async saves run in a background thread.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """The same filter, scoped (survives frameworks that reset the process-wide filters)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


def _flat_keys(state: Any, prefix: str) -> list[str]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict({prefix: state})
    return list(flat)


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
    ) -> None:
        self.config = cfg = checkpoint_config
        self.enable = bool(cfg.enable or cfg.create_seed_checkpoint)
        self.folder = os.path.join(dump_folder, cfg.folder)
        self.model = ModelWrapper(model_parts)
        self.sd_adapter = sd_adapter
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
        if cfg.export_dtype not in _EXPORT_DTYPES:
            raise CheckpointError(
                f"checkpoint.export_dtype={cfg.export_dtype!r}: use one of {sorted(_EXPORT_DTYPES)}"
            )
        if (cfg.initial_load_in_hf or cfg.last_save_in_hf) and sd_adapter is None and self.enable:
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
        self._pg = None
        self._stager = None
        self._in_flight: dict[str, Any] | None = None
        self._purge_thread: threading.Thread | None = None
        if self.enable and not cfg.load_only and self.async_mode != "disabled":
            if dist.is_initialized():
                # DCP's collectives must not interleave with training collectives on one group.
                self._pg = dist.new_group(backend="gloo")
            if self.async_mode == "async_with_pinned_mem":
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                self._stager = DefaultStager(StagingOptions(True, False, True, True))
        if self.enable and cfg.enable_ft_dataloader_checkpoints and _rank() == 0:
            logger.warning(
                "checkpoint.enable_ft_dataloader_checkpoints is ignored: fault-tolerance replicas "
                "(torchft) are not supported; the dataloader is checkpointed per dp rank as usual"
            )
        if self.enable:
            self._log_setup()

    # --- configuration ---------------------------------------------------------------------
    def _parse_exclude(self, raw: list[str] | str) -> list[str]:
        items = raw.split(",") if isinstance(raw, str) else [p for r in raw for p in r.split(",")]
        names = [p.strip() for p in items if p.strip()]
        valid = [MODEL, *self.states]
        bad = [n for n in names if n not in valid]
        if bad:
            raise CheckpointError(
                f"checkpoint.exclude_from_loading has unknown name(s) {bad}; valid names: {valid}"
            )
        return names

    def _log_setup(self) -> None:
        cfg = self.config
        if _rank() != 0:
            return
        if cfg.create_seed_checkpoint:
            return
        if cfg.load_only:
            logger.info(f"Checkpoint: load_only: loading from {self.folder} if possible, never saving")
            return
        extras = []
        if cfg.enable_first_step_checkpoint:
            extras.append("also after step 1")
        if cfg.last_save_model_only:
            extras.append(f"final save model-only in {cfg.export_dtype}")
        if cfg.last_save_in_hf:
            extras.append("final save also as HF safetensors")
        logger.info(
            f"Checkpoint: saving to {self.folder}/step-N every {cfg.interval} steps, "
            f"async_mode={self.async_mode}, keep_latest_k={cfg.keep_latest_k or 'all'}"
            + (f" ({'; '.join(extras)})" if extras else "")
        )

    # --- saving ----------------------------------------------------------------------------
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
        if force or last_step:
            return True
        if step == 1 and cfg.enable_first_step_checkpoint:
            return True
        return step % cfg.interval == 0

    def _model_state(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        sd = self.model.state_dict()
        if dtype is not None:
            sd = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in sd.items()}
        return sd

    def _full_state(self) -> dict[str, Any]:
        sd = self._model_state()
        for name, obj in self.states.items():
            sd[name] = obj.state_dict()
        return sd

    def save(self, curr_step: int, last_step: bool = False, force: bool = False) -> None:
        """Save after step ``curr_step`` when due (interval, first step, last step) or ``force``."""
        if not self._should_save(curr_step, last_step, force):
            return
        cfg = self.config
        model_only = last_step and cfg.last_save_model_only
        if model_only:
            sd = self._model_state(_EXPORT_DTYPES[cfg.export_dtype])
            for name in (TRAIN_STATE,):  # tiny, lets a finished run restart as finished
                if name in self.states:
                    sd[name] = self.states[name].state_dict()
        else:
            sd = self._full_state()
        states = sorted(k for k in sd if k in self.states)
        info = {"step": curr_step, "model_only": model_only, "states": states}
        export_hf = last_step and cfg.last_save_in_hf
        if self.async_mode != "disabled" and not (last_step or force):
            self._async_save(curr_step, sd, info)
        else:
            self._wait_in_flight()
            self._sync_save(curr_step, sd, info, export_hf=export_hf)

    def _prepare_tmp(self, step: int) -> tuple[str, str]:
        final = os.path.join(self.folder, cu.step_dir_name(step))
        tmp = final + cu.TMP_SUFFIX
        if _rank() == 0:
            os.makedirs(self.folder, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        return tmp, final

    def _maybe_test_kill(self, step: int, phase: str) -> None:
        spec = os.environ.get(TEST_KILL_ENV)
        if not spec:
            return
        want_step, _, want_phase = spec.partition(":")
        if int(want_step) == step and (want_phase or "commit") == phase:
            logger.warning(f"{TEST_KILL_ENV}={spec}: killing this process while saving step {step}")
            os.kill(os.getpid(), signal.SIGKILL)

    def _writer(self, tmp: str, step: int):
        if os.environ.get(TEST_KILL_ENV, "").endswith(":write"):
            manager = self

            class _KillingWriter(dcp.FileSystemWriter):
                def finish(self, metadata, results):  # before .metadata is written
                    manager._maybe_test_kill(step, "write")
                    return super().finish(metadata, results)

            return _KillingWriter(tmp)
        return dcp.FileSystemWriter(tmp)

    def _sync_save(self, step: int, sd: dict[str, Any], info: dict[str, Any], export_hf: bool) -> None:
        begin = time.perf_counter()
        tmp, final = self._prepare_tmp(step)
        with _quiet_dcp():
            dcp.save(sd, storage_writer=self._writer(tmp, step), no_dist=not dist.is_initialized())
        _barrier()  # every rank has written its files
        self._maybe_test_kill(step, "commit")
        if _rank() == 0:
            if export_hf:
                self._export_hf(tmp)
            cu.commit_checkpoint(tmp, final, {**info, "world_size": _world_size()})
        _barrier()
        if _rank() == 0:
            kind = "model-only checkpoint" if info["model_only"] else "checkpoint"
            logger.info(
                f"Checkpoint: saved {kind} step-{step} to {final} in {time.perf_counter() - begin:.2f} s"
            )
            self._purge()

    def _async_save(self, step: int, sd: dict[str, Any], info: dict[str, Any]) -> None:
        self._wait_in_flight()
        begin = time.perf_counter()
        tmp, final = self._prepare_tmp(step)
        kwargs: dict[str, Any] = {"no_dist": not dist.is_initialized()}
        if self._pg is not None:
            kwargs["process_group"] = self._pg
        if self._stager is not None:
            kwargs["async_stager"] = self._stager
        with _quiet_dcp():
            result = dcp.async_save(sd, storage_writer=self._writer(tmp, step), **kwargs)
        staging = getattr(result, "staging_completion", None)
        upload = getattr(result, "upload_completion", result)
        self._in_flight = {
            "step": step,
            "tmp": tmp,
            "final": final,
            "upload": upload,
            "staging": staging,
            "info": {**info, "world_size": _world_size()},
            "begin": begin,
        }
        if _rank() == 0:
            logger.info(
                f"Checkpoint: async save of step-{step} started "
                f"(blocked training {time.perf_counter() - begin:.2f} s)"
            )

    def _finish_in_flight(self) -> None:
        job = self._in_flight
        assert job is not None
        self._in_flight = None
        try:
            job["upload"].result()
        except Exception as err:  # noqa: BLE001 - report the failed background write in one line
            raise CheckpointError(
                f"the async save of step-{job['step']} to {job['tmp']} failed: {err}; older "
                "checkpoints are intact (check free disk space and permissions)"
            ) from err
        self._maybe_test_kill(job["step"], "commit")
        if _rank() == 0:
            # Rank 0's DCP finish gathered every rank's write results: all files are on disk.
            cu.commit_checkpoint(job["tmp"], job["final"], job["info"])
            logger.info(
                f"Checkpoint: committed async step-{job['step']} to {job['final']} "
                f"({time.perf_counter() - job['begin']:.2f} s after it started)"
            )
            self._purge()

    def _wait_in_flight(self) -> None:
        if self._in_flight is not None:
            self._finish_in_flight()

    def maybe_wait_for_staging(self) -> None:
        """Call before the optimizer step: waits until an async save has copied the weights
        (pinned-memory mode) and commits a background write that has finished."""
        job = self._in_flight
        if job is None:
            return
        if job["staging"] is not None:
            job["staging"].result()
        if job["upload"].done():
            self._finish_in_flight()

    def _purge(self) -> None:
        """Delete checkpoints beyond keep_latest_k (rank 0, in a background thread)."""
        k = self.config.keep_latest_k
        if k <= 0:
            return
        if self._purge_thread is not None:
            self._purge_thread.join()
        protect = [self._in_flight["tmp"]] if self._in_flight else []
        doomed = cu.purge_candidates(self.folder, k, protect)
        if not doomed:
            return

        def run() -> None:
            for path in doomed:
                logger.info(f"Checkpoint: keep_latest_k={k}: deleting {path}")
                shutil.rmtree(path, ignore_errors=True)

        self._purge_thread = threading.Thread(target=run, name="checkpoint-purge", daemon=True)
        self._purge_thread.start()

    def _export_hf(self, tmp: str) -> None:
        """Write ``tmp/hf``: the model weights of DCP checkpoint ``tmp`` as HF safetensors."""
        import json

        dtype = _EXPORT_DTYPES[self.config.export_dtype]
        weights = cu.load_dcp_model_tensors(tmp, dtype=dtype, extra_non_model=self.states)
        hf_sd = self.sd_adapter.to_hf(weights)
        out = os.path.join(tmp, cu.HF_SUBFOLDER)
        cu.save_safetensors_folder(hf_sd, out)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(self.sd_adapter.hf_config(self.config.export_dtype), f, indent=2)

    def save_seed_checkpoint(self) -> None:
        """Write the freshly initialised model weights as ``step-0`` (needs world size 1)."""
        ws = _world_size()
        if ws != 1:
            raise CheckpointError(
                f"checkpoint.create_seed_checkpoint needs a single process (NGPU=1 and every "
                f"parallelism.*_degree 1); this run has world size {ws}"
            )
        path = os.path.join(self.folder, cu.step_dir_name(0))
        if os.path.exists(path):
            logger.warning(f"Checkpoint: replacing the existing seed checkpoint {path}")
        info = {"step": 0, "model_only": True, "states": [], "seed": True}
        self._sync_save(0, self._model_state(), info, export_hf=False)
        logger.info(
            f"Checkpoint: seed checkpoint written to {path}; start runs from it with "
            f"--checkpoint.enable (any parallel layout, resharded on load)"
        )

    # --- loading ---------------------------------------------------------------------------
    def _plan_load(self, step: int) -> dict[str, Any] | None:
        """Rank 0 decides what to load (and logs why); the plan is broadcast to every rank."""
        plan: dict[str, Any] | None = None
        error = None
        if _rank() == 0:
            try:
                plan = self._decide(step)
            except CheckpointError as err:
                error = str(err)
        plan, error = _broadcast((plan, error))
        if error is not None:
            raise CheckpointError(error)
        return plan

    def _decide(self, step: int) -> dict[str, Any] | None:
        cfg = self.config
        entries = cu.scan_checkpoints(self.folder)
        complete = [e for e in entries if e.complete]
        if step >= 0:
            match = [e for e in entries if e.step == step and not e.path.endswith(cu.TMP_SUFFIX)]
            if not match or not match[0].complete:
                why = match[0].reason if match else "it does not exist"
                have = [e.step for e in complete]
                raise CheckpointError(
                    f"checkpoint.load_step={step}: cannot load {os.path.join(self.folder, cu.step_dir_name(step))}: "
                    f"{why}; complete checkpoints in {self.folder}: {have or 'none'}"
                )
            entry = match[0]
            reason = f"asked for by checkpoint.load_step={step}"
        else:
            newest = complete[-1].step if complete else -1
            for e in entries:
                if not e.complete and e.step >= newest:
                    logger.warning(f"Checkpoint: skipping incomplete checkpoint {e.path}: {e.reason}")
            for e in entries:
                if not e.complete and e.step < newest and not e.path.endswith(cu.TMP_SUFFIX):
                    logger.warning(f"Checkpoint: ignoring incomplete checkpoint {e.path}: {e.reason}")
            if not complete:
                return self._decide_initial()
            entry = complete[-1]
            reason = f"the newest complete checkpoint in {self.folder}"
        if cfg.initial_load_path:
            logger.info(
                f"Checkpoint: checkpoint.initial_load_path={cfg.initial_load_path} is ignored "
                f"because {self.folder} already has {cu.step_dir_name(entry.step)} (resuming wins)"
            )
        return {"path": entry.path, "step": entry.step, "reason": reason, "model_only": False, "hf": False}

    def _decide_initial(self) -> dict[str, Any] | None:
        cfg = self.config
        if not cfg.initial_load_path:
            logger.info(f"Checkpoint: no checkpoint in {self.folder}; starting from scratch")
            return None
        path = cfg.initial_load_path
        if not os.path.exists(path):
            raise CheckpointError(
                f"checkpoint.initial_load_path={path} does not exist; fix the path or unset it"
            )
        if cfg.initial_load_in_hf:
            return {
                "path": path,
                "step": None,
                "reason": f"{self.folder} has no checkpoint, so checkpoint.initial_load_path (HF) is used",
                "model_only": True,
                "hf": True,
            }
        reason_text, _ = cu.verify_checkpoint(path)
        if reason_text:
            # Perhaps a checkpoint root folder: use its newest complete step.
            inner = cu.complete_checkpoints(path)
            if not inner:
                raise CheckpointError(
                    f"checkpoint.initial_load_path={path} is not a complete DCP checkpoint "
                    f"({reason_text}) and holds no complete step-N folder"
                )
            path = inner[-1].path
        return {
            "path": path,
            "step": None,
            "reason": f"{self.folder} has no checkpoint, so checkpoint.initial_load_path is used",
            "model_only": bool(cfg.initial_load_model_only),
            "hf": False,
        }

    def load(self, step: int = -1) -> bool:
        """Load the newest complete checkpoint (or ``step-<step>``), else ``initial_load_path``.

        Returns True when something was loaded. Raises CheckpointError with a one-line reason.
        """
        if not self.enable:
            if _rank() == 0:
                logger.info("Checkpoint: checkpoint.enable is off; nothing is loaded")
            return False
        plan = self._plan_load(step)
        if plan is None:
            return False
        begin = time.perf_counter()
        if plan["hf"]:
            loaded = self._load_hf(plan["path"])
        else:
            loaded = self._load_dcp(plan["path"], plan["model_only"])
        if _rank() == 0:
            logger.info(
                f"Checkpoint: loaded {', '.join(loaded)} from {plan['path']} ({plan['reason']}) "
                f"in {time.perf_counter() - begin:.2f} s"
            )
        return True

    def _load_hf(self, path: str) -> list[str]:
        if MODEL in self.exclude:
            raise CheckpointError(
                "checkpoint.initial_load_in_hf loads model weights only, but exclude_from_loading has model"
            )
        hf_sd = cu.load_safetensors_folder(path)
        sd = self.sd_adapter.from_hf(hf_sd)
        expected = self.model.state_dict()
        missing = [k for k in expected if k not in sd]
        if missing:
            raise CheckpointError(
                f"HF checkpoint {path} has no weights for {missing[:3]} ({len(missing)} missing): "
                "it does not match model.flavor"
            )
        for k, v in expected.items():
            if tuple(v.shape) != tuple(sd[k].shape):
                raise CheckpointError(
                    f"HF checkpoint {path}: {k} has shape {tuple(sd[k].shape)}, the model "
                    f"expects {tuple(v.shape)}; check model.flavor"
                )
        self.model.load_full_state_dict({k: sd[k] for k in expected})
        return [f"{MODEL} (HF safetensors)"]

    def _load_dcp(self, path: str, model_only: bool) -> list[str]:
        error: str | None = None
        try:
            sd, loaded, to_load = self._load_template(path, model_only)
        except CheckpointError as err:
            error, sd, loaded, to_load = str(err), {}, [], []
        _agree(error)
        if not sd:
            return loaded
        try:
            with _quiet_dcp():
                dcp.load(sd, checkpoint_id=path, no_dist=not dist.is_initialized())
        except Exception as err:  # noqa: BLE001 - DCP raises CheckpointException with many lines
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"loading {path} failed: {first}") from err
        if MODEL in loaded:
            self.model.load_state_dict({k: v for k, v in sd.items() if k not in self.states})
        name = os.path.basename(path)
        for state_name in to_load:
            try:
                self.states[state_name].load_state_dict(sd[state_name])
            except ValueError as err:
                if state_name == DATALOADER:
                    error = self._dataloader_mismatch(name, str(err))
                else:
                    error = (
                        f"{path}: cannot restore {state_name}: {err}; skip it with "
                        f"--checkpoint.exclude_from_loading {state_name}"
                    )
                break
            loaded.append(state_name)
        _agree(error)
        return loaded

    def _load_template(self, path: str, model_only: bool) -> tuple[dict[str, Any], list[str], list[str]]:
        """The state dict to load into, after checking it against the checkpoint's metadata."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        try:
            metadata = cu.read_dcp_metadata(path)
        except Exception as err:  # noqa: BLE001 - any read failure is a bad checkpoint
            raise CheckpointError(f"cannot read the DCP metadata of {path}: {err}") from err
        meta = metadata.state_dict_metadata
        name = os.path.basename(path)
        sd: dict[str, Any] = {}
        loaded: list[str] = []
        if MODEL not in self.exclude:
            model_sd = self.model.state_dict()
            missing = [k for k in model_sd if k not in meta]
            if missing:
                raise CheckpointError(
                    f"{path} has no weights for {missing[:3]} ({len(missing)} of {len(model_sd)} "
                    "missing): it was saved from a different model; check model.name/flavor"
                )
            for k, v in model_sd.items():
                m = meta[k]
                if isinstance(m, TensorStorageMetadata) and tuple(m.size) != tuple(v.shape):
                    raise CheckpointError(
                        f"{path}: {k} has shape {tuple(m.size)} but the model expects "
                        f"{tuple(v.shape)}; check model.flavor (and the tokenizer's vocab size)"
                    )
            sd.update(model_sd)
            loaded.append(MODEL)
        elif _rank() == 0:
            logger.info(f"Checkpoint: not loading {MODEL} (checkpoint.exclude_from_loading)")
        to_load: list[str] = []
        fresh: list[str] = []
        skipped: list[str] = []
        for state_name, obj in self.states.items():
            if state_name in self.exclude:
                if _rank() == 0:
                    logger.info(f"Checkpoint: not loading {state_name} (checkpoint.exclude_from_loading)")
                continue
            if model_only:
                skipped.append(state_name)
                continue
            if not any(k.startswith(state_name + ".") for k in meta):
                fresh.append(state_name)
                continue
            template = obj.state_dict()
            missing = [k for k in _flat_keys(template, state_name) if k not in meta]
            if missing:
                if state_name == DATALOADER:
                    raise CheckpointError(self._dataloader_mismatch(name, f"it has no {missing[0]!r}"))
                raise CheckpointError(
                    f"{path}: the saved {state_name} state does not match this run (no "
                    f"{missing[0]!r}); skip it with --checkpoint.exclude_from_loading {state_name}"
                )
            sd[state_name] = template
            to_load.append(state_name)
        if _rank() == 0 and fresh:
            logger.warning(
                f"Checkpoint: {name} has no {', '.join(fresh)} state (a model-only save); "
                "these start fresh"
            )
        if _rank() == 0 and skipped:
            logger.info(
                f"Checkpoint: loading model weights only (checkpoint.initial_load_model_only); "
                f"{', '.join(skipped)} start fresh"
            )
        return sd, loaded, to_load

    @staticmethod
    def _dataloader_mismatch(name: str, detail: str) -> str:
        return (
            f"{name}: the dataloader state was saved with a different data-parallel layout "
            f"({detail}); resume with --checkpoint.exclude_from_loading dataloader to restart the "
            "data stream, or use the original data-parallel degree"
        )

    # --- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        """Finish and commit an in-flight async save, and wait for purging to end."""
        try:
            self._wait_in_flight()
        finally:
            if self._purge_thread is not None:
                self._purge_thread.join()
                self._purge_thread = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None
