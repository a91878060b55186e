"""The plan of a run: every check and derived figure that the config and the world size decide.

:func:`plan_run` is pure (no process group, no devices, no files; the model only on ``meta``
where a check needs its shapes). The pre-flight (:mod:`torchtitan.preflight`) is the plan plus
the checks of files and of this machine's device; :func:`torchtitan.build.build_run` makes the
plan real. A rule lives here once, so the launcher and the ranks refuse the same configs with
the same line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.components.adamw_bf16_state import check_state_dtype
from torchtitan.components.chunked_loss import check_loss_settings
from torchtitan.components.converters import check_converters
from torchtitan.components.fault_tolerance.layout import data_layout
from torchtitan.components.optimizer_in_backward import check_early_step
from torchtitan.components.weight_copies import check_weight_copies
from torchtitan.config.custom import ModuleExited, import_user_module
from torchtitan.config.job_config import Experimental, JobConfig, Training, Validation
from torchtitan.config.planned import reject_planned_settings
from torchtitan.distributed.compile import (
    check_compile_backend,
    validate_compile_components,
)
from torchtitan.distributed.mixed_precision import autocast_dtype, compute_dtype
from torchtitan.distributed.parallel_dims import ParallelDims, ParallelismError
from torchtitan.models import ModelSpec, get_model_spec
from torchtitan.models.common.document_mask import (
    apply_attention_config,
    check_document_separators,
    uses_attention_mask,
)
from torchtitan.models.common.moe import moe_layers
from torchtitan.tools.attention_kernels import check_attention_backend

__all__ = [
    "RunPlan",
    "check_context_parallel",
    "check_expert_parallel",
    "check_validation_seq_len",
    "import_custom_module",
    "gradient_accumulation_steps",
    "plan_run",
    "reject_planned_features",
]


@dataclass
class RunPlan:
    """What a run of one config on ``world_size`` ranks is, before anything is built."""

    parallel_dims: ParallelDims
    model_spec: ModelSpec
    model_args: Any
    """The flavor's args updated from the config (the tokenizer's vocabulary when given)."""
    global_batch_size: int
    gradient_accumulation_steps: int
    data_degree: int
    """Data-parallel ranks of the whole job (fault tolerance: all replica groups)."""
    data_rank_offset: int
    """This replica group's first data rank in the job."""


def import_custom_module(experimental: Experimental) -> None:
    """``experimental.custom_import``: the module that may register a model, a dataset or a
    converter (imported once; later calls are free)."""
    name = experimental.custom_import
    if not name:
        return
    try:
        import_user_module("experimental.custom_import", name)
    except ModuleExited as err:
        raise ImportError(str(err)) from None
    except ModuleNotFoundError as err:
        if err.name is not None and f"{name}.".startswith(f"{err.name}."):
            # the module itself (or a package on its path) is missing: the setting's fault
            raise ImportError(
                f"experimental.custom_import={name!r} cannot be imported ({err}): give a module "
                "on the Python path (e.g. my_pkg.register_model), or unset it"
            ) from None
        raise ImportError(_import_failure(name, err)) from err
    except Exception as err:  # the module's own code failed: one line that says where
        raise ImportError(_import_failure(name, err)) from err


def _import_failure(name: str, err: Exception) -> str:
    """The line for a custom module whose import raised ``err``: where, what, and how to see the
    traceback."""
    import traceback

    if isinstance(err, SyntaxError) and err.filename:
        where = f" ({os.path.basename(err.filename)}, line {err.lineno})"
    else:
        frames = [f for f in traceback.extract_tb(err.__traceback__)
                  if not f.filename.startswith("<frozen")]
        where = f" ({os.path.basename(frames[-1].filename)}, line {frames[-1].lineno})" if frames else ""
    text = err.msg if isinstance(err, SyntaxError) else str(err).strip()
    text = text.splitlines()[0] if text else ""
    what = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return (f"experimental.custom_import={name!r} failed while importing{where}: {what}; "
            f"`python -c 'import {name}'` shows the traceback")


def reject_planned_features(cfg: JobConfig, parallel_dims: ParallelDims) -> None:
    """Fail before any work on settings whose feature is planned but not built yet.

    Running with them silently ignored would train something other than what was asked for.
    ``parse_args_or_exit`` refuses planned config fields already; this repeats that check for
    configs built in code.
    """
    reject_planned_settings(cfg)
    check_converters(cfg)  # known names, consistent [float8] / [mx] settings


