"""Warmup-stable-decay learning-rate schedule, Stateful across optimizers."""

from __future__ import annotations

import functools
import math
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.job_config import LRScheduler as LRSchedulerConfig


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    decay_steps: int,
    training_steps: int,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of the peak LR after ``step`` completed optimizer steps.

    Linear warm-up over ``warmup_steps`` (the first update uses 1/(warmup+1) of the peak), then
    constant, then decay towards ``min_lr_factor`` over the last ``decay_steps`` steps.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    stable_end = training_steps - decay_steps
    if step < stable_end or decay_steps == 0:
        return 1.0
    progress = min(1.0, (step - stable_end) / decay_steps)
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr_scheduler.decay_type={decay_type!r}: use linear, sqrt or cosine")
    return min_lr_factor + (1.0 - min_lr_factor) * remaining


class LRSchedulersContainer(Stateful):
    """One ``LambdaLR`` per optimizer, all following the same schedule."""

    def __init__(self, optimizers: OptimizersContainer, cfg: LRSchedulerConfig, training_steps: int):
        warmup = cfg.warmup_steps
        if warmup > training_steps:
            from torchtitan.tools.logging import logger

            logger.warning(
                f"lr_scheduler.warmup_steps={warmup} exceeds training.steps={training_steps}; "
                f"warming up over all {training_steps} steps"
            )
            warmup = training_steps
        if cfg.decay_ratio is None:
            decay_steps = training_steps - warmup
        else:
            decay_steps = round(training_steps * cfg.decay_ratio)
            if warmup + decay_steps > training_steps:
                left = training_steps - warmup
                if warmup == cfg.warmup_steps:  # (a warm-up longer than the run is said above)
                    from torchtitan.tools.logging import logger

                    logger.warning(
                        f"lr_scheduler.warmup_steps={warmup} + decay_ratio={cfg.decay_ratio} x "
                        f"training.steps={training_steps} ({decay_steps} decay steps) exceed "
                        f"training.steps: the decay is cut to the {left} step"
                        f"{'s' if left != 1 else ''} after the warm-up; lower warmup_steps or "
                        "decay_ratio"
                    )
                decay_steps = left
        self.fn = functools.partial(
            lr_factor,
            warmup_steps=warmup,
            decay_steps=decay_steps,
            training_steps=training_steps,
            decay_type=cfg.decay_type,
            min_lr_factor=cfg.min_lr_factor,
        )
        self.schedulers = [LambdaLR(opt, self.fn) for opt in optimizers.optimizers]
        self.lr_before_load: float | None = None

    def step(self) -> None:
        for sched in self.schedulers:
            sched.step()

    def get_last_lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    def state_dict(self) -> dict[str, Any]:
        # All schedulers share one schedule; the step count is all that varies.
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = self.schedulers[0].optimizer.param_groups if self.schedulers else []
        # The LR a restored optimizer carries: the saving run's schedule at this step.
        self.lr_before_load = float(groups[0]["lr"]) if groups else None
        for sched in self.schedulers:
            sched.last_epoch = state_dict["last_epoch"]
            sched._last_lr = [self.fn(sched.last_epoch) * g["initial_lr"] for g in sched.optimizer.param_groups]
            for group, lr in zip(sched.optimizer.param_groups, sched._last_lr):
                group["lr"] = lr


def resumed_lr_note(optimizers: OptimizersContainer, lr_schedulers: LRSchedulersContainer,
                    cfg: Any, loaded: list[str], step: int) -> str | None:
    """After a checkpoint restored the optimizer (at ``step``): the line to log about the peak
    LR kept or replaced (:func:`reconcile_peak_lr`, ``cfg`` is the ``[optimizer]`` section),
    else about a schedule that changed since the save (:func:`schedule_change_note`)."""
    note = reconcile_peak_lr(optimizers, lr_schedulers, cfg.lr, cfg.override_checkpoint_lr)
    if note is None and "lr_scheduler" in loaded:
        note = schedule_change_note(lr_schedulers, step)
    return note


def schedule_change_note(lr_schedulers: LRSchedulersContainer, step: int) -> str | None:
    """After a checkpoint restored the optimizer and the schedulers: the warning line when this
    config's schedule gives another LR at the checkpoint's step than the run that saved it had
    (``training.steps`` or ``[lr_scheduler]`` changed, e.g. a run extended), else None."""
    before, now = lr_schedulers.lr_before_load, lr_schedulers.get_last_lr()
    if before is None or math.isclose(before, now, rel_tol=1e-6, abs_tol=1e-12):
        return None
    return (
        f"Checkpoint: this config's LR schedule is not the one step-{step} was trained with "
        f"(training.steps or [lr_scheduler] changed): the LR was {before:.4g} after step "
        f"{step} and is {now:.4g} now; training goes on with this config's schedule"
    )


def build_lr_schedulers(
    optimizers: OptimizersContainer, cfg: LRSchedulerConfig, training_steps: int
) -> LRSchedulersContainer:
    """Build the LR schedulers from the ``[lr_scheduler]`` section."""
    return LRSchedulersContainer(optimizers, cfg, training_steps)


def reconcile_peak_lr(
    optimizers: OptimizersContainer,
    lr_schedulers: LRSchedulersContainer,
    config_lr: float,
    override: bool,
) -> str | None:
    """After a checkpoint restored the optimizer: keep its peak lr, or with ``override`` use
    ``config_lr``. Returns the log line saying which one is used (None when they agree)."""
    groups = optimizers.param_groups
    saved = groups[0].get("initial_lr", groups[0]["lr"]) if groups else config_lr
    if math.isclose(saved, config_lr, rel_tol=1e-9, abs_tol=0.0):
        return None
    if not override:
        return (
            f"Checkpoint: using the checkpoint's peak lr {saved:g}; optimizer.lr={config_lr:g} "
            "in this config is ignored (add --optimizer.override_checkpoint_lr to use it)"
        )
    for group in groups:
        group["initial_lr"] = config_lr
    lr_schedulers.load_state_dict(lr_schedulers.state_dict())  # recompute lr from the schedule
    return (
        f"Checkpoint: using optimizer.lr={config_lr:g} from this config as the peak lr instead of "
        f"the checkpoint's {saved:g} (optimizer.override_checkpoint_lr)"
    )
