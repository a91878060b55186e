"""Gradient clipping inside the fused Adam/AdamW step (``optimizer.clip_in_step``): the fused
kernel divides each gradient by the clip factor as it reads it, so no pass rescales every
gradient first. The update equals the rescaling path within float rounding, bitwise while
nothing is clipped; the trainer takes it wherever the optimizers can."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from torchtitan.components.optimizer import OptimizersContainer, build_optimizers
from torchtitan.config.job_config import Optimizer
from torchtitan.distributed import utils as dist_utils

REPO_ROOT = Path(__file__).resolve().parents[2]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def _train(max_norm: float, in_step: bool, steps: int = 5,
           state_dtype: str = "float32") -> tuple[list[float], nn.Module]:
    model = _model()
    # eps as large as the gradients: Adam's update then depends on their scale (with a tiny
    # eps it cancels, and a wrong clip factor would not show)
    opts = build_optimizers([model], Optimizer(implementation="fused", lr=1e-2, eps=0.1,
                                               state_dtype=state_dtype))
    assert opts.clips_in_step
    g = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(steps):
        x, y = torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g)
        opts.zero_grad()
        (model(x) - y).pow(2).sum().backward()
        norm = dist_utils.clip_grad_norm_(model.parameters(), 0.0 if in_step else max_norm)
        if in_step:
            opts.set_grad_divisor(dist_utils.clip_divisor(norm, max_norm))
        norms.append(float(norm))
        opts.step()
    return norms, model


def test_clipping_in_the_step_equals_rescaling_the_gradients():
    ref_norms, ref = _train(max_norm=1.0, in_step=False)
    norms, got = _train(max_norm=1.0, in_step=True)
    assert min(ref_norms) > 1.0  # every step clips
    torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=0)
    for a, b in zip(got.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_without_clipping_the_update_is_bitwise_the_same():
    ref_norms, ref = _train(max_norm=1e6, in_step=False)
    _, got = _train(max_norm=1e6, in_step=True)
    assert max(ref_norms) < 1e6
    for a, b in zip(got.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_the_bf16_state_optimizer_clips_in_its_step_too():
    """optimizer.state_dtype=bfloat16: its compiled step divides by the clip factor as it
    reads each gradient; within bf16 moment rounding of rescaling the gradients first."""
    ref_norms, ref = _train(max_norm=1.0, in_step=False, state_dtype="bfloat16")
    norms, got = _train(max_norm=1.0, in_step=True, state_dtype="bfloat16")
    assert min(ref_norms) > 1.0
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    for a, b in zip(got.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


def test_the_divisor_is_used_once():
    model = _model()
    opts = OptimizersContainer([model], Optimizer(implementation="fused"))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opts.set_grad_divisor(torch.tensor(4.0))
    opts.step()
    assert all(getattr(opt, "grad_scale", None) is None for opt in opts.optimizers)


@pytest.mark.parametrize("implementation", ["foreach", "for-loop"])
def test_other_kernels_rescale_the_gradients(implementation):
    opts = OptimizersContainer([_model()], Optimizer(implementation=implementation))
    assert not opts.clips_in_step


def test_the_trainer_clips_in_the_step_without_touching_the_gradients(tmp_path, monkeypatch):
    """The debug model with a tight max_norm: after the backward the gradients are as the
    backward left them (not rescaled) and the optimizers hold the clip divisor (norm /
    max_norm); with ``--optimizer.no_clip_in_step`` the gradients are rescaled instead."""
    from tests.integration.trainer_utils import built_trainer
    from torchtitan.step import compute_gradients

    monkeypatch.chdir(REPO_ROOT)
    seen = {}
    for flag in ("--optimizer.clip_in_step", "--optimizer.no_clip_in_step"):
        with built_trainer(tmp_path / flag, "--training.seq_len", "32",
                           "--training.local_batch_size", "2", "--training.max_norm", "0.01",
                           flag) as trainer:
            batch = next(iter(trainer.dataloader))
            _, norm = compute_gradients(trainer.run, [batch])
            grads = torch.cat([p.grad.flatten() for m in trainer.model_parts
                               for p in m.parameters()])
            divisors = [getattr(o, "grad_scale", None) for o in trainer.optimizers.optimizers]
            seen[flag] = (float(norm), float(grads.norm()), divisors)
    norm, grad_norm, divisors = seen["--optimizer.clip_in_step"]
    assert norm > 0.01 and grad_norm == pytest.approx(norm, rel=1e-5)  # untouched
    assert divisors and all(float(d) == pytest.approx(norm / 0.01, rel=1e-5) for d in divisors)
    norm, grad_norm, divisors = seen["--optimizer.no_clip_in_step"]
    assert grad_norm == pytest.approx(0.01, rel=1e-4) and divisors == [None] * len(divisors)
