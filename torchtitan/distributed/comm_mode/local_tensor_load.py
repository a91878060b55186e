"""``COMM_MODE=local_tensor`` starting from ``checkpoint.initial_load_path`` (a seed checkpoint).

DCP's distributed load cannot run under LocalTensorMode (one process plays every rank, and the
data-parallel parameters are gather-on-use parametrizations whose state-dict keys differ from
the checkpoint's). So the checkpoint's full tensors are read once, in this process without
collectives, shape-checked like any load, and ``distribute_tensor``-ed into every simulated
rank's shard of each parameter. Layouts that need more ranks than the machine has can then be
compared from the same weights (``scripts/loss_compare.py --seed-checkpoint``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn

from torchtitan.config.job_config import Checkpoint, JobConfig
from torchtitan.tools.logging import logger


def take_initial_load(job_config: JobConfig, mode: str) -> Checkpoint | None:
    """The ``[checkpoint]`` settings to load from, taken out of ``job_config`` (whose
    CheckpointManager then loads and saves nothing); None without ``initial_load_path``."""
    cfg = job_config.checkpoint
    if not cfg.initial_load_path:
        return None
    if cfg.initial_load_in_hf:
        raise ValueError(
            f"COMM_MODE={mode} loads DCP checkpoints only, not checkpoint.initial_load_in_hf; "
            "convert the HF weights with scripts/convert_hf_to_dcp.py and load that"
        )
    taken = copy.deepcopy(cfg)
    cfg.initial_load_path = None
    if not taken.initial_load_model_only:
        logger.warning(
            f"COMM_MODE={mode} loads model weights only from checkpoint.initial_load_path; "
            "optimizer and other states start fresh"
        )
    return taken


_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing, compile


def checkpoint_fqn(name: str) -> str:
    """A parameter's checkpoint FQN: ``a.parametrizations.weight.original`` -> ``a.weight``,
    without activation-checkpoint / compile wrapper names."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    if ".parametrizations." in name and name.endswith(".original"):
        name = name.replace(".parametrizations.", ".")[: -len(".original")]
    return name


def stored_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(checkpoint FQN, stored parameter)`` of ``module`` (the sharded DTensors)."""
    for name, param in module.named_parameters():
        yield checkpoint_fqn(name), param


def load_initial_weights(
    cfg: Checkpoint,
    model_parts: list[nn.Module],
    mode: str,
    params_as_stored: Callable[[], contextlib.AbstractContextManager],
) -> str:
    """Copy the model weights of ``cfg.initial_load_path`` into every simulated rank's shards
    (``params_as_stored()``: parameters read as their stored shards, not gathered); returns
    the checkpoint folder loaded. CheckpointError (one line) on a mismatch."""
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    from torch.distributed.tensor import DTensor, distribute_tensor

    from torchtitan.components.checkpoint.load import (
        check_model_shapes,
        load_dcp_model_tensors,
        tensor_shapes,
    )
    from torchtitan.components.checkpoint.load_plan import decide_initial_load
    with maybe_disable_local_tensor_mode():
        plan = decide_initial_load(cfg)
        assert plan is not None  # take_initial_load returned settings with a path
        full = load_dcp_model_tensors(plan.path)
    params = [(fqn, p) for part in model_parts for fqn, p in stored_parameters(part)]
    check_model_shapes({fqn: tuple(p.shape) for fqn, p in params}, tensor_shapes(full), plan.path)
    with torch.no_grad(), params_as_stored():
        for fqn, param in params:
            src = full[fqn].to(param.dtype)
            if isinstance(param, DTensor):
                src = distribute_tensor(src, param.device_mesh, param.placements)
            param.copy_(src)
    logger.info(
        f"COMM_MODE={mode}: loaded the model weights of {plan.path} ({plan.reason}) into every "
        "simulated rank's shards"
    )
    return plan.path
