"""Adam / AdamW whose moments are kept in bfloat16 (``optimizer.state_dtype = "bfloat16"``).

torch's fused and foreach Adam keep ``exp_avg`` and ``exp_avg_sq`` in the parameters' dtype:
8 bytes of state per float32 parameter, and a step that reads and writes 28 bytes per
parameter (p, grad, exp_avg, exp_avg_sq read; p and both moments written). Here both moments
are bfloat16: 4 bytes of state, 20 bytes of traffic. The update itself runs in float32: the
moments are widened, updated, used for this step at full precision, and only their stored copy
is rounded (to nearest) to bfloat16. Parameters keep their dtype.

Each parameter's step is one function of elementwise ops; on CUDA it is compiled (one fused
kernel per parameter), elsewhere (the CPU, the memory estimator's fake tensors) it runs
eagerly. DTensor parameters (FSDP2, TP) step on their local shards: every tensor of the step
shares the parameter's placements.

Checkpoints have torch's Adam keys (``step``, ``exp_avg``, ``exp_avg_sq``, the same
param-group keys), so a run can switch ``state_dtype`` at a resume: float32 moments loaded
here are rounded to bfloat16, bfloat16 ones loaded by torch's Adam are widened exactly.
"""

from __future__ import annotations

import contextlib
import functools
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["AdamBF16State", "adam_bf16_state_step", "check_state_dtype", "compiled_step"]

_MOMENTS = ("exp_avg", "exp_avg_sq")

# The param-group keys of torch's Adam/AdamW besides the hyperparameters: held with this
# optimizer's fixed values so checkpoints of both have the same keys.
_FIXED_OPTIONS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}

_MIN_DECAY = 2.0**-8
"""bfloat16's relative precision: a moment multiplied by beta rounds back to itself when
1 - beta is below it (for some values; for all of them below 2**-9)."""


def check_state_dtype(cfg: Any) -> None:
    """Raise ValueError where ``optimizer.state_dtype="bfloat16"`` cannot serve ``cfg`` (the
    ``[optimizer]`` section)."""
    if cfg.state_dtype != "bfloat16":
        return
    if cfg.implementation != "fused":
        raise ValueError(
            f"optimizer.implementation={cfg.implementation} chooses torch's kernel for float32 "
            "optimizer state; optimizer.state_dtype=bfloat16 has its own step (compiled per "
            "parameter on CUDA): leave optimizer.implementation at fused"
        )
    for name in ("beta1", "beta2"):
        beta = getattr(cfg, name)
        if 1.0 - beta < _MIN_DECAY:
            raise ValueError(
                f"optimizer.{name}={beta} with optimizer.state_dtype=bfloat16: a decay by "
                f"{beta} is below bfloat16's precision (2**-8), so the moment would round back "
                f"to its old value and stop decaying; use {name} <= {1 - _MIN_DECAY} or "
                "optimizer.state_dtype=float32"
            )


def adam_bf16_state_step(
    p: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: Tensor,
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    grad_divisor: Tensor | None = None,
    weight_copy: Tensor | None = None,
) -> None:
    """One Adam(W) step of one (local) parameter, in float32; the moments are stored rounded to
    their own dtype. ``step`` (already counting this step) and ``lr`` are 0-dim float32;
    ``grad_divisor`` (0-dim float32, e.g. the clip factor) divides the gradient as it is read,
    before weight decay, as torch's fused kernel does with its ``grad_scale``;
    ``weight_copy`` (a low-precision copy of ``p``, ``training.weight_copies``) is written from
    the updated weight."""
    p32 = p.float()  # p itself when float32: updated in place
    g = grad.float()
    if grad_divisor is not None:
        g = g / grad_divisor if g is grad else g.div_(grad_divisor)
    if weight_decay != 0:
        if decoupled:
            p32.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p32, alpha=weight_decay)
    # the moments in float32: float32 state in place, bfloat16 state widened (eagerly, e.g.
    # the CPU or the memory estimate: as few full-size temporaries as the math allows)
    m, v = exp_avg.float(), exp_avg_sq.float()
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if m is not exp_avg:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step).sqrt()
    denom = v.sqrt() if v is exp_avg_sq else v.sqrt_()
    denom.div_(bias_correction2_sqrt).add_(eps)
    update = torch.div(m, denom, out=denom) if m is exp_avg else m.div_(denom)
    p32.sub_(update.mul_(lr / bias_correction1))
    if p32 is not p:
        p.copy_(p32)
    if weight_copy is not None:
        weight_copy.copy_(p32)


@functools.cache
def compiled_step(backend: Any = "inductor") -> Any:
    """:func:`adam_bf16_state_step` compiled, one graph per parameter shape and dtype. Static
    shapes on purpose: with torch's automatic dynamic shapes the third distinct shape would
    give a graph for any ``[s0, s1]``, whose kernel cannot know that its element count is a
    multiple of 16, so its loads are masked element by element instead of vectorised (the
    step is bound by memory bandwidth). A model has a handful of shapes; ``step`` lifts the
    recompile limit around the call."""
    return torch.compile(adam_bf16_state_step, fullgraph=True, dynamic=False, backend=backend)


def _step_fn(p: Tensor):
    """The compiled step for plain CUDA tensors, the eager one for anything else (CPU, fake
    and local-simulation tensors)."""
    if not p.is_cuda or type(p) not in (Tensor, torch.nn.Parameter):
        return adam_bf16_state_step
    return compiled_step()


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class AdamBF16State(torch.optim.Optimizer):
    """Adam (``decoupled_weight_decay=False``) or AdamW with bfloat16 moments and float32 math.
    Setting ``grad_scale`` (a 0-dim float32 tensor, as on torch's fused Adam) makes the next
    :meth:`step` use ``gradient / grad_scale`` inside its kernel."""

    divides_by_grad_scale = True
    grad_scale: Tensor | None = None
    weight_copies: Any = None
    """A :class:`~torchtitan.components.weight_copies.WeightCopies`: a copied weight's
    gradient is its copy's, and the step writes the copy."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = True,
        state_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"invalid lr={lr}, eps={eps} or weight_decay={weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas={betas}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay, **_FIXED_OPTIONS)
        super().__init__(params, defaults)
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Step every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = group["lr"]
            if not isinstance(lr, Tensor):
                lr = torch.tensor(lr, dtype=torch.float32)
            beta1, beta2 = group["betas"]
            divisor = self.grad_scale
            for p in group["params"]:
                copies = self.weight_copies
                copy = copies.copy_of(p) if copies is not None else None
                grad = copies.grad_of(p) if copies is not None else p.grad
                if grad is None:
                    continue
                if isinstance(p, DTensor) and grad.placements != p.placements:
                    grad = grad.redistribute(p.device_mesh, p.placements)
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    for key in _MOMENTS:
                        state[key] = torch.zeros_like(
                            p, dtype=self.state_dtype, memory_format=torch.preserve_format
                        )
                state["step"] += 1
                local = _local(p)
                fn = _step_fn(local)
                with _no_recompile_limit(fn):
                    fn(
                        local, _local(grad), _local(state["exp_avg"]),
                        _local(state["exp_avg_sq"]), state["step"], lr, beta1, beta2,
                        group["eps"], group["weight_decay"], group["decoupled_weight_decay"],
                        None if divisor is None else divisor.to(local.device),
                        copy,
                    )
                if copy is not None:
                    self.weight_copies.written(p)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.weight_copies is not None:
            self.weight_copies.zero_grad()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, keeping the moments in ``state_dtype`` (torch would cast them to the
        parameters' dtype) and this optimizer's fixed options."""
        moments: dict[Any, dict[str, Tensor]] = {}
        rest: dict[Any, Any] = {}
        for pid, saved in state_dict["state"].items():
            saved = dict(saved)
            moments[pid] = {k: saved.pop(k) for k in _MOMENTS if k in saved}
            rest[pid] = saved
        decoupled = [g["decoupled_weight_decay"] for g in self.param_groups]
        super().load_state_dict({**state_dict, "state": rest})
        for group, dec in zip(self.param_groups, decoupled):
            group.update(_FIXED_OPTIONS, decoupled_weight_decay=dec)
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        by_id = dict(zip(saved_ids, params))
        for pid, tensors in moments.items():
            p = by_id.get(pid)
            if p is None:
                continue
            for key, value in tensors.items():
                self.state[p][key] = value.to(device=p.device, dtype=self.state_dtype)
            step = self.state[p].get("step")
            if isinstance(step, Tensor):
                self.state[p]["step"] = step.to(device="cpu", dtype=torch.float32)


def _no_recompile_limit(fn: Any):
    """Compiled steps specialise per shape and dtype (:func:`compiled_step`); a model has a
    handful of each, which the default recompile limit may cut short (eager fallback)."""
    if fn is adam_bf16_state_step:
        return contextlib.nullcontext()
    return torch._dynamo.utils.disable_cache_limit()
