"""Preemption (SIGTERM) is deterministic: checkpoint written, exit 0, one line, exact resume.

* one process: a SIGTERM in the middle of a step aborts it at once; the last *completed* step
  is saved (with the data position and RNG from before the aborted step) and the resumed run is
  bitwise the run that never stopped (in-process, the signal sent from inside step 3's forward);
* two gloo ranks under ``torchtitan.launch`` (what ./run_train.sh runs) with torchrun's grace
  cut to 1 s, steps longer than that: SIGTERM to the launcher reaches the ranks, they finish the
  step, save and exit 0; the launcher exits 0 with one line and no traceback.
"""

from __future__ import annotations

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
from torchtitan.config.manager import ConfigManager
from torchtitan.train import Trainer

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


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_and_exits_zero(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("NGPU", "CONFIG_FILE", "LOG_RANK")}
    env.update(NGPU="2", CUDA_VISIBLE_DEVICES="", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1", OMP_NUM_THREADS="1")
    flags = [f for f in FLAGS if f != "--debug.deterministic"]
    flags[flags.index("--training.steps") + 1] = "40"
    cmd = ["./run_train.sh", *flags, "--training.global_batch_size", "96", "--job.dump_folder", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, sent = [], None
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        lines.append(line)
        if "step:  2" in line and sent is None:
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)  # the launcher (run_train.sh execs it)
        assert time.monotonic() < deadline, "".join(lines[-20:])
    proc.wait(timeout=60)
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]
    assert "torchtitan.launch: SIGTERM: asking 2 rank(s) to save a checkpoint and stop" in out
    assert "Traceback" not in out and "SignalException" not in out, out[-3000:]
    (saved,) = os.listdir(tmp_path / "checkpoint")
    k = int(saved.split("-")[1])
    assert 2 <= k < 40 and f"Stopping after step {k} on SIGTERM (checkpoint written" in out
    assert re.search(r"checkpoint written [\d.]+ s after the signal", out)  # torchrun's 1 s grace unused
