"""COMM_MODE dry runs: one process plays a whole job, no torchrun, no NCCL, no GPU needed.

``COMM_MODE=fake_backend``
    A ``fake`` process group of ``WORLD_SIZE`` ranks (this process is ``RANK``, default 0):
    collectives return immediately. The config is validated, the model is built, parallelized,
    materialized and initialized, and one step (forward, backward, clipping, optimizer) runs on
    *fake tensors* (``FakeTensorMode``): shapes, dtypes and placements are real, values are not
    computed and no memory is allocated, so a 70B model at 128 ranks runs on a laptop. Batches
    are random token ids of the configured shape; checkpointing and validation are off.

``COMM_MODE=local_tensor``
    ``LocalTensorMode`` simulates every rank in one process with real values: collectives
    really combine the simulated ranks' tensors, so numerics match a real run of that layout.
    Each data-parallel rank reads its own batches. Tensor parallel runs as is; data parallel
    (FSDP/HSDP/DDP) runs as DTensor-sharded parameters gathered on use (SimpleFSDP style),
    because ``fully_shard`` cannot run under LocalTensorMode. Pipeline and context parallel
    are refused. Memory and time grow with the number of simulated ranks.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims, ParallelismError
from torchtitan.tools.logging import logger

__all__ = [
    "COMM_MODES",
    "CommMode",
    "SyntheticBatches",
    "apply_local_data_parallel",
    "get_comm_mode",
    "init_fake_process_group",
]

COMM_MODES = ("fake_backend", "local_tensor")


def get_comm_mode() -> str | None:
    """The ``COMM_MODE`` environment variable (None when unset or empty)."""
    mode = os.environ.get("COMM_MODE", "").strip()
    if not mode:
        return None
    if mode not in COMM_MODES:
        raise ValueError(
            f"COMM_MODE={mode!r} is not a comm mode; use fake_backend or local_tensor, or unset it"
        )
    return mode


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """Initialise a ``fake`` default process group of ``world_size`` ranks in this process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group already exists; COMM_MODE needs a fresh process")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world_size})")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


@contextlib.contextmanager
def _shape_only_init() -> Iterator[None]:
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
    """Random ``(inputs, labels)`` token batches of the configured shape (fake_backend data)."""

    def __init__(self, local_batch_size: int, seq_len: int, vocab_size: int, seed: int = 0):
        self.shape = (local_batch_size, seq_len)
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            tokens = torch.randint(
                0, self.vocab_size, (self.shape[0], self.shape[1] + 1), generator=self.generator
            )
            yield tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def _dp_rank_of(parallel_dims: ParallelDims, rank: int) -> int:
    """Data-parallel index of global ``rank`` (the order of the flattened ``dp`` mesh)."""
    mesh = parallel_dims.world_mesh
    if mesh is None:
        return 0
    coords = (mesh.mesh == rank).nonzero()[0].tolist()
    named = dict(zip(mesh.mesh_dim_names or (), coords))
    return named.get("dp_replicate", 0) * parallel_dims.dp_shard + named.get("dp_shard", 0)


class LocalTensorBatches:
    """Combines one dataloader per data-parallel rank into per-rank ``LocalTensor`` batches."""

    def __init__(self, loaders: dict[int, Any], rank_to_dp: dict[int, int]):
        self.loaders = loaders
        self.rank_to_dp = rank_to_dp

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from torch.distributed._local_tensor import LocalTensor, maybe_disable_local_tensor_mode

        with maybe_disable_local_tensor_mode():
            iters = {d: iter(loader) for d, loader in self.loaders.items()}
        while True:
            with maybe_disable_local_tensor_mode():
                batches = {d: next(it) for d, it in iters.items()}
                inputs = LocalTensor({r: batches[d][0] for r, d in self.rank_to_dp.items()})
                labels = LocalTensor({r: batches[d][1] for r, d in self.rank_to_dp.items()})
            yield inputs, labels

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


