"""Without torchft (an optional extra), the fault-tolerance unit tests skip or pass; none fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

FILES = ["tests/unit/test_fault_tolerance_parts.py", "tests/unit/test_diloco_fragments.py"]
NEEDS_TORCHFT = [
    "tests/unit/test_diloco_fragments.py::test_should_quantize_reaches_torchfts_pseudo_gradient_all_reduce",
    "tests/unit/test_fault_tolerance_parts.py::test_should_quantize_without_triton_is_one_line",
    "tests/unit/test_fault_tolerance_parts.py::test_preflight_reaches_the_lighthouse",
    "tests/unit/test_fault_tolerance_parts.py::test_preflight_names_an_address_that_is_not_a_lighthouse",
    "tests/unit/test_fault_tolerance_parts.py::test_a_lighthouse_that_does_not_answer_yet_is_a_warning_not_a_refusal",
    "tests/unit/test_fault_tolerance_parts.py::test_a_group_of_one_process_starts_without_torchrun",
]


@pytest.mark.slow
def test_fault_tolerance_unit_tests_skip_without_torchft():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "tests.without_torchft",
         "-p", "no:cacheprovider", *FILES],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    outcomes = dict(re.findall(r"^(tests/\S+) (PASSED|FAILED|SKIPPED|ERROR)", proc.stdout, re.M))
    assert proc.returncode == 0 and outcomes, proc.stdout[-3000:]
    assert {t for t, o in outcomes.items() if o == "SKIPPED"} == set(NEEDS_TORCHFT)
    assert "could not import 'torchft" in proc.stdout
