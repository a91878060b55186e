"""The memory estimate against a real-tensor run of the same rank (torchtitan/tools/memory_compare.py).

On the CPU the real figure is the stand-in (the CPU allocator's live bytes); the CUDA figures
come from the GPU command in docs/performance.md ("Memory estimate against a real GPU peak").
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from torchtitan.config.manager import ConfigManager
from torchtitan.models import get_model_spec
from torchtitan.tools import memory_compare
from torchtitan.tools.memory_compare import (
    MemoryComparison,
    RealPeak,
    compare_memory,
    measure_real_peak,
)
from torchtitan.tools.memory_estimation import GiB, MemoryEstimate

ROOT = Path(__file__).resolve().parents[2]
DEBUG = ["--job.config_file", str(ROOT / "train_configs/debug_model.toml"),
         "--model.hf_assets_path", str(ROOT / "tests/assets/tokenizer"),
         "--training.local_batch_size", "2", "--training.seq_len", "128"]
TINY = [*DEBUG, "--model.flavor", "debugmodel_tiny", "--training.seq_len", "64"]
SLACK = 64 * 1024  # bytes: small CPU allocations the tracker does not see as tensors

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in's figures")


def _cfg(*flags: str):
    return ConfigManager().parse_args([*DEBUG, *flags])


def _model_bytes(world_size: int) -> tuple[int, int, int, int]:
    """(fp32 FSDP shard bytes, buffer bytes, parameter tensors, output weight bytes) of
    debugmodel with the test tokenizer; FSDP2 pads dim 0 to a multiple of the world size."""
    from torchtitan.components.tokenizer import build_tokenizer

    cfg = _cfg()
    spec = get_model_spec("llama3")
    args = spec.get_model_args("debugmodel")
    args.update_from_config(cfg, tokenizer=build_tokenizer(cfg.model))
    with torch.device("meta"):
        model = spec.model_cls(args)
    params = list(model.parameters())
    shard = sum(4 * math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0]) for p in params)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return shard, buffers, len(params), 4 * model.output.weight.numel()


def _estimate(peak: float, steps=(30.0, 40.0)) -> MemoryEstimate:
    return MemoryEstimate(world_size=8, rank=0, peak_bytes=int(peak * GiB),
                          step_peak_bytes=[int(s * GiB) for s in steps], parallelism="dp_shard=8")


def test_cuda_table_says_what_each_figure_includes_and_the_error():
    real = RealPeak(device="cuda", allocated_peak_bytes=42 * GiB, reserved_peak_bytes=46 * GiB,
                    held_at_start_bytes=4 * GiB, step_peak_bytes=[32 * GiB, 42 * GiB],
                    device_used_bytes=47 * GiB, device_total_bytes=80 * GiB,
                    device_name="NVIDIA H100 80GB HBM3")
    cmp = MemoryComparison(estimate=_estimate(40.0), real=real, steps=2)
    text = cmp.format()
    assert "measured on NVIDIA H100 80GB HBM3: CUDA" in text and "STAND-IN" not in text
    assert "| estimate | 40.000 | - | - |" in text
    assert "| real allocated peak | 42.000 | -2.000 | -4.8 |" in text
    assert "| real reserved peak | 46.000 | -6.000 | -13.0 |" in text
    assert "torch.cuda.max_memory_allocated()" in text and "4.000 GiB already held" in text
    assert "torch.cuda.max_memory_reserved()" in text and "47.00 of 80.00 GiB" in text
    assert "estimate 30.000, 40.000; measured 32.000, 42.000" in text
    js = json.loads(json.dumps(cmp.as_json()))
    assert js["stand_in"] is False and js["estimate_gib"] == 40.0
    assert js["error_allocated_gib"] == -2.0 and js["error_allocated_pct"] == -4.76
    assert js["error_reserved_gib"] == -6.0 and js["error_reserved_pct"] == -13.04


def test_cpu_table_is_marked_as_a_stand_in():
    real = RealPeak(device="cpu", allocated_peak_bytes=int(0.5 * GiB), reserved_peak_bytes=None,
                    held_at_start_bytes=0, step_peak_bytes=[int(0.5 * GiB)])
    cmp = MemoryComparison(estimate=_estimate(0.55, steps=(0.55,)), real=real, steps=1)
    text = cmp.format()
    assert "CPU STAND-IN (not a GPU figure)" in text
    assert "| CPU stand-in for the allocated peak | 0.500 | +0.050 | +10.0 |" in text
    assert "| real reserved peak | n/a on the CPU | - | - |" in text
    js = cmp.as_json()
    assert js["stand_in"] is True and js["real_reserved_peak_gib"] is None
    assert js["error_reserved_gib"] is None and js["error_allocated_pct"] == 10.0


def test_cuda_meter_resets_when_the_steps_begin_and_keeps_each_steps_peak(monkeypatch):
    """The CUDA meter's bookkeeping, on a scripted allocator: peaks are reset after
    ``empty_cache()`` when the steps begin and after each step; the result is the largest."""
    calls: list[str] = []
    stats = {"allocated": 5, "max_allocated": [30, 42], "max_reserved": [36, 46]}

    def record(name, value=None):
        def fn(*args):
            calls.append(name)
            return value() if callable(value) else value
        return fn

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "synchronize", record("synchronize"))
    monkeypatch.setattr(cuda, "empty_cache", record("empty_cache"))
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", record("reset"))
    monkeypatch.setattr(cuda, "memory_allocated", record("allocated", stats["allocated"]))
    monkeypatch.setattr(cuda, "max_memory_allocated",
                        record("max_allocated", lambda: stats["max_allocated"].pop(0)))
    monkeypatch.setattr(cuda, "max_memory_reserved",
                        record("max_reserved", lambda: stats["max_reserved"].pop(0)))
    monkeypatch.setattr(cuda, "mem_get_info", record("mem_get_info", (30, 80)))
    monkeypatch.setattr(cuda, "get_device_name", record("name", "GPU"))
    with memory_compare._CudaPeak() as meter:
        assert calls == ["synchronize", "empty_cache", "reset", "allocated"]
        meter.step_done()
        meter.step_done()
    result = meter.result()
    assert calls[4:12] == ["synchronize", "max_allocated", "max_reserved", "reset"] * 2
    assert (result.allocated_peak_bytes, result.reserved_peak_bytes) == (42, 46)
    assert result.step_peak_bytes == [30, 42] and result.held_at_start_bytes == 5
    assert (result.device_used_bytes, result.device_total_bytes) == (50, 80)
    assert not result.stand_in and result.device_name == "GPU"


@cpu_only
def test_cpu_stand_in_counts_allocator_bytes_with_resizes():
    """The stand-in follows the allocator: a storage freed by ``resize_(0)`` and grown again
    (how FSDP2 frees and re-allocates gathered parameters) counts once, at its new size."""
    weight = torch.nn.Linear(256, 256, bias=False)  # 256 KiB held
    run = SimpleNamespace(model_parts=[weight], optimizers=SimpleNamespace(optimizers=[]))
    batch = (torch.zeros(1024, dtype=torch.int64),)  # 8 KiB held
    meter = memory_compare._CpuPeak(run, [batch])
    with meter:
        a = torch.empty(1 << 20)  # 4 MiB
        del a
        meter.step_done()
        b = torch.empty(1 << 18)  # 1 MiB
        storage = b.untyped_storage()
        storage.resize_(0)
        storage.resize_(3 << 20)  # 3 MiB: 3 MiB live
        c = torch.empty(1 << 18)  # 1 MiB: 4 MiB live
        del b, storage, c
        meter.step_done()
    result = meter.result()
    held = 256 * 1024 + 8 * 1024
    assert result.held_at_start_bytes == held and result.stand_in
    assert result.step_peak_bytes == [held + (4 << 20), held + (4 << 20)]
    assert result.allocated_peak_bytes == held + (4 << 20)


@cpu_only
def test_refuses_when_the_estimate_exceeds_free_memory(monkeypatch):
    from torchtitan.distributed.comm_mode import local_tensor

    monkeypatch.setattr(local_tensor, "available_memory_bytes", lambda device_type: 1024)
    with pytest.raises(ValueError, match=r"^the real run of rank 0 needs about [0-9.]+ GiB "
                       r"\(the estimate\) but this machine .* has 0.00 GiB free: lower"):
        compare_memory(ConfigManager().parse_args(TINY), 2, steps=1)


@cpu_only
def test_out_of_memory_is_one_line(monkeypatch):
    import torchtitan.step

    def oom(run, microbatches):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore text")

    monkeypatch.setattr(torchtitan.step, "compute_gradients", oom)
    with pytest.raises(RuntimeError) as info:
        measure_real_peak(ConfigManager().parse_args(TINY), 2, steps=1)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("the real run ran out of device memory (CUDA out")
    assert "Tried to allocate 2.00 GiB)" in msg and "--training.local_batch_size" in msg


@cpu_only
@pytest.mark.slow
def test_real_8_rank_fsdp_step_agrees_with_the_estimate():
    """debugmodel as rank 0 of 8 (FSDP 8) on real tensors: it holds its 1/8 shards, the first
    step creates AdamW state for exactly those shards, and without activation checkpointing
    the estimate equals the CPU stand-in's peak within 64 KiB (measured: 4 KiB)."""
    shard, buffers, n_params, _ = _model_bytes(8)
    cmp = compare_memory(_cfg("--activation_checkpoint.mode", "none"), 8)
    real, est = cmp.real, cmp.estimate
    assert real.stand_in and "dp_shard=8" in est.parallelism
    inputs = 2 * 2 * 129 * 8  # (inputs, labels): 2 x 129 int64 tokens each at most
    assert shard + buffers <= real.held_at_start_bytes <= shard + buffers + inputs
    # step 2 holds AdamW's exp_avg + exp_avg_sq of this rank's shards and one step each
    assert real.step_peak_bytes[1] - real.step_peak_bytes[0] == 2 * shard + 4 * n_params
    assert abs(real.allocated_peak_bytes - est.peak_bytes) <= SLACK
    for measured, estimated in zip(real.step_peak_bytes, est.step_peak_bytes, strict=True):
        assert abs(measured - estimated) <= SLACK


