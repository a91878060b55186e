"""Apply TP -> EP -> AC -> compile -> FSDP/HSDP (or DDP) to a DeepSeek-V3 model: the Llama
family's composition (torchtitan/models/llama3/parallelize.py) with a DeepSeek-V3 TP plan.

Tensor parallel (sequence parallel between blocks, as for Llama): MLA shards heads (``wq`` or
``wq_b`` and ``wkv_b`` column-wise, ``wo`` row-wise); the latent projections ``wq_a``/``wkv_a``
and their norms run replicated on every TP rank: their gradients come out whole and equal on
each rank, since the column-wise layers all-reduce their input gradients and so does
:class:`SumGradientOverTP` for the rope key ``k_pe`` that all heads share; dense FFNs shard as
Llama's. MoE layers are left to torchtitan/distributed/expert_parallel.py (applied after this
plan): each TP rank runs its own sequence shard, or, with
``parallelism.expert_tensor_parallel_degree`` = tp, the gathered sequence with every expert's
hidden dims split over the TP ranks.

Everything here works on a ``meta``-device model; the trainer then calls
``model.to_empty(device=...)`` and ``model.init_weights(buffer_device=...)``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims, ParallelismError
from torchtitan.distributed.tensor_parallel import apply_non_block_tp, sum_gradient_over_tp
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.tools.logging import logger


class SumGradientOverTP(ParallelStyle):
    """Identity forward; backward all-reduces the input's gradient over the TP ranks (Megatron's
    "copy to the tensor-parallel region"), for a plain tensor that every rank feeds into its own
    heads: each rank's gradient is then only its heads' share."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre_hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]):
            return (sum_gradient_over_tp(inputs[0], device_mesh), *inputs[1:])

        module.register_forward_pre_hook(pre_hook)
        return module


def block_tp_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """TP plan of one DeepSeek-V3 block (MLA + dense FFN or MoE)."""
    attention = block.attention
    plan: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        # Local (plain) input: wkv_a / wq_a and their norms stay plain, replicated modules.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Replicate(), None),
            use_local_output=True,
        ),
        "attention.wkv_b": ColwiseParallel(),
        "attention.k_pe_shared": SumGradientOverTP(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    plan["attention.wq" if attention.q_lora_rank == 0 else "attention.wq_b"] = ColwiseParallel()
    if not block.moe_enabled:
        plan.update({
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return plan


def apply_tp_deepseekv3(
    model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool = True
) -> nn.Module:
    """Apply the TP/SP plans (parts that are None in a pipeline stage are skipped)."""
    apply_non_block_tp(model, tp_mesh, loss_parallel)
    for block in model.layers.values():
        if block is not None:
            parallelize_module(block, tp_mesh, block_tp_plan(block))
    logger.info(
        f"Applied tensor parallel to DeepSeek-V3 (degree {tp_mesh.size()}, MLA heads and dense "
        "FFNs sharded; MoE layers: see expert parallel)"
    )
    return model


def check_deepseekv3_tp(model: nn.Module, tp: int) -> None:
    """One line when the dense FFN width is not divisible by the TP degree (heads are checked
    by ``ParallelDims.validate_for_model``; expert hidden dims by
    ``build.check_expert_parallel``)."""
    args = model.model_args
    if args.n_dense_layers > 0 and args.inter_dim % tp:
        raise ParallelismError(
            f"parallelism.tensor_parallel_degree={tp} must divide the model's dense FFN "
            f"inter_dim={args.inter_dim} (w1/w3 are split column-wise)"
        )


def parallelize_deepseekv3(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Parallelize ``model`` in place: the shared composition (async TP check, TP, expert
    parallel, AC, per-block compile, FSDP/HSDP or DDP) with :func:`apply_tp_deepseekv3` as its
    tensor-parallel step."""
    if parallel_dims.tp_enabled:
        check_deepseekv3_tp(model, parallel_dims.tp)
    return parallelize_llama(model, parallel_dims, job_config, apply_tp_fn=apply_tp_deepseekv3)
