"""Text datasets: the registry, the global packed-sequence stream and its dataloader.

Attributes load on first use, so ``torchtitan.datasets.mix`` (used by the config validation)
imports without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DATASETS",
    "DatasetConfig",
    "HuggingFaceTextDataset",
    "build_text_dataloader",
    "load_text_dataset",
    "resolve_dataset",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("torchtitan.datasets.hf_datasets"), name)
    raise AttributeError(f"module 'torchtitan.datasets' has no attribute {name!r}")
