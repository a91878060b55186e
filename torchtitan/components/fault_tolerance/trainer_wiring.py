"""How the Trainer plugs into torchft: the live state a rejoining replica group receives, the
cross-group gradient average (synchronous mode) and the optimizer step inside LocalSGD /
DiLoCo (semi-synchronous mode)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.distributed import utils as dist_utils

SEMI_SYNC_KEY = "fault_tolerance_semi_sync"
"""The train state's key for LocalSGD / DiLoCo's own state (sent by torchft itself)."""


def build_fault_tolerance(trainer: Any) -> Any:
    """torchft's manager for this rank of ``trainer``; a rejoining group receives the trainer's
    live state, and in synchronous mode the gradients are averaged over the groups."""
    from torchtitan.components.fault_tolerance import FaultTolerance
    from torchtitan.components.fault_tolerance.live_state import (
        LiveState,
        OptimizerLiveState,
        StateWithout,
    )

    run = trainer.run
    group_rank = dist.get_rank() if dist.is_initialized() else 0
    group_size = dist.get_world_size() if dist.is_initialized() else 1
    ft = FaultTolerance(trainer.job_config.fault_tolerance, group_rank, group_size)
    parts = {
        "model": torch.nn.ModuleList(trainer.model_parts),
        "optimizer": OptimizerLiveState(trainer.optimizers),
        "lr_scheduler": trainer.lr_schedulers,
        "dataloader": trainer.dataloader,
        "train_state": StateWithout(trainer, SEMI_SYNC_KEY),
    }
    ft.register_live_state(LiveState(parts, after_load=trainer._peer_state_loaded))
    if not ft.semi_sync:
        run.after_backward.append(
            ft.sync_gradients_hook(
                trainer.model_parts, run.moe_layers,
                lambda: dist_utils.scalar_value(run.step_tokens),
            )
        )
    return ft


def semi_sync_optimizer_step(trainer: Any, optimizer_step: Callable[[], Any]) -> Callable[[], Any]:
    """``optimizer_step`` inside LocalSGD / DiLoCo (DiLoCo's fragments are cut from the whole
    model's units: with pipeline parallelism, those of every stage)."""
    from torchtitan.components.fault_tolerance.fragments import model_units

    run = trainer.run
    stages = run.pipeline.layout.fqns_per_stage if run.pipeline is not None else None
    n_layers = run.model_args.n_layers
    units = model_units(trainer.model_parts, stages, n_layers)
    tied = getattr(run.model_args, "tie_word_embeddings", False)
    return trainer.ft.wrap_optimizer_step(
        trainer.model_parts, optimizer_step, units, n_layers,
        after_sync=trainer._weights_replaced,
        tied_units=("tok_embeddings", "output") if tied else (),
    )