def gradient_accumulation_steps(training: Training, dp_degree: int) -> tuple[int, int]:
    """``(global batch size, microbatches per optimizer step)`` for ``dp_degree`` data ranks."""
    local_bs = training.local_batch_size
    global_bs = training.global_batch_size
    if global_bs < 0:
        global_bs = local_bs * dp_degree
    if global_bs % (local_bs * dp_degree):
        raise ParallelismError(
            f"training.global_batch_size={global_bs} must be a multiple of "
            f"local_batch_size*dp = {local_bs}*{dp_degree} = {local_bs * dp_degree}"
        )
    return global_bs, global_bs // (local_bs * dp_degree)


def check_validation_seq_len(validation: Validation, model_args: Any) -> None:
    """Validation batches must fit the model's RoPE table (``max_seq_len``, from
    ``training.seq_len``): ValueError before any step, not at the first validation."""
    max_seq_len = getattr(model_args, "max_seq_len", None)
    if validation.enable and max_seq_len and validation.seq_len > max_seq_len:
        raise ValueError(
            f"validation.seq_len={validation.seq_len} is longer than the model's "
            f"max_seq_len={max_seq_len} (set from training.seq_len): set --validation.seq_len "
            f"{max_seq_len} or less"
        )


def check_context_parallel(cfg: JobConfig, model_args: Any, cp: int) -> None:
    """What context parallel needs beyond the mesh rules: validation batches as long as
    training ones (the RoPE table is sharded for ``training.seq_len``), and a rotate method
    the attention kind uses (masked attention always all-gathers keys/values)."""
    rotate = cfg.parallelism.context_parallel_rotate_method
    if rotate != "allgather" and uses_attention_mask(model_args):
        raise ValueError(
            f"parallelism.context_parallel_rotate_method={rotate} passes key/value blocks "
            "around a ring, which merges causal attention only; with a document mask, a "
            "sliding window or FlexAttention context parallel all-gathers keys/values: use "
            "allgather (the default)"
        )
    if cfg.validation.enable and cfg.validation.seq_len != cfg.training.seq_len:
        raise ValueError(
            f"validation.seq_len={cfg.validation.seq_len} must equal training.seq_len="
            f"{cfg.training.seq_len} with parallelism.context_parallel_degree={cp} (both "
            "shard the same RoPE table)"
        )


def check_expert_parallel(cfg: JobConfig, parallel_dims: ParallelDims, model: Any) -> None:
    """Expert parallel and expert TP need a model with experts whose count and hidden dims
    they divide (``model`` may be on ``meta``)."""
    from torchtitan.distributed.expert_parallel import check_expert_shapes

    layers = moe_layers([model])
    for on, flag, degree in (
        (parallel_dims.ep_enabled, "expert_parallel_degree", parallel_dims.ep),
        (parallel_dims.etp_enabled, "expert_tensor_parallel_degree", parallel_dims.etp),
    ):
        if on and not layers:
            raise ParallelismError(
                f"parallelism.{flag}={degree} needs a mixture-of-experts model; "
                f"{cfg.model.name} {cfg.model.flavor} has no experts (e.g. "
                "--model.name qwen3 --model.flavor debugmodel_moe)"
            )
    for layer in layers:
        try:
            check_expert_shapes(layer, parallel_dims.ep, parallel_dims.etp)
        except ValueError as err:
            raise ParallelismError(str(err)) from None


def _check_pipeline(cfg: JobConfig, parallel_dims: ParallelDims, spec: ModelSpec,
                    model_args: Any, model: Any) -> None:
    """The pipeline plan for pp rank 0, cut from the model on ``meta`` (no memory, no data);
    each rank's own stages are cut by ``spec.pipelining_fn`` with the same functions."""
    from torchtitan.distributed.activation_checkpoint import uses_op_sac
    from torchtitan.distributed.compile import model_compile_enabled
    from torchtitan.distributed.pipeline import (
        check_microbatches,
        check_split_backward_schedule,
        n_microbatches_for,
        resolve_pipeline_layout,
    )

    if spec.pipelining_fn is None:
        raise ParallelismError(
            f"model {cfg.model.name} has no pipeline support; set "
            "parallelism.pipeline_parallel_degree=1"
        )
    p = cfg.parallelism
    layout = resolve_pipeline_layout(p, model, n_layers=model_args.n_layers, pp_rank=0)
    n_microbatches = n_microbatches_for(p, cfg.training.local_batch_size)
    check_microbatches(layout, n_microbatches, p.pipeline_parallel_degree)
    check_split_backward_schedule(
        layout, model_compile_enabled(cfg.compile), uses_op_sac(cfg.activation_checkpoint)
    )


