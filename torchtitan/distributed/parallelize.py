"""The parallelization every decoder family shares (``ModelSpec``'s default hooks).

:func:`parallelize_decoder`: TP -> EP -> AC -> compile -> FSDP/HSDP (or DDP), with the family's
tensor-parallel plan (a :class:`~torchtitan.distributed.tensor_parallel.TensorParallelPlan`).
:func:`pipeline_decoder`: cut the model into this pp rank's stages, parallelize each, build the
schedule. Everything here works on a ``meta``-device model; the trainer then calls
``model.to_empty(device=...)`` and ``model.init_weights(buffer_device=...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchtitan.components.float8 import float8_tensorwise_tp
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac, apply_memory_budget, uses_op_sac
from torchtitan.distributed.compile import apply_compile, model_compile_enabled
from torchtitan.distributed.expert_parallel import (
    apply_expert_parallel,
    apply_moe_sequence_sum,
    apply_moe_tp_boundary,
)
from torchtitan.distributed.fsdp import apply_data_parallel, to_torch_dtype
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline import (
    Pipeline,
    build_pipeline_stages,
    check_microbatches,
    check_split_backward_schedule,
    n_microbatches_for,
    pipeline_module_split,
    resolve_pipeline_layout,
)
from torchtitan.distributed.pipeline.tied_embeddings import TiedEmbeddings
from torchtitan.distributed.tensor_parallel import (
    DECODER_TP,
    TensorParallelPlan,
    apply_tp_plan,
    maybe_enable_async_tp,
)
from torchtitan.tools import device as device_tools
from torchtitan.tools.logging import logger

__all__ = ["parallelize_decoder", "pipeline_decoder"]


def parallelize_decoder(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    tp_plan: TensorParallelPlan = DECODER_TP,
) -> nn.Module:
    """Parallelize ``model`` in place per ``parallel_dims`` and ``job_config``; returns it.

    Order: the plan's TP checks, tensor parallel (+ async TP), expert parallel / expert TP (MoE
    layers), activation checkpointing, per-block compile, then FSDP/HSDP when dp_shard or
    cp > 1, else DDP when dp_replicate > 1. Float8 all-gathers in TP where the plan declares
    it can (``tp_plan.float8_tensorwise``) and the float8 converter scales tensorwise.
    """
    par = job_config.parallelism
    compile_model = model_compile_enabled(job_config.compile)
    mesh = parallel_dims.world_mesh
    device_type = mesh.device_type if mesh is not None else device_tools.device_type

    # Head counts and seq_len divisibility were checked by ParallelDims.validate_for_model.
    if parallel_dims.tp_enabled and tp_plan.check is not None:
        tp_plan.check(model, parallel_dims.tp)
    tp_mesh = parallel_dims.get_mesh("tp")
    # before any model surgery, so a bad async-TP config fails fast
    maybe_enable_async_tp(par.enable_async_tensor_parallel, compile_model, tp_mesh, device_type)
    if parallel_dims.tp_enabled:
        float8 = tp_plan.float8_tensorwise and float8_tensorwise_tp(job_config)
        apply_tp_plan(model, tp_mesh, tp_plan, not par.disable_loss_parallel, float8)
        apply_moe_tp_boundary(model, parallel_dims)  # MoE layers, if any
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


def pipeline_decoder(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    model_args: Any,
    parallelize_fn: Callable[[nn.Module, ParallelDims, JobConfig], nn.Module] | None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Pipeline:
    """Cut a meta-device decoder into this pp rank's stages, parallelize each, build the
    schedule (``ModelSpec.pipelining_fn``).

    Returns the :class:`Pipeline`; its ``model_parts`` are still on ``meta``: the caller
    materialises each (``to_empty`` + ``init_weights``) before the first step. ``loss_fn`` is
    the summed token loss; the pipeline applies each step's normalisation itself. Tied
    embeddings on different stages are kept equal (``TiedEmbeddings``).
    """
    cfg = job_config.parallelism
    pp_mesh = parallel_dims.get_mesh("pp")
    if pp_mesh is None:
        raise ValueError("pipeline_decoder needs parallelism.pipeline_parallel_degree > 1")
    layout = resolve_pipeline_layout(
        cfg, model, n_layers=model_args.n_layers, pp_rank=pp_mesh.get_local_rank()
    )
    n_microbatches = n_microbatches_for(cfg, job_config.training.local_batch_size)
    check_microbatches(layout, n_microbatches, cfg.pipeline_parallel_degree)
    check_split_backward_schedule(
        layout,
        model_compile_enabled(job_config.compile),
        uses_op_sac(job_config.activation_checkpoint),
    )
    parts = pipeline_module_split(model, layout)
    if parallelize_fn is not None:
        parts = [parallelize_fn(part, parallel_dims, job_config) for part in parts]
    stages = build_pipeline_stages(
        parts, layout.stage_ids, layout.num_stages, device, pp_mesh.get_group()
    )
    pipeline = Pipeline(layout, stages, n_microbatches, loss_fn, pp_mesh)
    if getattr(model_args, "tie_word_embeddings", False):
        pipeline.tied = TiedEmbeddings(layout, pipeline.model_parts, pp_mesh)
    return pipeline
