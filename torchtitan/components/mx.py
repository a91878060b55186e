"""MXFP8 training through torchao (``model.converters = ["mx"]``, the ``[mx]`` section).

torchao 0.18's ``MXFP8TrainingOpConfig`` wraps the weights of the chosen ``nn.Linear`` layers
(and, with ``mx.moe_fqns_prototype``, of MoE ``GroupedExperts``) in a tensor subclass whose
matmuls quantize to MXFP8 (float8 e4m3 values, one power-of-two scale per 32 elements).
MXFP8 matmuls need a CUDA GPU with compute capability >= 10.0 (Blackwell, e.g. B200); on any
other machine the run refuses in one line, unless ``mx.recipe_name = "mxfp8_emulated_rceil"``
(torchao's emulation: the same quantization, high-precision matmuls; slow, for tests).

Skipped, and logged: layers whose FQN contains an entry of ``mx.filter_fqns`` (default
``output``) and layers whose dims are not multiples of 32 (the MX block size). Parameter
names, shapes and dtypes are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchtitan.components.converters import ModelConverter, converts_linears
from torchtitan.components.float8 import (
    count_moe,
    cuda_capability,
    describe_device,
    moe_filter,
    plan_linears,
    require_torchao,
    summarize,
)
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.tools.logging import logger

MX_CAPABILITY = (10, 0)
RECIPES = ("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp", "mxfp8_emulated_rceil")
EMULATED = "mxfp8_emulated_rceil"
UPSTREAM_RECIPES = {"mxfp8": "mxfp8_rceil", "mxfp8_cublas": "mxfp8_rceil",
                    "mxfp8_cublas_rceil": "mxfp8_rceil", "mxfp8_cutlass": "mxfp8_rceil"}
"""Older torchtitan/torchao recipe names -> torchao 0.18's."""


def resolve_recipe(name: str) -> str:
    if name in RECIPES:
        return name
    if name in UPSTREAM_RECIPES:
        return UPSTREAM_RECIPES[name]
    raise ConfigError(f"mx.recipe_name={name!r} is not a torchao 0.18 MXFP8 recipe; use one of "
                      f"{', '.join(RECIPES)}")


def torch_has_mx_training() -> bool:
    """Whether this torch has the DTensor pieces torchao 0.18's MXFP8 training asserts on
    (torch 2.13 has them, 2.11 does not); the same test torchao makes, before any work."""
    from torch.distributed.tensor import _dispatch, _ops

    return hasattr(_ops, "scaled_mm_single_dim_strategy") and hasattr(_dispatch, "is_pinned_handler")


def has_mx_hardware(device_type: str) -> bool:
    cap = cuda_capability()
    return device_type == "cuda" and cap is not None and cap >= MX_CAPABILITY


class MXConverter(ModelConverter):
    name = "mx"

    @classmethod
    def check(cls, job_config: JobConfig) -> None:
        resolve_recipe(job_config.mx.recipe_name)
        if converts_linears(job_config.model.converters, "float8") and converts_linears(job_config.model.converters, "mx"):
            raise ConfigError("model.converters: float8 and mx both convert the Linear layers; "
                              "choose one")

    @classmethod
    def check_device(cls, job_config: JobConfig, device_type: str) -> None:
        if resolve_recipe(job_config.mx.recipe_name) != EMULATED and not has_mx_hardware(device_type):
            raise ValueError(
                "model.converters mx needs a GPU with MXFP8 matmuls (CUDA compute capability "
                f">= 10.0, e.g. B200); this machine has {describe_device(device_type)}: use "
                f"float8 instead, or mx.recipe_name={EMULATED!r} to emulate MXFP8 (slow; for tests)"
            )
        if not torch_has_mx_training():
            raise ValueError(
                f"model.converters mx needs a newer torch than {torch.__version__} (torchao's "
                "MXFP8 training uses DTensor features that torch 2.13 has): upgrade torch, or "
                "use model.converters float8"
            )

    @classmethod
    def prepare_dry_run(cls, job_config: JobConfig, device_type: str) -> list[str]:
        recipe = resolve_recipe(job_config.mx.recipe_name)
        if recipe != EMULATED and not has_mx_hardware(device_type):
            job_config.mx.recipe_name = EMULATED
            return [f"mx.recipe_name={EMULATED} (no MXFP8 hardware here)"]
        return []

    def __init__(self, job_config: JobConfig, parallel_dims: Any, device_type: str) -> None:
        super().__init__(job_config, parallel_dims, device_type)
        require_torchao("model.converters mx")
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe

        mx = job_config.mx
        if mx.recipe_name not in RECIPES:
            logger.warning(f"mx.recipe_name={mx.recipe_name!r} is an older name; using "
                           f"{resolve_recipe(mx.recipe_name)!r}")
        self.recipe = resolve_recipe(mx.recipe_name)
        self.config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(self.recipe))
        from torchtitan.distributed.mixed_precision import compute_dtype

        # The grouped GEMMs' output dtype: the dtype the model computes in; torchao's emulation
        # dequantizes to bf16 (exact for MXFP8 values) and CPU grouped GEMMs keep their dtype.
        dtype = compute_dtype(job_config.training, parallel_dims)
        fp32 = dtype == "float32" and self.recipe != EMULATED
        self.config.out_dtype = torch.float32 if fp32 else torch.bfloat16
        self.filter_fqns = list(mx.filter_fqns)
        self.moe_fqns = list(mx.moe_fqns_prototype)
        self.linears = converts_linears(job_config.model.converters, self.name)

    def convert(self, model: nn.Module) -> None:
        from torchao.quantization import quantize_

        chosen, skipped = plan_linears(model, self.filter_fqns, what="mx.filter_fqns")
        if not self.linears:  # upstream's quantize.grouped_mm.mx alone: MoE experts only
            skipped.update(dict.fromkeys(chosen, "no quantize.linear.mx"))
            chosen = set()
        for fqn in sorted(chosen):  # the MX block size is 32
            weight = model.get_submodule(fqn).weight
            if weight.shape[0] % 32 or weight.shape[1] % 32:
                chosen.discard(fqn)
                skipped[fqn] = f"{weight.shape[0]}x{weight.shape[1]}: dims not multiples of 32"
        keep_moe = moe_filter(self.moe_fqns)
        n_moe = count_moe(model, keep_moe) if self.moe_fqns else 0
        if self.moe_fqns and not n_moe:
            logger.warning(f"mx.moe_fqns_prototype={self.moe_fqns} matches no MoE experts")

        def keep(mod: nn.Module, fqn: str) -> bool:
            return fqn in chosen or (bool(self.moe_fqns) and keep_moe(mod, fqn))

        quantize_(model, config=self.config, filter_fn=keep)
        moe = f", {n_moe} MoE expert groups" if n_moe else ""
        logger.info(
            f"mx: converted {len(chosen)} Linear layers to MXFP8 ({self.recipe}{moe}); skipped "
            f"{len(skipped)}: {summarize(skipped) or '-'}"
        )
