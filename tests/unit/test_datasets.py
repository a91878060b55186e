"""Datasets: registry, local formats, packing, the global stream shared out to dp ranks, exact
resume (also across dp degrees, workers and batch sizes), the dataloader."""

import itertools
import json
import pickle
import socket
from pathlib import Path

import pytest
import torch

from tests.conftest import C4_TEST_TRAIN, C4_TEST_VALID, REPO_ROOT
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config.job_config import DataLoader
from torchtitan.datasets import (
    DATASETS,
    DatasetConfig,
    HuggingFaceTextDataset,
    build_text_dataloader,
    load_text_dataset,
    resolve_dataset,
)

BOS, EOS = 1, 2


class CharTokenizer(BaseTokenizer):
    """One id per character (ord + 3): token streams can be checked by hand."""

    def encode(self, text, bos=True, eos=False):
        return self._wrap([ord(c) + 3 for c in text], bos, eos)

    def decode(self, ids):
        return "".join(chr(i - 3) for i in ids if i > 2)

    @property
    def vocab_size(self):
        return 300

    @property
    def bos_id(self):
        return BOS

    @property
    def eos_id(self):
        return EOS


CHAR = CharTokenizer()
DOCS = [f"doc{i:03d} " + "xyz"[i % 3] * (i % 7) for i in range(40)]


def _stream(docs):
    return [t for d in docs for t in CHAR.encode(d, bos=True, eos=True)]


@pytest.fixture()
def jsonl(tmp_path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return path


def _ds(path, seq_len=8, **kw) -> HuggingFaceTextDataset:
    kw.setdefault("tokenizer", CHAR)
    return HuggingFaceTextDataset("local", str(path), seq_len=seq_len, **kw)


def _windows_to_stream(samples) -> list[int]:
    """Windows are w[:-1], w[1:]: re-join them into the packed token stream."""
    out = []
    for x, y in samples:
        assert torch.equal(x[1:], y[:-1])  # labels are the inputs shifted by one
        out += x.tolist() + [y[-1].item()]
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b)
    )


# --- registry and loading --------------------------------------------------------------------


def test_registry_entries():
    assert DATASETS["c4"] == DatasetConfig(
        path="allenai/c4", hf_name="en", split="train", streaming=True
    )
    assert DATASETS["c4_validation"].split == "validation" and DATASETS["c4_validation"].streaming
    # the bundled synthetic corpus, by a path relative to the repo root (run_train.sh's cwd)
    assert DATASETS["c4_test"].local and REPO_ROOT / DATASETS["c4_test"].path == C4_TEST_TRAIN
    assert DATASETS["c4_test_validation"].local
    assert REPO_ROOT / DATASETS["c4_test_validation"].path == C4_TEST_VALID
    assert C4_TEST_TRAIN.is_file() and C4_TEST_VALID.is_file()


def test_unknown_dataset_lists_known_names():
    with pytest.raises(ValueError, match=r"Unknown dataset 'nope'.*'c4', 'c4_test'"):
        resolve_dataset("nope")
    assert resolve_dataset("nope", "/data/x.jsonl").path == "/data/x.jsonl"
    # A registered name keeps its options (C4 streams) with the local path swapped in.
    local_c4 = resolve_dataset("c4", "/data/c4")
    assert local_c4.local and local_c4.streaming and local_c4.hf_name is None


def test_c4_loads_from_the_hub_streaming(monkeypatch):
    import datasets

    import torchtitan.datasets.sources as sources

    monkeypatch.setattr(sources, "check_hub", lambda *a, **k: None)  # as if the Hub answered
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or object())
    load_text_dataset(DATASETS["c4"], "c4")
    load_text_dataset(DATASETS["c4_validation"], "c4_validation")
    assert calls == [
        (("allenai/c4",), {"name": "en", "split": "train", "streaming": True}),
        (("allenai/c4",), {"name": "en", "split": "validation", "streaming": True}),
    ]


def test_missing_local_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Dataset path .*missing\.jsonl does not exist"):
        _ds(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match=r"holds no \.json/\.jsonl/\.parquet/\.txt files"):
        _ds(tmp_path)


