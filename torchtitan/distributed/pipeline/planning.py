"""Pipeline planning: pick the schedule, count stages, cut the model, place stages on ranks.

Pure functions with no communication, so they are unit-testable alone. A model is cut into
``num_stages`` *model parts*. Each part is a deep copy of the whole (meta) model with the
modules of other stages removed: entries of a ``ModuleDict`` (``layers``) are deleted and other
top-level modules (``tok_embeddings``, ``norm``, ``output``) are set to ``None``, so every
parameter keeps the FQN it has in the unsplit model and checkpoints are layout-independent.
Stages are placed on pp ranks by the schedule's style: looped schedules put stages
``r, r + pp, ...`` on rank ``r``; V-shaped ones (ZBVZeroBubble, DualPipeV) put
``r, 2 * pp - 1 - r``; a CSV schedule places stages where its action table runs them.
"""

from __future__ import annotations

import copy
import csv
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    _Action,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
)

from torchtitan.config.job_config import Parallelism
from torchtitan.distributed.pipeline.stage_fqns import (
    fqns_from_split_points,
    generate_fqns_per_stage,
    units_of,
    validate_fqns_per_stage,
)
from torchtitan.tools.logging import logger

# Schedule names accepted by parallelism.pipeline_parallel_schedule (case-insensitive).
SCHEDULES: dict[str, type[_PipelineSchedule]] = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}
_V_SCHEDULES = (ScheduleZBVZeroBubble, ScheduleDualPipeV)
ROUND_SCHEDULES = (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)


def get_schedule_class(name: str) -> type[_PipelineSchedule]:
    """The schedule class for ``parallelism.pipeline_parallel_schedule`` (case-insensitive)."""
    by_lower = {k.lower(): v for k, v in SCHEDULES.items()}
    cls = by_lower.get(name.lower())
    if cls is None:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule={name!r} is not a known schedule; use one of "
            f"{', '.join(SCHEDULES)} (or parallelism.pipeline_parallel_schedule_csv for a custom one)"
        )
    return cls


def schedule_name(cls: type) -> str:
    for name, known in SCHEDULES.items():
        if known is cls:
            return name
    return cls.__name__


