"""Model converters: swap parts of a model for low-precision versions before it is parallelized.

``model.converters`` names them (``float8``, ``mx``); :func:`torchtitan.build.build_run` builds
them with :func:`build_converters` (which checks the config and this machine's device first,
each failure one line) and calls :meth:`ModelConverters.convert` on the model built on
``meta``, before ``parallelize_fn`` / ``pipelining_fn``. After every optimizer step
:func:`torchtitan.step.optimizer_step` calls :meth:`ModelConverters.post_optimizer_hook` (float8
precomputes its FSDP all-gather scales there). A converter keeps parameter names, shapes and
dtypes, so checkpoints load across converter settings.

Converters live in their own modules and are imported on first use (torchao is optional):
:data:`REGISTRY` maps a name to ``"module:Class"``; :func:`register_converter` adds one (e.g.
from ``experimental.custom_import``).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from torchtitan.config.errors import ConfigError, suggest
from torchtitan.config.job_config import JobConfig
from torchtitan.tools.logging import logger

__all__ = [
    "REGISTRY",
    "ModelConverter",
    "ModelConverters",
    "build_converters",
    "check_converters",
    "converter_class",
    "prepare_dry_run",
    "register_converter",
]

REGISTRY: dict[str, str] = {
    "float8": "torchtitan.components.float8:Float8Converter",
    "mx": "torchtitan.components.mx:MXConverter",
}
"""Converter name -> ``"module:Class"`` (imported when a config names it)."""

_UPSTREAM_NAMES = {
    "quantize.linear.float8": "float8",
    "quantize.grouped_mm.float8": "float8 with float8.moe_fqns_prototype",
    "quantize.linear.mx": "mx",
    "quantize.grouped_mm.mx": "mx with mx.moe_fqns_prototype",
}


class ModelConverter:
    """One converter. The class-level checks run in the pre-flight too (no model needed)."""

    name = ""

    @classmethod
    def check(cls, job_config: JobConfig) -> None:
        """Refuse settings that contradict each other (one-line ValueError)."""

    @classmethod
    def check_device(cls, job_config: JobConfig, device_type: str) -> None:
        """Refuse, in one line, what this machine's device cannot run."""

    @classmethod
    def prepare_dry_run(cls, job_config: JobConfig, device_type: str) -> list[str]:
        """Adjust ``job_config`` for a COMM_MODE dry run (shapes, not kernels); returns what
        changed, for the dry run's info line."""
        return []

    def __init__(self, job_config: JobConfig, parallel_dims: Any, device_type: str) -> None:
        self.job_config = job_config

    def convert(self, model: nn.Module) -> None:
        """Swap modules of ``model`` (on ``meta``, not yet parallelized) in place."""
        raise NotImplementedError

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        """Called after every optimizer step."""

    @property
    def float8_tensorwise_tp(self) -> bool:
        """Whether TP should use torchao's float8 styles (float8 all-gather between ranks)."""
        return False


def register_converter(name: str, target: str | type[ModelConverter]) -> None:
    """Make ``model.converters`` accept ``name``: a class or ``"module:Class"``."""
    REGISTRY[name] = target  # type: ignore[assignment]


def converter_class(name: str) -> type[ModelConverter]:
    """The class registered as ``name``; ConfigError (one line) for an unknown name."""
    target: Any = REGISTRY.get(name)
    if target is None:
        known = ", ".join(sorted(REGISTRY))
        hint = ""
        if name in _UPSTREAM_NAMES:
            hint = f" (upstream's {name} is {_UPSTREAM_NAMES[name]} here)"
        else:
            close = suggest(name, sorted(REGISTRY))
            hint = f" (did you mean {close!r}?)" if close else ""
        raise ConfigError(f"model.converters: unknown converter {name!r}{hint}; known: {known}")
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
    return target


def _classes(job_config: JobConfig) -> list[type[ModelConverter]]:
    names = job_config.model.converters
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"model.converters names {repeated} more than once: {names}")
    return [converter_class(name) for name in names]


def check_converters(job_config: JobConfig, device_type: str | None = None) -> None:
    """The pre-flight's check: known names, consistent settings, and (``device_type`` given)
    what this machine's device can run. Raises one-line ValueErrors."""
    for cls in _classes(job_config):
        cls.check(job_config)
        if device_type is not None:
            cls.check_device(job_config, device_type)


def prepare_dry_run(job_config: JobConfig, device_type: str) -> list[str]:
    """Let each converter adjust the config for a dry run; returns what changed."""
    changes: list[str] = []
    for cls in _classes(job_config):
        changes += cls.prepare_dry_run(job_config, device_type)
    return changes


class ModelConverters:
    """The converters of one run, applied in ``model.converters`` order."""

    def __init__(self, converters: list[ModelConverter] | None = None,
                 print_after_conversion: bool = False):
        self.converters = converters or []
        self.print_after_conversion = print_after_conversion

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.converters]

    @property
    def float8_tensorwise_tp(self) -> bool:
        return any(c.float8_tensorwise_tp for c in self.converters)

    def convert(self, model: nn.Module) -> None:
        for converter in self.converters:
            converter.convert(model)
        keep_state_dict_plain(model)
        if self.print_after_conversion:
            which = ", ".join(self.names) or "no converters"
            logger.info(f"Model after conversion ({which}):\n{model}")

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        for converter in self.converters:
            converter.post_optimizer_hook(model_parts)


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """The high-precision tensor inside a torchao weight wrapper (``WeightWithDynamicFloat8Cast
    Tensor``, ``Float8/MXFP8TrainingWeightWrapperTensor``), sharing its storage; a DTensor gets
    its local wrapper unwrapped; anything else is returned as is."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        inner = plain_tensor(t._local_tensor)
        if inner is t._local_tensor:
            return t
        return DTensor.from_local(inner, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return t
    names, _ = t.__tensor_flatten__()
    inner = getattr(t, names[0])
    if inner.shape != t.shape or inner.dtype != t.dtype:
        return t
    return inner.detach()


def _plain_state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, _meta: Any) -> None:
    for name, _ in module.named_parameters(recurse=False):
        key = prefix + name
        if key in state_dict:
            state_dict[key] = plain_tensor(state_dict[key])


def keep_state_dict_plain(model: nn.Module) -> int:
    """Make ``model.state_dict()`` (and so checkpoints and HF exports) hold plain tensors where
    a converter wrapped a weight in a torchao tensor subclass: same FQNs, shapes and dtypes as
    the unconverted model, loadable without torchao. Loading writes through the shared storage
    into the wrapped weights. Returns the number of modules hooked."""
    hooked = 0
    for module in model.modules():
        wrapped = any(
            type(p) is not nn.Parameter or type(p.data) is not torch.Tensor
            for p in module.parameters(recurse=False)
        )
        if wrapped:
            module.register_state_dict_post_hook(_plain_state_dict_hook)
            hooked += 1
    return hooked


def build_converters(job_config: JobConfig, parallel_dims: Any, device_type: str) -> ModelConverters:
    """Check and build the converters ``model.converters`` names (none: an empty container)."""
    converters = []
    for cls in _classes(job_config):
        cls.check(job_config)
        cls.check_device(job_config, device_type)
        converters.append(cls(job_config, parallel_dims, device_type))
    return ModelConverters(converters, job_config.model.print_after_conversion)
