"""`./run_train.sh` with no arguments trains the debug model and the loss falls."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow  # real training runs in subprocesses (about 30 s on 2 cores)


def test_default_run_trains_debug_model(dump_folder, cpu_env):
    """Plain ./run_train.sh (the debug config's model, data and schedule), cut to 10 of its
    steps: 2 s each on 2 cores, and the loss has fallen by 2 by then."""
    proc = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(dump_folder),
         "--metrics.disable_color_printing", "--training.steps", "10"],
        cwd=REPO_ROOT, env=cpu_env, capture_output=True, text=True, timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    losses = [float(x) for x in re.findall(r"step:\s*\d+\s+loss:\s*([0-9.]+)", out)]
    assert len(losses) == 10, out[-3000:]
    assert losses[-1] < losses[0] - 1.5, losses  # e.g. 8.25 -> 6.06 on the synthetic corpus
    assert "Training completed" in out


def test_legacy_torchrun_train_py_command(dump_folder, cpu_env):
    """The 2024 run_llama_train.sh launcher line: torchrun ... train.py --job.config_file X."""
    cmd = (
        "torchrun --nproc_per_node=1 --rdzv_backend c10d --rdzv_endpoint=localhost:0 "
        "--local-ranks-filter 0 --role rank --tee 3 train.py "
        "--job.config_file ./train_configs/debug_model.toml --model.flavor debugmodel_tiny "
        f"--training.seq_len 64 --training.steps 2 --job.dump_folder {dump_folder}"
    )
    proc = subprocess.run(
        ["bash", "-c", cmd], cwd=REPO_ROOT, env=cpu_env, capture_output=True, text=True,
        timeout=300,
    )
    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)  # colours, should a console be a terminal
    assert proc.returncode == 0, out[-3000:]
    assert len(re.findall(r"step:\s*\d+\s+loss:", out)) == 2
