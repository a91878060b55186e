"""CheckpointManager in one process: save/load, exact resume, atomic commit, purging, options.

Uses a small MLP with the real optimizer / LR-scheduler containers, a Stateful toy data stream
and a train state that carries the RNG (the loss draws random targets, so a resume that does
not restore the RNG, the data position or the optimizer diverges at once).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.checkpoint import (
    HOOKS_ENV,
    CheckpointError,
    CheckpointManager,
    SaveHooks,
    check_model_shapes,
    fs,
    load,
    save,
)
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.job_config import Checkpoint, LRScheduler, Optimizer

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture
def caplog(caplog):
    """caplog that also sees the ``torchtitan`` logger when init_logger() turned propagation off."""
    titan = logging.getLogger("torchtitan")
    titan.addHandler(caplog.handler)
    yield caplog
    titan.removeHandler(caplog.handler)


class ToyStream(Stateful):
    """A deterministic batch stream with a position (keyed by dp rank like the real loader)."""

    def __init__(self, dp_rank: int = 0, dp_world: int = 1):
        self.pos = 0
        self.key = f"dp_rank_{dp_rank}"
        self.dp_world = dp_world

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.pos)
        self.pos += 1
        return torch.randn(4, 8, generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {self.key: pickle.dumps({"pos": self.pos}), "world_size": self.dp_world}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["world_size"] != self.dp_world:
            raise ValueError(f"dp degree changed from {sd['world_size']} to {self.dp_world}")
        self.pos = pickle.loads(sd[self.key])["pos"]


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "rng": torch.get_rng_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        torch.set_rng_state(sd["rng"])


class Rig:
    """Model + optimizer + scheduler + data + train state + CheckpointManager."""

    def __init__(
        self,
        folder: Path,
        width: int = 16,
        stream: ToyStream | None = None,
        save_hooks: SaveHooks | None = None,
        **ckpt: Any,
    ):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))
        self.opt = OptimizersContainer([self.model], Optimizer(lr=1e-2, implementation="for-loop"))
        self.sched = LRSchedulersContainer(self.opt, LRScheduler(warmup_steps=2), 10)
        self.data = stream or ToyStream()
        self.state = TrainState()
        cfg = Checkpoint(enable=True, interval=2, keep_latest_k=0, last_save_model_only=False)
        for key, value in ckpt.items():
            setattr(cfg, key, value)
        self.ckpt = CheckpointManager(
            dataloader=self.data,
            model_parts=[self.model],
            optimizers=self.opt,
            lr_schedulers=self.sched,
            states={"train_state": self.state},
            checkpoint_config=cfg,
            dump_folder=str(folder),
            save_hooks=save_hooks,
        )
        self.folder = folder / cfg.folder

    def train(self, until: int, total: int = 10) -> list[float]:
        """Train from the current step to ``until``, saving as configured; returns the losses."""
        losses = []
        while self.state.step < until:
            self.state.step += 1
            x = self.data.next()
            target = torch.randn(4, 1)  # consumes the RNG: resume must restore it
            loss = ((self.model(x) - target) ** 2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.ckpt.maybe_wait_for_staging()
            self.opt.step()
            self.sched.step()
            losses.append(loss.item())
            self.ckpt.save(self.state.step, last_step=self.state.step == total)
        return losses

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _steps(folder: Path) -> list[str]:
    # dotfiles (the writer lock .writer.lock) are not checkpoints
    return sorted(n for n in os.listdir(folder) if not n.startswith(".")) if folder.exists() else []


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_exact_resume(tmp_path, async_mode):
    straight = Rig(tmp_path / "a", async_mode=async_mode)
    ref = straight.train(10)
    straight.ckpt.close()
    assert _steps(straight.folder) == [f"step-{n}" for n in (10, 2, 4, 6, 8)]
    # Resume from step-4 in a fresh folder: the rest must be bitwise identical.
    shutil.copytree(straight.folder / "step-4", tmp_path / "b" / "checkpoint" / "step-4")
    resumed = Rig(tmp_path / "b", async_mode=async_mode)
    torch.manual_seed(123)  # a different RNG state before loading: the checkpoint restores it
    assert resumed.ckpt.load() is True
    assert resumed.state.step == 4 and resumed.data.pos == 4
    assert resumed.train(10) == ref[4:]
    resumed.ckpt.close()
    for a, b in zip(straight.params(), resumed.params()):
        assert torch.equal(a, b)


def test_commit_marker_and_no_leftovers(tmp_path):
    rig = Rig(tmp_path)
    rig.train(2)
    path = rig.folder / "step-2"
    marker = json.loads((path / ".committed").read_text())
    assert marker["step"] == 2 and marker["world_size"] == 1 and not marker["model_only"]
    assert marker["states"] == ["dataloader", "lr_scheduler", "optimizer", "train_state"]
    on_disk = {f: (path / f).stat().st_size for f in os.listdir(path) if f != ".committed"}
    assert marker["files"] == on_disk and ".metadata" in on_disk
    assert _steps(rig.folder) == ["step-2"]  # no step-2.tmp left behind


def test_keep_latest_k_purges_old_and_stale(tmp_path):
    rig = Rig(tmp_path, interval=1, keep_latest_k=2)
    (rig.folder / "step-1.tmp").mkdir(parents=True)  # an interrupted write of an old run
    rig.train(5)
    rig.ckpt.close()  # joins the purge thread
    assert _steps(rig.folder) == ["step-4", "step-5"]


def test_start_up_names_the_save_that_would_not_fit(tmp_path, monkeypatch, caplog):
    """check_space (called when training starts or resumes) counts the saves still ahead, the
    checkpoints keep_latest_k keeps at once, those already in the folder, and a model-only last
    save in the export dtype; the warning names the first save that runs out of room."""
    from collections import namedtuple

    from torchtitan.components.checkpoint.space import checkpoint_sizes

    usage = namedtuple("usage", "total used free")

    def warnings_for(rig: Rig, start: int, free: float) -> list[str]:
        estimate = sum(checkpoint_sizes(rig.ckpt.model)[1:])
        monkeypatch.setattr(shutil, "disk_usage",
                            lambda path: usage(10**12, 0, int(free * estimate)))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="torchtitan"):
            rig.ckpt.check_space(start, 10)
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    rig = Rig(tmp_path / "a")  # every 2 steps, keeps all: saves 2, 4, 6, 8, 10
    (line,) = warnings_for(rig, 0, 2.5)
    assert "this run saves 5 checkpoints" in line and "the save at step 6 will fail" in line
    assert warnings_for(rig, 0, 5.0) == []
    rig.train(4, total=10)  # step-2 and step-4 are on disk now (their bytes are not free)
    (line,) = warnings_for(rig, 4, 2.5)
    assert "this run saves 3 checkpoints" in line and "the save at step 10 will fail" in line
    assert warnings_for(Rig(tmp_path / "b", keep_latest_k=1), 0, 2.5) == []
    (line,) = warnings_for(Rig(tmp_path / "c", keep_latest_k=3), 0, 2.5)
    assert "keeps the latest 3" in line and "the save at step 6 will fail" in line
    small_last = Rig(tmp_path / "d", last_save_model_only=True, export_dtype="bfloat16")
    assert warnings_for(small_last, 4, 2.2) == []  # 6 and 8 full, 10 only bf16 weights
    assert warnings_for(Rig(tmp_path / "e"), 4, 2.2) != []


def test_purge_never_lists_newest_or_protected(tmp_path):
    folder = tmp_path / "ck"
    for step in (1, 2, 3):
        save.save_dcp_single_process({"w": torch.zeros(2)}, str(folder / f"step-{step}"), {"step": step})
    (folder / "step-4.tmp").mkdir()
    doomed = fs.purge_candidates(str(folder), 1, protect=[str(folder / "step-4.tmp")])
    assert sorted(os.path.basename(p) for p in doomed) == ["step-1", "step-2"]
    assert fs.purge_candidates(str(folder), 0) == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_purge_interrupted_midway_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    """keep_latest_k's purge dies after removing one data file of step-1 (the chaos test's
    kill -9 at a random moment): no ``step-1`` that looks committed but lacks files is left
    (it is renamed before it is emptied), and the next purge removes the rest."""
    real_rmtree = shutil.rmtree
    interrupted = []

    def dies_after_one_file(path, ignore_errors=False):
        data = sorted(p for p in os.listdir(path) if p.endswith(".distcp")) if os.path.isdir(path) else []
        if data and not interrupted:
            os.remove(os.path.join(path, data[0]))
            interrupted.append(os.path.basename(path))
            raise SystemExit  # the purge thread stops here, like a process killed mid-delete
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", dies_after_one_file)
    rig = Rig(tmp_path, interval=1, keep_latest_k=2)
    rig.train(3)
    rig.ckpt.close()
    assert interrupted
    assert [(e.step, e.complete) for e in fs.scan_checkpoints(str(rig.folder))] == [(2, True), (3, True)]
    rig.train(4)  # the next purge also removes the leftover
    rig.ckpt.close()
    assert _steps(rig.folder) == ["step-3", "step-4"]


def test_incomplete_and_corrupt_are_skipped(tmp_path, caplog):
    rig = Rig(tmp_path)
    rig.train(4)
    (rig.folder / "step-6.tmp").mkdir()  # a write that never finished
    (rig.folder / "step-8").mkdir()  # no .metadata, no marker
    (rig.folder / "step-8" / "__0_0.distcp").write_bytes(b"junk")
    data = rig.folder / "step-4" / "__0_0.distcp"
    with open(data, "ab") as f:  # damaged after commit: its size no longer matches
        f.write(b"xx")
    fresh = Rig(tmp_path)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        assert fresh.ckpt.load()
    assert fresh.state.step == 2
    text = caplog.text
    assert "step-8: it has no .metadata" in text
    assert "step-6.tmp: an unfinished write" in text
    assert "step-4: file __0_0.distcp has" in text
    with pytest.raises(CheckpointError, match=r"load_step=4: .*step-4: file __0_0.distcp has \d+ bytes"):
        Rig(tmp_path).ckpt.load(step=4)
    with pytest.raises(CheckpointError, match=r"load_step=7: .*does not exist; complete checkpoints .*\[2\]"):
        Rig(tmp_path).ckpt.load(step=7)


def test_explicit_load_step_picks_older_and_sets_newer_aside(tmp_path):
    rig = Rig(tmp_path)
    first = rig.train(6)
    old_marker = json.loads((rig.folder / "step-4" / ".committed").read_text())
    fresh = Rig(tmp_path)
    assert fresh.ckpt.load(step=2) and fresh.state.step == 2
    assert fresh.train(4) == first[2:4]
    # the rewind set the abandoned step-4 and step-6 aside (never loaded or purged); the new
    # step-4 was committed next to them
    names = _steps(rig.folder)
    assert [n for n in names if ".abandoned-" not in n] == ["step-2", "step-4"]
    assert sorted(n.split(".")[0] for n in names if ".abandoned-" in n) == ["step-4", "step-6"], names
    new_marker = json.loads((rig.folder / "step-4" / ".committed").read_text())
    assert new_marker["committed_at"] >= old_marker["committed_at"] and new_marker["step"] == 4


def test_force_interval_first_step(tmp_path, caplog):
    rig = Rig(tmp_path, interval=100, enable_first_step_checkpoint=True)
    rig.train(3)
    assert _steps(rig.folder) == ["step-1"]
    rig.ckpt.save(3, force=True)  # SIGTERM path: saves off-interval
    assert _steps(rig.folder) == ["step-1", "step-3"]
    ro = Rig(tmp_path / "ro", load_only=True)
    off = Rig(tmp_path / "off", enable=False)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        ro.train(2)
        ro.ckpt.save(2, force=True, last_step=True)
        off.ckpt.save(2, force=True)
    assert not ro.folder.exists() and not off.folder.exists()
    assert "load_only is set, so no checkpoint is written" in caplog.text
    assert "checkpoint.enable is off, so no checkpoint is written" in caplog.text


def test_last_save_model_only_export_dtype(tmp_path, caplog):
    rig = Rig(tmp_path, interval=100, last_save_model_only=True, export_dtype="bfloat16")
    rig.train(10)
    path = rig.folder / "step-10"
    meta = load.read_dcp_metadata(str(path)).state_dict_metadata
    assert not any(k.startswith(("optimizer.", "lr_scheduler.", "dataloader.")) for k in meta)
    assert meta["0.weight"].properties.dtype == torch.bfloat16
    assert "train_state.step" in meta
    assert json.loads((path / ".committed").read_text())["model_only"] is True
    fresh = Rig(tmp_path, interval=100)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        fresh.ckpt.load()
    assert "has no optimizer, lr_scheduler, dataloader state" in caplog.text
    assert fresh.state.step == 10  # a finished run restarts as finished
    assert torch.equal(fresh.model[0].weight, rig.model[0].weight.bfloat16().float())


def test_resuming_a_model_only_step_names_the_older_full_one(tmp_path, caplog):
    """A finished run's last save is model-only by default: resuming it (more steps) starts the
    optimizer fresh; the warning names the older step that holds the whole state."""
    rig = Rig(tmp_path, interval=5, last_save_model_only=True)
    rig.train(10)
    assert _steps(rig.folder) == ["step-10", "step-5"]
    fresh = Rig(tmp_path, interval=5)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        fresh.ckpt.load()
    assert ("step-10 has no optimizer, lr_scheduler, dataloader state (a model-only save); "
            "these start fresh (step-5 beside it holds them: --checkpoint.load_step 5 resumes "
            "from there)") in caplog.text


def test_seed_checkpoint_is_model_only_and_needs_one_process(tmp_path, monkeypatch, caplog):
    seed = Rig(tmp_path, create_seed_checkpoint=True, enable=False)
    seed.ckpt.save_seed_checkpoint()
    meta = load.read_dcp_metadata(str(seed.folder / "step-0")).state_dict_metadata
    assert sorted(meta) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    user = Rig(tmp_path, load_only=True, width=16)
    with torch.no_grad():
        for p in user.model.parameters():
            p.zero_()
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        assert user.ckpt.load()
    assert torch.equal(user.model[0].weight, seed.model[0].weight)
    assert user.state.step == 0 and user.data.pos == 0
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(CheckpointError, match="needs a single process .* world size 2"):
        Rig(tmp_path / "x", create_seed_checkpoint=True).ckpt.save_seed_checkpoint()


def test_initial_load_path_rules(tmp_path, caplog):
    src = Rig(tmp_path / "src")
    src.train(3)  # step-2
    # model only (default): weights from src, everything else fresh
    dst = Rig(tmp_path / "dst", initial_load_path=str(src.folder / "step-2"))
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        assert dst.ckpt.load()
    assert "has no checkpoint, so checkpoint.initial_load_path is used" in caplog.text
    assert dst.state.step == 0 and dst.data.pos == 0
    # a checkpoint root folder is accepted (its newest complete step), full state on request
    full = Rig(tmp_path / "full", initial_load_path=str(src.folder), initial_load_model_only=False)
    assert full.ckpt.load() and full.state.step == 2 and full.data.pos == 2
    # once the run has its own checkpoint, initial_load_path is ignored (and says so)
    full.train(4)
    again = Rig(tmp_path / "full", initial_load_path=str(src.folder))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        assert again.ckpt.load()
    assert again.state.step == 4
    assert "initial_load_path=" in caplog.text and "is ignored because" in caplog.text
    assert "already has step-4" in caplog.text
    with pytest.raises(CheckpointError, match="initial_load_path=.*does not exist"):
        Rig(tmp_path / "none", initial_load_path=str(tmp_path / "missing")).ckpt.load()


def test_exclude_from_loading(tmp_path):
    Rig(tmp_path).train(2)
    fresh = Rig(tmp_path, exclude_from_loading=["optimizer,dataloader"])
    assert fresh.ckpt.load()
    assert fresh.state.step == 2 and fresh.data.pos == 0
    assert fresh.opt.optimizers[0].state == {}
    with pytest.raises(CheckpointError, match=r"unknown name\(s\) \['optimiser'\]; valid names"):
        Rig(tmp_path, exclude_from_loading=["optimiser"])


def test_dataloader_that_refuses_its_state_is_a_clear_error(tmp_path):
    """A Stateful data stream keyed by dp rank (this toy; torchtitan's own dataloader resumes
    under any dp degree, tests/unit/test_datasets.py) refusing its state is one clear line."""
    Rig(tmp_path, stream=ToyStream(dp_rank=0, dp_world=2)).train(2)
    # fewer dp ranks: the loader itself refuses (ValueError) -> one clear line
    with pytest.raises(CheckpointError, match="dataloader state does not fit this run .*dp degree changed.*exclude_from_loading dataloader"):
        Rig(tmp_path, stream=ToyStream(dp_rank=0, dp_world=1)).ckpt.load()
    # a dp rank the checkpoint never had: caught from the metadata before loading
    with pytest.raises(CheckpointError, match="no 'dataloader.dp_rank_3'.*exclude_from_loading dataloader"):
        Rig(tmp_path, stream=ToyStream(dp_rank=3, dp_world=4)).ckpt.load()
    ok = Rig(tmp_path, stream=ToyStream(dp_rank=0, dp_world=1), exclude_from_loading=["dataloader"])
    assert ok.ckpt.load() and ok.state.step == 2


def test_different_model_is_a_clear_error(tmp_path):
    Rig(tmp_path).train(2)
    with pytest.raises(CheckpointError, match=r"0.weight has shape \(16, 8\) but the model expects \(32, 8\)"):
        Rig(tmp_path, width=32).ckpt.load()


def test_bad_options(tmp_path, caplog):
    with pytest.raises(CheckpointError, match="keep_latest_k=-1"):
        Rig(tmp_path, keep_latest_k=-1)
    with pytest.raises(CheckpointError, match="interval=0"):
        Rig(tmp_path, interval=0)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        rig = Rig(tmp_path, async_mode="async_with_pinned_mem")
    if not torch.cuda.is_available():
        assert rig.ckpt.async_mode == "async"
        assert "async_with_pinned_mem needs CUDA" in caplog.text


class RecordingHooks(SaveHooks):
    """Records each phase with what is on disk at that moment."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str, bool, bool]] = []

    def _record(self, phase: str, step: int, path: str) -> None:
        has_meta = os.path.exists(os.path.join(path, ".metadata"))
        has_marker = os.path.exists(os.path.join(path, ".committed"))
        self.calls.append((phase, step, os.path.basename(path), has_meta, has_marker))

    def data_written(self, step: int, path: str) -> None:
        self._record("data_written", step, path)

    def before_commit(self, step: int, path: str) -> None:
        self._record("before_commit", step, path)

    def after_commit(self, step: int, path: str) -> None:
        self._record("after_commit", step, path)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_save_hooks_see_each_phase_in_order(tmp_path, async_mode):
    hooks = RecordingHooks()
    rig = Rig(tmp_path, save_hooks=hooks, async_mode=async_mode)
    rig.train(4)  # both saves async in async mode (step 4 is committed by close)
    rig.ckpt.close()
    expected = []
    for step in (2, 4):
        expected += [
            ("data_written", step, f"step-{step}.tmp", False, False),  # before .metadata
            ("before_commit", step, f"step-{step}.tmp", True, False),  # before the marker
            ("after_commit", step, f"step-{step}", True, True),
        ]
    assert hooks.calls == expected


