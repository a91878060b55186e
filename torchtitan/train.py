"""The trainer: ``python -m torchtitan.train --job.config_file X [flags]`` (run by run_train.sh)."""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torchtitan.components.loss import IGNORE_INDEX, build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.comm_mode import CommMode
from torchtitan.distributed.parallel_dims import ParallelDims, ParallelismError
from torchtitan.models import get_model_spec
from torchtitan.tools import flight_recorder
from torchtitan.tools.device import device_type, get_device
from torchtitan.tools.logging import init_logger, logger
from torchtitan.tools.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss became NaN); the message says why and where."""


class Trainer(Stateful):
    """Builds everything from a JobConfig and runs the training loop.

    Its own state (the step count and the RNG states needed for exact resume) is checkpointed
    alongside the model, optimizers, LR schedulers and dataloader.
    """

    def __init__(self, job_config: JobConfig) -> None:
        self.job_config = job_config
        cfg = job_config
        if cfg.experimental.custom_import:
            importlib.import_module(cfg.experimental.custom_import)

        self.device = get_device()
        world_size = dist_utils.world_size_from_env()
        self.parallel_dims = parallel_dims = ParallelDims.from_config(cfg.parallelism, world_size)
        if cfg.memory_estimation.enable:
            from torchtitan.tools.memory_estimation import log_memory_estimate

            log_memory_estimate(cfg, world_size)
        # COMM_MODE=fake_backend|local_tensor: one process plays all ranks (no torchrun).
        self.comm = CommMode.from_env(world_size)
        if self.comm is not None:
            self.comm.check(parallel_dims, cfg)
            self.comm.adjust_config(cfg)
            self.comm.init_distributed()
        elif world_size > 1:
            flight_recorder.configure_env(cfg.comm, cfg.job.dump_folder, device_type)
            dist_utils.init_distributed(cfg.comm, device_type)
        _reject_planned_features(cfg, parallel_dims)
        self.world_mesh = parallel_dims.build_mesh(device_type)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._log_config()

        self.seed = dist_utils.set_determinism(self.world_mesh, self.device, cfg.debug)
        self.dp_mesh = parallel_dims.get_mesh("dp")
        self.loss_mesh = parallel_dims.get_mesh("dp_cp")
        dp_degree = parallel_dims.dp_degree
        dp_rank = parallel_dims.mesh_local_rank("dp")

        # Batch arithmetic: gradient accumulation fills the global batch.
        local_bs = cfg.training.local_batch_size
        global_bs = cfg.training.global_batch_size
        if global_bs < 0:
            global_bs = local_bs * dp_degree
        if global_bs % (local_bs * dp_degree):
            raise ParallelismError(
                f"training.global_batch_size={global_bs} must be a multiple of "
                f"local_batch_size*dp = {local_bs}*{dp_degree} = {local_bs * dp_degree}"
            )
        self.gradient_accumulation_steps = global_bs // (local_bs * dp_degree)

        self.model_spec = spec = get_model_spec(cfg.model.name)
        if self.comm is None:
            self.tokenizer = spec.build_tokenizer_fn(cfg.model)
        else:
            self.tokenizer = self.comm.build_tokenizer(spec.build_tokenizer_fn, cfg.model)

        def build_dataloader(dp_rank: int):
            return spec.build_dataloader_fn(
                dataset_name=cfg.training.dataset,
                dataset_path=cfg.training.dataset_path,
                tokenizer=self.tokenizer,
                local_batch_size=local_bs,
                seq_len=cfg.training.seq_len,
                dp_rank=dp_rank,
                dp_world_size=dp_degree,
                infinite=True,
                dataloader_config=cfg.training.dataloader,
            )

        self.model_args = model_args = spec.get_model_args(cfg.model.flavor)
        model_args.update_from_config(cfg, tokenizer=self.tokenizer)
        if self.comm is None:
            self.dataloader = build_dataloader(dp_rank)
        else:  # synthetic batches (fake_backend) or one loader per simulated dp rank
            self.dataloader = self.comm.build_dataloader(
                build_dataloader, parallel_dims, local_bs, cfg.training.seq_len,
                model_args.vocab_size,
            )
        parallel_dims.validate_for_model(
            n_heads=model_args.n_heads,
            n_kv_heads=model_args.n_kv_heads or model_args.n_heads,
            n_layers=model_args.n_layers,
            seq_len=cfg.training.seq_len,
        )
        logger.info(f"Building {cfg.model.name} {cfg.model.flavor} with {model_args}")
        if self.comm is not None:  # local_tensor: LocalTensorMode from here on
            self.comm.begin_model_build(cfg)
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        nparams, self.flops_per_token = model_args.get_nparams_and_flops(model, cfg.training.seq_len)
        logger.info(f"Model {cfg.model.name} {cfg.model.flavor}: {nparams:,} parameters")

        compile_loss = cfg.compile.enable and "loss" in cfg.compile.components
        self.loss_fn = build_cross_entropy_loss(compile_loss, cfg.compile.backend)
        self.model_parts = self._build_model_parts(model)

        self.loss_parallel = parallel_dims.loss_parallel_enabled and not (
            cfg.parallelism.disable_loss_parallel
        )

        self.optimizers = build_optimizers(self.model_parts, cfg.optimizer)
        self.lr_schedulers = build_lr_schedulers(self.optimizers, cfg.lr_scheduler, cfg.training.steps)
        if self.comm is not None:
            self.comm.end_model_build()

        self.step = 0
        self.ntokens_seen = 0
        owns_loss = True
        self.metrics = MetricsProcessor(cfg, rank=self.rank, owns_loss=owns_loss and self.rank == 0)
        self.metrics.num_flops_per_token = self.flops_per_token
        self.metrics.tokens_divisor = parallel_dims.non_data_parallel_size

        from torchtitan.components.checkpoint import CheckpointManager

        self.checkpointer = CheckpointManager(
            dataloader=self.dataloader,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            checkpoint_config=cfg.checkpoint,
            dump_folder=cfg.job.dump_folder,
            sd_adapter=(
                spec.state_dict_adapter(model_args, cfg.model.hf_assets_path)
                if spec.state_dict_adapter is not None
                else None
            ),
        )
        self.validator = self._build_validator() if cfg.validation.enable else None
        self._stop_requested = False
        self.gc_freq = 1 if cfg.training.gc_debug else cfg.training.gc_freq
        gc.disable()
        logger.info(
            f"Training on {device_type} x{world_size}: {parallel_dims}; local batch {local_bs}, "
            f"global batch {global_bs} (gradient accumulation {self.gradient_accumulation_steps}), "
            f"seq_len {cfg.training.seq_len}, {cfg.training.steps} steps"
        )

    # --- setup helpers -------------------------------------------------------------------
    def _build_model_parts(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """Parallelize the meta-device ``model`` (or split it into pipeline stages), then
        materialise and initialise every part on this rank's device."""
        cfg, spec, parallel_dims = self.job_config, self.model_spec, self.parallel_dims
        model_args = self.model_args
        self.pp_schedule = None  # pipeline parallel: schedule + which end stages this rank holds
        self.pp_has_first_stage = self.pp_has_last_stage = True
        if parallel_dims.pp_enabled:
            from torchtitan.distributed.pipeline_parallel import ScaledLoss

            if spec.pipelining_fn is None:
                raise ParallelismError(
                    f"model {cfg.model.name} has no pipeline support; set "
                    "parallelism.pipeline_parallel_degree=1"
                )
            # Called per microbatch on the last stage; train_step sets its scale to the non-PP
            # normalisation. Parts come back parallelized but still on meta (init below; the
            # per-stage seed from set_determinism makes stages initialise differently).
            self.pp_loss_fn = ScaledLoss(self.loss_fn)
            (
                self.pp_schedule,
                model_parts,
                self.pp_has_first_stage,
                self.pp_has_last_stage,
            ) = spec.pipelining_fn(
                model, parallel_dims, cfg, self.device, model_args, spec.parallelize_fn,
                self.pp_loss_fn,
            )
            del model
        else:
            if spec.parallelize_fn is not None:
                model = spec.parallelize_fn(model, parallel_dims, cfg)
            model_parts = [model]
        if self.comm is not None:  # fake_backend: materialize as fake tensors
            self.comm.before_materialize()
        for model in model_parts:
            model.to_empty(device=self.device)
            with torch.no_grad(), (self.comm.init_weights_context() if self.comm else contextlib.nullcontext()):
                model.init_weights(buffer_device=None)
            if not parallel_dims.fsdp_enabled and cfg.training.dtype == "bfloat16":
                model.to(torch.bfloat16)
            model.train()
        return model_parts

    def _log_config(self) -> None:
        cfg = self.job_config
        if self.rank != 0:
            return
        from torchtitan.config.manager import config_to_toml, save_config

        if cfg.job.print_config:
            logger.info(f"Resolved config:\n{config_to_toml(cfg)}")
        if cfg.job.save_config_file:
            path = os.path.join(cfg.job.dump_folder, cfg.job.save_config_file)
            save_config(cfg, path)
            logger.info(f"Saved the resolved config to {path}")

    def _build_validator(self):
        from torchtitan.components.validate import Validator

        cfg = self.job_config
        val = cfg.validation
        dp_rank = self.parallel_dims.mesh_local_rank("dp")

        def build():
            return self.model_spec.build_dataloader_fn(
                dataset_name=val.dataset,
                dataset_path=val.dataset_path,
                tokenizer=self.tokenizer,
                local_batch_size=val.local_batch_size,
                seq_len=val.seq_len,
                dp_rank=dp_rank,
                dp_world_size=self.parallel_dims.dp_degree,
                infinite=False,
                dataloader_config=cfg.training.dataloader,
            )

        if self.pp_schedule is not None:
            from torchtitan.distributed.pipeline_parallel import build_pipeline_validator

            return build_pipeline_validator(
                self.pp_schedule,
                self.pp_loss_fn,
                self.parallel_dims.get_mesh("pp").get_group(),
                build_dataloader=build,
                freq=val.freq,
                steps=val.steps,
                device=self.device,
                dp_mesh=self.loss_mesh,
                train_context=self.train_context,
            )
        return Validator(
            build,
            self.loss_fn,
            freq=val.freq,
            steps=val.steps,
            device=self.device,
            dp_mesh=self.loss_mesh,
            train_context=self.train_context,
        )

    def train_context(self):
        """Context for forward+backward: loss parallel under TP."""
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    # --- one step ------------------------------------------------------------------------
    def next_batch(self, data_iterator: Iterator) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        inputs, labels = next(data_iterator)
        self.metrics.data_loading_times.append(time.perf_counter() - start)
        self.metrics.ntokens_since_last_log += labels.numel()
        self.ntokens_seen += labels.numel()
        return inputs.to(self.device), labels.to(self.device)

    def forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, loss_scale: float
    ) -> torch.Tensor:
        if self.pp_schedule is not None:
            from torchtitan.distributed.pipeline_parallel import pipeline_step

            # The schedule splits the batch into microbatches and runs forward+backward; the
            # loss (0 except on the last stage) is the same normalised sum as below.
            self.pp_loss_fn.scale = loss_scale
            with self.train_context():
                return pipeline_step(
                    self.pp_schedule,
                    inputs,
                    labels,
                    has_first_stage=self.pp_has_first_stage,
                    has_last_stage=self.pp_has_last_stage,
                )
        model = self.model_parts[0]
        with self.train_context():
            pred = model(inputs)
            loss = self.loss_fn(pred, labels) * loss_scale
            del pred
            loss.backward()
        loss = loss.detach()
        # Under loss parallel the loss is a replicated DTensor; its local value is the loss.
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def train_step(self, data_iterator: Iterator) -> tuple[float, float]:
        """One optimizer step over the global batch; returns (global mean loss, grad norm)."""
        if self.comm is not None and self.comm.fake:
            return self.comm.fake_train_step(self, data_iterator)
        self.optimizers.zero_grad()
        microbatches = [self.next_batch(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        local_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in microbatches)
        global_tokens = dist_utils.dist_reduce(local_tokens, "sum", self.loss_mesh)
        # Data-parallel gradient reduction averages over the dp x cp ranks; scaling by their
        # count makes the result the gradient of (sum of token losses) / (global valid tokens).
        n_loss_ranks = 1 if self.loss_mesh is None else self.loss_mesh.size()
        loss_scale = n_loss_ranks / max(global_tokens, 1.0)
        local_loss = torch.zeros((), device=self.device)
        for inputs, labels in microbatches:
            local_loss += self.forward_backward(inputs, labels, loss_scale)
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.job_config.training.max_norm,
            foreach=True,
            pp_mesh=self.parallel_dims.get_mesh("pp"),
        )
        loss = dist_utils.dist_reduce(local_loss / n_loss_ranks, "sum", self.loss_mesh)
        if self.pp_schedule is not None:  # only last-stage ranks hold it; the others add 0
            loss = dist_utils.dist_reduce(loss, "sum", self.parallel_dims.get_mesh("pp"))
        grad_norm_value = float(grad_norm)
        if not (torch.isfinite(torch.tensor(loss)) and torch.isfinite(torch.tensor(grad_norm_value))):
            raise TrainingError(
                f"loss became {loss} (grad norm {grad_norm_value}) at step {self.step}; the "
                "optimizer step was skipped. Lower optimizer.lr, check the data, or resume from "
                "the last checkpoint"
            )
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        return loss, grad_norm_value

    # --- the loop ------------------------------------------------------------------------
    def train(self) -> None:
        cfg = self.job_config
        if cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save_seed_checkpoint()
            return
        self.checkpointer.load(step=cfg.checkpoint.load_step)
        self._install_preemption_handler()
        data_iterator = iter(self.dataloader)
        logger.info(f"Training starts at step {self.step + 1}")
        dump_folder = cfg.job.dump_folder
        with (
            maybe_enable_profiling(cfg.profiling, dump_folder, global_step=self.step) as profiler,
            maybe_enable_memory_snapshot(
                cfg.profiling, dump_folder, global_step=self.step
            ) as memory_profiler,
            flight_recorder.CollectiveWatchdog(cfg.comm, dump_folder) as watchdog,
        ):
            while self.step < cfg.training.steps:
                self.step += 1
                watchdog.set_step(self.step)
                if self.step % self.gc_freq == 0:
                    gc.collect(1)
                lr = self.lr_schedulers.get_last_lr()
                loss, grad_norm = self.train_step(data_iterator)
                if self.metrics.should_log(self.step) and not (self.comm and self.comm.fake):
                    self.metrics.log(self.step, loss, grad_norm, lr)
                if self.validator is not None and self.validator.should_validate(self.step):
                    self.metrics.log_validation(self.step, self.validator.validate(self.model_parts))
                stop = self._preemption_agreed()
                self.checkpointer.save(self.step, last_step=(self.step == cfg.training.steps), force=stop)
                if self.step == 1:
                    dist_utils.set_pg_timeouts(cfg.comm.train_timeout_seconds, self.world_mesh)
                if profiler is not None:
                    profiler.step()
                if memory_profiler is not None:
                    memory_profiler.step()
                if stop:
                    logger.warning(f"Stopping after step {self.step} on SIGTERM (checkpoint written)")
                    return
        logger.info("Training completed")

    def _install_preemption_handler(self) -> None:
        def handler(signum, frame):  # noqa: ARG001
            self._stop_requested = True

        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(signal.SIGTERM, handler)

    def _preemption_agreed(self) -> bool:
        """True on every rank once any rank received SIGTERM."""
        if not dist.is_initialized():
            return self._stop_requested
        flag = torch.tensor([float(self._stop_requested)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics.close()
        if self.comm is not None:
            self.comm.close()

    # --- Stateful ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {
            "step": torch.tensor(self.step),
            "ntokens_seen": torch.tensor(self.ntokens_seen),
            "cpu_rng_state": torch.get_rng_state(),
        }
        if device_type == "cuda":
            state["cuda_rng_state"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.ntokens_seen = int(state_dict.get("ntokens_seen", 0))
        if "cpu_rng_state" in state_dict:
            torch.set_rng_state(state_dict["cpu_rng_state"])
        if device_type == "cuda" and "cuda_rng_state" in state_dict:
            torch.cuda.set_rng_state(state_dict["cuda_rng_state"])


def _reject_planned_features(cfg: JobConfig, parallel_dims: ParallelDims) -> None:
    """Fail before any work on settings whose feature is planned but not built yet.

    Running with them silently ignored would train something other than what was asked for.
    """
    if parallel_dims.cp_enabled:
        raise ParallelismError(
            f"parallelism.context_parallel_degree={parallel_dims.cp}: context parallelism is "
            "planned but not implemented yet; set it to 1"
        )
    if parallel_dims.ep_enabled or parallel_dims.etp > 1:
        raise ParallelismError(
            "parallelism.expert_parallel_degree / expert_tensor_parallel_degree > 1 need an MoE "
            f"model; {cfg.model.name} has no experts (MoE support is planned)"
        )
    if cfg.model.converters:
        raise ValueError(
            f"model.converters={cfg.model.converters}: model converters (float8, mx) are planned "
            "but not implemented yet; remove them (e.g. --model.converters '')"
        )


_USER_ERRORS = (FileNotFoundError, ParallelismError, ValueError)


def main(argv: list[str] | None = None) -> int:
    """Parse the config, train, and return the process exit code."""
    init_logger()
    from torchtitan.config.manager import parse_args_or_exit

    job_config = parse_args_or_exit(argv)
    trainer = None
    code = 0
    try:
        trainer = Trainer(job_config)
        trainer.train()
    except _USER_ERRORS as err:
        logger.error(f"error: {err}")
        code = 2
    except TrainingError as err:
        logger.error(f"error: {err}")
        code = 1
    finally:
        if trainer is not None:
            trainer.close()
    if dist.is_initialized():
        if code == 0:
            dist_utils.shutdown_distributed()
        dist_utils.hard_exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
