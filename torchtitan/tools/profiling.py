"""Profiler traces and CUDA memory snapshots around the training loop.

Both context managers yield an object to ``.step()`` once at the end of every training step
(or None when disabled)::

    with maybe_enable_profiling(cfg.profiling, dump_folder, global_step=step) as prof, \
         maybe_enable_memory_snapshot(cfg.profiling, dump_folder, global_step=step) as mem:
        for ...:
            train_step()
            if prof: prof.step()
            if mem: mem.step()

Files: ``{dump_folder}/{save_traces_folder}/iteration_N/rank{r}_trace.json`` (chrome trace, open
in https://ui.perfetto.dev or chrome://tracing) and
``{dump_folder}/{save_memory_snapshot_folder}/iteration_N[_exit]/rank{r}_memory_snapshot.pickle``
(drag onto https://pytorch.org/memory_viz). ``N`` is the 1-based training step the file covers.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from torchtitan.config.job_config import Profiling
from torchtitan.tools.logging import logger

__all__ = [
    "MEMORY_SNAPSHOT_MAX_ENTRIES",
    "MemoryProfiler",
    "maybe_enable_memory_snapshot",
    "maybe_enable_profiling",
    "periodic_steps_in_run",
    "profiler_schedule_wait",
]

MEMORY_SNAPSHOT_MAX_ENTRIES = 100_000
"""Allocator events kept by ``torch.cuda.memory._record_memory_history``."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def profiler_schedule_wait(cfg: Profiling) -> int:
    """Idle steps in each ``profile_freq`` cycle; ValueError when warmup + active do not fit."""
    if cfg.profile_freq < 1:
        raise ValueError(f"profiling.profile_freq={cfg.profile_freq} must be >= 1")
    if cfg.profiler_active < 1 or cfg.profiler_warmup < 0:
        raise ValueError(
            f"profiling.profiler_active={cfg.profiler_active} must be >= 1 and "
            f"profiling.profiler_warmup={cfg.profiler_warmup} >= 0"
        )
    wait = cfg.profile_freq - (cfg.profiler_active + cfg.profiler_warmup)
    if wait < 0:
        raise ValueError(
            f"profiling.profile_freq={cfg.profile_freq} must be >= profiler_warmup + "
            f"profiler_active = {cfg.profiler_warmup} + {cfg.profiler_active}; raise "
            "profile_freq or lower the warm-up/active steps"
        )
    return wait


def periodic_steps_in_run(freq: int, global_step: int, last_step: int | None) -> bool:
    """True when a step in ``global_step + 1 .. last_step`` is a multiple of ``freq``.

    Traces and snapshots are written on exactly those steps (the profiler schedule is aligned
    on absolute steps, a resumed run included), so False means the run writes none.
    """
    return last_step is None or last_step // freq > global_step // freq


def _warn_no_periodic_step(what: str, cfg: Profiling, global_step: int, last_step: int) -> None:
    if global_step >= last_step:  # no step left to run: nothing to miss
        return
    freq = f"profiling.profile_freq={cfg.profile_freq}"
    why = (f"{freq} > training.steps={last_step}" if global_step == 0 else
           f"this run does steps {global_step + 1}..{last_step} and none is a multiple of {freq}")
    logger.warning(f"{what}: {why}; lower --profiling.profile_freq")


@contextlib.contextmanager
def maybe_enable_profiling(
    cfg: Profiling,
    dump_folder: str,
    *,
    global_step: int = 0,
    last_step: int | None = None,
    rank: int | None = None,
) -> Iterator[torch.profiler.profile | None]:
    """torch.profiler over the loop when ``profiling.enable_profiling``; yields it (or None).

    Every ``profile_freq`` steps the last ``profiler_active`` steps (after ``profiler_warmup``
    warm-up steps) are written as a chrome trace per rank. ``global_step`` is the step already
    done (resume), so folder numbers stay training-step numbers. When no step up to
    ``last_step`` ends a cycle it warns once and yields None.
    """
    if not cfg.enable_profiling:
        yield None
        return
    wait = profiler_schedule_wait(cfg)
    if not periodic_steps_in_run(cfg.profile_freq, global_step, last_step):
        _warn_no_periodic_step("profiling.enable_profiling writes no trace", cfg, global_step, last_step)
        yield None
        return
    rank = _rank() if rank is None else rank
    trace_root = os.path.join(dump_folder, cfg.save_traces_folder)

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        folder = os.path.join(trace_root, f"iteration_{prof.step_num}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{rank}_trace.json")
        start = time.perf_counter()
        prof.export_chrome_trace(path)
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            # torch's exporter swallows a failed write (e.g. a full disk), leaving a .tmp
            with contextlib.suppress(OSError):
                os.remove(f"{path}.tmp")
            free = shutil.disk_usage(folder).free
            logger.warning(f"Profiler trace of step {prof.step_num} could not be written to "
                           f"{path} ({free / 2**20:.0f} MiB free there); training goes on")
            return
        logger.info(f"Profiler trace of step {prof.step_num} written to {path} "
                    f"in {time.perf_counter() - start:.2f} s")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(
        wait=wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active
    )
    prof = torch.profiler.profile(
        activities=activities, schedule=schedule, on_trace_ready=on_trace_ready, record_shapes=True
    )
    # Start the schedule where a resumed run is, so traces land on the same steps.
    prof.step_num = global_step
    prof.current_action = schedule(global_step)
    logger.info(
        f"Profiling every {cfg.profile_freq} steps ({cfg.profiler_warmup} warm-up, "
        f"{cfg.profiler_active} active); traces in {trace_root}"
    )
    with prof:
        try:
            yield prof
        finally:
            # A cycle still open when the loop ends covers no finished step: do not write it.
            prof.on_trace_ready = None


