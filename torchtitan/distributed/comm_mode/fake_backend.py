"""``COMM_MODE=fake_backend``: one process plays one rank of a large job on fake tensors.

A ``fake`` process group of ``WORLD_SIZE`` ranks (this process is ``RANK``, default 0):
collectives return immediately. The config is validated, the model is built, parallelized,
materialized and initialized, and each step (forward, backward, clipping, optimizer) runs on
*fake tensors* (``FakeTensorMode``): shapes, dtypes and placements are real, values are not
computed and no memory is allocated, so a 70B model at 128 ranks runs on a laptop. Batches are
random token ids of the configured shape; checkpointing and validation are off. Expert
parallel's all-to-all is sized as if routing were balanced (``BalancedExpertDispatch``). The memory
estimator runs the same mode (optionally with real tensors) under a memory tracker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.comm_mode.base import CommMode, prepare_dry_run
from torchtitan.distributed.parallel_dims import ParallelDims, ParallelismError
from torchtitan.tools.logging import logger


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """Initialise a ``fake`` default process group of ``world_size`` ranks in this process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group already exists; COMM_MODE needs a fresh process")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world_size})")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


@contextlib.contextmanager
def shape_only_init() -> Iterator[None]:
    """``nn.init.trunc_normal_`` without its data-dependent rejection loop (fake tensors)."""
    original = nn.init.trunc_normal_

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):  # noqa: ARG001
        with torch.no_grad():
            return tensor.normal_(mean, std, generator=generator)

    nn.init.trunc_normal_ = trunc_normal_
    try:
        yield
    finally:
        nn.init.trunc_normal_ = original


class SyntheticBatches:
    """Random ``(inputs, labels)`` token batches of the configured shape, as real tensors."""

    def __init__(self, local_batch_size: int, seq_len: int, vocab_size: int, seed: int = 0):
        self.shape = (local_batch_size, seq_len)
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        while True:
            with unset_fake_temporarily():
                tokens = torch.randint(
                    0, self.vocab_size, (self.shape[0], self.shape[1] + 1), generator=self.generator
                )
            yield tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class FakeBackend(CommMode):
    """One rank of a ``world_size`` job on a fake process group (see the module docstring).

    ``fake_tensors=False`` keeps real tensors (real allocation and compute on a fake process
    group: values are meaningless, memory is real); the memory estimator offers that.
    """

    name = "fake_backend"
    computes_values = False

    def __init__(
        self, world_size: int, rank: int = 0, *, fake_tensors: bool = True,
        label: str = "COMM_MODE=fake_backend",
    ) -> None:
        super().__init__(world_size, rank)
        self.fake_tensors = fake_tensors
        self.label = label
        """How log lines and errors name this run."""
        self._fake_mode = None

    def prepare(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        if parallel_dims.pp_enabled:
            raise ParallelismError(
                f"{self.label} cannot run pipeline parallel (parallelism."
                "pipeline_parallel_degree > 1: its stages exchange shapes and activations point "
                "to point, which a fake process group cannot deliver): turn that off, or run it "
                "for real with torchrun"
            )
        if parallel_dims.ep_enabled:
            logger.info(
                f"{self.label}: expert parallel's token dispatch assumes balanced routing (each "
                f"rank sends 1/{parallel_dims.ep} of its routed tokens to every ep peer; fake "
                "collectives carry no per-expert token counts)"
            )
        prepare_dry_run(
            job_config, self.label, "a dry run checks the layout, shapes and memory, not outputs, "
            "kernels or timings", extra=(("metrics", "enable_tensorboard"), ("metrics", "enable_wandb")),
        )
        if job_config.checkpoint.initial_load_path:
            logger.info(
                f"{self.label}: checkpoint.initial_load_path is not loaded (fake tensors hold "
                "no values)"
            )
            job_config.checkpoint.initial_load_path = None

    def init_process_group(self, job_config: JobConfig, device_type: str) -> None:
        init_fake_process_group(self.world_size, self.rank)
        logger.info(
            f"{self.label}: one process playing rank {self.rank} of {self.world_size} "
            "on a fake process group"
        )

    def build_tokenizer(self, build: Callable[[Any], Any], model_config: Any) -> Any:
        """The configured tokenizer, or none when its files are missing (batches are random)."""
        try:
            return build(model_config)
        except (FileNotFoundError, ValueError, OSError) as err:
            logger.warning(
                f"{self.label}: no tokenizer ({err}); using the flavor's vocab size "
                "and random token batches"
            )
            return None

    def build_dataloader(self, build_for_dp_rank, parallel_dims, local_batch_size, seq_len, vocab_size):
        return SyntheticBatches(local_batch_size, seq_len, vocab_size)

    def _fake_tensor_mode(self) -> contextlib.AbstractContextManager:
        if not self.fake_tensors:
            return contextlib.nullcontext()
        if self._fake_mode is None:
            from torch._subclasses.fake_tensor import FakeTensorMode

            self._fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        stack = contextlib.ExitStack()
        stack.enter_context(self._fake_mode)
        stack.enter_context(shape_only_init())
        return stack

    def model_build(self) -> contextlib.AbstractContextManager:
        """Expert parallel dispatches as if routing were balanced (no real token counts)."""
        from torchtitan.distributed.expert_parallel import (
            BalancedExpertDispatch,
            expert_dispatch_policy,
        )

        return expert_dispatch_policy(BalancedExpertDispatch)

    def materialize(self) -> contextlib.AbstractContextManager:
        return self._fake_tensor_mode()

    def step(self) -> contextlib.AbstractContextManager:
        return self._fake_tensor_mode()

    def after_step(self, step: int) -> None:
        logger.info(
            f"{self.label}: step {step} ran forward, backward and the optimizer "
            f"on {'fake' if self.fake_tensors else 'real'} tensors (loss and grad norm are not "
            "computed)"
        )
