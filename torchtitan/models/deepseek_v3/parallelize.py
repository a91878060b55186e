"""DeepSeek-V3's tensor-parallel plan on the shared decoder composition.

Tensor parallel (sequence parallel between blocks, as for Llama): MLA shards heads (``wq`` or
``wq_b`` and ``wkv_b`` column-wise, ``wo`` row-wise); the latent projections ``wq_a``/``wkv_a``
and their norms run replicated on every TP rank: their gradients come out whole and equal on
each rank, since the column-wise layers all-reduce their input gradients and so does
:class:`SumGradientOverTP` for the rope key ``k_pe`` that all heads share; dense FFNs use the
shared plan. MoE layers are left to torchtitan/distributed/expert_parallel.py (applied after
this plan): each TP rank runs its own sequence shard, or, with
``parallelism.expert_tensor_parallel_degree`` = tp, the gathered sequence with every expert's
hidden dims split over the TP ranks.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import parallelize_decoder
from torchtitan.distributed.tensor_parallel import (
    SumGradientOverTP,
    TensorParallelPlan,
    check_feed_forward_tp,
    feed_forward_tp_plan,
)

__all__ = [
    "DEEPSEEK_V3_TP",
    "SumGradientOverTP",
    "block_tp_plan",
    "check_deepseekv3_tp",
    "parallelize_deepseekv3",
]


def block_tp_plan(block: nn.Module, float8_tensorwise: bool = False) -> dict[str, ParallelStyle]:
    """TP plan of one DeepSeek-V3 block (MLA + dense FFN or MoE)."""
    q_proj = "attention.wq" if block.attention.q_lora_rank == 0 else "attention.wq_b"
    return {
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
        q_proj: ColwiseParallel(),
    } | feed_forward_tp_plan(block)


def check_deepseekv3_tp(model: nn.Module, tp: int) -> None:
    """One line when the dense FFN width is not divisible by the TP degree (heads are checked
    by ``ParallelDims.validate_for_model``; expert hidden dims by
    ``plan.check_expert_parallel``)."""
    args = model.model_args
    check_feed_forward_tp(tp, args.inter_dim, "dense FFN inter_dim", args.n_dense_layers > 0)


DEEPSEEK_V3_TP = TensorParallelPlan(
    block_plan=block_tp_plan, check=check_deepseekv3_tp, name="DeepSeek-V3"
)


def parallelize_deepseekv3(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """The shared decoder composition with :data:`DEEPSEEK_V3_TP`."""
    return parallelize_decoder(model, parallel_dims, job_config, DEEPSEEK_V3_TP)
