"""gpt-oss's tensor-parallel plan on the shared decoder composition.

Attention as Llama's (``wq/wk/wv`` column-wise with their biases ``Shard(0)``, ``wo`` row-wise
with its bias replicated, added once after the reduce-scatter) plus the per-head ``sinks``
sharded like the heads. Every block is MoE: the MoE layers are left to
torchtitan/distributed/expert_parallel.py (each TP rank routes its own sequence shard, or expert
TP splits every expert's hidden units and the biases of ``w1``/``w3`` with them).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import parallelize_decoder
from torchtitan.distributed.tensor_parallel import (
    TensorParallelPlan,
    WithShardedParameters,
    block_tp_plan,
)


def gpt_oss_block_tp_plan(block: nn.Module, float8_tensorwise: bool = False) -> dict[str, ParallelStyle]:
    """The shared block plan with the attention sinks sharded by head."""
    plan = block_tp_plan(block, float8_tensorwise)
    plan["attention"] = WithShardedParameters(plan["attention"], ("sinks",))
    return plan


GPT_OSS_TP = TensorParallelPlan(
    block_plan=gpt_oss_block_tp_plan, float8_tensorwise=True, name="gpt-oss"
)


def parallelize_gpt_oss(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """The shared decoder composition with :data:`GPT_OSS_TP`."""
    return parallelize_decoder(model, parallel_dims, job_config, GPT_OSS_TP)
