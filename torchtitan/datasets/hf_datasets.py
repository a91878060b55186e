"""Text datasets: a registry (c4, c4_test, c4_validation, ...) and a packed, DP-sharded, Stateful
token dataset over HF ``datasets``.

Documents are tokenized with BOS and EOS, concatenated into a token buffer and cut into
non-overlapping windows of ``seq_len + 1`` tokens; each window gives ``input = w[:-1]`` and
``labels = w[1:]``. See docs/datasets.md.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.datasets import text_checks

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

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DatasetConfig:
    """How to load one dataset."""

    path: str
    """HF Hub dataset id (e.g. ``allenai/c4``), or a local file/folder when ``local``."""

    local: bool = False
    """``path`` is on disk (relative paths resolve against the repo root, then the CWD)."""

    hf_name: str | None = None
    """HF dataset config name (e.g. ``en`` for C4)."""

    split: str = "train"
    """Split to read (local files always load as ``train``)."""

    streaming: bool = False
    """Read lazily as an HF ``IterableDataset`` instead of a map-style Arrow dataset."""

    text_column: str = "text"
    """Column holding each document's text."""


DATASETS: dict[str, DatasetConfig] = {
    "c4": DatasetConfig(path="allenai/c4", hf_name="en", split="train", streaming=True),
    "c4_validation": DatasetConfig(
        path="allenai/c4", hf_name="en", split="validation", streaming=True
    ),
    "c4_test": DatasetConfig(path="tests/assets/c4_test/data.json", local=True),
    "c4_test_validation": DatasetConfig(path="tests/assets/c4_test/validation.json", local=True),
}

# File suffix -> HF packaged builder.
_SUFFIX_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".parquet": "parquet",
    ".txt": "text",
}


def _builder_for(path: Path) -> str | None:
    name = path.name.lower()
    for suffix in sorted(_SUFFIX_BUILDERS, key=len, reverse=True):
        if name.endswith(suffix):
            return _SUFFIX_BUILDERS[suffix]
    return None


def resolve_dataset(dataset_name: str, dataset_path: str | None = None) -> DatasetConfig:
    """The loading config for ``dataset_name``, with ``dataset_path`` (a local path) overriding it.

    A registered name keeps its options (e.g. C4 stays streaming) with the path swapped;
    an unregistered name needs ``dataset_path``, else ``ValueError`` lists the known names.
    """
    if dataset_path:
        base = DATASETS.get(dataset_name, DatasetConfig(path=dataset_path))
        return replace(base, path=dataset_path, local=True, hf_name=None, split="train")
    if dataset_name not in DATASETS:
        raise ValueError(
            f"Unknown dataset {dataset_name!r}: use one of {sorted(DATASETS)} "
            "or give a local file/folder with --training.dataset_path."
        )
    return DATASETS[dataset_name]


def _local_path(cfg: DatasetConfig, dataset_name: str) -> Path:
    """The on-disk path of a local dataset.

    A registry entry's own path is relative to the repo root; a user's ``dataset_path`` is
    relative to the CWD, falling back to the repo root.
    """
    path = Path(cfg.path).expanduser()
    entry = DATASETS.get(dataset_name)
    if entry is not None and entry.local and cfg.path == entry.path:
        full = path if path.is_absolute() else REPO_ROOT / path
        if not full.exists():
            raise FileNotFoundError(
                f"Dataset {dataset_name!r} expects {full}, which is missing: "
                "run `python scripts/generate_test_assets.py` to regenerate the test assets."
            )
        return full
    if path.exists():
        return path
    if not path.is_absolute() and (REPO_ROOT / path).exists():
        return REPO_ROOT / path
    raise FileNotFoundError(
        f"Dataset path {cfg.path} does not exist: fix --training.dataset_path "
        "(or --validation.dataset_path)."
    )


@contextlib.contextmanager
def _no_download_count():
    """Keep HF ``datasets`` from pinging its servers (a download counter) for local files."""
    import datasets.config as hf_config

    old = hf_config.HF_UPDATE_DOWNLOAD_COUNTS
    hf_config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        hf_config.HF_UPDATE_DOWNLOAD_COUNTS = old