def _check_model_shapes(cfg: JobConfig, parallel_dims: ParallelDims, spec: ModelSpec,
                        model_args: Any) -> None:
    """The checks that need the model's modules (experts, pipeline cut): on ``meta``, and
    only when the layout asks for them."""
    early_step_under_tp = (cfg.optimizer.early_step_in_backward
                           and parallel_dims.tp_splits_moe_tokens)  # refused with MoE layers
    if not (parallel_dims.pp_enabled or parallel_dims.ep_enabled or parallel_dims.etp_enabled
            or early_step_under_tp):
        return
    with torch.device("meta"):  # shapes only: no memory, no init
        model = spec.model_cls(model_args)
    check_expert_parallel(cfg, parallel_dims, model)
    check_early_step(cfg, parallel_dims, has_moe=bool(moe_layers([model])))
    if parallel_dims.pp_enabled:
        _check_pipeline(cfg, parallel_dims, spec, model_args, model)


def plan_run(cfg: JobConfig, world_size: int, *, tokenizer: Any = None,
             parallel_dims: ParallelDims | None = None,
             device_type: str | None = None) -> RunPlan:
    """Check ``cfg`` for ``world_size`` ranks and derive what the build needs: the degrees,
    the batch arithmetic, the model args. Raises the one-line errors of a bad config
    (``ConfigError``, ``ParallelismError``, ``ValueError``, ``ImportError``).

    ``tokenizer`` (the ranks have one) sets the vocabulary and checks the document
    separators; ``parallel_dims`` reuses degrees already resolved from ``cfg``;
    ``device_type`` (the ranks' device: ``cpu`` / ``cuda``) adds the rules of that device.
    """
    import_custom_module(cfg.experimental)
    if parallel_dims is None:
        parallel_dims = ParallelDims.from_config(cfg.parallelism, world_size)
    reject_planned_features(cfg, parallel_dims)
    # Under fault tolerance the replica groups split the data (and the global batch) too.
    data_degree, data_rank_offset = data_layout(cfg.fault_tolerance, parallel_dims.dp_degree, 0)
    global_bs, grad_accum = gradient_accumulation_steps(cfg.training, data_degree)

    spec = get_model_spec(cfg.model.name)
    model_args = spec.get_model_args(cfg.model.flavor)
    model_args.update_from_config(cfg, tokenizer=tokenizer)
    apply_attention_config(cfg.model, model_args)  # attn_mask_type / use_flex_attn / window
    if hasattr(model_args, "validate"):
        model_args.validate()
    check_document_separators(model_args, tokenizer)
    check_attention_backend(
        cfg.model.attention_backend, model_args, cp=parallel_dims.cp, device_type=device_type,
        compute_dtype=compute_dtype(cfg.training, parallel_dims),
    )
    parallel_dims.validate_for_model(
        n_heads=model_args.n_heads,
        n_kv_heads=model_args.effective_n_kv_heads,
        n_layers=model_args.n_layers,
        seq_len=cfg.training.seq_len,
    )
    if parallel_dims.cp_enabled:
        check_context_parallel(cfg, model_args, parallel_dims.cp)
    check_validation_seq_len(cfg.validation, model_args)
    check_loss_settings(cfg.training)
    validate_compile_components(cfg.compile)
    check_compile_backend(cfg.compile)
    check_early_step(cfg, parallel_dims)
    check_state_dtype(cfg.optimizer)
    check_weight_copies(cfg, parallel_dims, autocast_dtype(cfg.training, parallel_dims),
                        grad_accum)
    _check_model_shapes(cfg, parallel_dims, spec, model_args)
    return RunPlan(
        parallel_dims=parallel_dims,
        model_spec=spec,
        model_args=model_args,
        global_batch_size=global_bs,
        gradient_accumulation_steps=grad_accum,
        data_degree=data_degree,
        data_rank_offset=data_rank_offset,
    )
