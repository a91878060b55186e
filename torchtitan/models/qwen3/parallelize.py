"""Qwen3's tensor-parallel plan on the shared decoder composition (dense or MoE).

* attention: as Llama's (``wq/wk/wv`` column-wise, heads sharded; ``wo`` row-wise); the
  QK-norms run on the local heads with their weight replicated (``SequenceParallel`` over the
  head dimension), so their gradient is summed over the TP ranks and the result equals one
  device;
* dense feed-forward: the shared plan (``w1/w3`` column-wise, ``w2`` row-wise);
* MoE feed-forward: not in this plan. torchtitan/distributed/expert_parallel.py, applied after
  it, either lets each TP rank route and run its own sequence shard (experts whole, or spread
  over an ep group that includes the TP ranks) or, with
  ``parallelism.expert_tensor_parallel_degree`` = tp, gathers the sequence and splits every
  expert's hidden dims over the TP ranks.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import parallelize_decoder
from torchtitan.distributed.tensor_parallel import (
    TensorParallelPlan,
    block_tp_plan,
    check_feed_forward_tp,
)


def qwen3_block_tp_plan(block: nn.Module, float8_tensorwise: bool = False) -> dict[str, ParallelStyle]:
    """TP plan of one Qwen3 block: the shared block plan plus the QK-norms."""
    # [B, S, local heads, head_dim]: the heads (dim 2) are what the TP ranks split.
    return block_tp_plan(block) | {
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }


def check_qwen3_tp(model: nn.Module, tp: int) -> None:
    """One line when the dense feed-forward width is not divisible by the TP degree (heads
    are checked by ``ParallelDims.validate_for_model``; expert hidden dims by
    ``plan.check_expert_parallel``)."""
    args = model.model_args
    has_dense = not all(args.is_moe_layer(i) for i in range(args.n_layers))
    check_feed_forward_tp(tp, args.hidden_dim, "feed-forward hidden_dim", has_dense)


QWEN3_TP = TensorParallelPlan(block_plan=qwen3_block_tp_plan, check=check_qwen3_tp, name="Qwen3")


def parallelize_qwen3(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """The shared decoder composition with :data:`QWEN3_TP`."""
    return parallelize_decoder(model, parallel_dims, job_config, QWEN3_TP)
