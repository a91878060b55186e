"""The gradient half of a training step, shared by the Trainer and the memory estimator.

Loss normalisation: every microbatch's summed token loss (over this rank's part of the
sequence under context parallel) is multiplied by ``n_loss_ranks / global_valid_tokens``,
where the loss ranks are ``dp x cp``. Gradient reduction averages over those ranks, so the
result is the gradient of (sum of token losses) / (global valid tokens): the same for any
data-parallel or context-parallel layout and any gradient-accumulation split.

No host copies: the token count, the loss scale, the loss, the grad norm and the MoE load
figures stay 0-dim tensors on the device (the token count is all-reduced as a tensor), so the
host never waits for the device within a step; the Trainer copies them at log steps.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch

from torchtitan.build import RunParts
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.pipeline.evaluation import local_value
from torchtitan.models.common.document_mask import uses_attention_mask
from torchtitan.models.common.moe import update_load_balance_bias

Batch = tuple[torch.Tensor, torch.Tensor]


def loss_context(run: RunParts) -> contextlib.AbstractContextManager:
    """Context for forward+backward (and validation): loss parallel under TP."""
    if run.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def sequence_context(
    run: RunParts, inputs: torch.Tensor, labels: torch.Tensor
) -> contextlib.AbstractContextManager:
    """Context parallel: shard ``inputs``/``labels`` (in place, for good) and every model
    part's RoPE table along the sequence, and run causal attention as ring attention (masked
    attention: against all-gathered keys/values). A no-op without CP."""
    cp_mesh = run.parallel_dims.get_mesh("cp")
    if cp_mesh is None:
        return contextlib.nullcontext()
    from torchtitan.distributed import context_parallel as cp

    rope_tables = [part.freqs_cis for part in run.model_parts]
    shard = dict(
        buffers=[inputs, labels, *rope_tables],
        seq_dims=[1, 1, *[0] * len(rope_tables)],
        no_restore={inputs, labels},
        load_balance=run.parallel_dims.cp_load_balance,
    )
    if uses_attention_mask(run.model_args):
        return cp.masked_context_parallel_context(cp_mesh, model_parts=run.model_parts, **shard)
    return cp.context_parallel_context(
        cp_mesh, rotate_method=run.job_config.parallelism.context_parallel_rotate_method, **shard
    )

def model_inputs(
    run: RunParts, inputs: torch.Tensor, labels: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Keyword inputs of the model's forward besides the tokens: ``document_ids`` (from the
    tokenizer's BOS/EOS in ``inputs``) when the model masks attention by document (or uses a
    window or FlexAttention: the ids give every model part the batch's shape), and ``labels``
    when the model's output head computes the loss (``run.loss_in_model``). Built here, once
    per batch, so every model part (pipeline stages too) gets them."""
    kwargs = {}
    if run.loss_in_model and labels is not None:
        kwargs["labels"] = labels
    if not uses_attention_mask(run.model_args):
        return kwargs
    from torchtitan.models.common.document_mask import document_ids

    tokenizer = run.tokenizer
    bos = tokenizer.bos_id if tokenizer is not None else -1
    eos = tokenizer.eos_id if tokenizer is not None else -1
    kwargs["document_ids"] = document_ids(inputs, bos, eos)
    return kwargs


def forward_backward(
    run: RunParts, inputs: torch.Tensor, labels: torch.Tensor, loss_scale: torch.Tensor | float
) -> torch.Tensor:
    """Forward and backward of one microbatch; returns its scaled loss (detached; 0 on
    pipeline ranks without the last stage)."""
    if run.parallel_dims.cp_enabled:  # the batch is resized in place: own its storage
        inputs, labels = inputs.clone(), labels.clone()
    kwargs = model_inputs(run, inputs, labels)
    with loss_context(run), sequence_context(run, inputs, labels):
        if run.pipeline is not None:
            # The schedule splits the batch (and kwargs) into pipeline microbatches itself.
            return run.pipeline.train_step(inputs, labels, loss_scale, **kwargs)
        pred = run.model_parts[0](inputs, **kwargs)
        loss = run.loss_fn(pred, labels) * loss_scale
        del pred
        loss.backward()
    # Under loss parallel the loss is a replicated DTensor; its full value is the loss.
    return local_value(loss.detach())


