"""Context parallelism: each rank of the ``cp`` mesh holds a slice of every sequence.

Inside :func:`context_parallel_context` the batch (inputs, labels) and every model part's RoPE
table are sharded along the sequence dimension, and causal SDPA becomes ring attention over
the ``cp`` group (torch's ``context_parallel``): key/value blocks travel around the ring
(``allgather``: each rank gathers all of them; ``alltoall``: one hop per step) and partial
results are merged with their log-sum-exp. Head-tail load balancing gives every rank one chunk
from the front and one from the back of the sequence, so causal attention costs the same on
every rank; it needs ``seq_len`` divisible by ``2 * cp``.

torch ships ring handlers for the CUDA SDPA kernels only (flash, efficient, cuDNN).
:func:`install_cpu_ring_attention` adds the same for the CPU flash kernel, so CP runs and is
tested on CPU with gloo.

Masked attention (document masking, a sliding window, FlexAttention) cannot be merged block by
block from a ring, so :func:`masked_context_parallel_context` shards the same buffers by the
same positions itself and lets every rank attend with its queries to the keys/values of the
whole sequence, all-gathered over ``cp`` (their gradients reduce-scattered back), under the
mask rows of its own positions (``Decoder.sequence_shard`` of every model part).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.models.common.document_mask import SequenceShard

ROTATE_METHODS = ("allgather", "alltoall")
_SEQ_DIM = 2  # SDPA's [batch, heads, seq, head_dim]


def _cpu_flash_ring_handler(op_call, args, kwargs):
    """DTensor handler: the CPU flash-attention forward/backward as ring attention."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attn

    aten = torch.ops.aten
    mesh = next(a.device_mesh for a in args if isinstance(a, DTensor))
    local = [a.to_local() if isinstance(a, DTensor) else a for a in args]
    group = mesh.get_group()
    if op_call is aten._scaled_dot_product_flash_attention_for_cpu.default:
        query, key, value, *rest = local
        dropout_p = rest[0] if len(rest) > 0 else kwargs.get("dropout_p", 0.0)
        is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
        if kwargs.get("attn_mask") is not None:
            raise NotImplementedError("context parallel supports causal attention without a mask")
        outputs = cp_attn._templated_ring_attention(
            group, _SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu.default,
            query=query, key=key, value=value, is_causal=is_causal, dropout_p=dropout_p,
            scale=kwargs.get("scale"),
        )
    else:
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = local[:8]
        outputs = cp_attn._templated_ring_attention_backward(
            group, _SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=grad_out, grad_out_name="grad_out", query=query, key=key, value=value,
            out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p,
            scale=kwargs.get("scale"),
        )
    return tuple(
        DTensor.from_local(t, mesh, [Shard(_SEQ_DIM)], run_check=False) for t in outputs
    )


