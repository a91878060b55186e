"""One checkpoint folder, several writers: fault-tolerant replica groups stopped mid-step save
only from the writing group, and a commit never renames a folder whose ``.committed`` lists
files that are gone. One process, a tiny model, a stand-in for torchft's manager."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.checkpoint import CheckpointError, CheckpointManager, fs
from torchtitan.components.finite_check import FiniteCheck
from torchtitan.config.job_config import Checkpoint
from torchtitan.tools.lifecycle import Preemption
from torchtitan.train import Trainer


class _Step(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])


class _FaultTolerance:
    """What ``Trainer._stop_mid_step`` asks of ``FaultTolerance``."""

    semi_sync = False

    def __init__(self, writes: bool) -> None:
        self.writes = writes

    def writes_checkpoints(self) -> bool:
        return self.writes


def _manager(dump: Path, writer_id: str = "") -> CheckpointManager:
    cfg = Checkpoint(enable=True, interval=100, keep_latest_k=0)
    return CheckpointManager(None, [nn.Linear(2, 1, bias=False)], None, None,
                             {"train_state": _Step()}, cfg, str(dump), writer_id=writer_id)


def _stop_group_mid_step(dump: Path, replica_id: int, writes: bool) -> None:
    """A replica group whose step 3 was aborted by SIGTERM (step 2 is its last complete one)."""
    trainer = Trainer.__new__(Trainer)  # only what a mid-step stop uses
    trainer.step = 3
    trainer.ft = _FaultTolerance(writes)
    trainer.preemption = Preemption()
    trainer.finite = FiniteCheck()  # no unchecked step: the save checks nothing new
    trainer.checkpointer = _manager(dump, writer_id=f"replica_{replica_id}")
    try:
        trainer._stop_mid_step({"train_state": {"step": torch.tensor(2)}})
    finally:
        trainer.checkpointer.close()


def test_only_the_writing_replica_group_saves_on_a_mid_step_stop(tmp_path, caplog):
    folder = tmp_path / "checkpoint"
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        _stop_group_mid_step(tmp_path, replica_id=1, writes=False)
    assert not [n for n in os.listdir(folder) if n.startswith("step-")]  # nothing written
    (line,) = [m for m in caplog.messages if "Stopping mid-step 3" in m]
    assert "(another replica group writes the shared checkpoint" in line, line

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        _stop_group_mid_step(tmp_path, replica_id=0, writes=True)
    assert "saved step-2, the last completed step" in caplog.text
    assert [e.step for e in fs.complete_checkpoints(str(folder))] == [2]
    assert sorted(n for n in os.listdir(folder) if n.startswith("step-")) == ["step-2"]


def test_a_commit_refuses_a_folder_whose_listed_files_vanished(tmp_path, monkeypatch):
    """Another process removed a data file after the marker listed it: the save fails in one
    line, nothing is renamed to step-N, the older checkpoint stays whole."""
    ckpt = _manager(tmp_path)
    ckpt.save(1, force=True)
    collect = fs._collect_checksums

    def collect_while_another_process_deletes(root: str, files):
        os.remove(os.path.join(root, "__0_0.distcp"))
        return collect(root, files)

    monkeypatch.setattr(fs, "_collect_checksums", collect_while_another_process_deletes)
    with pytest.raises(CheckpointError) as err:
        ckpt.save(2, force=True)
    msg = str(err.value)
    assert msg.startswith("saving checkpoint step-2 to ") and "\n" not in msg
    assert "__0_0.distcp is gone before the commit" in msg and "(intact: step-1)" in msg, msg
    folder = Path(ckpt.folder)
    assert sorted(os.listdir(folder)) == [".writer.lock", "step-1"]
    assert fs.verify_checkpoint(str(folder / "step-1"))[0] == ""
    ckpt.close()


def test_a_commit_without_dcp_metadata_is_refused(tmp_path):
    tmp = tmp_path / "step-5.tmp"
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(b"x" * 10)  # the rest was removed before the commit
    with pytest.raises(FileNotFoundError, match=r"\.metadata is gone before the commit"):
        fs.commit_checkpoint(str(tmp), str(tmp_path / "step-5"), {"step": 5})
    assert not (tmp_path / "step-5").exists()
