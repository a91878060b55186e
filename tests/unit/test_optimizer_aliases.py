"""Optimizer state saved under another parameter name (a pipeline stage's tied-weight copy)."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.components.optimizer import build_optimizers
from torchtitan.config.job_config import Optimizer


class _LastStage(nn.Module):
    """A last pipeline stage of a tied model: ``output`` without ``tok_embeddings``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = None
        self.norm = nn.LayerNorm(4)
        self.output = nn.Linear(4, 6, bias=False)


def _stepped(seed: int) -> tuple[_LastStage, object]:
    torch.manual_seed(seed)
    part = _LastStage()
    optimizers = build_optimizers([part], Optimizer())
    optimizers.fqn_aliases = [{"output.weight": "tok_embeddings.weight"}]
    part.output(part.norm(torch.randn(3, 4))).sum().backward()
    optimizers.step()
    return part, optimizers


def test_aliased_state_is_saved_under_the_alias_and_loads_back():
    part, optimizers = _stepped(0)
    state = optimizers.state_dict()
    assert "state.tok_embeddings.weight.exp_avg" in state
    assert "param_groups.tok_embeddings.weight.lr" in state
    assert not [k for k in state if "output.weight" in k]
    assert "state.norm.weight.exp_avg" in state  # other names are left alone

    _, fresh = _stepped(1)  # different state, then the saved one loaded
    fresh.load_state_dict(state)
    loaded = fresh.optimizers[0].state[fresh.model_parts[0].output.weight]
    torch.testing.assert_close(
        loaded["exp_avg"], optimizers.optimizers[0].state[part.output.weight]["exp_avg"],
        rtol=0, atol=0,
    )
