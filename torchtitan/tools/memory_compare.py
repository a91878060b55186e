"""The memory estimator's figure against a real peak of the same rank, on one device.

``compare_memory`` computes the estimate (``estimate_memory``: fake tensors under torch's
memory tracker), then builds the same rank again on the same fake process group with *real*
tensors on this machine's device (collectives faked, so FSDP shards have this rank's real size
and all-gathers allocate their real buffers) and runs the same steps (the trainer's
``compute_gradients`` + ``optimizer_step``, then ``zero_grad``, on the same random batches).

What the real figures are:

- CUDA: ``torch.cuda.max_memory_allocated()`` and ``max_memory_reserved()`` over the steps,
  with the peaks reset (after ``empty_cache()``) once the build is done and the batches are on
  the device. The allocated peak therefore includes what the run already holds when the steps
  begin (parameter shards, buffers, inputs), as the estimate does; the reserved peak adds the
  caching allocator's cached and fragmented blocks. Neither includes the CUDA context or NCCL
  (there is none: the process group is fake).
- CPU (a stand-in, not a GPU figure): the bytes the CPU allocator handed out during the steps
  and had not taken back, at their peak (``torch.profiler``'s memory reporting, which sees
  every allocation, storage resizes included), plus the storages the run holds when the steps
  begin (parameter shards, buffers, optimizer state, inputs). There is no reserved figure.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

from torchtitan.config.job_config import JobConfig
from torchtitan.tools.memory_estimation import (
    GiB,
    MemoryEstimate,
    estimate_memory,
    fake_backend_run,
    parallelism_of,
    prepare_config,
)

__all__ = ["MemoryComparison", "RealPeak", "compare_memory", "measure_real_peak"]

_STEP_MARK = "memory_compare_step_"


@dataclass
class RealPeak:
    """One rank's measured peak (bytes) over the steps of a real-tensor run."""

    device: str
    allocated_peak_bytes: int
    reserved_peak_bytes: int | None
    held_at_start_bytes: int
    step_peak_bytes: list[int] = field(default_factory=list)
    device_used_bytes: int | None = None
    device_total_bytes: int | None = None
    device_name: str = ""
    seconds: float = 0.0

    @property
    def stand_in(self) -> bool:
        """True when the figure is the CPU stand-in, not a CUDA allocator figure."""
        return self.device != "cuda"


