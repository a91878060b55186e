"""A data-parallel-aware Stateful dataloader (torchdata's ``StatefulDataLoader``)."""

from __future__ import annotations

import logging
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.config.job_config import DataLoader

__all__ = ["ParallelAwareDataloader"]

logger = logging.getLogger(__name__)


class ParallelAwareDataloader(StatefulDataLoader, Stateful):
    """``StatefulDataLoader`` whose state is keyed by data-parallel rank.

    ``state_dict()`` returns ``{"dp_rank_<r>": <pickled loader state>, "world_size": <dp degree>}``
    so each rank's entry survives a DCP checkpoint. Loading a state saved under another dp degree
    raises ``ValueError``: the data position of each rank cannot be mapped to a new layout.
    Workers, ``pin_memory``, ``persistent_workers`` and ``prefetch_factor`` come from the
    ``[training.dataloader]`` section (the last two only apply with ``num_workers > 0``).
    """

    def __init__(
        self,
        dataset: IterableDataset,
        dp_rank: int,
        dp_world_size: int,
        batch_size: int,
        dataloader_config: DataLoader | None = None,
        collate_fn: Callable | None = None,
    ):
        cfg = dataloader_config or DataLoader()
        if batch_size < 1:
            raise ValueError(f"local batch size must be >= 1, got {batch_size}.")
        if cfg.num_workers < 0:
            raise ValueError(
                f"training.dataloader.num_workers must be >= 0, got {cfg.num_workers}."
            )
        kwargs: dict[str, Any] = {
            "num_workers": cfg.num_workers,
            "pin_memory": cfg.pin_memory and torch.cuda.is_available(),
            "collate_fn": collate_fn,
        }
        if cfg.num_workers > 0:
            kwargs["persistent_workers"] = cfg.persistent_workers
            if cfg.prefetch_factor is not None:
                kwargs["prefetch_factor"] = cfg.prefetch_factor
        with warnings.catch_warnings():  # torchdata 0.11 calls the deprecated torch.set_vital
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            super().__init__(dataset, batch_size=batch_size, **kwargs)
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self._rank_id = f"dp_rank_{dp_rank}"

    def state_dict(self) -> dict[str, Any]:
        """``{"dp_rank_<r>": bytes, "world_size": int}``; bytes so DCP stores it per rank as-is."""
        return {
            self._rank_id: pickle.dumps(super().state_dict()),
            "world_size": self.dp_world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's position; ``ValueError`` if the dp degree changed."""
        if not state_dict:
            logger.warning(
                "Dataloader state is empty (dp rank %d): starting from the beginning.", self.dp_rank
            )
            return
        saved_world = state_dict.get("world_size")
        if saved_world != self.dp_world_size:
            raise ValueError(
                f"The data-parallel degree changed from {saved_world} to {self.dp_world_size}, "
                "so the dataloader position cannot be resumed; resume with the old dp degree "
                "or skip it with `--checkpoint.exclude_from_loading dataloader`."
            )
        if self._rank_id not in state_dict:
            raise ValueError(
                f"The dataloader state has no entry for {self._rank_id} (keys: "
                f"{sorted(k for k in state_dict if k != 'world_size')}); skip it with "
                "`--checkpoint.exclude_from_loading dataloader`."
            )
        super().load_state_dict(pickle.loads(state_dict[self._rank_id]))
