"""``COMM_MODE=local_tensor``: every rank of a job simulated in one process, with real values.

``LocalTensorMode`` holds one tensor per simulated rank; collectives really combine them, so
numerics match a real run of that layout. Each data-parallel rank reads its own batches.
Tensor parallel runs as is; data parallel (FSDP/HSDP/DDP) runs as DTensor-sharded parameters
gathered on use (SimpleFSDP style), because ``fully_shard`` cannot run under
LocalTensorMode. Expert parallel's token all-to-all runs for real: its per-rank split sizes
come out of ``tolist()`` as per-rank integers, which LocalTensor's all-to-all accepts. Pipeline
parallel and context parallel are refused; compile (and async TP) are switched off
(``prepare_dry_run``), as in ``fake_backend``.
Memory and time grow with the number of simulated ranks: ``check_memory`` estimates the
memory before the build and refuses a run that cannot fit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.comm_mode.base import CommMode, prepare_dry_run
from torchtitan.distributed.comm_mode.fake_backend import init_fake_process_group
from torchtitan.distributed.comm_mode.local_tensor_load import (
    load_initial_weights,
    take_initial_load,
)
from torchtitan.distributed.fsdp import data_parallel_override
from torchtitan.distributed.parallel_dims import ParallelDims, ParallelismError
from torchtitan.tools.logging import logger

GiB = 1024**3
HEADROOM = 1.25
"""Measured: 32 simulated ranks of the debug model (8 x 512 tokens each) estimated at 15.5 GiB
reached 16.1 GiB of RSS before their first step ended (LocalTensor bookkeeping, per-rank
loaders, allocator slack)."""
PROCESS_BYTES = GiB
"""Python, torch and the interpreter's own memory."""


def available_memory_bytes(device_type: str) -> int | None:
    """Free memory of the device tensors live on (CUDA: free GPU memory; CPU: what the host has
    left, :func:`~torchtitan.tools.host_memory.available_host_bytes`)."""
    if device_type == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    from torchtitan.tools.host_memory import available_host_bytes

    return available_host_bytes()


def real_rank_threads(world_size: int) -> int | None:
    """CPU threads for the simulation: as many as each rank of the real CPU job gets
    (``run_train.sh``: the cores / NGPU, at least 1), so CPU kernels split their sums alike and
    the numerics match the real run's (with another thread count some kernels round their
    last bit differently, and not always the same way). None on GPU machines or when
    ``OMP_NUM_THREADS`` is set."""
    if "OMP_NUM_THREADS" in os.environ or torch.cuda.is_available():
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """The estimator builds a run of its own: keep its log lines out of this one's."""
    level = logger.level
    logger.setLevel("ERROR")
    try:
        yield
    finally:
        logger.setLevel(level)


def _dp_rank_of(parallel_dims: ParallelDims, rank: int) -> int:
    """Data-parallel index of global ``rank`` (the order of the flattened ``dp`` mesh)."""
    mesh = parallel_dims.world_mesh
    if mesh is None:
        return 0
    coords = (mesh.mesh == rank).nonzero()[0].tolist()
    named = dict(zip(mesh.mesh_dim_names or (), coords))
    return named.get("dp_replicate", 0) * parallel_dims.dp_shard + named.get("dp_shard", 0)


class LocalTensorBatches:
    """Combines one dataloader per data-parallel rank into per-rank ``LocalTensor`` batches."""

    def __init__(self, loaders: dict[int, Any], rank_to_dp: dict[int, int]):
        self.loaders = loaders
        self.rank_to_dp = rank_to_dp

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from torch.distributed._local_tensor import LocalTensor, maybe_disable_local_tensor_mode

        with maybe_disable_local_tensor_mode():
            iters = {d: iter(loader) for d, loader in self.loaders.items()}
        while True:
            with maybe_disable_local_tensor_mode():
                batches = {d: next(it) for d, it in iters.items()}
                inputs = LocalTensor({r: batches[d][0] for r, d in self.rank_to_dp.items()})
                labels = LocalTensor({r: batches[d][1] for r, d in self.rank_to_dp.items()})
            yield inputs, labels

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


# --- data parallel under LocalTensorMode (SimpleFSDP style) ---------------------------------
_gather_enabled = True


@contextlib.contextmanager
def params_as_stored() -> Iterator[None]:
    """Parameters read as their sharded DTensors (for in-place init), not gathered."""
    global _gather_enabled
    old, _gather_enabled = _gather_enabled, False
    try:
        yield
    finally:
        _gather_enabled = old


