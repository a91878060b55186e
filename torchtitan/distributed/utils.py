"""Process-group setup, seeding/determinism, cross-mesh reductions and grad-norm clipping."""

from __future__ import annotations

import datetime
import math
import os
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import Comm, Debug
from torchtitan.tools.logging import logger


def env_int(name: str, default: int) -> int:
    """The integer environment variable ``name`` (``default`` when unset); a ValueError naming
    it otherwise (``int()``'s own message does not say which variable)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be an integer") from None


def world_size_from_env() -> int:
    """``WORLD_SIZE`` (1 when unset); a ValueError naming it when it is not a positive integer."""
    world_size = env_int("WORLD_SIZE", 1)
    if world_size < 1:
        raise ValueError(
            f"WORLD_SIZE={world_size} must be >= 1 (the number of ranks; torchrun sets it): "
            "unset it for one process"
        )
    return world_size


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init_distributed(comm: Comm, device_type: str) -> None:
    """Initialise the default process group (nccl on CUDA, gloo on CPU) with ``comm`` timeouts.

    Call :func:`torchtitan.tools.flight_recorder.configure_env` first (Flight Recorder size).
    """
    if dist.is_initialized():
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:  # torch's own error names env:// rendezvous, not the launch that was meant
        raise ValueError(
            f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} asks for several ranks, but "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: launch "
            "them with ./run_train.sh (NGPU=N) or torchrun, which set them, or unset "
            "WORLD_SIZE for one process"
        )
    backend = backend_for(device_type)
    if device_type == "cuda":
        backend = "cuda:nccl,cpu:gloo"  # gloo for CPU-side work such as async checkpoint staging
    dist.init_process_group(
        backend=backend, timeout=datetime.timedelta(seconds=comm.init_timeout_seconds)
    )


def set_pg_timeouts(timeout_seconds: int, world_mesh: DeviceMesh | None) -> None:
    """Shorten collective timeouts after the first step (first-step compiles can be slow)."""
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return
    timeout = datetime.timedelta(seconds=timeout_seconds)
    # A barrier first so no rank changes its timeout while another is still in a collective.
    dist.barrier()
    groups = [dist.distributed_c10d._get_default_group()]
    if world_mesh is not None:
        groups += [world_mesh.get_group(i) for i in range(world_mesh.ndim)]
    for group in groups:
        try:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
        except (RuntimeError, AttributeError, ValueError) as err:  # not every backend supports it
            logger.debug(f"could not set timeout of a process group: {err}")
            return


def shutdown_distributed() -> None:
    """Tear the process group down cleanly (avoids gloo's abort at interpreter exit)."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def hard_exit(code: int = 0) -> None:
    """Flush and leave without running interpreter finalizers (gloo threads can abort there)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


DEFAULT_DETERMINISTIC_SEED = 42
"""Seed of ``debug.deterministic`` runs that set no ``debug.seed``."""


def set_determinism(
    world_mesh: DeviceMesh | None,
    device: torch.device,
    cfg: Debug,
    distinct_seed_mesh_dims: Iterable[str] = ("pp",),
) -> int:
    """Seed every RNG and optionally force deterministic kernels; returns this rank's seed.

    Ranks share one seed, except that each coordinate along ``distinct_seed_mesh_dims`` (the pp
    stage by default) adds its index, so different pipeline stages initialise differently.
    Without ``debug.seed`` a deterministic run uses :data:`DEFAULT_DETERMINISTIC_SEED` (so two
    such runs are identical) and any other run a fresh random seed; the seed is always logged.
    ``deterministic_warn_only`` alone implies deterministic mode.
    """
    deterministic = cfg.deterministic or cfg.deterministic_warn_only
    if deterministic:
        if not cfg.deterministic:
            logger.info("debug.deterministic_warn_only implies debug.deterministic: turning it on")
        logger.info(
            "Deterministic algorithms are on (slower, bitwise reproducible)"
            + (", warning only for ops without one" if cfg.deterministic_warn_only else "")
        )
        torch.use_deterministic_algorithms(True, warn_only=cfg.deterministic_warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    seed = cfg.seed
    source = "debug.seed"
    if seed is None and deterministic:
        seed, source = DEFAULT_DETERMINISTIC_SEED, "the default seed of deterministic runs"
    elif seed is None:
        # A fresh random seed, agreed by all ranks so replicated state stays identical.
        seed_tensor = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        if dist.is_initialized():
            dist.broadcast(seed_tensor, src=0)
        seed = int(seed_tensor.item())
        source = f"random, as debug.seed is unset; --debug.seed {seed} repeats this run"
    offset, stride = 0, 1
    if world_mesh is not None and world_mesh.mesh_dim_names:
        for name in reversed(world_mesh.mesh_dim_names):
            if name in distinct_seed_mesh_dims:
                offset += world_mesh.get_local_rank(name) * stride
                stride *= world_mesh.size(world_mesh.mesh_dim_names.index(name))
    rank_seed = (seed + offset) % 2**63
    torch.manual_seed(rank_seed)
    if not dist.is_initialized() or dist.get_rank() == 0:
        per_stage = "; each pipeline stage adds its index" if stride > 1 else ""
        logger.info(f"Seed {seed} ({source}){per_stage}")
    if world_mesh is not None and world_mesh.device_type != "cpu":
        # DTensor's RNG tracker only matters for random ops on sharded tensors on accelerators.
        from torch.distributed.tensor._random import manual_seed as dtensor_manual_seed

        spmd_names = [n for n in world_mesh.mesh_dim_names if n not in distinct_seed_mesh_dims]
        if spmd_names:
            dtensor_manual_seed(rank_seed, world_mesh[tuple(spmd_names)])
    return rank_seed


def all_reduce_scalar(
    value: torch.Tensor | float, op: str, mesh: DeviceMesh | None
) -> torch.Tensor | float:
    """``value`` reduced across ``mesh`` (sum / mean / max) as a 0-dim float64 tensor, without
    a host copy: on the mesh's device (``value``'s own without a mesh). NaN (a float) for a fake
    tensor. The result never aliases ``value``."""
    if _is_fake(value):  # shapes only (COMM_MODE=fake_backend, memory estimation)
        return math.nan
    if mesh is None:
        t = torch.as_tensor(value, dtype=torch.float64).detach()
        return t.clone() if isinstance(value, torch.Tensor) and value.dtype == torch.float64 else t
    value = _per_simulated_rank(value)
    if isinstance(value, DTensor):
        t = value.full_tensor().double()
    else:
        t = torch.as_tensor(value, dtype=torch.float64).detach().clone()
    t = t.to("cuda" if mesh.device_type == "cuda" else "cpu")
    reduce_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    dist.all_reduce(t, op=reduce_op, group=mesh.get_group())
    if op == "mean":
        t /= mesh.size()
    return t


def dist_reduce(value: torch.Tensor | float, op: str, mesh: DeviceMesh | None) -> float:
    """Reduce a scalar across ``mesh`` (sum / mean / max); identity without a mesh. A Python
    float: a host copy (:func:`all_reduce_scalar` keeps it on the device)."""
    return scalar_value(all_reduce_scalar(value, op, mesh))


def scalar_value(value: torch.Tensor | float) -> float:
    """A Python float of a scalar tensor (DTensors in full); NaN for a fake tensor."""
    if _is_fake(value):
        return math.nan
    if isinstance(value, DTensor):
        value = value.full_tensor()
    same = _same_on_every_simulated_rank(value)
    return float(value) if same is None else same


def _same_on_every_simulated_rank(value: object) -> float | None:
    """A LocalTensor's value when every simulated rank holds the same one (NaN included:
    LocalTensor's own ``float()`` compares the ranks' values, and NaN equals nothing); None
    for anything else."""
    per_rank = getattr(value, "_local_tensors", None)
    if not isinstance(per_rank, dict) or not per_rank:
        return None
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    with maybe_disable_local_tensor_mode():
        values = {repr(float(t)) for t in per_rank.values()}  # repr: nan == nan
    return float(values.pop()) if len(values) == 1 else None


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite (a DTensor's: this rank's shard)."""
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
    per_rank = getattr(local, "_local_tensors", None)  # COMM_MODE=local_tensor: every rank's
    if isinstance(per_rank, dict):
        from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

        with maybe_disable_local_tensor_mode():
            return all(bool(torch.isfinite(x).all()) for x in per_rank.values())
    return bool(torch.isfinite(local).all())


