"""scripts/loss_compare.py: equal layouts pass, different ones are caught."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT as ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import loss_compare  # noqa: E402

TINY = (
    "--model.flavor debugmodel_tiny --training.seq_len 64 --activation_checkpoint.mode none "
    "--lr_scheduler.warmup_steps 1"
)


def test_parse_losses_reads_console_lines():
    log = (
        "[rank0]:[titan] ... - INFO - \x1b[31mstep:  1  \x1b[32mloss:  8.2050  grad_norm: 0.6\n"
        "step: 12  loss:  7.8412  grad_norm:  1.2\nvalidate step:  12  loss:  6.0\n"
    )
    assert loss_compare.parse_losses(log) == {1: 8.205, 12: 7.8412}


def test_compare_verdict():
    rows, ok = loss_compare.compare({1: 8.0, 2: 7.0}, {1: 8.0, 2: 7.00001}, 1e-5, 1e-5)
    assert ok and len(rows) == 2
    _, ok = loss_compare.compare({1: 8.0, 2: 7.0}, {1: 8.0, 2: 7.01}, 1e-5, 1e-5)
    assert not ok


@pytest.mark.slow
def test_fsdp2_equals_ddp2_from_seed_checkpoint(tmp_path):
    """Same dp degree (so the same data), different sharding: equal losses."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    seed_dir = tmp_path / "seed"
    subprocess.run(
        ["./run_train.sh", *TINY.split(), "--checkpoint.enable",
         "--checkpoint.create_seed_checkpoint", "--job.dump_folder", str(seed_dir)],
        cwd=ROOT, env={**env, "NGPU": "1"}, check=True, capture_output=True, timeout=300,
    )
    seed = (
        f"--checkpoint.enable --checkpoint.initial_load_path {seed_dir}/checkpoint/step-0 "
        "--checkpoint.load_only"
    )
    common = ["--steps", "3", "--dump-folder", str(tmp_path / "cmp")]
    equal = subprocess.run(
        [sys.executable, "scripts/loss_compare.py", *common, "--assert-equal",
         "--a", f"NGPU=2 {TINY} {seed} --parallelism.data_parallel_shard_degree 2 "
                "--training.mixed_precision_param float32",
         "--b", f"NGPU=2 {TINY} {seed} --parallelism.data_parallel_shard_degree 1 "
                "--parallelism.data_parallel_replicate_degree 2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert equal.returncode == 0, equal.stdout + equal.stderr[-3000:]
    assert "verdict: EQUAL" in equal.stdout
    # A different global batch is a different run: the tool must say so and exit 1.
    differ = subprocess.run(
        [sys.executable, "scripts/loss_compare.py", *common, "--assert-equal",
         "--a", f"NGPU=1 {TINY} {seed} --training.local_batch_size 4",
         "--b", f"NGPU=1 {TINY} {seed} --training.local_batch_size 2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert differ.returncode == 1, differ.stdout + differ.stderr[-3000:]
    assert "verdict: DIFFERENT" in differ.stdout
