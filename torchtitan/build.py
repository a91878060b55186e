"""One build path: config -> mesh -> tokenizer, data -> model parts -> optimizers -> loss.

:func:`build_run` is what the Trainer, the memory estimator and both COMM_MODE dry runs use to
set a run up; the :class:`~torchtitan.distributed.comm_mode.CommMode` it is given decides the
process group, the data source and the tensor modes, so nothing here asks which mode is on.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.components.chunked_loss import choose_loss_path, precomputed_loss
from torchtitan.components.converters import ModelConverters, build_converters
from torchtitan.components.lr_scheduler import LRSchedulersContainer, build_lr_schedulers
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer_in_backward import build_optimizers_in_backward
from torchtitan.components.weight_copies import (
    WeightCopies,
    build_weight_copies,
    choose_weight_copies,
    uncopied_float8_linears,
)
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.comm_mode import CommMode
from torchtitan.distributed.compile import isolate_compile_cache
from torchtitan.distributed.expert_parallel import moe_grad_hooks
from torchtitan.distributed.fsdp import to_torch_dtype
from torchtitan.distributed.mixed_precision import (
    apply_autocast,
    autocast_dtype,
    compute_dtype,
    log_precision,
)
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline import Pipeline
from torchtitan.models import ModelSpec, get_model_spec
from torchtitan.models.common.moe import MoE, moe_layers
from torchtitan.plan import import_custom_module, plan_run, reject_planned_features
from torchtitan.tools.attention_kernels import resolve_attention_backend, set_attention_backend
from torchtitan.tools.device import device_type, get_device
from torchtitan.tools.logging import logger


@dataclass
class RunParts:
    """Everything a training step needs, built once by :func:`build_run`."""

    job_config: JobConfig
    comm_mode: CommMode
    parallel_dims: ParallelDims
    world_mesh: DeviceMesh | None
    device: torch.device
    rank: int
    seed: int
    model_spec: ModelSpec
    model_args: Any
    tokenizer: Any
    dataloader: Any
    build_dataloader: Callable[..., Any]
    """``build(dataset, dataset_path, local_batch_size, seq_len, dp_rank, infinite)``."""
    model_parts: list[torch.nn.Module]
    pipeline: Pipeline | None
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    nparams: int
    flops_per_token: float
    global_batch_size: int
    gradient_accumulation_steps: int
    after_backward: list[Callable[[], None]]
    """Run once the step's gradients are reduced, before clipping (e.g. expert-parallel scaling)."""
    moe_layers: list[MoE]
    """The mixture-of-experts layers of this rank's model parts (empty for dense models)."""
    compute_dtype: str
    """The dtype matmuls run in (``float32`` / ``bfloat16``): the MFU peak is chosen by it."""
    loss_parallel: bool
    loss_in_model: bool = False
    """The model's output head computes the summed loss (``model(tokens, labels=labels)``,
    the chunked loss); ``loss_fn`` then only passes it on."""
    weight_copies: WeightCopies | None = None
    """Low-precision copies of the linear weights the step runs on (``training.weight_copies``)."""
    converters: ModelConverters = field(default_factory=ModelConverters)
    """``model.converters`` (float8, mx): applied before parallelizing; hooked after each
    optimizer step."""
    step_tokens: torch.Tensor | float = 0.0
    """The current step's valid labels over this job's data-parallel ranks (what the loss is
    normalised by; a 0-dim device tensor); set by ``compute_gradients`` before the
    ``after_backward`` hooks."""

    @property
    def loss_mesh(self) -> DeviceMesh | None:
        """Ranks whose losses add up to the global batch's (data parallel x context parallel)."""
        return self.parallel_dims.get_mesh("dp_cp")




