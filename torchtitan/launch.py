"""``python -m torchtitan.launch [torchrun options] -- ENTRY [args]``: torchrun, with a
pre-flight check before it and one line after a failure. ``./run_train.sh`` runs this.

1. **Pre-flight** (when ENTRY is the trainer: ``-m torchtitan.train`` or ``train.py``): the
   config is parsed and checked for the world size (``--nproc_per_node`` x ``--nnodes``) in
   this one process, with the trainer's own checks (:func:`torchtitan.preflight.check_run`).
   A bad config prints one ``error:`` line and exits 2 before torchrun starts. Flag, value and
   TOML mistakes are found before torch is even imported.
2. **torchrun** runs in this process (``torch.distributed.run.run``), so there is no second
   Python start-up.
3. **After a failure**, torchrun's ``ChildFailedError`` traceback is replaced by one
   ``error:`` line naming the root cause: the first rank that stopped on an error the trainer
   reported (it writes its one line to torchrun's per-rank error file, see
   :func:`torchtitan.tools.error_file.record_error`), else the first rank that failed. The
   line is printed only when the console has not shown it already (``--local-ranks-filter``,
   i.e. ``LOG_RANK``). The exit code is that rank's: 2 for a bad config or a missing file, 1
   for a training error, 3 for a collective timeout, 128+N for a rank killed by signal N
   (a SIGKILL from the kernel's out-of-memory killer is named as such, with what to change).
4. **Ctrl-C** goes on to the ranks (torchrun starts them in their own sessions): the first
   stops them after the step with a checkpoint, like SIGTERM; a second stops them at once.
   Either way, and before any rank started, the launcher ends killed by SIGINT (the shell
   shows 130) with one line per Ctrl-C and no traceback (:mod:`torchtitan.tools.interrupts`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from torchtitan.tools.error_file import TRAINER_MARK, host_out_of_memory_message, record_error
from torchtitan.tools.host_memory import killed_by_oom_killer, oom_kill_count
from torchtitan.tools.interrupts import INTERRUPTED, ForwardedInterrupts, end_as_interrupted
from torchtitan.tools.logging import COLOR_ENV

__all__ = ["TRAINER_MARK", "main", "record_error"]


# --- the command line ---------------------------------------------------------------------------
_TRAINER_MODULES = ("torchtitan.train",)


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: python -m torchtitan.launch [torchrun options] -- ENTRY [args]")
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def _option(opts: list[str], *names: str) -> str | None:
    """The last value of torchrun option ``names`` (``--x=v`` or ``--x v``; - and _ alike)."""
    wanted = {n.replace("-", "_") for n in names}
    value = None
    for i, token in enumerate(opts):
        name, eq, inline = token.partition("=")
        if name.lstrip("-").replace("-", "_") in wanted and token.startswith("--"):
            value = inline if eq else (opts[i + 1] if i + 1 < len(opts) else None)
    return value


def _trainer_args(entry: list[str]) -> list[str] | None:
    """The trainer's flags when ``entry`` runs the trainer, else None (unknown program)."""
    if len(entry) >= 2 and entry[0] in ("-m", "--module") and entry[1] in _TRAINER_MODULES:
        return entry[2:]
    if entry and entry[0].endswith(".py"):
        script = os.path.realpath(entry[0])
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if script in (os.path.join(root, "train.py"), os.path.join(root, "torchtitan", "train.py")):
            return entry[1:]
    return None


def _world_size(opts: list[str]) -> int | None:
    nproc = _option(opts, "nproc_per_node", "nproc-per-node") or "1"
    nnodes = _option(opts, "nnodes") or "1"
    if not (nproc.isdigit() and nnodes.isdigit()):
        return None  # "gpu", "auto", an elastic range: known only at run time
    return int(nproc) * int(nnodes)


