"""bfloat16 weight gradients for torchao's ``Float8Linear`` without a bfloat16 weight copy.

A ``Float8Linear`` casts its float32 weight to float8 and returns the weight's gradient in
the compute dtype (bfloat16); autograd then widens it to float32 for the float32 weight (a
pass that reads 2 bytes and writes 4 per parameter), and the gradient norm and the optimizer
read 4-byte gradients. ``training.weight_copies=on`` avoids that with a bfloat16 copy of the
weight, which costs 2 bytes a parameter for the whole run (the plain float8 path holds no
bfloat16 weight at all). Here the module instead gets a **gradient view**: a bfloat16 tensor
over the high halves of its float32 weight's own storage (no memory), which stands in as the
module's ``weight`` during the step (:meth:`WeightCopies.active`). The forward still casts the
float32 weight to float8 exactly as torchao does; the float8 weight is attached to the
autograd graph through the view, so the gradient arriving there is torchao's bfloat16 gradient,
kept as it is: no widening pass, half the gradient memory, the norm and the optimizer step
read 2 bytes. The view's values are never read (they are the float32 weight's truncated high
halves); the optimizer step reads the view's gradient, updates the float32 weight and writes
nothing else.

Numerics: the forward and backward are torchao's tensorwise path's; the weight's float8 values
for the input gradient are the forward's (torchao recasts the float32 weight with the same
settings: the same values). The gradient equals the plain path's float32 one exactly (a
widened bfloat16). Tensorwise scaling only: rowwise scales the weight along another axis for
the input gradient, so those layers keep torchao's path.
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn

__all__ = ["attach_grad_view", "grad_view_of", "supports_grad_view"]


class _Float8:
    """torchao's float8 training pieces, loaded when first needed (torchao is imported by
    then: the model was converted); module globals, which compiled code reads freely."""

    loaded = False

    @classmethod
    def load(cls) -> type[_Float8]:
        if not cls.loaded:
            from torchao.float8.config import ScalingGranularity, ScalingType
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
            from torchao.float8.float8_scaling_utils import (
                get_maybe_axiswise_dim,
                hp_tensor_to_float8_dynamic,
            )
            from torchao.float8.float8_training_tensor import (
                Float8TrainingTensor,
                GemmInputRole,
            )

            cls.ScalingGranularity, cls.ScalingType = ScalingGranularity, ScalingType
            cls.matmul, cls.axiswise_dim = matmul_with_hp_or_float8_args, get_maybe_axiswise_dim
            cls.to_float8, cls.Float8TrainingTensor = hp_tensor_to_float8_dynamic, Float8TrainingTensor
            cls.GemmInputRole = GemmInputRole
            cls.loaded = True
        return cls


def supports_grad_view(module: nn.Module) -> bool:
    """A ``Float8Linear`` (exactly) with tensorwise weight scaling, on a little-endian machine
    (a float32's high half is its second bfloat16 there)."""
    module_type = getattr(sys.modules.get("torchao.float8.float8_linear"), "Float8Linear", None)
    if module_type is None or type(module) is not module_type or sys.byteorder != "little":
        return False
    f8 = _Float8.load()
    casts = (module.config.cast_config_weight, module.config.cast_config_weight_for_grad_input)
    return (module.weight.dtype == torch.float32
            and all(c.scaling_type is f8.ScalingType.DYNAMIC
                    and c.scaling_granularity is f8.ScalingGranularity.TENSORWISE
                    and c.target_dtype == casts[0].target_dtype for c in casts))


class _Float8WeightWithViewGrad(torch.autograd.Function):
    """The float32 weight (transposed, detached) cast to float8 as torchao casts it, as a
    float8 tensor whose gradient goes to ``view_t`` unchanged (its dtype is the view's, so
    autograd does not widen it)."""

    @staticmethod
    def forward(ctx, weight_t, view_t, config, mm_config):
        f8 = _Float8
        cast = config.cast_config_weight
        w8 = f8.to_float8(
            weight_t, cast.target_dtype, mm_config, gemm_input_role=f8.GemmInputRole.WEIGHT,
            scaling_granularity=cast.scaling_granularity,
            axiswise_dim=f8.axiswise_dim(0, cast.scaling_granularity),
            round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        )
        return f8.Float8TrainingTensor(w8._data, w8._scale, view_t.dtype,
                                       w8._linear_mm_config, w8._gemm_input_role,
                                       w8._axiswise_dim)

    @staticmethod
    def backward(ctx, grad):
        return None, grad, None, None


def _forward_with_grad_view(self, input: torch.Tensor) -> torch.Tensor:
    """``Float8Linear.forward`` (same autocast handling) when ``self.weight`` is the gradient
    view; torchao's own forward when it is the float32 weight (outside the step)."""
    view = self.weight
    if view.dtype == torch.float32:
        return type(self).forward(self, input)
    if torch.is_autocast_enabled("cuda"):  # torchao's rule: the CUDA autocast dtype
        input = input.to(torch.get_autocast_dtype("cuda"))
    weight_t = _Float8WeightWithViewGrad.apply(
        self._float32_weight.detach().t(), view.t(), self.config,
        self.linear_mm_config,
    )
    out = _Float8.matmul.apply(input, weight_t, self.linear_mm_config, self.config)
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


def grad_view_of(module: nn.Module) -> bool:
    """Whether ``module`` runs the gradient-view forward."""
    return "_float32_weight" in module.__dict__
