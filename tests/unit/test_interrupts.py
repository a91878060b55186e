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