class _GatherOnUse(nn.Module):
    """Parametrization: gather a data-parallel-sharded parameter when it is used.

    The stored parameter is a DTensor on ``(dp dims..., [tp])``; the computed one is the
    TP-local view (a DTensor on the tp mesh, or a plain tensor), cast to ``param_dtype``.
    Its gradient is averaged over the dp dims and reduce-scattered back to the shard.
    """

    def __init__(self, n_dp: int, tp_mesh, tp_placements, param_dtype: torch.dtype | None):
        super().__init__()
        self.n_dp = n_dp
        self.tp_mesh = tp_mesh
        self.tp_placements = tuple(tp_placements)
        self.param_dtype = param_dtype

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Partial, Replicate

        if not _gather_enabled:
            return x
        gathered = x.redistribute(x.device_mesh, [Replicate()] * self.n_dp + list(self.tp_placements))
        local = gathered.to_local(grad_placements=[Partial("avg")] * self.n_dp + list(self.tp_placements))
        if self.param_dtype is not None and local.is_floating_point():
            local = local.to(self.param_dtype)
        if self.tp_mesh is None:
            return local
        return DTensor.from_local(local, self.tp_mesh, self.tp_placements, run_check=False)


def apply_local_data_parallel(
    model: nn.Module, parallel_dims: ParallelDims, param_dtype: torch.dtype | None = None
) -> nn.Module:
    """Shard every parameter over the data-parallel mesh dims as a DTensor, gathered on use.

    ``dp_shard`` shards dim 0 (FSDP), ``dp_replicate`` replicates (DDP / HSDP's outer dim);
    gradients are averaged over both, as FSDP2 and DDP do. Expert-parallel experts use
    ``dp_shard_mod_ep`` instead of ``dp_shard``. Works under LocalTensorMode, where
    ``fully_shard`` does not.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.nn.utils import parametrize

    mesh = parallel_dims.world_mesh
    if mesh is None:
        return model
    dp_dims = [n for n in ("dp_replicate", "dp_shard") if n in (mesh.mesh_dim_names or ())]
    if not dp_dims:
        return model
    # expert-parallel experts (DTensors on a mesh with ep): data parallel over the ranks
    # outside their ep group, (dp_replicate,) dp_shard_mod_ep, as fsdp.get_expert_fsdp_mesh
    expert_dp = [
        n for n in ("dp_replicate", "dp_shard_mod_ep") if parallel_dims.get_mesh(n) is not None
    ]
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            tp_mesh = param.device_mesh if isinstance(param, DTensor) else None
            tp_placements = list(param.placements) if tp_mesh is not None else []
            if tp_mesh is not None and "ep" in (tp_mesh.mesh_dim_names or ()):
                dims = expert_dp
                span = DeviceMesh._concatenate([*map(parallel_dims.get_mesh, dims), tp_mesh])
            else:
                dims = dp_dims
                names = [*dims, *(tp_mesh.mesh_dim_names if tp_mesh is not None else ())]
                span = mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]
            placements = [Replicate() if n == "dp_replicate" else Shard(0) for n in dims]
            full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            sharded = distribute_tensor(full, span, placements + tp_placements)
            setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            parametrize.register_parametrization(
                module,
                name,
                _GatherOnUse(len(dims), tp_mesh, tp_placements, param_dtype),
                unsafe=True,
            )
    kinds = "+".join(f"{n}={mesh[n].size()}" for n in dp_dims)
    logger.info(f"Applied DTensor data parallel (gather on use, {kinds}) for LocalTensorMode")
    return model


def evict_dead_mesh_coordinates() -> None:
    """Make LocalTensorMode forget a mesh's per-rank coordinates when the mesh is freed.

    torch caches them by ``id(mesh)``; a mesh built later at a freed mesh's address (the
    meshes built per parameter while sharding) then got the dead mesh's coordinates: wrong
    shards, or ``IndexError: list index out of range`` in ``distribute_tensor``, depending
    on the garbage collector. Idempotent."""
    import weakref

    from torch.distributed import _local_tensor

    cls = _local_tensor._LocalDeviceMesh
    original = cls.get_coordinate
    if getattr(original, "evicts_dead_meshes", False):
        return

    def get_coordinate(mesh):
        mode = _local_tensor.enabled_local_tensor_mode()
        cache = getattr(mode, "_coordinate_cache", None)  # torch versions without it: no cache
        new = cache is not None and id(mesh) not in cache
        coordinates = original(mesh)
        if new:
            weakref.finalize(mesh, cache.pop, id(mesh), None)
        return coordinates

    get_coordinate.evicts_dead_meshes = True
    cls.get_coordinate = staticmethod(get_coordinate)


def _local_data_parallel(model, parallel_dims, param_dtype, reduce_dtype, **_unused):
    """``fsdp.apply_data_parallel``'s stand-in while LocalTensorMode is on."""
    if not (parallel_dims.dp_shard_enabled or parallel_dims.dp_replicate_enabled):
        return model
    mp_dtype = param_dtype if parallel_dims.fsdp_enabled else None
    return apply_local_data_parallel(model, parallel_dims, mp_dtype)


