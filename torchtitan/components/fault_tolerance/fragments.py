"""Streaming DiLoCo's model fragments: which modules synchronise together.

With ``fault_tolerance.num_fragments`` = N (or ``module_fqns_per_model_fragment``), DiLoCo
synchronises one fragment every ``sync_steps / N`` steps, in turn, so each fragment still syncs
every ``sync_steps`` steps while the cross-group traffic is spread out (torchft's streaming
DiLoCo). The units that make up fragments are those of pipeline splitting: the embedding, each
transformer block, the norm and the output.

A fragment is a module that holds its units under their model names, so its parameter names
are the model's FQNs (checkpoints and torchft's live state use them). On a pipeline stage that
holds none of a fragment's units the fragment is a single zero placeholder: torchft needs a
tensor to all-reduce at each fragment sync, and every rank takes part in every sync.

The MoE load-balancing biases (``expert_bias`` buffers) move with each group's own routing
between syncs; a fragment also holds them, as parameters that share the buffers' storage
(under :data:`ROUTING_BIASES`), so each sync reconciles them like the weights (LocalSGD
averages them, DiLoCo applies their averaged drift with the outer optimizer) and the groups
route alike afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from torchtitan.distributed.pipeline.stage_fqns import (
    generate_fqns_per_stage,
    group_units,
    units_of,
)

__all__ = [
    "PLACEHOLDER",
    "ROUTING_BIASES",
    "build_fragments",
    "fragment_units",
    "model_units",
    "routing_biases",
]

PLACEHOLDER = "empty_fragment_placeholder"
ROUTING_BIASES = "routing_biases"
"""The submodule of a fragment whose parameters alias its MoE layers' ``expert_bias`` buffers;
its ``fqns`` maps each parameter name to the buffer's model FQN."""
_KEY = "fault_tolerance.module_fqns_per_model_fragment"


def model_units(
    model_parts: Sequence[nn.Module], fqns_per_stage: Sequence[Sequence[str]] | None, n_layers: int
) -> list[str]:
    """Every unit of the whole model in order: this rank's parts' units, or with pipeline
    parallelism the units of all stages (``fqns_per_stage``; a whole ``layers`` entry counts
    as its ``n_layers`` blocks)."""
    if fqns_per_stage is None:
        return [u for part in model_parts for u in units_of(part)]
    return [
        u for stage in fqns_per_stage for name in stage
        for u in ([f"{name}.{i}" for i in range(n_layers)] if name == "layers" else [name])
    ]


def fragment_units(
    num_fragments: int, fqns_per_fragment: Sequence[Sequence[str]], all_units: Sequence[str],
    n_layers: int, tied: Sequence[str] = (),
) -> list[list[str]]:
    """The units of each fragment: ``fqns_per_fragment`` checked against the model (every unit
    in exactly one fragment), or ``num_fragments`` even slices of the layers, the embedding
    with the first and the norm and output with the last. ``tied``: units sharing a weight,
    which must sync together (under pipeline parallelism each holds its own copy, so
    :func:`build_fragments` cannot see the tie). Raises ValueError."""
    if not fqns_per_fragment:
        if num_fragments == 1:
            return [list(all_units)]
        if num_fragments > n_layers + 2:
            raise ValueError(
                f"fault_tolerance.num_fragments={num_fragments} is more than the model's "
                f"{n_layers} layers + embedding + output; use at most {n_layers + 2}"
            )
        fqns_per_fragment = generate_fqns_per_stage(num_fragments, n_layers)
    units = group_units(all_units, fqns_per_fragment, _KEY, "fragment")
    where = {unit: f for f, members in enumerate(units) for unit in members}
    placed = [(unit, where[unit]) for unit in tied if unit in where]
    if len({f for _, f in placed}) > 1:
        (a, fa), (b, fb) = placed[0], next(x for x in placed if x[1] != placed[0][1])
        raise ValueError(
            f"{_KEY}: {a} (fragment {fa}) and {b} (fragment {fb}) share one tied weight (the "
            "model ties its input and output embeddings); put both modules in the same fragment"
        )
    return units


def routing_biases(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of the MoE load-balancing biases (``expert_bias``) in ``module``."""
    return [(n, b) for n, b in module.named_buffers() if n.rsplit(".", 1)[-1] == "expert_bias"]


def build_fragments(
    model_parts: Sequence[nn.Module], units_per_fragment: Sequence[Sequence[str]]
) -> list[nn.Module]:
    """One module per fragment holding this rank's units of it by their model names (a zero
    placeholder parameter where it holds none) and their MoE routing biases. Raises ValueError
    when two fragments share a
    parameter (tied weights)."""
    local = {unit: part.get_submodule(unit) for part in model_parts for unit in units_of(part)}
    fragments = []
    for units in units_per_fragment:
        root = nn.Module()
        biases = nn.Module()
        biases.fqns = {}
        for unit in units:
            if unit in local:
                _add(root, unit, local[unit])
                for name, buf in routing_biases(local[unit]):
                    alias = f"b{len(biases.fqns)}"
                    biases.register_parameter(alias, nn.Parameter(buf, requires_grad=False))
                    biases.fqns[alias] = f"{unit}.{name}"
        if biases.fqns:
            root.add_module(ROUTING_BIASES, biases)
        if not any(True for _ in root.parameters()):
            device = next(p.device for part in model_parts for p in part.parameters())
            root.register_parameter(PLACEHOLDER, nn.Parameter(torch.zeros(1, device=device)))
        fragments.append(root)
    seen: dict[int, tuple[int, str]] = {}
    for f, fragment in enumerate(fragments):
        for name, p in fragment.named_parameters():
            if id(p) in seen:
                other, other_name = seen[id(p)]
                raise ValueError(
                    f"{_KEY}: {other_name} (fragment {other}) and {name} (fragment {f}) are one "
                    "tied weight; put both modules in the same fragment"
                )
            seen[id(p)] = (f, name)
    return fragments


def _add(root: nn.Module, fqn: str, module: nn.Module) -> None:
    *path, leaf = fqn.split(".")
    parent = root
    for name in path:
        if name not in parent._modules:
            parent.add_module(name, nn.Module())
        parent = parent._modules[name]
    parent.add_module(leaf, module)
