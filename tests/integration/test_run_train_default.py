"""`./run_train.sh` with no arguments trains the debug model and the loss falls."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_default_run_trains_debug_model(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CONFIG_FILE", "MODULE", "CONFIG", "NGPU")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(tmp_path), "--metrics.disable_color_printing"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    losses = [float(x) for x in re.findall(r"step:\s*\d+\s+loss:\s*([0-9.]+)", out)]
    assert len(losses) == 30, out[-3000:]
    assert losses[-1] < losses[0] - 2.0, losses  # e.g. 8.2 -> 4.5 on the synthetic corpus
    assert "Training completed" in out


def test_legacy_torchrun_train_py_command(tmp_path):
    """Seed 003's launcher line: torchrun ... train.py --job.config_file $CONFIG_FILE $overrides."""
    cmd = (
        "torchrun --nproc_per_node=1 --rdzv_backend c10d --rdzv_endpoint=localhost:0 "
        "--local-ranks-filter 0 --role rank --tee 3 train.py "
        "--job.config_file ./train_configs/debug_model.toml --model.flavor debugmodel_tiny "
        f"--training.seq_len 64 --training.steps 2 --job.dump_folder {tmp_path}"
    )
    proc = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)  # colours are on by default
    assert proc.returncode == 0, out[-3000:]
    assert len(re.findall(r"step:\s*\d+\s+loss:", out)) == 2
