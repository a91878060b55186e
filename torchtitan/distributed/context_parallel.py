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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

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


def check_context_parallel_model(model_args: object) -> None:
    """Refuse attention kinds ring attention cannot split (one line, before any work)."""
    if getattr(model_args, "use_flex_attn", False):
        raise ValueError(
            "parallelism.context_parallel_degree > 1 needs SDPA attention; this flavor uses "
            "FlexAttention, which context parallel does not split here"
        )
    mask = getattr(model_args, "attn_mask_type", "causal")
    if mask != "causal":
        raise ValueError(
            f"parallelism.context_parallel_degree > 1 supports causal attention only; this "
            f"flavor's attn_mask_type is {mask!r}"
        )
    window = getattr(model_args, "sliding_window_size", None)
    if window:
        raise ValueError(
            f"parallelism.context_parallel_degree > 1 supports causal attention only; "
            f"model.sliding_window_size={window} needs a mask ring attention does not split"
        )
