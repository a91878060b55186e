"""Apply TP -> AC -> compile -> FSDP/HSDP (or DDP) to a Llama model.

Everything here works on a ``meta``-device model; the trainer then calls
``model.to_empty(device=...)`` and ``model.init_weights(buffer_device=...)``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from torchtitan.components.float8 import float8_tensorwise_tp
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac, apply_memory_budget
from torchtitan.distributed.compile import apply_compile, model_compile_enabled
from torchtitan.distributed.expert_parallel import (
    apply_expert_parallel,
    apply_moe_sequence_sum,
    apply_moe_tp_boundary,
)
from torchtitan.distributed.fsdp import apply_data_parallel, to_torch_dtype
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import apply_tp, maybe_enable_async_tp
from torchtitan.tools import device as device_tools
from torchtitan.tools.logging import logger


def parallelize_llama(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    apply_tp_fn: Callable[..., nn.Module] = apply_tp,
) -> nn.Module:
    """Parallelize ``model`` in place per ``parallel_dims`` and ``job_config``; returns it.

    Order: tensor parallel (+ async TP), expert parallel / expert TP (MoE layers), activation
    checkpointing, per-block compile, then
    FSDP/HSDP when dp_shard or cp > 1, else DDP when dp_replicate > 1. Families with other
    block layouts pass their own ``apply_tp_fn(model, tp_mesh, loss_parallel=...)``.
    """
    par = job_config.parallelism
    compile_model = model_compile_enabled(job_config.compile)
    mesh = parallel_dims.world_mesh
    device_type = mesh.device_type if mesh is not None else device_tools.device_type

    # Head counts and seq_len divisibility were checked by ParallelDims.validate_for_model.
    tp_mesh = parallel_dims.get_mesh("tp")
    # before any model surgery, so a bad async-TP config fails fast
    maybe_enable_async_tp(par.enable_async_tensor_parallel, compile_model, tp_mesh, device_type)
    if parallel_dims.tp_enabled:
        loss_parallel = not par.disable_loss_parallel
        if apply_tp_fn is apply_tp:  # the float8 converter's flag: float8 all-gather in TP
            float8_tp = float8_tensorwise_tp(job_config)
            apply_tp(model, tp_mesh, loss_parallel, enable_float8_tensorwise_tp=float8_tp)
        else:  # other families' plans: float8 layers all-gather in high precision
            apply_tp_fn(model, tp_mesh, loss_parallel=loss_parallel)
    if parallel_dims.tp_enabled:  # MoE layers, if any
        apply_moe_tp_boundary(model, parallel_dims)
    if parallel_dims.ep_enabled or parallel_dims.tp_enabled:
        apply_expert_parallel(model, parallel_dims)
    apply_moe_sequence_sum(model, parallel_dims)  # MoE auxiliary loss over sequence shards

    apply_ac(model, job_config.activation_checkpoint)
    apply_memory_budget(job_config.activation_checkpoint, job_config.job.dump_folder)

    if compile_model:
        apply_compile(model, job_config.compile)

    training = job_config.training
    if training.enable_cpu_offload and not parallel_dims.fsdp_enabled:
        logger.warning(
            "training.enable_cpu_offload only works with FSDP (parallelism.data_parallel_shard_degree "
            "> 1); ignoring it"
        )
    apply_data_parallel(
        model,
        parallel_dims,
        param_dtype=to_torch_dtype(
            training.mixed_precision_param, "training.mixed_precision_param"
        ),
        reduce_dtype=to_torch_dtype(
            training.mixed_precision_reduce, "training.mixed_precision_reduce"
        ),
        cpu_offload=training.enable_cpu_offload and parallel_dims.fsdp_enabled,
        reshard_after_forward_policy=par.fsdp_reshard_after_forward,
        enable_compile=compile_model,
        enable_compiled_autograd=par.enable_compiled_autograd,
    )
    return model
