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
    "converts_linears",
    "prepare_dry_run",
    "register_converter",
    "requested_converters",
]

REGISTRY: dict[str, str] = {
    "float8": "torchtitan.components.float8:Float8Converter",
    "mx": "torchtitan.components.mx:MXConverter",
}
"""Converter name -> ``"module:Class"`` (imported when a config names it)."""

# Upstream's 2026 converter names: (our converter, the part of the model it converts). The
# grouped-GEMM names take their MoE FQNs from quantize.grouped_mm.*.fqns, which the legacy
# rules move to float8.moe_fqns_prototype / mx.moe_fqns_prototype.
UPSTREAM_NAMES: dict[str, tuple[str, str]] = {
    "quantize.linear.float8": ("float8", "linear"),
    "quantize.grouped_mm.float8": ("float8", "grouped_mm"),
    "quantize.linear.mx": ("mx", "linear"),
    "quantize.grouped_mm.mx": ("mx", "grouped_mm"),
}
_BOTH = frozenset({"linear", "grouped_mm"})


def requested_converters(names: list[str]) -> dict[str, frozenset[str]]:
    """``model.converters`` as {our converter name: the parts it converts} ("linear": the
    Linear layers; "grouped_mm": the MoE experts its ``moe_fqns_prototype`` names), in order.
    Our names convert both; upstream's name one part each. Raises one line for a repeat."""
    parts: dict[str, set[str]] = {}
    for name in names:
        ours, part = UPSTREAM_NAMES.get(name, (name, None))
        wanted = {part} if part else set(_BOTH)
        if names.count(name) > 1 or (parts.get(ours, set()) & wanted):
            same = [n for n in names if UPSTREAM_NAMES.get(n, (n,))[0] == ours]
            raise ConfigError(
                f"model.converters names {ours} more than once: {same}"
                + (f" (upstream's {', '.join(n for n in same if n != ours)} is {ours} here)"
                   if any(n != ours for n in same) else "")
            )
        parts.setdefault(ours, set()).update(wanted)
    return {name: frozenset(p) for name, p in parts.items()}


def converts_linears(converters: list[str], name: str) -> bool:
    """Whether converter ``name`` (``float8`` / ``mx``) converts the Linear layers when
    ``model.converters`` is ``converters``."""
    return "linear" in requested_converters(converters).get(name, ())


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
    target: Any = REGISTRY.get(UPSTREAM_NAMES.get(name, (name,))[0])
    if target is None:
        known = ", ".join(sorted(REGISTRY))
        close = suggest(name, sorted([*REGISTRY, *UPSTREAM_NAMES]))
        hint = f" (did you mean {close!r}?)" if close else ""
        raise ConfigError(f"model.converters: unknown converter {name!r}{hint}; known: {known}")
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
    return target


def _classes(job_config: JobConfig) -> list[type[ModelConverter]]:
    classes = []
    for name, parts in requested_converters(job_config.model.converters).items():
        cls = converter_class(name)
        if parts == {"grouped_mm"} and not getattr(job_config, name).moe_fqns_prototype:
            raise ConfigError(
                f"model.converters quantize.grouped_mm.{name} converts the MoE experts that "
                f"quantize.grouped_mm.{name}.fqns ({name}.moe_fqns_prototype) names, and it is "
                "empty: name them (e.g. experts), or drop the converter"
            )
        classes.append(cls)
    return classes


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
