"""Predict one rank's peak memory for a config at any world size, without the hardware.

One process joins a ``fake`` process group of ``world_size`` ranks, builds and parallelizes the
model exactly as the trainer does, materializes it as fake tensors (``FakeTensorMode``: shapes
and dtypes, no storage) and runs two training steps (forward, backward, clipping, optimizer;
the second one with optimizer state) under torch's memory tracker
(``FSDPMemTracker`` with FSDP, ``MemTracker`` otherwise), which adds up every live tensor.

What is counted: parameters (sharded and all-gathered), gradients, optimizer state,
activations (after activation checkpointing), temporaries, collective buffers, inputs.
Optimizer state is the real optimizer's: with ``optimizer.state_dtype = "bfloat16"`` its two
moments take 4 bytes per parameter instead of 8; that step runs eagerly here, with two float32
temporaries the size of the parameter being stepped (three for Adam with weight decay), which
the compiled CUDA step does not make.
What is not: the CUDA context and NCCL workspaces (~0.5-1.5 GiB per GPU), caching-allocator
fragmentation (reserved memory is typically 5-20 % above active), and kernels' workspaces.
Nor is FSDP2's reduce-scatter input of the group reduced last, which FSDP2 keeps until the next
group reduces (float32, the group's unsharded size): when the peak falls there (e.g. selective
AC, in the last block's backward, after the output layer's gradient was reduced) the real peak
is higher by about ``vocab x dim x 4`` bytes. ``scripts/estimate_memory.py --compare-real``
measures the estimate against a real-tensor run of the same rank (docs/performance.md).
Attention is traced with the CPU SDPA kernel, whose saved tensors match flash attention's.
Expert parallel: expert weights are counted as the shards each rank holds (``E / ep`` experts,
FSDP-sharded over ``dp_shard_mod_ep``) and only those are all-gathered; the token all-to-all is
sized for perfectly balanced routing (fake collectives carry no token counts), so a skewed
router's extra tokens on a hot rank are not counted.

``memory_estimation.disable_fake_mode`` uses real tensors instead (real allocation and compute,
so only for small models).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.config.job_config import JobConfig
from torchtitan.tools.logging import logger

__all__ = ["MemoryEstimate", "estimate_memory", "log_memory_estimate"]

GiB = 1024**3


@dataclass
class MemoryEstimate:
    """One rank's predicted peak memory (bytes) and what it is made of at the peak."""

    world_size: int
    rank: int
    peak_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)
    step_peak_bytes: list[int] = field(default_factory=list)
    parallelism: str = ""
    fake: bool = True
    seconds: float = 0.0

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GiB

    def format(self) -> str:
        """A multi-line human-readable summary."""
        lines = [
            f"Estimated peak memory of rank {self.rank} at world size {self.world_size} "
            f"({self.parallelism}): {self.peak_gib:.2f} GiB"
            f"{'' if self.fake else ' (real tensors)'}",
        ]
        for name, nbytes in sorted(self.breakdown.items(), key=lambda kv: -kv[1]):
            if nbytes > 0:
                lines.append(f"  {name:<16} {nbytes / GiB:9.3f} GiB")
        if self.step_peak_bytes:
            per_step = ", ".join(f"{b / GiB:.2f}" for b in self.step_peak_bytes)
            lines.append(f"  peak per step (GiB): {per_step}")
        lines.append(
            "  not included: CUDA context + NCCL buffers (~0.5-1.5 GiB), allocator fragmentation"
        )
        return "\n".join(lines)


_propagation_depth = 0


@contextlib.contextmanager
def _untracked_sharding_propagation() -> Iterator[None]:
    """Mark DTensor's sharding propagation so the tracker skips it.

    Under an ambient FakeTensorMode, DTensor propagates some ops (foreach norms, fused
    optimizers) by running them on *global-shape* fake tensors in that same mode; torch's
    tracker would count those as real memory (a full unsharded copy of every gradient).
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        global _propagation_depth
        _propagation_depth += 1
        try:
            return original(self, op_schema)
        finally:
            _propagation_depth -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


@contextlib.contextmanager
def _cheap_module_weakrefs():
    """The tracker keys its per-module stats by torch's ``WeakIdRef``, whose every dereference
    asks ``hasattr(module, "_fix_weakref")`` (a tensor hook): for a module that is a failed
    ``nn.Module.__getattr__`` (two under checkpoint wrappers), once per tracked module per
    operator, about a third of a large model's estimate. A no-op answers it while the tracker
    runs."""
    if "_fix_weakref" in torch.nn.Module.__dict__:
        yield
        return
    torch.nn.Module._fix_weakref = lambda self: None
    try:
        yield
    finally:
        del torch.nn.Module._fix_weakref


def _skipping_propagation(tracker_cls: type) -> type:
    class Tracker(tracker_cls):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _propagation_depth:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    Tracker.__name__ = tracker_cls.__name__
    return Tracker


def _tracker_for(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return _skipping_propagation(FSDPMemTracker)(mod=model, optm=optimizer)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = _skipping_propagation(MemTracker)()
    tracker.track_external(model, optimizer)
    return tracker


def _peak_of(snapshot: dict) -> tuple[int, dict[str, int]]:
    peak, breakdown = 0, {}
    for per_device in snapshot.values():
        total = int(per_device.get("Total", 0))
        if total >= peak:
            peak = total
            breakdown = {
                str(getattr(k, "value", k)): int(v) for k, v in per_device.items() if k != "Total"
            }
    return peak, breakdown


def prepare_config(job_config: JobConfig, steps: int = 2) -> JobConfig:
    """A copy of ``job_config`` as an estimate runs it: eager (no compile), writing nothing,
    at least ``steps`` steps, ``memory_budget`` AC counted as none (warned)."""
    cfg = copy.deepcopy(job_config)
    if cfg.compile.enable:
        logger.warning("memory estimation runs without torch.compile (compile.enable ignored)")
    if cfg.activation_checkpoint.mode == "memory_budget":
        logger.warning(
            "memory estimation counts activation_checkpoint.mode='memory_budget' as no AC: "
            "the budget acts inside torch.compile, which the estimate does not run (an upper "
            "bound)"
        )
        cfg.activation_checkpoint.mode = "none"
    # An estimate writes nothing and measures the training step only.
    cfg.compile.enable = cfg.checkpoint.enable = cfg.validation.enable = False
    cfg.metrics.enable_tensorboard = cfg.metrics.enable_wandb = False
    cfg.job.print_config, cfg.job.save_config_file = False, None
    cfg.training.steps = max(cfg.training.steps, steps)
    return cfg


def parallelism_of(cfg: JobConfig, world_size: int) -> str:
    """The layout as one line (``dp_shard=8, ...``); refuses pipeline parallel (ValueError)."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    parallel_dims = ParallelDims.from_config(cfg.parallelism, world_size)
    if parallel_dims.pp_enabled:
        raise ValueError(
            "memory estimation does not support pipeline parallel "
            "(parallelism.pipeline_parallel_degree > 1)"
        )
    return str(parallel_dims).replace("ParallelDims", "").strip("()")


