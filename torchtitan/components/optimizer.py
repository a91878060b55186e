"""Optimizers for one or more model parts, as one Stateful object."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.config.job_config import Optimizer as OptimizerConfig

_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}

_KERNEL_KEYS = ("fused", "foreach")
"""Param-group keys that choose the kernel: the run's config sets them, not a checkpoint."""

_CONFIG_KEYS = ("betas", "eps", "weight_decay", "decoupled_weight_decay")
"""Param-group hyperparameters from ``[optimizer]`` (``decoupled_weight_decay``: AdamW vs Adam):
a resumed run uses this config's, not the checkpoint's (the peak lr has its own rule:
``lr_scheduler.reconcile_peak_lr``)."""


def optimizer_kwargs(cfg: OptimizerConfig) -> dict[str, Any]:
    """Constructor kwargs for ``cfg.name`` (lr, betas, eps, weight decay, kernel choice)."""
    kwargs: dict[str, Any] = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
    }
    if cfg.implementation == "fused":
        kwargs["fused"] = True
    elif cfg.implementation == "foreach":
        kwargs["foreach"] = True
    else:
        kwargs["foreach"] = False
    return kwargs


def optimizer_class(cfg: OptimizerConfig, own_step: bool = False) -> tuple[type, dict[str, Any]]:
    """The optimizer class and its constructor kwargs for ``cfg`` (``state_dtype="bfloat16"``,
    or ``own_step`` (weight copies): :class:`~torchtitan.components.adamw_bf16_state.
    AdamBF16State` with the state in ``state_dtype``)."""
    _check_name(cfg)
    if cfg.state_dtype == "bfloat16" or own_step:
        from torchtitan.components.adamw_bf16_state import AdamBF16State

        kwargs = {k: v for k, v in optimizer_kwargs(cfg).items() if k not in _KERNEL_KEYS}
        return AdamBF16State, {**kwargs, "decoupled_weight_decay": cfg.name == "AdamW",
                               "state_dtype": getattr(torch, cfg.state_dtype)}
    return _OPTIMIZERS[cfg.name], optimizer_kwargs(cfg)


class OptimizersContainer(Stateful):
    """One optimizer per model part; stepped, zeroed and checkpointed together.

    The state dict is the flattened (FQN-keyed) optimizer state of all parts, so a
    checkpoint does not depend on how the model was split into parts or sharded.
    """

    def __init__(self, model_parts: list[nn.Module], cfg: OptimizerConfig,
                 weight_copies: Any = None) -> None:
        self.model_parts = model_parts
        cls, kwargs = optimizer_class(cfg, own_step=weight_copies is not None)
        self.optimizers: list[torch.optim.Optimizer] = []
        for part in model_parts:
            params = [p for p in part.parameters() if p.requires_grad]
            self.optimizers.append(_construct(cls, _groups_by_mesh(params), kwargs))
            if weight_copies is not None:  # gradients from the copies, which the step writes
                self.optimizers[-1].weight_copies = weight_copies
        self._per_part: list[Any] = list(self.optimizers)
        """Each part's optimizer (or list of optimizers): what its state dict is built from."""
        self.fqn_aliases: list[dict[str, str]] = [{} for _ in model_parts]
        """Per part, ``{parameter FQN: the FQN its state is saved under}`` (a pipeline stage's
        copy of a tied weight keeps its state under the name the unsplit model uses)."""

    steps_in_backward = False
    """True when the parameters step during backward (``optimizer_in_backward``)."""

    def before_backward(self, final: bool) -> None:
        """Called before each microbatch's backward (``final``: the step's last)."""

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def clips_in_step(self) -> bool:
        """Every optimizer divides the gradients by a device scalar inside its kernel (torch's
        fused Adam/AdamW with ``grad_scale``, AMP's unscale; the bfloat16-state AdamW):
        clipping then costs no pass of its own over the gradients (:meth:`set_grad_divisor`)."""
        return bool(self.optimizers) and all(
            getattr(opt, "divides_by_grad_scale", False)
            or (getattr(opt, "_step_supports_amp_scaling", False)
                and all(g.get("fused") for g in opt.param_groups))
            for opt in self.optimizers
        )

    def set_grad_divisor(self, divisor: torch.Tensor) -> None:
        """The next :meth:`step` uses ``gradient / divisor`` (a 0-dim float32 device tensor)."""
        for opt in self.optimizers:
            opt.grad_scale = divisor

    def step(self) -> None:
        try:
            for opt in self.optimizers:
                opt.step()
        finally:
            for opt in self.optimizers:
                opt.grad_scale = None

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        merged: dict[str, Any] = {}
        for part, opt, aliases in zip(self.model_parts, self._per_part, self.fqn_aliases):
            merged.update(_renamed(get_optimizer_state_dict(part, opt, options=opts), aliases))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A checkpoint's kernel choice (e.g. from a run with other optimizer.state_dtype or
        # implementation) and hyperparameters would replace this run's: keep this run's.
        kept = _KERNEL_KEYS + _CONFIG_KEYS
        this_run = [[{k: g[k] for k in kept if k in g} for g in opt.param_groups]
                    for opt in self.optimizers]
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        for part, opt, aliases in zip(self.model_parts, self._per_part, self.fqn_aliases):
            back = {saved: own for own, saved in aliases.items()}
            set_optimizer_state_dict(
                part, opt, optim_state_dict=_renamed(state_dict, back), options=opts
            )
        changed: dict[str, tuple[Any, Any]] = {}
        for opt, groups in zip(self.optimizers, this_run):
            for group, keys in zip(opt.param_groups, groups):
                for key in _CONFIG_KEYS:
                    if key in keys and group.get(key) != keys[key]:
                        changed.setdefault(key, (group.get(key), keys[key]))
                group.update(keys)
        if changed:
            from torchtitan.tools.logging import logger

            what = ", ".join(f"{key} {saved} -> {own}" for key, (saved, own) in changed.items())
            logger.warning(f"Checkpoint: the optimizer uses this config's settings, not the "
                           f"checkpoint's: {what}")


