"""The output projection fused with cross-entropy, a chunk of tokens at a time.

The plain path materialises the ``[tokens, vocab]`` logits (then a float32 copy, its
log-softmax and its gradient: several bytes per logit, gigabytes at a 128k vocabulary).
:func:`linear_cross_entropy_sum` computes the same summed token loss without ever holding more
than ``chunk_size`` rows of logits: for each chunk it projects, takes the float32 loss and the
gradient of the logits (``softmax - onehot``), and folds that gradient straight into the
gradients of the hidden states and of the weight. The backward only scales those by the
incoming gradient (a scalar). Same matmuls as the plain path, no recomputation; the numbers
equal the plain path's within float rounding (the gradient of the logits is rounded to the
compute dtype before the loss scale is applied instead of after; with several chunks, the
weight's gradient is rounded to the compute dtype once per chunk).

Under tensor parallelism the weight is a ``DTensor`` sharded over the vocabulary (``Shard(0)``)
and the hidden states arrive sequence-sharded: the chunk's max, sum of exponentials and label
logit are all-reduced over the TP ranks (vocabulary-parallel cross-entropy, Megatron's), the
hidden states' gradient is reduce-scattered back to sequence shards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from torchtitan.components.loss import IGNORE_INDEX

__all__ = ["DEFAULT_CHUNK_SIZE", "linear_cross_entropy_sum", "precomputed_loss"]

DEFAULT_CHUNK_SIZE = 8192


def precomputed_loss(loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The trainer's loss function when the model's output head already returned the summed
    token loss (``model(tokens, labels=labels)``)."""
    return loss


EAGER_BLOCK_BYTES = 128 * 2**20
"""The eager loss works on this many bytes of float32 logits at a time (rows of a chunk)."""


def _row_blocks(rows: int, width: int) -> list[tuple[int, int]]:
    """``[start, end)`` row ranges of a ``rows x width`` chunk, ``EAGER_BLOCK_BYTES`` of
    float32 each."""
    step = max(1, EAGER_BLOCK_BYTES // (4 * max(width, 1)))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def _chunk_loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, grad_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed float32 cross-entropy of one chunk and the gradient of its logits (in
    ``grad_dtype``); rows whose label is ``IGNORE_INDEX`` add nothing to either.

    A block of rows at a time (``EAGER_BLOCK_BYTES`` of float32), the gradient written over
    ``logits`` when it has ``grad_dtype``: like the compiled version, no float32 copy of the
    whole chunk (3.9 GiB for 8192 tokens of Llama 3's vocabulary), so an eager run, and the
    memory estimate of a compiled one, hold what the compiled loss holds. Each row's values
    are the whole-chunk computation's, and the loss sums the same per-row vector."""
    n, vocab = logits.shape
    grad = logits if logits.dtype == grad_dtype else torch.empty_like(logits, dtype=grad_dtype)
    row_loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    for start, end in _row_blocks(n, vocab):
        block = logits[start:end].float()  # float32 logits: these rows themselves
        valid = labels[start:end] != IGNORE_INDEX
        safe = torch.where(valid, labels[start:end], 0)
        lse = torch.logsumexp(block, dim=-1)
        target = block.gather(1, safe[:, None]).squeeze(1)
        row_loss[start:end] = torch.where(valid, lse - target, 0.0)
        block.sub_(lse[:, None]).exp_()  # softmax
        block.scatter_add_(1, safe[:, None], -valid[:, None].to(block.dtype))  # minus one-hot
        block.mul_(valid[:, None])
        grad[start:end].copy_(block)
    return row_loss.sum(), grad


def _chunk_loss_grad_into_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """:func:`_chunk_loss_and_grad` written for the compiler: the same values, but the
    gradient of the logits overwrites ``logits`` (in its dtype) and nothing else of the
    chunk's size is allocated: compiled, a reduction for the log-sum-exp and one pointwise
    kernel that reads each logit in its dtype and writes its gradient in place (not even
    a block of float32 rows, as the eager version makes)."""
    x = logits.float()
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, 0)
    lse = torch.logsumexp(x, dim=-1)
    target = x.gather(1, safe[:, None]).squeeze(1)
    loss = torch.where(valid, lse - target, 0.0).sum()
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == safe[:, None]
    grad = torch.where(valid[:, None], torch.exp(x - lse[:, None]) - onehot.to(x.dtype), 0.0)
    logits.copy_(grad)
    return loss


@functools.cache
def _compiled_chunk_loss_grad_into_logits(backend: str) -> Callable:
    return torch.compile(_chunk_loss_grad_into_logits, backend=backend, dynamic=False)