def install_cpu_ring_attention() -> None:
    """Register ring-attention handlers for the CPU flash SDPA kernels (idempotent)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attn

    aten = torch.ops.aten
    for op in (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    ):
        cp_attn.custom_ops.setdefault(op, _cpu_flash_ring_handler)


@contextlib.contextmanager
def context_parallel_context(
    cp_mesh: DeviceMesh,
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    no_restore: set[torch.Tensor],
    rotate_method: str,
    load_balance: bool = True,
) -> Iterator[None]:
    """Shard ``buffers`` along ``seq_dims`` over ``cp_mesh`` and run SDPA as ring attention.

    Buffers in ``no_restore`` stay sharded after the context (the batch); the others (RoPE
    tables) get their full contents back. ``load_balance``: head-tail chunks (else contiguous
    ones); torch keeps the choice process-wide, so it is set on every entry.
    """
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    if rotate_method not in ROTATE_METHODS:
        raise ValueError(
            f"parallelism.context_parallel_rotate_method={rotate_method!r} is not one of "
            f"{', '.join(ROTATE_METHODS)}"
        )
    if cp_mesh.device_type == "cpu":
        install_cpu_ring_attention()
    set_rotate_method(rotate_method)
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    _cp_options.enable_load_balance = load_balance
    with context_parallel(
        cp_mesh, buffers=list(buffers), buffer_seq_dims=list(seq_dims),
        no_restore_buffers=set(no_restore),
    ):
        yield


def sequence_order(seq_len: int, cp: int, load_balance: bool) -> torch.Tensor:
    """The global position held in each slot when the ``cp`` ranks' parts of a sequence are
    concatenated in rank order: rank ``r`` holds ``order.view(cp, -1)[r]``. Head-tail
    (``load_balance``): chunks ``r`` and ``2cp-1-r`` of ``2cp``; else contiguous chunk ``r``."""
    if not load_balance:
        return torch.arange(seq_len)
    chunks = torch.arange(seq_len).view(2 * cp, -1)
    return torch.cat([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


@torch.library.custom_op("torchtitan::cp_all_gather", mutates_args=())
def cp_all_gather(x: torch.Tensor, dim: int, group_name: str, group_size: int) -> torch.Tensor:
    """Concatenate ``x`` from every rank of the group along ``dim`` (rank order)."""
    front = x.movedim(dim, 0).contiguous()
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(front, group_size, group_name)
    gathered = torch.ops._c10d_functional.wait_tensor(gathered)
    return gathered.movedim(0, dim).contiguous()


@cp_all_gather.register_fake
def _(x: torch.Tensor, dim: int, group_name: str, group_size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= group_size
    return x.new_empty(shape)


@torch.library.custom_op("torchtitan::cp_reduce_scatter", mutates_args=())
def cp_reduce_scatter(x: torch.Tensor, dim: int, group_name: str, group_size: int) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's ``1/group_size`` slice of ``dim``."""
    front = x.movedim(dim, 0).contiguous()
    part = torch.ops._c10d_functional.reduce_scatter_tensor(front, "sum", group_size, group_name)
    part = torch.ops._c10d_functional.wait_tensor(part)
    return part.movedim(0, dim).contiguous()


@cp_reduce_scatter.register_fake
def _(x: torch.Tensor, dim: int, group_name: str, group_size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] //= group_size
    return x.new_empty(shape)


def _gather_backward(ctx, grad: torch.Tensor):
    return cp_reduce_scatter(grad, ctx.dim, ctx.group_name, ctx.group_size), None, None, None


def _gather_setup(ctx, inputs, output) -> None:
    _, ctx.dim, ctx.group_name, ctx.group_size = inputs


cp_all_gather.register_autograd(_gather_backward, setup_context=_gather_setup)


@functools.cache
def _kv_gatherer(group_name: str, group_size: int):
    """One gather function per group, so compiled blocks see the same one every step."""

    def gather_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (cp_all_gather(k, _SEQ_DIM, group_name, group_size),
                cp_all_gather(v, _SEQ_DIM, group_name, group_size))

    return gather_kv


@contextlib.contextmanager
def masked_context_parallel_context(
    cp_mesh: DeviceMesh,
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    no_restore: set[torch.Tensor],
    load_balance: bool = True,
    model_parts: Sequence[nn.Module] = (),
) -> Iterator[None]:
    """Context parallel for masked attention: shard ``buffers`` (in place) like
    :func:`context_parallel_context` and give every model part this rank's
    :class:`SequenceShard` (``sequence_shard``), so the attention masks it builds cover this
    rank's positions against the whole sequence, whose keys/values attention all-gathers."""
    seq_len = buffers[0].shape[seq_dims[0]]
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    order = sequence_order(seq_len, cp, load_balance).to(buffers[0].device)
    mine = order.view(cp, -1)[rank]
    restore = []
    with torch.no_grad():
        for buffer, dim in zip(buffers, seq_dims, strict=True):
            if not any(buffer is kept for kept in no_restore):
                restore.append((buffer, buffer.clone()))
            part = buffer.index_select(dim, mine.to(buffer.device))
            buffer.resize_(part.shape)
            buffer.copy_(part)
    group = cp_mesh.get_group()
    shard = SequenceShard(mine, order, _kv_gatherer(group.group_name, cp))
    previous = [getattr(model, "sequence_shard", None) for model in model_parts]
    for model in model_parts:
        model.sequence_shard = shard
    try:
        yield
    finally:
        for model, before in zip(model_parts, previous):
            model.sequence_shard = before
        with torch.no_grad():
            for buffer, original in restore:
                buffer.resize_(original.shape)
                buffer.copy_(original)

