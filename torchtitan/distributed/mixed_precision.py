"""Mixed precision on every layout: which mechanism applies, and the dtype matmuls run in.

``training.mixed_precision_param`` (bfloat16 by default) is honoured on every layout:

* FSDP / HSDP (``dp_shard x cp > 1``): FSDP2's ``MixedPrecisionPolicy`` (parameters cast to
  ``mixed_precision_param`` for compute, gradients reduced in ``mixed_precision_reduce``),
  applied by :func:`torchtitan.distributed.fsdp.apply_fsdp`.
* Everything else (one device, DDP, DDP x TP / PP, TP or PP without FSDP): ``torch.autocast``
  around each model part's forward. Parameters, gradients and optimizer state stay float32;
  matmuls run in ``mixed_precision_param``; the loss (outside the forward) is float32.
* ``training.dtype = "bfloat16"`` without FSDP trains fully in bf16 (parameters cast): no
  autocast on top.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from torchtitan.distributed.fsdp import to_torch_dtype
from torchtitan.tools.logging import logger


def _fsdp(parallel_dims) -> bool:
    return bool(getattr(parallel_dims, "fsdp_enabled", False))  # None: no layout (yet)


def autocast_dtype(training, parallel_dims) -> torch.dtype | None:
    """The dtype to autocast model forwards to, or None (FSDP's policy applies, the
    parameters are already low precision, or ``mixed_precision_param`` is float32)."""
    if _fsdp(parallel_dims) or training.dtype != "float32":
        return None
    dtype = to_torch_dtype(training.mixed_precision_param, "training.mixed_precision_param")
    return None if dtype == torch.float32 else dtype


def compute_dtype(training, parallel_dims) -> str:
    """The dtype the model's matmuls run in (for the peak-FLOPs table and converters)."""
    if _fsdp(parallel_dims):
        return training.mixed_precision_param
    if training.dtype != "float32":
        return training.dtype
    return training.mixed_precision_param


def apply_autocast(model: nn.Module, device_type: str, dtype: torch.dtype) -> nn.Module:
    """Run ``model``'s forward under ``torch.autocast(device_type, dtype)``. Backward stays
    outside it (as autocast recommends); pipeline stages call the part, so they get it too."""
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast_forward
    return model


def log_precision(training, parallel_dims) -> None:
    """One line saying how this layout applies mixed precision."""
    dtype = autocast_dtype(training, parallel_dims)
    if _fsdp(parallel_dims):
        how = (f"FSDP mixed precision (param {training.mixed_precision_param}, "
               f"reduce {training.mixed_precision_reduce})")
    elif dtype is not None:
        how = f"torch.autocast({training.mixed_precision_param}) with float32 parameters"
    elif training.dtype != "float32":
        how = f"pure {training.dtype} (parameters cast; training.dtype)"
    else:
        how = "float32 (training.mixed_precision_param = float32)"
    logger.info(f"Precision: {how}")