def _load_local(path: Path, streaming: bool, column: str = "text"):
    import datasets

    if path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file():
        ds = datasets.load_from_disk(str(path))  # written by Dataset.save_to_disk
        return ds.to_iterable_dataset() if streaming else ds
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and _builder_for(p)
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise FileNotFoundError(
                f"Dataset folder {path} holds no .json/.jsonl/.parquet/.txt files."
            )
    else:
        files = [path]
    builders = {_builder_for(f) for f in files}
    if None in builders:
        raise ValueError(
            f"Dataset file {path} is not .json/.jsonl(.gz), .parquet or .txt; convert it to one."
        )
    if len(builders) > 1:
        raise ValueError(
            f"Dataset folder {path} mixes file formats ({sorted(builders)}); keep one format."
        )
    text_checks.check_not_empty(files)
    try:
        with _no_download_count():
            ds = datasets.load_dataset(
                builders.pop(), data_files=[str(f) for f in files], split="train", streaming=streaming
            )
    except Exception as err:  # noqa: BLE001 - HF/pyarrow errors are many lines: name the bad line
        raise text_checks.explain_load_failure(files, column, err) from None
    text_checks.check_text_feature(ds, files, column, str(path))
    return ds


def load_text_dataset(cfg: DatasetConfig, dataset_name: str = ""):
    """Load ``cfg`` with HF ``datasets``: a ``Dataset``, or an ``IterableDataset`` when streaming."""
    if cfg.local:
        ds = _load_local(_local_path(cfg, dataset_name), cfg.streaming, cfg.text_column)
    else:
        import datasets

        ds = datasets.load_dataset(
            cfg.path, name=cfg.hf_name, split=cfg.split, streaming=cfg.streaming
        )
    columns = getattr(ds, "column_names", None)
    if columns is not None and cfg.text_column not in columns:
        raise ValueError(
            f"Dataset {dataset_name or cfg.path} has no {cfg.text_column!r} column "
            f"(columns: {columns}); each document's text must be in {cfg.text_column!r}."
        )
    return ds


