"""Seed checkpoint + load_only across layouts, through ./run_train.sh (real torchrun on CPU).

The seed command of docs/debugging (NGPU=1, every degree 1) writes step-0; then a 2-rank FSDP
job and a 2-rank DDP job (the same dp degree, so the same data) both start from it with
``--checkpoint.load_only`` and must log the same losses (fp32: |diff| < 1e-5), while never
writing a checkpoint. (Their own random inits differ: FSDP initialises sharded parameters.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--activation_checkpoint.mode", "none",
    "--metrics.log_freq", "1",
    "--metrics.disable_color_printing",
    "--debug.seed", "7",
]
SEED_FLAGS = [
    "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
    "--parallelism.data_parallel_replicate_degree", "1",
    "--parallelism.data_parallel_shard_degree", "1",
    "--parallelism.tensor_parallel_degree", "1",
    "--parallelism.pipeline_parallel_degree", "1",
    "--parallelism.context_parallel_degree", "1",
    "--parallelism.expert_parallel_degree", "1",
]
DRIVER = '''
import json, os, sys
import torchtitan.components.metrics as metrics
_log = metrics.MetricsProcessor.log
def log(self, step, loss, *args, **kwargs):
    if os.environ.get("RANK", "0") == "0":
        with open(os.environ["TT_LOSS_FILE"], "a") as f:
            f.write(json.dumps([step, loss]) + "\\n")
    return _log(self, step, loss, *args, **kwargs)
metrics.MetricsProcessor.log = log
from torchtitan.train import main
sys.exit(main())
'''


def _run(tmp_path: Path, name: str, ngpu: int, *flags: str) -> tuple[str, dict[int, float]]:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    losses = tmp_path / f"{name}.jsonl"
    env = {
        **os.environ,
        "NGPU": str(ngpu),
        "CONFIG_FILE": "./train_configs/debug_model.toml",
        "TRAIN_FILE": str(driver),
        "TT_LOSS_FILE": str(losses),
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run(
        ["./run_train.sh", *TINY, "--job.dump_folder", str(tmp_path / "run"), *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    recorded = {}
    if losses.exists():
        recorded = {s: v for s, v in (json.loads(line) for line in losses.read_text().splitlines())}
    return out, recorded


@pytest.mark.slow
def test_seed_checkpoint_then_load_only_in_two_layouts(tmp_path):
    folder = tmp_path / "run" / "checkpoint"
    out, _ = _run(tmp_path, "seed", 1, *SEED_FLAGS)
    assert os.listdir(folder) == ["step-0"] and "seed checkpoint written to" in out
    marker = json.loads((folder / "step-0" / ".committed").read_text())
    assert marker["seed"] and marker["model_only"] and marker["states"] == []
    before = sorted(os.listdir(folder / "step-0"))

    common = ["--checkpoint.enable", "--checkpoint.load_only", "--training.steps", "2"]
    out1, fsdp = _run(tmp_path, "fsdp2", 2, *common, "--parallelism.data_parallel_shard_degree", "2")
    out2, ddp = _run(
        tmp_path, "ddp2", 2, *common,
        "--parallelism.data_parallel_shard_degree", "1", "--parallelism.data_parallel_replicate_degree", "2",
    )
    assert "dp_shard=2" in out1 and "dp_replicate=2" in out2
    for out in (out1, out2):
        assert "Checkpoint: loaded model from" in out and "step-0" in out
        assert "load_only" in out
    assert sorted(fsdp) == sorted(ddp) == [1, 2]
    for step in (1, 2):
        assert abs(fsdp[step] - ddp[step]) < 1e-5, (fsdp, ddp)
    # load_only: nothing new was written
    assert os.listdir(folder) == ["step-0"] and sorted(os.listdir(folder / "step-0")) == before
