"""Preemption (SIGTERM) is deterministic: checkpoint written, exit 0, one line, exact resume.

* one process: a SIGTERM in the middle of a step aborts it at once; the last *completed* step
  is saved (with the data position and RNG from before the aborted step) and the resumed run is
  bitwise the run that never stopped (in-process, the signal sent from inside step 3's forward);
* two gloo ranks under ``./run_train.sh`` (torchtitan.launch -> torchrun) with torchrun's grace
  cut to 1 s: SIGTERM to the launcher reaches the ranks, they finish the step, save and exit 0;
  the launcher exits 0 with one line and no traceback. The same test covers the launcher's
  death (no orphans) and the one-writer lock, to share the launches.
"""

from __future__ import annotations

import contextlib
import gc
import json
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
from torchtitan.config.manager import ConfigManager
from torchtitan.tools.lifecycle import _children
from torchtitan.train import Trainer, main

FLAGS = [
    "--job.config_file", "./train_configs/debug_model.toml",
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--training.steps", "6",
    "--activation_checkpoint.mode", "none",
    "--metrics.log_freq", "1",
    "--metrics.disable_color_printing",
    "--debug.seed", "7",
    "--debug.deterministic",
    "--checkpoint.enable",
    "--checkpoint.interval", "1000",
    "--checkpoint.no_last_save_model_only",
]


class _Recorder(Trainer):
    def __init__(self, job_config):
        super().__init__(job_config)
        self.losses: dict[int, float] = {}

    def train_step(self, data_iterator):
        loss, grad_norm = super().train_step(data_iterator)
        self.losses[self.step] = loss
        return loss, grad_norm


