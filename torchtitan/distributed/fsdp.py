"""Data parallelism: FSDP2 / HSDP via ``fully_shard``; DDP via ``replicate`` (FSDP2's with TP/PP).

Gradients are *averaged* over the data-parallel ranks by both FSDP2 and DDP (the usual
semantics): a loss that is a per-rank mean over equally many tokens gives the gradient of the
global-batch mean. ``apply_fsdp(..., gradient_divide_factor=1.0)`` turns the division off for a
training loop that normalises by the global token count itself.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.utils import embeddings_tied
from torchtitan.tools.logging import logger

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

ReshardPolicy = Literal["default", "always", "never"]


def to_torch_dtype(name: str, key: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ``key`` names the config field in the error."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"{key}={name!r} is not a known dtype; use one of {sorted(TORCH_DTYPES)}"
        ) from None


def resolve_reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    """Map ``parallelism.fsdp_reshard_after_forward`` to a bool (default: not under PP)."""
    if policy == "always":
        return True
    if policy == "never":
        return False
    if policy == "default":
        # Under PP each microbatch runs forward then backward on the stage; keeping the
        # gathered parameters avoids an all-gather per microbatch.
        return not pp_enabled
    raise ValueError(
        f"parallelism.fsdp_reshard_after_forward={policy!r} is invalid; "
        "use 'default', 'always' or 'never'"
    )


def get_fsdp_mesh(parallel_dims: ParallelDims) -> DeviceMesh | None:
    """The mesh FSDP shards over: 1-D ``dp_shard_cp`` or, for HSDP, 2-D
    ``(dp_replicate, dp_shard_cp)``; None when FSDP is off (or there is no mesh)."""
    if not parallel_dims.fsdp_enabled:
        return None
    shard_mesh = parallel_dims.get_mesh("dp_shard_cp")
    if not parallel_dims.dp_replicate_enabled:
        return shard_mesh
    world_mesh = parallel_dims.world_mesh
    assert world_mesh is not None
    if parallel_dims.dp_shard_enabled and parallel_dims.cp_enabled:
        # "dp_shard_cp" is a flattened dim; slicing it from the root warns in torch >= 2.11
        # but is the only way to get the 2-D HSDP mesh that shares its process groups.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flattened dim.*")
            return world_mesh["dp_replicate", "dp_shard_cp"]
    inner = "dp_shard" if parallel_dims.dp_shard_enabled else "cp"
    return world_mesh["dp_replicate", inner]


def get_expert_fsdp_mesh(parallel_dims: ParallelDims) -> DeviceMesh | None:
    """The mesh expert-parallel experts are FSDP-sharded over: ``dp_shard_mod_ep`` (the
    ranks of ``dp_shard x cp`` outside the ep group) or, with ``dp_replicate > 1``, 2-D HSDP
    ``(dp_replicate, dp_shard_mod_ep)``. With the ep all-to-all this reduces expert gradients
    over every rank that holds different tokens. None without expert parallel."""
    shard = parallel_dims.get_mesh("dp_shard_mod_ep")
    if shard is None or not parallel_dims.dp_replicate_enabled:
        return shard
    replicate = parallel_dims.get_mesh("dp_replicate")
    return DeviceMesh._concatenate([replicate, shard])


def _mesh_desc(mesh: DeviceMesh) -> dict[str, int]:
    return dict(zip(mesh.mesh_dim_names or (), mesh.shape))


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    return getattr(model, name, None)


def _units(model: nn.Module) -> tuple[nn.Module | None, list[nn.Module], Any]:
    """The data-parallel units below the root, shared by FSDP and replicate:
    ``(tok_embeddings, blocks, norm + output)``. Embeddings and tail are None when missing
    (pipeline stages) or tied (one weight cannot belong to two units: the root takes it);
    the tail is one module or the ``[norm, output]`` pair."""
    tied = embeddings_tied(model)
    emb = _submodule(model, "tok_embeddings")
    layers = _submodule(model, "layers")
    blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers or [])
    tail = [m for m in (_submodule(model, "norm"), _submodule(model, "output")) if m is not None]
    return (
        None if tied else emb,
        blocks,
        None if tied or not tail else (tail if len(tail) > 1 else tail[0]),
    )


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    pp_enabled: bool = False,
    cpu_offload: bool = False,
    reshard_after_forward_policy: ReshardPolicy = "default",
    gradient_divide_factor: float | None = None,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 (HSDP when ``dp_mesh`` is 2-D ``(replicate, shard)``).

    Units: each block of ``model.layers``, ``tok_embeddings``, ``[norm, output]`` together, then
    the root (which picks up anything left, e.g. tied embeddings). Any of the named parts may be
    missing or None (pipeline stages). Under the ``default`` policy the last block and
    ``norm``+``output`` keep their parameters after forward: backward needs them first.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload: OffloadPolicy = OffloadPolicy()
    if cpu_offload:
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    config = {"mesh": dp_mesh, "mp_policy": mp_policy, "offload_policy": offload}
    reshard = resolve_reshard_after_forward(reshard_after_forward_policy, pp_enabled)
    # Only "default" applies the keep-the-last-units optimisation; "always" means always.
    keep_last = reshard_after_forward_policy == "default"

    emb, blocks, tail = _units(model)
    if emb is not None:
        fully_shard(emb, reshard_after_forward=reshard, **config)

    if expert_mesh is not None:  # expert parallel: experts are their own units on their mesh
        from torchtitan.distributed.expert_parallel import expert_fsdp_units

        for experts in expert_fsdp_units(model):
            fully_shard(experts, reshard_after_forward=reshard, **{**config, "mesh": expert_mesh})
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard and not (keep_last and last), **config)

    if tail is not None:
        fully_shard(tail, reshard_after_forward=reshard and not keep_last, **config)

    fully_shard(model, reshard_after_forward=reshard, **config)
    if dp_mesh.device_type == "cpu":
        gather_float8_as_bytes(model)

    if gradient_divide_factor is not None:
        set_gradient_divide_factor(model, gradient_divide_factor)
    kind = "HSDP" if dp_mesh.ndim == 2 else "FSDP"
    logger.info(
        f"Applied {kind} to the model (mesh {_mesh_desc(dp_mesh)}, "
        f"param {param_dtype}, reduce {reduce_dtype}, reshard_after_forward={reshard}"
        f"{', CPU offload' if cpu_offload else ''}"
        + (f"; experts on {_mesh_desc(expert_mesh)}" if expert_mesh is not None else "")
        + ")"
    )
    return model


def gather_float8_as_bytes(model: nn.Module) -> bool:
    """gloo has no float8 dtypes: when ``model`` holds weights that FSDP all-gathers in float8
    (torchao's float8 all-gather), make every FSDP unit send float8 buffers as bytes (the same
    bits). Returns whether it did."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    float8 = (torch.float8_e4m3fn, torch.float8_e5m2)

    class Float8AsBytesAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if output_tensor.dtype in float8:
                output_tensor = output_tensor.view(torch.uint8)
                input_tensor = input_tensor.view(torch.uint8)
            return super().__call__(output_tensor, input_tensor, group, async_op)

    if not any(
        hasattr(getattr(p, "_local_tensor", p), "fsdp_pre_all_gather") for p in model.parameters()
    ):
        return False
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(Float8AsBytesAllGather())
    return True


