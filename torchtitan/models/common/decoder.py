"""The decoder every family builds on (plain PyTorch, no parallelism)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def keep_float32_buffers(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``fn`` (as given to ``Module._apply``) except that the buffers a submodule names in its
    ``float32_buffers`` stay float32 through a dtype cast, with their float32 values (a cast
    down and back would round them): e.g. MoE token counts, inexact in bf16 above 256."""
    kept = {
        id(buf)
        for module in model.modules()
        for name in getattr(module, "float32_buffers", ())
        if (buf := getattr(module, name, None)) is not None
    }

    def apply(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        if id(t) in kept and out.is_floating_point() and out.dtype != torch.float32:
            source = t if t.dtype == torch.float32 else out
            out = source.to(device=out.device, dtype=torch.float32)
        return out

    return apply
