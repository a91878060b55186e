"""Ctrl-C (SIGINT) without tracebacks; no torch import (the launcher needs it before torch).

* **At start-up** a trainer process started as a program (``python -m torchtitan.train`` or
  ``python torchtitan/train.py``, which import this module first) gives SIGINT its default
  action: until the training loop takes Ctrl-C over (``lifecycle.Preemption``: a checkpoint,
  then stop), Ctrl-C ends the process at once. There is nothing to save yet, and a
  KeyboardInterrupt inside the imports (torch takes seconds) prints tracebacks.
* **In the launcher** (``ForwardedInterrupts``) each Ctrl-C goes on to the ranks, which torchrun
  starts in their own sessions (the terminal's Ctrl-C reaches only the launcher).
* **A run stopped by Ctrl-C** ends killed by SIGINT (``end_as_interrupted``): the shell shows
  status 130 (``INTERRUPTED``) and stops a script or an ``&&`` chain, as after any program.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

INTERRUPTED = 130
"""Exit status of a run stopped by Ctrl-C (128 + SIGINT, what the shell shows)."""
ABORT_GRACE_S = 5.0
"""After a second Ctrl-C, the launcher SIGKILLs the ranks still running this long after it."""


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def _started_as_trainer() -> bool:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return spec.name == "torchtitan.train"
    path = os.path.abspath(getattr(main, "__file__", "") or "")
    return path.endswith(os.path.join("torchtitan", "train.py"))


if _started_as_trainer() and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; empty elsewhere)."""
    kids = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            if len(fields) > 1 and int(fields[1]) == pid:
                kids.append(int(name))
    return kids


@contextlib.contextmanager
def uninterruptible() -> Iterator[None]:
    """A section that Ctrl-C must not cut in half (the renames of a checkpoint's commit): while
    SIGINT has its default action (start-up, or after a first Ctrl-C), a SIGINT arriving inside
    takes effect at its end."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.SIG_DFL
    ):
        yield
        return
    pending: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if pending:
            os.kill(os.getpid(), signal.SIGINT)


def end_as_interrupted() -> None:
    """End this process as a program stopped by Ctrl-C ends: killed by SIGINT (an exit(130)
    would let a shell script go on to its next command)."""
    import logging

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    for handler in logging.getLogger("torchtitan").handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


class ForwardedInterrupts:
    """In the launcher: each Ctrl-C is sent on to the ranks. The first asks them to stop after
    the step (with a checkpoint); the second stops them at once (SIGKILL for any rank still
    running ``ABORT_GRACE_S`` later). Before any rank exists, the launcher ends at once (nothing
    to save). ``count``: how many reached running ranks. ``restore()`` puts the old handler back."""

    def __init__(self) -> None:
        self.count = 0
        self._previous = signal.signal(signal.SIGINT, self._handler)

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _handler(self, signum, frame) -> None:  # noqa: ARG002
        ranks = child_pids(os.getpid())
        if not ranks:
            _say("Ctrl-C before training started: stopped; nothing was saved")
            end_as_interrupted()
            return
        self.count += 1
        if self.count == 1:
            _say(
                f"Ctrl-C: stopping {len(ranks)} rank(s); once training, they first finish the "
                "step and save a checkpoint (if enabled). Ctrl-C again stops them at once, "
                "without saving"
            )
        else:
            _say(f"Ctrl-C: stopping {len(ranks)} rank(s) at once, without saving")
            timer = threading.Timer(ABORT_GRACE_S, _kill_children)
            timer.daemon = True
            timer.start()
        for pid in ranks:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGINT)


def _say(text: str) -> None:
    print(f"torchtitan.launch: {text}", file=sys.stderr, flush=True)


def _kill_children() -> None:
    for pid in child_pids(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
