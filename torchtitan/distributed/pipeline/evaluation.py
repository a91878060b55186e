"""Forward-only evaluation through a pipeline's stages (validation under PP).

torch 2.13's ``schedule.eval`` runs the backward actions of multi-stage schedules and fails,
so activations are handed stage to stage here with point-to-point sends on the pp group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.pipelining.schedules import _PipelineSchedule


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a (replicated) DTensor loss, e.g. under loss parallel."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]
_HEADER = 10  # dtype code, ndim, up to 8 dims


def _send(t: torch.Tensor, peer: int, group, works: list) -> None:
    t = t.detach().contiguous()
    header = torch.zeros(_HEADER, dtype=torch.int64, device=t.device)
    header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
    header[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    works.append(torch.distributed.isend(header, group=group, group_dst=peer))
    works.append(torch.distributed.isend(t, group=group, group_dst=peer))


def _recv(peer: int, group, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    torch.distributed.recv(header, group=group, group_src=peer)
    ndim = int(header[1])
    shape = [int(d) for d in header[2 : 2 + ndim]]
    out = torch.empty(shape, dtype=_DTYPES[int(header[0])], device=device)
    torch.distributed.recv(out, group=group, group_src=peer)
    return out


@torch.no_grad()
def pipeline_forward_only(
    schedule: _PipelineSchedule,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    /,
    **model_kwargs: torch.Tensor,
) -> torch.Tensor:
    """Forward-only pass of one batch through ``schedule``'s stages, then ``loss_fn``.

    ``model_kwargs`` (batch-first tensors such as ``document_ids``) are split like the batch
    and given to every stage.

    Microbatches (``torch.tensor_split`` into the schedule's count, so any batch size works)
    flow stage by stage over point-to-point sends on the pp group; a rank that holds two
    adjacent stages hands the activation over locally. Returns the summed loss on the rank
    holding the last stage, else 0 (plain tensors).
    """
    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
    by_index = {stage.stage_index: stage for stage in stages}
    ref = stages[0]
    group, rank_of = ref.group, ref.stage_index_to_group_rank
    num_stages, me = ref.num_stages, ref.group_rank
    total = torch.zeros((), device=inputs.device)
    works: list = []
    n = schedule._n_microbatches
    kwarg_chunks = {k: torch.tensor_split(v, n) for k, v in model_kwargs.items()}
    for i, (x, y) in enumerate(zip(torch.tensor_split(inputs, n), torch.tensor_split(labels, n))):
        kwargs = {k: chunks[i] for k, chunks in kwarg_chunks.items()}
        if x.shape[0] == 0:
            continue
        h: torch.Tensor | None = x
        for idx in range(num_stages):
            if idx not in by_index:
                continue
            if idx > 0 and rank_of[idx - 1] != me:
                h = _recv(rank_of[idx - 1], group, inputs.device)
            h = by_index[idx].submod(h, **kwargs)
            if idx == num_stages - 1:
                total = total + local_value(loss_fn(h, y).detach())
            elif rank_of[idx + 1] != me:
                _send(h, rank_of[idx + 1], group, works)
    for work in works:
        work.wait()
    _reshard_fsdp(stages)
    return total


def _reshard_fsdp(stages) -> None:
    """Free parameters FSDP kept gathered after forward (PP's default), as training expects."""
    from torch.distributed.fsdp import FSDPModule

    for stage in stages:
        for module in stage.submod.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
