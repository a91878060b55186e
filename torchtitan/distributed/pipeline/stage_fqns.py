"""Which modules each pipeline stage holds: even splits of the layers, explicit per-stage FQN
lists and upstream's older split points, checked against the model (pure functions, shared
with streaming DiLoCo's fragments)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def generate_fqns_per_stage(
    num_stages: int,
    n_layers: int,
    input_weight: int = 1,
    output_weight: int = 1,
    *,
    input_modules: Sequence[str] = ("tok_embeddings",),
    output_modules: Sequence[str] = ("norm", "output"),
    layers_prefix: str = "layers",
) -> list[list[str]]:
    """Balanced module FQNs per stage.

    The input modules count as ``input_weight`` layers and the output modules as
    ``output_weight`` layers (``pipeline_parallel_first/last_stage_less_layers``); the
    ``n_layers + input_weight + output_weight`` units are spread as evenly as possible, earlier
    stages taking the remainder.
    """
    if input_weight < 0 or output_weight < 0:
        raise ValueError(
            "parallelism.pipeline_parallel_first_stage_less_layers and "
            f"last_stage_less_layers must be >= 0, got {input_weight} and {output_weight}"
        )
    layer = [f"{layers_prefix}.{i}" for i in range(n_layers)]
    if num_stages == 1:
        return [[*input_modules, *layer, *output_modules]]
    units = n_layers + input_weight + output_weight
    how = (
        f"n_layers={n_layers} (+{input_weight} for the embedding, +{output_weight} for the "
        f"output, from pipeline_parallel_first/last_stage_less_layers)"
    )
    if num_stages > units:
        raise ValueError(
            f"cannot split {how} into {num_stages} pipeline stages: every stage needs at least "
            "one unit; lower parallelism.pipeline_parallel_degree or raise "
            "pipeline_parallel_layers_per_stage"
        )
    base, extra = divmod(units, num_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    n_first, n_last = sizes[0] - input_weight, sizes[-1] - output_weight
    if n_first < 0 or n_last < 0:
        raise ValueError(
            f"cannot split {how} into {num_stages} pipeline stages: a stage holds only "
            f"{min(sizes)} units, fewer than the embedding/output weight; lower "
            "pipeline_parallel_first_stage_less_layers / last_stage_less_layers or use fewer stages"
        )
    out: list[list[str]] = []
    nxt = 0
    for s, size in enumerate(sizes):
        count = n_first if s == 0 else n_last if s == num_stages - 1 else size
        names = layer[nxt : nxt + count]
        nxt += count
        if s == 0:
            names = [*input_modules, *names]
        if s == num_stages - 1:
            names = [*names, *output_modules]
        out.append(names)
    return out


def units_of(model: nn.Module) -> list[str]:
    """Splittable units in model order: entries of ModuleDict children, other children whole."""
    units: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleDict):
            units.extend(f"{name}.{key}" for key in child.keys())
        elif child is not None:
            units.append(name)
    return units


def group_units(
    units: Sequence[str], groups: Sequence[Sequence[str]], key: str, noun: str
) -> list[list[str]]:
    """``groups`` of module names (a whole ModuleDict like ``layers`` stands for its entries)
    as lists of ``units``, each unit in exactly one group. Raises ValueError naming ``key``
    and the ``noun`` of a group: an empty group, an unknown name, a unit twice or in none."""
    order = {u: i for i, u in enumerate(units)}
    containers = {u.split(".", 1)[0] for u in units if "." in u}
    owner: dict[str, int] = {}
    out: list[list[str]] = []
    for g, names in enumerate(groups):
        if not names:
            raise ValueError(f"{key}: {noun} {g} is empty; give every {noun} at least one module")
        expanded: list[str] = []
        for name in names:
            if name in containers:
                expanded.extend(u for u in units if u.startswith(f"{name}."))
            elif name in order:
                expanded.append(name)
            else:
                raise ValueError(
                    f"{key}: {noun} {g} names {name!r}, which is not a module of the model; use "
                    f"names like {', '.join(units[:2])}, ..., {units[-1]}"
                )
        for unit in expanded:
            if unit in owner:
                raise ValueError(
                    f"{key}: {unit!r} is in both {noun} {owner[unit]} and {noun} {g}; list it "
                    "once"
                )
            owner[unit] = g
        out.append(expanded)
    missing = [u for u in units if u not in owner]
    if missing:
        raise ValueError(
            f"{key}: {', '.join(map(repr, missing))} {'is' if len(missing) == 1 else 'are'} in "
            f"no {noun}; every module must belong to one {noun}"
        )
    return out


def validate_fqns_per_stage(model: nn.Module, fqns_per_stage: Sequence[Sequence[str]]) -> None:
    """Every unit of ``model`` is in exactly one stage, names exist, and stages follow model order.

    Raises ValueError naming ``parallelism.module_fqns_per_model_part`` and the offending name.
    """
    key = "parallelism.module_fqns_per_model_part"
    units = units_of(model)
    order = {u: i for i, u in enumerate(units)}
    last_pos = -1
    for s, expanded in enumerate(group_units(units, fqns_per_stage, key, "model part")):
        positions = sorted(order[u] for u in expanded)
        if positions[0] < last_pos:
            raise ValueError(
                f"{key}: model part {s} holds {units[positions[0]]!r}, which comes before "
                "modules of an earlier part; list the parts in model order"
            )
        last_pos = max(last_pos, positions[-1])


def fqns_from_split_points(
    split_points: Sequence[str],
    n_layers: int,
    input_modules: Sequence[str] = ("tok_embeddings",),
    output_modules: Sequence[str] = ("norm", "output"),
    layers_prefix: str = "layers",
) -> list[list[str]]:
    """The stages that ``split_points`` (the first layer of each stage after the first, e.g.
    ``layers.4``) cut: the input modules with the first stage, the output ones with the last.
    Raises ValueError naming the bad point."""
    key = "parallelism.pipeline_parallel_split_points"
    starts = []
    for point in split_points:
        head, _, index = str(point).rpartition(".")
        if head != layers_prefix or not index.isdigit() or not 0 < int(index) < n_layers:
            last = n_layers - 1
            allowed = (
                f"{layers_prefix}.1 ... {layers_prefix}.{last}" if last > 1
                else f"{layers_prefix}.1" if last == 1 else "none: the model has one layer"
            )
            raise ValueError(
                f"{key}: {point!r} is not a layer that can start a stage ({n_layers} layers); "
                f"use {allowed}"
            )
        if starts and int(index) <= starts[-1]:
            raise ValueError(f"{key}: {point!r} does not come after the split point before it")
        starts.append(int(index))
    bounds = [0, *starts, n_layers]
    stages = [
        [f"{layers_prefix}.{i}" for i in range(lo, hi)] for lo, hi in zip(bounds, bounds[1:])
    ]
    stages[0] = [*input_modules, *stages[0]]
    stages[-1] = [*stages[-1], *output_modules]
    return stages
