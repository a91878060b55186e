"""Run a fault-tolerant job on this machine: a torchft lighthouse and N replica groups.

    python scripts/run_fault_tolerant.py --groups 2 --ranks-per-group 2 -- \
        --job.config_file train_configs/debug_model.toml --training.steps 100

Each group is ``./run_train.sh`` (its own torchrun job, NGPU = ranks per group) with
``--fault_tolerance.enable --fault_tolerance.group_size N --fault_tolerance.replica_id i`` added.
With CUDA GPUs each group gets its own ``CUDA_VISIBLE_DEVICES`` slice. A group that fails is
started again (up to ``--max-restarts`` times) and rejoins the others from their live state;
a user error (exit code 2: bad config) stops everything. The script owns the lighthouse: if it
cannot start (port taken), nothing starts (exit 2); if it dies, everything stops (exit 1, no
group restarts spent). Logs go to ``{--log-dir}/replica_{i}.log`` (attempts after the first
append to the same file) and ``{--log-dir}/lighthouse.log``.

Everything it starts dies with it, even on ``kill -9``: on Linux each child gets a parent-death
signal, and a watchdog process kills whatever is left of the run (every process carrying its
``TORCHTITAN_FT_RUNNER`` mark: torchrun's ranks too) once the script is gone. SIGTERM or
Ctrl-C first asks the groups to save a checkpoint (``--stop-timeout``).

``--print`` shows the commands and exits. See docs/fault_tolerance.md (slurm recipe too).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # a checkout run without installing it
from torchtitan.tools.cli_args import OneLineParser  # noqa: E402

MARK_ENV = "TORCHTITAN_FT_RUNNER"  # in the environment of every process of one run
PR_SET_PDEATHSIG = 1
START_TIMEOUT_S = 10.0



def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        argv, trainer_flags = argv[:i], argv[i + 1 :]
    else:
        trainer_flags = []
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=2, help="replica groups (default 2)")
    p.add_argument("--ranks-per-group", type=int, default=None,
                   help="ranks in each group (default: NGPU from the environment, else 1)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts per group (default 3)")
    p.add_argument("--lighthouse-port", type=int, default=29510)
    p.add_argument("--join-timeout-ms", type=int, default=10000,
                   help="how long the lighthouse waits for groups that are up but not joined")
    p.add_argument("--stop-timeout", type=float, default=120.0,
                   help="seconds the groups get to save and exit on SIGTERM before SIGKILL")
    p.add_argument("--log-dir", default="outputs/fault_tolerance_logs")
    p.add_argument("--print", action="store_true", help="print the commands and exit")
    args = p.parse_args(argv)
    if args.ranks_per_group is None:
        ngpu = os.environ.get("NGPU", "1") or "1"
        if not ngpu.isdigit() or int(ngpu) < 1:
            p.error(f"NGPU={ngpu!r} in the environment is not a number of ranks per group "
                    "(an integer >= 1): fix it or give --ranks-per-group")
        args.ranks_per_group = int(ngpu)
    for flag in trainer_flags:
        name = flag.split("=", 1)[0].replace("-", "_").lstrip("_")
        if name in _SET_PER_GROUP:
            p.error(f"{flag.split('=', 1)[0]} is set for each group by this script "
                    f"({_SET_PER_GROUP[name]}): leave it out of the trainer flags")
    if args.groups < 1 or args.ranks_per_group < 1:
        p.error("--groups and --ranks-per-group must be >= 1")
    if not 1 <= args.lighthouse_port <= 65535:
        p.error(f"--lighthouse-port must be a TCP port (1-65535), got {args.lighthouse_port}")
    if args.max_restarts < 0 or args.join_timeout_ms < 1 or not args.stop_timeout > 0:
        p.error("--max-restarts must be >= 0, --join-timeout-ms and --stop-timeout > 0")
    if os.path.exists(args.log_dir) and not os.path.isdir(args.log_dir):
        p.error(f"--log-dir {args.log_dir} is an existing file, not a folder")
    return args, trainer_flags


_SET_PER_GROUP = {
    "fault_tolerance.replica_id": "group i is replica i",
    "fault_tolerance.group_size": "--groups",
    "fault_tolerance.enable": "always on",
}


def lighthouse_command(args: argparse.Namespace) -> list[str]:
    return ["torchft_lighthouse", "--min_replicas", "1", "--bind",
            f"[::]:{args.lighthouse_port}", "--join_timeout_ms", str(args.join_timeout_ms)]


def group_command(args: argparse.Namespace, replica: int, flags: list[str]) -> list[str]:
    return [str(REPO / "run_train.sh"), *flags, "--fault_tolerance.enable",
            "--fault_tolerance.group_size", str(args.groups),
            "--fault_tolerance.replica_id", str(replica)]


def group_env(args: argparse.Namespace, replica: int, lighthouse: str, n_gpus: int) -> dict:
    """The variables this script sets for group ``replica`` (on top of its own environment)."""
    env = {"NGPU": str(args.ranks_per_group), "TORCHFT_LIGHTHOUSE": lighthouse}
    if n_gpus:
        first = replica * args.ranks_per_group
        env["CUDA_VISIBLE_DEVICES"] = ",".join(
            str(d) for d in range(first, first + args.ranks_per_group)
        )
    return env


def _count_gpus() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(line.startswith("GPU ") for line in out.splitlines())


# ---- process lifetime ---------------------------------------------------------------------


def _die_with_me(sig: int):
    """A ``preexec_fn``: the child gets ``sig`` when this process dies (Linux), and exits at
    once if this process died before the child could ask for that."""
    parent = os.getpid()
    prctl = None
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork

    def arm() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def _marked(mark: str) -> list[int]:
    """Live processes whose environment carries ``MARK_ENV=mark`` (Linux /proc; [] elsewhere)."""
    needle = f"{MARK_ENV}={mark}".encode()
    found = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(name))
            except OSError:
                continue
    return found


def watchdog(mark: str, sweep_s: float = 10.0) -> int:
    """The watchdog process: wait until the runner closes our stdin (it exited or was killed),
    then SIGKILL every process of its run that is still there, until none is left."""
    sys.stdin.buffer.read()
    deadline = time.monotonic() + sweep_s
    while pids := _marked(mark):
        if time.monotonic() > deadline:
            return 1
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    return 0


def _start_watchdog(mark: str) -> subprocess.Popen | None:
    if not os.path.isdir("/proc/self"):
        return None
    env = {k: v for k, v in os.environ.items() if k != MARK_ENV}
    # its own session: Ctrl-C and a closed terminal reach the runner, not the watchdog
    return subprocess.Popen([sys.executable, __file__, "--watchdog", mark], stdin=subprocess.PIPE,
                            env=env, start_new_session=True)


def _stop_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, sig)


# ---- the lighthouse -----------------------------------------------------------------------


def _port_holder(port: int) -> str:
    """Who listens on TCP ``port`` ("pid N: command"), from /proc; "" when unknown."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{cols[9]}]")
    with contextlib.suppress(OSError):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                if inodes & {os.readlink(f"/proc/{pid}/fd/{fd}")
                             for fd in os.listdir(f"/proc/{pid}/fd")}:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                    cmd = " ".join(cmd.replace("\0", " ").split())
                    return f"pid {pid}: {cmd[:150]}"
    return ""