def scalar_values(values: Sequence[torch.Tensor | float]) -> list[float]:
    """:func:`scalar_value` of each; plain tensors on one device are copied to the host together
    (one transfer, exact: float64 holds every float32 and bfloat16 value)."""
    if len(values) > 1 and all(type(v) is torch.Tensor for v in values):
        if len({v.device for v in values}) == 1:
            return torch.stack([v.detach().double() for v in values]).tolist()
    return [scalar_value(v) for v in values]


def host_collective_device(device: torch.device) -> torch.device:
    """Where a small collective of the default process group (e.g. agreeing on a flag) runs
    without waiting for ``device``'s queue: the CPU when the group has a CPU backend (gloo next
    to nccl on CUDA runs), else ``device``."""
    if device.type == "cpu" or not dist.is_initialized():
        return device
    try:
        config = str(dist.get_backend_config())
    except (RuntimeError, ValueError, AttributeError):
        return device
    return torch.device("cpu") if "cpu:" in config else device


def _is_fake(value: object) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, DTensor):
        value = value._local_tensor
    return isinstance(value, FakeTensor)


def _per_simulated_rank(value: object) -> object:
    """Under LocalTensorMode (ranks simulated in one process), ``value`` as a LocalTensor so
    the collective combines the simulated ranks: a number or plain tensor is the same on every
    rank, a per-rank SymInt keeps its per-rank values. Unchanged otherwise."""
    from torch.distributed._local_tensor import (
        LocalIntNode,
        LocalTensor,
        local_tensor_mode,
        maybe_disable_local_tensor_mode,
    )

    mode = local_tensor_mode()
    if mode is None or isinstance(value, (LocalTensor, DTensor)):
        return value
    ranks = sorted(mode.ranks)
    with maybe_disable_local_tensor_mode():
        if isinstance(value, torch.SymInt) and isinstance(value.node, LocalIntNode):
            ints = value.node._local_ints
            return LocalTensor({r: torch.tensor(float(ints[r]), dtype=torch.float64) for r in ranks})
        t = torch.as_tensor(value, dtype=torch.float64).detach()
        return LocalTensor({r: t.clone() for r in ranks})


