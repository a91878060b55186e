"""Validation loop: mean token loss over a finite validation set (pipelined or not)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed.utils import dist_reduce

if TYPE_CHECKING:
    from torchtitan.build import RunParts

BatchLoss = Callable[..., torch.Tensor]


class Validator:
    """Runs the model over a validation dataloader every ``freq`` steps.

    ``batch_loss(inputs, labels, **batch_kwargs(inputs, labels))`` returns one batch's summed token
    loss: the model's forward and the loss function, or a forward-only pass through pipeline
    stages. It runs inside ``loss_context(inputs, labels)`` (loss parallel, context parallel,
    which may shard the batch: ``batch_kwargs``, e.g. document ids, are taken before it).
    """

    def __init__(
        self,
        build_dataloader: Callable[[], Iterable],
        batch_loss: BatchLoss,
        *,
        freq: int,
        steps: int,
        device: torch.device,
        dp_mesh: DeviceMesh | None,
        loss_context: Callable[[torch.Tensor, torch.Tensor], contextlib.AbstractContextManager],
        batch_kwargs: Callable[[torch.Tensor, torch.Tensor], dict] = lambda inputs, labels: {},
    ) -> None:
        self.build_dataloader = build_dataloader
        self.batch_loss = batch_loss
        self.freq = freq
        self.steps = steps
        self.device = device
        self.dp_mesh = dp_mesh
        self.loss_context = loss_context
        self.batch_kwargs = batch_kwargs

    def should_validate(self, step: int) -> bool:
        return step % self.freq == 0

    @torch.no_grad()
    def validate(self, model_parts: list[nn.Module]) -> float:
        """Mean loss per valid token over ``steps`` batches (or the whole set when steps == -1).

        ``model_parts`` are switched to eval mode for the pass and back to train mode after.
        """
        for part in model_parts:
            part.eval()
        try:
            loss_sum, tokens = self._sum_losses()
        finally:
            for part in model_parts:
                part.train()
        total_loss = dist_reduce(loss_sum, "sum", self.dp_mesh)
        total_tokens = dist_reduce(tokens, "sum", self.dp_mesh)
        return total_loss / max(total_tokens, 1.0)

    def _sum_losses(self) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        # Each dp rank may hold a different number of batches, so every rank keeps stepping
        # until all are exhausted (a rank out of data contributes nothing).
        iterator = iter(self.build_dataloader())
        step = 0
        while self.steps < 0 or step < self.steps:
            batch = next(iterator, None)
            if not self._any_rank_has(batch is not None):
                break
            step += 1
            if batch is None:
                continue
            inputs, labels = (t.to(self.device).clone() for t in batch)
            kwargs = self.batch_kwargs(inputs, labels)
            with self.loss_context(inputs, labels):
                loss_sum += self.batch_loss(inputs, labels, **kwargs).double()
            # The labels the loss saw: this rank's slice of the sequence under context parallel.
            tokens += (labels != IGNORE_INDEX).sum()
        return loss_sum, tokens

    def _any_rank_has(self, has_batch: bool) -> bool:
        if self.dp_mesh is None:
            return has_batch
        return dist_reduce(float(has_batch), "max", self.dp_mesh) > 0


def build_validator(run: RunParts) -> Validator:
    """The ``[validation]`` section's validator for ``run`` (through its pipeline under PP)."""
    from torchtitan.distributed.pipeline.evaluation import local_value
    from torchtitan.step import loss_context, model_inputs, sequence_context

    val = run.job_config.validation
    steps = run.job_config.training.steps
    if val.freq > steps:
        from torchtitan.tools.logging import logger

        logger.warning(
            f"validation.freq={val.freq} > training.steps={steps}: the training loop validates "
            "at no step; lower --validation.freq to validate during training"
        )
    dp_rank = run.parallel_dims.mesh_local_rank("dp")

    def build():
        return run.build_dataloader(
            val.dataset, val.dataset_path, val.local_batch_size, val.seq_len, dp_rank,
            infinite=False,
        )

    _read_one_batch(build)
    if run.pipeline is not None:
        pipeline = run.pipeline

        def batch_loss(inputs: torch.Tensor, labels: torch.Tensor, /, **kwargs) -> torch.Tensor:
            return pipeline.eval_loss(inputs, labels, **kwargs)
    else:
        model, loss_fn, copies = run.model_parts[0], run.loss_fn, run.weight_copies

        def batch_loss(inputs: torch.Tensor, labels: torch.Tensor, /, **kwargs) -> torch.Tensor:
            # with weight copies, the forward the training step compiled (the same numbers)
            with copies.active() if copies is not None else contextlib.nullcontext():
                return local_value(loss_fn(model(inputs, **kwargs), labels))

    return Validator(
        build,
        batch_loss,
        freq=val.freq,
        steps=val.steps,
        device=run.device,
        dp_mesh=run.loss_mesh,
        loss_context=lambda inputs, labels: _stacked(
            loss_context(run), sequence_context(run, inputs, labels)
        ),
        batch_kwargs=lambda inputs, labels: model_inputs(run, inputs, labels),
    )


def _read_one_batch(build: Callable[[], Iterable]) -> None:
    """Read one validation batch at start-up: a missing file, a missing text column or an
    unreachable Hub dataset stops the run before step 1 rather than at step
    ``validation.freq`` (after training that far)."""
    from torchtitan.datasets.sources import in_section

    try:
        next(iter(build()), None)
    except FileNotFoundError as err:
        raise FileNotFoundError(in_section(err, "validation")) from None
    except ValueError as err:
        raise ValueError(in_section(err, "validation")) from None


@contextlib.contextmanager
def _stacked(*contexts: contextlib.AbstractContextManager):
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield
