"""Failures never destroy checkpoints: the real trainer (``torchtitan.train.main``, in-process,
debugmodel_tiny on CPU) against damaged checkpoints, a full disk and a diverging run.

* damaged commit markers: the run refuses to start from scratch, names the checkpoints and the
  two ways out (``load_step`` / ``start_fresh``), and no file of the folder changes;
* content checksums: a same-size corruption or a corrupt header of the newest checkpoint is found
  before loading; the run falls back to the previous one (warning naming the file), or refuses
  when none is left;
* disk full while saving (an injected ENOSPC): one line naming the path and "no space left",
  the partial write removed, the older checkpoint intact (sync and async saves);
* a diverging run (lr 1e30) never saves its exploded weights; the NaN error names the newest
  safe checkpoint and the exact flag to resume from it; a new lr on resume needs a flag and the
  log says which lr is used.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
from pathlib import Path

import pytest
import torch

from tests.checkpoint_kill_hook import DISK_FULL_ENV
from torchtitan.components.checkpoint import HOOKS_ENV
from torchtitan.train import main

FLAGS = [
    "--job.config_file", "./train_configs/debug_model.toml",
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--activation_checkpoint.mode", "none",
    "--metrics.log_freq", "1",
    "--metrics.disable_color_printing",
    "--debug.seed", "0",
    "--checkpoint.enable",
    "--checkpoint.no_last_save_model_only",
]


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self, level: int = logging.INFO) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


def run(dump: Path, *flags: str) -> tuple[int, _Log]:
    """``python -m torchtitan.train`` in this process: (exit code, log records)."""
    log = _Log()
    titan = logging.getLogger("torchtitan")
    titan.addHandler(log)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main([*FLAGS, "--job.dump_folder", str(dump), *flags])
    finally:
        titan.removeHandler(log)
        torch.set_num_threads(threads)
        gc.enable()
    return code, log


def snapshot(folder: Path) -> dict[str, str]:
    """relative path -> md5 of every file under ``folder``."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(folder))] = hashlib.md5(path.read_bytes()).hexdigest()
    return out


def errors(log: _Log) -> list[str]:
    return [line for line in log.lines(logging.ERROR) if line.startswith("error:")]


def test_damaged_markers_refuse_fresh_start_and_touch_nothing(tmp_path):
    flags = ["--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2"]
    code, _ = run(tmp_path, *flags, "--training.steps", "6")
    assert code == 0
    folder = tmp_path / "checkpoint"
    assert sorted(os.listdir(folder)) == ["step-4", "step-6"]
    for step in (4, 6):
        (folder / f"step-{step}" / ".committed").write_text("garbage")
    before = snapshot(folder)

    code, log = run(tmp_path, *flags, "--training.steps", "8")
    assert code != 0
    (line,) = errors(log)
    assert "\n" not in line
    assert f"{folder} holds checkpoints but none of them verifies" in line
    assert "step-4: its commit marker .committed is unreadable" in line and "step-6" in line
    assert "--checkpoint.load_step 6" in line and "--checkpoint.start_fresh" in line
    assert not any("Training starts" in m for m in log.lines())
    assert snapshot(folder) == before  # nothing deleted, nothing changed

    # start_fresh: trains from step 1; the old checkpoints survive (moved aside when the new
    # run saves the same step, never purged)
    code, log = run(tmp_path, *flags, "--training.steps", "4", "--checkpoint.start_fresh")
    assert code == 0 and any("Training starts at step 1" in m for m in log.lines())
    after = snapshot(folder)
    kept = {h for name, h in after.items() if ".superseded-" in name or name.startswith("step-6/")}
    assert set(before.values()) <= kept
    assert "step-2" in os.listdir(folder) and "step-4" in os.listdir(folder)

    # the explicit choice: load_step loads one whose marker is unreadable (its data is whole)
    code, log = run(tmp_path, *flags, "--training.steps", "7", "--checkpoint.load_step", "6")
    assert code == 0
    assert any("loading it anyway because checkpoint.load_step=6" in m for m in log.lines())
    assert any("Training starts at step 7" in m for m in log.lines())


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_checksums_fall_back_to_the_previous_checkpoint_or_refuse(tmp_path):
    flags = ["--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0", "--training.steps", "6"]
    assert run(tmp_path, *flags)[0] == 0
    folder = tmp_path / "checkpoint"
    _flip_middle_byte(folder / "step-6" / "__0_0.distcp")  # same size: the sizes still match
    meta = folder / "step-4" / ".metadata"
    meta.write_bytes(b"\x00" * 16 + meta.read_bytes()[16:])  # a corrupt header, same size

    code, log = run(tmp_path, *flags)
    warnings = log.lines(logging.WARNING)
    assert code == 0
    assert any(
        "skipping damaged checkpoint" in m and "step-6: file __0_0.distcp has checksum" in m
        and "falling back to" in m for m in warnings
    ), warnings
    assert any("step-4: file .metadata has checksum" in m for m in warnings), warnings
    assert any("Training starts at step 3" in m for m in log.lines())
    # the damaged ones were kept aside, not overwritten
    assert sum(".superseded-" in n for n in os.listdir(folder)) == 2

    # every checkpoint damaged: refuse (one line), never start from scratch
    for name in os.listdir(folder):
        for f in (folder / name).glob("*.distcp"):
            _flip_middle_byte(f)
    before = snapshot(folder)
    code, log = run(tmp_path, *flags)
    assert code != 0
    (line,) = errors(log)
    assert "none of them verifies" in line and "checksum" in line and "--checkpoint.start_fresh" in line
    assert snapshot(folder) == before