def test_save_hooks_from_environment(tmp_path, monkeypatch):
    (tmp_path / "my_hooks.py").write_text(
        "from torchtitan.components.checkpoint import SaveHooks\n"
        "class Counting(SaveHooks):\n"
        "    commits = []\n"
        "    def after_commit(self, step, path):\n"
        "        Counting.commits.append(step)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(HOOKS_ENV, "my_hooks:Counting")
    rig = Rig(tmp_path / "run")
    rig.train(2)
    import my_hooks

    assert my_hooks.Counting.commits == [2]
    for spec, needle in (
        ("my_hooks", "use module:attr"),
        ("my_hooks:Nope", "cannot import it"),
        ("no_such_module_xyz:X", "cannot import it"),
    ):
        monkeypatch.setenv(HOOKS_ENV, spec)
        with pytest.raises(CheckpointError, match=f"{HOOKS_ENV}=.*{needle}"):
            Rig(tmp_path / "bad")


def test_model_shape_check_names_key_shapes_and_source():
    expected = {"w": (4, 2), "b": (4,), "extra": None}
    check_model_shapes(expected, {"w": (4, 2), "b": (4,), "extra": None, "other": (1,)}, "ck")
    with pytest.raises(CheckpointError, match=r"^ck: w has shape \(2, 4\) but the model expects \(4, 2\);"):
        check_model_shapes(expected, {"w": (2, 4), "b": (4,), "extra": None}, "ck")
    with pytest.raises(CheckpointError, match=r"^ck has no weights for \['b'\] \(1 of 3 missing\)"):
        check_model_shapes(expected, {"w": (4, 2), "extra": None}, "ck")


_KILL_DRIVER = """
import sys
from pathlib import Path
sys.path.insert(0, {here!r})
sys.path.insert(0, {repo!r})
from test_checkpoint import Rig
from tests.checkpoint_kill_hook import KillDuringSave
rig = Rig(Path({folder!r}), async_mode={mode!r}, save_hooks=KillDuringSave(4, {phase!r}))
rig.train(6)
rig.ckpt.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,phase", [("disabled", "write"), ("disabled", "commit"), ("async", "commit")]
)
def test_kill_during_save_keeps_last_complete(tmp_path, caplog, mode, phase):
    """SIGKILL while step-4 is written: step-2 survives, step-4.tmp is skipped on restart."""
    code = _KILL_DRIVER.format(
        here=str(HERE), repo=str(REPO), folder=str(tmp_path), mode=mode, phase=phase
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    folder = tmp_path / "checkpoint"
    assert _steps(folder) == ["step-2", "step-4.tmp"]
    has_metadata = (folder / "step-4.tmp" / ".metadata").exists()
    assert has_metadata == (phase == "commit")
    ref = Rig(tmp_path / "ref").train(6)
    fresh = Rig(tmp_path)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        assert fresh.ckpt.load()
    assert fresh.state.step == 2
    assert "skipping incomplete checkpoint" in caplog.text and "step-4.tmp" in caplog.text
    assert fresh.train(6) == ref[2:]  # and resuming from it is exact
    fresh.ckpt.close()
    assert _steps(folder) == ["step-2", "step-4", "step-6"]  # step-4.tmp rewritten, committed
