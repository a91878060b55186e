"""Pipeline hook for the Llama family (``ModelSpec.pipelining_fn``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import uses_op_sac
from torchtitan.distributed.compile import model_compile_enabled
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


def pipeline_llama(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    model_args: Any,
    parallelize_fn: Callable[[nn.Module, ParallelDims, JobConfig], nn.Module] | None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Pipeline:
    """Cut a meta-device Llama into this pp rank's stages, parallelize each, build the schedule.

    Returns the :class:`Pipeline`; its ``model_parts`` are still on ``meta``: the caller
    materialises each (``to_empty`` + ``init_weights``) before the first step. ``loss_fn`` is
    the summed token loss; the pipeline applies each step's normalisation itself.
    """
    cfg = job_config.parallelism
    pp_mesh = parallel_dims.get_mesh("pp")
    if pp_mesh is None:
        raise ValueError("pipeline_llama needs parallelism.pipeline_parallel_degree > 1")
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