def _train(dump: Path) -> tuple[_Recorder, list[str]]:
    lines: list[str] = []

    class H(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = H(logging.INFO)
    titan = logging.getLogger("torchtitan")
    titan.addHandler(handler)
    old_level, threads = titan.level, torch.get_num_threads()
    titan.setLevel(logging.INFO)
    torch.set_num_threads(1)
    trainer = None
    try:
        trainer = _Recorder(ConfigManager().parse_args([*FLAGS, "--job.dump_folder", str(dump)]))
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        titan.removeHandler(handler)
        titan.setLevel(old_level)
        torch.set_num_threads(threads)
        gc.enable()
    return trainer, lines


def test_sigterm_mid_step_saves_the_last_completed_step_and_resumes_exactly(tmp_path, monkeypatch):
    straight, _ = _train(tmp_path / "straight")
    assert sorted(straight.losses) == [1, 2, 3, 4, 5, 6]

    original = step_module.forward_backward
    holder: dict[str, Trainer] = {}

    def signalled(run, inputs, labels, loss_scale):
        if holder["t"].step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives inside step 3's forward
        return original(run, inputs, labels, loss_scale)

    monkeypatch.setattr(step_module, "forward_backward", signalled)
    real_init = _Recorder.__init__

    def init(self, job_config):
        real_init(self, job_config)
        holder["t"] = self

    monkeypatch.setattr(_Recorder, "__init__", init)
    dump = tmp_path / "stopped"
    stopped, log = _train(dump)
    assert sorted(stopped.losses) == [1, 2]  # step 3 was aborted, not finished
    assert any("Stopping mid-step 3 on SIGTERM (saved step-2, the last completed step" in m for m in log), log
    assert sorted(os.listdir(dump / "checkpoint")) == ["step-2"]
    assert signal.getsignal(signal.SIGTERM) is not None  # the trainer put the old handler back

    monkeypatch.setattr(step_module, "forward_backward", original)
    resumed, log = _train(dump)
    assert any("Training starts at step 3" in m for m in log)
    assert sorted(resumed.losses) == [3, 4, 5, 6]
    for step, loss in resumed.losses.items():
        assert loss == straight.losses[step], (step, loss, straight.losses[step])  # bitwise



def _running(pid: int) -> bool:
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


def _main_here(dump: Path, *flags: str) -> tuple[int, list[str]]:
    lines: list[str] = []

    class H(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    titan = logging.getLogger("torchtitan")
    handler = H(logging.INFO)
    titan.addHandler(handler)
    try:
        code = main([*flags, "--job.dump_folder", str(dump)])
    finally:
        titan.removeHandler(handler)
        gc.enable()
    return code, lines


def _steps(folder: Path) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in os.listdir(folder) if n.startswith("step-") and "." not in n)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")
def test_launcher_sigterm_exits_0_and_kill9_leaves_no_orphan_nor_second_writer(tmp_path, cpu_env):
    """Items 7 and 6 with two launches of ``./run_train.sh`` (two gloo ranks):

    1. while it trains, a second job on the same folder is refused, naming the holder (lock);
    2. SIGTERM to the launcher (torchrun's grace cut to 1 s): the ranks save and exit 0; the
       launcher exits 0 with one line and no traceback;
    3. the rerun resumes; ``kill -9`` of its launcher: both ranks are gone within 5 s;
    4. a restart takes over the dead job's lock with a warning and resumes.
    """
    env = {**cpu_env, "NGPU": "2", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1", "OMP_NUM_THREADS": "1"}
    flags = [f for f in FLAGS if f != "--debug.deterministic"]
    flags[flags.index("--training.steps") + 1] = "100000"
    flags[flags.index("--checkpoint.interval") + 1] = "2"
    folder = tmp_path / "checkpoint"
    cmd = ["./run_train.sh", *flags, "--job.dump_folder", str(tmp_path)]

    def steps(n: int) -> list[str]:  # the same flags, n steps
        out = list(flags)
        out[out.index("--training.steps") + 1] = str(n)
        return out

    def launch() -> subprocess.Popen:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def wait_for(proc: subprocess.Popen, needle: str, lines: list[str]) -> None:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            lines.append(line)
            if needle in line:
                return
            assert time.monotonic() < deadline, "".join(lines[-20:])
        raise AssertionError(f"no {needle!r}: " + "".join(lines[-20:]))

    first, second, lines = launch(), None, []
    try:
        wait_for(first, "saved checkpoint step-2", lines)
        holder = json.loads((folder / ".writer.lock").read_text())
        assert holder["pid"] in _children(first.pid)
        code, log = _main_here(tmp_path, *steps(3))
        errors = [m for m in log if m.startswith("error:")]
        assert code == 2 and len(errors) == 1, log[-5:]
        assert f"is in use by another job (pid {holder['pid']} on host" in errors[0]

        first.send_signal(signal.SIGTERM)  # the launcher: run_train.sh execs it
        out = "".join(lines) + first.communicate(timeout=120)[0]
        assert first.returncode == 0, out[-3000:]
        assert "torchtitan.launch: SIGTERM: asking 2 rank(s) to save a checkpoint and stop" in out
        assert "Traceback" not in out and "SignalException" not in out, out[-3000:]
        k = int(re.search(r"Stopping after step (\d+) on SIGTERM \(checkpoint written", out).group(1))
        assert _steps(folder)[-1] == k

        second, lines = launch(), []
        wait_for(second, f"Training starts at step {k + 1}", lines)
        ranks = _children(second.pid)
        assert len(ranks) == 2, ranks
        second.send_signal(signal.SIGKILL)
        second.wait(timeout=10)
        killed = time.monotonic()
        while any(_running(r) for r in ranks) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        assert not any(_running(r) for r in ranks), "a rank survived its launcher"
        assert time.monotonic() - killed < 5
    finally:
        for proc in (first, second):
            if proc is None:
                continue
            for pid in _children(proc.pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
    newest = _steps(folder)[-1]
    code, log = _main_here(tmp_path, *steps(newest + 1))
    assert code == 0, log[-5:]
    assert any(f"taking over the writer lock {folder}/.writer.lock: its holder, pid" in m
               and "is no longer running" in m for m in log), log
    assert any(f"Training starts at step {newest + 1}" in m for m in log)
