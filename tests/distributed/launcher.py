"""Run a function in N real processes joined by a gloo process group (CPU).

``launch(fn, world_size, *args)`` starts ``world_size`` Python processes with torchrun-style
env vars, runs ``fn(*args)`` in each after ``init_process_group("gloo", timeout=60 s)``, and
returns the per-rank results (pickled back through files). If any rank fails, the others are
killed and ``LaunchError`` carries every failing rank's traceback (or its output tail when it
died without one). A hard wall-clock timeout kills everything. Each worker ends with barrier,
destroy_process_group, flush, ``os._exit`` (gloo can abort in interpreter finalisation
otherwise).

The ranks are forked from a multiprocessing fork server that imported torch and the trainer
once (importing them took each fresh rank ~2.5 s of CPU: most of a short launch). Each forked
rank starts its own session, writes to its own log, and takes the launch's environment;
nothing in the server has run a torch op, started a thread or read a launch variable. With
``env`` overrides (which may matter at import time) or ``TT_LAUNCH_FRESH=1`` the ranks are
fresh interpreters instead (``python -m tests.distributed.launcher``).
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
PG_TIMEOUT_S = 60


class LaunchError(AssertionError):
    """One or more ranks failed or the launch timed out; the message holds their tracebacks."""


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _target_name(fn: Callable[..., Any]) -> str:
    module = fn.__module__
    if module == "__main__" or "<locals>" in fn.__qualname__:
        raise ValueError(
            f"launch target {fn.__qualname__} must be a module-level function of an importable "
            "module (not __main__ or a closure)"
        )
    return f"{module}:{fn.__qualname__}"


def _kill(proc: subprocess.Popen | _ForkedRank) -> None:
    if proc.poll() is None:
        try:  # each worker leads its own process group (its own session), so this
            os.killpg(proc.pid, signal.SIGKILL)  # reaches its helpers too (compile workers)
        except (ProcessLookupError, PermissionError):  # not yet its own group
            os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


_PRELOAD = ["torch", "torch.distributed", "torchtitan.train", "tests.distributed.trainer_runs",
            "tests.distributed.harness"]
_forkserver: Any = None


def _fork_context() -> Any:
    """The fork server's context, started on first use with the heavy imports done once.
    libgomp reads OMP_NUM_THREADS when torch loads it, so the server starts with 1 (what
    fresh ranks default to; a rank sets its own count again after the fork)."""
    global _forkserver
    if _forkserver is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _forkserver = ctx
    return _forkserver


class _ForkedRank:
    """One rank forked from the fork server, with the small part of Popen's API used here."""

    def __init__(self, env: dict[str, str], log: Path):
        self.process = _fork_context().Process(target=_forked_worker, args=(env, str(log)))
        self.process.start()
        self.pid = self.process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self) -> int:
        self.process.join()
        return self.process.exitcode

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode


def _forked_worker(env: dict[str, str], log: str) -> None:
    """A forked rank: its own session (so a kill reaches its helpers), output and environment,
    then the usual worker."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO_ROOT)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    _worker()


def _tail(path: Path, n_chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n_chars:]
    except OSError:
        return "<no output>"


class _NativeCrash(LaunchError):
    """A rank died by a signal of its own (SIGABRT, SIGSEGV...), not by a Python error."""


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    retries_on_native_crash: int = 1,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; returns ``[result of rank 0, ...]``.

    A launch in which a rank died by a signal of its own (an abort or segfault inside gloo's
    C++ threads, which CPU runs of torch 2.13 show rarely and at random: once in hundreds of
    launches) is run again, up to ``retries_on_native_crash`` times, with a warning that holds
    the crash report; Python errors, hangs and a crash that repeats fail at once.
    """
    for attempt in range(retries_on_native_crash + 1):
        try:
            return _launch_once(fn, world_size, args, timeout_s, env)
        except _NativeCrash as crash:
            if attempt == retries_on_native_crash:
                raise LaunchError(str(crash)) from None
            warnings.warn(f"retrying after a native crash: {crash}", stacklevel=2)
    raise AssertionError("unreachable")


def _launch_once(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    timeout_s: float,
    env: dict[str, str] | None,
) -> list[Any]:
    target = _target_name(fn)
    with tempfile.TemporaryDirectory(prefix="tt_launch_") as tmp:
        work = Path(tmp)
        (work / "args.pkl").write_bytes(pickle.dumps(args))
        port = free_port()
        base_env = dict(os.environ)
        base_env.setdefault("OMP_NUM_THREADS", "1")
        base_env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT)] + [p for p in base_env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        base_env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            TT_LAUNCH_TARGET=target,
            TT_LAUNCH_DIR=str(work),
        )
        base_env.update(env or {})
        procs: list[subprocess.Popen | _ForkedRank] = []
        logs = [work / f"log_{rank}.txt" for rank in range(world_size)]
        fresh = env is not None or os.environ.get("TT_LAUNCH_FRESH") == "1"
        try:
            for rank in range(world_size):
                rank_env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
                if not fresh:
                    procs.append(_ForkedRank(rank_env, logs[rank]))
                    continue
                with open(logs[rank], "wb") as log:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "tests.distributed.launcher"],
                            cwd=REPO_ROOT,
                            env=rank_env,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
            deadline = time.monotonic() + timeout_s
            timed_out = False
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                _kill(p)
        codes = [p.returncode for p in procs]
        failures = []
        crashed = False
        for rank, code in enumerate(codes):
            err = work / f"error_{rank}.txt"
            if err.exists():
                failures.append(f"--- rank {rank} (exit {code}) ---\n{err.read_text()}")
            elif code not in (0, -signal.SIGKILL):
                # crashed without a Python traceback (an abort in C++ code, a segfault): the
                # output tail is the only clue, and this rank is usually the first to fail
                crashed = crashed or code < 0
                failures.insert(0, f"--- rank {rank} (exit {code}) output tail ---\n{_tail(logs[rank])}")
        if timed_out or failures or any(c != 0 for c in codes):
            if not failures:  # every failing rank was killed: show their output
                failures = [
                    f"--- rank {r} (exit {c}) output tail ---\n{_tail(logs[r])}"
                    for r, c in enumerate(codes)
                    if c != 0
                ]
            head = (
                f"launch of {target} on {world_size} ranks timed out after {timeout_s:.0f} s"
                if timed_out
                else f"launch of {target} on {world_size} ranks failed (exit codes {codes})"
            )
            error = _NativeCrash if crashed and not timed_out else LaunchError
            raise error(head + "\n" + "\n".join(failures))
        return [pickle.loads((work / f"result_{r}.pkl").read_bytes()) for r in range(world_size)]


def _worker() -> None:
    """Entry point of one rank (``python -m tests.distributed.launcher``)."""
    rank = int(os.environ["RANK"])
    work = Path(os.environ["TT_LAUNCH_DIR"])
    code = 0
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        module_name, qualname = os.environ["TT_LAUNCH_TARGET"].split(":", 1)
        fn: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        args = pickle.loads((work / "args.pkl").read_bytes())
        result = fn(*args)
        (work / f"result_{rank}.pkl").write_bytes(pickle.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report everything, including SystemExit/KeyboardInterrupt
        (work / f"error_{rank}.txt").write_text(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _worker()
