"""Before the first step: load what the checkpoint folder holds and say where training starts."""

from __future__ import annotations

from typing import Any

from torchtitan.components.lr_scheduler import resumed_lr_note
from torchtitan.tools.logging import logger


def resume(trainer: Any) -> None:
    """Load ``trainer``'s checkpoint (the newest, or ``checkpoint.load_step``), set a rewind's
    abandoned newer steps aside, hand the loaded state to fault tolerance and the comm mode,
    and log one line: where training starts, or that there is nothing left to train, plus a
    warning when the config's LR schedule is not the one the checkpoint was trained with."""
    cfg = trainer.job_config
    checkpointer = trainer.checkpointer
    checkpointer.load(step=cfg.checkpoint.load_step)
    if trainer.step < cfg.training.steps:  # it trains on: a rewind's newer steps go aside now
        checkpointer.set_aside_abandoned()
        checkpointer.check_space(trainer.step, cfg.training.steps)
    if trainer.ft is not None:
        trainer.ft.after_checkpoint_load()
    trainer.comm_mode.load_initial_weights(trainer.model_parts)  # COMM_MODE=local_tensor
    if "optimizer" in checkpointer.loaded:
        note = resumed_lr_note(trainer.optimizers, trainer.lr_schedulers, cfg.optimizer,
                               checkpointer.loaded, trainer.step)
        if note and trainer.rank == 0:
            logger.warning(note)
    if trainer.step >= cfg.training.steps:  # e.g. a finished job started again
        logger.warning(
            f"Nothing to train: the checkpoint loaded is at step {trainer.step} and "
            f"training.steps={cfg.training.steps}; raise --training.steps to train on"
        )
    else:
        logger.info(f"Training starts at step {trainer.step + 1}")