def read_csv_stage_placement(path: str) -> dict[int, list[int]]:
    """pp rank -> sorted stage indices, read from a compute-only action table (one row per rank,
    actions like ``0F0,1F0,1B0,0B0``)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"parallelism.pipeline_parallel_schedule_csv={path!r} does not exist; give the path "
            "of a CSV action table (one row per pp rank)"
        )
    placement: dict[int, list[int]] = {}
    with open(path, newline="") as f:
        for rank, row in enumerate(csv.reader(f)):
            stages: set[int] = set()
            for cell in row:
                try:
                    action = _Action.from_str(cell)
                except RuntimeError as err:
                    raise ValueError(
                        f"parallelism.pipeline_parallel_schedule_csv={path!r}: row {rank} has an "
                        f"invalid action {cell.strip()!r} (write actions like 0F0, 1B0, 1I0, 1W0)"
                    ) from err
                if action is not None:
                    stages.add(action.stage_index)
            placement[rank] = sorted(stages)
    return placement


def stage_ids_this_rank(
    pp_rank: int, pp_size: int, num_stages: int, style: str = "loop"
) -> tuple[int, ...]:
    """Stages held by ``pp_rank``: looped ``r, r + pp, ...`` or V-shaped ``r, 2 * pp - 1 - r``."""
    if num_stages % pp_size:
        raise ValueError(
            f"{num_stages} pipeline stages cannot be spread evenly over "
            f"parallelism.pipeline_parallel_degree={pp_size} ranks"
        )
    per_rank = num_stages // pp_size
    if style == "loop":
        return tuple(pp_rank + k * pp_size for k in range(per_rank))
    if style == "v":
        if per_rank != 2:
            raise ValueError(
                f"V-shaped schedules need exactly 2 stages per rank, got {per_rank} "
                f"({num_stages} stages over pp={pp_size})"
            )
        return (pp_rank, num_stages - 1 - pp_rank)
    raise ValueError(f"unknown stage placement style {style!r}; use 'loop' or 'v'")


def split_model_part(model: nn.Module, fqns: Sequence[str]) -> nn.Module:
    """A deep copy of ``model`` holding only ``fqns`` (FQNs unchanged).

    ModuleDict entries not listed are deleted (an unlisted ModuleDict becomes empty); other
    unlisted children are set to ``None``. Works on meta-device models.
    """
    keep = set(fqns)
    part = copy.deepcopy(model)
    for name, child in list(part.named_children()):
        if isinstance(child, nn.ModuleDict):
            if name in keep:
                continue
            for key in list(child.keys()):
                if f"{name}.{key}" not in keep:
                    del child[key]
        elif isinstance(child, nn.ModuleList):
            raise ValueError(
                f"cannot split {type(model).__name__}.{name}: pipeline splitting needs an "
                "nn.ModuleDict (keys '0'..'N-1') so FQNs stay stable, not an nn.ModuleList"
            )
        elif name not in keep:
            setattr(part, name, None)
    return part


@dataclass
class PipelineLayout:
    """How the model is cut and which stages this pp rank holds."""

    schedule_class: type[_PipelineSchedule]
    num_stages: int
    stage_ids: tuple[int, ...]
    fqns_per_stage: list[list[str]]
    csv_path: str | None = None
    stage_ranks: tuple[int, ...] = ()
    """The pp rank holding each stage (every stage, not only this rank's)."""

    @property
    def is_multi_stage(self) -> bool:
        return issubclass(self.schedule_class, PipelineScheduleMulti)


def resolve_pipeline_layout(
    cfg: Parallelism,
    model: nn.Module,
    n_layers: int,
    pp_rank: int,
    *,
    input_modules: Sequence[str] = ("tok_embeddings",),
    output_modules: Sequence[str] = ("norm", "output"),
    layers_prefix: str = "layers",
) -> PipelineLayout:
    """Pick the schedule, count stages, cut the layers and place stages (no communication).

    Stage count: ``module_fqns_per_model_part`` if set, else
    ``ceil((n_layers + first_less + last_less) / pipeline_parallel_layers_per_stage)``, else one
    stage per rank for single-stage schedules (GPipe, 1F1B) and two for the others (or what a
    CSV schedule uses). Raises ValueError up front for impossible combinations.
    """
    pp = cfg.pipeline_parallel_degree
    csv_path = cfg.pipeline_parallel_schedule_csv or None
    placement: dict[int, list[int]] | None = None
    _refuse_unused_settings(cfg)
    if csv_path:
        schedule_class: type[_PipelineSchedule] = _PipelineScheduleRuntime
        placement = read_csv_stage_placement(csv_path)
        if len(placement) != pp:
            raise ValueError(
                f"parallelism.pipeline_parallel_schedule_csv={csv_path!r} has {len(placement)} "
                f"rows but pipeline_parallel_degree={pp}; write one row per pp rank"
            )
        csv_stages = sorted(s for stages in placement.values() for s in stages)
        if csv_stages != list(range(len(csv_stages))):
            raise ValueError(
                f"parallelism.pipeline_parallel_schedule_csv={csv_path!r} must run each stage "
                f"0..N-1 on exactly one rank; it runs stages {csv_stages}"
            )
    else:
        schedule_class = get_schedule_class(cfg.pipeline_parallel_schedule)
    name = schedule_name(schedule_class) if not csv_path else f"CSV schedule {csv_path!r}"
    single = issubclass(schedule_class, PipelineScheduleSingle)
    v_style = issubclass(schedule_class, _V_SCHEDULES)
    first_less = cfg.pipeline_parallel_first_stage_less_layers
    last_less = cfg.pipeline_parallel_last_stage_less_layers
    lps = cfg.pipeline_parallel_layers_per_stage

    fqns = cfg.module_fqns_per_model_part
    split_points = cfg.pipeline_parallel_split_points
    cuts = [name for name, value in (("module_fqns_per_model_part", fqns),
                                     ("pipeline_parallel_split_points", split_points),
                                     ("pipeline_parallel_layers_per_stage", lps))
            if value not in (None, [])]
    if len(cuts) > 1:
        raise ValueError(
            f"parallelism.{cuts[0]} and {cuts[1]} both cut the pipeline stages; set one of them"
        )
    if split_points:
        fqns = fqns_from_split_points(
            split_points, n_layers, input_modules, output_modules, layers_prefix
        )
        source = f"parallelism.pipeline_parallel_split_points ({len(fqns)} stages)"
        num_stages = len(fqns)
    elif fqns:
        num_stages = len(fqns)
        source = f"parallelism.module_fqns_per_model_part ({num_stages} parts)"
    elif lps is not None:
        if lps < 1:
            raise ValueError(f"parallelism.pipeline_parallel_layers_per_stage={lps} must be >= 1")
        num_stages = math.ceil((n_layers + first_less + last_less) / lps)
        source = (
            f"pipeline_parallel_layers_per_stage={lps} (n_layers={n_layers} + first/last stage "
            f"weights {first_less}+{last_less} -> {num_stages} stages)"
        )
    elif placement is not None:
        num_stages = sum(len(s) for s in placement.values())
        source = f"the CSV schedule ({num_stages} stages)"
    else:
        num_stages = pp * (1 if single else 2)
        source = f"the default for {name} ({num_stages} stages)"

    if num_stages % pp:
        raise ValueError(
            f"{source} cannot be spread evenly over pipeline_parallel_degree={pp} ranks; "
            "pick a stage count that is a multiple of the pp degree"
        )
    per_rank = num_stages // pp
    if placement is not None:
        csv_count = sum(len(s) for s in placement.values())
        if csv_count != num_stages:
            raise ValueError(
                f"{source} does not match the {csv_count} stages run by "
                f"parallelism.pipeline_parallel_schedule_csv={csv_path!r}"
            )
        stage_ids = tuple(placement[pp_rank])
        stage_ranks = tuple(
            next(r for r, stages in placement.items() if s in stages) for s in range(num_stages)
        )
    else:
        if single and per_rank != 1:
            raise ValueError(
                f"schedule {name} runs one stage per rank, but {source} gives {per_rank} per rank; "
                "use a multi-stage schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
                "ZBVZeroBubble, DualPipeV) or fewer stages"
            )
        if not single and per_rank < 2:
            raise ValueError(
                f"schedule {name} needs at least 2 stages per rank, but {source} gives "
                f"{per_rank}; use GPipe/1F1B or lower pipeline_parallel_layers_per_stage"
            )
        if v_style and per_rank != 2:
            raise ValueError(
                f"schedule {name} needs exactly 2 stages per rank (V shape), but {source} gives "
                f"{per_rank}"
            )
        style = "v" if v_style else "loop"
        stage_ids = stage_ids_this_rank(pp_rank, pp, num_stages, style)
        stage_ranks = tuple(
            next(r for r in range(pp) if s in stage_ids_this_rank(r, pp, num_stages, style))
            for s in range(num_stages)
        )

    if fqns:
        fqns_per_stage = [list(p) for p in fqns]
    else:
        try:
            fqns_per_stage = generate_fqns_per_stage(
                num_stages,
                n_layers,
                first_less,
                last_less,
                input_modules=input_modules,
                output_modules=output_modules,
                layers_prefix=layers_prefix,
            )
        except ValueError as err:
            raise ValueError(f"{err} (stage count from {source})") from None
    validate_fqns_per_stage(model, fqns_per_stage)
    return PipelineLayout(
        schedule_class, num_stages, stage_ids, fqns_per_stage, csv_path, stage_ranks
    )


def _refuse_unused_settings(cfg: Parallelism) -> None:
    """ValueError for a setting the chosen way of cutting or scheduling would not use: a named
    schedule beside a CSV action table, stage-size offsets beside explicitly listed stages."""
    default = Parallelism()
    if cfg.pipeline_parallel_schedule_csv and get_schedule_class(
        cfg.pipeline_parallel_schedule
    ) is not get_schedule_class(default.pipeline_parallel_schedule):
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule={cfg.pipeline_parallel_schedule!r} is not "
            "used: pipeline_parallel_schedule_csv gives the schedule; drop one of them"
        )
    listed = [name for name in ("module_fqns_per_model_part", "pipeline_parallel_split_points")
              if getattr(cfg, name)]
    for name in ("pipeline_parallel_first_stage_less_layers",
                 "pipeline_parallel_last_stage_less_layers"):
        if listed and getattr(cfg, name) != getattr(default, name):
            raise ValueError(
                f"parallelism.{name}={getattr(cfg, name)} is not used: parallelism.{listed[0]} "
                "lists each stage's modules; drop it"
            )


def pipeline_module_split(
    model: nn.Module,
    layout: PipelineLayout,
) -> list[nn.Module]:
    """This rank's model parts (deep copies of ``model``), in the order of ``layout.stage_ids``."""
    parts = []
    for stage_idx in layout.stage_ids:
        part = split_model_part(model, layout.fqns_per_stage[stage_idx])
        parts.append(part)
        logger.info(f"Pipeline stage {stage_idx}: {', '.join(units_of(part)) or '(empty)'}")
    return parts