def _chunk_loss_and_grad_any(
    logits: torch.Tensor, labels: torch.Tensor, grad_dtype: torch.dtype, compiled: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's loss and the gradient of its logits: compiled (``compiled``: a backend)
    in ``logits``' own storage, else eagerly."""
    if compiled and logits.dtype == grad_dtype:
        return _compiled_chunk_loss_grad_into_logits(compiled)(logits, labels), logits
    return _chunk_loss_and_grad(logits, labels, grad_dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss and both gradients in the forward; the backward scales them."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunk_size, compiled, tp_group, vocab_start):
        n = h.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_grad else None
        grad_w = None
        for start in range(0, n, chunk_size):
            h_c, labels_c = h[start:start + chunk_size], labels[start:start + chunk_size]
            logits = h_c @ weight.t()
            if tp_group is None:
                loss_c, grad_logits = _chunk_loss_and_grad_any(logits, labels_c, h.dtype, compiled)
            else:
                loss_c, grad_logits = _vocab_parallel_chunk(
                    logits, labels_c, h.dtype, tp_group, vocab_start
                )
            del logits  # (eagerly, a chunk's worth of memory less during the matmuls below)
            loss += loss_c
            if need_grad:
                grad_h[start:start + chunk_size] = grad_logits @ weight
                grad_w = _add_weight_grad(grad_w, grad_logits, h_c)
            del grad_logits
        if need_grad:
            if grad_w is None:  # no tokens
                grad_w = torch.zeros_like(weight)
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # scaled in place: no second weight-sized gradient at the start of the backward (a
        # second backward through the same graph then fails torch's saved-tensor version
        # check instead of scaling twice); the foreach kernel reads the device scalar
        # vectorised, where a broadcast multiply takes torch's strided path
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_loss.to(grad_h.dtype)
        torch._foreach_mul_([grad_h], scale)
        torch._foreach_mul_([grad_w], scale.to(grad_w.dtype))
        return grad_h, grad_w, None, None, None, None, None


def _add_weight_grad(
    acc: torch.Tensor | None, grad_logits: torch.Tensor, h: torch.Tensor
) -> torch.Tensor:
    """``acc + grad_logits.T @ h`` in the compute dtype: the first chunk's product as it is
    (one chunk: exactly the plain path's matmul), later chunks added in place by the matmul
    (which sums in float32 and rounds once per chunk): no weight-sized float32 buffer, and
    the gradient is held in the dtype it ends in anyway."""
    if acc is None:
        return grad_logits.t() @ h
    return acc.addmm_(grad_logits.t(), h)


def _vocab_parallel_chunk(
    logits: torch.Tensor, labels: torch.Tensor, grad_dtype: torch.dtype,
    group: dist.ProcessGroup, vocab_start: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_chunk_loss_and_grad` for this rank's slice of the vocabulary
    ``[vocab_start, vocab_start + logits.shape[-1])``: the max, the sum of exponentials and the
    label's logit are all-reduced over ``group`` (two all-reduces per chunk). Like the
    unsharded version, on blocks of rows in float32 with the gradient written over the logits
    (the exponentials are computed again for the gradient rather than kept in float32)."""
    n, width = logits.shape
    grad = logits if logits.dtype == grad_dtype else torch.empty_like(logits, dtype=grad_dtype)
    valid = labels != IGNORE_INDEX
    local = labels - vocab_start
    mine = valid & (local >= 0) & (local < width)
    safe = torch.where(mine, local, 0)
    row_max = logits.max(dim=-1).values.float()  # (a max is exact in any dtype)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    # the label's logit less the row max (as the exponentials below), on the rank holding it
    target = torch.where(mine, logits.gather(1, safe[:, None]).squeeze(1).float() - row_max, 0.0)
    sum_exp = torch.empty(n, dtype=torch.float32, device=logits.device)
    blocks = _row_blocks(n, width)
    for start, end in blocks:  # out of place: float32 logits are these rows themselves
        sum_exp[start:end] = torch.exp(logits[start:end].float() - row_max[start:end, None]).sum(-1)
    sums = torch.stack([sum_exp, target])
    dist.all_reduce(sums, group=group)
    sum_exp, target = sums[0], sums[1]
    loss = torch.where(valid, torch.log(sum_exp) - target, 0.0).sum()
    for start, end in blocks:
        block = logits[start:end].float()
        block.sub_(row_max[start:end, None]).exp_().div_(sum_exp[start:end, None])
        block.scatter_add_(1, safe[start:end, None], -mine[start:end, None].to(block.dtype))
        block.mul_(valid[start:end, None])
        grad[start:end].copy_(block)
    return loss, grad


def linear_cross_entropy_sum(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE, compiled: str | None = None,
) -> torch.Tensor:
    """Summed token cross-entropy (float32) of ``h @ weight.T`` against ``labels``, without
    materialising the logits: ``h`` ``[..., D]``, ``weight`` ``[V, D]``, ``labels`` ``h``'s
    leading shape, ``IGNORE_INDEX`` rows do not count. ``chunk_size`` tokens are projected at
    a time; ``compiled`` (a ``torch.compile`` backend, e.g. ``"inductor"``) compiles the
    per-chunk float32 math (one pass over the chunk's logits).

    Under autocast the projection runs in the autocast dtype, as ``nn.Linear`` would. A
    ``DTensor`` ``weight`` sharded over the vocabulary on a 1-D mesh (tensor parallel, with
    ``h`` a DTensor on the same mesh) takes the vocabulary-parallel path; the loss is then the
    same plain tensor on every TP rank.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        h, weight = h.to(dtype), weight.to(dtype)
    tp_group, vocab_start = None, 0
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        h, weight, tp_group, vocab_start = _local_vocab_parallel(h, weight)
    elif isinstance(h, DTensor):
        raise ValueError("linear_cross_entropy_sum: h is a DTensor but the weight is not")
    flat_h = h.reshape(-1, h.shape[-1])
    flat_labels = labels.reshape(-1)
    if flat_labels.shape[0] != flat_h.shape[0]:
        raise ValueError(
            f"linear_cross_entropy_sum: {flat_h.shape[0]} hidden states but "
            f"{flat_labels.shape[0]} labels"
        )
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(
            flat_h, weight, flat_labels, chunk_size, compiled, tp_group, vocab_start
        )


def _local_vocab_parallel(h, weight):
    """``(h_local, weight_local, group, vocab_start)`` for a vocabulary-sharded weight: ``h``
    gathered to the whole sequence (its gradient reduce-scattered back), the weight's rows of
    this rank."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.placements != (Shard(0),):
        raise ValueError(
            f"linear_cross_entropy_sum: the weight must be sharded over the vocabulary on a "
            f"1-D mesh, got placements {weight.placements} on a {mesh.ndim}-D mesh"
        )
    if not isinstance(h, DTensor):
        h = DTensor.from_local(h, mesh, [Replicate()], run_check=False)
    h = h.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    rows = weight.to_local()
    vocab = weight.shape[0]
    rank, size = mesh.get_local_rank(), mesh.size()
    per_rank = -(-vocab // size)  # DTensor's Shard(0): ceil-sized pieces, the last shorter
    return h, rows, mesh.get_group(), min(rank * per_rank, vocab)


def choose_loss_path(
    implementation: str, chunk_size: int, device_type: str, model: torch.nn.Module,
    family_loss: bool, tp_logits_replicated: bool,
) -> bool:
    """Whether the run fuses the output projection with the loss (``training.
    loss_implementation``: ``logits``, ``chunked`` or ``auto``: chunked on CUDA). Chunked
    needs the decoder's plain output head (not converted, e.g. by float8), the shared
    cross-entropy (``family_loss``: the family declares its own) and, under tensor parallel,
    loss parallel (``tp_logits_replicated``: it is off). ``chunked`` where it cannot apply is
    a one-line ValueError; ``auto`` then computes the logits and says why. A chunk size set
    for a run that takes the logits path warns that it does nothing."""
    from torchtitan.config.job_config import Training
    from torchtitan.tools.logging import logger

    fused = _choose_loss_path(implementation, chunk_size, device_type, model, family_loss,
                              tp_logits_replicated)
    if not fused and chunk_size != Training().loss_chunk_size:
        logger.warning(
            f"training.loss_chunk_size={chunk_size} has no effect: the loss takes the full "
            f"logits (training.loss_implementation={implementation}"
            + (", which is chunked on CUDA only)" if implementation == "auto" else ")")
        )
    return fused


def _choose_loss_path(
    implementation: str, chunk_size: int, device_type: str, model: torch.nn.Module,
    family_loss: bool, tp_logits_replicated: bool,
) -> bool:
    from torchtitan.tools.logging import logger

    if implementation == "logits":
        return False
    head = getattr(model, "output", None)
    obstacle = None
    if not hasattr(head, "fuse_loss"):  # the decoder's OutputHead (not imported: a cycle)
        obstacle = (
            "the model has no plain output projection" if head is None else
            f"the output projection is a {type(head).__name__} (a converter replaced it; for "
            "float8 keep 'output' in quantize.linear.float8.filter_fqns)"
        )
    elif head.bias is not None:
        obstacle = "the output projection has a bias"
    elif family_loss:
        obstacle = "this model family declares its own loss"
    elif tp_logits_replicated:
        obstacle = "parallelism.disable_loss_parallel gathers the logits under tensor parallel"
    if obstacle is not None:
        if implementation == "chunked":
            raise ValueError(f"training.loss_implementation=chunked cannot apply: {obstacle}")
        if device_type == "cuda":
            logger.info(f"Loss: full logits ({obstacle})")
        return False
    if implementation == "auto" and device_type != "cuda":
        return False
    logger.info(
        f"Loss: output projection fused with cross-entropy over {chunk_size}-token chunks "
        "(the logits never exist whole; --training.loss_implementation logits for the full logits)"
    )
    return True


def check_loss_settings(training) -> None:
    """One-line ValueError for ``training.loss_chunk_size`` below 1."""
    if training.loss_chunk_size < 1:
        raise ValueError(
            f"training.loss_chunk_size={training.loss_chunk_size} must be >= 1 (tokens per "
            "chunk of the chunked loss)"
        )
