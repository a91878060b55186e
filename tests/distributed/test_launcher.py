"""The multi-process test launcher: results, failure propagation, wall-clock timeout."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launcher import LaunchError, launch


def _rank_sum(scale: int) -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), scale * t.item()


def _fail_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here until the 60 s PG timeout if not killed


@pytest.mark.slow
def test_failure_propagation():
    # (the success path, results per rank, is exercised by every numerics test)
    start = time.monotonic()
    with pytest.raises(LaunchError, match="(?s)failed.*rank 1.*ValueError: boom on rank 1"):
        launch(_fail_on_rank_1, 2)
    assert time.monotonic() - start < 30  # the blocked rank is killed, not waited for


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.slow
def test_wall_timeout_kills_ranks():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="timed out after 1 s"):
        launch(_sleep, 2, 60.0, timeout_s=1.0)
    assert time.monotonic() - start < 20  # killed at the deadline, not after the sleep


def test_target_must_be_importable():
    with pytest.raises(ValueError, match="module-level function"):
        launch(lambda: None, 2)


def _abort_on_rank_1(marker: str, always: bool) -> int:
    import os
    from pathlib import Path

    if dist.get_rank() == 1 and (always or not Path(marker).exists()):
        Path(marker).write_text("crashed once")
        print("native crash on rank 1", flush=True)
        os.abort()
    dist.barrier()
    return dist.get_rank()


@pytest.mark.slow
def test_native_crash_is_retried_once_with_a_warning(tmp_path):
    marker = str(tmp_path / "crashed")
    with pytest.warns(UserWarning, match="(?s)retrying after a native crash.*exit -6.*native crash on rank 1"):
        assert launch(_abort_on_rank_1, 2, marker, False) == [0, 1]
    with pytest.raises(LaunchError, match=r"(?s)exit codes \[.*-6\].*native crash on rank 1"), \
            pytest.warns(UserWarning, match="retrying after a native crash"):
        launch(_abort_on_rank_1, 2, marker, True)


def _env_and_preloaded(key: str) -> tuple[str | None, bool, int]:
    import os
    import sys

    return os.environ.get(key), "torchtitan.train" in sys.modules, torch.get_num_threads()


@pytest.mark.slow
def test_forked_ranks_take_the_launch_env_and_env_overrides_get_fresh_ranks(monkeypatch):
    # forked from the fork server (the trainer already imported), with this launch's env
    monkeypatch.setenv("TT_PROBE", "forked")
    assert launch(_env_and_preloaded, 2, "TT_PROBE") == [("forked", True, 1)] * 2
    # env overrides may matter at import time: fresh interpreters
    fresh = launch(_env_and_preloaded, 2, "TT_PROBE", env={"TT_PROBE": "fresh"})
    assert fresh == [("fresh", False, 1)] * 2
