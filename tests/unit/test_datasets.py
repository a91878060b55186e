"""Datasets: registry, local formats, packing, DP sharding, exact resume, the dataloader."""

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


def test_dp_ranks_get_disjoint_contiguous_shards(jsonl):
    seen = []
    for rank in range(2):
        samples = list(_ds(jsonl, seq_len=4, dp_rank=rank, dp_world_size=2, infinite=False))
        stream = _windows_to_stream(samples)
        shard = DOCS[rank * 20 : (rank + 1) * 20]
        expected = _stream(shard)
        assert stream == expected[: len(stream)] and len(expected) - len(stream) < 5
        seen.append(set(CHAR.decode(stream).split("doc")[1:-1]))  # complete documents
    assert seen[0].isdisjoint(seen[1])
    assert len(seen[0] | seen[1]) >= len(DOCS) - 2  # all but each rank's cut-off last document


def test_dp_rank_out_of_range_and_empty_shard(jsonl, tmp_path):
    with pytest.raises(ValueError, match=r"dp_rank 2 is outside \[0, 2\)"):
        _ds(jsonl, dp_rank=2, dp_world_size=2)
    one = tmp_path / "one.jsonl"
    one.write_text('{"text": "only"}\n')
    with pytest.raises(ValueError, match=r"no documents for dp rank 1 of 2"):
        next(iter(_ds(one, dp_rank=1, dp_world_size=2)))


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
    assert set(state) == {"dp_rank_1", "world_size"} and state["world_size"] == 2
    resumed = make()
    resumed.load_state_dict(state)
    assert _same(list(itertools.islice(iter(resumed), 9)), ref[5:14])


def test_workers_split_documents(jsonl):
    loader = build_text_dataloader(
        dataset_name="local",
        dataset_path=str(jsonl),
        tokenizer=CHAR,
        local_batch_size=1,
        seq_len=4,
        dp_rank=0,
        dp_world_size=1,
        infinite=False,
        dataloader_config=DataLoader(num_workers=2),
    )
    rows = [(x[0], y[0]) for x, y in loader]
    # Worker w packs documents w, w + 2, ...; the loader takes batches from the workers in turn.
    per_worker = []
    for w in range(2):
        stream = _stream(DOCS[w::2])
        n = len(stream) // 5
        per_worker.append([stream[i * 5 : (i + 1) * 5] for i in range(n)])
    expected = [
        win
        for i in range(max(map(len, per_worker)))
        for ws in per_worker
        if i < len(ws)
        for win in [ws[i]]
    ]
    assert [_windows_to_stream([r]) for r in rows] == expected


def test_dp_world_size_change_is_refused(jsonl):
    def make(rank, world):
        return build_text_dataloader(
            dataset_name="local",
            dataset_path=str(jsonl),
            tokenizer=CHAR,
            local_batch_size=2,
            seq_len=8,
            dp_rank=rank,
            dp_world_size=world,
        )

    saved = make(0, 2)
    next(iter(saved))
    state = saved.state_dict()
    with pytest.raises(ValueError) as e:
        make(0, 4).load_state_dict(state)
    msg = str(e.value)
    assert "changed from 2 to 4" in msg and "--checkpoint.exclude_from_loading dataloader" in msg
    with pytest.raises(ValueError, match=r"no entry for dp_rank_1"):
        make(1, 2).load_state_dict(state)
    fresh = make(0, 2)
    fresh.load_state_dict({})  # nothing saved: start from the beginning
    assert torch.equal(next(iter(fresh))[0], next(iter(make(0, 2)))[0])


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