def _port_taken(port: int) -> bool:
    """Whether the lighthouse's bind (``[::]:port``, SO_REUSEADDR) would fail."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
            return False
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return True
    return False


def _port_in_use_error(port: int) -> str:
    holder = _port_holder(port)
    return (f"error: lighthouse port {port}: address already in use"
            f"{f' (by {holder})' if holder else ''}; stop that process or pick another "
            "--lighthouse-port")


def _start_lighthouse(args, log: Path, env: dict) -> tuple[subprocess.Popen | None, str]:
    """Start our lighthouse and wait until it answers as one; ``(None, error line)`` if not."""
    from torchtitan.components.fault_tolerance.layout import probe_lighthouse

    port = args.lighthouse_port
    if _port_taken(port):
        return None, _port_in_use_error(port)
    lh = subprocess.Popen(lighthouse_command(args), stdout=log.open("w"), stderr=subprocess.STDOUT,
                          env=env, start_new_session=True,
                          preexec_fn=_die_with_me(signal.SIGKILL))
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        rc = lh.poll()
        if rc is not None:
            text = log.read_text(errors="replace")
            if "Address already in use" in text or "AddrInUse" in text:
                return None, _port_in_use_error(port)
            last = (text.strip().splitlines() or ["no output"])[-1].strip()
            return None, (f"error: the torchft lighthouse exited with code {rc} at start "
                          f"({last[-200:]}); see {log}")
        if not probe_lighthouse(f"http://localhost:{port}", timeout_s=1.0)[0] and lh.poll() is None:
            return lh, ""
        if time.monotonic() > deadline:
            lh.kill()
            lh.wait()
            return None, (f"error: the torchft lighthouse did not answer on port {port} within "
                          f"{START_TIMEOUT_S:g}s; see {log}")
        time.sleep(0.1)


def _check_external_lighthouse(address: str) -> str:
    from torchtitan.components.fault_tolerance.layout import FaultToleranceError, check_lighthouse
    from torchtitan.config.job_config import FaultTolerance

    try:
        check_lighthouse(FaultTolerance(enable=True, group_size=1, lighthouse=address))
    except FaultToleranceError as err:
        return f"error: {err}"
    return ""


# ---- main ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--watchdog"]:
        return watchdog(argv[1])
    args, flags = parse_args(argv)
    n_gpus = _count_gpus()
    if n_gpus and n_gpus < args.groups * args.ranks_per_group:
        print(f"error: {args.groups} groups x {args.ranks_per_group} ranks need "
              f"{args.groups * args.ranks_per_group} GPUs; this machine has {n_gpus}",
              file=sys.stderr)
        return 2
    external = os.environ.get("TORCHFT_LIGHTHOUSE")
    lighthouse = external or f"http://localhost:{args.lighthouse_port}"
    if args.print:
        if not external:
            print(shlex.join(lighthouse_command(args)))
        for i in range(args.groups):
            prefix = " ".join(f"{k}={v}" for k, v in group_env(args, i, lighthouse, n_gpus).items())
            print(f"{prefix} {shlex.join(group_command(args, i, flags))}")
        return 0
    if shutil.which("torchft_lighthouse") is None:
        print("error: torchft_lighthouse not found; pip install 'torchft>=0.2'", file=sys.stderr)
        return 2

    log_dir = Path(args.log_dir)
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"error: --log-dir {log_dir}: cannot make the folder ({err.strerror})",
              file=sys.stderr)
        return 2
    mark = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    env = {**os.environ, MARK_ENV: mark}
    lh_log = log_dir / "lighthouse.log"
    if external:
        error = _check_external_lighthouse(external)
        if error:
            print(error, file=sys.stderr)
            return 2
    watchdog_proc = _start_watchdog(mark)
    lh = None
    groups: dict[int, subprocess.Popen] = {}
    restarts = dict.fromkeys(range(args.groups), 0)

    def start(i: int) -> None:
        log = (log_dir / f"replica_{i}.log").open("a")
        groups[i] = subprocess.Popen(group_command(args, i, flags), cwd=REPO, stdout=log,
                                     stderr=subprocess.STDOUT,
                                     env={**env, **group_env(args, i, lighthouse, n_gpus)},
                                     start_new_session=True,
                                     preexec_fn=_die_with_me(signal.SIGKILL))
        print(f"replica group {i}: started (pid {groups[i].pid}, log {log.name})", flush=True)

    def stop_all(grace: float) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut this short
        running = [p for p in groups.values() if p.poll() is None]
        for proc in running:
            _stop_group(proc, signal.SIGTERM)  # the ranks save a checkpoint and exit
        deadline = time.monotonic() + grace
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _stop_group(proc, signal.SIGKILL)  # the ranks follow their launcher
                proc.wait()
        if lh is not None and lh.poll() is None:
            lh.kill()
            lh.wait()
        if watchdog_proc is not None:  # it kills what is left (ranks outside the groups' sessions)
            watchdog_proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                watchdog_proc.wait(timeout=15)

    # SIGTERM (scancel, docker stop) and SIGHUP stop the groups too: SystemExit runs `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    code, grace = 0, args.stop_timeout
    try:
        if not external:
            lh, error = _start_lighthouse(args, lh_log, env)
            if lh is None:
                print(error, file=sys.stderr)
                return 2
            print(f"lighthouse: started (pid {lh.pid}, {lighthouse}, log {lh_log})", flush=True)
        for i in range(args.groups):
            start(i)
        done: set[int] = set()
        while len(done) < args.groups:
            time.sleep(0.5)
            # First: a group that fails because the lighthouse is gone is not the group's fault.
            if lh is not None and lh.poll() is not None:
                print(f"error: the torchft lighthouse (pid {lh.pid}) died with code "
                      f"{lh.returncode} (an infrastructure failure: the groups were stopped and "
                      "no restart was spent; run again to resume from the last checkpoint); see "
                      f"{lh_log}", file=sys.stderr)
                code, grace = 1, min(grace, 10.0)  # no step can commit without it
                return code
            for i, proc in list(groups.items()):
                rc = proc.poll()
                if rc is None or i in done:
                    continue
                if rc == 0:
                    done.add(i)
                    print(f"replica group {i}: finished", flush=True)
                elif rc == 2 or restarts[i] >= args.max_restarts:
                    why = "a user error" if rc == 2 else f"{restarts[i]} restarts"
                    print(f"error: replica group {i} exited with code {rc} ({why}); see "
                          f"{log_dir / f'replica_{i}.log'}", file=sys.stderr)
                    code = rc
                    return code
                else:
                    restarts[i] += 1
                    print(f"replica group {i}: exited with code {rc}; restart "
                          f"{restarts[i]}/{args.max_restarts}", flush=True)
                    start(i)
    except KeyboardInterrupt:
        code = 130
    finally:
        stop_all(grace)
    return code


if __name__ == "__main__":
    sys.exit(main())
