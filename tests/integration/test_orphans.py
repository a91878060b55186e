"""No orphans, no second writer: a ``kill -9`` of the launcher ends its ranks at once, and a
checkpoint folder in use refuses a second job; the dead job's lock is taken over with a warning.

One rank under ``./run_train.sh`` (torchtitan.launch -> torchrun) trains and saves; meanwhile a
second trainer (in this process) on the same folder must refuse with one line naming the holder.
Then the launcher is SIGKILLed: its rank must be gone within seconds (not go on training and
writing checkpoints), and a restart resumes, taking over the stale lock.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO_ROOT
from torchtitan.train import main

FLAGS = [
    "--job.config_file", "./train_configs/debug_model.toml",
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--activation_checkpoint.mode", "none",
    "--metrics.log_freq", "1",
    "--checkpoint.enable",
    "--checkpoint.interval", "2",
    "--checkpoint.keep_latest_k", "2",
]


def _children(pid: int) -> list[int]:
    kids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = open(f"/proc/{name}/stat").read()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
                kids.append(int(name))
    return kids


def _running(pid: int) -> bool:
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


def _run_here(dump, *flags) -> tuple[int, list[str]]:
    lines: list[str] = []

    class H(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    titan = logging.getLogger("torchtitan")
    handler = H(logging.INFO)
    titan.addHandler(handler)
    try:
        code = main([*FLAGS, "--job.dump_folder", str(dump), *flags])
    finally:
        titan.removeHandler(handler)
        gc.enable()
    return code, lines


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")
def test_killed_launcher_leaves_no_orphan_and_folder_has_one_writer(tmp_path, cpu_env):
    env = {**cpu_env, "NGPU": "1", "OMP_NUM_THREADS": "1"}
    cmd = ["./run_train.sh", *FLAGS, "--training.steps", "100000", "--job.dump_folder", str(tmp_path)]
    launcher = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    folder = tmp_path / "checkpoint"
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (folder / "step-2").is_dir():
            assert launcher.poll() is None and time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.2)
        ranks = _children(launcher.pid)
        assert len(ranks) == 1, ranks
        holder = json.loads((folder / ".writer.lock").read_text())
        assert holder["pid"] == ranks[0]

        code, log = _run_here(tmp_path, "--training.steps", "3")  # a second writer
        errors = [m for m in log if m.startswith("error:")]
        assert code == 2 and len(errors) == 1, log[-5:]
        assert f"is in use by another job (pid {ranks[0]} on host" in errors[0]

        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        killed = time.monotonic()
        while _running(ranks[0]) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        assert not _running(ranks[0]), "the rank survived its launcher"
        assert time.monotonic() - killed < 5
    finally:
        for pid in [*ranks, *_children(launcher.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if launcher.poll() is None:
            launcher.kill()
    newest = max(int(n.split("-")[1]) for n in os.listdir(folder) if n.startswith("step-") and "." not in n)
    code, log = _run_here(tmp_path, "--training.steps", str(newest + 1))
    assert code == 0, log[-5:]
    assert any(f"taking over the writer lock {folder}/.writer.lock: its holder, pid {ranks[0]}" in m
               and "is no longer running" in m for m in log), log
    assert any(f"Training starts at step {newest + 1}" in m for m in log)