def test_a_rewritten_damaged_step_is_purged_like_any_other(tmp_path):
    """After a fallback past a damaged step-2, the new step-2 stayed protected as if it were
    the damaged one: keep_latest_k=1 left step-2 and step-3 (purging lagged one save)."""
    flags = ["--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "1"]
    assert run(tmp_path, *flags, "--checkpoint.keep_latest_k", "0", "--training.steps", "2")[0] == 0
    folder = tmp_path / "checkpoint"
    _flip_middle_byte(folder / "step-2" / "__0_0.distcp")
    code, log = run(tmp_path, *flags, "--training.steps", "3")
    assert code == 0 and any("falling back to" in m for m in log.lines(logging.WARNING))
    names = sorted(os.listdir(folder))
    aside = [n for n in names if n.startswith("step-2.superseded-")]
    assert len(aside) == 1  # the damaged one, kept aside (never purged)
    assert [n for n in names if n not in aside] == ["step-3"]


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_disk_full_is_one_line_and_keeps_older_checkpoints(tmp_path, monkeypatch, async_mode):
    monkeypatch.setenv(HOOKS_ENV, "tests.checkpoint_kill_hook:DiskFull")
    monkeypatch.setenv(DISK_FULL_ENV, "4")
    flags = ["--checkpoint.interval", "2", "--training.steps", "6", "--checkpoint.async_mode", async_mode]
    folder = tmp_path / "checkpoint"
    code, log = run(tmp_path, *flags)
    assert code != 0
    (line,) = errors(log)
    assert "\n" not in line
    assert f"saving checkpoint step-4 to {folder}/step-4.tmp failed: no space left on the device" in line
    assert "ENOSPC" in line and "intact: step-2" in line
    assert sorted(os.listdir(folder)) == ["step-2"]  # the partial step-4.tmp was removed
    monkeypatch.delenv(HOOKS_ENV)
    code, log = run(tmp_path, *flags)  # the intact checkpoint resumes
    assert code == 0 and any("Training starts at step 3" in m for m in log.lines())


def test_exploded_weights_are_never_saved_and_nan_names_the_safe_checkpoint(tmp_path):
    flags = ["--checkpoint.interval", "1", "--lr_scheduler.warmup_steps", "0"]
    assert run(tmp_path, *flags, "--training.steps", "2")[0] == 0
    folder = tmp_path / "checkpoint"

    # a new lr on resume is ignored unless asked for, and the log says which one is used
    code, log = run(tmp_path, *flags, "--training.steps", "3", "--optimizer.lr", "1e30")
    assert code == 0
    assert any(
        "using the checkpoint's peak lr 0.0008; optimizer.lr=1e+30 in this config is ignored" in m
        for m in log.lines()
    )
    assert sorted(os.listdir(folder)) == ["step-1", "step-2", "step-3"]

    code, log = run(
        tmp_path, *flags, "--training.steps", "8", "--optimizer.lr", "1e30",
        "--optimizer.override_checkpoint_lr",
    )
    assert code != 0
    assert any("using optimizer.lr=1e+30 from this config" in m for m in log.lines())
    skipped = [m for m in log.lines(logging.WARNING) if "not saving step-" in m]
    assert skipped and "the weights exploded" in skipped[0], log.lines()
    (line,) = errors(log)
    assert "loss became nan" in line or "grad norm nan" in line
    assert f"the newest safe checkpoint is {folder}/step-3: resume from it with --checkpoint.load_step 3" in line
    assert sorted(os.listdir(folder)) == ["step-1", "step-2", "step-3"]  # nothing poisoned saved


def test_unwritable_folder_fails_before_training_and_short_space_warns(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    code, log = run(tmp_path, "--training.steps", "2", "--checkpoint.folder", str(blocker / "ckpt"))
    assert code != 0
    (line,) = errors(log)
    assert f"the checkpoint folder {blocker}/ckpt is not writable" in line and "ENOTDIR" in line
    assert not any("step:" in m or "Training starts" in m for m in log.lines())  # before step 1

    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    code, log = run(tmp_path, "--training.steps", "1", "--checkpoint.interval", "100")
    short = [m for m in log.lines(logging.WARNING) if "less than one checkpoint" in m]
    assert short and "has 1000 bytes free" in short[0] and "MiB: weights + optimizer state" in short[0]
    assert "the save at step 1 will fail with 'no space left'" in short[0]


def test_a_seed_checkpoint_is_refused_where_trained_checkpoints_are(tmp_path):
    """A seed written next to step-2 was never used: the next run resumed from step-2. Both
    the launcher's pre-flight and the rank refuse, and the folder stays as it was."""
    from tests.unit.test_preflight_files import cfg_of
    from torchtitan.preflight import check_run

    assert run(tmp_path, "--training.steps", "2", "--checkpoint.interval", "1")[0] == 0
    folder = tmp_path / "checkpoint"
    before = snapshot(folder)
    expected = (f"checkpoint.create_seed_checkpoint: {folder} already holds step-2, and a run "
                "there resumes from it, not from a seed: write the seed checkpoint to an empty "
                "folder (another --job.dump_folder or --checkpoint.folder)")
    with pytest.raises(ValueError) as info:
        check_run(cfg_of(tmp_path, "--job.dump_folder", str(tmp_path), "--checkpoint.enable",
                         "--checkpoint.create_seed_checkpoint"), 1, device_type="cpu")
    assert str(info.value) == expected
    code, log = run(tmp_path, "--checkpoint.create_seed_checkpoint")
    assert code == 2 and errors(log) == [f"error: {expected}"]
    assert snapshot(folder) == before
