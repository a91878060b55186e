"""Data edges: text that is not UTF-8 is named by file and line, and a resume onto other data
says so."""

from __future__ import annotations

import gzip
import json
import logging
import pickle

import pytest

from tests.unit.test_datasets import CHAR, DOCS
from torchtitan.datasets import HuggingFaceTextDataset


def _first(ds) -> None:
    next(iter(ds))


def _write_latin1(path, bad_line: int, n: int = 5) -> None:
    lines = [json.dumps({"text": f"line {i} " + "word " * 6}) for i in range(1, n + 1)]
    lines[bad_line - 1] = '{"text": "caf\u00e9 au lait, d\u00e9j\u00e0 vu"}'
    data = "".join(line + "\n" for line in lines).encode("latin-1")
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    path.write_bytes(data)


@pytest.mark.parametrize("name", ["local", "c4"], ids=["map-style", "streaming"])
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_jsonl_that_is_not_utf8_names_file_and_line(tmp_path, name, suffix):
    path = tmp_path / f"latin1{suffix}"
    _write_latin1(path, bad_line=1)
    with pytest.raises(ValueError) as info:
        _first(HuggingFaceTextDataset(name, str(path), CHAR, seq_len=8))
    assert str(info.value) == (
        f"Dataset {path}:1: not UTF-8 (byte 0xe9 at column 14). Save the file as UTF-8 "
        "(e.g. iconv -f latin1 -t utf-8)."
    )


def test_a_late_bad_line_is_found_when_it_is_read(tmp_path):
    path = tmp_path / "late.jsonl"
    _write_latin1(path, bad_line=4)
    ds = HuggingFaceTextDataset("local", str(path), CHAR, seq_len=8)
    with pytest.raises(ValueError, match=r"late\.jsonl:4: not UTF-8 \(byte 0xe9 at column 14\)"):
        list(ds)


def test_txt_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_bytes(b"good line\nanother\ncaf\xe9\nok\nna\xefve\n")
    with pytest.raises(ValueError) as info:
        _first(HuggingFaceTextDataset("local", str(path), CHAR, seq_len=8))
    assert f"{path}:3: not UTF-8 (byte 0xe9 at column 4); 2 lines are not UTF-8 in all" in str(info.value)


# --- a resume onto other data ------------------------------------------------------------------
def _docs(path, docs) -> str:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def _state_after(ds, n: int) -> dict:
    it = iter(ds)
    for _ in range(n):
        next(it)
    return pickle.loads(pickle.dumps(ds.state_dict()))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_resume_onto_another_path_under_the_same_name_warns(tmp_path, caplog):
    old = _docs(tmp_path / "old.jsonl", DOCS)
    new = _docs(tmp_path / "new.jsonl", list(reversed(DOCS)))
    state = _state_after(HuggingFaceTextDataset("mine", old, CHAR, seq_len=8), 5)
    with caplog.at_level(logging.INFO):
        ds = HuggingFaceTextDataset("mine", new, CHAR, seq_len=8)
        ds.load_state_dict(state)
        _first(ds)
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    docs = state["sources"]["mine"]["docs"]
    assert warnings[0] == (
        f"Data stream: dataset mine was {old} in the checkpoint and is {new} now; it resumes at "
        f"document {docs} of pass 0 of the new data (start it over with "
        "--checkpoint.exclude_from_loading dataloader)"
    )
    caplog.clear()
    with caplog.at_level(logging.INFO):  # the same data: nothing to say
        same = HuggingFaceTextDataset("mine", old, CHAR, seq_len=8)
        same.load_state_dict(state)
        _first(same)
    assert _warnings(caplog) == []


def test_resume_onto_another_dataset_name_is_one_warning(tmp_path, caplog):
    old = _docs(tmp_path / "old.jsonl", DOCS)
    new = _docs(tmp_path / "new.jsonl", DOCS[:20])
    state = _state_after(HuggingFaceTextDataset("before", old, CHAR, seq_len=8), 5)
    with caplog.at_level(logging.INFO):
        ds = HuggingFaceTextDataset("after", new, CHAR, seq_len=8)
        ds.load_state_dict(state)
        _first(ds)
    messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Data stream")]
    assert messages == [
        f"Data stream: the checkpoint read dataset before ({old}), this run reads after ({new}); "
        f"after starts at its beginning and gives the sequences from {state['position']} on"
    ]
    assert caplog.records[0].levelno == logging.WARNING


# --- data smaller than one sample ----------------------------------------------------------------
def test_a_dataset_shorter_than_one_sample_is_warned_once(tmp_path, caplog):
    """One two-word document re-looped hundreds of times within the first sample, said only
    as one INFO line per pass."""
    path = _docs(tmp_path / "tiny.jsonl", ["hi"])
    with caplog.at_level(logging.INFO):
        it = iter(HuggingFaceTextDataset("mine", path, CHAR, seq_len=64))
        next(it), next(it)
    assert _warnings(caplog) == [
        f"Dataset mine ({path}): a whole pass over its 1 documents gives 4 tokens (dp rank 0), "
        "fewer than one sample of 65 (training.seq_len + 1): each sample repeats the same text; "
        "train on more data"
    ]
    assert not any("re-looping" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO):  # enough data: passes are said once each, no warning
        it = iter(HuggingFaceTextDataset("mine", _docs(tmp_path / "ok.jsonl", DOCS), CHAR,
                                         seq_len=8))
        for _ in range(5000):
            next(it)
            if any("re-looping" in r.getMessage() for r in caplog.records):
                break
    assert _warnings(caplog) == []
    assert any("re-looping (epoch 1)" in r.getMessage() for r in caplog.records)
