"""Text datasets: the registry and the packed, DP-sharded, Stateful dataloader builder."""

from torchtitan.datasets.hf_datasets import (
    DATASETS,
    DatasetConfig,
    HuggingFaceTextDataset,
    build_text_dataloader,
    load_text_dataset,
    resolve_dataset,
)

__all__ = [
    "DATASETS",
    "DatasetConfig",
    "HuggingFaceTextDataset",
    "build_text_dataloader",
    "load_text_dataset",
    "resolve_dataset",
]