def hf_state_dict_adapter(run: RunParts) -> Any | None:
    """The model's HF state-dict adapter (None: it has none). HF exports get the flavor's
    context length as max_position_embeddings, not this run's training.seq_len."""
    import copy

    spec, cfg = run.model_spec, run.job_config
    if spec.state_dict_adapter is None:
        return None
    args = copy.copy(run.model_args)
    if hasattr(args, "max_seq_len"):
        args.max_seq_len = spec.get_model_args(cfg.model.flavor).max_seq_len
    return spec.state_dict_adapter(args, cfg.model.hf_assets_path)


def _shared_loss(spec: ModelSpec) -> bool:
    """The family uses the shared cross-entropy (not a loss of its own)."""
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.models.spec import LazyCallable

    fn = spec.build_loss_fn
    return (fn.resolve() if isinstance(fn, LazyCallable) else fn) is build_cross_entropy_loss


def dataloader_factory(
    spec: ModelSpec, cfg: JobConfig, tokenizer: Any, dp_world_size: int
) -> Callable[..., Any]:
    """``build(dataset, dataset_path, local_batch_size, seq_len, dp_rank, infinite)``: a
    dataloader for one data-parallel rank, from the model spec's builder."""

    def build(dataset: str, dataset_path: str | None, local_batch_size: int, seq_len: int,
              dp_rank: int, infinite: bool) -> Any:
        return spec.build_dataloader_fn(
            dataset_name=dataset,
            dataset_path=dataset_path,
            tokenizer=tokenizer,
            local_batch_size=local_batch_size,
            seq_len=seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            infinite=infinite,
            dataloader_config=cfg.training.dataloader,
            seed=cfg.debug.seed or 0,  # a dataset mix's draws (0 when the seed is unset)
        )

    return build










def log_resolved_config(cfg: JobConfig, rank: int) -> None:
    """Rank 0 logs ``job.description``, prints (``job.print_config``) and saves
    (``job.save_config_file``) the config."""
    if rank != 0:
        return
    from torchtitan.config.toml_io import config_to_toml, save_config

    logger.info(f"Job: {cfg.job.description}")
    if cfg.job.print_config:
        logger.info(f"Resolved config:\n{config_to_toml(cfg)}")
    if cfg.job.save_config_file:
        path = os.path.join(cfg.job.dump_folder, cfg.job.save_config_file)
        try:
            save_config(cfg, path)
        except OSError as err:
            import errno

            fix = ("free space there" if err.errno == errno.ENOSPC
                   else "give a file name inside job.dump_folder")
            raise ValueError(
                f"job.save_config_file={cfg.job.save_config_file!r} cannot be written to {path} "
                f"({err.strerror or type(err).__name__}): {fix}"
            ) from None
        logger.info(f"Saved the resolved config to {path}")


def _weight_copies(cfg: JobConfig, parallel_dims: ParallelDims, autocast: torch.dtype | None,
                   model_parts: list[nn.Module], device_type: str,
                   grad_accum: int) -> WeightCopies | None:
    """The run's weight copies (``training.weight_copies``), logged in one line; None: none."""
    if not choose_weight_copies(cfg, parallel_dims, autocast, device_type, grad_accum):
        return None
    every = cfg.training.weight_copies == "on"
    copies = build_weight_copies(model_parts, autocast, float8=every,
                                 grad_views=cfg.float8.weight_grad_views)
    if not copies:
        if every:
            raise ValueError("training.weight_copies=on cannot apply: the model has no plain "
                             "linear layer weights to copy")
        return None
    n = sum(w.numel() for w in copies.masters)
    views = len(copies.views)
    skipped = 0 if every else uncopied_float8_linears(model_parts) - views
    logger.info(f"Weight copies: {len(copies)} linear weights ({n:,} parameters) in "
                f"{str(autocast).removeprefix('torch.')}, written by the optimizer step "
                "(--training.weight_copies off: autocast casts them every step)"
                + (f"; {views} float8 linears cast their float32 weights and keep bf16 "
                   "gradients through views of them (no memory)" if views else "")
                + (f"; not the {skipped} float8 linears' (--training.weight_copies on copies "
                   "them too: faster, 2 bytes a parameter more memory)" if skipped else ""))
    return copies


