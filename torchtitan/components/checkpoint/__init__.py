"""DCP checkpointing: atomic, verified, resharding-friendly saves and exact resume.

Modules: ``manager`` (CheckpointManager: what and when), ``save`` (sync/async writes, commit,
purge), ``load`` (load plan, the shared shape check, DCP loading), ``hf`` (HF safetensors),
``fs`` (folder layout: step folders, the ``.committed`` marker, verify/scan/commit/purge),
``hooks`` (SaveHooks: an injectable observer of the phases of a save), ``common`` (errors,
names, process-group helpers). See docs/checkpoint.md.
"""

from torchtitan.components.checkpoint import fs, hf, hooks, load, save
from torchtitan.components.checkpoint.common import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    TRAIN_STATE,
    CheckpointError,
    ModelWrapper,
)
from torchtitan.components.checkpoint.hooks import HOOKS_ENV, SaveHooks
from torchtitan.components.checkpoint.load import check_model_shapes
from torchtitan.components.checkpoint.load_plan import LoadPlan
from torchtitan.components.checkpoint.manager import CheckpointManager
from torchtitan.components.checkpoint.save import InFlightSave

__all__ = [
    "DATALOADER",
    "HOOKS_ENV",
    "LR_SCHEDULER",
    "MODEL",
    "OPTIMIZER",
    "TRAIN_STATE",
    "CheckpointError",
    "CheckpointManager",
    "InFlightSave",
    "LoadPlan",
    "ModelWrapper",
    "SaveHooks",
    "check_model_shapes",
    "fs",
    "hf",
    "hooks",
    "load",
    "save",
]
