"""A training step copies nothing from the device to the host outside log steps.

The real Trainer runs in-process (debugmodel_tiny on CPU) under a dispatch mode that counts
every device-to-host scalar copy (``.item()``, ``float()``, ``int()``, ``bool()`` of a tensor:
``aten._local_scalar_dense``; ``tolist`` / ``numpy``) that torchtitan's own code makes, outside
data loading (host tensors). Steps that neither log, save, validate nor end the run make none;
the numbers logged at the log steps equal those of a ``log_freq 1`` run. The deferred finite
check names the step where the loss first became non-finite and never saves after it.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.integration.trainer_utils import TINY
from torchtitan.config.manager import ConfigManager
from torchtitan.train import Trainer, TrainingError

TORCHTITAN = str(Path(__file__).resolve().parents[2] / "torchtitan")
TORCH = str(Path(torch.__file__).parent) + os.sep
STEPS = 6
FLAGS = ["--training.steps", str(STEPS), "--debug.deterministic"]


def _torchtitan_caller() -> str | None:
    """``file:line`` of the innermost frame outside torch (and this file), when it is
    torchtitan's: its own copies and those torch makes on its behalf."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith(TORCH)
    ):
        frame = frame.f_back
    if frame is not None and frame.f_code.co_filename.startswith(TORCHTITAN):
        return f"{frame.f_code.co_filename[len(TORCHTITAN) - 10:]}:{frame.f_lineno}"
    return None


class HostCopies(TorchDispatchMode):
    """Counts, per trainer step, torchtitan's device-to-host scalar copies (not while loading
    data: those tensors live on the host)."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__()
        self.trainer = trainer
        self.loading = False
        self.by_step: dict[int, list[str]] = defaultdict(list)

    def record(self) -> None:
        caller = _torchtitan_caller()
        if caller is not None and not self.loading:
            self.by_step[self.trainer.step].append(caller)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:  # .item(), float(), int(), bool()
            self.record()
        return func(*args, **(kwargs or {}))


def _run(tmp_path: Path, monkeypatch, *flags: str) -> tuple[Trainer, HostCopies]:
    cfg = ConfigManager().parse_args([*TINY, "--job.dump_folder", str(tmp_path), *FLAGS, *flags])
    trainer = Trainer(cfg)
    counter = HostCopies(trainer)
    next_batch = trainer.next_batch

    def loading(data_iterator):
        counter.loading = True
        try:
            return next_batch(data_iterator)
        finally:
            counter.loading = False

    monkeypatch.setattr(trainer, "next_batch", loading)
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, **kw):
            counter.record()
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        with counter:
            trainer.train()
    finally:
        trainer.close()
        monkeypatch.undo()
    return trainer, counter


def _logged(dump: Path) -> dict[int, dict]:
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def test_no_host_copies_outside_log_steps_and_same_logged_numbers(tmp_path, monkeypatch, one_thread):
    trainer, copies = _run(tmp_path / "every4", monkeypatch, "--metrics.log_freq", "4")
    assert trainer.step == STEPS
    # steps 1 and 4 log, step 6 ends the run (and logs); 2, 3 and 5 copy nothing to the host
    quiet = {step: copies.by_step.get(step, []) for step in (2, 3, 5)}
    assert quiet == {2: [], 3: [], 5: []}, quiet
    assert copies.by_step[1] and copies.by_step[4]  # the counter sees the log steps' copies

    _run(tmp_path / "every1", monkeypatch, "--metrics.log_freq", "1")
    every4, every1 = _logged(tmp_path / "every4"), _logged(tmp_path / "every1")
    assert sorted(every4) == [1, 4, STEPS] and sorted(every1) == list(range(1, STEPS + 1))
    for step in (1, 4, STEPS):
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert every4[step][key] == every1[step][key], (step, key)  # exact


@pytest.mark.parametrize("bad, found, checkpoint", [
    (3, 4, ["--checkpoint.enable", "--checkpoint.interval", "2"]),  # step 4 logs and saves
    (5, 6, []),  # the last step checks too
])
def test_nan_between_log_steps_names_its_step_and_is_never_saved(
    tmp_path, monkeypatch, one_thread, bad, found, checkpoint
):
    """log_freq 4: a NaN at a step that neither logs nor saves is found by the next checked
    step, named as its own step, and nothing after the step before it is saved."""
    import torchtitan.step as step_module

    cfg = ConfigManager().parse_args([
        *TINY, "--job.dump_folder", str(tmp_path), *FLAGS, "--metrics.log_freq", "4",
        "--checkpoint.no_last_save_model_only", *checkpoint,
    ])
    trainer = Trainer(cfg)
    original = step_module.forward_backward

    def poisoned(run, inputs, labels, loss_scale):
        loss = original(run, inputs, labels, loss_scale)
        if trainer.step == bad:
            for p in run.model_parts[0].parameters():
                p.grad.fill_(float("nan"))
            return loss * float("nan")
        return loss

    monkeypatch.setattr(step_module, "forward_backward", poisoned)
    try:
        with pytest.raises(TrainingError) as err:
            trainer.train()
    finally:
        trainer.close()
    line = str(err.value)
    assert "\n" not in line and trainer.step == found
    assert line.startswith(f"loss became nan (grad norm nan) at step {bad}; found at step {found}")
    assert f"nothing after step {bad - 1} was saved" in line
    folder = tmp_path / "checkpoint"
    if checkpoint:
        assert f"the newest safe checkpoint is {folder}/step-2: resume from it with " \
            "--checkpoint.load_step 2" in line
        assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step-")) == ["step-2"]
    else:
        assert "checkpointing is off" in line and not folder.exists()
