"""Packed, Stateful text data for one data-parallel rank, and its dataloader.

Documents are tokenized with BOS and EOS, concatenated and cut into non-overlapping windows of
``seq_len + 1`` tokens (``input = w[:-1]``, ``labels = w[1:]``); the windows form one global
stream that the data-parallel ranks share out sequence by sequence, so its position is the same
for every layout (packing.py). Sources and the registry: sources.py; mixes: mix.py.
See docs/datasets.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.datasets.mix import SourceSpec, parse_dataset_spec
from torchtitan.datasets.packing import DocumentSource, PackedStream, SequenceStream
from torchtitan.datasets.sources import (
    DATASETS,
    DatasetConfig,
    load_text_dataset,
    resolve_dataset,
)

if TYPE_CHECKING:
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.config.job_config import DataLoader

__all__ = [
    "DATASETS",
    "DatasetConfig",
    "HuggingFaceTextDataset",
    "build_text_dataloader",
    "load_text_dataset",
    "resolve_dataset",
]


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def tokenizer_fingerprint(tokenizer: BaseTokenizer) -> str:
    """What the saved token buffers depend on: the tokenizer's kind, size and BOS/EOS."""
    return f"{type(tokenizer).__name__}:{tokenizer.vocab_size}:{tokenizer.bos_id}:{tokenizer.eos_id}"


class HuggingFaceTextDataset(IterableDataset, Stateful):
    """This data-parallel rank's packed samples ``(input_ids, labels)``, ``LongTensor[seq_len]``.

    All ranks walk one global stream of packed sequences (``packing.SequenceStream``, over one
    dataset or a weighted mix, see ``mix.py``); counted from the position ``g`` it starts at,
    rank ``r`` of ``N`` takes sequences ``g + r, g + r + N, ...``, ``batch_size`` at a time, and
    dataloader worker ``w`` of ``W`` makes this rank's batches ``w, w + W, ...``. After the last
    sample of each batch the stream is moved to the end of that *global* batch, so
    ``state_dict()`` there is one value for all ranks: the stream's position, from which any
    number of ranks, workers or batch size resumes exactly (docs/datasets.md).

    ``infinite=True`` re-loops forever; ``infinite=False`` makes one pass per ``iter()`` (each
    new ``iter()`` starts a fresh pass, unless a state was just loaded).
    """

    def __init__(
        self,
        dataset_name: str,
        dataset_path: str | None,
        tokenizer: BaseTokenizer,
        seq_len: int = 2048,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
        dataset_config: DatasetConfig | None = None,
        batch_size: int = 1,
        seed: int = 0,
    ):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_world_size}).")
        if batch_size < 1:
            raise ValueError(f"local batch size must be >= 1, got {batch_size}.")
        self.dataset_name = dataset_name
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.batch_size = batch_size
        self.infinite = infinite
        self.seed = seed
        if dataset_config is not None:
            specs = [SourceSpec(dataset_name, None, 1.0)]
            configs = [dataset_config]
        else:
            specs = parse_dataset_spec(dataset_name, dataset_path)
            configs = [resolve_dataset(s.name, s.path) for s in specs]
        self.cfg = configs[0]
        self.sources = [
            DocumentSource(s.name, c, tokenizer, infinite, dp_rank) for s, c in zip(specs, configs)
        ]
        self.weights = {s.name: s.weight for s in specs}
        self._fingerprint = tokenizer_fingerprint(tokenizer)
        self._base: dict[str, Any] | None = None  # the position the next iter() starts from
        self._stream: SequenceStream | None = None  # the stream being iterated (this process)
        self._resume_pending = False

    def _new_stream(self) -> SequenceStream:
        for source in self.sources:
            source.reset()
        stream = SequenceStream(
            {s.name: PackedStream(s, self.seq_len + 1) for s in self.sources},
            self.weights,
            self.seed,
        )
        if self._base is not None:
            stream.load_state_dict(self._base)
        return stream

    def __iter__(self):
        if not self.infinite and not self._resume_pending:
            self._base = None
        self._resume_pending = False
        stream = self._stream = self._new_stream()
        worker_id, num_workers = _worker()
        n, r, size = self.dp_world_size, self.dp_rank, self.batch_size
        first, batch = stream.position, worker_id
        while True:
            start = first + batch * size * n  # this rank's batch `batch` lies in [start, start+size*n)
            for i in range(size):
                if not stream.advance_to(start + i * n + r):
                    return
                window = stream.next()
                if window is None:
                    return
                if i == size - 1:  # the end of the global batch: the state all ranks share
                    stream.advance_to(start + size * n)
                tokens = torch.tensor(window, dtype=torch.long)
                yield tokens[:-1], tokens[1:]
            batch += num_workers

    # -- Stateful -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The global stream's position (``"position"``: sequences consumed by all ranks)."""
        if self._stream is not None:
            state = self._stream.state_dict()
        elif self._base is not None:
            state = dict(self._base)
        else:
            state = self._new_stream().state_dict()
        state["tokenizer"] = self._fingerprint
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("tokenizer")
        if saved is not None and saved != self._fingerprint:
            raise ValueError(
                f"the data stream was tokenized by {saved}, this run uses {self._fingerprint}; "
                "its buffered tokens do not fit"
            )
        self._base = dict(state_dict)
        self._stream = None
        self._resume_pending = True


def _collate(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])


def build_text_dataloader(
    *,
    dataset_name: str,
    dataset_path: str | None,
    tokenizer: BaseTokenizer,
    local_batch_size: int,
    seq_len: int,
    dp_rank: int,
    dp_world_size: int,
    infinite: bool = True,
    dataloader_config: DataLoader | None = None,
    seed: int = 0,
) -> ParallelAwareDataloader:
    """A Stateful dataloader yielding ``(input_ids, labels)``, ``LongTensor[local_batch_size, seq_len]``.

    ``dataset_name`` is a dataset or a mix (``"a:0.7,b=/path:0.3"``, drawn with ``seed``).
    With ``infinite=False`` the last batch of a pass may hold fewer than ``local_batch_size`` rows.
    """
    dataset = HuggingFaceTextDataset(
        dataset_name=dataset_name,
        dataset_path=dataset_path,
        tokenizer=tokenizer,
        seq_len=seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
        batch_size=local_batch_size,
        seed=seed,
    )
    return ParallelAwareDataloader(
        dataset,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        batch_size=local_batch_size,
        dataloader_config=dataloader_config,
        collate_fn=_collate,
    )
