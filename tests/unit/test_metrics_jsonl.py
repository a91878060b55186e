"""The JSONL metrics sink: rank 0 writes ``{dump_folder}/metrics.jsonl`` at full precision."""

from __future__ import annotations

import json
import sys

import pytest

from torchtitan.components.metrics import METRICS_JSONL, MetricsProcessor
from torchtitan.config.job_config import JobConfig


def _processor(dump_folder, rank: int = 0) -> MetricsProcessor:
    cfg = JobConfig()
    cfg.job.dump_folder = str(dump_folder)
    cfg.metrics.disable_color_printing = True
    return MetricsProcessor(cfg, rank=rank, compute_dtype="float32")


def _records(dump_folder) -> list[dict]:
    return [json.loads(line) for line in (dump_folder / METRICS_JSONL).read_text().splitlines()]


def test_rank0_writes_every_logged_step_at_full_precision(dump_folder):
    mp = _processor(dump_folder)
    for step, loss in ((1, 8.123456789012), (2, 8.123456789099)):
        mp.ntokens_since_last_log = 512
        mp.log(step, loss, 0.25 + step, 1e-4 * step, extra={"tokens": 512 * step})
    mp.log_validation(2, 7.5)
    mp.log(3, float("nan"), float("inf"), 3e-4, extra={"tokens": 1536})
    mp.close()
    records = _records(dump_folder)
    assert [r["step"] for r in records] == [1, 2, 2, 3]
    assert records[0]["loss"] == 8.123456789012 and records[1]["loss"] == 8.123456789099
    assert (records[1]["grad_norm"], records[1]["lr"], records[1]["tokens"]) == (2.25, 2e-4, 1024)
    assert records[2] == {"step": 2, "validation/loss": 7.5}
    assert (records[3]["loss"], records[3]["grad_norm"]) == ("nan", "inf")  # valid JSON
    assert {"tps", "memory/peak_gib", "time/step_s"} <= set(records[0])


def test_resumed_run_appends_other_ranks_write_nothing(dump_folder):
    mp = _processor(dump_folder)
    mp.log(1, 9.0, 1.0, 1e-4)
    mp.close()
    resumed = _processor(dump_folder)
    resumed.log(2, 8.0, 1.0, 1e-4)
    resumed.close()
    assert [r["loss"] for r in _records(dump_folder)] == [9.0, 8.0]
    assert not (dump_folder / f"{METRICS_JSONL}.1").exists()
    other = _processor(dump_folder / "rank1", rank=1)
    other.log(1, 7.0, 1.0, 1e-4)
    other.close()
    assert not (dump_folder / "rank1" / METRICS_JSONL).exists()


def test_a_new_run_moves_earlier_runs_aside_never_truncates(dump_folder, caplog):
    """Each run that starts at step 1 in the same dump folder keeps the earlier ones:
    metrics.jsonl.1 is the previous run, .2 the one before."""
    import logging

    for loss in (9.0, 8.0, 7.0):
        mp = _processor(dump_folder)
        with caplog.at_level(logging.INFO):
            mp.log(1, loss, 1.0, 1e-4)
        mp.log(2, loss - 0.5, 1.0, 1e-4)
        mp.close()
    assert [r["loss"] for r in _records(dump_folder)] == [7.0, 6.5]
    older = [
        [json.loads(line)["loss"] for line in (dump_folder / f"{METRICS_JSONL}.{k}").read_text().splitlines()]
        for k in (1, 2)
    ]
    assert older == [[8.0, 7.5], [9.0, 8.5]]
    assert not (dump_folder / f"{METRICS_JSONL}.3").exists()
    moved = [m for m in caplog.messages if m.startswith("Metrics:")]
    path = dump_folder / METRICS_JSONL
    assert moved == [f"Metrics: this run starts at step 1; the earlier {path} is now {path}.1"] * 2


def test_the_last_step_is_logged_whatever_the_frequency(dump_folder):
    cfg = JobConfig()
    cfg.job.dump_folder = str(dump_folder)
    cfg.metrics.log_freq, cfg.training.steps = 5, 12
    mp = MetricsProcessor(cfg, rank=0, compute_dtype="float32")
    assert [s for s in range(1, 13) if mp.should_log(s)] == [1, 5, 10, 12]
    mp.close()


def test_a_sink_that_cannot_write_is_dropped_and_training_goes_on(dump_folder, caplog,
                                                                  monkeypatch):
    """A full disk under the dump folder used to end the run with an OSError traceback from
    the metrics file (at a log step, and again at close). /dev/full fails every write."""
    import logging
    import os
    import shutil
    from collections import namedtuple

    cfg = JobConfig()
    cfg.job.dump_folder = str(dump_folder)
    cfg.metrics.enable_tensorboard = True
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, 0))
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        mp = MetricsProcessor(cfg, rank=0, compute_dtype="float32")
        assert [type(s).__name__ for s in mp.sinks] == ["JSONLLogger"]
        jsonl = mp.sinks[0]
        jsonl.path = jsonl.label = "/dev/full" if os.path.exists("/dev/full") else "/proc/version"
        for step in (1, 2):
            mp.log(step, 8.0, 1.0, 1e-4)
        mp.log_validation(2, 7.5)
        mp.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("Metrics: TensorBoard cannot write (") and "it is off" in warnings[0]
    assert warnings[1].startswith(f"Metrics: writing {jsonl.path} failed (") and warnings[1].endswith(
        "it is off for the rest of the run (the console line goes on)")
    assert mp.sinks == []


@pytest.mark.parametrize(
    "env, tty, disabled, colored",
    [
        ({}, True, False, True),  # a terminal
        ({}, False, False, False),  # a log file or a pipe: plain text
        ({"TORCHTITAN_COLOR": "1"}, False, False, True),  # the launcher's console is a terminal
        ({"TORCHTITAN_COLOR": "0"}, True, False, False),
        ({"NO_COLOR": "1", "TORCHTITAN_COLOR": "1"}, True, False, False),
        ({}, True, True, False),  # metrics.disable_color_printing
    ],
)
def test_the_step_line_is_colored_only_for_a_terminal(dump_folder, caplog, monkeypatch, env, tty,
                                                      disabled, colored):
    for name in ("NO_COLOR", "TORCHTITAN_COLOR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty)
    cfg = JobConfig()
    cfg.job.dump_folder = str(dump_folder)
    cfg.metrics.disable_color_printing = disabled
    mp = MetricsProcessor(cfg, rank=0, compute_dtype="float32")
    with caplog.at_level("INFO", logger="torchtitan"):
        mp.log(1, 8.0, 1.0, 1e-4)
    mp.close()
    line = next(m for m in caplog.messages if "loss:" in m)
    assert ("\x1b[" in line) == colored
