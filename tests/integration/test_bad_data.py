"""Bad data stops the trainer with one clear line (file and line number), never a traceback or
an endless loop: a dataset whose documents are all empty, an empty file, a line that is not
JSON, a text that is a number, a garbage ``tokenizer.json``. Empty/missing texts among good ones
are skipped and counted (the stated policy). The real trainer, in-process
(``torchtitan.train.main``); an alarm turns a hang into a failure.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import re
import signal
from pathlib import Path

import pytest

from torchtitan.train import main

FLAGS = [
    "--job.config_file", "./train_configs/debug_model.toml",
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "16",
    "--training.local_batch_size", "2",
    "--training.steps", "2",
    "--activation_checkpoint.mode", "none",
    "--metrics.log_freq", "1",
]


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: int):
    def fire(signum, frame):  # noqa: ARG001
        raise _Hang(f"still running after {seconds} s (an endless loop?)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))


def run(tmp_path: Path, *flags: str) -> tuple[int, list[tuple[int, str]]]:
    log = _Log()
    loggers = [logging.getLogger("torchtitan"), logging.getLogger("torchtitan.datasets.hf_datasets")]
    for lg in loggers:
        lg.addHandler(log)
    try:
        with _deadline(60):
            code = main([*FLAGS, "--job.dump_folder", str(tmp_path / "out"), *flags])
    finally:
        for lg in loggers:
            lg.removeHandler(log)
        gc.enable()
    return code, log.lines


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


CASES = {
    "all_empty": (
        ['{"text": ""}'] * 50,
        r"\(.*e\.jsonl\): a whole pass over the 50 documents of dp rank 0 gave no tokens",
    ),
    "empty_file": ([], r"Dataset file .*e\.jsonl is empty \(0 bytes\)"),
    "not_json": (
        ['{"text": "hello"}', '{"text": "world"}', "not json", '{"text": "x"}', "{oops"],
        r"e\.jsonl:3: not valid JSON \(.*\); 2 lines are not JSON in all\. Fix or remove them",
    ),
    "number": (['{"text": "hello world"}', '{"text": 12345}'], r"e\.jsonl:2: 'text' is int 12345, not a string"),
    "row_not_object": (['{"text": "hello world"}', "[1, 2]"],
                       r"e\.jsonl:2: the row is a JSON list \[1, 2\], not an object with a 'text' field"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_dataset_is_one_clear_line(tmp_path, case):
    lines, pattern = CASES[case]
    path = tmp_path / "e.jsonl"
    if lines:
        _write(path, lines)
    else:
        path.write_bytes(b"")
    code, log = run(tmp_path, "--training.dataset_path", str(path))
    errors = [m for level, m in log if level >= logging.ERROR]
    assert code == 2, log[-5:]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert re.search(pattern, errors[0]), errors[0]


def test_empty_texts_among_good_ones_are_skipped_and_counted(tmp_path):
    good = '{"text": "the quick brown fox jumps over the lazy dog again and again"}'
    path = _write(tmp_path / "mixed.jsonl", [good, '{"text": ""}', '{"text": null}', '{"other": 1}', good])
    code, log = run(tmp_path, "--training.dataset_path", str(path))
    assert code == 0
    skipped = [m for _, m in log if "skipped" in m]
    assert skipped and "skipped 3 empty or missing texts of 5" in skipped[0], skipped


@pytest.mark.parametrize(
    "content, pattern",
    [
        ("garbage{", r"not a HF tokenizer\.json: not valid JSON at line 1, column 1"),
        ('{"version": "1.0"}', r"is JSON but not a HF tokenizer\.json \(it has no 'model' entry\)"),
    ],
)
def test_garbage_tokenizer_json_is_one_line(tmp_path, content, pattern):
    pytest.importorskip("tokenizers")
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(content)
    code, log = run(tmp_path, "--model.hf_assets_path", str(folder))
    errors = [m for level, m in log if level >= logging.ERROR]
    assert code == 2 and len(errors) == 1, log[-5:]
    assert re.search(pattern, errors[0]), errors[0]
