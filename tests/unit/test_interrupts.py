"""Ctrl-C helpers (torchtitan/tools/interrupts.py), each in a short child process (signals)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=60)


@pytest.mark.subprocess_ok  # no torch import: well under a second
def test_a_ctrl_c_inside_a_commit_takes_effect_after_it():
    proc = _child(
        "import os, signal\n"
        "from torchtitan.tools.interrupts import uninterruptible\n"
        "signal.signal(signal.SIGINT, signal.SIG_DFL)  # as after a first Ctrl-C\n"
        "with uninterruptible():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    print('renamed', flush=True)\n"
        "print('went on', flush=True)\n"
    )
    assert proc.returncode == -signal.SIGINT, proc.stderr
    assert proc.stdout == "renamed\n" and proc.stderr == ""


@pytest.mark.subprocess_ok
def test_end_as_interrupted_is_a_death_by_sigint():
    proc = _child(
        "import sys\n"
        "from torchtitan.tools.interrupts import end_as_interrupted\n"
        "print('bye', flush=True)\n"
        "end_as_interrupted()\n"
        "sys.exit(3)\n"
    )
    assert proc.returncode == -signal.SIGINT and proc.stdout == "bye\n", proc.stderr
    shell = subprocess.run(
        ["bash", "-c", f"{sys.executable} -c 'from torchtitan.tools.interrupts import "
         "end_as_interrupted; end_as_interrupted()'; echo status=$?"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
    )
    assert shell.stdout.strip() == "status=130", shell


@pytest.mark.parametrize("after_ctrl_c", [True, False])
def test_a_collective_broken_by_peers_stopping_at_once_is_the_stop_not_an_error(
        monkeypatch, caplog, after_ctrl_c):
    """Two quick Ctrl-Cs reach a rank busy in a collective as one: its peers die at once and its
    save breaks. After a Ctrl-C that is the stop (130, no ``error:`` line); without one, the
    save's failure is reported as before."""
    import torch.distributed as dist

    import torchtitan.train as train
    from torchtitan.components.checkpoint.common import CheckpointError
    from torchtitan.components.checkpoint.integrity import describe_save_failure
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools.interrupts import INTERRUPTED

    broken = describe_save_failure(
        6, "/ckpt/step-6.tmp", RuntimeError("[pair.cc:553] Connection closed by peer [::1]:636"), [4, 5])

    from torchtitan.tools.lifecycle import Preemption

    preemption = Preemption()  # (before is_initialized is patched below)
    preemption.interrupted = after_ctrl_c

    class Trainer:
        def __init__(self, cfg):
            self.preemption = preemption

        def train(self):
            raise CheckpointError(broken)

        def close(self):
            pass

    exits: list[int] = []
    monkeypatch.setattr(train, "Trainer", Trainer)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist_utils, "hard_exit", exits.append)
    train.main(["--job.config_file", str(REPO_ROOT / "train_configs" / "debug_model.toml")])
    errors = [m for m in caplog.messages if m.startswith("error: ")]
    if after_ctrl_c:
        assert exits == [INTERRUPTED] and errors == []
        assert "Ctrl-C: stopped at once, without saving (another rank stopped first)" in caplog.messages
    else:
        assert exits == [2] and len(errors) == 1 and "Connection closed by peer" in errors[0]


@pytest.mark.parametrize("ctrl_cs", [0, 1, 2])
def test_the_launcher_ends_interrupted_after_a_second_ctrl_c_whatever_a_rank_reported(
        monkeypatch, tmp_path, capsys, ctrl_cs):
    """A rank's error on its way down after a second Ctrl-C (its peers killed) does not make the
    run a failure; after no or one Ctrl-C that error is the run's exit code."""
    import json

    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from torchtitan import launch
    from torchtitan.tools import lifecycle
    from torchtitan.tools.error_file import TRAINER_MARK
    from torchtitan.tools.interrupts import INTERRUPTED

    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({
        "message": "saving checkpoint step-6 failed: Connection closed by peer", "timestamp": 1,
        TRAINER_MARK: {"exitcode": 2, "time": 1.0}}))

    def run(args):
        raise ChildFailedError("train", {0: ProcessFailure(0, 1234, 2, str(error_file))})

    monkeypatch.setattr(torchrun, "run", run)
    monkeypatch.setattr(lifecycle, "forward_sigterm_to_ranks", lambda: True)  # pytest's SIGTERM
    interrupts = type("Interrupts", (), {"count": ctrl_cs})()
    code = launch._launch(["--log-dir", str(tmp_path)], ["some_script.py"], interrupts)
    assert code == (INTERRUPTED if ctrl_cs == 2 else 2)
