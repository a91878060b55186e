"""Run a fault-tolerant job on this machine: a torchft lighthouse and N replica groups.

    python scripts/run_fault_tolerant.py --groups 2 --ranks-per-group 2 -- \
        --job.config_file train_configs/debug_model.toml --training.steps 100

Each group is ``./run_train.sh`` (its own torchrun job, NGPU = ranks per group) with
``--fault_tolerance.enable --fault_tolerance.group_size N --fault_tolerance.replica_id i`` added.
With CUDA GPUs each group gets its own ``CUDA_VISIBLE_DEVICES`` slice. A group that fails is
started again (up to ``--max-restarts`` times) and rejoins the others from their live state;
a user error (exit code 2: bad config, no lighthouse) stops everything. Logs go to
``{--log-dir}/replica_{i}.log`` (attempts after the first append to the same file).

``--print`` shows the commands and exits. See docs/fault_tolerance.md (slurm recipe too).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        argv, trainer_flags = argv[:i], argv[i + 1 :]
    else:
        trainer_flags = []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=2, help="replica groups (default 2)")
    p.add_argument("--ranks-per-group", type=int, default=1, help="ranks in each group")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts per group (default 3)")
    p.add_argument("--lighthouse-port", type=int, default=29510)
    p.add_argument("--join-timeout-ms", type=int, default=10000,
                   help="how long the lighthouse waits for groups that are up but not joined")
    p.add_argument("--log-dir", default="outputs/fault_tolerance_logs")
    p.add_argument("--print", action="store_true", help="print the commands and exit")
    args = p.parse_args(argv)
    if args.groups < 1 or args.ranks_per_group < 1:
        p.error("--groups and --ranks-per-group must be >= 1")
    return args, trainer_flags


def lighthouse_command(args: argparse.Namespace) -> list[str]:
    return ["torchft_lighthouse", "--min_replicas", "1", "--bind",
            f"[::]:{args.lighthouse_port}", "--join_timeout_ms", str(args.join_timeout_ms)]


def group_command(args: argparse.Namespace, replica: int, flags: list[str]) -> list[str]:
    return [str(REPO / "run_train.sh"), *flags, "--fault_tolerance.enable",
            "--fault_tolerance.group_size", str(args.groups),
            "--fault_tolerance.replica_id", str(replica)]


def group_env(args: argparse.Namespace, replica: int, lighthouse: str, n_gpus: int) -> dict:
    env = {**os.environ, "NGPU": str(args.ranks_per_group), "TORCHFT_LIGHTHOUSE": lighthouse}
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


def _wait_for_port(port: int, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("localhost", port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def main(argv: list[str] | None = None) -> int:
    args, flags = parse_args(sys.argv[1:] if argv is None else argv)
    n_gpus = _count_gpus()
    if n_gpus and n_gpus < args.groups * args.ranks_per_group:
        print(f"error: {args.groups} groups x {args.ranks_per_group} ranks need "
              f"{args.groups * args.ranks_per_group} GPUs; this machine has {n_gpus}",
              file=sys.stderr)
        return 2
    lighthouse = os.environ.get("TORCHFT_LIGHTHOUSE") or f"http://localhost:{args.lighthouse_port}"
    if args.print:
        if "TORCHFT_LIGHTHOUSE" not in os.environ:
            print(shlex.join(lighthouse_command(args)))
        for i in range(args.groups):
            env = group_env(args, i, lighthouse, n_gpus)
            prefix = " ".join(f"{k}={env[k]}" for k in ("NGPU", "TORCHFT_LIGHTHOUSE",
                                                        "CUDA_VISIBLE_DEVICES") if k in env)
            print(f"{prefix} {shlex.join(group_command(args, i, flags))}")
        return 0
    if shutil.which("torchft_lighthouse") is None:
        print("error: torchft_lighthouse not found; pip install 'torchft>=0.2'", file=sys.stderr)
        return 2

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    lh = None
    if "TORCHFT_LIGHTHOUSE" not in os.environ:
        lh = subprocess.Popen(lighthouse_command(args), stdout=(log_dir / "lighthouse.log").open("w"),
                              stderr=subprocess.STDOUT)
        if not _wait_for_port(args.lighthouse_port):
            lh.kill()
            print(f"error: torchft_lighthouse did not start on port {args.lighthouse_port} "
                  f"(see {log_dir / 'lighthouse.log'})", file=sys.stderr)
            return 2
    groups: dict[int, subprocess.Popen] = {}
    restarts = dict.fromkeys(range(args.groups), 0)

    def start(i: int) -> None:
        log = (log_dir / f"replica_{i}.log").open("a")
        groups[i] = subprocess.Popen(group_command(args, i, flags), cwd=REPO, stdout=log,
                                     stderr=subprocess.STDOUT,
                                     env=group_env(args, i, lighthouse, n_gpus),
                                     start_new_session=True)
        print(f"replica group {i}: started (pid {groups[i].pid}, log {log.name})", flush=True)

    def stop_all() -> None:
        for proc in groups.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in groups.values():
            proc.wait()
        if lh is not None:
            lh.kill()
            lh.wait()

    # SIGTERM (scancel, docker stop) stops the groups too: SystemExit runs the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    code = 0
    try:
        for i in range(args.groups):
            start(i)
        done: set[int] = set()
        while len(done) < args.groups:
            time.sleep(0.5)
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
        stop_all()
    return code


if __name__ == "__main__":
    sys.exit(main())
