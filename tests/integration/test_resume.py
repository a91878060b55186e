"""End-to-end resume with the real Trainer (debugmodel_tiny, c4_test, CPU, deterministic).

Reference: 20 steps straight. Against it, bitwise equal per-step losses for
  * an async-saving run SIGKILLed while committing step-15 (keep_latest_k=2), resumed: it skips
    the half-written step-15.tmp, resumes from step-10, nothing older than it was lost;
  * a run stopped by SIGTERM mid-training (it saves where it stopped and exits 0), resumed.
Killed/signalled runs are subprocesses (``python -m torchtitan.train``); the others run
in-process to save start-up time.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.checkpoint_kill_hook import kill_env
from torchtitan.config.manager import ConfigManager
from torchtitan.train import Trainer

REPO = Path(__file__).resolve().parents[2]
STEPS = 20
FLAGS = [
    "--job.config_file", "./train_configs/debug_model.toml",
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--training.steps", str(STEPS),
    "--lr_scheduler.warmup_steps", "2",
    "--activation_checkpoint.mode", "none",
    "--metrics.log_freq", "1",
    "--metrics.disable_color_printing",
    "--debug.seed", "42",
    "--debug.deterministic",
    "--checkpoint.enable",
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


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _train(dump: Path, *flags: str) -> tuple[_Recorder, str]:
    """Run the trainer in this process; returns it and its log."""
    cfg = ConfigManager().parse_args([*FLAGS, "--job.dump_folder", str(dump), *flags])
    log = _Log()
    titan = logging.getLogger("torchtitan")
    titan.addHandler(log)
    old_level = titan.level
    titan.setLevel(logging.INFO)
    trainer = None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocesses (OMP_NUM_THREADS=1): same kernels, same bits
    try:
        trainer = _Recorder(cfg)
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        titan.removeHandler(log)
        titan.setLevel(old_level)
        torch.set_num_threads(threads)
        gc.enable()  # the Trainer disables automatic GC for its loop
    return trainer, log.text


def _popen(dump: Path, *flags: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torchtitan.train", *FLAGS, "--job.dump_folder", str(dump), *flags],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _dirs(dump: Path) -> list[str]:
    folder = dump / "checkpoint"
    names = [n for n in os.listdir(folder) if not n.startswith(".")]  # not the writer lock
    return sorted(names, key=lambda n: (int(n.split("-")[1].split(".")[0]), n))


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[int, float]:
    dump = tmp_path_factory.mktemp("straight")
    trainer, _ = _train(dump, "--checkpoint.interval", "10")
    assert sorted(trainer.losses) == list(range(1, STEPS + 1))
    assert _dirs(dump) == ["step-10", "step-20"]
    return trainer.losses


@pytest.mark.slow
def test_kill_during_async_commit_then_exact_resume(tmp_path, straight):
    flags = ["--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "2"]
    proc = _popen(tmp_path, *flags, "--checkpoint.async_mode", "async", env=kill_env(15, "commit"))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    # step-15 was never committed; the two complete ones before it are intact
    assert _dirs(tmp_path) == ["step-5", "step-10", "step-15.tmp"], out[-3000:]
    assert (tmp_path / "checkpoint" / "step-15.tmp" / ".metadata").exists()  # looks whole, isn't

    resumed, log = _train(tmp_path, *flags)
    assert "skipping incomplete checkpoint" in log and "step-15.tmp" in log
    assert "Checkpoint: loaded model, optimizer, lr_scheduler, dataloader, train_state" in log
    assert "step-10 (the newest complete checkpoint" in log
    assert sorted(resumed.losses) == list(range(11, STEPS + 1))
    for step, loss in resumed.losses.items():
        assert loss == straight[step], (step, loss, straight[step])  # bitwise
    assert _dirs(tmp_path) == ["step-15", "step-20"]  # rewritten, committed, purged to 2


@pytest.mark.slow
def test_sigterm_saves_and_resumes_exactly(tmp_path, straight):
    flags = ["--checkpoint.interval", "1000"]
    proc = _popen(tmp_path, *flags, "--training.steps", str(STEPS))
    lines = []
    deadline = time.monotonic() + 240
    for line in proc.stdout:  # SIGTERM once step 3 is logged
        lines.append(line)
        if "step:  3" in line:
            proc.send_signal(signal.SIGTERM)
            break
        assert time.monotonic() < deadline, "".join(lines[-30:])
    out = "".join(lines) + proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, out[-3000:]
    stopped = [d for d in _dirs(tmp_path)]
    assert len(stopped) == 1, stopped
    k = int(stopped[0].split("-")[1])
    # the signal lands after step k's work (agreed at its end) or inside step k + 1 (one
    # process: that step is aborted and step k, the last completed one, is saved)
    assert 3 <= k < STEPS, out[-3000:]
    assert (f"Stopping after step {k} on SIGTERM" in out
            or f"Stopping mid-step {k + 1} on SIGTERM (saved step-{k}, the last completed" in out), out[-3000:]

    resumed, log = _train(tmp_path, *flags)
    assert f"Training starts at step {k + 1}" in log
    assert sorted(resumed.losses) == list(range(k + 1, STEPS + 1))
    for step, loss in resumed.losses.items():
        assert loss == straight[step], (step, loss, straight[step])
