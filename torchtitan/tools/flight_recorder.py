"""Flight Recorder: dump every rank's collective trace when a collective times out, then exit.

torch's Flight Recorder (FR) keeps the last ``comm.trace_buf_size`` collectives of each rank
(op, process group, sequence id, sizes, Python stack). On NCCL the PG watchdog dumps it on a
timeout when the ``TORCH_NCCL_*`` variables set by :func:`configure_env` are present. Gloo records
the same entries but has no watchdog, so :class:`CollectiveWatchdog` does that job:

* the rank whose collective raises (gloo raises after the PG timeout) dumps its trace, asks every
  other rank through the c10d store to dump too, waits (bounded) for their summaries and exits
  non-zero with one line naming the stalled collective and the rank(s) that never joined it;
* every other rank's watchdog thread sees the request (also while its main thread is stuck or
  sleeping), dumps its trace, publishes what it last called and exits non-zero.

Dumps are FR pickles at ``{dump_folder}/{comm.save_traces_folder}/{comm.save_traces_file_prefix}{rank}``
with ``pg_config`` filled in, so torch's analyser reads them directly::

    python -m torch.distributed.flight_recorder.fr_trace outputs/comm_traces -p rank_
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.config.job_config import Comm
from torchtitan.tools.logging import logger

__all__ = [
    "CollectiveWatchdog",
    "configure_env",
    "dump_trace",
    "fix_pg_config",
    "is_collective_failure",
    "last_collectives",
    "read_trace",
    "set_buffer_size",
    "trace_path",
]

_STORE_PREFIX = "torchtitan_fr/"
EXIT_CODE = 3
"""Exit status of a rank stopped by a collective timeout (1 is a training error, 2 a user error)."""

_FAILURE_PATTERNS = re.compile(
    r"timed out|timeout|connection closed by peer|connection reset by peer|broken pipe|"
    r"collective operation|nccl|gloo",
    re.IGNORECASE,
)


def trace_path(comm: Comm, dump_folder: str, rank: int) -> str:
    """Where ``rank`` writes its Flight Recorder dump."""
    return os.path.join(dump_folder, comm.save_traces_folder, f"{comm.save_traces_file_prefix}{rank}")


def configure_env(comm: Comm, dump_folder: str, device_type: str) -> None:
    """Set the Flight Recorder environment; call before ``init_process_group``.

    ``comm.trace_buf_size`` entries are kept per rank (0 turns FR off). On CUDA, NCCL's watchdog
    is told to dump to ``{dump_folder}/{save_traces_folder}/{prefix}<rank>`` on a timeout.
    The buffer size is always the config's (:func:`set_buffer_size`); ``TORCH_NCCL_*``
    variables the user set are left alone (a differing dump path with one warning)."""
    set_buffer_size(comm)
    if device_type != "cuda" or comm.trace_buf_size <= 0:
        return
    folder = os.path.join(dump_folder, comm.save_traces_folder)
    os.makedirs(folder, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    ours = os.path.join(folder, comm.save_traces_file_prefix)
    exported = os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", ours)
    if exported != ours and os.environ.get("RANK", "0") == "0":
        logger.warning(
            f"TORCH_NCCL_DEBUG_INFO_TEMP_FILE={exported} from the environment: NCCL's watchdog "
            f"dumps go there (<that prefix><rank>), not to comm.save_traces_folder "
            f"({ours}<rank>); unset it to use the config's"
        )
    # FR dumps need the "skip clean-up" error handling mode (pytorch issue 121055).
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")


def set_buffer_size(comm: Comm) -> None:
    """Set ``TORCH_FR_BUFFER_SIZE`` to ``comm.trace_buf_size``, which wins over the environment.

    The config is what the run records and what the watchdog relies on (0 = no entries), so a
    differing exported value is overridden with one warning (rank 0) naming both.
    """
    value = comm.trace_buf_size
    # either name (TORCH_NCCL_TRACE_BUFFER_SIZE: deprecated since torch 2.8, loses to the new)
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        exported = os.environ.get(name)
        if exported is None or exported.strip() == str(value):
            continue
        if os.environ.get("RANK", "0") == "0":
            logger.warning(
                f"{name}={exported} from the environment is overridden by comm.trace_buf_size="
                f"{value}: Flight Recorder keeps {value} entries per rank; to keep the exported "
                f"size pass --comm.trace_buf_size {exported}"
            )
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(value)


def is_collective_failure(err: BaseException) -> bool:
    """True for the errors a timed-out or broken collective raises (gloo, NCCL, c10d)."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    return isinstance(err, RuntimeError) and bool(_FAILURE_PATTERNS.search(str(err)))


