"""The seed-checkpoint hint names the flags a later run needs to find it."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.config.job_config import Checkpoint


def _write_seed(dump_folder: str, folder: str, caplog) -> str:
    cfg = Checkpoint(enable=True, create_seed_checkpoint=True, folder=folder)
    manager = CheckpointManager(
        dataloader=None, model_parts=[torch.nn.Linear(2, 2)], optimizers=None,
        lr_schedulers=None, states=None, checkpoint_config=cfg, dump_folder=dump_folder,
    )
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        manager.save_seed_checkpoint()
    manager.close()
    (line,) = [m for m in caplog.messages if "seed checkpoint written to" in m]
    return line.split("start runs from it with ", 1)[1].split(" (", 1)[0]


@pytest.mark.parametrize(
    ("dump", "folder", "flags"),
    [
        ("./outputs", "checkpoint", "--checkpoint.enable"),
        ("{tmp}/seed", "checkpoint", "--checkpoint.enable --job.dump_folder {tmp}/seed"),
        ("./outputs", "seed_ckpt", "--checkpoint.enable --checkpoint.folder seed_ckpt"),
        ("{tmp}/x", "{tmp}/abs", "--checkpoint.enable --checkpoint.folder {tmp}/abs"),
    ],
)
def test_seed_hint_names_the_folder_when_not_the_default(tmp_path, monkeypatch, caplog,
                                                         dump, folder, flags):
    monkeypatch.chdir(tmp_path)  # ./outputs lands in the test's folder
    tmp = str(tmp_path)
    got = _write_seed(dump.format(tmp=tmp), folder.format(tmp=tmp), caplog)
    assert got == flags.format(tmp=tmp)
    assert os.path.isdir(os.path.join(dump.format(tmp=tmp), folder.format(tmp=tmp), "step-0"))
