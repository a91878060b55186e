"""How a rank ends: preemption (SIGTERM), Ctrl-C (SIGINT) and the death of its launcher.

**Preemption.** SIGTERM sets a flag; the ranks agree on it at the end of every step (an
all-reduce), save that step and exit 0. A single process (no process group) does not wait for
the step to end: the signal aborts the step in progress at the next Python-level operation of
its forward/backward, and the last *completed* step is saved with the data position and RNG
state taken before the aborted step began, so the resumed run is bitwise the same. (Several
ranks cannot abort a step safely: a rank would leave its peers inside a collective.)

**Ctrl-C.** In the training loop the first SIGINT is a stop request like SIGTERM (same
agreement, same save); the run then ends as interrupted (interrupts.py: killed by SIGINT, status
130). It also gives SIGINT its default action back, so a second Ctrl-C ends the process at once
in the kernel (no Python, no traceback, even inside a collective), except inside
``interrupts.uninterruptible()`` (a checkpoint's commit renames), which finishes first.

**Launcher death.** Under torchrun a rank asks the kernel to SIGKILL it when its parent (the
torchrun agent) dies (``prctl(PR_SET_PDEATHSIG)``, Linux), and checks that the parent is still
there, so a ``kill -9`` of the launcher never leaves ranks training and writing checkpoints.
Elsewhere a thread polls the parent pid and exits the process when it changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from torchtitan.tools.interrupts import child_pids as _children
from torchtitan.tools.interrupts import under_torchrun
from torchtitan.tools.logging import logger

PR_SET_PDEATHSIG = 1


class Preempted(BaseException):
    """Raised by the SIGTERM / SIGINT handler inside an abortable section (single process
    only); a BaseException so that no ``except Exception`` on the way swallows it."""


class Preemption:
    """The stop flag (SIGTERM or Ctrl-C), the abortable section of a step and the ranks'
    agreement."""

    def __init__(self) -> None:
        self.requested = False
        self.interrupted = False
        """A Ctrl-C (SIGINT) asked for the stop: the run ends with ``INTERRUPTED``."""
        self.cause = "SIGTERM"
        """What asked first, for the log line: ``SIGTERM`` or ``Ctrl-C``."""
        self.received_at: float | None = None
        self._abortable = False
        self._previous: dict[int, object] = {}
        self.can_abort = not (dist.is_initialized() and dist.get_world_size() > 1)

    def install(self) -> None:
        def handler(signum, frame):  # noqa: ARG001
            if not self.requested:
                self.received_at = time.monotonic()
                self.cause = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
            self.requested = True
            if signum == signal.SIGINT and not self.interrupted:
                self.interrupted = True
                signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends it at once
                if not under_torchrun():  # else the launcher says it
                    logger.warning(
                        "Ctrl-C: stopping, with a checkpoint if checkpointing is on; Ctrl-C "
                        "again stops at once, without saving"
                    )
            if self._abortable and self.can_abort:
                self._abortable = False
                raise Preempted()

        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread
                self._previous[sig] = signal.signal(sig, handler)

    def uninstall(self) -> None:
        """Put back the handlers that were there before ``install``."""
        for sig, previous in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, previous)
        self._previous.clear()

    @contextlib.contextmanager
    def abortable(self) -> Iterator[None]:
        """A section that SIGTERM may abort (forward/backward: nothing is updated yet)."""
        if self.requested and self.can_abort:
            raise Preempted()
        self._abortable = True
        try:
            yield
        finally:
            self._abortable = False

    def agreed(self, device: torch.device) -> bool:
        """True on every rank once any rank received SIGTERM or Ctrl-C."""
        if not dist.is_initialized():
            return self.requested
        flag = torch.tensor([float(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def stopped_at_once(self, err: BaseException) -> bool:
        """True, with one line saying so, when ``err`` is a collective broken by ranks that a
        Ctrl-C stopped at once: two quick Ctrl-Cs reach a rank busy in a collective (a
        checkpoint save, say) as one signal, its peers die and its collective breaks. That is
        the stop the user asked for, not an error."""
        from torchtitan.tools.error_file import is_peer_failure

        if not (self.interrupted and is_peer_failure(err)):
            return False
        logger.warning("Ctrl-C: stopped at once, without saving (another rank stopped first)")
        return True

    def waited(self) -> str:
        if self.received_at is None:
            return ""
        return f" {time.monotonic() - self.received_at:.1f} s after the signal"


def die_with_launcher() -> None:
    """Under torchrun, end this rank when the launcher (its parent) dies."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()


def _watch_parent(parent: int, poll_s: float = 1.0) -> None:
    while True:
        time.sleep(poll_s)
        if os.getppid() != parent:
            _orphaned(parent)


def _orphaned(parent: int) -> None:
    logger.error(f"the launcher (pid {parent}) is gone; stopping this rank")
    for handler in logger.handlers:
        handler.flush()
    os._exit(1)


def forward_sigterm_to_ranks() -> bool:
    """In the launcher: on SIGTERM, send SIGTERM to its children (the ranks) and keep waiting
    for them instead of tearing them down after torchrun's fixed grace period. The ranks save
    and exit 0, so the launcher exits 0. False when children cannot be listed (no /proc)."""
    if not os.path.isdir("/proc/self"):
        return False

    def handler(signum, frame):  # noqa: ARG001
        ranks = _children(os.getpid())
        print(
            f"torchtitan.launch: SIGTERM: asking {len(ranks)} rank(s) to save a checkpoint and stop",
            file=sys.stderr,
            flush=True,
        )
        for pid in ranks:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)
    return True


def honour_shutdown_timeout_on_failure(timeout: int) -> None:
    """torchrun (torch 2.11-2.13) tears the other ranks down after a rank failed with a fixed 30 s
    grace, ignoring ``--shutdown-timeout`` (``PContext.close``'s default, and the agent's
    ``_stop_workers``); a rank that is stopped or hung then delays the end of the job by 30 s.
    Make those paths use ``timeout`` too."""
    try:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        from torch.distributed.elastic.multiprocessing.api import PContext
    except ImportError:
        return
    if getattr(PContext, "_titan_timeout", None) is not None:
        PContext._titan_timeout = timeout
        return
    original_close = PContext.close

    def close(self, death_sig=None, timeout=None):  # noqa: ANN001 - torchrun's signature
        return original_close(self, death_sig, PContext._titan_timeout if timeout is None else timeout)

    # torch < 2.13: _shutdown takes no timeout and closes with timeout None (the patched close)
    shutdown_takes_timeout = "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters

    def _stop_workers(self, worker_group) -> None:  # noqa: ARG001 - torchrun's signature
        if shutdown_takes_timeout:
            self._shutdown(timeout=PContext._titan_timeout)
        else:
            self._shutdown()

    PContext._titan_timeout = timeout
    PContext.close = close
    LocalElasticAgent._stop_workers = _stop_workers