def _shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, end)`` of rank's contiguous block when n documents split over world_size ranks."""
    size, extra = divmod(n, world_size)
    start = rank * size + min(rank, extra)
    return start, start + size + (1 if rank < extra else 0)


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class HuggingFaceTextDataset(IterableDataset, Stateful):
    """Packed next-token-prediction samples ``(input_ids, labels)``, each ``LongTensor[seq_len]``.

    The documents are split across ``dp_world_size`` ranks (contiguous blocks for map-style
    datasets; HF's ``split_dataset_by_node`` for streaming ones) and, inside a rank, across
    dataloader workers (every ``num_workers``-th document). ``infinite=True`` re-loops forever;
    ``infinite=False`` makes one pass per ``iter()`` (each new ``iter()`` starts a fresh pass,
    unless a state was just loaded). ``state_dict()`` after k samples, loaded into a fresh dataset,
    makes it yield exactly samples k, k+1, ... of an uninterrupted run.
    """

    _BATCH_DOCS = 64  # documents read from a map-style dataset at a time

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
    ):
        import datasets
        from datasets.distributed import split_dataset_by_node

        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_world_size}).")
        self.dataset_name = dataset_name
        self.cfg = dataset_config or resolve_dataset(dataset_name, dataset_path)
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite

        ds = load_text_dataset(self.cfg, dataset_name)
        self._streaming = isinstance(ds, datasets.IterableDataset)
        if self._streaming:
            self._data = split_dataset_by_node(ds, rank=dp_rank, world_size=dp_world_size)
        else:  # this rank's contiguous block of documents
            self._shard = _shard_bounds(len(ds), dp_rank, dp_world_size)
            self._data = ds.select_columns([self.cfg.text_column])

        # Position (the whole state): epoch, documents this worker consumed in the epoch, leftover
        # tokens, and HF's own position for streaming datasets.
        self._epoch = 0
        self._docs_consumed = 0
        self._token_buffer: list[int] = []
        self._hf_state: dict | None = None
        self._hf_live = False  # self._data's state reflects this epoch's iteration
        self._resume_pending = False

    # -- documents ------------------------------------------------------------------------------

    def _iter_docs_map(self):
        worker_id, num_workers = _worker()
        start, end = self._shard
        col = self.cfg.text_column
        while True:
            first = start + worker_id + self._docs_consumed * num_workers
            if first >= end:
                return
            idxs = list(range(first, min(end, first + self._BATCH_DOCS * num_workers), num_workers))
            for text in self._data[idxs][col]:
                self._docs_consumed += 1
                yield text

    def _iter_docs_streaming(self):
        # HF's own epoch stays 0 (same shard order every pass; set_epoch would write a tensor
        # shared by all workers): our epoch counter is separate, and a new pass clears HF's state.
        data = self._data
        if self._hf_state is not None:
            data.load_state_dict(self._hf_state)
        else:
            data.load_state_dict({})  # falsy: no resume, start the pass from its beginning
        self._hf_live = True
        col = self.cfg.text_column
        for example in data:
            self._docs_consumed += 1
            if col not in example:
                raise ValueError(
                    f"Dataset {self.dataset_name} has no {col!r} field (fields: {sorted(example)})."
                )
            yield example[col]

    def _iter_docs(self):
        return self._iter_docs_streaming() if self._streaming else self._iter_docs_map()

    # -- samples --------------------------------------------------------------------------------

    def _reset_position(self) -> None:
        self._epoch, self._docs_consumed, self._token_buffer = 0, 0, []
        self._hf_state, self._hf_live = None, False

    def __iter__(self):
        if not self.infinite and not self._resume_pending:
            self._reset_position()
        self._resume_pending = False
        window = self.seq_len + 1
        while True:
            while len(self._token_buffer) >= window:
                yield self._pop_window(window)
            whole_pass = self._docs_consumed == 0
            tokens = skipped = 0
            for text in self._iter_docs():
                if not isinstance(text, str) or not text or text.isspace():
                    if text is not None and not isinstance(text, str):
                        raise text_checks.bad_document(
                            self.dataset_name, self._docs_consumed - 1, self.cfg.text_column, text
                        )
                    skipped += 1
                    continue
                ids = self.tokenizer.encode(text, bos=True, eos=True)
                tokens += len(ids)
                self._token_buffer.extend(ids)
                while len(self._token_buffer) >= window:
                    yield self._pop_window(window)
            if skipped and whole_pass and self._epoch == 0:  # once: later passes repeat it
                logger.warning(
                    "Dataset %s: skipped %d empty or missing texts of %d in a pass (dp rank %d).",
                    self.dataset_name, skipped, self._docs_consumed, self.dp_rank,
                )
            if whole_pass and tokens == 0 and self._docs_consumed > 0:
                raise text_checks.empty_pass(
                    self.dataset_name, self.cfg.path, self._docs_consumed, self.dp_rank
                )
            if self._docs_consumed == 0:  # this rank/worker has no documents at all
                worker_id, num_workers = _worker()
                if num_workers > 1 or not self.infinite:
                    logger.warning(
                        "Dataset %s: dp rank %d, worker %d of %d got no documents.",
                        self.dataset_name,
                        self.dp_rank,
                        worker_id,
                        num_workers,
                    )
                    return
                raise ValueError(
                    f"Dataset {self.dataset_name} has no documents for dp rank {self.dp_rank} "
                    f"of {self.dp_world_size}; use a larger dataset or fewer data-parallel ranks."
                )
            if not self.infinite:
                logger.info(
                    "Dataset %s: end of data (dp rank %d).", self.dataset_name, self.dp_rank
                )
                return
            self._epoch += 1
            self._docs_consumed = 0
            self._hf_state, self._hf_live = None, False
            logger.info("Dataset %s is re-looping (epoch %d).", self.dataset_name, self._epoch)

    def _pop_window(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.tensor(self._token_buffer[:window], dtype=torch.long)
        del self._token_buffer[:window]
        return tokens[:-1], tokens[1:]

    # -- Stateful -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "epoch": self._epoch,
            "docs_consumed": self._docs_consumed,
            "token_buffer": list(self._token_buffer),
        }
        if self._streaming:
            state["hf_state"] = self._data.state_dict() if self._hf_live else self._hf_state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._epoch = int(state_dict["epoch"])
        self._docs_consumed = int(state_dict["docs_consumed"])
        self._token_buffer = list(state_dict["token_buffer"])
        self._hf_state = state_dict.get("hf_state")
        self._hf_live = False
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
) -> ParallelAwareDataloader:
    """A Stateful dataloader yielding ``(input_ids, labels)``, ``LongTensor[local_batch_size, seq_len]``.

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
    )
    return ParallelAwareDataloader(
        dataset,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        batch_size=local_batch_size,
        dataloader_config=dataloader_config,
        collate_fn=_collate,
    )