def _renamed(flat_state: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """``flat_state`` (keys ``state.<fqn>.<name>`` / ``param_groups.<fqn>.<name>``) with each
    FQN in ``aliases`` replaced by its alias."""
    if not aliases:
        return flat_state
    out = {}
    for key, value in flat_state.items():
        section, _, rest = key.partition(".")
        for fqn, alias in aliases.items():
            if rest.startswith(fqn + "."):
                key = f"{section}.{alias}{rest[len(fqn):]}"
                break
        out[key] = value
    return out


def _groups_by_mesh(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    """One param group per device mesh (plain tensors in their own): a foreach / fused kernel
    runs per group and cannot mix DTensors of different meshes or DTensors and plain tensors
    (e.g. TP-sharded attention beside MoE experts that TP leaves whole)."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return [{"params": group} for group in groups.values()]


def _construct(cls: type, params: list, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """Build the optimizer; a fused kernel the device lacks falls back to foreach."""
    try:
        if kwargs.get("fused"):
            _check_fused(params)  # torch checks devices only at the first step
        return cls(params, **kwargs)
    except RuntimeError as err:
        if not kwargs.get("fused"):
            raise
        from torchtitan.tools.logging import warn_once

        warn_once(f"fused optimizer unavailable here ({err}); using foreach")
        fallback = {k: v for k, v in kwargs.items() if k != "fused"}
        return cls(params, foreach=True, **fallback)


def _check_fused(params: list) -> None:
    """Raise torch's RuntimeError if a parameter's device or dtype has no fused kernel."""
    from torch.optim.optimizer import _device_dtype_check_for_fused

    for item in params:
        for p in item["params"] if isinstance(item, dict) else [item]:
            _device_dtype_check_for_fused(p)


def build_optimizers(model_parts: list[nn.Module], cfg: OptimizerConfig,
                     weight_copies: Any = None) -> OptimizersContainer:
    """Build the optimizers for ``model_parts`` from the ``[optimizer]`` section (with
    ``early_step_in_backward``: ``optimizer_in_backward.build_optimizers_in_backward``;
    ``weight_copies``: ``components/weight_copies.py``)."""
    return OptimizersContainer(model_parts, cfg, weight_copies)


def _check_name(cfg: OptimizerConfig) -> None:
    if cfg.name not in _OPTIMIZERS:
        raise ValueError(
            f"optimizer.name={cfg.name!r} is not supported; choose one of {sorted(_OPTIMIZERS)}"
        )
