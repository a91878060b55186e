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
