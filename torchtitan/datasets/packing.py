"""The global packed sequence stream and its position.

``DocumentSource``: one dataset's documents in order, pass after pass, tokenized as
``[BOS] text [EOS]``; its position is (pass, documents read in the pass, HF's own state for
streaming datasets). ``PackedStream``: those token lists concatenated and cut into windows of
``seq_len + 1`` tokens; its position adds the tokens read but not yet cut (the tail of the last
document read). ``SequenceStream``: the global stream of packed sequences ``0, 1, 2, ...``,
sequence ``j`` taken from the source :func:`~torchtitan.datasets.mix.pick_source` draws for it.

Nothing here depends on the data-parallel layout: every rank (and worker) walks the same stream
and keeps the sequences assigned to it, so the position after sequence ``g`` is one value that
any layout can resume from (see hf_datasets.py and docs/datasets.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torchtitan.datasets import text_checks
from torchtitan.datasets.mix import pick_source
from torchtitan.datasets.sources import DatasetConfig, data_files, describe, load_text_dataset

if TYPE_CHECKING:
    from torchtitan.components.tokenizer import BaseTokenizer

__all__ = ["DocumentSource", "PackedStream", "SequenceStream"]

logger = logging.getLogger(__name__)

_READ_AHEAD = 64  # documents read from a map-style dataset at a time


def _next_unsharded(iterator):
    """``next(iterator)`` of an HF streaming dataset with torch's worker info hidden: HF would
    give each dataloader worker a share of the shards, and here every worker reads the stream."""
    from torch.utils.data._utils import worker

    saved, worker._worker_info = worker._worker_info, None
    try:
        return next(iterator)
    finally:
        worker._worker_info = saved


class DocumentSource:
    """The documents of one dataset as token lists, with a resumable position."""

    def __init__(self, name: str, cfg: DatasetConfig, tokenizer: BaseTokenizer,
                 infinite: bool = True, dp_rank: int = 0):
        import datasets

        self.name, self.cfg, self.tokenizer = name, cfg, tokenizer
        self.infinite, self.dp_rank = infinite, dp_rank
        self.origin = describe(cfg)  # saved with the position: a resume onto other data is named
        self.window = 0  # tokens per sample, set by the PackedStream that reads this source
        ds = load_text_dataset(cfg, name)
        self.streaming = isinstance(ds, datasets.IterableDataset)
        self._data = ds if self.streaming else ds.select_columns([cfg.text_column])
        self.reset()

    def reset(self) -> None:
        self.epoch = 0
        self.docs = 0  # documents read in this pass (skipped empty ones included)
        self._hf_state: dict | None = None
        self._iter = None
        self._cache: list[Any] = []
        self._cache_start = 0
        self._pass_tokens = self._pass_skipped = 0
        self._whole_pass = True

    # -- position -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "docs": self.docs}
        if self.streaming:
            state["hf_state"] = self._data.state_dict() if self._iter is not None else self._hf_state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        self.epoch, self.docs = int(state["epoch"]), int(state["docs"])
        self._hf_state = state.get("hf_state")
        self._whole_pass = self.docs == 0

    # -- documents ------------------------------------------------------------------------------
    _END = object()

    def _next_text(self) -> Any:
        try:
            return self._read_text()
        except UnicodeDecodeError as err:  # HF keeps the bytes; they fail only when read
            files = data_files(self.cfg, self.name)
            if files:
                raise text_checks.not_utf8_error(files, err) from None
            raise ValueError(
                f"Dataset {self.name} ({self.origin}): document {self.docs} is not UTF-8 text ({err})"
            ) from None

    def _read_text(self) -> Any:
        if self.streaming:
            if self._iter is None:
                self._data.load_state_dict(self._hf_state or {})  # falsy: the pass's start
                self._iter = iter(self._data)
            try:
                example = _next_unsharded(self._iter)
            except StopIteration:
                return self._END
            col = self.cfg.text_column
            if col not in example:
                raise ValueError(
                    f"Dataset {self.name} has no {col!r} field (fields: {sorted(example)})."
                )
            self.docs += 1
            return example[col]
        if self.docs >= len(self._data):
            return self._END
        offset = self.docs - self._cache_start
        if not 0 <= offset < len(self._cache):
            self._cache_start, offset = self.docs, 0
            end = min(len(self._data), self.docs + _READ_AHEAD)
            self._cache = self._data[self.docs : end][self.cfg.text_column]
        self.docs += 1
        return self._cache[offset]

    def next_ids(self) -> list[int] | None:
        """The next non-empty document's ids, re-looping at the end of a pass; None at the end
        of the data when not infinite."""
        while True:
            text = self._next_text()
            if text is self._END:
                if not self._end_of_pass():
                    return None
                continue
            if not isinstance(text, str) or not text or text.isspace():
                if text is not None and not isinstance(text, str):
                    raise text_checks.bad_document(
                        self.name, self.docs - 1, self.cfg.text_column, text
                    )
                self._pass_skipped += 1
                continue
            ids = self.tokenizer.encode(text, bos=True, eos=True)
            self._pass_tokens += len(ids)
            return ids

    def _end_of_pass(self) -> bool:
        if self.docs == 0:
            if self.infinite:
                raise ValueError(f"Dataset {self.name} has no documents; use another dataset.")
            logger.warning("Dataset %s has no documents.", self.name)
            return False
        if self._whole_pass and self._pass_skipped and self.epoch == 0:
            logger.warning(
                "Dataset %s: skipped %d empty or missing texts of %d in a pass (dp rank %d).",
                self.name, self._pass_skipped, self.docs, self.dp_rank,
            )
        if self._whole_pass and self._pass_tokens == 0:
            raise text_checks.empty_pass(self.name, self.cfg.path, self.docs, self.dp_rank)
        if not self.infinite:
            logger.info("Dataset %s: end of data (dp rank %d).", self.name, self.dp_rank)
            return False
        # A pass shorter than one sample: every sample repeats the data, one pass after another
        tiny = self._whole_pass and self._pass_tokens < self.window
        if tiny and self.epoch == 0:
            logger.warning(
                "Dataset %s (%s): a whole pass over its %d documents gives %d tokens (dp rank "
                "%d), fewer than one sample of %d (training.seq_len + 1): each sample repeats "
                "the same text; train on more data",
                self.name, self.origin, self.docs, self._pass_tokens, self.dp_rank, self.window,
            )
        self.epoch += 1
        self.docs = 0
        self._hf_state, self._iter = None, None
        self._pass_tokens = self._pass_skipped = 0
        self._whole_pass = True
        if not tiny:  # (else one line per pass, hundreds per step)
            logger.info("Dataset %s is re-looping (epoch %d).", self.name, self.epoch)
        return True


class PackedStream:
    """Windows of ``window`` tokens cut from one source's concatenated documents."""

    def __init__(self, source: DocumentSource, window: int):
        self.source, self.window = source, window
        source.window = window
        self.buffer: list[int] = []

    def _fill(self) -> bool:
        while len(self.buffer) < self.window:
            ids = self.source.next_ids()
            if ids is None:
                return False
            self.buffer.extend(ids)
        return True

    def next_window(self, keep: bool = True) -> list[int] | None:
        """The next window (``[]`` when not ``keep``: skipped), or None at the end of data."""
        if not self._fill():
            return None
        out = self.buffer[: self.window] if keep else []
        del self.buffer[: self.window]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**self.source.state_dict(), "buffer": list(self.buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)
        self.buffer = list(state["buffer"])


