"""The code base stays ruff-clean (configured in pyproject.toml)."""

import shutil
import subprocess

import pytest

from tests.conftest import REPO_ROOT


@pytest.mark.subprocess_ok  # ruff checks the whole repo in well under a second
def test_ruff_clean():
    if shutil.which("ruff") is None:
        pytest.skip("ruff is not installed (it is in the dev extra)")
    proc = subprocess.run(
        ["ruff", "check", "--quiet", str(REPO_ROOT)], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert proc.returncode == 0, f"ruff found problems:\n{proc.stdout}{proc.stderr}"
