"""Profiler traces and memory snapshots (torchtitan/tools/profiling.py)."""

from __future__ import annotations

import json
import logging
import pickle

import pytest
import torch

from torchtitan.config.job_config import Profiling
from torchtitan.tools import profiling
from torchtitan.tools.logging import logger


def _train(steps: int, prof=None, mem=None) -> None:
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        if prof is not None:
            prof.step()
        if mem is not None:
            mem.step()


@pytest.fixture
def records():
    """Log records of the torchtitan logger (it does not propagate to the root logger)."""

    class _Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.records: list[logging.LogRecord] = []

        def emit(self, record):
            self.records.append(record)

    handler = _Keep()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def test_traces_per_iteration_and_rank(tmp_path):
    cfg = Profiling(enable_profiling=True, save_traces_folder="traces", profile_freq=2,
                    profiler_warmup=0, profiler_active=1)
    with profiling.maybe_enable_profiling(cfg, str(tmp_path), rank=3) as prof:
        assert prof is not None
        _train(5, prof=prof)
    folders = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert folders == ["iteration_2", "iteration_4"]
    for folder in folders:
        files = [p.name for p in (tmp_path / "traces" / folder).iterdir()]
        assert files == ["rank3_trace.json"]
        trace = json.loads((tmp_path / "traces" / folder / "rank3_trace.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert any("addmm" in str(n) or "linear" in str(n) for n in names), sorted(map(str, names))[:20]


def test_a_trace_that_was_not_written_is_not_reported_written(tmp_path, records, monkeypatch):
    """On a full disk torch's exporter leaves an empty ``.tmp`` and raises nothing; the log
    used to say "written to ... in 0.00 s". Now a warning, and the leftover is removed."""
    def failed_export(self, path):
        open(f"{path}.tmp", "w").close()

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", failed_export)
    cfg = Profiling(enable_profiling=True, save_traces_folder="traces", profile_freq=2,
                    profiler_warmup=0, profiler_active=1)
    with profiling.maybe_enable_profiling(cfg, str(tmp_path), rank=0) as prof:
        _train(3, prof=prof)
    messages = [r.getMessage() for r in records]
    path = tmp_path / "traces" / "iteration_2" / "rank0_trace.json"
    assert not any(" 2 written to" in m for m in messages), messages
    assert any(m.startswith(f"Profiler trace of step 2 could not be written to {path} (")
               and m.endswith("free there); training goes on") for m in messages), messages
    assert list(path.parent.iterdir()) == []


def test_trace_steps_follow_resumed_global_step(tmp_path):
    cfg = Profiling(enable_profiling=True, profile_freq=3, profiler_warmup=1, profiler_active=1)
    with profiling.maybe_enable_profiling(cfg, str(tmp_path), global_step=4) as prof:
        _train(5, prof=prof)  # training steps 5..9: the step-6 and step-9 cycles end here
    assert sorted(p.name for p in (tmp_path / "profile_traces").iterdir()) == [
        "iteration_6",
        "iteration_9",
    ]


def test_disabled_yields_none_and_writes_nothing(tmp_path):
    cfg = Profiling()
    with profiling.maybe_enable_profiling(cfg, str(tmp_path)) as prof, \
            profiling.maybe_enable_memory_snapshot(cfg, str(tmp_path)) as mem:
        assert prof is None and mem is None
    assert list(tmp_path.iterdir()) == []


def test_bad_schedule_is_a_clear_error(tmp_path):
    cfg = Profiling(enable_profiling=True, profile_freq=2, profiler_warmup=3, profiler_active=1)
    with pytest.raises(ValueError, match=r"profiling.profile_freq=2 must be >= profiler_warmup"):
        with profiling.maybe_enable_profiling(cfg, str(tmp_path)):
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_memory_snapshot_on_cpu_warns_once_and_training_goes_on(tmp_path, records):
    cfg = Profiling(enable_memory_snapshot=True, profile_freq=1)
    with profiling.maybe_enable_memory_snapshot(cfg, str(tmp_path)) as mem:
        assert mem is None
        _train(3)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "needs CUDA" in warnings[0], warnings
    assert not (tmp_path / "memory_snapshot").exists()


class _FakeCudaMemory:
    """Stands in for torch.cuda.memory's history API so the CUDA logic runs on CPU."""

    def __init__(self):
        self.recording = None
        self.snapshots = 0

    def _record_memory_history(self, enabled="all", max_entries=0, **kwargs):
        self.recording = enabled

    def _snapshot(self):
        self.snapshots += 1
        return {"segments": [], "device_traces": [], "n": self.snapshots}


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = _FakeCudaMemory()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake._record_memory_history)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", fake._snapshot)
    return fake


def test_memory_snapshot_every_freq_steps(tmp_path, fake_cuda):
    cfg = Profiling(enable_memory_snapshot=True, save_memory_snapshot_folder="snap", profile_freq=2)
    with profiling.maybe_enable_memory_snapshot(cfg, str(tmp_path), rank=1) as mem:
        assert fake_cuda.recording == "all"
        _train(5, mem=mem)
    assert fake_cuda.recording is None  # recording stopped on exit
    assert sorted(p.name for p in (tmp_path / "snap").iterdir()) == ["iteration_2", "iteration_4"]
    with open(tmp_path / "snap" / "iteration_4" / "rank1_memory_snapshot.pickle", "rb") as f:
        assert pickle.load(f)["n"] == 2


def test_oom_dumps_exit_snapshot_and_is_reraised(tmp_path, fake_cuda):
    cfg = Profiling(enable_memory_snapshot=True, profile_freq=10)
    with pytest.raises(torch.OutOfMemoryError, match="boom"):
        with profiling.maybe_enable_memory_snapshot(cfg, str(tmp_path), global_step=6) as mem:
            mem.step()  # step 7 done
            raise torch.OutOfMemoryError("boom")  # during step 8
    exit_file = tmp_path / "memory_snapshot" / "iteration_8_exit" / "rank0_memory_snapshot.pickle"
    assert exit_file.is_file()
    assert fake_cuda.recording is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_snapshot_and_oom(tmp_path):
    cfg = Profiling(enable_memory_snapshot=True, profile_freq=1)
    with pytest.raises(torch.OutOfMemoryError):
        with profiling.maybe_enable_memory_snapshot(cfg, str(tmp_path)) as mem:
            x = torch.randn(1024, 1024, device="cuda")
            (x @ x).sum().item()
            mem.step()
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB: always OOM
    with open(tmp_path / "memory_snapshot" / "iteration_1" / "rank0_memory_snapshot.pickle", "rb") as f:
        assert pickle.load(f)["segments"]
    assert (tmp_path / "memory_snapshot" / "iteration_2_exit" / "rank0_memory_snapshot.pickle").is_file()