class LocalTensorSim(CommMode):
    """All ranks simulated in one process under LocalTensorMode (see the module docstring)."""

    name = "local_tensor"

    def __init__(self, world_size: int, rank: int = 0) -> None:
        super().__init__(world_size, rank)
        self._stack = contextlib.ExitStack()
        self._initial_load = None

    def prepare(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        refused = []
        if parallel_dims.pp_enabled:
            refused.append(
                "pipeline parallel (parallelism.pipeline_parallel_degree > 1: each rank runs a "
                "different stage (MPMD), which one SPMD process cannot simulate)"
            )
        if parallel_dims.cp_enabled:
            refused.append("context parallel (parallelism.context_parallel_degree > 1)")
        if refused:
            raise ParallelismError(
                f"COMM_MODE={self.name} cannot run " + "; ".join(refused)
                + ": turn that off, or run it for real with torchrun"
            )
        threads = real_rank_threads(self.world_size)
        if threads is not None:
            torch.set_num_threads(threads)
            logger.info(
                f"COMM_MODE={self.name}: {threads} CPU thread(s), what each of the "
                f"{self.world_size} real ranks gets from run_train.sh (OMP_NUM_THREADS overrides)"
            )
        self._initial_load = take_initial_load(job_config, self.name)
        prepare_dry_run(
            job_config, f"COMM_MODE={self.name}",
            "the simulation runs eager kernels, writes nothing and profiles nothing",
        )

    def init_process_group(self, job_config: JobConfig, device_type: str) -> None:
        init_fake_process_group(self.world_size, self.rank)
        logger.info(
            f"COMM_MODE={self.name}: one process simulating all {self.world_size} ranks on a fake "
            "process group"
        )

    def check_state_memory(self, model_parts, job_config, device_type, param_itemsize) -> None:
        """Done by :meth:`check_memory`, for every simulated rank and the whole step."""

    def check_memory(self, estimate: Callable[[], Any]) -> None:
        """This process holds every simulated rank's tensors: estimate the total (one rank's
        fake-tensor estimate x ranks) and refuse in one line when it exceeds what is free."""
        from torchtitan.tools.device import device_type

        try:
            with _quiet_logs():
                per_rank = estimate().peak_bytes
        except (ValueError, RuntimeError, NotImplementedError) as err:
            logger.warning(f"COMM_MODE={self.name}: no memory estimate ({err}); going on")
            return
        total = per_rank * self.world_size * HEADROOM + PROCESS_BYTES
        free = available_memory_bytes(device_type)
        what = (
            f"about {total / GiB:.2f} GiB ({self.world_size} simulated ranks x "
            f"{per_rank / GiB:.2f} GiB estimated, +{HEADROOM - 1:.0%} headroom and "
            f"{PROCESS_BYTES / GiB:.0f} GiB for the process)"
        )
        if free is not None and total > free:
            raise ParallelismError(
                f"COMM_MODE={self.name} needs {what} but this machine has {free / GiB:.1f} GiB "
                "free: simulate fewer ranks (NGPU), lower training.local_batch_size or seq_len, "
                "or check the layout with COMM_MODE=fake_backend"
            )
        room = "" if free is None else f" of {free / GiB:.1f} GiB free"
        logger.info(f"COMM_MODE={self.name}: memory {what}{room}; time grows with the ranks too")

    def build_dataloader(self, build_for_dp_rank, parallel_dims, local_batch_size, seq_len, vocab_size):
        """One loader per data-parallel rank, combined into per-rank LocalTensor batches."""
        rank_to_dp = {r: _dp_rank_of(parallel_dims, r) for r in range(self.world_size)}
        loaders = {d: build_for_dp_rank(d) for d in sorted(set(rank_to_dp.values()))}
        return LocalTensorBatches(loaders, rank_to_dp)

    @contextlib.contextmanager
    def model_build(self) -> Iterator[None]:
        """Enter LocalTensorMode for the rest of the run (steps run under it too); data
        parallel becomes gather-on-use DTensor parameters while the model is built."""
        from torch.distributed._local_tensor import LocalTensorMode

        evict_dead_mesh_coordinates()
        self._stack.enter_context(LocalTensorMode(self.world_size))
        with data_parallel_override(_local_data_parallel):
            yield

    def init_weights(self) -> contextlib.AbstractContextManager:
        return params_as_stored()

    def load_initial_weights(self, model_parts: list[nn.Module]) -> bool:
        """checkpoint.initial_load_path's weights into every simulated rank's shards."""
        if self._initial_load is None:
            return False
        load_initial_weights(self._initial_load, model_parts, self.name, params_as_stored)
        return True

    def close(self) -> None:
        self._stack.close()