def _raw_trace(include_stack_traces: bool = True) -> dict[str, Any] | None:
    c10d = torch._C._distributed_c10d
    dump_fn: Callable[..., bytes] | None = getattr(c10d, "_dump_fr_trace", None) or getattr(
        c10d, "_dump_nccl_trace", None
    )
    if dump_fn is None:
        return None
    try:
        return pickle.loads(dump_fn(includeStackTraces=include_stack_traces))
    except Exception as err:  # noqa: BLE001 - a failed dump must not mask the real error
        logger.warning(f"Flight Recorder dump failed: {err}")
        return None


def _process_groups() -> dict[str, dict[str, str]]:
    """``pg_config`` as torch's analyser expects it: group name -> name, desc, global ranks."""
    config: dict[str, dict[str, str]] = {}
    if not dist.is_initialized():
        return config
    world = dist.distributed_c10d._world
    for pg, name in list(world.pg_names.items()):
        ranks = sorted(world.pg_group_ranks.get(pg, {}))
        desc = getattr(pg, "group_desc", "") or ("default_pg" if pg is world.default_pg else name)
        config[name] = {"name": name, "desc": desc, "ranks": str(ranks)}
    return config


def fix_pg_config(trace: dict[str, Any], pg_config: dict[str, dict[str, str]] | None = None) -> dict:
    """Repair ``pg_config`` of a gloo FR dump (torch 2.13 writes one entry keyed ``''``).

    Uses ``pg_config`` when given (this process's groups), else rebuilds entries from the
    groups named in the trace's entries (ranks taken from the broken entry, which only holds
    them for the default group). Returns ``trace`` (modified in place).
    """
    current = trace.get("pg_config") or {}
    if pg_config:
        current = {k: v for k, v in current.items() if k}
        current.update(pg_config)
    named = {e["process_group"][0]: e["process_group"][1] for e in trace.get("entries", [])}
    broken = current.pop("", None)
    for name, desc in named.items():
        if name not in current:
            ranks = broken["ranks"] if broken and broken.get("ranks") not in (None, "[]") else "[]"
            current[name] = {"name": name, "desc": desc, "ranks": ranks}
    trace["pg_config"] = current
    return trace


def read_trace(path: str) -> dict[str, Any]:
    """Load a Flight Recorder dump (pickle) written by :func:`dump_trace` or NCCL."""
    with open(path, "rb") as f:
        return pickle.load(f)


def dump_trace(path: str) -> str | None:
    """Write this rank's Flight Recorder trace (pickle, analyser-ready) to ``path``.

    Returns the path, or None when this build has no Flight Recorder or the dump failed.
    """
    trace = _raw_trace(include_stack_traces=True)
    if trace is None:
        return None
    fix_pg_config(trace, _process_groups())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(trace, f)
    os.replace(tmp, path)
    return path


