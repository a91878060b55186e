"""Inductor's on-disk cache across ranks: a rank never runs another rank's compiled graph.

Two CPU ranks with TP2 and the compiled loss (loss parallel bakes each TP rank's vocabulary
offset into its graph) run twice on one fresh cache folder; the second run finds the cache
warm. Before each rank had its own cache subfolder, the second run logged 2.71 instead of 8.19
(a rank loaded the other rank's graph).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # torchrun + inductor compiles


def _step1_loss(tmp_path: Path, *flags: str) -> float:
    env = dict(os.environ, NGPU="2", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    env.pop("COMM_MODE", None)
    proc = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(tmp_path / "out"), "--model.flavor",
         "debugmodel_tiny", "--training.seq_len", "64", "--training.steps", "1",
         "--debug.seed", "3", "--parallelism.tensor_parallel_degree", "2",
         "--metrics.disable_color_printing", *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return float(re.search(r"step:\s+1\s+loss:\s+([0-9.]+)", out).group(1))


def test_warm_inductor_cache_gives_each_rank_its_own_compiled_loss(tmp_path):
    eager = _step1_loss(tmp_path)
    compiled = ["--compile.enable", "--compile.components", "loss"]
    cold = _step1_loss(tmp_path, *compiled)
    warm = _step1_loss(tmp_path, *compiled)
    assert cold == warm == eager
    assert sorted(p.name for p in (tmp_path / "inductor").iterdir()) == ["rank0", "rank1"]