class SequenceStream:
    """The global packed-sequence stream over one or more weighted sources.

    ``position`` is the index of the next sequence; sequence ``j`` is the next window of source
    ``pick_source(weights, seed, j)``. The state is the position and every source's position.
    """

    def __init__(self, streams: dict[str, PackedStream], weights: dict[str, float], seed: int):
        self.streams, self.seed = streams, seed
        self.names = list(streams)
        self.weights = [weights[n] for n in self.names]
        self.position = 0

    def next(self, keep: bool = True) -> list[int] | None:
        name = self.names[pick_source(self.weights, self.seed, self.position)]
        window = self.streams[name].next_window(keep)
        if window is not None:
            self.position += 1
        return window

    def advance_to(self, position: int) -> bool:
        """Skip sequences up to ``position`` (tokenizing them: their lengths place the next);
        False at the end of the data."""
        while self.position < position:
            if self.next(keep=False) is None:
                return False
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "sources": {n: s.state_dict() for n, s in self.streams.items()},
            "origins": {n: s.source.origin for n, s in self.streams.items()},
            "weights": dict(zip(self.names, self.weights)),
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        saved = state["sources"]
        origins = {n: s.source.origin for n, s in self.streams.items()}
        saved_origins = state.get("origins", {})  # absent in states of older torchtitan
        for name, stream in self.streams.items():
            if name in saved:
                stream.load_state_dict(saved[name])
                was = saved_origins.get(name, origins[name])
                if was != origins[name]:
                    logger.warning(
                        "Data stream: dataset %s was %s in the checkpoint and is %s now; it "
                        "resumes at document %s of pass %s of the new data (start it over with "
                        "--checkpoint.exclude_from_loading dataloader)",
                        name, was, origins[name], saved[name]["docs"], saved[name]["epoch"],
                    )
        if len(saved) == 1 and len(self.streams) == 1 and set(saved) != set(self.streams):
            (old,), (new,) = saved, self.streams
            was = f" ({saved_origins[old]})" if old in saved_origins else ""
            logger.warning(
                "Data stream: the checkpoint read dataset %s%s, this run reads %s (%s); %s starts "
                "at its beginning and gives the sequences from %d on",
                old, was, new, origins[new], new, self.position,
            )
            return
        for name in self.streams:
            if name not in saved:
                logger.info("Data stream: source %s is new; it starts at its beginning.", name)
        dropped = sorted(set(saved) - set(self.streams))
        if dropped:
            logger.info("Data stream: sources %s are no longer in the mix.", dropped)
        if state.get("weights") != dict(zip(self.names, self.weights)) or state.get("seed") != self.seed:
            logger.info(
                "Data stream: the mix changed (%s, seed %s -> %s, seed %s); every source resumes "
                "where it stopped and sequences from %d on follow the new mix.",
                state.get("weights"), state.get("seed"), dict(zip(self.names, self.weights)),
                self.seed, self.position,
            )
