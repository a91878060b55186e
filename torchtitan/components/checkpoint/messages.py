"""What the checkpoint manager tells the user about its setup: the start-up line and the flags
that find a seed checkpoint."""

from __future__ import annotations

import os
from typing import Any

from torchtitan.components.checkpoint import hf
from torchtitan.components.checkpoint.common import rank
from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.tools.logging import logger


def setup_line(cfg: CheckpointConfig, folder: str, async_mode: Any, sd_adapter: Any,
               model_parts: list) -> None:
    """Rank 0 logs where and how often the run saves (or that it only loads); a warning when a
    lossy HF export lies ahead."""
    if rank() != 0 or cfg.create_seed_checkpoint:
        return
    if cfg.load_only:
        logger.info(f"Checkpoint: load_only: loading from {folder} if possible, never saving")
        return
    extras = []
    if cfg.enable_first_step_checkpoint:
        extras.append("also after step 1")
    if cfg.last_save_model_only:
        extras.append(f"final save model-only in {cfg.export_dtype}")
    if cfg.last_save_in_hf:
        extras.append("final save also as HF safetensors")
        ahead = not cfg.last_save_in_hf_allow_lossy and hf.lossy_export_ahead(
            sd_adapter, model_parts
        )
        if ahead:
            logger.warning(f"Checkpoint: {ahead}")
    logger.info(
        f"Checkpoint: saving to {folder}/step-N every {cfg.interval} steps, "
        f"async_mode={async_mode}, keep_latest_k={cfg.keep_latest_k or 'all'}"
        + (f" ({'; '.join(extras)})" if extras else "")
    )


def seed_flags(folder: str, cfg: CheckpointConfig) -> str:
    """The flags a run needs to find ``folder``'s seed checkpoint: ``--checkpoint.enable``,
    plus the dump folder / checkpoint folder when they are not the defaults."""
    from torchtitan.config.job_config import Job

    flags = ["--checkpoint.enable"]
    if not os.path.isabs(cfg.folder):  # else the dump folder plays no part
        dump = folder[: -len(cfg.folder)].rstrip("/") or "."
        if os.path.normpath(dump) != os.path.normpath(Job().dump_folder):
            flags.append(f"--job.dump_folder {dump}")
    if cfg.folder != CheckpointConfig().folder:
        flags.append(f"--checkpoint.folder {cfg.folder}")
    return " ".join(flags)