def _valid_tokens(labels: torch.Tensor) -> int:
    """Labels that count toward the loss (real labels also under an ambient fake mode)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return int((labels != IGNORE_INDEX).sum())


def _loss_scale(
    run: RunParts, microbatches: Sequence[Batch]
) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """``(global valid tokens, n_loss_ranks / global valid tokens)`` of one optimizer step.

    0-dim device tensors, computed without a host copy: the count in float64 (summed over the
    data-parallel ranks), the scale in float32, the loss's dtype, so that ``loss * scale``
    rounds exactly as a Python-float scale did. Python floats when the comm mode computes no
    values (fake tensors: the count comes from the real labels).
    """
    loss_mesh = run.loss_mesh
    n_loss_ranks = 1 if loss_mesh is None else loss_mesh.size()
    dp_mesh = run.parallel_dims.get_mesh("dp")
    # Context-parallel ranks share their batch: count its tokens once per data-parallel rank.
    if not run.comm_mode.computes_values:
        tokens = dist_utils.dist_reduce(
            sum(_valid_tokens(labels) for _, labels in microbatches), "sum", dp_mesh
        )
        return tokens, n_loss_ranks / max(tokens, 1.0)
    local = sum((labels != IGNORE_INDEX).sum() for _, labels in microbatches)
    tokens = dist_utils.all_reduce_scalar(local, "sum", dp_mesh)
    return tokens, (n_loss_ranks / tokens.clamp_min(1.0)).float()


def compute_gradients(
    run: RunParts, microbatches: Sequence[Batch]
) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """Forward+backward over one optimizer step's microbatches, then clip the gradients.

    Returns ``(global mean token loss, total grad norm before clipping)``, the same on every
    rank, as 0-dim device tensors (float64 loss, float32 norm: no host copy); NaN floats for
    both when the comm mode computes no values (fake tensors).
    """
    loss_mesh = run.loss_mesh
    n_loss_ranks = 1 if loss_mesh is None else loss_mesh.size()
    run.step_tokens, scale = _loss_scale(run, microbatches)
    copies = (run.weight_copies.active() if run.weight_copies is not None
              else contextlib.nullcontext())  # the copies stand in through the norm
    with run.comm_mode.step(), copies:
        local_loss = torch.zeros((), device=run.device)
        for i, (inputs, labels) in enumerate(microbatches):
            run.optimizers.before_backward(final=i == len(microbatches) - 1)
            local_loss += forward_backward(run, inputs, labels, scale)
        for hook in run.after_backward:
            hook()
        if run.optimizers.steps_in_backward:  # stepped already: the norms its hooks took
            grad_norm = dist_utils.total_norm(run.optimizers.take_grad_norms())
        else:
            max_norm = run.job_config.training.max_norm
            # Clipping inside the fused optimizer step saves a pass over every gradient.
            in_step = max_norm > 0 and clip_in_step(run)
            grad_norm = dist_utils.clip_grad_norm_(
                [p for m in run.model_parts for p in m.parameters()],
                0.0 if in_step else max_norm,
                foreach=True,
                pp_mesh=run.parallel_dims.get_mesh("pp"),
                exclude_from_norm=run.pipeline.norm_duplicates() if run.pipeline is not None else (),
            )
            if in_step:
                run.optimizers.set_grad_divisor(dist_utils.clip_divisor(grad_norm, max_norm))
    if not run.comm_mode.computes_values:
        return math.nan, math.nan
    loss = dist_utils.all_reduce_scalar(local_loss / n_loss_ranks, "sum", loss_mesh)
    if run.pipeline is not None:  # only last-stage ranks hold it; the others add 0
        loss = dist_utils.all_reduce_scalar(loss, "sum", run.pipeline.pp_mesh)
    return loss, grad_norm


def clip_in_step(run: RunParts) -> bool:
    """Gradient clipping happens inside the optimizer step (``optimizer.clip_in_step`` and
    optimizers that can: torch's fused Adam/AdamW) rather than as a rescale of every gradient.
    Not on fake tensors (dry runs and estimates count the plain path's memory)."""
    return (run.job_config.optimizer.clip_in_step and run.comm_mode.computes_values
            and run.optimizers.clips_in_step)


def gradients_rescaled(run: RunParts) -> bool:
    """Whether :func:`compute_gradients` rescales every gradient in place by the clip factor
    (a non-finite norm then makes every gradient non-finite)."""
    return (run.job_config.training.max_norm > 0 and not run.optimizers.steps_in_backward
            and not clip_in_step(run))


def optimizer_step(run: RunParts) -> dict[str, torch.Tensor]:
    """Update the MoE load-balancing biases from this step's routing (token counts summed over
    the data- and context-parallel ranks, and the TP ranks when they split the MoE tokens),
    apply the optimizers, run the model converters' post-optimizer hooks (float8 precomputes
    its FSDP all-gather scales) and advance the LR schedules.

    Returns the step's MoE load figures (``moe/max_load`` ...; empty without MoE layers) as
    0-dim device tensors (no host copy).
    """
    # the ranks that routed different tokens: data and context parallel, and TP when the TP
    # ranks split the MoE tokens
    meshes = [run.loss_mesh]
    if run.parallel_dims.tp_splits_moe_tokens:
        meshes.append(run.parallel_dims.get_mesh("tp_tokens"))

    def reduce_sum(counts: torch.Tensor) -> torch.Tensor:
        for mesh in meshes:
            if mesh is not None:
                torch.distributed.all_reduce(counts, group=mesh.get_group())
        return counts

    with run.comm_mode.step():
        figures = update_load_balance_bias(run.moe_layers, reduce_sum)
        run.optimizers.step()
        run.converters.post_optimizer_hook(run.model_parts)  # e.g. float8 FSDP scales
    run.lr_schedulers.step()
    return figures
