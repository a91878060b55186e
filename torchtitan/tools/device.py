"""Device selection, peak-FLOPs table and memory readings (CUDA when present, else CPU)."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import torch

device_type = "cuda" if torch.cuda.is_available() else "cpu"
device_module = torch.cuda if device_type == "cuda" else None

# Dense (no sparsity) peak TFLOP/s per device, by the precision matmuls run in: bfloat16,
# tf32 (float32 matmuls on TF32 tensor cores) and float32 (full precision: no TF32; AMD's fp32
# matrix cores). Sources: vendor datasheets. A device or precision not listed reports MFU as
# unavailable rather than guessing.
_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bfloat16": 989.5, "tf32": 494.7, "float32": 67.0},
    "H100 NVL": {"bfloat16": 835.0, "tf32": 417.5, "float32": 60.0},
    "H100 PCIe": {"bfloat16": 756.0, "tf32": 378.0, "float32": 51.0},
    "H200": {"bfloat16": 989.5, "tf32": 494.7, "float32": 67.0},
    "H20": {"bfloat16": 148.0, "tf32": 74.0, "float32": 44.0},
    "GH200": {"bfloat16": 989.5, "tf32": 494.7, "float32": 67.0},
    "B200": {"bfloat16": 2250.0, "tf32": 1125.0},
    "A100": {"bfloat16": 312.0, "tf32": 156.0, "float32": 19.5},
    "A10G": {"bfloat16": 70.0, "tf32": 35.0},
    "L40S": {"bfloat16": 362.0, "tf32": 183.0, "float32": 91.6},
    "L4": {"bfloat16": 121.0, "tf32": 60.0, "float32": 30.3},
    "MI300X": {"bfloat16": 1307.4, "tf32": 653.7, "float32": 163.4},
    "MI325X": {"bfloat16": 1307.4, "tf32": 653.7, "float32": 163.4},
    "MI250X": {"bfloat16": 383.0, "tf32": 95.7, "float32": 95.7},  # no TF32: fp32 matrix cores
}


def matmul_precision(dtype: str) -> str:
    """The peak-table column for matmuls in ``dtype``: float32 matmuls use TF32 tensor cores
    only when torch allows it (``torch.set_float32_matmul_precision("high")``; torch's
    default, "highest", runs them in full float32, at a small fraction of the TF32 peak)."""
    if dtype == "float32" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return dtype


def device_name() -> str:
    """Human-readable name of the accelerator, or ``cpu``."""
    if device_type == "cuda":
        return torch.cuda.get_device_name()
    return "cpu"


def lookup_peak_tflops(name: str, dtype: str) -> float | None:
    """Peak dense TFLOP/s of device ``name`` for ``dtype`` (a column of the table: bfloat16,
    tf32, float32); None when unknown."""
    if "H100" in name:
        key = "H100 NVL" if "NVL" in name else "H100 PCIe" if "PCIe" in name else "H100 SXM"
    else:
        key = next((k for k in _PEAK_TFLOPS if k in name), None)
    if key is None:
        return None
    return _PEAK_TFLOPS[key].get(dtype)


def get_peak_flops(dtype: str) -> float | None:
    """Peak FLOP/s of this process's device for matmuls in ``dtype`` (float32: TF32 or full
    precision, as torch runs them now), or None when not in the table."""
    tflops = lookup_peak_tflops(device_name(), matmul_precision(dtype))
    return None if tflops is None else tflops * 1e12


ALLOCATOR_DEFAULT = "expandable_segments:True"


def default_cuda_allocator() -> bool:
    """Give CUDA's caching allocator expandable segments unless the user configured it
    (``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF`` set, to anything): segments grow in
    place instead of new blocks being cut for each size, so the memory a run reserves stays
    near what it allocates (less fragmentation, fewer out-of-memory errors at the same
    batch). Set in the environment too, so processes this one starts (compile workers)
    agree. True when it set them."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_DEFAULT
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is not None:  # effective even if the allocator is already initialised
        setter(ALLOCATOR_DEFAULT)
    return True


def get_device(local_rank: int | None = None) -> torch.device:
    """The device this rank computes on (sets the current CUDA device, with
    :func:`default_cuda_allocator`)."""
    if device_type == "cuda":
        if default_cuda_allocator():
            from torchtitan.tools.logging import logger

            logger.info(f"CUDA allocator: {ALLOCATOR_DEFAULT} (less fragmentation; set "
                        "PYTORCH_CUDA_ALLOC_CONF to choose otherwise)")
        idx = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx)
    return torch.device("cpu")


@dataclass
class MemoryReading:
    peak_gib: float
    peak_pct: float
    kind: str  # "device" (accelerator allocator) or "host" (process peak RSS)


class MemoryMonitor:
    """Peak memory since the last reset: the CUDA allocator's, or the process RSS on CPU."""

    def __init__(self) -> None:
        if device_type == "cuda":
            self.capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        else:
            self.capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.reset_peak_stats()

    def reset_peak_stats(self) -> None:
        if device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def get_peak_stats(self) -> MemoryReading:
        if device_type == "cuda":
            peak = torch.cuda.max_memory_reserved()
            kind = "device"
        else:
            # ru_maxrss is in KiB on Linux.
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            kind = "host"
        gib = peak / 2**30
        return MemoryReading(gib, 100.0 * peak / self.capacity, kind)
