"""Which checkpoint a restart loads after an operator acted on the folder: a rewind with
``load_step`` (the newer folders are set aside, never deleted), and step folders without a
``.committed`` marker (never picked silently). One process, a tiny model, no subprocess."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.checkpoint import CheckpointError, CheckpointManager
from torchtitan.config.job_config import Checkpoint


class Step(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])


class Run:
    """A linear model whose weight records the trajectory: each step adds ``offset + step``."""

    def __init__(self, dump: Path, offset: float = 0.0, **ckpt: Any) -> None:
        self.model = nn.Linear(2, 1, bias=False)
        nn.init.zeros_(self.model.weight)
        self.offset = offset
        self.state = Step()
        cfg = Checkpoint(enable=True, interval=2, keep_latest_k=0, last_save_model_only=False)
        for key, value in ckpt.items():
            setattr(cfg, key, value)
        self.ckpt = CheckpointManager(None, [self.model], None, None, {"train_state": self.state},
                                      cfg, str(dump))
        self.folder = Path(self.ckpt.folder)

    def train(self, until: int) -> None:
        while self.state.step < until:
            self.state.step += 1
            with torch.no_grad():
                self.model.weight += self.offset + self.state.step
            self.ckpt.save(self.state.step)

    @property
    def weight(self) -> float:
        return float(self.model.weight.detach()[0, 0])

    def close(self) -> None:
        self.ckpt.close()


def _names(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if not n.startswith("."))


@pytest.fixture
def log(caplog):
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        yield caplog


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_rewind_sets_newer_steps_aside_and_a_plain_restart_follows_the_new_trajectory(tmp_path, log):
    first = Run(tmp_path)
    first.train(6)
    first.close()
    assert _names(first.folder) == ["step-2", "step-4", "step-6"]

    rewound = Run(tmp_path, offset=100.0)  # another trajectory from step 2 on
    log.clear()
    assert rewound.ckpt.load(step=2) and rewound.state.step == 2
    assert _names(first.folder) == ["step-2", "step-4", "step-6"]  # the load alone renames nothing
    rewound.ckpt.set_aside_abandoned()  # what the Trainer does before training on
    (line,) = [m for m in _warnings(log) if "rewound" in m]
    assert "rewound to step-2 (checkpoint.load_step): the newer step-4, step-6 belong to the abandoned" in line
    names = _names(first.folder)
    assert [n for n in names if ".abandoned-" not in n] == ["step-2"]
    assert sorted(n.split(".")[0] for n in names if ".abandoned-" in n) == ["step-4", "step-6"]
    rewound.train(4)
    rewound.close()
    assert not [m for m in _warnings(log) if "superseded" in m or "already existed" in m]
    assert [n for n in _names(first.folder) if "." not in n] == ["step-2", "step-4"]

    restart = Run(tmp_path)
    log.clear()
    assert restart.ckpt.load()
    assert restart.state.step == 4 and restart.weight == rewound.weight  # not the abandoned step-6
    assert "step-4 (the newest complete checkpoint" in log.text
    restart.close()
    # nothing was lost: the abandoned folders still load by hand
    (old6,) = [n for n in _names(first.folder) if n.startswith("step-6.abandoned-")]
    assert (first.folder / old6 / ".committed").exists()


def test_a_reader_of_an_older_step_changes_nothing_and_a_first_save_sets_aside(tmp_path, log):
    """Loading an older step to look at it (or reshard it) into a folder that this manager
    never saves to leaves the newer steps where they are; a save there is a rewind."""
    first = Run(tmp_path)
    first.train(6)
    first.close()
    reader = Run(tmp_path)
    assert reader.ckpt.load(step=2) and reader.state.step == 2
    reader.close()
    assert _names(first.folder) == ["step-2", "step-4", "step-6"]
    assert not [m for m in _warnings(log) if "rewound" in m]
    newest = Run(tmp_path)
    assert newest.ckpt.load() and newest.state.step == 6 and newest.weight == first.weight
    newest.close()

    writer = Run(tmp_path, offset=100.0)
    assert writer.ckpt.load(step=2)
    writer.train(3)  # no save at step 3 (interval 2): still nothing renamed
    assert _names(first.folder) == ["step-2", "step-4", "step-6"]
    writer.train(4)
    writer.close()
    assert [n for n in _names(first.folder) if "." not in n] == ["step-2", "step-4"]
    assert sorted(n.split(".")[0] for n in _names(first.folder) if ".abandoned-" in n) == ["step-4", "step-6"]
    assert len([m for m in _warnings(log) if "rewound to step-2" in m]) == 1


def test_load_only_rewind_changes_nothing(tmp_path):
    first = Run(tmp_path)
    first.train(6)
    first.close()
    peek = Run(tmp_path, load_only=True)
    assert peek.ckpt.load(step=2) and peek.state.step == 2
    assert _names(first.folder) == ["step-2", "step-4", "step-6"]


def _strip_marker(path: Path) -> None:
    os.remove(path / ".committed")


def test_a_step_without_commit_marker_is_skipped_with_a_warning_and_loads_only_when_asked(tmp_path, log):
    first = Run(tmp_path)
    first.train(6)
    first.close()
    _strip_marker(first.folder / "step-6")  # e.g. copied by hand, or written by another tool

    auto = Run(tmp_path)
    log.clear()
    assert auto.ckpt.load() and auto.state.step == 4
    (line,) = [m for m in _warnings(log) if "step-6" in m]
    assert line.endswith(
        "step-6: it has no .committed (written by another tool or copied by hand), so its file "
        "sizes and checksums cannot be checked; load it anyway with --checkpoint.load_step 6"
    ), line
    auto.close()

    asked = Run(tmp_path, load_only=True)
    log.clear()
    assert asked.ckpt.load(step=6) and asked.state.step == 6
    (line,) = [m for m in _warnings(log) if "step-6" in m]
    assert "cannot be checked; loading it anyway because checkpoint.load_step=6 asks for it" in line


def test_only_unverified_steps_refuse_a_fresh_start_and_are_never_purged(tmp_path, log):
    first = Run(tmp_path)
    first.train(4)
    first.close()
    for name in ("step-2", "step-4"):
        _strip_marker(first.folder / name)
    with pytest.raises(CheckpointError, match=r"none of them verifies .*--checkpoint.load_step 4"):
        Run(tmp_path).ckpt.load()
    again = Run(tmp_path, keep_latest_k=1)
    assert again.ckpt.load(step=4) and again.state.step == 4
    again.train(8)  # saves step-6, step-8 and purges beyond the newest one
    again.close()
    assert _names(first.folder) == ["step-2", "step-4", "step-8"]


def test_initial_load_path_without_marker_loads_with_one_warning(tmp_path, log):
    first = Run(tmp_path / "pre")
    first.train(2)
    first.close()
    _strip_marker(first.folder / "step-2")
    for target in (first.folder / "step-2", first.folder):  # the step folder, or its root
        run = Run(tmp_path / "ft", initial_load_path=str(target), initial_load_model_only=False)
        log.clear()
        assert run.ckpt.load() and run.weight == first.weight
        (line,) = [m for m in _warnings(log) if "step-2" in m]
        assert line.startswith("Checkpoint: initial_load_path ") and "cannot be checked" in line
        run.close()
