"""gpt-oss 120B dry run at 64 ranks with expert parallel 8 (``COMM_MODE=fake_backend``, the
command of docs/models.md): it builds the published size, runs its step on fake tensors and
logs the memory estimate (about 55 s of CPU time; 2 minutes of wall time when other jobs share
the 2 cores)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_120b_at_64_ranks_with_ep8_runs_its_step_and_estimates_memory(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore", NGPU="64", COMM_MODE="fake_backend",
               CONFIG_FILE="./train_configs/gpt_oss_debugmodel.toml")
    proc = subprocess.run(
        ["./run_train.sh", "--model.flavor", "120B", "--parallelism.expert_parallel_degree", "8",
         "--training.seq_len", "4096", "--training.local_batch_size", "1",
         "--activation_checkpoint.mode", "full", "--training.mixed_precision_param", "bfloat16",
         "--memory_estimation.enable", "--job.dump_folder", str(tmp_path / "out")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Model gpt_oss 120B: 116,829,156,672 parameters" in out
    assert "ep=8: 16 experts per rank" in out
    peak = re.search(r"Estimated peak memory of rank 0 at world size 64 .*: ([0-9.]+) GiB", out)
    assert peak is not None and 10 < float(peak.group(1)) < 80, out[-3000:]
    assert "step 1 ran forward, backward and the optimizer on fake tensors" in out