def build_run(cfg: JobConfig, comm_mode: CommMode, device: torch.device | None = None) -> RunParts:
    """Set up a run of ``cfg`` on ``comm_mode.world_size`` ranks; returns its parts.

    Order: process group and mesh, seed, batch arithmetic, tokenizer and dataloader, the model
    on ``meta``, parallelized (or split into pipeline stages), materialised and initialised,
    then optimizers and LR schedulers. Raises ParallelismError / ValueError /
    FileNotFoundError with one line meant for people.
    """
    import_custom_module(cfg.experimental)  # it may register the model, dataset or converter
    device = device if device is not None else get_device()
    parallel_dims = ParallelDims.from_config(cfg.parallelism, comm_mode.world_size)
    reject_planned_features(cfg, parallel_dims)  # not built: refused before any mode's rules
    comm_mode.prepare(cfg, parallel_dims)
    converters = build_converters(cfg, parallel_dims, device.type)  # refuses what it cannot run
    comm_mode.init_process_group(cfg, device_type)
    world_mesh = parallel_dims.build_mesh(device.type)
    rank = dist.get_rank() if dist.is_initialized() else 0
    isolate_compile_cache(rank, dist.get_world_size() if dist.is_initialized() else 1)
    log_resolved_config(cfg, rank)
    seed = dist_utils.set_determinism(world_mesh, device, cfg.debug)

    spec = get_model_spec(cfg.model.name)
    tokenizer = comm_mode.build_tokenizer(spec.build_tokenizer_fn, cfg.model)
    # Every check of the config (the pre-flight's too), with this run's tokenizer.
    plan = plan_run(cfg, comm_mode.world_size, tokenizer=tokenizer, parallel_dims=parallel_dims,
                    device_type=device.type)
    model_args = plan.model_args
    global_bs, grad_accum = plan.global_batch_size, plan.gradient_accumulation_steps
    data_degree, data_rank_offset = plan.data_degree, plan.data_rank_offset

    build_dataloader = dataloader_factory(spec, cfg, tokenizer, parallel_dims.dp_degree)
    build_train_data = dataloader_factory(spec, cfg, tokenizer, data_degree)

    def build_train_loader(dp_rank: int) -> Any:
        t = cfg.training
        return build_train_data(t.dataset, t.dataset_path, t.local_batch_size, t.seq_len,
                                data_rank_offset + dp_rank, infinite=True)

    dataloader = comm_mode.build_dataloader(
        build_train_loader, parallel_dims, cfg.training.local_batch_size, cfg.training.seq_len,
        model_args.vocab_size,
    )
    compile_loss = cfg.compile.enable and "loss" in cfg.compile.components
    loss_fn = spec.build_loss_fn(compile_loss, cfg.compile.backend)

    logger.info(f"Building {cfg.model.name} {cfg.model.flavor} with {model_args}")
    # The SDPA kernel, timed on this rank's attention shape before any memory is taken (dry
    # runs compute no values: PyTorch's choice, nothing timed).
    sdpa_backend = (resolve_attention_backend(cfg, parallel_dims, model_args, device)
                    if comm_mode.computes_values else None)
    with comm_mode.model_build():
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        converters.convert(model)  # float8 / mx: on meta, before parallelize_fn
        # A dry run or memory estimate (no values computed) plans the GPU run it stands for.
        loss_device = device.type if comm_mode.computes_values else "cuda"
        loss_in_model = choose_loss_path(
            cfg.training.loss_implementation, cfg.training.loss_chunk_size, loss_device, model,
            family_loss=not _shared_loss(spec),
            tp_logits_replicated=parallel_dims.tp_enabled
            and cfg.parallelism.disable_loss_parallel,
        )
        if loss_in_model:  # set before the pipeline split copies the head
            model.output.fuse_loss = True
            model.output.loss_chunk_size = cfg.training.loss_chunk_size
            model.output.loss_compile_backend = cfg.compile.backend if compile_loss else None
            loss_fn = precomputed_loss
        nparams, flops_per_token = model_args.get_nparams_and_flops(model, cfg.training.seq_len)
        logger.info(f"Model {cfg.model.name} {cfg.model.flavor}: {nparams:,} parameters")
        pipeline = None
        if parallel_dims.pp_enabled:
            # The per-stage seed from set_determinism makes stages initialise differently.
            pipeline = spec.pipelining_fn(
                model, parallel_dims, cfg, device, model_args, spec.parallelize_fn, loss_fn
            )
            model_parts = pipeline.model_parts
        else:
            if spec.parallelize_fn is not None:
                model = spec.parallelize_fn(model, parallel_dims, cfg)
            model_parts = [model]
        del model
        set_attention_backend(model_parts, sdpa_backend, cfg.model.attention_backend != "auto")
        autocast = autocast_dtype(cfg.training, parallel_dims)
        log_precision(cfg.training, parallel_dims)
        cast_to_bf16 = not parallel_dims.fsdp_enabled and cfg.training.dtype == "bfloat16"
        comm_mode.check_state_memory(model_parts, cfg, device.type, 2 if cast_to_bf16 else None)
        with comm_mode.materialize():
            for part in model_parts:
                part.to_empty(device=device)
                with torch.no_grad(), comm_mode.init_weights():
                    part.init_weights(buffer_device=None)
                if cast_to_bf16:
                    part.to(to_torch_dtype(cfg.training.dtype, "training.dtype"))
                if autocast is not None:
                    apply_autocast(part, device.type, autocast)
                part.train()
            tied = pipeline.tied if pipeline is not None else None
            if tied is not None:
                tied.copy_initial_weights()
            layers = moe_layers(model_parts)
            for layer in layers:  # the auxiliary loss is added once per microbatch
                layer.aux_loss_scale = 1.0 / grad_accum
            if cfg.debug.moe_force_load_balance and not layers:
                logger.warning(
                    f"debug.moe_force_load_balance has no effect: {cfg.model.name} "
                    f"{cfg.model.flavor} has no MoE layers"
                )
            weight_copies = _weight_copies(cfg, parallel_dims, autocast, model_parts,
                                           device.type if comm_mode.computes_values else "cuda",
                                           grad_accum)
            optimizers = build_optimizers_in_backward(model_parts, cfg.optimizer, weight_copies)
            if tied is not None:
                optimizers.fqn_aliases = [tied.optimizer_aliases(part) for part in model_parts]
            lr_schedulers = build_lr_schedulers(optimizers, cfg.lr_scheduler, cfg.training.steps)

    return RunParts(
        job_config=cfg,
        comm_mode=comm_mode,
        parallel_dims=parallel_dims,
        world_mesh=world_mesh,
        device=device,
        rank=rank,
        seed=seed,
        model_spec=spec,
        model_args=model_args,
        tokenizer=tokenizer,
        dataloader=dataloader,
        build_dataloader=build_dataloader,
        model_parts=model_parts,
        pipeline=pipeline,
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        loss_fn=loss_fn,
        nparams=nparams,
        flops_per_token=flops_per_token,
        global_batch_size=global_bs,
        gradient_accumulation_steps=grad_accum,
        after_backward=(
            moe_grad_hooks(model_parts, parallel_dims)
            + ([tied.sum_gradients] if tied is not None else [])
        ),
        moe_layers=layers,
        compute_dtype=compute_dtype(cfg.training, parallel_dims),
        loss_in_model=loss_in_model,
        weight_copies=weight_copies,
        loss_parallel=parallel_dims.loss_parallel_enabled
        and not cfg.parallelism.disable_loss_parallel,
        converters=converters,
    )
