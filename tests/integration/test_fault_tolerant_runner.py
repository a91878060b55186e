"""scripts/run_fault_tolerant.py as a user runs it: its lighthouse, its groups, its death.

Two 1-rank CPU groups (each a torchrun job: launcher + rank) train the tiny debug model for as
long as a test needs; the tests then kill the runner or its lighthouse and look at what is left.
"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from torchtitan.tools.lifecycle import _children

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        subprocess.run(["which", "torchft_lighthouse"], capture_output=True).returncode != 0,
        reason="torchft (torchft_lighthouse) is not installed",
    ),
]

RUNNER = REPO_ROOT / "scripts" / "run_fault_tolerant.py"
TRAINER = [
    "--model.flavor", "debugmodel_tiny", "--training.seq_len", "64",
    "--training.local_batch_size", "2", "--activation_checkpoint.mode", "none",
    "--metrics.log_freq", "1", "--training.steps", "100000",
    "--fault_tolerance.quorum_timeout_seconds", "5",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _tree(root: int) -> list[int]:
    todo, found = [root], []
    while todo:
        found.append(todo.pop())
        todo += _children(found[-1])
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class Runner:
    """The runner in the background, its output in files; ``close`` kills what it leaves."""

    def __init__(self, tmp: Path, env: dict, port: int, *args: str) -> None:
        self.tmp, self.port, self.seen = tmp, port, set()
        self.out, self.err = tmp / "runner.out", tmp / "runner.err"
        self.proc = subprocess.Popen(
            [sys.executable, str(RUNNER), "--groups", "2", "--lighthouse-port", str(port),
             "--log-dir", str(tmp / "logs"), *args, "--", *TRAINER,
             "--job.dump_folder", str(tmp / "out")],
            cwd=REPO_ROOT, env=env, stdout=self.out.open("w"), stderr=self.err.open("w"),
        )

    def processes(self) -> list[int]:
        pids = _tree(self.proc.pid)
        self.seen.update(pids)
        return pids

    def wait_until_training(self, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        metrics = [self.tmp / "out" / f"replica_{i}" / "metrics.jsonl" for i in (0, 1)]
        while not all(m.exists() and m.read_text().count("\n") >= 2 for m in metrics):
            assert time.time() < deadline and self.proc.poll() is None, self.log()
            self.processes()
            time.sleep(0.2)

    def log(self) -> str:
        logs = sorted((self.tmp / "logs").glob("*.log")) if (self.tmp / "logs").exists() else []
        tails = "".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in logs)
        return f"{self.out.read_text()}{self.err.read_text()}{tails}"

    def close(self) -> None:
        leftovers = [p for p in self.seen | set(_tree(self.proc.pid)) if p != os.getpid()]
        for pid in leftovers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def runner_env(cpu_env):
    env = {k: v for k, v in cpu_env.items() if k != "TORCHFT_LIGHTHOUSE"}
    return {**env, "OMP_NUM_THREADS": "1"}


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.time() + seconds
    while (left := [p for p in pids if _alive(p)]) and time.time() < deadline:
        time.sleep(0.1)
    return [f"{p} {_cmdline(p)}" for p in left]


def test_kill_9_of_the_runner_takes_its_lighthouse_groups_and_ranks_with_it(tmp_path, runner_env):
    runner = Runner(tmp_path, runner_env, _free_port())
    try:
        runner.wait_until_training()
        pids = runner.processes()
        commands = [_cmdline(p) for p in pids]
        assert any("torchft_lighthouse" in c for c in commands), commands
        assert sum("torchtitan.launch" in c for c in commands) >= 2, commands
        assert sum("torchtitan.train" in c for c in commands) >= 2, commands  # torchrun's ranks
        os.kill(runner.proc.pid, signal.SIGKILL)
        runner.proc.wait()
        assert _gone_within([p for p in pids if p != runner.proc.pid], 20) == []
        with socket.socket(socket.AF_INET6) as s:  # the next run's lighthouse can bind the port
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torchft's does
            s.bind(("::", runner.port))
            s.listen()
    finally:
        runner.close()


def test_a_lighthouse_that_dies_stops_the_run_as_an_infrastructure_failure(tmp_path, runner_env):
    runner = Runner(tmp_path, runner_env, _free_port())
    try:
        runner.wait_until_training()
        pids = runner.processes()
        lighthouse = next(p for p in pids if "torchft_lighthouse" in _cmdline(p))
        os.kill(lighthouse, signal.SIGKILL)
        code = runner.proc.wait(timeout=60)
        assert code == 1, runner.log()
        errors = [line for line in runner.err.read_text().splitlines() if line.startswith("error")]
        assert errors == [
            f"error: the torchft lighthouse (pid {lighthouse}) died with code -9 (an "
            "infrastructure failure: the groups were stopped and no restart was spent; run again "
            f"to resume from the last checkpoint); see {tmp_path / 'logs' / 'lighthouse.log'}"
        ], runner.log()
        assert "restart" not in runner.out.read_text()
        assert _gone_within(pids, 20) == []
    finally:
        runner.close()


def test_a_taken_lighthouse_port_is_one_line_and_starts_no_group(tmp_path, runner_env):
    """An orphan lighthouse of an earlier run (here: this test's socket) holds the port."""
    with socket.socket(socket.AF_INET6) as holder:
        holder.bind(("::", 0))
        holder.listen()
        port = holder.getsockname()[1]
        runner = Runner(tmp_path, runner_env, port)
        try:
            code = runner.proc.wait(timeout=60)
        finally:
            runner.close()
    err = runner.err.read_text().splitlines()
    assert code == 2 and len(err) == 1, runner.log()
    assert err[0].startswith(f"error: lighthouse port {port}: address already in use (by pid "
                             f"{os.getpid()}: "), err
    assert err[0].endswith("; stop that process or pick another --lighthouse-port")
    assert "replica group" not in runner.out.read_text()
    assert not list((tmp_path / "logs").glob("replica_*.log"))


def test_an_external_address_that_is_not_a_lighthouse_starts_no_group(tmp_path, runner_env):
    server = http.server.HTTPServer(("localhost", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:  # a web server where the lighthouse should be
        address = f"http://localhost:{server.server_address[1]}"
        runner = Runner(tmp_path, {**runner_env, "TORCHFT_LIGHTHOUSE": address}, _free_port())
        try:
            code = runner.proc.wait(timeout=60)
        finally:
            runner.close()
    finally:
        server.shutdown()
        server.server_close()
    assert code == 2, runner.log()
    assert runner.err.read_text().splitlines() == [
        f"error: {address} is not a torchft lighthouse (it answered HTTP 501 to "
        "/torchft.LighthouseService/Heartbeat); point "
        "--fault_tolerance.lighthouse / TORCHFT_LIGHTHOUSE at one, started with "
        "`torchft_lighthouse --min_replicas 1`"
    ]
    assert "replica group" not in runner.out.read_text()
