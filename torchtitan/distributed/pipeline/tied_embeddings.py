"""Tied input/output embeddings under pipeline parallelism.

With ``tie_word_embeddings`` the input embedding and the output projection are one matrix. The
pipeline puts them in different stages (the first and the last), each with its own copy: on
two pp ranks for looped schedules, on pp rank 0 for V-shaped ones. :class:`TiedEmbeddings`
keeps the copies equal, so training is that of the unsplit model:

* the output copy starts as the embedding's initial values (stages initialise with different
  seeds; a loaded checkpoint then overwrites both with the same saved matrix);
* after each backward the two gradients are summed into both copies (the unsplit model's
  gradient of the shared matrix), and the grad norm counts the matrix once; the optimizer
  then makes the same update to both;
* the optimizer state of the output copy is saved and loaded under the embedding's name, as
  an unsplit model keeps it, so checkpoints move between layouts with and without PP.

Gradients and weights travel between the two holders by point-to-point send/receive over the
pp group; each holder adds in its own order, which is exact (float addition commutes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.distributed.pipeline.planning import PipelineLayout

INPUT_MODULE, OUTPUT_MODULE = "tok_embeddings", "output"
INPUT_WEIGHT, OUTPUT_WEIGHT = f"{INPUT_MODULE}.weight", f"{OUTPUT_MODULE}.weight"


def _stage_of(layout: PipelineLayout, module: str) -> int:
    return next(i for i, fqns in enumerate(layout.fqns_per_stage) if module in fqns)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _sharded_like_param(param: nn.Parameter) -> torch.Tensor:
    """The local part of ``param``'s gradient, sharded as ``param`` is (a TP embedding's
    gradient arrives replicated; the output projection's is sharded like its weight)."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        grad = param.grad = grad.redistribute(grad.device_mesh, param.placements)
    return _local(grad)


class TiedEmbeddings:
    """Keeps the embedding stage's ``tok_embeddings.weight`` and the output stage's
    ``output.weight`` equal (see the module docstring). Every pp rank builds one; ranks
    holding neither stage do nothing."""

    def __init__(self, layout: PipelineLayout, model_parts: list[nn.Module], pp_mesh: DeviceMesh):
        input_stage, output_stage = _stage_of(layout, INPUT_MODULE), _stage_of(layout, OUTPUT_MODULE)
        parts = dict(zip(layout.stage_ids, model_parts, strict=True))
        if input_stage == output_stage:  # one stage holds both: the tie itself survives
            parts = {}
        # The parts, not their parameters: materialising a part (to_empty) replaces those.
        self.input_part: nn.Module | None = parts.get(input_stage)
        self.output_part: nn.Module | None = parts.get(output_stage)
        self._group = pp_mesh.get_group()
        # where the pp group communicates (CPU-offloaded FSDP keeps gradients on the host,
        # which NCCL cannot send)
        self._comm_device = torch.device(pp_mesh.device_type)
        holders = (layout.stage_ranks[input_stage], layout.stage_ranks[output_stage])
        me = pp_mesh.get_local_rank()
        self._peer: int | None = None  # global rank of the other holder; None: both here
        if holders[0] != holders[1] and me in holders:
            other = holders[1] if me == holders[0] else holders[0]
            self._peer = dist.get_global_rank(self._group, other)

    @property
    def embedding(self) -> nn.Parameter | None:
        """This rank's ``tok_embeddings.weight`` of the tie, if it holds that stage."""
        return getattr(self.input_part, INPUT_MODULE).weight if self.input_part else None

    @property
    def output(self) -> nn.Parameter | None:
        """This rank's ``output.weight`` of the tie, if it holds that stage."""
        return getattr(self.output_part, OUTPUT_MODULE).weight if self.output_part else None

    @property
    def active(self) -> bool:
        return self.embedding is not None or self.output is not None

    def norm_duplicates(self) -> list[nn.Parameter]:
        """Parameters the grad norm must leave out: the output copy (the embedding counts)."""
        return [self.output] if self.output is not None else []

    def _swap(self, mine: torch.Tensor) -> torch.Tensor:
        """Send ``mine`` to the other holder and return what it sent."""
        send = mine.to(self._comm_device).contiguous()
        theirs = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self._peer, self._group),
               dist.P2POp(dist.irecv, theirs, self._peer, self._group)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return theirs.to(mine.device)

    @torch.no_grad()
    def copy_initial_weights(self) -> None:
        """Give the output copy the embedding's values (call once on every pp rank, after
        initialisation)."""
        # NCCL: the first operation on a group must involve all of its ranks, and the pair's
        # send/receive may be the first on the pp group (the schedule's come later).
        dist.all_reduce(torch.zeros(1, device=self._comm_device), group=self._group)
        if not self.active:
            return
        if self._peer is None:
            _local(self.output).copy_(_local(self.embedding))
        elif self.embedding is not None:
            self._swap(_local(self.embedding))
        else:
            _local(self.output).copy_(self._swap(_local(self.output)))

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Both copies' gradient becomes their sum (after backward, before clipping)."""
        if not self.active:
            return
        if self._peer is None:
            embedding, output = _sharded_like_param(self.embedding), _sharded_like_param(self.output)
            total = embedding + output
            embedding.copy_(total)
            output.copy_(total)
            return
        grad = _sharded_like_param(self.embedding if self.embedding is not None else self.output)
        grad.add_(self._swap(grad))

    def optimizer_aliases(self, part: nn.Module) -> dict[str, str]:
        """``{fqn in part: fqn in checkpoints}`` for ``part``'s optimizer state."""
        if part is self.output_part and getattr(part, INPUT_MODULE, None) is None:
            return {OUTPUT_WEIGHT: INPUT_WEIGHT}
        return {}
