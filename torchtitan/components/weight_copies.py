"""Low-precision copies of the matmul weights, written by the optimizer step
(``training.weight_copies``).

Under autocast (one device: no FSDP, no data, tensor, context or pipeline parallelism) every
forward casts each float32 matmul weight to the compute dtype (read 4 bytes, write 2 per
parameter), the backward casts each weight gradient back to float32 (read 2, write 4), and
the gradient norm and the optimizer read float32 gradients (4 bytes each). With copies, each
plain ``nn.Linear`` weight (and the decoder's untied output projection; with ``on``, torchao's
``Float8Linear`` weights of a float8 run too) has a copy in the compute dtype: during the step
(:meth:`WeightCopies.active`: forward, backward, the gradient norm) the module holds its copy as its ``weight``, so autocast finds it already cast, its
gradient stays in the compute dtype (the same values: autocast's cast back to float32 is
exact), the norm reads it with float32 accumulation, and the optimizer step reads it, updates
the float32 weight and its state in float32 and writes the new copy in the same kernel
(:class:`~torchtitan.components.adamw_bf16_state.AdamBF16State`). About 14 bytes of memory
traffic less per weight and step, and half the gradient memory.

Memory: a plain linear's copy takes the place of the cast autocast would hold from the forward
to the backward anyway, so ``auto`` costs no memory at the peak. A ``Float8Linear`` casts its
float32 weight straight to float8, so its copy (2 bytes a parameter, for the whole run) is
memory the plain float8 path never holds: only ``on`` copies those (faster casts and bfloat16
gradients for that memory). ``auto`` gives a ``Float8Linear`` a gradient view
instead (``float8_grad_views.py``): its gradient stays bfloat16 through a view of its own
weight's storage, which stands in like a copy and is never written.

Outside :meth:`~WeightCopies.active` the float32 weights are the modules' parameters as
always: checkpoints, the optimizer's state, exports and the memory figures see them. A copy
whose weight changed in place since it was written (a checkpoint load, an initialisation) is
refreshed when the step begins (tensor version counters tell).

Numerics: the forward and backward are the autocast path's bit for bit; the gradient norm and
the AdamW step equal torch's within float32 rounding. A ``Float8Linear`` casts its copy rather
than the float32 weight to float8 (what it casts under FSDP's bf16 mixed precision): its float8
scale can differ in the last bits, losses within 5e-5 (tests/unit/test_weight_copies.py).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from torchtitan.components.float8_grad_views import attach_grad_view, supports_grad_view

__all__ = [
    "WeightCopies",
    "build_weight_copies",
    "check_weight_copies",
    "choose_weight_copies",
    "uncopied_float8_linears",
    "weight_copies_obstacle",
]


class WeightCopies:
    """The copied modules with their float32 weights and the copies (``dtype``)."""

    def __init__(self, modules: Sequence[nn.Module], dtype: torch.dtype,
                 view_modules: Sequence[nn.Module] = ()) -> None:
        self.dtype = dtype
        self.modules = list(modules)
        self.masters = [m.weight for m in self.modules]
        with torch.no_grad():
            self.copies = [nn.Parameter(w.detach().to(dtype), requires_grad=w.requires_grad)
                           for w in self.masters]
        self._copy_of = {id(w): c for w, c in zip(self.masters, self.copies)}
        self._index = {id(w): i for i, w in enumerate(self.masters)}
        self._versions = [w._version for w in self.masters]
        # Float8Linear gradient views (float8_grad_views.py): bf16 leaves over the weights'
        # own storage, standing in like copies, never written
        self.view_modules = list(view_modules)
        self.view_masters = [m.weight for m in self.view_modules]
        self.views = [attach_grad_view(m) for m in self.view_modules]
        self._view_of = {id(w): v for w, v in zip(self.view_masters, self.views)}
        self._depth = 0

    def __len__(self) -> int:
        """The copied modules (gradient views not counted)."""
        return len(self.modules)

    def __bool__(self) -> bool:
        return bool(self.modules or self.view_modules)

    def copy_of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``weight``'s copy (None: not copied; a gradient view is no copy to write)."""
        return self._copy_of.get(id(weight))

    def grad_of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``weight``'s gradient of the step: its copy's or gradient view's where it has one
        (else its own, which torch's checkpoint loader sets to initialise the optimizer
        state)."""
        stand_in = self._copy_of.get(id(weight))
        if stand_in is None:
            stand_in = self._view_of.get(id(weight))
        return stand_in.grad if stand_in is not None and stand_in.grad is not None else weight.grad

    def written(self, weight: torch.Tensor) -> None:
        """The optimizer wrote ``weight`` and its copy together: the copy is current."""
        i = self._index.get(id(weight))
        if i is not None:
            self._versions[i] = weight._version

    @torch.no_grad()
    def refresh(self) -> None:
        """Rewrite every copy whose weight changed since it was written (e.g. loaded)."""
        for i, (w, c) in enumerate(zip(self.masters, self.copies)):
            if w._version != self._versions[i]:
                c.copy_(w)
                self._versions[i] = w._version

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The copies stand in for the weights (forward, backward, gradient norm); nested
        uses keep them in until the outermost ends."""
        if self._depth == 0:
            self.refresh()
            for m, c in zip(self.modules + self.view_modules, self.copies + self.views):
                m._parameters["weight"] = c
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                for m, w in zip(self.modules + self.view_modules,
                                self.masters + self.view_masters):
                    m._parameters["weight"] = w

    def zero_grad(self) -> None:
        for c in self.copies + self.views:
            c.grad = None


def _float8_linear_type() -> type | None:
    """torchao's ``Float8Linear`` when torchao is already imported (a float8 run imported it
    to convert the model), else None."""
    module = sys.modules.get("torchao.float8.float8_linear")
    return getattr(module, "Float8Linear", None)


def _copyable(module: nn.Module, float8: bool = True) -> bool:
    """A plain ``nn.Linear`` (or the decoder's output head), whose forward is ``F.linear`` on
    its weight, or torchao's ``Float8Linear``, which casts its weight to float8 in the forward
    and returns its gradient in the compute dtype: with a copy, the cast reads 2 bytes a
    parameter rather than 4 (as under FSDP's bf16 mixed precision) and the gradient is not
    widened to float32. Other subclasses (MX, anything unknown) and weights that are tensor
    subclasses (DTensor, float8 all-gather weights) are not copied."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    from torchtitan.models.common.decoder import OutputHead

    weight = getattr(module, "weight", None)
    kinds = (nn.Linear, OutputHead, _float8_linear_type() if float8 else None)
    return (type(module) in kinds and isinstance(weight, torch.Tensor)
            and not is_traceable_wrapper_subclass(weight) and weight.dtype == torch.float32)


def _shared_weights(model_parts: Sequence[nn.Module]) -> set[int]:
    """ids of parameters that more than one module holds (tied embeddings)."""
    seen: dict[int, int] = {}
    for part in model_parts:
        for _, p in part.named_parameters(remove_duplicate=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, n in seen.items() if n > 1}


def build_weight_copies(model_parts: Sequence[nn.Module], dtype: torch.dtype,
                        float8: bool = True, grad_views: bool = True) -> WeightCopies:
    """Copies of every copyable module's weight in ``model_parts`` (tied weights excluded:
    the embedding reads them too); ``float8=False``: ``Float8Linear`` weights get no copy
    but a gradient view (bf16 compute dtype; ``grad_views``)."""
    shared = _shared_weights(model_parts)
    candidates = [m for part in model_parts for m in part.modules()
                  if _copyable(m) and id(m.weight) not in shared]
    modules = [m for m in candidates if float8 or _copyable(m, float8=False)]
    views = [] if float8 or not grad_views or dtype != torch.bfloat16 else [
        m for m in candidates if m not in modules and supports_grad_view(m)]
    return WeightCopies(modules, dtype, views)


def uncopied_float8_linears(model_parts: Sequence[nn.Module]) -> int:
    """How many ``Float8Linear`` modules ``on`` would copy besides what ``auto`` copies."""
    kind = _float8_linear_type()
    return 0 if kind is None else sum(
        1 for part in model_parts for m in part.modules() if type(m) is kind and _copyable(m))


def weight_copies_obstacle(cfg: Any, parallel_dims: Any, autocast: torch.dtype | None,
                           grad_accum: int = 1) -> str | None:
    """Why ``training.weight_copies`` cannot apply to this run (None: it can);
    ``grad_accum``: microbatches per optimizer step."""
    if autocast is None:
        return ("the run does not autocast (FSDP's mixed precision, training.dtype bfloat16 or "
                "float32 matmuls)")
    degrees = {name: getattr(parallel_dims, name, 1) for name in
               ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")}
    parallel = [f"{name}={d}" for name, d in degrees.items() if d > 1]
    if parallel:
        return f"the copies are for one device, and this run is parallel ({', '.join(parallel)})"
    if grad_accum > 1:
        return (f"gradient accumulation ({grad_accum} microbatches per step) would sum the "
                "gradients in the copies' precision")
    if cfg.fault_tolerance.enable:
        return "fault tolerance averages the float32 gradients across replica groups"
    opt = cfg.optimizer
    if opt.early_step_in_backward:
        return "optimizer.early_step_in_backward steps each parameter in the backward"
    if opt.implementation != "fused":
        return (f"optimizer.implementation={opt.implementation} asks for torch's kernel; the "
                "copies need the project's own step (the fused default)")
    if cfg.training.max_norm > 0 and not opt.clip_in_step:
        return ("optimizer.no_clip_in_step rescales the gradients in place, in the copies' "
                "precision; clipping must happen in the optimizer step")
    return None


def check_weight_copies(cfg: Any, parallel_dims: Any, autocast: torch.dtype | None,
                        grad_accum: int) -> None:
    """The plan's rule: ``training.weight_copies=on`` where it cannot apply is a one-line
    ValueError."""
    if cfg.training.weight_copies == "on":
        obstacle = weight_copies_obstacle(cfg, parallel_dims, autocast, grad_accum)
        if obstacle is not None:
            raise ValueError(f"training.weight_copies=on cannot apply: {obstacle}")


def choose_weight_copies(cfg: Any, parallel_dims: Any, autocast: torch.dtype | None,
                         device_type: str, grad_accum: int = 1) -> bool:
    """Whether the run keeps weight copies (``training.weight_copies``: ``auto`` on CUDA where
    it applies, the plain path elsewhere, as every CPU exactness test expects; ``on`` where it
    cannot apply is a one-line ValueError)."""
    mode = cfg.training.weight_copies
    if mode == "off":
        return False
    obstacle = weight_copies_obstacle(cfg, parallel_dims, autocast, grad_accum)
    if obstacle is not None:
        if mode == "on":
            raise ValueError(f"training.weight_copies=on cannot apply: {obstacle}")
        return False
    return mode == "on" or device_type == "cuda"