class _CudaPeak:
    """The CUDA caching allocator's peaks, per step, from the moment the steps begin."""

    def __enter__(self) -> _CudaPeak:
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.held_at_start = torch.cuda.memory_allocated()
        self.allocated: list[int] = []
        self.reserved: list[int] = []
        return self

    def step_done(self) -> None:
        torch.cuda.synchronize()
        self.allocated.append(torch.cuda.max_memory_allocated())
        self.reserved.append(torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()

    def __exit__(self, *exc) -> None:
        pass

    def result(self) -> RealPeak:
        free, total = torch.cuda.mem_get_info()
        return RealPeak(
            device="cuda", allocated_peak_bytes=max(self.allocated),
            reserved_peak_bytes=max(self.reserved), held_at_start_bytes=self.held_at_start,
            step_peak_bytes=self.allocated, device_used_bytes=total - free,
            device_total_bytes=total, device_name=torch.cuda.get_device_name(),
        )


def held_bytes(run, batches) -> int:
    """Bytes of the distinct storages behind the run's parameters (local shards), buffers,
    gradients, optimizer state and ``batches``."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    storages: dict[int, int] = {}

    def add(t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        if is_traceable_wrapper_subclass(t):  # DTensor: its local shard
            for name in t.__tensor_flatten__()[0]:
                add(getattr(t, name))
            return
        storage = t.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()

    for model in run.model_parts:
        for p in model.parameters():
            add(p)
            add(p.grad)
        for b in model.buffers():
            add(b)
    for opt in run.optimizers.optimizers:
        for state in opt.state.values():
            for v in state.values():
                add(v)
    for batch in batches:
        for t in batch:
            add(t)
    return sum(storages.values())


def cpu_allocations(prof) -> list[tuple[int, int, int, int]]:
    """The CPU allocator's events in a finished ``torch.profiler.profile(profile_memory=True)``
    as sorted ``(time_ns, size, running total, step)`` (``size`` negative for a free; ``step``:
    the innermost enclosing ``record_function`` mark of :class:`_CpuPeak`, else -1). Buffers
    that compiled code allocates count too (a dispatch mode would not see them)."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, int, int]] = []

    def walk(nodes, step: int) -> None:
        for e in nodes:
            if e.name.startswith(_STEP_MARK):
                step = int(e.name[len(_STEP_MARK):])
            if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu":
                alloc = e.typed[1]
                events.append((e.start_time_ns, alloc.alloc_size, alloc.total_allocated, step))
            walk(e.children, step)

    walk(prof.profiler.kineto_results.experimental_event_tree(), -1)
    return sorted(events)


def cpu_peak_added_bytes(fn) -> int:
    """The most bytes the CPU allocator held above its level at the start while ``fn()`` ran
    (torch.profiler's memory reporting)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = cpu_allocations(prof)
    base = events[0][2] - events[0][1] if events else 0
    return max([total - base for _, _, total, _ in events] + [0])


class _CpuPeak:
    """CPU stand-in: the allocator's live bytes at their peak, from the profiler's memory
    reporting, over the held storages."""

    def __init__(self, run, batches) -> None:
        self.run, self.batches = run, batches
        self.steps = 0

    def __enter__(self) -> _CpuPeak:
        from torch.profiler import ProfilerActivity, profile, record_function

        self.held_at_start = held_bytes(self.run, self.batches)
        self._record_function = record_function
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        self._mark = record_function(f"{_STEP_MARK}0")
        self._mark.__enter__()
        return self

    def step_done(self) -> None:
        self._mark.__exit__(None, None, None)
        self.steps += 1
        self._mark = self._record_function(f"{_STEP_MARK}{self.steps}")
        self._mark.__enter__()

    def __exit__(self, *exc) -> None:
        self._mark.__exit__(None, None, None)
        self._profile.__exit__(*exc)

    def result(self) -> RealPeak:
        events = cpu_allocations(self._profile)
        # The reporter's running total may start above 0 (blocks of earlier sessions).
        base = events[0][2] - events[0][1] if events else 0
        per_step = [0] * self.steps
        for _, _, total, step in events:
            if 0 <= step < self.steps:
                per_step[step] = max(per_step[step], total - base)
        peak = max([total - base for _, _, total, _ in events], default=0)
        held = self.held_at_start
        return RealPeak(
            device="cpu", allocated_peak_bytes=held + peak, reserved_peak_bytes=None,
            held_at_start_bytes=held, step_peak_bytes=[held + p for p in per_step],
        )


def measure_real_peak(
    job_config: JobConfig, world_size: int, *, rank: int = 0, steps: int = 2
) -> RealPeak:
    """Run ``steps`` training steps of ``rank`` of ``world_size`` on real tensors (fake process
    group) on this machine's device and measure its peak: CUDA's allocator figures, or the CPU
    stand-in. Raises RuntimeError (one line) when the device runs out of memory."""
    from torchtitan.step import compute_gradients, optimizer_step

    start = time.perf_counter()
    cfg = prepare_config(job_config, steps)
    parallelism_of(cfg, world_size)  # refuses pipeline parallel
    with fake_backend_run(cfg, world_size, rank, False, steps) as (run, mode, batches):
        meter = _CudaPeak() if batches[0][0].device.type == "cuda" else _CpuPeak(run, batches)
        try:
            with mode.step(), meter:
                for inputs, labels in batches:
                    compute_gradients(run, [(inputs, labels)])
                    optimizer_step(run)
                    run.optimizers.zero_grad()
                    gc.collect()
                    meter.step_done()
        except torch.OutOfMemoryError as err:
            raise RuntimeError(
                "the real run ran out of device memory ("
                + str(err).splitlines()[0].rstrip(". ")
                + "): lower --training.local_batch_size or --training.seq_len, or use "
                "--activation_checkpoint.mode full"
            ) from None
        result = meter.result()
    result.seconds = time.perf_counter() - start
    return result


@dataclass
class MemoryComparison:
    """The estimate and the measured peak of the same rank, and the error between them."""

    estimate: MemoryEstimate
    real: RealPeak
    steps: int

    def errors(self) -> dict[str, tuple[float, float] | None]:
        """Per real figure: (estimate - figure in GiB, as % of the figure)."""
        out: dict[str, tuple[float, float] | None] = {}
        for name, real in (("allocated", self.real.allocated_peak_bytes),
                           ("reserved", self.real.reserved_peak_bytes)):
            if not real:
                out[name] = None
                continue
            diff = self.estimate.peak_bytes - real
            out[name] = (diff / GiB, 100.0 * diff / real)
        return out

    def format(self) -> str:
        """A table line per figure and what each one includes."""
        est, real = self.estimate, self.real
        errors = self.errors()
        where = "CUDA" if not real.stand_in else "CPU STAND-IN (not a GPU figure)"
        lines = [
            f"Memory of rank {est.rank} at world size {est.world_size} ({est.parallelism}), "
            f"{self.steps} steps, measured on {real.device_name or real.device}: {where}",
            "| figure | GiB | error = estimate - figure, GiB | error, % of figure |",
            "|---|---|---|---|",
            f"| estimate | {est.peak_gib:.3f} | - | - |",
        ]
        alloc_name = ("real allocated peak" if not real.stand_in
                      else "CPU stand-in for the allocated peak")
        for label, nbytes, err in ((alloc_name, real.allocated_peak_bytes, errors["allocated"]),
                                   ("real reserved peak", real.reserved_peak_bytes,
                                    errors["reserved"])):
            if nbytes is None or err is None:
                lines.append(f"| {label} | n/a on the CPU | - | - |")
            else:
                lines.append(f"| {label} | {nbytes / GiB:.3f} | {err[0]:+.3f} | {err[1]:+.1f} |")
        held = real.held_at_start_bytes / GiB
        lines.append(
            "  estimate: torch's memory tracker over fake tensors, at its peak: parameter shards,"
            " gathered parameters, gradients, optimizer state, activations, temporaries,"
            " collective buffers, inputs"
        )
        if not real.stand_in:
            lines += [
                "  real allocated peak: torch.cuda.max_memory_allocated() over the steps (peaks"
                f" reset when the steps begin), including the {held:.3f} GiB already held then"
                " (parameter shards, buffers, inputs); no CUDA context, no NCCL (fake group)",
                "  real reserved peak: torch.cuda.max_memory_reserved() over the steps (after"
                " empty_cache()): allocated + the caching allocator's cached and fragmented"
                " blocks; no CUDA context",
            ]
            if real.device_used_bytes is not None and real.device_total_bytes:
                lines.append(
                    "  in no figure: the CUDA context and other processes (device memory in use"
                    f" after the steps: {real.device_used_bytes / GiB:.2f} of"
                    f" {real.device_total_bytes / GiB:.2f} GiB, torch.cuda.mem_get_info)"
                )
        else:
            lines.append(
                "  CPU stand-in: the CPU allocator's live bytes at their peak over the steps"
                " (torch.profiler memory reporting) plus the storages held when the steps"
                f" begin ({held:.3f} GiB: parameter shards, buffers, inputs); not a GPU figure"
            )
        per_step = ", ".join(f"{b / GiB:.3f}" for b in real.step_peak_bytes)
        est_steps = ", ".join(f"{b / GiB:.3f}" for b in est.step_peak_bytes)
        lines.append(f"  peak per step (GiB): estimate {est_steps}; measured {per_step}")
        return "\n".join(lines)

    def as_json(self) -> dict:
        """Every figure, machine-readable (GiB rounded to 1e-3)."""
        est, real = self.estimate, self.real
        errors = self.errors()

        def gib(b):
            return None if b is None else round(b / GiB, 3)

        return {
            "world_size": est.world_size, "rank": est.rank, "parallelism": est.parallelism,
            "steps": self.steps, "device": real.device, "device_name": real.device_name,
            "stand_in": real.stand_in, "estimate_gib": gib(est.peak_bytes),
            "real_allocated_peak_gib": gib(real.allocated_peak_bytes),
            "real_reserved_peak_gib": gib(real.reserved_peak_bytes),
            "error_allocated_gib": errors["allocated"] and round(errors["allocated"][0], 3),
            "error_allocated_pct": errors["allocated"] and round(errors["allocated"][1], 2),
            "error_reserved_gib": errors["reserved"] and round(errors["reserved"][0], 3),
            "error_reserved_pct": errors["reserved"] and round(errors["reserved"][1], 2),
            "held_at_start_gib": gib(real.held_at_start_bytes),
            "estimate_step_peaks_gib": [gib(b) for b in est.step_peak_bytes],
            "real_step_peaks_gib": [gib(b) for b in real.step_peak_bytes],
            "device_used_gib": gib(real.device_used_bytes),
            "device_total_gib": gib(real.device_total_bytes),
            "estimate_breakdown_gib": {k: gib(v) for k, v in est.breakdown.items()},
            "seconds": {"estimate": round(est.seconds, 1), "real": round(real.seconds, 1)},
            "torch": torch.__version__,
        }


def compare_memory(
    job_config: JobConfig, world_size: int, *, rank: int = 0, steps: int = 2,
    fake_estimate: bool | None = None,
) -> MemoryComparison:
    """Estimate ``rank``'s peak, then measure it on real tensors (:func:`measure_real_peak`).

    Refuses (ValueError, one line) before the real run when the estimate exceeds the free
    memory of this machine's device."""
    from torchtitan.distributed.comm_mode.local_tensor import available_memory_bytes
    from torchtitan.tools.device import device_type

    estimate = estimate_memory(job_config, world_size, rank=rank, fake=fake_estimate, steps=steps)
    free = available_memory_bytes(device_type)
    if free is not None and estimate.peak_bytes > free:
        where = "GPU" if device_type == "cuda" else "machine (CPU stand-in: small flavors only)"
        raise ValueError(
            f"the real run of rank {rank} needs about {estimate.peak_gib:.2f} GiB (the estimate) "
            f"but this {where} has {free / GiB:.2f} GiB free: lower "
            "--training.local_batch_size or --training.seq_len, or run on a larger GPU"
        )
    real = measure_real_peak(job_config, world_size, rank=rank, steps=steps)
    return MemoryComparison(estimate=estimate, real=real, steps=steps)
