"""Where a forward pass turned non-finite: the step's batch run again with a hook on every
module (the finite check's error line, when a NaN / inf loss came from finite weights).

The re-run is the step's forward on the same microbatches and weights (the optimizer step was
skipped), under the same contexts (weight copies, loss parallel, context parallel), without
gradients and eagerly (``torch.compiler.set_stance("force_eager")``, so the hooks of modules
inside compiled blocks fire). A module's forward hook runs after its submodules', so the first
hook to see a non-finite output names the innermost, earliest module that produced one (a
linear layer, say); a module whose inputs already are non-finite names the code that passed
them on: its nearest ancestor that runs code (attention, RoPE, a residual add between
submodules; not a ModuleDict). Every rank re-runs its own batch together (SPMD layouts:
FSDP, DDP, TP, CP, EP); the earliest finding over the ranks is reported. Pipeline-parallel
runs are not probed (their forward is a schedule).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.distributed.comm_mode.local_tensor_load import checkpoint_fqn
from torchtitan.distributed.utils import all_finite

__all__ = ["describe_forward", "first_non_finite_output"]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _finite(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex()) or all_finite(t.detach())


def _all_finite(value: Any) -> bool:
    return all(_finite(t) for t in _tensors(value))


def _code_owner(raw_name: str, modules: dict[str, torch.nn.Module]) -> str:
    """The nearest ancestor of module ``raw_name`` whose forward is code that calls it: not a
    ``ModuleDict`` / ``ModuleList`` (which hold modules and run nothing)."""
    parent = raw_name
    while parent:
        parent = parent.rpartition(".")[0]
        if not isinstance(modules.get(parent), (torch.nn.ModuleDict, torch.nn.ModuleList)):
            break
    return checkpoint_fqn(parent) or "the model"


@contextlib.contextmanager
def _module_hooks(model_parts: Sequence[torch.nn.Module], found: list[str]):
    """Hooks on every module that record, once, where the first non-finite value appeared: a
    module whose output is non-finite from finite inputs (its own code, or a submodule's,
    whose hook fired first), or, when a module's inputs already are, its parent's own code
    before it (a functional op between submodules: RoPE, attention, a residual add)."""
    handles = []

    def hooks_for(name: str, parent: str):
        def before(module, args, kwargs):
            if not found and not (_all_finite(args) and _all_finite(kwargs)):
                found.append(f"{parent} (its own code, before {name})")

        def after(module, args, kwargs, output):
            if not found and not _all_finite(output):
                found.append(name)

        return before, after

    for part in model_parts:
        modules = dict(part.named_modules())
        for raw_name, module in modules.items():
            name = checkpoint_fqn(raw_name) or "the model"
            before, after = hooks_for(name, _code_owner(raw_name, modules))
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _earliest_over_ranks(finding: tuple[int, str] | None) -> tuple[int, str] | None:
    """The finding of the lowest microbatch over the ranks (the lowest rank on a tie)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return finding
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, finding)
    found = [f for f in gathered if f is not None]
    return min(found, key=lambda f: f[0]) if found else None


def first_non_finite_output(run: Any, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]
                            ) -> tuple[int, str] | None:
    """``(microbatch index from 1, module name)`` of the first module output with a non-finite
    value when ``run``'s forward re-runs ``microbatches``; ``"loss"`` when every module output
    was finite and the loss was not. None: all finite, or not probed (pipeline parallel)."""
    from torchtitan.step import loss_context, model_inputs, sequence_context

    if run.pipeline is not None or not microbatches:
        return None
    copies = run.weight_copies.active() if run.weight_copies is not None else contextlib.nullcontext()
    finding = None
    with run.comm_mode.step(), torch.no_grad(), torch.compiler.set_stance("force_eager"), \
            copies:
        for i, (inputs, labels) in enumerate(microbatches, start=1):
            if run.parallel_dims.cp_enabled:  # sharded in place by the context
                inputs, labels = inputs.clone(), labels.clone()
            found: list[str] = []
            kwargs = model_inputs(run, inputs, labels)
            with loss_context(run), sequence_context(run, inputs, labels), \
                    _module_hooks(run.model_parts, found):
                loss = run.loss_fn(run.model_parts[0](inputs, **kwargs), labels)
            if not found and not _finite(loss):
                found.append("loss")
            if found and finding is None:
                finding = (i, found[0])
    return _earliest_over_ranks(finding)


def describe_forward(run: Any, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """The error line's sentence on the re-run of the step's forward (empty when not probed, or
    when the re-run itself failed: the error line must not be lost to it)."""
    from torchtitan.tools.logging import logger

    if run.pipeline is not None or not microbatches:
        return ""
    try:
        finding = first_non_finite_output(run, microbatches)
    except Exception as err:  # noqa: BLE001 - a diagnosis, never a second failure
        logger.warning(f"the forward re-run that locates a non-finite value failed: {err}")
        return ""
    of = f"of {len(microbatches)}"
    if finding is None:
        return ("Re-run on the same batch, the forward stayed finite: the non-finite value did "
                "not reproduce (a nondeterministic kernel?).")
    i, name = finding
    if name == "loss":
        return (f"Re-run on the same batch, every module output was finite and the loss was not "
                f"(microbatch {i} {of}).")
    return (f"Re-run on the same batch, the first non-finite value comes out of {name} "
            f"(microbatch {i} {of}).")