# --- data parallel for LocalTensorMode (SimpleFSDP style) -----------------------------------
_gather_enabled = True


@contextlib.contextmanager
def _params_as_stored() -> Iterator[None]:
    """Parameters read as their sharded DTensors (for in-place init), not gathered."""
    global _gather_enabled
    old, _gather_enabled = _gather_enabled, False
    try:
        yield
    finally:
        _gather_enabled = old


class _GatherOnUse(nn.Module):
    """Parametrization: gather a data-parallel-sharded parameter when it is used.

    The stored parameter is a DTensor on ``(dp dims..., [tp])``; the computed one is the
    TP-local view (a DTensor on the tp mesh, or a plain tensor), cast to ``param_dtype``.
    Its gradient is averaged over the dp dims and reduce-scattered back to the shard.
    """

    def __init__(self, n_dp: int, tp_mesh, tp_placements, param_dtype: torch.dtype | None):
        super().__init__()
        self.n_dp = n_dp
        self.tp_mesh = tp_mesh
        self.tp_placements = tuple(tp_placements)
        self.param_dtype = param_dtype

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Partial, Replicate

        if not _gather_enabled:
            return x
        gathered = x.redistribute(x.device_mesh, [Replicate()] * self.n_dp + list(self.tp_placements))
        local = gathered.to_local(grad_placements=[Partial("avg")] * self.n_dp + list(self.tp_placements))
        if self.param_dtype is not None and local.is_floating_point():
            local = local.to(self.param_dtype)
        if self.tp_mesh is None:
            return local
        return DTensor.from_local(local, self.tp_mesh, self.tp_placements, run_check=False)


