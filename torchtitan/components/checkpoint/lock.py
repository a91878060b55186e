"""One writer per checkpoint folder: ``{folder}/.writer.lock`` names the job that saves there.

Rank 0 of a run that saves creates the lock (``O_EXCL``) with its host, pid and the pid's start
time, and removes it at the end. A second run on the same folder stops with one line naming the
holder. A lock left by a process that is gone is taken over with a warning: on the same host
when the pid no longer runs (or runs another program: the start time differs); from another
host when the holder has not refreshed it (a heartbeat every ``HEARTBEAT_S``) for ``STALE_S``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from typing import Any

from torchtitan.components.checkpoint.common import agree, rank
from torchtitan.tools.logging import logger

LOCK_NAME = ".writer.lock"
HEARTBEAT_S = 30.0
STALE_S = 120.0


def _start_ticks(pid: int) -> str | None:
    """The process start time (clock ticks since boot) from /proc; None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def _alive(pid: int, ticks: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        if "\nState:\tZ" in f.read():
            return False  # exited; its parent has not reaped it yet
    now = _start_ticks(pid)
    return ticks is None or now is None or now == ticks


def _me() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start_ticks": _start_ticks(os.getpid()),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


class FolderLock:
    """The writer lock of one checkpoint folder (acquire on every rank; rank 0 does the work)."""

    def __init__(self, folder: str, owner: str = "") -> None:
        """``owner``: a writer sharing the folder by design gets its own lock, e.g. each
        fault-tolerant replica group (they take turns writing; see fault_tolerance.md)."""
        self.folder = folder
        self.path = os.path.join(folder, LOCK_NAME + (f".{owner}" if owner else ""))
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        error = None
        if rank() == 0:
            try:
                self._acquire()
            except RuntimeError as err:
                error = str(err)
        agree(error)

    def _acquire(self) -> None:
        me = _me()
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder is not None and self._is_me(holder):
                    break  # this process already holds it (another manager object)
                stale = self._stale_reason(holder)
                if not stale:
                    raise RuntimeError(self._busy(holder)) from None
                logger.warning(f"Checkpoint: taking over the writer lock {self.path}: {stale}")
                self._replace(me)
                if self._is_me(self._read() or {}):
                    break
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            break
        else:
            raise RuntimeError(self._busy(self._read()))
        self.held = True
        self._thread = threading.Thread(target=self._heartbeat, name="ckpt-lock", daemon=True)
        self._thread.start()

    def _read(self) -> dict[str, Any] | None:
        for _ in range(5):  # the holder may be writing it right now
            try:
                with open(self.path) as f:
                    data = json.load(f)
                return data if isinstance(data, dict) else None
            except FileNotFoundError:
                return {}
            except (OSError, ValueError):
                time.sleep(0.05)
        return None

    @staticmethod
    def _is_me(holder: dict[str, Any]) -> bool:
        return holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()

    def _stale_reason(self, holder: dict[str, Any] | None) -> str:
        if not holder:
            return "it is empty or unreadable"
        host, pid = holder.get("host"), holder.get("pid")
        if host == socket.gethostname() and isinstance(pid, int):
            if not _alive(pid, holder.get("start_ticks")):
                return f"its holder, pid {pid} on {host}, is no longer running"
            return ""
        with contextlib.suppress(OSError):
            age = time.time() - os.path.getmtime(self.path)
            if age > STALE_S:
                return f"its holder, pid {pid} on {host}, has not refreshed it for {age:.0f} s"
        return ""

    def _busy(self, holder: dict[str, Any] | None) -> str:
        h = holder or {}
        return (
            f"the checkpoint folder {self.folder} is in use by another job (pid {h.get('pid')} on "
            f"host {h.get('host')}, since {h.get('since')}): two jobs must not write one folder. "
            f"Stop that job, or use another job.dump_folder; if it is dead, delete {self.path} "
            f"(a lock from another host also expires {STALE_S:.0f} s after its last refresh)"
        )

    def _replace(self, me: dict[str, Any]) -> None:
        tmp = f"{self.path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(me, f)
        os.replace(tmp, self.path)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Remove the lock if this process still holds it."""
        if not self.held:
            return
        self._stop.set()
        self.held = False
        holder = self._read()
        if holder and self._is_me(holder):
            with contextlib.suppress(OSError):
                os.remove(self.path)
