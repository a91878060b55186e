"""DeepSeek-V3 debugmodel trains on CPU in-process (``--module deepseek_v3 --config
deepseek_v3_debugmodel``): the loss falls from near-uniform, the MoE routing bias moves toward
balance, the load figures are measured, and a bad setting stops with one line."""

from __future__ import annotations

import math

import pytest

from tests.integration.trainer_utils import RecordingTrainer
from torchtitan.config.manager import ConfigManager

ARGS = [
    "--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel",
    "--training.seq_len", "64", "--training.local_batch_size", "4",
    "--training.steps", "6", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1",
    "--activation_checkpoint.mode", "none", "--metrics.disable_color_printing",
    "--debug.seed", "0",
]


def test_debugmodel_loss_falls(tmp_path):
    cfg = ConfigManager().parse_args([*ARGS, "--job.dump_folder", str(tmp_path)])
    trainer = RecordingTrainer(cfg)
    try:
        trainer.train()
        moe = trainer.model_parts[0].layers["1"].moe
        bias = moe.expert_bias.clone()
    finally:
        trainer.close()
    losses = [loss for loss, _ in trainer.history]
    assert len(losses) == 6 and trainer.run.model_args.n_layers == 6
    assert math.isclose(losses[0], math.log(2256), rel_tol=0.1)  # near uniform at init
    assert losses[-1] < losses[0] - 0.8, losses
    assert bias.abs().max() > 0 and abs(float(bias.sum())) < 1e-5  # updated, centred


def test_bad_flavor_setting_is_one_line(tmp_path):
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    args = deepseekv3_args["debugmodel"]
    old = args.n_dense_layers
    args.n_dense_layers = 7
    try:
        cfg = ConfigManager().parse_args([*ARGS, "--job.dump_folder", str(tmp_path)])
        with pytest.raises(ValueError, match=r"^model n_dense_layers=7 must be between 0 and n_layers=6$"):
            RecordingTrainer(cfg)
    finally:
        args.n_dense_layers = old