def check_local_gpus(nproc_per_node: str | None) -> None:
    """On a CUDA machine, refuse more ranks per node than visible GPUs (each rank takes the GPU
    of its local rank; one past the last dies with "invalid device ordinal"); on the CPU, warn
    when the ranks outnumber the cores."""
    from torchtitan.tools.device import device_type

    if not (nproc_per_node or "").isdigit():
        return
    if device_type == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if cores and int(nproc_per_node) > cores:
            print(f"warning: NGPU={nproc_per_node} starts {nproc_per_node} CPU ranks on {cores} "
                  f"core{'s' if cores != 1 else ''}: they take turns, and each step is about "
                  f"{int(nproc_per_node) / cores:.0f}x slower than on enough cores (fine for "
                  "trying a layout; lower NGPU for speed)", file=sys.stderr)
        return
    if device_type != "cuda":
        return
    import torch

    from torchtitan.distributed.parallel_dims import ParallelismError

    count = torch.cuda.device_count()
    if int(nproc_per_node) > count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        which = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise ParallelismError(
            f"--nproc_per_node={nproc_per_node} (NGPU) starts {nproc_per_node} ranks on this "
            f"machine, but it has {count} visible GPU{'s' if count != 1 else ''}{which}: one "
            "rank per GPU; lower NGPU, or add nodes"
        )


def preflight(trainer_args: list[str], world_size: int | None,
              nproc_per_node: str | None = None) -> int:
    """Check the trainer's config (and, on a CUDA machine, ``nproc_per_node`` against its
    GPUs); 0 when it may start, else 2 (one ``error:`` line printed)."""
    from torchtitan.config.errors import ConfigError, print_error
    from torchtitan.config.manager import ConfigManager

    # Deprecation and other notes come from the ranks' own logs; here only the verdict counts.
    logging.getLogger("torchtitan").setLevel(logging.ERROR)
    try:
        cfg = ConfigManager().parse_args(trainer_args)
    except ConfigError as exc:
        print_error(exc)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    from torchtitan.preflight import USER_ERRORS, check_run

    try:
        check_run(cfg, world_size, on_this_machine=True)
        check_local_gpus(nproc_per_node)
    except USER_ERRORS as exc:
        print_error(exc)
        return 2
    return 0


