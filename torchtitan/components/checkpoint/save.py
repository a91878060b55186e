"""Writing checkpoints: synchronous and async DCP saves, the commit, and purging old ones.

Each save is written to ``step-N.tmp``; every rank records the CRC32 of the files it wrote
(in the writing thread: for async saves off the training thread); once every rank finished
writing, rank 0 commits it (``fs.commit_checkpoint``: marker with sizes and checksums + rename).
Async saves run on their own gloo process group (DCP's collectives must not interleave with
training collectives) and are committed when the background write has finished on every rank
(the ranks agree on it, so they commit, and fail, together). A failed save (disk full, ...) is
one ``CheckpointError`` line naming the path and the OS error; the partial ``step-N.tmp`` is
removed and older checkpoints are untouched. ``SaveHooks`` are called at each phase (hooks.py).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchtitan.components.checkpoint import fs
from torchtitan.components.checkpoint.common import (
    CheckpointError,
    agree,
    barrier,
    quiet_dcp,
    rank,
    world_size,
)
from torchtitan.components.checkpoint.hooks import SaveHooks
from torchtitan.components.checkpoint.integrity import (
    describe_os_error,
    describe_save_failure,
    is_fatal_interrupt,
    root_os_error,
)
from torchtitan.tools.interrupts import uninterruptible
from torchtitan.tools.logging import logger


@dataclass
class InFlightSave:
    """An async save whose background write may still be running."""

    step: int
    tmp: str
    """The ``step-N.tmp`` folder being written."""
    final: str
    """The ``step-N`` folder it becomes when committed."""
    upload: Any
    """Future of the background write (``.result()`` raises its error)."""
    staging: Any | None
    """Future of the copy into pinned memory (None unless async_with_pinned_mem)."""
    info: dict[str, Any]
    """What the commit marker records (step, model_only, states, world_size)."""
    begin: float
    """``time.perf_counter()`` when the save started."""


class _Writer(dcp.FileSystemWriter):
    """A FileSystemWriter that records the CRC32 of each rank's files right after writing them
    and reports when every data file is written, before ``.metadata``."""

    def __init__(self, path: str, on_data_written: Callable[[], None] | None) -> None:
        super().__init__(path)
        self._dir = path
        self._on_data_written = on_data_written

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        results = future.wait()
        fs.write_checksum_sidecar(self._dir, rank(), [r.storage_data.relative_path for r in results])
        return future

    def finish(self, metadata, results):  # runs on the coordinator before .metadata is written
        if self._on_data_written is not None:
            self._on_data_written()
        return super().finish(metadata, results)


class CheckpointSaver:
    """Writes, commits and purges the checkpoints of one folder.

    Args:
        folder: the checkpoint folder (``{dump_folder}/{checkpoint.folder}``).
        keep_latest_k: complete checkpoints to keep (0: all).
        async_mode: ``disabled``, ``async`` or ``async_with_pinned_mem`` (already validated).
        background: whether async saves will happen (creates the gloo group and the stager).
        hooks: called at each phase of a save; None: no hooks.
    """

    def __init__(
        self,
        folder: str,
        keep_latest_k: int,
        async_mode: str,
        background: bool,
        hooks: SaveHooks | None = None,
    ) -> None:
        self.folder = folder
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self.hooks = hooks if hooks is not None else SaveHooks()
        self._observe_writes = hooks is not None
        self._pg = None
        self._stager = None
        self.in_flight: InFlightSave | None = None
        self._purge_thread: threading.Thread | None = None
        self.written: set[str] = set()
        """``step-N`` folders this run committed (a later save of that step replaces them)."""
        self.protected: set[str] = set()
        """Folders never purged: checkpoints found damaged, or pre-existing under start_fresh."""
        if background:
            if dist.is_initialized():
                # DCP's collectives must not interleave with training collectives on one group.
                self._pg = dist.new_group(backend="gloo")
            if async_mode == "async_with_pinned_mem":
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                self._stager = DefaultStager(StagingOptions(True, False, True, True))

    def _prepare_tmp(self, step: int) -> tuple[str, str]:
        final = os.path.join(self.folder, fs.step_dir_name(step))
        tmp = final + fs.TMP_SUFFIX
        error = None
        if rank() == 0:
            try:
                os.makedirs(self.folder, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
            except OSError as err:
                error = str(self._failed(step, tmp, err))
        agree(error)
        return tmp, final

    def _writer(self, tmp: str, step: int) -> dcp.FileSystemWriter:
        on_written = (lambda: self.hooks.data_written(step, tmp)) if self._observe_writes else None
        return _Writer(tmp, on_written)

    def _commit(self, step: int, tmp: str, final: str, info: dict[str, Any]) -> None:
        """Rank 0: write the marker, rename (an existing ``step-N`` this run did not write is
        moved aside, never deleted), tell the hooks."""
        with uninterruptible():  # a second Ctrl-C waits for the renames
            aside = fs.commit_checkpoint(tmp, final, info, replace=os.path.abspath(final) in self.written)
        self.written.add(os.path.abspath(final))
        # a damaged or pre-existing step-N protected at this path went aside: its protection
        # goes with it, and the checkpoint now here is this run's, purged like the others
        self.protected.discard(os.path.abspath(final))
        if aside is not None:
            self.protected.add(os.path.abspath(aside))
            logger.warning(
                f"Checkpoint: {final} already existed (not written by this run); kept it as {aside} "
                "(never loaded or purged: delete it once you no longer need it)"
            )
        self.hooks.after_commit(step, final)

    def _failed(self, step: int, tmp: str, err: BaseException) -> CheckpointError:
        """Remove the partial write (rank 0) and describe the failure in one line."""
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        intact = [e.step for e in fs.complete_checkpoints(self.folder)]
        return CheckpointError(describe_save_failure(step, tmp, err, intact))

    def save_sync(
        self,
        step: int,
        sd: dict[str, Any],
        info: dict[str, Any],
        export: Callable[[str], None] | None = None,
    ) -> None:
        """Write ``sd`` as ``step-N`` and commit it before returning. ``export(tmp)`` runs on
        rank 0 after every rank has written and before the commit (its files are committed too).
        Call only when no async save is in flight."""
        begin = time.perf_counter()
        tmp, final = self._prepare_tmp(step)
        try:
            with quiet_dcp():
                dcp.save(sd, storage_writer=self._writer(tmp, step), no_dist=not dist.is_initialized())
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            if is_fatal_interrupt(err):
                raise
            raise self._failed(step, tmp, err) from None
        barrier()  # every rank has written its files
        self.hooks.before_commit(step, tmp)
        error = None
        if rank() == 0:
            try:
                if export is not None:
                    export(tmp)
                self._commit(step, tmp, final, {**info, "world_size": world_size()})
            except OSError as err:
                error = str(self._failed(step, tmp, err))
        agree(error)  # every rank raises together (none waits in a barrier for rank 0)
        barrier()
        if rank() == 0:
            kind = "model-only checkpoint" if info["model_only"] else "checkpoint"
            logger.info(
                f"Checkpoint: saved {kind} step-{step} to {final} in {time.perf_counter() - begin:.2f} s"
            )
            self.purge()

    def save_async(self, step: int, sd: dict[str, Any], info: dict[str, Any]) -> None:
        """Start writing ``sd`` in the background (after finishing the previous async save)."""
        self.wait()
        begin = time.perf_counter()
        tmp, final = self._prepare_tmp(step)
        kwargs: dict[str, Any] = {"no_dist": not dist.is_initialized()}
        if self._pg is not None:
            kwargs["process_group"] = self._pg
        if self._stager is not None:
            kwargs["async_stager"] = self._stager
        try:
            with quiet_dcp():
                result = dcp.async_save(sd, storage_writer=self._writer(tmp, step), **kwargs)
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            if is_fatal_interrupt(err):
                raise
            raise self._failed(step, tmp, err) from None
        self.in_flight = InFlightSave(
            step=step,
            tmp=tmp,
            final=final,
            upload=getattr(result, "upload_completion", result),
            staging=getattr(result, "staging_completion", None),
            info={**info, "world_size": world_size()},
            begin=begin,
        )
        if rank() == 0:
            logger.info(
                f"Checkpoint: async save of step-{step} started "
                f"(blocked training {time.perf_counter() - begin:.2f} s)"
            )

    def _finish_in_flight(self) -> None:
        job = self.in_flight
        assert job is not None
        self.in_flight = None
        error = None
        try:
            job.upload.result()
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            if is_fatal_interrupt(err):
                raise
            error = str(self._failed(job.step, job.tmp, err))
        agree(error)
        self.hooks.before_commit(job.step, job.tmp)
        if rank() == 0:
            # Rank 0's DCP finish gathered every rank's write results: all files are on disk.
            try:
                self._commit(job.step, job.tmp, job.final, job.info)
            except OSError as err:
                error = str(self._failed(job.step, job.tmp, err))
        agree(error)
        if rank() == 0:
            logger.info(
                f"Checkpoint: committed async step-{job.step} to {job.final} "
                f"({time.perf_counter() - job.begin:.2f} s after it started)"
            )
            self.purge()

    def wait(self) -> None:
        """Finish and commit the in-flight async save, if any."""
        if self.in_flight is not None:
            self._finish_in_flight()

    def maybe_wait_for_staging(self) -> None:
        """Wait until an async save has copied the weights (pinned-memory mode), and commit a
        background write that has finished."""
        job = self.in_flight
        if job is None:
            return
        if job.staging is not None:
            job.staging.result()
        if _all_ranks(job.upload.done()):
            self._finish_in_flight()

    def purge(self) -> None:
        """Delete checkpoints beyond keep_latest_k (rank 0, in a background thread)."""
        k = self.keep_latest_k
        if k <= 0:
            return
        if self._purge_thread is not None:
            self._purge_thread.join()
        protect = [self.in_flight.tmp] if self.in_flight else []
        protect += sorted(self.protected)
        doomed = fs.purge_candidates(self.folder, k, protect)
        if not doomed:
            return

        def run() -> None:
            for path in doomed:
                logger.info(f"Checkpoint: keep_latest_k={k}: deleting {path}")
                fs.delete_checkpoint(path)

        self._purge_thread = threading.Thread(target=run, name="checkpoint-purge", daemon=True)
        self._purge_thread.start()

    def close(self) -> None:
        """Finish and commit an in-flight async save, and wait for purging to end."""
        try:
            self.wait()
        finally:
            if self._purge_thread is not None:
                self._purge_thread.join()
                self._purge_thread = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None


def _all_ranks(flag: bool) -> bool:
    """True when ``flag`` is True on every rank (a MIN all-reduce; identity in one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def save_dcp_single_process(
    state_dict: dict[str, Any], path: str, info: dict[str, Any]
) -> str | None:
    """Write ``state_dict`` as a committed DCP checkpoint at ``path`` from one process; a
    checkpoint already there is moved aside (returns its new name), an empty folder replaced."""
    path = path.rstrip("/") or path
    tmp = path + fs.TMP_SUFFIX
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(tmp)), exist_ok=True)
    try:
        with quiet_dcp():
            dcp.save(state_dict, checkpoint_id=tmp, no_dist=True)
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        shutil.rmtree(tmp, ignore_errors=True)
        cause = root_os_error(err)
        if cause is None or is_fatal_interrupt(err):
            raise
        raise OSError(f"cannot write {tmp}: {describe_os_error(cause)}") from None
    if os.path.isdir(path) and not os.listdir(path):
        os.rmdir(path)
    return fs.commit_checkpoint(tmp, path, info)
