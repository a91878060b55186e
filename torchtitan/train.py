"""The trainer: ``python -m torchtitan.train --job.config_file X [flags]`` (run by run_train.sh)."""

from __future__ import annotations

# First, before torch: until the training loop takes Ctrl-C over, it ends this process at once.
import torchtitan.tools.interrupts  # noqa: F401

# isort: split

import gc
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.build import build_run, hf_state_dict_adapter
from torchtitan.components.fault_tolerance.layout import split_group_outputs
from torchtitan.components.fault_tolerance.trainer_wiring import (
    SEMI_SYNC_KEY,
    build_fault_tolerance,
    semi_sync_optimizer_step,
)
from torchtitan.components.finite_check import FiniteCheck, StepFigures, non_finite_message
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.rng_state import RNG_KEY, RNGState
from torchtitan.components.validate import build_validator
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.comm_mode import CommMode, comm_mode_from_env
from torchtitan.preflight import USER_ERRORS
from torchtitan.resume import resume
from torchtitan.step import compute_gradients, optimizer_step
from torchtitan.tools import flight_recorder, known_warnings
from torchtitan.tools.device import device_type
from torchtitan.tools.error_file import (
    is_out_of_memory,
    is_peer_failure,
    out_of_memory_message,
    record_error,
    report_error,
)
from torchtitan.tools.interrupts import INTERRUPTED, end_as_interrupted, under_torchrun
from torchtitan.tools.lifecycle import Preempted, Preemption, die_with_launcher
from torchtitan.tools.logging import init_logger, logger
from torchtitan.tools.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling

FT_KEY = "fault_tolerance"


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss became NaN); the message says why and where."""


def _estimate(cfg: JobConfig, world_size: int) -> Any:
    from torchtitan.tools.memory_estimation import estimate_memory

    return estimate_memory(cfg, world_size)


class Trainer(Stateful):
    """Builds a run from a JobConfig (:func:`~torchtitan.build.build_run`) and trains it.

    Its own state (the step count and the RNG states needed for exact resume) is checkpointed
    alongside the model, optimizers, LR schedulers and dataloader.
    """

    def __init__(self, job_config: JobConfig) -> None:
        self.job_config = cfg = job_config
        split_group_outputs(cfg)  # fault tolerance: per-group outputs, one checkpoint folder
        world_size = dist_utils.world_size_from_env()
        if cfg.memory_estimation.enable:
            from torchtitan.tools.memory_estimation import log_memory_estimate

            log_memory_estimate(cfg, world_size)
        self.comm_mode = comm_mode_from_env(world_size)
        if cfg.fault_tolerance.enable and self.comm_mode.name != CommMode.name:
            raise ValueError(
                f"COMM_MODE={self.comm_mode.name} does not simulate fault tolerance (one "
                "process, no lighthouse, no replica groups): drop --fault_tolerance.enable"
            )
        self.comm_mode.check_memory(lambda: _estimate(cfg, world_size))
        self.run = run = build_run(cfg, self.comm_mode)
        self.device, self.rank = run.device, run.rank
        self.parallel_dims, self.world_mesh = run.parallel_dims, run.world_mesh
        self.model_parts, self.dataloader = run.model_parts, run.dataloader
        self.optimizers, self.lr_schedulers = run.optimizers, run.lr_schedulers
        self.gradient_accumulation_steps = run.gradient_accumulation_steps

        self.step = 0
        self.ntokens_seen = 0
        # MoE load of the last step (0-dim device tensors; empty if dense)
        self.moe_figures: dict[str, torch.Tensor] = {}
        self.finite = FiniteCheck()  # the unchecked steps' loss and grad norm, on the device
        self._microbatches: list = []  # the current step's batch (a NaN's diagnosis re-runs it)
        # host -> GPU batches through pinned memory, without waiting for the device's queue
        self._pinned_batches = run.device.type == "cuda" and self.comm_mode.computes_values
        self._flag_device = dist_utils.host_collective_device(run.device)
        self.rng_state = RNGState(self.rank, repr(run.parallel_dims), cuda=device_type == "cuda")
        self.metrics = MetricsProcessor(cfg, rank=self.rank, compute_dtype=run.compute_dtype)
        self.metrics.num_flops_per_token = run.flops_per_token
        self.metrics.tokens_divisor = run.parallel_dims.non_data_parallel_size

        from torchtitan.components.checkpoint import CheckpointManager

        self.checkpointer = CheckpointManager(
            dataloader=self.dataloader,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            checkpoint_config=cfg.checkpoint,
            dump_folder=cfg.job.dump_folder,
            sd_adapter=hf_state_dict_adapter(run),
            writer_id=f"replica_{cfg.fault_tolerance.replica_id}" if cfg.fault_tolerance.enable else "",
            tokenizer=run.tokenizer,
        )
        self.validator = build_validator(run) if cfg.validation.enable else None
        self._data_iterator_stale = False
        self.ft = build_fault_tolerance(self) if cfg.fault_tolerance.enable else None
        self._step_optimizer = (
            semi_sync_optimizer_step(self, lambda: optimizer_step(run))
            if self.ft is not None and self.ft.semi_sync
            else lambda: optimizer_step(run)
        )
        self.preemption = Preemption()
        self.gc_freq = 1 if cfg.training.gc_debug else cfg.training.gc_freq
        self._gc_was_enabled = gc.isenabled()  # collected every gc_freq steps instead
        gc.disable()
        t = cfg.training
        logger.info(
            f"Training on {device_type} x{world_size}: {run.parallel_dims}; local batch "
            f"{t.local_batch_size}, global batch {run.global_batch_size} (gradient accumulation "
            f"{self.gradient_accumulation_steps}), seq_len {t.seq_len}, {t.steps} steps"
        )

    def _weights_replaced(self) -> None:
        # The weights changed outside the optimizer (a semi-sync step's sync, a peer's live
        # state): what the converters derive from them after each step (float8's precomputed
        # FSDP all-gather scales) must follow, or the next forward casts with stale scales.
        self.run.converters.post_optimizer_hook(self.model_parts)

    def _peer_state_loaded(self) -> None:
        # The dataloader now holds the peer's stream position, which only a new iterator
        # follows (a semi-synchronous group heals inside its optimizer step, mid-loop).
        self._data_iterator_stale = True
        self._weights_replaced()

    # --- one step ------------------------------------------------------------------------
    def next_batch(self, data_iterator: Iterator) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        inputs, labels = next(data_iterator)
        self.metrics.data_loading_times.append(time.perf_counter() - start)
        self.metrics.ntokens_since_last_log += labels.numel()
        self.ntokens_seen += labels.numel()
        return self._to_device(inputs), self._to_device(labels)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        # A copy from pageable host memory waits for the GPU's queue; a pinned one does not.
        if self._pinned_batches and type(t) is torch.Tensor and t.device.type == "cpu":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def train_step(
        self, data_iterator: Iterator
    ) -> tuple[torch.Tensor | float, torch.Tensor | float] | None:
        """One optimizer step over the global batch; returns (global mean loss, grad norm) as
        0-dim device tensors: no host copy (the loop copies them at log steps).

        The finite check runs before the optimizer on the steps that need host values
        (:meth:`_finite_check_due`); a non-finite loss or grad norm of this step then raises
        TrainingError with the weights still those of the previous step, and one of an earlier
        unchecked step names that step. Under synchronous fault tolerance the loss is averaged
        over the replica groups (a float), and None means the groups did not commit the step
        (one failed during it): the optimizer did not step.
        """
        self.optimizers.zero_grad()
        with self.preemption.abortable():  # one process: SIGTERM / Ctrl-C aborts the step here
            microbatches = [self.next_batch(data_iterator) for _ in range(self.gradient_accumulation_steps)]
            self._microbatches = microbatches
            loss, grad_norm = compute_gradients(self.run, microbatches)
        synchronous_ft = self.ft is not None and not self.ft.semi_sync
        if synchronous_ft:
            loss = self.ft.average_loss(dist_utils.scalar_value(loss))
        if self.comm_mode.computes_values:
            self.finite.add(self.step, loss, grad_norm)
            if self._finite_check_due(self.step):
                self._check_finite(before_optimizer=True)
        if synchronous_ft and not self.ft.should_commit():
            return None
        self.checkpointer.maybe_wait_for_staging()
        self.moe_figures = self._step_optimizer() or {}
        return loss, grad_norm

    def _finite_check_due(self, step: int) -> bool:
        """Whether step ``step`` checks (copies its loss and grad norm to the host): it logs,
        saves a checkpoint or validates by schedule, is the last step, or runs under fault
        tolerance (whose protocol waits for every step anyway; and a non-finite group must stop
        before its weights reach the others)."""
        last = step == self.job_config.training.steps
        return (
            self.ft is not None
            or last
            or self.metrics.should_log(step)
            or self.checkpointer.is_due(step, last_step=last)
            or (self.validator is not None and self.validator.should_validate(step))
        )

    def _check_finite(self, before_optimizer: bool = False) -> StepFigures | None:
        """The finite check: copy the unchecked steps' figures to the host (one transfer); a
        non-finite one raises TrainingError naming the first such step and the checkpoint to
        resume from. Returns the newest checked step's figures."""
        bad = self.finite.check()
        if bad is not None:
            raise TrainingError(
                non_finite_message(bad, self.step, before_optimizer, self.run, self._microbatches)
                + " Lower optimizer.lr or check the data; "
                + self.checkpointer.resume_hint(bad.step - 1)
            )
        return self.finite.last

    # --- the loop ------------------------------------------------------------------------
    def train(self) -> None:
        cfg = self.job_config
        if cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save_seed_checkpoint()
            return
        resume(self)
        self._install_preemption_handler()
        data_iterator = iter(self.dataloader)
        dump_folder = cfg.job.dump_folder
        with (
            maybe_enable_profiling(
                cfg.profiling, dump_folder, global_step=self.step, last_step=cfg.training.steps
            ) as profiler,
            maybe_enable_memory_snapshot(
                cfg.profiling, dump_folder, global_step=self.step, last_step=cfg.training.steps
            ) as memory_profiler,
            flight_recorder.CollectiveWatchdog(cfg.comm, dump_folder) as watchdog,
        ):
            while self.step < cfg.training.steps:
                self._begin_ft_step()  # may heal from a peer: its step and data position
                if self._data_iterator_stale:
                    data_iterator, self._data_iterator_stale = iter(self.dataloader), False
                    if self.step >= cfg.training.steps:
                        break
                before = self._pre_step_state()
                self.step += 1
                watchdog.set_step(self.step)
                if self.step % self.gc_freq == 0:
                    gc.collect(1)
                lr = self.lr_schedulers.get_last_lr()
                try:
                    result = self.train_step(data_iterator)
                except Preempted:
                    self._stop_mid_step(before)
                    return
                if result is None:
                    self.step -= 1
                    logger.warning(
                        f"Step {self.step + 1} was not committed by the replica groups (one "
                        "failed during it, or fewer than fault_tolerance.min_replica_size took "
                        "part); it is redone with the next batch"
                    )
                    continue
                self.comm_mode.after_step(self.step)
                if self.metrics.should_log(self.step) and self.comm_mode.computes_values:
                    self._log_step(lr)
                stop = self._preemption_agreed()
                last = self.step == cfg.training.steps
                if stop or self.checkpointer.is_due(self.step, last_step=last, force=stop):
                    self._check_finite()  # never save weights updated by a non-finite step
                if self.ft is None or self.ft.writes_checkpoints():
                    self.checkpointer.save(self.step, last_step=last, force=stop)
                # after the save: a validation that fails (data, memory) loses no trained step
                if self.validator is not None and self.validator.should_validate(self.step) \
                        and not stop:
                    self._check_finite()
                    self.metrics.log_validation(self.step, self.validator.validate(self.model_parts))
                if self.step == 1:
                    dist_utils.set_pg_timeouts(cfg.comm.train_timeout_seconds, self.world_mesh)
                if profiler is not None:
                    profiler.step()
                if memory_profiler is not None:
                    memory_profiler.step()
                if stop:
                    saved = "checkpoint written" if self.checkpointer.has_step(self.step) else "no checkpoint"
                    logger.warning(
                        f"Stopping after step {self.step} on {self.preemption.cause} "
                        f"({saved}{self.preemption.waited()})"
                    )
                    return
        self._check_finite()
        logger.info("Training completed")

    def _log_step(self, lr: float) -> None:
        """The log line and sinks of this step: its figures copied to the host (the finite
        check of the step, already run by ``train_step``, gave the loss and grad norm)."""
        figures = self.finite.last
        if figures is None or figures.step != self.step or self.finite.pending:
            figures = self._check_finite()
        tokens = self.ntokens_seen * self.parallel_dims.dp_degree  # global, so far
        moe = dict(zip(self.moe_figures, dist_utils.scalar_values(list(self.moe_figures.values()))))
        extra = {"tokens": tokens, **moe}
        if self.ft is not None:
            extra.update(self.ft.figures(self.model_parts))
        self.metrics.log(self.step, figures.loss, figures.grad_norm, lr, extra=extra)

    def _begin_ft_step(self) -> None:
        """Synchronous fault tolerance: this step's quorum (a group that is behind loads a
        peer's live state: ``_peer_state_loaded``)."""
        if self.ft is None or self.ft.semi_sync:
            return
        try:
            self.ft.begin_step()
        except RuntimeError as err:  # the lighthouse went away mid-run
            raise TrainingError(
                f"{err} before step {self.step + 1}; a full restart of the replica groups "
                "resumes from the shared checkpoint: " + self.checkpointer.resume_hint(self.step)
            ) from None

    def _install_preemption_handler(self) -> None:
        self.preemption.install()

    def _preemption_agreed(self) -> bool:
        """True on every rank once any rank received SIGTERM or Ctrl-C."""
        return self.preemption.agreed(self._flag_device)  # a host collective: no device wait

    def _pre_step_state(self) -> dict[str, Any] | None:
        """What a save after an aborted step records (one process with checkpointing only)."""
        if not self.preemption.can_abort or not self.checkpointer.enable:
            return None
        return {"dataloader": self.dataloader.state_dict(), "train_state": self.state_dict()}

    def _stop_mid_step(self, before: dict[str, Any] | None) -> None:
        """SIGTERM / Ctrl-C aborted step ``self.step``: save the last completed step as it was."""
        self.step -= 1
        done = self.step
        if self.ft is not None and not self.ft.writes_checkpoints():
            # the groups share one folder: a second writer of step-N would clash with the first
            what = "another replica group writes the shared checkpoint"
        elif before is None or done == 0 or self.checkpointer.has_step(done):
            what = "nothing new to save" if before is not None else "checkpointing is off"
        else:
            self._check_finite()
            self.checkpointer.save(done, force=True, overrides=before)
            what = f"saved step-{done}, the last completed step"
        logger.warning(
            f"Stopping mid-step {done + 1} on {self.preemption.cause} "
            f"({what}{self.preemption.waited()})"
        )

    def close(self) -> None:
        if self.ft is not None:
            self.ft.shutdown()
        self.preemption.uninstall()
        self.checkpointer.close()
        self.metrics.close()
        self.comm_mode.close()
        if getattr(self, "_gc_was_enabled", False):
            gc.enable()  # the process goes on (tests, notebooks): automatic collection back

    # --- Stateful ------------------------------------------------------------------------
    # Per-rank RNG states saved by another layout are absent on load (rng_state.py); torchft's
    # step count is saved by fault-tolerant runs only, LocalSGD / DiLoCo by semi-sync ones.
    optional_state_keys = (RNG_KEY, FT_KEY, SEMI_SYNC_KEY)

    def state_dict(self) -> dict[str, Any]:
        state = {
            "step": torch.tensor(self.step),
            "ntokens_seen": torch.tensor(self.ntokens_seen),
            RNG_KEY: self.rng_state.state_dict(),
        }
        if getattr(self, "ft", None) is not None:
            state[FT_KEY] = self.ft.state_dict()
            if self.ft.semi_sync:
                state[SEMI_SYNC_KEY] = self.ft.semi_sync_state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.ntokens_seen = int(state_dict.get("ntokens_seen", 0))
        self.rng_state.load_state_dict(state_dict.get(RNG_KEY))
        if getattr(self, "ft", None) is not None:
            if state_dict.get(FT_KEY):
                self.ft.load_state_dict(state_dict[FT_KEY])
            if state_dict.get(SEMI_SYNC_KEY):
                self.ft.load_semi_sync_state_dict(state_dict[SEMI_SYNC_KEY])