class MemoryProfiler:
    """Records the CUDA caching allocator's history and dumps snapshots.

    ``step()`` after each training step dumps every ``freq`` steps to ``iteration_N``;
    ``dump_exit()`` writes ``iteration_N_exit`` for the step that failed.
    """

    def __init__(self, folder: str, freq: int, global_step: int = 0, rank: int | None = None):
        self.folder = folder
        self.freq = freq
        self.step_num = global_step
        self.rank = _rank() if rank is None else rank
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_SNAPSHOT_MAX_ENTRIES)

    def _dump(self, dir_name: str) -> str:
        folder = os.path.join(self.folder, dir_name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        start = time.perf_counter()
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info(f"Memory snapshot written to {path} in {time.perf_counter() - start:.2f} s")
        return path

    def step(self) -> str | None:
        """Count a finished step; dump on every ``freq``-th. Returns the file written, if any."""
        self.step_num += 1
        if self.step_num % self.freq:
            return None
        return self._dump(f"iteration_{self.step_num}")

    def dump_exit(self) -> str:
        """Dump for the step in progress (``step_num + 1``) after it failed."""
        return self._dump(f"iteration_{self.step_num + 1}_exit")

    def stop(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)


@contextlib.contextmanager
def maybe_enable_memory_snapshot(
    cfg: Profiling,
    dump_folder: str,
    *,
    global_step: int = 0,
    last_step: int | None = None,
    rank: int | None = None,
) -> Iterator[MemoryProfiler | None]:
    """Allocator-history snapshots when ``profiling.enable_memory_snapshot`` (CUDA only).

    On an out-of-memory error the snapshot of the failing step is written to
    ``iteration_N_exit/`` and the error is re-raised. Without CUDA it logs one warning and
    yields None: training goes on without snapshots. When no step up to ``last_step`` is a
    snapshot step it warns (the history is still recorded for the out-of-memory dump).
    """
    if not cfg.enable_memory_snapshot:
        yield None
        return
    if not torch.cuda.is_available():
        logger.warning(
            "profiling.enable_memory_snapshot needs CUDA (the allocator history is CUDA-only); "
            "no memory snapshots on this CPU run, training continues. For CPU memory use "
            "--profiling.enable_profiling"
        )
        yield None
        return
    if cfg.profile_freq < 1:
        raise ValueError(f"profiling.profile_freq={cfg.profile_freq} must be >= 1")
    if not periodic_steps_in_run(cfg.profile_freq, global_step, last_step):
        _warn_no_periodic_step(
            "profiling.enable_memory_snapshot writes a snapshot only on out-of-memory", cfg,
            global_step, last_step,
        )
    folder = os.path.join(dump_folder, cfg.save_memory_snapshot_folder)
    profiler = MemoryProfiler(folder, cfg.profile_freq, global_step, rank)
    logger.info(f"Memory snapshots every {cfg.profile_freq} steps in {folder}")
    try:
        yield profiler
    except torch.OutOfMemoryError:
        try:
            path = profiler.dump_exit()
            logger.error(f"Out of memory at step {profiler.step_num + 1}; snapshot written to {path}")
        except Exception as err:  # noqa: BLE001 - never mask the OOM itself
            logger.error(f"Out of memory at step {profiler.step_num + 1}; snapshot failed: {err}")
        raise
    finally:
        profiler.stop()
