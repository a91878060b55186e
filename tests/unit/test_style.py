"""The code base stays ruff-clean (configured in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_clean():
    if shutil.which("ruff") is None:
        pytest.skip("ruff is not installed (it is in the dev extra)")
    proc = subprocess.run(
        ["ruff", "check", "--quiet", str(ROOT)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, f"ruff found problems:\n{proc.stdout}{proc.stderr}"


def test_python_version_supported():
    assert sys.version_info >= (3, 10)
