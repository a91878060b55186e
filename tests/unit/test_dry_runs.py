"""What the COMM_MODE dry runs switch off, the torch warnings explained once, and the
local_tensor memory check (all in-process)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tests.conftest import REPO_ROOT
from torchtitan.config.manager import ConfigManager
from torchtitan.distributed.comm_mode import COMM_MODES, CommMode
from torchtitan.distributed.comm_mode import local_tensor as local_tensor_mod
from torchtitan.distributed.parallel_dims import ParallelDims, ParallelismError
from torchtitan.tools import known_warnings

GiB = 1024**3
DEBUG = str(REPO_ROOT / "train_configs" / "debug_model.toml")


def cfg_of(*flags: str):
    return ConfigManager().parse_args(["--job.config_file", DEBUG, *flags])


def dims(tp: int = 1, world_size: int = 4) -> ParallelDims:
    return ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=tp, pp=1, ep=1, etp=1,
                        world_size=world_size)


@pytest.mark.parametrize("mode", ["fake_backend", "local_tensor"])
def test_dry_runs_switch_compile_async_tp_and_profiling_off(mode, caplog):
    """One policy: a dry run checks layouts, not kernels, so both dry runs switch compile,
    async TP and the profilers off in one info line (a real run refuses async TP without
    CUDA: check_async_tp); the LR warm-up is fitted to the dry run's one step silently."""
    cfg = cfg_of("--compile.enable", "--parallelism.enable_async_tensor_parallel",
                 "--parallelism.tensor_parallel_degree", "2", "--profiling.enable_profiling", "--profiling.enable_memory_snapshot",
                 "--training.steps", "1")
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        COMM_MODES[mode](4).prepare(cfg, dims(tp=2))
    assert not cfg.compile.enable and not cfg.parallelism.enable_async_tensor_parallel
    assert not (cfg.profiling.enable_profiling or cfg.profiling.enable_memory_snapshot)
    assert cfg.lr_scheduler.warmup_steps == 1  # debug_model.toml warms up over 2 steps
    assert "switched off compile.enable, parallelism.enable_async_tensor_parallel, " \
           "profiling.enable_profiling, profiling.enable_memory_snapshot" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_known_torch_warnings_are_explained_once_others_still_show(caplog, monkeypatch):
    monkeypatch.setattr(known_warnings, "_explained", set())
    shown = []
    hook = known_warnings.explaining(lambda message, *args: shown.append(str(message)))
    rng = "DTensor random operators may not have complete support on cpu device mesh"
    view = "FSDP2-wrapped module (FSDPEmbedding) returned a view tensor. An in-place op ..."
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        for message in (rng, view, rng, "something new", view):
            hook(UserWarning(message), UserWarning, "x.py", 1)
        log_filter = known_warnings._LogFilter()
        record = logging.LogRecord(
            "torch.distributed.tensor._redistribute", logging.WARNING, "x.py", 1,
            "While redistributing from (Shard(dim=0), Shard(dim=0)) to (Replicate(), "
            "Shard(dim=0)), 2 sequential all_gather operations will be performed.", None, None,
        )
        assert log_filter.filter(record) is False  # dropped, explained
    assert shown == ["something new"]
    explained = [m for m in caplog.messages if m.startswith("known torch warning:")]
    assert len(explained) == 3, explained  # once each, whatever the repeats
    assert "RNG tracker is CUDA-only" in explained[0] and "never h += ..." in explained[1]


def test_local_tensor_refuses_a_run_that_cannot_fit(monkeypatch, caplog):
    monkeypatch.setattr(local_tensor_mod, "available_memory_bytes", lambda device: 8 * GiB)
    estimate = SimpleNamespace(peak_bytes=int(0.75 * GiB))
    with pytest.raises(ParallelismError) as info:
        COMM_MODES["local_tensor"](16).check_memory(lambda: estimate)
    assert str(info.value).startswith(
        "COMM_MODE=local_tensor needs about 16.00 GiB (16 simulated ranks x 0.75 GiB estimated, "
        "+25% headroom and 1 GiB for the process) but this machine has 8.0 GiB free"
    )
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        COMM_MODES["local_tensor"](6).check_memory(lambda: estimate)
    assert "memory about 6.62 GiB (6 simulated ranks x 0.75 GiB estimated, +25% headroom and " \
        "1 GiB for the process) of 8.0 GiB free" in caplog.text


def test_only_local_tensor_pays_for_an_estimate():
    def boom():
        raise AssertionError("estimated")

    CommMode(2).check_memory(boom)
    COMM_MODES["fake_backend"](128).check_memory(boom)