def set_gradient_divide_factor(model: nn.Module, factor: float) -> None:
    """Make every FSDP unit of ``model`` divide reduced gradients by ``factor`` (1.0: sum).

    Uses sum-only collectives plus a post-scale (gloo has no ``PREMUL_SUM``; NCCL's zero-copy
    path wants sums too).
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(factor)
            module.set_force_sum_reduction_for_comms(True)


def apply_ddp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    enable_compile: bool = False,
    enable_compiled_autograd: bool = False,
    bucket_cap_mb: int = 100,
) -> nn.Module:
    """Replicate ``model`` over ``dp_mesh`` with DDP (``replicate``); gradients are averaged.

    Works on a meta-device model: DDP initialises lazily at the first forward, broadcasting
    rank 0's (materialised) parameters and buffers.
    """
    from torch.distributed._composable.replicate import replicate

    if enable_compile:
        torch._dynamo.config.optimize_ddp = (
            "python_reducer_without_compiled_forward"
            if enable_compiled_autograd
            else "ddp_optimizer"
        )
    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=bucket_cap_mb)
    logger.info(f"Applied DDP to the model (dp_replicate={dp_mesh.size()})")
    return model


def apply_replicate(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Replicate ``model`` over the 1-D ``dp_mesh`` with FSDP2's replicate: DDP semantics
    (whole parameters on every rank, gradients all-reduced and averaged) built on FSDP2's
    machinery, so it composes with tensor-parallel DTensor parameters and with pipeline
    schedules (several microbatch backwards per step), which classic DDP's reducer does not.

    Units as in :func:`apply_fsdp`: ``tok_embeddings``, each block, ``[norm, output]``, root;
    each unit all-reduces its gradients as soon as its backward is done.
    """
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError:
        replicate = None
    if replicate is None or "mesh" not in inspect.signature(replicate).parameters:
        raise ValueError(
            f"DDP with tensor or pipeline parallelism needs FSDP2's replicate, which torch "
            f"{torch.__version__} lacks; set parallelism.data_parallel_shard_degree > 1 (FSDP/HSDP)"
        )

    emb, blocks, tail = _units(model)
    for unit in [emb, *blocks, tail, model]:
        if unit is not None:
            replicate(unit, mesh=dp_mesh)
    logger.info(f"Applied DDP (FSDP2 replicate) to the model (dp_replicate={dp_mesh.size()})")
    return model