def apply_local_data_parallel(
    model: nn.Module, parallel_dims: ParallelDims, param_dtype: torch.dtype | None = None
) -> nn.Module:
    """Shard every parameter over the data-parallel mesh dims as a DTensor, gathered on use.

    ``dp_shard`` shards dim 0 (FSDP), ``dp_replicate`` replicates (DDP / HSDP's outer dim);
    gradients are averaged over both, as FSDP2 and DDP do. Works under LocalTensorMode,
    where ``fully_shard`` does not.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.nn.utils import parametrize

    mesh = parallel_dims.world_mesh
    if mesh is None:
        return model
    dp_dims = [n for n in ("dp_replicate", "dp_shard") if n in (mesh.mesh_dim_names or ())]
    if not dp_dims:
        return model
    dp_placements = [Replicate() if n == "dp_replicate" else Shard(0) for n in dp_dims]
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                tp_mesh, tp_placements = param.device_mesh, list(param.placements)
                names = list(dp_dims) + list(tp_mesh.mesh_dim_names or ())
            else:
                tp_mesh, tp_placements = None, []
                names = list(dp_dims)
            span = mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]
            full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            sharded = distribute_tensor(full, span, dp_placements + tp_placements)
            setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            parametrize.register_parametrization(
                module,
                name,
                _GatherOnUse(len(dp_dims), tp_mesh, tp_placements, param_dtype),
                unsafe=True,
            )
    kinds = "+".join(f"{n}={mesh[n].size()}" for n in dp_dims)
    logger.info(f"Applied DTensor data parallel (gather on use, {kinds}) for LocalTensorMode")
    return model


def _as_local_tensor(value: Any, ranks: frozenset[int]) -> Any:
    """A value computed outside LocalTensor ops (a Python number, a plain tensor, a per-rank
    SymInt) as a LocalTensor: the same on every simulated rank unless it differs per rank."""
    from torch.distributed._local_tensor import (
        LocalIntNode,
        LocalTensor,
        maybe_disable_local_tensor_mode,
    )
    from torch.distributed.tensor import DTensor

    if isinstance(value, (LocalTensor, DTensor)):
        return value
    with maybe_disable_local_tensor_mode():
        if isinstance(value, torch.SymInt) and isinstance(value.node, LocalIntNode):
            ints = value.node._local_ints
            return LocalTensor({r: torch.tensor(float(ints[r]), dtype=torch.float64) for r in ranks})
        t = torch.as_tensor(value, dtype=torch.float64).detach()
        return LocalTensor({r: t.clone() for r in sorted(ranks)})


def active_local_tensor_ranks() -> frozenset[int] | None:
    """The simulated ranks when LocalTensorMode is active, else None."""
    from torch.distributed._local_tensor import local_tensor_mode

    mode = local_tensor_mode()
    return None if mode is None else frozenset(mode.ranks)


def as_replicated_local_tensor(value: Any) -> Any:
    """Under LocalTensorMode, a plain number as a LocalTensor (same on every simulated rank), so
    collectives reduce across the simulated ranks; unchanged otherwise."""
    ranks = active_local_tensor_ranks()
    return value if ranks is None else _as_local_tensor(value, ranks)


class CommMode:
    """The trainer's hooks for one COMM_MODE run (see the module docstring)."""

    def __init__(self, mode: str, world_size: int, rank: int = 0):
        if mode not in COMM_MODES:
            raise ValueError(f"COMM_MODE={mode!r} is not one of {', '.join(COMM_MODES)}")
        self.mode = mode
        self.world_size = world_size
        self.rank = rank
        self._fake_mode = None
        self._stack = contextlib.ExitStack()
        self._build_stack: contextlib.ExitStack | None = None

    @classmethod
    def from_env(cls, world_size: int) -> CommMode | None:
        """``CommMode`` for ``COMM_MODE`` (None when unset); RANK picks the rank played."""
        mode = get_comm_mode()
        if mode is None:
            return None
        return cls(mode, world_size, int(os.environ.get("RANK", "0")))

    @property
    def fake(self) -> bool:
        return self.mode == "fake_backend"

    # --- setup ----------------------------------------------------------------------------
    def check(self, parallel_dims: ParallelDims, job_config: JobConfig) -> None:
        """Refuse what this mode cannot run, naming the parallelism or option."""
        refused = []
        if parallel_dims.pp_enabled:
            why = (
                "its stages exchange shapes and activations point to point, which a fake "
                "process group cannot deliver"
                if self.fake
                else "each rank runs a different stage (MPMD), which one SPMD process cannot "
                "simulate"
            )
            refused.append(f"pipeline parallel (parallelism.pipeline_parallel_degree > 1: {why})")
        if not self.fake:
            if parallel_dims.cp_enabled:
                refused.append("context parallel (parallelism.context_parallel_degree > 1)")
            if parallel_dims.ep_enabled:
                refused.append("expert parallel (parallelism.expert_parallel_degree > 1)")
            if job_config.compile.enable:
                refused.append("torch.compile (compile.enable)")
        if refused:
            raise ParallelismError(
                f"COMM_MODE={self.mode} cannot run " + "; ".join(refused)
                + ": turn that off, or run it for real with torchrun"
            )

    def adjust_config(self, job_config: JobConfig) -> None:
        """Turn off what a dry run must not do (checkpoints, validation, metric sinks)."""
        off = []
        if job_config.checkpoint.enable:
            job_config.checkpoint.enable = False
            off.append("checkpoint.enable")
        if job_config.validation.enable:
            job_config.validation.enable = False
            off.append("validation.enable")
        if self.fake:
            for key in ("enable_tensorboard", "enable_wandb"):
                if getattr(job_config.metrics, key):
                    setattr(job_config.metrics, key, False)
                    off.append(f"metrics.{key}")
            if job_config.compile.enable:
                job_config.compile.enable = False
                off.append("compile.enable")
        if off:
            logger.warning(f"COMM_MODE={self.mode}: turned off {', '.join(off)}")

    def init_distributed(self) -> None:
        init_fake_process_group(self.world_size, self.rank)
        logger.info(
            f"COMM_MODE={self.mode}: one process playing rank {self.rank} of {self.world_size} "
            "on a fake process group"
        )
        if not self.fake:
            logger.warning(
                f"COMM_MODE=local_tensor holds the tensors of all {self.world_size} simulated ranks "
                f"in this process: expect about {self.world_size}x one rank's memory and time "
                "(lower training.local_batch_size / seq_len if that is too much)"
            )

    # --- data -----------------------------------------------------------------------------
    def build_tokenizer(self, build: Callable[[Any], Any], model_cfg: Any) -> Any:
        """The configured tokenizer; fake_backend goes on without one when its files are missing."""
        try:
            return build(model_cfg)
        except (FileNotFoundError, ValueError, OSError) as err:
            if not self.fake:
                raise
            logger.warning(
                f"COMM_MODE=fake_backend: no tokenizer ({err}); using the flavor's vocab size "
                "and random token batches"
            )
            return None

    def build_dataloader(
        self, build: Callable[[int], Any], parallel_dims: ParallelDims, local_batch_size: int,
        seq_len: int, vocab_size: int,
    ) -> Any:
        """fake_backend: synthetic batches; local_tensor: one loader per dp rank, combined."""
        if self.fake:
            return SyntheticBatches(local_batch_size, seq_len, vocab_size)
        rank_to_dp = {r: _dp_rank_of(parallel_dims, r) for r in range(self.world_size)}
        loaders = {d: build(d) for d in sorted(set(rank_to_dp.values()))}
        return LocalTensorBatches(loaders, rank_to_dp)

    # --- model build ----------------------------------------------------------------------
    def begin_model_build(self, job_config: JobConfig) -> None:
        """Before the meta-device model is built: local_tensor enters LocalTensorMode.

        The mode stays on until :meth:`close` (training steps run under it too); while it is on,
        ``apply_data_parallel`` uses :func:`apply_local_data_parallel` instead of FSDP/DDP.
        """
        self._build_stack = contextlib.ExitStack()
        if not self.fake:
            from torch.distributed._local_tensor import LocalTensorMode

            self._stack.enter_context(LocalTensorMode(self.world_size))

    def before_materialize(self) -> None:
        """Before ``to_empty``: fake_backend materializes and initialises as fake tensors."""
        if self.fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            if self._build_stack is None:
                self._build_stack = contextlib.ExitStack()
            self._fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            self._build_stack.enter_context(self._fake_mode)
            self._build_stack.enter_context(_shape_only_init())

    def init_weights_context(self) -> contextlib.AbstractContextManager:
        """Around ``model.init_weights()``: parameters are initialised in their stored shards."""
        return _params_as_stored() if not self.fake else contextlib.nullcontext()

    def end_model_build(self) -> None:
        if self._build_stack is not None:
            self._build_stack.close()
            self._build_stack = None

    # --- one step -------------------------------------------------------------------------
    def fake_train_step(self, trainer: Any, data_iterator: Iterator) -> tuple[float, float]:
        """fake_backend: forward, backward, clip and optimizer step on fake tensors.

        Returns ``(nan, nan)``: no value is computed under fake tensors.
        """
        from torchtitan.distributed import utils as dist_utils

        assert self._fake_mode is not None, "begin_model_build() was not called"
        with self._fake_mode, _shape_only_init():
            trainer.optimizers.zero_grad()
            for _ in range(trainer.gradient_accumulation_steps):
                inputs, labels = trainer.next_batch(data_iterator)
                trainer.forward_backward(inputs, labels, 1.0 / max(labels.numel(), 1))
            dist_utils.clip_grad_norm_(
                [p for m in trainer.model_parts for p in m.parameters()],
                trainer.job_config.training.max_norm,
                foreach=True,
                pp_mesh=trainer.parallel_dims.get_mesh("pp"),
            )
            trainer.optimizers.step()
            trainer.lr_schedulers.step()
        logger.info(
            f"COMM_MODE=fake_backend: step {trainer.step} ran forward, backward and the optimizer "
            "on fake tensors (loss and grad norm are not computed)"
        )
        return math.nan, math.nan

    def close(self) -> None:
        self.end_model_build()
        self._stack.close()
