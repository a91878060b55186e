"""Mixed precision on layouts without FSDP: ``torch.autocast`` around each model part's forward.

``training.mixed_precision_param`` used to apply only under FSDP; one device, DDP and TP or PP
without FSDP silently trained in float32. Now every layout honours it: FSDP by its policy, the
rest by autocast with float32 parameters, gradients and optimizer state.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchtitan.config.job_config import JobConfig, Parallelism
from torchtitan.distributed.mixed_precision import apply_autocast, autocast_dtype
from torchtitan.distributed.parallel_dims import ParallelDims


def _dims(world_size: int = 1, **degrees) -> ParallelDims:
    return ParallelDims.from_config(Parallelism(**degrees), world_size)


@pytest.mark.parametrize(
    "dims, dtype, mp, expected",
    [
        (_dims(), "float32", "bfloat16", torch.bfloat16),
        (_dims(), "float32", "float32", None),
        (_dims(), "bfloat16", "bfloat16", None),  # parameters are bf16 already
        (_dims(2, data_parallel_replicate_degree=2, data_parallel_shard_degree=1),
         "float32", "bfloat16", torch.bfloat16),
        (_dims(2, pipeline_parallel_degree=2, data_parallel_shard_degree=1),
         "float32", "bfloat16", torch.bfloat16),
        (_dims(2), "float32", "bfloat16", None),  # FSDP: its mixed-precision policy
        (_dims(2, context_parallel_degree=2, data_parallel_shard_degree=1),
         "float32", "bfloat16", None),  # cp > 1 shards with FSDP over dp_shard x cp
    ],
)
def test_autocast_where_fsdp_does_not_apply_the_policy(dims, dtype, mp, expected):
    cfg = JobConfig()
    cfg.training.dtype, cfg.training.mixed_precision_param = dtype, mp
    assert autocast_dtype(cfg.training, dims) == expected


def test_autocast_forward_keeps_float32_parameters_and_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(8, 16)
    reference = model(x)
    apply_autocast(model, "cpu", torch.bfloat16)
    out = model(x)
    assert out.dtype == torch.bfloat16 and reference.dtype == torch.float32
    assert 0 < (out.float() - reference).abs().max() < 0.05  # bf16 matmuls, same function
    out.float().sum().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in model.parameters())
    assert not torch.is_autocast_enabled("cpu")  # only inside the forward