_override: Callable[..., nn.Module] | None = None


@contextlib.contextmanager
def data_parallel_override(apply: Callable[..., nn.Module]) -> Iterator[None]:
    """Within this context :func:`apply_data_parallel` calls ``apply(model, parallel_dims,
    param_dtype=..., reduce_dtype=..., cpu_offload=...)`` instead of FSDP/DDP."""
    global _override
    previous, _override = _override, apply
    try:
        yield
    finally:
        _override = previous


def apply_data_parallel(
    model: nn.Module,
    parallel_dims: ParallelDims,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool = False,
    reshard_after_forward_policy: ReshardPolicy = "default",
    enable_compile: bool = False,
    enable_compiled_autograd: bool = False,
) -> nn.Module:
    """FSDP/HSDP when dp_shard or cp > 1, else DDP when dp_replicate > 1 (FSDP2's replicate
    under TP or PP, classic DDP otherwise), else nothing.

    Inside :func:`data_parallel_override` the given function is applied instead (e.g.
    gather-on-use DTensor parameters under LocalTensorMode, where ``fully_shard`` cannot run).
    """
    if _override is not None:
        return _override(
            model, parallel_dims, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
            cpu_offload=cpu_offload,
        )
    fsdp_mesh = get_fsdp_mesh(parallel_dims)
    if fsdp_mesh is not None:
        return apply_fsdp(
            model,
            fsdp_mesh,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=cpu_offload,
            reshard_after_forward_policy=reshard_after_forward_policy,
            expert_mesh=get_expert_fsdp_mesh(parallel_dims),
        )
    if reshard_after_forward_policy != "default":
        logger.info(
            f"parallelism.fsdp_reshard_after_forward={reshard_after_forward_policy} has no "
            "effect without FSDP (data_parallel_shard_degree x context_parallel_degree = 1)"
        )
    if parallel_dims.dp_replicate_enabled:
        if cpu_offload:
            raise ValueError(
                "training.enable_cpu_offload needs FSDP (parallelism.data_parallel_shard_degree "
                "> 1); DDP cannot offload"
            )
        mesh = parallel_dims.get_mesh("dp_replicate")
        assert mesh is not None
        if parallel_dims.tp_enabled or parallel_dims.pp_enabled:
            return apply_replicate(model, mesh)
        return apply_ddp(model, mesh, enable_compile, enable_compiled_autograd)
    return model
