"""``optimizer.early_step_in_backward`` in one process: gradients are freed as parameters step,
the usual step's results, checkpoint keys, and the layouts it refuses."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchtitan.components.optimizer_in_backward import (
    build_optimizers_in_backward as build_optimizers,
)
from torchtitan.components.optimizer_in_backward import check_early_step
from torchtitan.config.job_config import JobConfig, Optimizer
from torchtitan.distributed.parallel_dims import ParallelDims


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _steps(model: nn.Module, early: bool, microbatches: int = 2) -> list[torch.Tensor]:
    opts = build_optimizers([model], Optimizer(implementation="for-loop", lr=0.1,
                                               early_step_in_backward=early))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        opts.zero_grad()
        for i in range(microbatches):
            opts.before_backward(final=i == microbatches - 1)
            model(torch.randn(5, 4, generator=g)).square().mean().backward()
        opts.step()
    return [p.detach().clone() for p in model.parameters()]


def test_stepping_in_backward_frees_every_gradient_and_equals_the_usual_step():
    usual = _steps(_model(), early=False)
    model = _model()
    early = _steps(model, early=True)
    for a, b in zip(usual, early):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in model.parameters())  # freed right after each step


def test_gradient_norms_come_from_the_hooks():
    model = _model()
    opts = build_optimizers([model], Optimizer(early_step_in_backward=True))
    reference = copy.deepcopy(model)
    x = torch.randn(5, 4)
    model(x).sum().backward()
    reference(x).sum().backward()
    from torchtitan.distributed.utils import clip_grad_norm_, total_norm

    expected = clip_grad_norm_(reference.parameters(), max_norm=0)
    assert torch.allclose(total_norm(opts.take_grad_norms()), expected)
    assert opts.take_grad_norms() == {}  # taken once


def test_checkpoints_have_the_usual_keys_and_load_both_ways():
    usual_model, early_model = _model(), _model()
    usual = build_optimizers([usual_model], Optimizer())
    early = build_optimizers([early_model], Optimizer(early_step_in_backward=True))
    for model, opts in ((usual_model, usual), (early_model, early)):
        model(torch.ones(2, 4)).sum().backward()
        opts.step()
    saved = early.state_dict()
    assert saved.keys() == usual.state_dict().keys()
    fresh = build_optimizers([copy.deepcopy(early_model)], Optimizer())
    fresh.load_state_dict(saved)
    for key, value in fresh.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, saved[key]), key
    back = build_optimizers([copy.deepcopy(usual_model)], Optimizer(early_step_in_backward=True))
    back.load_state_dict(usual.state_dict())
    assert float(back.state_dict()["state.0.weight.step"]) == 1.0


def _cfg(**sections) -> JobConfig:
    cfg = JobConfig()
    cfg.optimizer.early_step_in_backward = True
    cfg.training.max_norm = 0
    for key, value in sections.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def _dims(**degrees) -> ParallelDims:
    d = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1)
    d.update(degrees)
    world = d["dp_replicate"] * d["dp_shard"] * d["cp"] * d["tp"] * d["pp"]
    return ParallelDims(**d, world_size=world)


@pytest.mark.parametrize(
    ("cfg", "dims", "why"),
    [
        (_cfg(training__max_norm=1.0), _dims(), "training.max_norm=1.0 clips by the global "
         "grad norm, which is known only once every parameter has stepped: set "
         "--training.max_norm 0"),
        (_cfg(), _dims(dp_shard=2, ep=2), "expert parallel rescales the expert gradients "
         "after backward"),
        (_cfg(), _dims(dp_replicate=2), "DDP all-reduces gradients in buckets after the hooks "
         "fire; use FSDP or HSDP (or DDP with tensor parallelism, which replicates through "
         "FSDP2)"),
        (_cfg(fault_tolerance__enable=True, fault_tolerance__semi_sync_method="diloco"), _dims(),
         "fault tolerance all-reduces gradients across groups after backward (or, "
         "semi-synchronous, lets a rejoining group copy the weights outside the optimizer step, "
         "and here they change during backward)"),
    ],
)
def test_layouts_it_cannot_serve_are_refused_in_one_line(cfg, dims, why):
    with pytest.raises(ValueError) as info:
        check_early_step(cfg, dims)
    assert str(info.value) == f"optimizer.early_step_in_backward does not work here: {why}"


def test_fsdp_hsdp_tp_cp_and_ddp_with_tp_are_accepted():
    for dims in (_dims(dp_shard=2), _dims(dp_replicate=2, dp_shard=2), _dims(dp_shard=2, tp=2),
                 _dims(dp_replicate=2, cp=2), _dims(dp_replicate=2, tp=2)):
        check_early_step(_cfg(), dims)
    check_early_step(SimpleNamespace(optimizer=Optimizer()), None)  # off: nothing to check
