"""Apply TP -> AC -> compile -> FSDP/HSDP (or DDP) to a Qwen3 model (dense or MoE).

The same composition as the Llama family (torchtitan/models/llama3/parallelize.py), with a Qwen3
tensor-parallel plan:

* attention: ``wq/wk/wv`` column-wise (heads sharded), ``wo`` row-wise; the QK-norms run on the
  local heads with their weight replicated (``SequenceParallel`` over the head dimension), so
  their gradient is summed over the TP ranks and the result equals one device;
* dense feed-forward: ``w1/w3`` column-wise, ``w2`` row-wise, as in Llama;
* MoE feed-forward: not in this plan. torchtitan/distributed/expert_parallel.py, applied after
  it, either lets each TP rank route and run its own sequence shard (experts whole, or spread
  over an ep group that includes the TP ranks) or, with
  ``parallelism.expert_tensor_parallel_degree`` = tp, gathers the sequence and splits every
  expert's hidden dims over the TP ranks.

Everything here works on a ``meta``-device model.
"""

from __future__ import annotations

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
from torchtitan.distributed.tensor_parallel import apply_non_block_tp
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.tools.logging import logger


def qwen3_block_tp_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """TP plan of one Qwen3 block (sequence-parallel norms between the sublayers)."""
    plan: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        # [B, S, local heads, head_dim]: the heads (dim 2) are what the TP ranks split.
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if getattr(block, "moe", None) is None:
        plan.update({
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return plan


def check_qwen3_tp(model: nn.Module, tp: int) -> None:
    """One line when the dense feed-forward width is not divisible by the TP degree (heads
    are checked by ``ParallelDims.validate_for_model``; expert hidden dims by
    ``build.check_expert_parallel``)."""
    args = model.model_args
    has_dense = any(
        getattr(b, "feed_forward", None) is not None for b in model.layers.values()
    )
    if has_dense and args.hidden_dim % tp:
        raise ParallelismError(
            f"parallelism.tensor_parallel_degree={tp} must divide the model's feed-forward "
            f"hidden_dim={args.hidden_dim} (w1/w3 are split column-wise)"
        )


def apply_qwen3_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool = True) -> nn.Module:
    """Apply the Qwen3 TP/SP plans (works on a meta-device model and on pipeline parts)."""
    apply_non_block_tp(model, tp_mesh, loss_parallel)
    n_moe = 0
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, qwen3_block_tp_plan(block))
        n_moe += getattr(block, "moe", None) is not None
    logger.info(
        f"Applied tensor parallel to Qwen3 (degree {tp_mesh.size()}, sequence parallel, loss "
        f"parallel {'on' if loss_parallel else 'off'}"
        + (f"; {n_moe} MoE layer(s): see expert parallel)" if n_moe else ")")
    )
    return model


def parallelize_qwen3(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Parallelize ``model`` in place: the Llama composition (async TP check, TP, AC, per-block
    compile, FSDP/HSDP or DDP) with :func:`apply_qwen3_tp` as its tensor-parallel step."""
    if parallel_dims.tp_enabled:
        check_qwen3_tp(model, parallel_dims.tp)
    return parallelize_llama(model, parallel_dims, job_config, apply_tp_fn=apply_qwen3_tp)
