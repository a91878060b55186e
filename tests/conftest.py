"""Shared paths and fixtures, and a guard that keeps the fast loop (``-m "not slow"``) fast.

Import the constants (``from tests.conftest import ASSETS``) where a module needs them at import
time (parametrize lists, module constants); use the fixtures everywhere else.
"""

from __future__ import annotations

import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
ASSETS = REPO_ROOT / "tests" / "assets"
TOKENIZER_DIR = ASSETS / "tokenizer"  # tiktoken BPE, 2000 + 256 special ids
TIKTOKEN_FILE = TOKENIZER_DIR / "tokenizer.model"
SP_TOKENIZER_DIR = ASSETS / "tokenizer_sp"  # sentencepiece, 2000 pieces
SP_FILE = SP_TOKENIZER_DIR / "tokenizer.model"
C4_TEST_DIR = ASSETS / "c4_test"  # 2000 train + 200 validation synthetic documents
C4_TEST_TRAIN = C4_TEST_DIR / "data.json"
C4_TEST_VALID = C4_TEST_DIR / "validation.json"

# Environment variables read by ./run_train.sh that a developer's shell may have exported.
_LAUNCHER_VARS = ("CONFIG_FILE", "CONFIG", "MODULE", "NGPU", "COMM_MODE", "TRAIN_FILE", "LOG_RANK")


def load_script(name: str):
    """Import ``scripts/<name>.py`` as a module (the scripts are not a package); its ``main()``
    is the CLI, run in-process."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def dump_folder(tmp_path) -> Path:
    """A fresh ``--job.dump_folder`` for one test (not created: the trainer makes it)."""
    return tmp_path / "dump"


@pytest.fixture
def cpu_env() -> dict[str, str]:
    """``os.environ`` for ./run_train.sh and trainer subprocesses: CPU + gloo, launcher defaults."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@pytest.fixture
def caplog(caplog):
    """caplog that sees the ``torchtitan`` logger exactly once, whether or not an earlier
    in-process test ran ``init_logger()`` (which turns propagation to the root logger off)."""
    import logging

    titan = logging.getLogger("torchtitan")
    propagate = titan.propagate
    titan.propagate = False
    titan.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        titan.removeHandler(caplog.handler)
        titan.propagate = propagate


@pytest.fixture(autouse=True)
def _keep_titan_logger():
    """An in-process ``main()`` adds a handler bound to this test's captured stderr; a later
    test would log into that closed stream and see nothing. Each test gets the logger back
    as it found it."""
    import logging

    titan = logging.getLogger("torchtitan")
    handlers, level, propagate = titan.handlers[:], titan.level, titan.propagate
    yield
    titan.handlers[:] = handlers
    titan.setLevel(level)
    titan.propagate = propagate


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module: 2 shared cores oversubscribed by OpenMP spin."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiktoken_tokenizer():
    from torchtitan.components.tokenizer import TikTokenTokenizer

    return TikTokenTokenizer(TIKTOKEN_FILE)


# --- the fast-loop guard -----------------------------------------------------------------------
class UnmarkedSubprocessWarning(pytest.PytestWarning):
    """A test outside the ``slow`` set started a subprocess (in its body or a fixture)."""


def _guarded(item: pytest.Item):
    if item.get_closest_marker("slow") or item.get_closest_marker("subprocess_ok"):
        return None
    real_init = subprocess.Popen.__init__

    def init(self, args, *a, **kw):
        warnings.warn(
            UnmarkedSubprocessWarning(
                f"{item.nodeid} starts a subprocess ({str(args)[:80]}): mark it "
                "@pytest.mark.slow, or subprocess_ok if it stays well under a second"
            ),
            stacklevel=2,
        )
        real_init(self, args, *a, **kw)

    subprocess.Popen.__init__ = init
    return real_init


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    real_init = _guarded(item)  # module fixtures that launch processes run in setup
    try:
        return (yield)
    finally:
        if real_init is not None:
            subprocess.Popen.__init__ = real_init


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    real_init = _guarded(item)
    try:
        return (yield)
    finally:
        if real_init is not None:
            subprocess.Popen.__init__ = real_init
