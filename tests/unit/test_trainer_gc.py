"""The Trainer turns automatic garbage collection off for its loop (collecting every
``training.gc_freq`` steps) and, on close, back to what it was: a process that goes on
(tests, notebooks) keeps collecting."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("enabled_before", [True, False])
def test_close_restores_automatic_collection(tmp_path, monkeypatch, enabled_before):
    from torchtitan.config.manager import ConfigManager
    from torchtitan.train import Trainer

    monkeypatch.chdir(REPO_ROOT)
    cfg = ConfigManager().parse_args(
        ["--job.config_file", "train_configs/debug_model.toml", "--model.flavor",
         "debugmodel_tiny", "--training.seq_len", "32", "--training.local_batch_size", "1",
         "--job.dump_folder", str(tmp_path)])
    (gc.enable if enabled_before else gc.disable)()
    try:
        trainer = Trainer(cfg)
        assert not gc.isenabled()
        trainer.close()
        assert gc.isenabled() is enabled_before
    finally:
        gc.enable()
