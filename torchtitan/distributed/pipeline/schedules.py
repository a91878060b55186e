"""Pipeline runtime objects: stages, the schedule, and the checks torch's schedules need."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    _PipelineSchedule,
)

from torchtitan.config.job_config import Parallelism
from torchtitan.distributed.pipeline.planning import (
    ROUND_SCHEDULES,
    PipelineLayout,
    schedule_name,
)
from torchtitan.tools.logging import logger


def n_microbatches_for(cfg: Parallelism, local_batch_size: int) -> int:
    """``local_batch_size // pipeline_parallel_microbatch_size`` (or the older
    ``pipeline_parallel_microbatches``); ValueError unless it divides."""
    count = cfg.pipeline_parallel_microbatches
    mbs = cfg.pipeline_parallel_microbatch_size
    if count is not None:
        if mbs != 1:
            raise ValueError(
                f"parallelism.pipeline_parallel_microbatches={count} and "
                f"pipeline_parallel_microbatch_size={mbs} both set the microbatching; set one"
            )
        if count < 1 or local_batch_size % count:
            raise ValueError(
                f"parallelism.pipeline_parallel_microbatches={count} must be >= 1 and divide "
                f"training.local_batch_size={local_batch_size}"
            )
        return count
    if mbs < 1 or local_batch_size % mbs:
        raise ValueError(
            f"parallelism.pipeline_parallel_microbatch_size={mbs} must be >= 1 and divide "
            f"training.local_batch_size={local_batch_size}"
        )
    return local_batch_size // mbs


def check_microbatches(layout: PipelineLayout, n_microbatches: int, pp: int) -> None:
    """Reject microbatch counts the schedule cannot run (torch 2.13's rules, with config names)."""
    cls = layout.schedule_class
    name = schedule_name(cls)
    hint = (
        "raise training.local_batch_size or lower parallelism.pipeline_parallel_microbatch_size "
        "(n_microbatches = local_batch_size // microbatch_size)"
    )
    if cls is Schedule1F1B and n_microbatches < layout.num_stages:
        raise ValueError(
            f"schedule 1F1B needs at least as many microbatches as stages: got {n_microbatches} "
            f"microbatches for {layout.num_stages} stages; {hint}"
        )
    if cls is ScheduleDualPipeV and n_microbatches < layout.num_stages:
        raise ValueError(
            f"schedule DualPipeV needs at least as many microbatches as stages: got "
            f"{n_microbatches} microbatches for {layout.num_stages} stages; {hint}"
        )
    if cls in ROUND_SCHEDULES:
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise ValueError(
                f"schedule {name} needs the number of microbatches ({n_microbatches}) to be a "
                f"multiple of the rounds max(1, n_microbatches // pp) = {rounds}; use a multiple "
                f"of pipeline_parallel_degree={pp} (or fewer microbatches than pp); {hint}"
            )
    if n_microbatches < layout.num_stages:
        logger.warning(
            f"{n_microbatches} pipeline microbatches for {layout.num_stages} stages: the pipeline "
            "bubble will dominate; use more microbatches"
        )


# Schedules that split each backward into input- and weight-gradient passes.
_SPLIT_BACKWARD_SCHEDULES = (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV)


def check_split_backward_schedule(layout: PipelineLayout, model_compiled: bool,
                                  op_sac: bool) -> None:
    """Refuse what a zero-bubble schedule cannot run (one line, before any work).

    These schedules run two backward passes through every block (input gradients, then weight
    gradients). torch 2.13 stops them when a stage holds a compiled module, and a block
    compiled in place inside its activation-checkpoint wrapper slips past that check and fails
    in the first backward instead ("compiled with non-empty donated buffers"). Op-level SAC
    allows one backward per checkpointed region ("Trying to backward an extra time").
    """
    cls = layout.schedule_class
    if cls not in _SPLIT_BACKWARD_SCHEDULES:
        return
    name = schedule_name(cls)
    if model_compiled:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule={name} splits each backward in two "
            "(input and weight gradients), which torch's pipelining does not support for "
            "compiled blocks; use another schedule (1F1B, Interleaved1F1B, ...) or leave "
            "'model' out of compile.components"
        )
    if op_sac:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule={name} splits each backward in two "
            "(input and weight gradients), and op-level selective activation checkpointing "
            "allows one backward per block; use activation_checkpoint.mode full (or selective "
            "with a layer count) or another schedule (1F1B, Interleaved1F1B, ...)"
        )


def build_pipeline_stages(
    parts: Sequence[nn.Module],
    stage_ids: Sequence[int],
    num_stages: int,
    device: torch.device,
    pp_group: torch.distributed.ProcessGroup,
) -> list[PipelineStage]:
    """One ``PipelineStage`` per model part on the pp process group (shapes inferred at runtime)."""
    return [
        PipelineStage(part, stage_idx, num_stages, device, group=pp_group)
        for part, stage_idx in zip(parts, stage_ids)
    ]


def build_pipeline_schedule(
    layout: PipelineLayout,
    stages: list[PipelineStage],
    n_microbatches: int,
    pp: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> _PipelineSchedule:
    """The schedule over this rank's ``stages`` (``scale_grads=False``: ``loss_fn`` normalises)."""
    check_microbatches(layout, n_microbatches, pp)
    cls = layout.schedule_class
    target = stages if layout.is_multi_stage else stages[0]
    try:
        schedule = cls(target, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    except ValueError as err:
        raise ValueError(
            f"pipeline schedule {schedule_name(cls)} with {n_microbatches} microbatches and "
            f"{layout.num_stages} stages over pp={pp}: {err}"
        ) from None
    if layout.csv_path:
        try:
            schedule._load_csv(layout.csv_path)
        except (AssertionError, RuntimeError) as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
            raise ValueError(
                f"parallelism.pipeline_parallel_schedule_csv={layout.csv_path!r} is not a valid "
                f"schedule for {n_microbatches} microbatches and {layout.num_stages} stages: "
                f"{first_line}"
            ) from None
    logger.info(
        f"Pipeline schedule {schedule_name(cls) if not layout.csv_path else layout.csv_path}: "
        f"{layout.num_stages} stages, {n_microbatches} microbatches, this rank holds stages "
        f"{list(layout.stage_ids)}"
    )
    return schedule