# --- after a failure ----------------------------------------------------------------------------
class _DropAgentNoise(logging.Filter):
    """torchrun's per-failure log lines, which the one-line summary replaces."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("failed (exitcode") or msg.startswith("Sending process"))


def _shown_local_ranks(opts: list[str]) -> set[int] | None:
    """Local ranks whose output reaches the console (None: all of them)."""
    value = _option(opts, "local_ranks_filter", "local-ranks-filter")
    if not value:
        return None
    return {int(r) for r in value.split(",") if r.strip().isdigit()}


def _one_line(text: Any) -> str:
    text = " ".join(str(text).split())
    return text[len("error: ") :] if text.startswith("error: ") else text


def summarize_failure(failures: dict[int, Any], shown: set[int] | None, log_dir: str,
                      oom_killed: Callable[[], str | None] = lambda: None) -> int:
    """Print the root cause of ``failures`` (rank -> ProcessFailure) once; its exit code.
    ``oom_killed()`` explains a SIGKILL that the kernel's out-of-memory killer sent (else
    None)."""
    ours = {r: f for r, f in failures.items() if TRAINER_MARK in (f.error_file_data or {})}
    if ours:
        rank, root = min(ours.items(), key=lambda kv: kv[1].error_file_data[TRAINER_MARK]["time"])
        message = _one_line(root.message)
        on_console = [
            f for f in ours.values()
            if (shown is None or f.local_rank in shown) and _one_line(f.message) == message
        ]
        if not on_console:
            print(f"error: {message} (rank {rank}; every rank's output: {log_dir})",
                  file=sys.stderr)
        return int(root.error_file_data[TRAINER_MARK]["exitcode"])
    rank, root = min(failures.items(), key=lambda kv: kv[1].timestamp)
    code = root.exitcode
    if isinstance(root.message, dict):  # a traceback recorded by torch's @record
        what = _one_line(root.message.get("message", ""))
    elif code < 0:
        what = f"killed by signal {root.signal_name()}"
        if root.signal_name() == "SIGKILL":
            what = oom_killed() or what
    else:
        what = f"exit code {code}"
    path, last = _rank_stderr(log_dir, root.local_rank)
    said = f": {last}" if last and not isinstance(root.message, dict) else ""
    print(f"error: rank {rank} failed ({what}){said}; its output: {path or log_dir}",
          file=sys.stderr)
    return 128 - code if code < 0 else (code or 1)


def _rank_stderr(log_dir: str, local_rank: int) -> tuple[str | None, str]:
    """torchrun's ``stderr.log`` of ``local_rank`` (newest attempt) and its last line, which
    is what the rank said last (its console may be filtered out by LOG_RANK)."""
    import glob

    found = glob.glob(os.path.join(glob.escape(log_dir), "**", "attempt_*", str(local_rank),
                                   "stderr.log"), recursive=True)
    if not found:
        return None, ""
    path = max(found, key=os.path.getmtime)
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return path, ""
    lines = [ln for ln in lines if ln]
    last = re.sub(r"^\[[^\]]*\]:?\s*", "", lines[-1]) if lines else ""  # "[rank1]:" prefix
    return path, (last if len(last) <= 300 else last[:297] + "...")


def main(argv: list[str] | None = None) -> int:
    opts, entry = _split(list(sys.argv[1:] if argv is None else argv))
    # Ctrl-C and SIGTERM go to the ranks, which save and stop; torchrun would instead SIGKILL
    # them after its shutdown timeout and exit 1 with a traceback (tools/lifecycle.py,
    # tools/interrupts.py). A Ctrl-C before any rank started ends the launcher at once.
    ours = _option(opts, "signals_to_handle", "signals-to-handle") is None
    interrupts = ForwardedInterrupts() if ours and os.path.isdir("/proc/self") else None
    try:
        code = _launch(opts, entry, interrupts)
    finally:
        if interrupts is not None:
            interrupts.restore()
    if code == 0 and interrupts is not None and interrupts.count:
        return INTERRUPTED  # the ranks stopped on the Ctrl-C, with their checkpoint
    return code


def _launch(opts: list[str], entry: list[str], interrupts: ForwardedInterrupts | None) -> int:
    trainer_args = _trainer_args(entry)
    if trainer_args is not None:
        code = preflight(trainer_args, _world_size(opts),
                         _option(opts, "nproc_per_node", "nproc-per-node") or "1")
        if code:
            return code

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # The ranks print through pipes: tell them whether this console is a terminal (colours).
    os.environ.setdefault(COLOR_ENV, "1" if sys.stdout.isatty() else "0")
    if _option(opts, "log_dir", "log-dir") is None:
        log_dir = tempfile.mkdtemp(prefix="torchelastic_")
        opts = [*opts, "--log-dir", log_dir]
    else:
        log_dir = _option(opts, "log_dir", "log-dir") or ""
    if interrupts is not None:
        from torchtitan.tools.lifecycle import forward_sigterm_to_ranks

        forward_sigterm_to_ranks()
        opts = [*opts, "--signals-to-handle", "SIGHUP,SIGQUIT"]
    parser = get_args_parser()
    # Now used only to tear down the other ranks after one failed (they are stuck in a
    # collective or stopped): 5 s instead of torchrun's 30 s. torchrun has the flag from torch
    # 2.13 on; older ones get the same teardown time through the patch below.
    shutdown_timeout = _option(opts, "shutdown_timeout", "shutdown-timeout")
    if shutdown_timeout is None:
        shutdown_timeout = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "5")
        if "--shutdown-timeout" in parser._option_string_actions:
            opts = [*opts, "--shutdown-timeout", shutdown_timeout]
    from torchtitan.tools.lifecycle import honour_shutdown_timeout_on_failure

    honour_shutdown_timeout_on_failure(int(shutdown_timeout or 30))
    args = parser.parse_args([*opts, *entry])
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropAgentNoise())
    oom_kills = oom_kill_count()
    try:
        run(args)
    except ChildFailedError as err:
        reported = any(TRAINER_MARK in (f.error_file_data or {}) for f in err.failures.values())
        if interrupts is not None and interrupts.count and not reported:
            return INTERRUPTED  # stopped by the Ctrl-C (killed, or before the trainer ran)
        if interrupts is not None and interrupts.count > 1:
            return INTERRUPTED  # stopped at once: what a rank said on the way down follows from it

        def oom_killed() -> str | None:
            if not killed_by_oom_killer(oom_kills):
                return None
            return host_out_of_memory_message(trainer_args, _world_size(opts))

        return summarize_failure(err.failures, _shown_local_ranks(opts), log_dir, oom_killed)
    return 0


if __name__ == "__main__":
    exit_code = main()
    if exit_code == INTERRUPTED:
        end_as_interrupted()
    sys.exit(exit_code)