def test_local_c4_test_loads_offline(monkeypatch):
    attempts = []

    def blocked(*args, **kwargs):
        attempts.append(args)
        raise OSError("network blocked by test")

    monkeypatch.setattr(socket, "create_connection", blocked)
    monkeypatch.setattr(socket.socket, "connect", blocked)
    monkeypatch.setattr(socket, "getaddrinfo", blocked)
    for name, n in (("c4_test", 2000), ("c4_test_validation", 200)):
        assert len(load_text_dataset(DATASETS[name], name)) == n
    stream = load_text_dataset(
        DatasetConfig(path=DATASETS["c4_test"].path, local=True, streaming=True), "c4_test"
    )
    assert next(iter(stream))["text"]
    assert attempts == []


def _write(tmp_path: Path, fmt: str) -> Path:
    if fmt == "json":
        path = tmp_path / "d.json"
        path.write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    elif fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("\n".join(json.dumps({"text": d, "n": 1}) for d in DOCS))
    elif fmt == "txt":
        path = tmp_path / "d.txt"
        path.write_text("\n".join(DOCS) + "\n\n")  # one document per line; blank lines skipped
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "d.parquet"
        pq.write_table(pa.table({"text": DOCS}), path)
    else:  # a folder of jsonl shards, read in sorted order
        path = tmp_path / "shards"
        path.mkdir()
        for k in range(2):
            part = DOCS[k * 20 : (k + 1) * 20]
            (path / f"part-{k}.jsonl").write_text(
                "".join(json.dumps({"text": d}) + "\n" for d in part)
            )
    return path


@pytest.mark.parametrize("fmt", ["json", "jsonl", "txt", "parquet", "folder"])
def test_local_formats(tmp_path, fmt):
    path = _write(tmp_path, fmt)
    samples = list(_ds(path, seq_len=16, infinite=False))
    stream = _stream(DOCS)
    n = len(stream) // 17
    assert len(samples) == n
    assert _windows_to_stream(samples) == stream[: n * 17]


