"""Fault injection for the checkpoint crash tests: save hooks that SIGKILL the process mid-save.

In-process: ``CheckpointManager(..., save_hooks=KillDuringSave(4, "write"))``. For a trainer run
as a subprocess, ``kill_env(15)`` gives the environment that makes its CheckpointManager import
``KillDuringSave`` through ``TORCHTITAN_CHECKPOINT_HOOKS`` (the step and phase go in
``TORCHTITAN_TEST_KILL_AT=N[:phase]``).

Phases: ``write`` kills after every data file is written but before DCP's ``.metadata``;
``commit`` (default) kills after ``.metadata``, before the commit marker and rename.

``DiskFull`` makes the save of step ``TORCHTITAN_TEST_DISK_FULL_AT`` fail like a full disk
(``OSError(ENOSPC)`` once its data files are written, inside DCP's write).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from pathlib import Path

from torchtitan.components.checkpoint import HOOKS_ENV, SaveHooks

KILL_AT_ENV = "TORCHTITAN_TEST_KILL_AT"
DISK_FULL_ENV = "TORCHTITAN_TEST_DISK_FULL_AT"
REPO = Path(__file__).resolve().parents[1]
PHASES = ("write", "commit")


class KillDuringSave(SaveHooks):
    """SIGKILL this process while saving ``step``, at ``phase``. Without arguments, both come
    from ``TORCHTITAN_TEST_KILL_AT`` (``N`` or ``N:phase``)."""

    def __init__(self, step: int | None = None, phase: str = "commit") -> None:
        if step is None:
            spec = os.environ[KILL_AT_ENV]
            want_step, _, want_phase = spec.partition(":")
            step, phase = int(want_step), want_phase or "commit"
        if phase not in PHASES:
            raise ValueError(f"kill phase {phase!r}: use one of {PHASES}")
        self.step = step
        self.phase = phase

    def _maybe_kill(self, step: int, phase: str) -> None:
        if step == self.step and phase == self.phase:
            print(f"KillDuringSave: killing this process while saving step {step} ({phase})",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def data_written(self, step: int, path: str) -> None:
        self._maybe_kill(step, "write")

    def before_commit(self, step: int, path: str) -> None:
        self._maybe_kill(step, "commit")


def kill_env(step: int, phase: str = "commit") -> dict[str, str]:
    """Environment for a subprocess whose checkpoint saves are killed at ``step``/``phase``."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {
        HOOKS_ENV: "tests.checkpoint_kill_hook:KillDuringSave",
        KILL_AT_ENV: f"{step}:{phase}",
        "PYTHONPATH": path,
    }


class DiskFull(SaveHooks):
    """Fail the save of ``step`` (default: ``TORCHTITAN_TEST_DISK_FULL_AT``) with ENOSPC."""

    def __init__(self, step: int | None = None) -> None:
        self.step = int(os.environ[DISK_FULL_ENV]) if step is None else step

    def data_written(self, step: int, path: str) -> None:
        if step == self.step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(path, "__0_0.distcp"))
