"""What an operator does to a run, with the real trainer (debugmodel_tiny, CPU):

* rewinding with ``--checkpoint.load_step``: the newer folders are set aside (renamed, kept),
  and a later plain restart continues the rewound trajectory;
* Ctrl-C: one process (``main`` in this process) stops with a checkpoint of the last completed
  step and returns 130; two gloo ranks under ``./run_train.sh`` (own process group, SIGINT to
  the group as a terminal does): one Ctrl-C saves and the launcher ends killed by SIGINT (the
  shell's 130) with no traceback; a second Ctrl-C stops the ranks at once, and no folder named
  ``step-N`` is a partial write.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import torchtitan.step as step_module
from tests.conftest import REPO_ROOT
from torchtitan.components.checkpoint import fs
from torchtitan.components.checkpoint.integrity import content_problem
from torchtitan.config.manager import ConfigManager
from torchtitan.tools.lifecycle import _children
from torchtitan.train import Trainer, main

FLAGS = [
    "--job.config_file", "./train_configs/debug_model.toml",
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--activation_checkpoint.mode", "none",
    "--metrics.log_freq", "1",
    "--metrics.disable_color_printing",
    "--debug.seed", "3",
    "--checkpoint.enable",
    "--checkpoint.no_last_save_model_only",
]


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _captured():
    log = _Log()
    titan = logging.getLogger("torchtitan")
    old_level, threads = titan.level, torch.get_num_threads()
    titan.addHandler(log)
    titan.setLevel(logging.INFO)
    torch.set_num_threads(1)
    try:
        yield log.lines
    finally:
        titan.removeHandler(log)
        titan.setLevel(old_level)
        torch.set_num_threads(threads)
        gc.enable()  # the Trainer disables automatic GC for its loop


def _train(dump: Path, *flags: str) -> tuple[Trainer, list[str]]:
    with _captured() as lines:
        trainer = Trainer(ConfigManager().parse_args([*FLAGS, "--job.dump_folder", str(dump), *flags]))
        try:
            trainer.train()
        finally:
            trainer.close()
    return trainer, lines


def _names(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if not n.startswith("."))


@pytest.mark.slow
def test_rewind_then_a_plain_restart_continues_the_rewound_trajectory(tmp_path):
    folder = tmp_path / "checkpoint"
    every2 = ["--checkpoint.interval", "2"]
    _train(tmp_path, *every2, "--training.steps", "6")
    assert _names(folder) == ["step-2", "step-4", "step-6"]

    # rewind to step 2 with another learning rate: a new trajectory from there
    rewound, log = _train(tmp_path, *every2, "--training.steps", "4", "--checkpoint.load_step", "2",
                          "--optimizer.lr", "1e-3", "--optimizer.override_checkpoint_lr")
    assert any("Training starts at step 3" in m for m in log)
    (line,) = [m for m in log if "rewound" in m]
    assert "rewound to step-2 (checkpoint.load_step): the newer step-4, step-6 belong to the abandoned trajectory" in line
    # set aside before the first step, so a restart before the new step-4 skips them too
    assert log.index(line) < next(i for i, m in enumerate(log) if "Training starts" in m)
    assert not any("already existed" in m for m in log), log  # the new step-4 met no old one
    names = _names(folder)
    assert [n for n in names if "." not in n] == ["step-2", "step-4"]
    assert sorted(n.split(".")[0] for n in names if ".abandoned-" in n) == ["step-4", "step-6"]

    # a plain restart: the rewound step-4, not the abandoned step-6
    _, log = _train(tmp_path, *every2, "--training.steps", "5")
    assert any(f"from {folder}/step-4 (the newest complete checkpoint" in m for m in log), log
    assert any("Training starts at step 5" in m for m in log), log
    # nothing was deleted: both abandoned folders are still there, committed
    for name in names:
        if ".abandoned-" in name:
            assert (folder / name / ".committed").exists() and not content_problem(str(folder / name))


@pytest.mark.slow
def test_ctrl_c_in_one_process_saves_the_last_completed_step_and_returns_130(tmp_path, monkeypatch):
    original = step_module.forward_backward
    calls = {"n": 0}

    def interrupted(run, inputs, labels, loss_scale):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # arrives inside step 3's forward
        return original(run, inputs, labels, loss_scale)

    monkeypatch.setattr(step_module, "forward_backward", interrupted)
    before = signal.getsignal(signal.SIGINT)
    with _captured() as log:
        try:
            code = main([*FLAGS, "--training.steps", "6", "--checkpoint.interval", "1000",
                         "--job.dump_folder", str(tmp_path)])
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C escaped the trainer as a KeyboardInterrupt")
    assert code == 130
    assert signal.getsignal(signal.SIGINT) is before  # put back
    assert _names(tmp_path / "checkpoint") == ["step-2"]
    stops = [m for m in log if "Ctrl-C" in m]
    assert len(stops) == 2, stops  # what a second Ctrl-C does, then what was saved
    assert stops[1].startswith("Stopping mid-step 3 on Ctrl-C (saved step-2, the last completed step")
    assert not [m for m in log if m.startswith("error:")]


def _launch(dump: Path, env: dict[str, str], steps: int) -> subprocess.Popen:
    cmd = ["./run_train.sh", *FLAGS, "--training.steps", str(steps), "--checkpoint.interval", "1",
           "--checkpoint.keep_latest_k", "0", "--job.dump_folder", str(dump)]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _read_until(proc: subprocess.Popen, pattern: str, lines: list[str]) -> None:
    deadline = time.monotonic() + 180
    for line in proc.stdout:
        lines.append(line)
        if re.search(pattern, line):
            return
        assert time.monotonic() < deadline, "".join(lines[-20:])
    raise AssertionError(f"no {pattern!r}: " + "".join(lines[-20:]))


def _every_step_folder_committed(folder: Path) -> None:
    for entry in fs.scan_checkpoints(str(folder)):
        if entry.path.endswith(fs.TMP_SUFFIX):
            continue
        assert entry.complete and entry.marker is not None, (entry.path, entry.reason)
        assert not content_problem(entry.path), entry.path


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")
def test_ctrl_c_to_the_launcher_group_saves_once_and_a_second_stops_at_once(tmp_path, cpu_env):
    env = {**cpu_env, "NGPU": "2", "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"}
    folder = tmp_path / "checkpoint"
    procs: list[subprocess.Popen] = []
    try:
        # one Ctrl-C: the step ends, a checkpoint of it is committed, the launcher ends killed
        # by SIGINT (a shell shows 130) without a traceback
        first, lines = _launch(tmp_path, env, 100000), []
        procs.append(first)
        _read_until(first, r"step:\s+3\s", lines)
        mark = len(lines)
        os.killpg(first.pid, signal.SIGINT)
        out = "".join(lines) + first.communicate(timeout=120)[0]
        after = out.splitlines()[mark:]
        assert first.returncode == -signal.SIGINT, out[-3000:]
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
        about = [m for m in after if "Ctrl-C" in m]
        assert len(about) == 2, after  # the launcher's line, rank 0's "Stopping ..." line
        assert "torchtitan.launch: Ctrl-C: stopping 2 rank(s)" in about[0]
        k = int(re.search(r"Stopping after step (\d+) on Ctrl-C \(checkpoint written", out).group(1))
        assert f"step-{k}" in _names(folder) and not [n for n in _names(folder) if n.endswith(".tmp")]
        _every_step_folder_committed(folder)

        # the restart resumes from it; two quick Ctrl-Cs stop the ranks at once
        second, lines = _launch(tmp_path, env, 100000), []
        procs.append(second)
        _read_until(second, rf"Training starts at step {k + 1}\b", lines)
        _read_until(second, rf"step:\s+{k + 2}\s", lines)
        os.killpg(second.pid, signal.SIGINT)
        time.sleep(0.05)
        os.killpg(second.pid, signal.SIGINT)
        begin = time.monotonic()
        out = "".join(lines) + second.communicate(timeout=60)[0]
        assert time.monotonic() - begin < 10
        assert second.returncode == -signal.SIGINT, out[-3000:]
        assert "Traceback" not in out and "error:" not in out, out[-3000:]
        assert "torchtitan.launch: Ctrl-C: stopping 2 rank(s) at once, without saving" in out
        _every_step_folder_committed(folder)  # a write cut short stays step-N.tmp
    finally:
        for proc in procs:
            for pid in _children(proc.pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")
def test_ctrl_c_while_the_ranks_start_ends_at_once_without_traceback(tmp_path, cpu_env):
    env = {**cpu_env, "NGPU": "2", "OMP_NUM_THREADS": "1"}
    proc = _launch(tmp_path, env, 100000)
    try:
        lines: list[str] = []
        _read_until(proc, r"torchtitan\.launch", lines)  # run_train.sh's command line
        deadline = time.monotonic() + 60
        while len(_children(proc.pid)) < 2:  # the ranks exist, still importing torch
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        out = "".join(lines) + proc.communicate(timeout=60)[0]
    finally:
        for pid in _children(proc.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGINT, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out and "error:" not in out, out[-3000:]
    assert "Training starts" not in out
