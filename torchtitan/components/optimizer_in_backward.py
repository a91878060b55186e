"""``optimizer.early_step_in_backward``: each parameter steps as soon as its gradient is final.

Every trainable parameter gets its own optimizer, stepped from the parameter's
post-accumulate-grad hook, which then frees the gradient: the full set of gradients never
exists at once. That lowers the peak where gradients set it; where activations do (the memory
estimate of Llama 3 8B on FSDP8 keeps its 40.2 GiB peak) it changes nothing. Under FSDP2 the
hook runs after the gradient's reduce-scatter, on the sharded gradient.

What this excludes (refused by :func:`check_early_step`): clipping by the global grad norm
(unknown until every gradient exists), pipeline parallel and classic DDP (gradients are final
only after their schedule or bucketed all-reduce; DDP with TP replicates through FSDP2, whose
hooks run on the all-reduced gradient, and works), expert parallel and MoE layers under TP with
``expert_tensor_parallel_degree`` 1 (their expert / router gradients are rescaled or summed over
tp after backward) and fault tolerance (it all-reduces gradients after backward, or reads the live
weights between optimizer steps). Gradient accumulation works: only the last microbatch's
backward steps (the container is armed for it). The grad norm is still measured: each hook
records its gradient's norm, reduced once after backward.

Checkpoints are the flattened, FQN-keyed optimizer state of all parameters, the same keys as
:class:`~torchtitan.components.optimizer.OptimizersContainer` writes, so a run can switch
between the two on resume.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchtitan.components.optimizer import (
    OptimizersContainer,
    _construct,
    build_optimizers,
    optimizer_class,
)
from torchtitan.config.job_config import Optimizer as OptimizerConfig

__all__ = ["OptimizersInBackwardContainer", "build_optimizers_in_backward", "check_early_step"]


def build_optimizers_in_backward(
    model_parts: list[nn.Module], cfg: OptimizerConfig, weight_copies: Any = None
) -> OptimizersContainer:
    """The ``[optimizer]`` section's optimizers: one per parameter, stepped in backward, with
    ``early_step_in_backward``; else the usual container (with ``weight_copies``)."""
    if not cfg.early_step_in_backward:
        return build_optimizers(model_parts, cfg, weight_copies)
    return OptimizersInBackwardContainer(model_parts, *optimizer_class(cfg))


def check_early_step(cfg: Any, parallel_dims: Any, has_moe: bool = False) -> None:
    """Raise ValueError when ``optimizer.early_step_in_backward`` cannot be honoured
    (``has_moe``: the model has mixture-of-experts layers)."""
    if not cfg.optimizer.early_step_in_backward:
        return
    why = None
    if cfg.training.max_norm > 0:
        why = (
            f"training.max_norm={cfg.training.max_norm} clips by the global grad norm, which "
            "is known only once every parameter has stepped: set --training.max_norm 0"
        )
    elif parallel_dims.pp_enabled:
        why = "pipeline parallel runs backward per pipeline microbatch inside its schedule"
    elif (parallel_dims.dp_replicate_enabled and not parallel_dims.fsdp_enabled
          and not parallel_dims.tp_enabled):
        why = ("DDP all-reduces gradients in buckets after the hooks fire; use FSDP or HSDP "
               "(or DDP with tensor parallelism, which replicates through FSDP2)")
    elif parallel_dims.ep_enabled:
        why = "expert parallel rescales the expert gradients after backward"
    elif has_moe and parallel_dims.tp_splits_moe_tokens:
        why = (
            "under tensor parallel the MoE layers sum their router and expert gradients over "
            "the TP ranks after backward (each rank routes its own tokens); set "
            f"parallelism.expert_tensor_parallel_degree={parallel_dims.tp}"
        )
    elif cfg.fault_tolerance.enable:
        why = (
            "fault tolerance all-reduces gradients across groups after backward (or, "
            "semi-synchronous, lets a rejoining group copy the weights outside the optimizer "
            "step, and here they change during backward)"
        )
    if why:
        raise ValueError(f"optimizer.early_step_in_backward does not work here: {why}")


class OptimizersInBackwardContainer(OptimizersContainer):
    """One optimizer per parameter, stepped (then its gradient freed) from the parameter's
    post-accumulate-grad hook while :attr:`armed`; :meth:`step` does nothing."""

    steps_in_backward = True

    def __init__(self, model_parts: list[nn.Module], cls: type, kwargs: dict[str, Any]) -> None:
        self.model_parts = model_parts
        self.optimizers = []
        self._per_part: list[list[torch.optim.Optimizer]] = []
        self.fqn_aliases = [{} for _ in model_parts]
        self._norms: dict[object, list[torch.Tensor]] = defaultdict(list)
        self.armed = True
        for part in model_parts:
            opts = []
            for p in part.parameters():
                if not p.requires_grad:
                    continue
                opt = _construct(cls, [p], kwargs)
                p.register_post_accumulate_grad_hook(self._hook(opt))
                opts.append(opt)
            self._per_part.append(opts)
            self.optimizers.extend(opts)

    def _hook(self, opt: torch.optim.Optimizer):
        def step_now(param: torch.Tensor) -> None:
            if not self.armed or param.grad is None:
                return
            grad = param.grad
            norm = torch.linalg.vector_norm(grad, 2.0)  # a DTensor stays lazy (no collective)
            self._norms[grad.device_mesh if isinstance(grad, DTensor) else None].append(norm)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step_now

    def before_backward(self, final: bool) -> None:
        """Arm the hooks for the step's last microbatch only (earlier ones accumulate)."""
        self.armed = final

    def step(self) -> None:
        """Nothing: every parameter stepped in backward."""

    def take_grad_norms(self) -> dict[object, list[torch.Tensor]]:
        """The norms of the gradients the hooks stepped with, by device mesh; cleared."""
        norms, self._norms = dict(self._norms), defaultdict(list)
        return norms
