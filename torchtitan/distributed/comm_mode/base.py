"""The seams through which a run talks to its ranks; the base class is a real run.

A real run is one process per rank under torchrun (or one process alone). The COMM_MODE dry
runs (``fake_backend``, ``local_tensor``) subclass :class:`CommMode` and override a few seams:
the process group, the data source, and the tensor modes around model build, materialisation
and the training step. ``torchtitan.build.build_run`` and the Trainer call these seams and
never ask which mode is active.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.tools import flight_recorder
from torchtitan.tools.logging import logger


class CommMode:
    """A real run: torchrun's process group (or none for one rank), real tensors, real data."""

    name = "torchrun"
    computes_values = True
    """False when the step runs on tensors without values (loss and grad norm are NaN)."""

    def __init__(self, world_size: int, rank: int = 0) -> None:
        self.world_size = world_size
        self.rank = rank

    # --- setup ----------------------------------------------------------------------------
    def prepare(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        """Refuse what this mode cannot run and switch off what it must not do."""

    def init_process_group(self, job_config: JobConfig, device_type: str) -> None:
        """The default process group (nccl on CUDA, gloo on CPU); none for a single rank."""
        if self.world_size > 1:
            flight_recorder.configure_env(job_config.comm, job_config.job.dump_folder, device_type)
            dist_utils.init_distributed(job_config.comm, device_type)

    def check_memory(self, estimate: Callable[[], Any]) -> None:
        """Refuse before building when the run cannot fit this machine's memory; ``estimate()``
        returns one rank's :class:`~torchtitan.tools.memory_estimation.MemoryEstimate` (costs a
        fake-tensor build and two steps, so a mode calls it only when it needs it)."""

    def check_state_memory(self, model_parts: list[Any], job_config: JobConfig,
                           device_type: str, param_itemsize: int | None) -> None:
        """Refuse in one line (before the weights are materialised) a CPU run whose weights,
        gradients and optimizer states alone (with an asynchronous save's staged copy) exceed
        this machine's free memory: the kernel would kill a rank without a word. A GPU run's
        OOM names itself; its asynchronous saves' host copies get a warning when short."""
        if not self.computes_values:
            return
        from torchtitan.tools import host_memory

        opt, ckpt = job_config.optimizer, job_config.checkpoint
        params = [p for part in model_parts for p in part.parameters()]
        staged = 0
        if ckpt.enable and not ckpt.load_only and ckpt.async_mode != "disabled":
            staged = host_memory.staged_checkpoint_bytes(params, opt.state_dtype, param_itemsize)
        if device_type == "cpu":
            need = host_memory.training_state_bytes(params, opt.state_dtype, param_itemsize)
            host_memory.check_training_state_fits(need + staged, opt.name, staged)
        elif staged:
            host_memory.warn_if_staging_short(staged, ckpt.async_mode)

    # --- data -----------------------------------------------------------------------------
    def build_tokenizer(self, build: Callable[[Any], Any], model_config: Any) -> Any:
        return build(model_config)

    def build_dataloader(
        self,
        build_for_dp_rank: Callable[[int], Any],
        parallel_dims: ParallelDims,
        local_batch_size: int,
        seq_len: int,
        vocab_size: int,
    ) -> Any:
        """This rank's training dataloader (its shard of the data-parallel split)."""
        return build_for_dp_rank(parallel_dims.mesh_local_rank("dp"))

    # --- tensor modes ---------------------------------------------------------------------
    def model_build(self) -> contextlib.AbstractContextManager:
        """Around building, parallelizing and materialising the model and its optimizers."""
        return contextlib.nullcontext()

    def materialize(self) -> contextlib.AbstractContextManager:
        """Around ``to_empty`` + ``init_weights`` and the optimizer build."""
        return contextlib.nullcontext()

    def init_weights(self) -> contextlib.AbstractContextManager:
        """Around each model part's ``init_weights()``."""
        return contextlib.nullcontext()

    def load_initial_weights(self, model_parts: list[Any]) -> bool:
        """Load starting weights the CheckpointManager cannot load in this mode (called after
        it); returns True when something was loaded. A real run loads through the manager."""
        return False

    def step(self) -> contextlib.AbstractContextManager:
        """Around one training step (forward, backward, clipping, optimizer)."""
        return contextlib.nullcontext()

    def after_step(self, step: int) -> None:
        """Called once a training step has finished."""

    def close(self) -> None:
        """Leave any tensor mode this mode entered."""


DRY_RUN_OFF = (
    ("checkpoint", "enable"),
    ("validation", "enable"),
    ("compile", "enable"),
    ("parallelism", "enable_async_tensor_parallel"),
    ("profiling", "enable_profiling"),
    ("profiling", "enable_memory_snapshot"),
)
"""What the dry runs switch off: they write nothing, run eager kernels and profile nothing."""


def prepare_dry_run(job_config: JobConfig, label: str, why: str,
                    extra: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """Switch off :data:`DRY_RUN_OFF` (+ ``extra``) with one info line saying ``why``, and fit
    the LR warm-up into the run's steps (``run_train.sh`` gives a dry run one step) so the
    scheduler does not warn about a step count the user did not choose. Returns what was
    switched off."""
    off = []
    for section, key in (*DRY_RUN_OFF, *extra):
        if getattr(getattr(job_config, section), key):
            setattr(getattr(job_config, section), key, False)
            off.append(f"{section}.{key}")
    if off:
        logger.info(f"{label}: switched off {', '.join(off)} ({why})")
    from torchtitan.components.converters import prepare_dry_run as converters_dry_run
    from torchtitan.tools.device import device_type

    changed = converters_dry_run(job_config, device_type)
    if job_config.model.attention_backend != "auto":
        changed.append(f"model.attention_backend {job_config.model.attention_backend} -> auto")
        job_config.model.attention_backend = "auto"
    if changed:
        logger.info(f"{label}: {', '.join(changed)} (a dry run checks shapes, not kernels)")
    lr = job_config.lr_scheduler
    lr.warmup_steps = min(lr.warmup_steps, job_config.training.steps)
    return off
