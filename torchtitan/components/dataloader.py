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
    """``StatefulDataLoader`` whose state is the position of the global data stream.

    The dataset (``HuggingFaceTextDataset``) deals one global stream of packed sequences out
    to the data-parallel ranks and stops each batch at the end of its *global* batch, so after
    every step all ranks hold the same position. ``state_dict()`` is
    ``{"data_stream": <pickled position>, "world_size": <dp degree>}``, identical on every rank
    (DCP stores it once), and loading it under any dp degree, worker count or local batch size
    continues the stream exactly: nothing is read twice or skipped. With workers, the position
    is that of the worker which made the last batch taken from the loader.
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
            "snapshot_every_n_steps": 1,  # a worker's position with every batch
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

    def _stream_position(self) -> dict[str, Any]:
        """The dataset state after the last batch handed out (the latest of the workers')."""
        loader_state = super().state_dict()
        if "dataset_state" in loader_state:  # no workers: the dataset in this process
            states = [loader_state["dataset_state"]]
        else:
            snapshots = loader_state.get("_snapshot", {}).get("_worker_snapshots", {})
            states = [w.get("dataset_state") for w in snapshots.values()]
        states = [s for s in states if s]
        if not states:
            return self.dataset.state_dict()  # not iterated yet
        return max(states, key=lambda s: s.get("position", 0))

    def state_dict(self) -> dict[str, Any]:
        """``{"data_stream": bytes, "world_size": int}``, the same on every rank."""
        return {
            "data_stream": pickle.dumps(self._stream_position()),
            "world_size": self.dp_world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the data stream where it was saved (any dp degree); ``ValueError`` when
        the state cannot be used."""
        if not state_dict:
            logger.warning(
                "Dataloader state is empty (dp rank %d): starting from the beginning.", self.dp_rank
            )
            return
        if "data_stream" not in state_dict:
            raise ValueError(
                f"the dataloader state has no data stream position (keys: {sorted(state_dict)}; "
                "per-rank states of an older torchtitan cannot be resumed)"
            )
        position = pickle.loads(state_dict["data_stream"])
        saved_world = state_dict.get("world_size")
        if saved_world != self.dp_world_size and self.dp_rank == 0:
            logger.info(
                "Data stream saved at data-parallel degree %s resumes at degree %d from sequence "
                "%s: rank r now takes sequences %s + r, %s + r + %d, ...",
                saved_world, self.dp_world_size, position.get("position"),
                position.get("position"), position.get("position"), self.dp_world_size,
            )
        self.dataset.load_state_dict(position)
