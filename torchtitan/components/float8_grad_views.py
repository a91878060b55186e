"""bfloat16 weight gradients for torchao's ``Float8Linear`` without a bfloat16 weight copy.

A ``Float8Linear`` casts its float32 weight to float8 and returns the weight's gradient in
the compute dtype (bfloat16); autograd then widens it to float32 for the float32 weight (a
pass that reads 2 bytes and writes 4 per parameter), and the gradient norm and the optimizer
read 4-byte gradients. ``training.weight_copies=on`` avoids that with a bfloat16 copy of the
weight, which costs 2 bytes a parameter for the whole run (the plain float8 path holds no
bfloat16 weight at all). Here the module instead gets a **gradient view**: a bfloat16 tensor
over the high halves of its float32 weight's own storage (no memory), which stands in as the
module's ``weight`` during the step (:meth:`WeightCopies.active`). The forward still casts the
float32 weight to float8 exactly as torchao does, and the weight's gradient is handed to the
view, so it stays torchao's bfloat16 gradient: no widening pass, half the gradient memory,
the norm and the optimizer step read 2 bytes. The view's values are never read (they are the
float32 weight's truncated high halves); the optimizer step reads the view's gradient,
updates the float32 weight and writes nothing else.

Numerics: the forward and backward are torchao's own (its matmul function runs under this
module's autograd function, saving the input and the float32 weight and recasting the weight
in the backward as always); only the weight's gradient goes to the view instead of the
weight. Under CUDA autocast (bf16, where ``training.weight_copies=auto`` applies) torchao's
weight gradient is bf16, so it equals the plain path's widened float32 one exactly. Every
recipe (tensorwise, rowwise, rowwise_with_gw_hp).
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn

__all__ = ["attach_grad_view", "supports_grad_view"]


class _Float8:
    """torchao's float8 matmul's forward and backward as plain functions (what its autograd
    function runs), loaded when first needed (torchao is imported by then: the model was
    converted); class attributes, which compiled code reads freely."""

    forward = backward = None

    @classmethod
    def load(cls) -> None:
        if cls.forward is None:
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args as matmul

            cls.forward = staticmethod(matmul.__dict__["forward"].__func__)
            cls.backward = staticmethod(matmul.__dict__["backward"].__func__)


def supports_grad_view(module: nn.Module) -> bool:
    """A ``Float8Linear`` (exactly) with a float32 weight, on a little-endian machine (a
    float32's high half is its second bfloat16 there), with a torchao whose float8 matmul
    has the form this module runs (else the layer keeps torchao's path)."""
    module_type = getattr(sys.modules.get("torchao.float8.float8_linear"), "Float8Linear", None)
    if not (module_type is not None and type(module) is module_type
            and sys.byteorder == "little" and module.weight.dtype == torch.float32):
        return False
    try:
        _Float8.load()
    except (ImportError, KeyError, AttributeError):
        return False
    return True


class _Float8MatmulWithViewGrad(torch.autograd.Function):
    """torchao's float8 matmul (its own forward and backward, run under this function's
    context: it saves the input and the float32 weight, and recasts the weight in the
    backward as always), with the weight's gradient handed to ``view_t``: its dtype is the
    view's, so autograd does not widen it."""

    @staticmethod
    def forward(ctx, input, weight_t, view_t, mm_config, config):
        return _Float8.forward(ctx, input, weight_t, mm_config, config)

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight_t, *_ = _Float8.backward(ctx, grad_output)
        return grad_input, None, grad_weight_t, None, None


def _forward_with_grad_view(self, input: torch.Tensor) -> torch.Tensor:
    """``Float8Linear.forward`` (same autocast handling) when ``self.weight`` is the gradient
    view; torchao's own forward when it is the float32 weight (outside the step)."""
    view = self.weight
    if view.dtype == torch.float32:
        return type(self).forward(self, input)
    if torch.is_autocast_enabled("cuda"):  # torchao's rule: the CUDA autocast dtype
        input = input.to(torch.get_autocast_dtype("cuda"))
    # The float32 weight goes in as the parameter it is (its gradient is None): detached, the
    # compiler's partitioner kept each weight's float8 cast for the backward instead of recasting
    # it (1 byte a parameter of activation memory that the plain float8 path does not hold).
    out = _Float8MatmulWithViewGrad.apply(
        input, self._float32_weight.t(), view.t(), self.linear_mm_config, self.config
    )
    return out if self.bias is None else out + self.bias.to(out.dtype)


def attach_grad_view(module: nn.Module) -> torch.Tensor:
    """Give ``module`` (see :func:`supports_grad_view`) its gradient view and the forward that
    uses it; returns the view (a bfloat16 leaf over the weight's storage)."""
    _Float8.load()
    weight = module.weight
    view = weight.detach().view(torch.bfloat16)[..., 1::2]
    view.requires_grad_(weight.requires_grad)
    module.__dict__["_float32_weight"] = weight  # (not a registered parameter)
    module.forward = types.MethodType(_forward_with_grad_view, module)
    return view