@contextlib.contextmanager
def fake_backend_run(
    cfg: JobConfig, world_size: int, rank: int, fake: bool, steps: int
) -> Iterator[tuple[Any, Any, list]]:
    """``build_run`` of ``cfg`` as ``rank`` of ``world_size`` on a fake process group, with
    fake tensors on the CPU or (``fake=False``) real ones on this machine's device; yields
    ``(run, mode, batches)`` (``steps`` input batches already on the device) and removes the
    process group after."""
    from torchtitan.build import build_run
    from torchtitan.distributed.comm_mode import FakeBackend
    from torchtitan.tools.device import device_type

    if dist.is_initialized():
        raise RuntimeError("estimate_memory needs a process without a process group")
    device = torch.device("cpu") if fake else torch.device(device_type)
    mode = FakeBackend(world_size, rank, fake_tensors=fake, label="memory estimation")
    try:
        run = build_run(cfg, mode, device=device)
        loader = iter(run.dataloader)
        yield run, mode, [tuple(t.to(device) for t in next(loader)) for _ in range(steps)]
    finally:
        mode.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def estimate_memory(
    job_config: JobConfig,
    world_size: int,
    *,
    rank: int = 0,
    fake: bool | None = None,
    steps: int = 2,
) -> MemoryEstimate:
    """Estimate ``rank``'s peak memory for ``job_config`` on ``world_size`` ranks.

    Builds the run with ``build_run`` on a fake process group (``FakeBackend``) and runs
    ``steps`` training steps of the trainer's own step functions under the tracker. Needs no
    process group (it makes and removes a fake one). ``fake=None`` follows
    ``memory_estimation.disable_fake_mode``. Raises ValueError for what it cannot estimate
    (pipeline parallel) and ParallelismError for impossible layouts.
    """
    from torchtitan.step import compute_gradients, optimizer_step

    start = time.perf_counter()
    if fake is None:
        fake = not job_config.memory_estimation.disable_fake_mode
    cfg = prepare_config(job_config, steps)
    parallelism = parallelism_of(cfg, world_size)
    with fake_backend_run(cfg, world_size, rank, fake, steps) as (run, mode, batches):
        model = run.model_parts[0]
        tracker = _tracker_for(model, run.optimizers.optimizers[0])
        if run.optimizers.steps_in_backward:
            logger.info(
                "memory estimation: the tracker follows one optimizer; with "
                "optimizer.early_step_in_backward (one per parameter) most optimizer state is "
                "counted as Temp (the peak is the same)"
            )
        step_peaks = []
        # Trackers must see the fake tensors from inside the fake mode (as the step does).
        with mode.step(), _untracked_sharding_propagation(), _cheap_module_weakrefs(), tracker:
            for inputs, labels in batches:
                if hasattr(tracker, "track_inputs"):
                    tracker.track_inputs((inputs, labels))
                compute_gradients(run, [(inputs, labels)])
                optimizer_step(run)
                run.optimizers.zero_grad()
                step_peaks.append(_peak_of(tracker.get_tracker_snapshot("peak"))[0])
                tracker.reset_mod_stats()  # per-module stats only; the peak is kept
                gc.collect()
        peak, breakdown = _peak_of(tracker.get_tracker_snapshot("peak"))
    return MemoryEstimate(
        world_size=world_size,
        rank=rank,
        peak_bytes=peak,
        breakdown=breakdown,
        step_peak_bytes=step_peaks,
        parallelism=parallelism,
        fake=fake,
        seconds=time.perf_counter() - start,
    )


def log_memory_estimate(job_config: JobConfig, world_size: int) -> MemoryEstimate | None:
    """Run :func:`estimate_memory` before training (``memory_estimation.enable``) and log it.

    A failure is logged as a warning; training goes on.
    """
    rank = 0
    with contextlib.suppress(ValueError):
        import os

        rank = int(os.environ.get("RANK", "0"))
    try:
        estimate = estimate_memory(job_config, world_size, rank=rank)
    except (ValueError, RuntimeError, NotImplementedError) as err:
        logger.warning(f"memory estimation failed, training goes on: {err}")
        return None
    logger.info(estimate.format() + f"\n  (estimated in {estimate.seconds:.1f} s)")
    return estimate