_LOW_PRECISION = (torch.bfloat16, torch.float16)


@torch.no_grad()
def total_norm(
    tensors_by_mesh: dict[object, list[torch.Tensor]],
    norm_type: float = 2.0,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """The ``norm_type`` norm of all ``tensors_by_mesh`` together (gradients, or norms of
    gradients: the norm of norms is the same), each list reduced over its device mesh (key;
    None for plain tensors) and the total over ``pp_mesh``. A plain float32 scalar tensor."""
    norms = []
    for tensors in tensors_by_mesh.values():
        # bf16 / fp16 plain tensors (weight copies' gradients): float32 accumulation, which
        # torch's get_total_norm does not do for them
        low = [t for t in tensors if type(t) is torch.Tensor and t.dtype in _LOW_PRECISION]
        if low:
            tensors = [t for t in tensors if not (type(t) is torch.Tensor
                                                  and t.dtype in _LOW_PRECISION)]
            per_tensor = torch._foreach_norm(low, norm_type, dtype=torch.float32)
            norms.append(torch.linalg.vector_norm(torch.stack(per_tensor), norm_type))
            if not tensors:
                continue
        n = torch.nn.utils.get_total_norm(tensors, norm_type, False, foreach)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        norms.append(n.float())
    if not norms:  # e.g. a stage holding only a tied output copy
        total = torch.tensor(0.0, device=pp_mesh.device_type if pp_mesh is not None else None)
    elif math.isinf(norm_type):
        total = torch.stack(norms).max()
    else:
        total = torch.stack(norms).pow(norm_type).sum()
    if pp_mesh is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
        else:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
    if not math.isinf(norm_type):
        total = total.pow(1.0 / norm_type)
    return total


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
    exclude_from_norm: Iterable[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """Total gradient norm across every mesh the gradients live on; clips when max_norm > 0.

    Gradients may be DTensors on different meshes (FSDP, TP, FSDP x TP) or plain tensors; the
    norm of each group is reduced over its mesh, and over ``pp_mesh`` when stages hold
    different parameters. ``exclude_from_norm``: copies of a parameter counted elsewhere (tied
    embeddings split by the pipeline), clipped but not counted. Returns the pre-clip norm (a
    plain tensor).
    """
    params = [p for p in parameters if p.grad is not None]
    excluded = {id(p) for p in exclude_from_norm}
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if id(p) not in excluded:
            groups[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p.grad)
    total = total_norm(groups, norm_type, foreach, pp_mesh)
    if max_norm > 0 and params:
        # One call per mesh: foreach kernels cannot mix DTensors of different meshes and plain
        # tensors (e.g. TP-sharded attention next to MoE layers that TP leaves whole).
        by_mesh: dict[object, list[torch.nn.Parameter]] = defaultdict(list)
        for p in params:
            by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)
    return total


def clip_divisor(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What gradients are divided by to clip them to ``max_norm`` given their norm ``total``:
    the reciprocal of torch's clip coefficient ``min(max_norm / (total + 1e-6), 1)`` (exactly
    1 when nothing is clipped), as a 0-dim float32 tensor."""
    coef = (max_norm / (total.float() + 1e-6)).clamp(max=1.0)
    return 1.0 / coef


def embeddings_tied(model: torch.nn.Module) -> bool:
    """``model`` (or a pipeline stage of it) holds both ``tok_embeddings`` and ``output`` and
    they share one weight."""
    emb, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    weight = getattr(emb, "weight", None)
    return weight is not None and out is not None and weight is getattr(out, "weight", None)