def test_local_format_errors(tmp_path):
    (tmp_path / "a.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"is not \.json/\.jsonl\(\.gz\), \.parquet or \.txt"):
        _ds(tmp_path / "a.csv")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text('{"text": "a"}\n')
    (mixed / "b.txt").write_text("b\n")
    with pytest.raises(ValueError, match=r"mixes file formats \(\['json', 'text'\]\)"):
        _ds(mixed)
    nocol = tmp_path / "nocol.jsonl"
    nocol.write_text('{"body": "a"}\n')
    with pytest.raises(ValueError, match=r"has no 'text' column \(columns: \['body'\]\)"):
        _ds(nocol)


# --- packing ---------------------------------------------------------------------------------


def test_packing_is_the_bos_eos_token_stream(jsonl):
    samples = list(itertools.islice(iter(_ds(jsonl, seq_len=8)), 30))
    assert all(x.shape == (8,) and x.dtype == torch.long for x, _ in samples)
    assert _windows_to_stream(samples) == _stream(DOCS)[: 30 * 9]
    first_x, first_y = samples[0]
    assert first_x[0].item() == BOS
    # Documents are separated by EOS, BOS: doc000 ends, doc001 starts.
    assert CHAR.encode(DOCS[0], bos=True, eos=True) == _stream(DOCS)[: len(DOCS[0]) + 2]


def test_infinite_reloops_and_finite_stops(jsonl):
    stream = _stream(DOCS)
    per_pass = len(stream) // 9
    finite = _ds(jsonl, seq_len=8, infinite=False)
    assert len(list(finite)) == per_pass
    assert len(list(finite)) == per_pass  # every iter() is a fresh pass
    infinite = list(itertools.islice(iter(_ds(jsonl, seq_len=8)), 3 * per_pass))
    # The leftover tokens of a pass carry over: the re-looped stream is the corpus repeated.
    assert _windows_to_stream(infinite) == (stream * 4)[: 3 * per_pass * 9]


def test_real_tokenizer_on_c4_test(tiktoken_tokenizer):
    tok = tiktoken_tokenizer
    x, y = next(iter(HuggingFaceTextDataset("c4_test", None, tok, seq_len=512)))
    with open(C4_TEST_TRAIN) as f:
        docs = [json.loads(next(f))["text"] for _ in range(5)]
    stream = [t for d in docs for t in tok.encode(d, bos=True, eos=True)]
    assert x.tolist() + [y[-1].item()] == stream[:513]
    assert x[0].item() == tok.bos_id and tok.eos_id in x.tolist()


# --- data-parallel sharding ------------------------------------------------------------------


def _global_stream(path, n: int) -> list[list[int]]:
    """The first ``n`` packed sequences of the global stream (one rank, one at a time)."""
    return [_windows_to_stream([s]) for s in itertools.islice(iter(_ds(path, seq_len=8)), n)]


def test_dp_ranks_share_out_the_global_stream(jsonl):
    """Rank r of N takes sequences r, r + N, ... of one stream, batch by batch."""
    ref = _global_stream(jsonl, 24)
    for world, batch in ((2, 1), (2, 3), (3, 2)):
        for rank in range(world):
            ds = _ds(jsonl, seq_len=8, dp_rank=rank, dp_world_size=world, batch_size=batch)
            got = [_windows_to_stream([s]) for s in itertools.islice(iter(ds), 24 // world)]
            assert got == ref[rank::world][: len(got)], (world, batch, rank)


def test_dp_rank_out_of_range_and_short_data(jsonl, tmp_path):
    with pytest.raises(ValueError, match=r"dp_rank 2 is outside \[0, 2\)"):
        _ds(jsonl, dp_rank=2, dp_world_size=2)
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "a"}\n')
    assert list(_ds(short, seq_len=4, infinite=False)) == []  # no full window in one pass
    # every rank reads every document: one document serves any number of ranks
    x, _ = next(iter(_ds(short, seq_len=4, dp_rank=1, dp_world_size=2)))
    assert x.tolist() == [EOS, BOS, ord("a") + 3, EOS]  # sequence 1 of a, a, a, ...


# --- exact resume ----------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True])
def test_dataset_resume_is_exact(jsonl, streaming):
    cfg = DatasetConfig(path=str(jsonl), local=True, streaming=streaming)

    def make():
        return HuggingFaceTextDataset("local", None, CHAR, seq_len=8, dataset_config=cfg)

    per_pass = len(_stream(DOCS)) // 9
    ref = list(itertools.islice(iter(make()), 2 * per_pass + 10))
    for k in (0, 1, 7, per_pass - 1, per_pass, per_pass + 3, 2 * per_pass + 1):
        ds = make()
        it = iter(ds)
        for _ in range(k):
            next(it)
        state = pickle.loads(pickle.dumps(ds.state_dict()))
        fresh = make()
        fresh.load_state_dict(state)
        assert _same(list(itertools.islice(iter(fresh), 8)), ref[k : k + 8]), f"after {k} samples"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_resume_is_exact(jsonl, num_workers):
    cfg = DataLoader(num_workers=num_workers, prefetch_factor=2 if num_workers else None)

    def make():
        return build_text_dataloader(
            dataset_name="local",
            dataset_path=str(jsonl),
            tokenizer=CHAR,
            local_batch_size=3,
            seq_len=8,
            dp_rank=1,
            dp_world_size=2,
            dataloader_config=cfg,
        )

    ref = list(itertools.islice(iter(make()), 14))  # crosses the re-loop boundary (~6 batches)
    assert all(x.shape == (3, 8) and y.shape == (3, 8) for x, y in ref)
    loader = make()
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    assert set(state) == {"data_stream", "world_size"} and state["world_size"] == 2
    resumed = make()
    resumed.load_state_dict(state)
    assert _same(list(itertools.islice(iter(resumed), 9)), ref[5:14])


def _rows(loader, n_batches):
    return [
        _windows_to_stream([(x[i], y[i])])
        for x, y in itertools.islice(iter(loader), n_batches)
        for i in range(x.shape[0])
    ]


def _loader(path, rank=0, world=1, batch=2, workers=0, infinite=True, tokenizer=CHAR):
    return build_text_dataloader(
        dataset_name="local",
        dataset_path=str(path),
        tokenizer=tokenizer,
        local_batch_size=batch,
        seq_len=8,
        dp_rank=rank,
        dp_world_size=world,
        infinite=infinite,
        dataloader_config=DataLoader(num_workers=workers),
    )


def test_workers_make_the_same_batches(jsonl):
    """Worker w of W makes this rank's batches w, w + W, ...: the rows do not depend on W."""
    ref = _rows(_loader(jsonl, rank=1, world=2, batch=3), 8)
    assert _rows(_loader(jsonl, rank=1, world=2, batch=3, workers=2), 8) == ref
    assert ref == _global_stream(jsonl, 48)[1::2]
    finite = _rows(_loader(jsonl, batch=1, workers=2, infinite=False), 1000)
    assert finite == _global_stream(jsonl, len(finite)) and len(finite) == len(_stream(DOCS)) // 9


@pytest.mark.parametrize("workers", [0, 2])
def test_dp_degree_change_resumes_exactly(jsonl, workers):
    """Saved after 3 steps at dp 2 (local batch 2): resuming at dp 1 (batch 4) or dp 4 (batch
    1) reads exactly the sequences an uninterrupted run reads, none twice, none missed."""
    steps_before, steps_after, global_batch = 3, 4, 4
    total = (steps_before + steps_after) * global_batch
    uninterrupted = sorted(
        row for r in range(2) for row in _rows(_loader(jsonl, r, 2, 2), steps_before + steps_after)
    )
    before = [_loader(jsonl, r, 2, 2, workers) for r in range(2)]
    its = [iter(loader) for loader in before]
    consumed = []
    for _ in range(steps_before):
        for it in its:
            x, y = next(it)
            consumed += [_windows_to_stream([(x[i], y[i])]) for i in range(x.shape[0])]
    states = [loader.state_dict() for loader in before]
    assert states[0] == states[1] and set(states[0]) == {"data_stream", "world_size"}
    state = pickle.loads(pickle.dumps(states[0]))
    for world in (1, 4):
        after = []
        for rank in range(world):
            loader = _loader(jsonl, rank, world, global_batch // world, workers)
            loader.load_state_dict(state)
            after += _rows(loader, steps_after)
        rows = consumed + after
        assert len(rows) == total and sorted(rows) == uninterrupted, f"dp 2 -> {world}"
        assert len({tuple(r) for r in rows}) == total  # no sequence twice
        assert sorted(rows) == sorted(_global_stream(jsonl, total))


def test_dataloader_state_errors_and_empty_state(jsonl):
    with pytest.raises(ValueError, match=r"no data stream position .*older torchtitan"):
        _loader(jsonl).load_state_dict({"dp_rank_0": b"", "world_size": 2})
    saved = _loader(jsonl)
    next(iter(saved))
    other = type("OtherTokenizer", (CharTokenizer,), {})()
    with pytest.raises(ValueError, match=r"tokenized by CharTokenizer:300:1:2, this run uses Other"):
        _loader(jsonl, tokenizer=other).load_state_dict(saved.state_dict())
    fresh = _loader(jsonl)
    fresh.load_state_dict({})  # nothing saved: start from the beginning
    assert torch.equal(next(iter(fresh))[0], next(iter(_loader(jsonl)))[0])


def test_dataloader_options(jsonl):
    ds = _ds(jsonl)
    # prefetch_factor / persistent_workers only reach torch with workers.
    plain = ParallelAwareDataloader(ds, 0, 1, 2, DataLoader(num_workers=0, prefetch_factor=4))
    assert plain.num_workers == 0 and plain.prefetch_factor is None
    workers = ParallelAwareDataloader(
        ds, 0, 1, 2, DataLoader(num_workers=2, prefetch_factor=4, persistent_workers=True)
    )
    assert workers.prefetch_factor == 4 and workers.persistent_workers
    with pytest.raises(ValueError, match=r"training.dataloader.num_workers must be >= 0"):
        ParallelAwareDataloader(ds, 0, 1, 2, DataLoader(num_workers=-1))


def test_build_text_dataloader_on_c4_test(tiktoken_tokenizer):
    tok = tiktoken_tokenizer
    loader = build_text_dataloader(
        dataset_name="c4_test",
        dataset_path=None,
        tokenizer=tok,
        local_batch_size=4,
        seq_len=128,
        dp_rank=0,
        dp_world_size=1,
    )
    x, y = next(iter(loader))
    assert isinstance(loader, ParallelAwareDataloader)
    assert x.shape == y.shape == (4, 128) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < tok.vocab_size
    val = build_text_dataloader(
        dataset_name="c4_test_validation",
        dataset_path=None,
        tokenizer=tok,
        local_batch_size=8,
        seq_len=128,
        dp_rank=0,
        dp_world_size=1,
        infinite=False,
    )
    batches = list(val)
    assert 20 < len(batches) < 200 and batches[-1][0].shape[0] <= 8
    assert len(list(val)) == len(batches)  # a finite loader can be iterated again
