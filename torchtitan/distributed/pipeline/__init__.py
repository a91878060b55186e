"""Pipeline parallelism: planning (pure), schedules, forward-only evaluation, and the
``Pipeline`` object the trainer holds. ``torchtitan/models/<family>/pipeline.py`` wires a
model family to these pieces."""

from torchtitan.distributed.pipeline.evaluation import pipeline_forward_only
from torchtitan.distributed.pipeline.planning import (
    SCHEDULES,
    PipelineLayout,
    get_schedule_class,
    pipeline_module_split,
    read_csv_stage_placement,
    resolve_pipeline_layout,
    split_model_part,
    stage_ids_this_rank,
)
from torchtitan.distributed.pipeline.runner import Pipeline, pipeline_step
from torchtitan.distributed.pipeline.schedules import (
    build_pipeline_schedule,
    build_pipeline_stages,
    check_microbatches,
    check_split_backward_schedule,
    n_microbatches_for,
)
from torchtitan.distributed.pipeline.stage_fqns import (
    generate_fqns_per_stage,
    validate_fqns_per_stage,
)

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "PipelineLayout",
    "build_pipeline_schedule",
    "build_pipeline_stages",
    "check_microbatches",
    "check_split_backward_schedule",
    "generate_fqns_per_stage",
    "get_schedule_class",
    "n_microbatches_for",
    "pipeline_forward_only",
    "pipeline_module_split",
    "pipeline_step",
    "read_csv_stage_placement",
    "resolve_pipeline_layout",
    "split_model_part",
    "stage_ids_this_rank",
    "validate_fqns_per_stage",
]