@cpu_only
@pytest.mark.slow
def test_selective_ac_estimate_misses_the_held_reduce_scatter_input():
    """With the config's selective AC the peak falls in the backward, after the (norm, output)
    group's reduce-scatter: FSDP2 keeps that input (float32, vocab x dim) alive until the next
    group reduces, and the estimate does not count it. The stand-in is above the estimate by
    exactly that, within 64 KiB."""
    _, _, _, output_bytes = _model_bytes(8)
    cmp = compare_memory(_cfg(), 8)
    gap = cmp.real.allocated_peak_bytes - cmp.estimate.peak_bytes
    assert abs(gap - output_bytes) <= SLACK, (gap, output_bytes)


@cpu_only
@pytest.mark.slow
def test_script_compare_real_prints_the_table_and_json():
    cmd = [sys.executable, str(ROOT / "scripts/estimate_memory.py"), *TINY, "--world-size", "4",
           "--compare-real", "--steps", "1"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "| figure | GiB | error = estimate - figure, GiB | error, % of figure |" in out
    assert "| CPU stand-in for the allocated peak |" in out and "n/a on the CPU" in out
    data = json.loads(out.strip().splitlines()[-1])
    assert data["flavor"] == "debugmodel_tiny" and data["world_size"] == 4
    assert data["steps"] == 1 and data["stand_in"] is True and data["device"] == "cpu"
    assert data["estimate_gib"] > 0 and data["real_allocated_peak_gib"] > 0
    bad = subprocess.run([*cmd[:-2], "--steps", "0"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=env)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == "error: --steps must be at least 1 (got 0)"