def main(argv: list[str] | None = None) -> int:
    """Parse the config, train, and return the process exit code.

    A bad config or a missing file is one ``error:`` line and exit code 2; a training error
    (e.g. NaN loss) one line and 1. Either line also goes to torchrun's error file for this
    rank (:func:`torchtitan.tools.error_file.record_error`), so the launcher names it whatever
    ``LOG_RANK`` shows. A rank whose collective broke because another rank stopped first says
    so in one line; the other rank's error is the root cause. A run stopped by Ctrl-C (a
    checkpoint saved, like SIGTERM) returns 130, or 0 for a rank under torchrun.
    """
    init_logger()
    known_warnings.install()
    die_with_launcher()
    from torchtitan.config.manager import parse_args_or_exit

    job_config = parse_args_or_exit(argv)
    trainer = None
    code = 0
    try:
        trainer = Trainer(job_config)
        trainer.train()
        if trainer.preemption.interrupted:
            # Under torchrun a rank exits 0, so that torchrun neither reports nor restarts
            # it; torchtitan.launch then ends as interrupted.
            code = 0 if under_torchrun() else INTERRUPTED
    except Exception as err:
        if trainer is not None and trainer.preemption.stopped_at_once(err):
            code = INTERRUPTED
        elif isinstance(err, USER_ERRORS):
            code = report_error(err, 2)
        elif isinstance(err, TrainingError):
            code = report_error(err, 1)
        elif is_out_of_memory(err):  # the config asks for more than the device has: exit 2
            args = sys.argv[1:] if argv is None else argv
            code = report_error(
                out_of_memory_message(err, args, dist_utils.world_size_from_env()), 2)
        elif is_peer_failure(err):
            line = " ".join(str(err).split())[:300]
            logger.warning(f"stopping: a collective failed ({line}); another rank stopped first")
            code = 1
        else:
            record_error(f"{type(err).__name__}: {err}", 1)
            raise
    finally:
        if trainer is not None:
            trainer.close()
    if dist.is_initialized():
        if code == 0:
            dist_utils.shutdown_distributed()
        dist_utils.hard_exit(code)
    return code


if __name__ == "__main__":
    exit_code = main()
    if exit_code == INTERRUPTED:
        end_as_interrupted()
    sys.exit(exit_code)