def last_collectives(trace: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per process group (by name): the last collective this rank issued on it."""
    out: dict[str, dict[str, Any]] = {}
    if not trace:
        return out
    for e in trace.get("entries", []):
        name, desc = e["process_group"]
        seq = e["p2p_seq_id"] if e.get("is_p2p") else e["collective_seq_id"]
        prev = out.get(name)
        if prev is None or e["record_id"] > prev["record_id"]:
            out[name] = {
                "record_id": e["record_id"],
                "desc": desc,
                "seq": seq,
                "p2p": bool(e.get("is_p2p")),
                "op": str(e["profiling_name"]).split(":")[-1],
                "sizes": e.get("input_sizes"),
                "time_ns": e.get("time_created_ns", 0),
            }
    return out


def _newest(colls: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    if not colls:
        return None
    return max(colls.items(), key=lambda kv: (kv[1]["time_ns"], kv[1]["record_id"]))


def _describe(pg: str, c: dict[str, Any]) -> str:
    kind = "p2p op" if c["p2p"] else "collective"
    return f"{c['op']} ({kind} #{c['seq']} on process group {pg} '{c['desc']}', input sizes {c['sizes']})"


class CollectiveWatchdog:
    """Turn a hung or failed collective into trace dumps on every rank and a non-zero exit.

    Use as a context manager around the training loop; call :meth:`set_step` each step so the
    message can say where each rank was. It is inert when no multi-rank process group exists
    (single process, fake backends).
    """

    def __init__(
        self,
        comm: Comm,
        dump_folder: str,
        *,
        poll_seconds: float = 1.0,
        peer_wait_seconds: float = 5.0,
        exit_fn: Callable[[int], None] | None = None,
    ) -> None:
        self.comm = comm
        self.dump_folder = dump_folder
        self.poll_seconds = poll_seconds
        self.peer_wait_seconds = peer_wait_seconds
        self._exit = exit_fn or _hard_exit
        self.step = 0
        self._stop = threading.Event()
        self._handling = threading.Lock()
        self._thread: threading.Thread | None = None
        self.enabled = (
            dist.is_initialized()
            and dist.get_world_size() > 1
            and dist.get_backend() not in ("fake",)
            and comm.trace_buf_size > 0
        )
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._store = dist.distributed_c10d._get_default_store() if self.enabled else None

    # --- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> CollectiveWatchdog:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.stop()
        if exc is not None and self.enabled and is_collective_failure(exc):
            self.handle_failure(exc)  # exits the process
        return False

    def start(self) -> None:
        """Start the thread that answers other ranks' dump requests."""
        if not self.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, name="fr-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def set_step(self, step: int) -> None:
        self.step = step

    # --- failure handling --------------------------------------------------------------------
    def handle_failure(self, err: BaseException) -> None:
        """This rank's collective failed: dump, make every rank dump, explain, exit non-zero."""
        if not self._handling.acquire(blocking=False):
            return
        self._stop.set()
        if threading.current_thread() is threading.main_thread():
            # The launcher may SIGTERM this rank once a peer exits: finish the report first.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        trace = _raw_trace(include_stack_traces=False)
        mine = last_collectives(trace)
        newest = _newest(mine)
        failed = {"rank": self.rank, "step": self.step}
        if newest is not None:
            failed.update(pg=newest[0], **{k: newest[1][k] for k in ("seq", "op", "p2p")})
        assert self._store is not None
        try:
            self._store.compare_set(_STORE_PREFIX + "abort", "", json.dumps(failed))
        except Exception as store_err:  # noqa: BLE001
            logger.warning(f"could not ask the other ranks to dump Flight Recorder traces: {store_err}")
        path = self._dump_and_publish(mine)
        peers = self._collect_peer_states()
        message = self._explain(err, mine, newest, peers)
        where = os.path.dirname(path) if path else None
        message += (
            f". Flight Recorder traces: {where}/ (analyse: python scripts/analyze_flight_recorder.py "
            f"{where} -p {self.comm.save_traces_file_prefix})" if where else ""
        )
        logger.error(message)
        # The launcher prints it when this rank's output is not on the console (LOG_RANK).
        from torchtitan.tools.error_file import record_error

        record_error(message, EXIT_CODE)
        with contextlib.suppress(Exception):
            self._store.set(_STORE_PREFIX + "reported", str(self.rank))
        self._exit(EXIT_CODE)

    def _dump_and_publish(self, mine: dict[str, dict[str, Any]] | None = None) -> str | None:
        path = dump_trace(trace_path(self.comm, self.dump_folder, self.rank))
        if mine is None:
            mine = last_collectives(_raw_trace(include_stack_traces=False))
        state = {"step": self.step, "dumped": path is not None, "last": mine}
        if self._store is not None:
            try:
                self._store.set(f"{_STORE_PREFIX}state/{self.rank}", json.dumps(state))
            except Exception as store_err:  # noqa: BLE001
                logger.warning(f"could not publish Flight Recorder state: {store_err}")
        return path

    def _collect_peer_states(self) -> dict[int, dict[str, Any]]:
        states: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.peer_wait_seconds
        pending = [r for r in range(self.world_size) if r != self.rank]
        while pending and time.monotonic() < deadline:
            for r in list(pending):
                key = f"{_STORE_PREFIX}state/{r}"
                try:
                    if self._store.check([key]):
                        states[r] = json.loads(self._store.get(key))
                        pending.remove(r)
                except Exception:  # noqa: BLE001 - a dead store ends the wait
                    pending = []
                    break
            if pending:
                time.sleep(0.2)
        return states

    def _explain(
        self,
        err: BaseException,
        mine: dict[str, dict[str, Any]],
        newest: tuple[str, dict[str, Any]] | None,
        peers: dict[int, dict[str, Any]],
    ) -> str:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if newest is None:
            return (
                f"Collective failure on rank {self.rank} at step {self.step} ({first_line}); "
                "no Flight Recorder entries (comm.trace_buf_size=0?)"
            )
        pg, coll = newest
        members = _group_members(pg) or list(range(self.world_size))
        missing, desynced, silent = [], [], []
        for r in members:
            if r == self.rank:
                continue
            state = peers.get(r)
            if state is None:
                silent.append(r)
                continue
            theirs = state["last"].get(pg)
            if theirs is None or theirs["seq"] < coll["seq"]:
                before = f"last called {_describe(pg, theirs)}" if theirs else "never used that group"
                missing.append(f"rank {r} (at step {state['step']}; {before})")
            elif theirs["seq"] == coll["seq"] and theirs["op"] != coll["op"]:
                desynced.append(f"rank {r} called {theirs['op']} instead")
        parts = [
            f"Collective timeout/failure on rank {self.rank} at step {self.step}: "
            f"{_describe(pg, coll)} did not complete ({first_line})"
        ]
        if missing:
            parts.append("stalled: " + ", ".join(missing) + " never joined it")
        if desynced:
            parts.append("desync: " + ", ".join(desynced))
        if silent:
            parts.append(
                f"rank(s) {', '.join(map(str, silent))} did not answer (hung in native code "
                "or dead; check their logs)"
            )
        if not (missing or desynced or silent):
            parts.append("every rank issued it; suspect the network or a slow rank")
        return "; ".join(parts)

    # --- the thread --------------------------------------------------------------------------
    def _watch(self) -> None:
        key = _STORE_PREFIX + "abort"
        while not self._stop.wait(self.poll_seconds):
            try:
                if not self._store.check([key]):
                    continue
                failed = json.loads(self._store.get(key))
            except Exception:  # noqa: BLE001 - store gone: the job is ending anyway
                return
            if not self._handling.acquire(blocking=False):
                return  # the main thread is handling its own failure
            path = self._dump_and_publish()
            what = (
                f"{failed['op']} #{failed['seq']} on process group {failed['pg']}"
                if "op" in failed
                else "a collective"
            )
            logger.error(
                f"Stopping rank {self.rank} at step {self.step}: rank {failed['rank']} reported "
                f"that {what} timed out (step {failed['step']})"
                + (f"; Flight Recorder trace written to {path}" if path else "")
            )
            # Let the reporting rank print its diagnosis before the launcher tears the job down.
            deadline = time.monotonic() + self.peer_wait_seconds + 5
            while time.monotonic() < deadline:
                try:
                    if self._store.check([_STORE_PREFIX + "reported"]):
                        break
                except Exception:  # noqa: BLE001
                    break
                time.sleep(0.2)
            self._exit(EXIT_CODE)
            return


def _group_members(pg_name: str) -> list[int]:
    if not dist.is_initialized():
        return []
    world = dist.distributed_c10d._world
    for pg, name in world.pg_names.items():
        if name == pg_name:
            return sorted(world.pg_group_ranks.get(pg, {}))
    return []


def _hard_exit(code: int) -> None:
    for handler in logger.handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
