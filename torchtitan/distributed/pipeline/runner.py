"""``Pipeline``: everything the trainer holds for pipeline parallelism, in one object."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule

from torchtitan.distributed.pipeline.evaluation import local_value, pipeline_forward_only
from torchtitan.distributed.pipeline.planning import PipelineLayout
from torchtitan.distributed.pipeline.schedules import build_pipeline_schedule
from torchtitan.distributed.pipeline.tied_embeddings import TiedEmbeddings

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def pipeline_step(
    schedule: _PipelineSchedule,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    /,
    *,
    has_first_stage: bool,
    has_last_stage: bool,
    **model_kwargs: torch.Tensor,
) -> torch.Tensor:
    """Forward+backward of one batch through ``schedule`` (every pp rank calls it).

    The first stage feeds ``inputs`` and the last stage applies the schedule's loss per
    microbatch against ``labels``; ``model_kwargs`` (e.g. ``document_ids``, batch-first
    tensors) are split into microbatches and given to every stage's forward. Returns the sum of the microbatch losses (detached, a plain
    tensor) on a rank holding the last stage, else 0.
    """
    losses: list[torch.Tensor] | None = [] if has_last_stage else None
    args = (inputs,) if has_first_stage else ()
    target = labels if has_last_stage else None
    schedule.step(*args, target=target, losses=losses, return_outputs=False, **model_kwargs)
    if not losses:
        return torch.zeros((), device=inputs.device)
    return torch.stack([local_value(loss.detach()) for loss in losses]).sum()


def _probe_leaves_no_trace(stage: PipelineStage) -> None:
    """torch's pipelining runs a stage's forward once on its first step to infer shapes; make
    that probe restore the stage's buffers, so state updated in forward (e.g. MoE token
    counts) only sees the real microbatches."""
    probe = getattr(stage, "_forward_metadata_inference", None)
    if probe is None:  # another torch version: nothing known to wrap
        return

    def restoring_probe(*args, **kwargs):
        saved = [(b, b.detach().clone()) for b in stage.submod.buffers()]
        try:
            return probe(*args, **kwargs)
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    if not torch.equal(buffer, value):  # unchanged buffers keep their version:
                        buffer.copy_(value)  # a forward may have saved them (RoPE tables)

    stage._forward_metadata_inference = restoring_probe


class Pipeline:
    """This pp rank's stages, their schedule, which end stages it holds, and the loss.

    ``train_step`` runs forward+backward with the loss multiplied by the step's normalisation
    (the same factor the non-PP path uses, so losses and gradients match); ``eval_loss`` runs a
    forward-only pass with the plain summed loss for validation. The scale is private to a
    ``train_step`` call: nothing else reads or sets it.
    """

    def __init__(
        self,
        layout: PipelineLayout,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: LossFn,
        pp_mesh: DeviceMesh,
    ) -> None:
        self.layout = layout
        self.stages = list(stages)
        for stage in self.stages:
            _probe_leaves_no_trace(stage)
        self.model_parts: list[nn.Module] = [stage.submod for stage in self.stages]
        self.loss_fn = loss_fn
        self.pp_mesh = pp_mesh
        self.has_first_stage = any(stage.is_first for stage in self.stages)
        self.has_last_stage = any(stage.is_last for stage in self.stages)
        self._loss_scale = 1.0
        self.tied: TiedEmbeddings | None = None
        """Set when the model ties its input and output embeddings across stages."""
        self.schedule = build_pipeline_schedule(
            layout, self.stages, n_microbatches, pp_mesh.size(), self._scaled_loss
        )

    def norm_duplicates(self) -> list[nn.Parameter]:
        """Parameters the grad norm leaves out: copies of a weight counted on another stage."""
        return self.tied.norm_duplicates() if self.tied is not None else []

    def _scaled_loss(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(pred, labels) * self._loss_scale

    def train_step(
        self, inputs: torch.Tensor, labels: torch.Tensor, loss_scale: float, /,
        **model_kwargs: torch.Tensor,
    ) -> torch.Tensor:
        """Forward+backward of one batch; the scaled loss on last-stage ranks, else 0."""
        self._loss_scale = loss_scale
        try:
            return pipeline_step(
                self.schedule,
                inputs,
                labels,
                has_first_stage=self.has_first_stage,
                has_last_stage=self.has_last_stage,
                **model_kwargs,
            )
        finally:
            self._loss_scale = 1.0

    def eval_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, /, **model_kwargs: torch.Tensor
    ) -> torch.Tensor:
        """Summed token loss of one batch, forward only, the same on every pp rank."""
        total = pipeline_forward_only(
            self.schedule, inputs, labels, self.loss_fn, **model_kwargs
        ).float()
        dist.all_reduce(total, group=self.pp_mesh.get_group())
        return total
