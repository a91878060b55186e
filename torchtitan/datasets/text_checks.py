"""Bad data is one clear line, never a traceback or an endless loop.

Policy (docs/datasets.md):

* a document whose text is empty, whitespace-only or missing/null is **skipped**; the number
  skipped is logged after each pass over the data;
* a line that is not JSON, or a text that is not a string (a number, a list, an object), **stops
  the job** with the file, the line number and how many lines are bad: dropping such lines
  silently usually hides a broken export;
* a line that is not UTF-8 stops the job with the file and the line (HF reads such bytes
  without complaint and fails only when the text is used);
* a file that cannot be read (a ``.gz`` that is not gzip or is cut short) stops the job naming
  it;
* an empty file (no bytes, only whitespace, or a parquet file without rows), and a whole pass over the data that yields no token at all (every document
  empty: the loader would re-loop forever), stop the job naming the file.

The line scans run only on an error path (or when HF ``datasets`` inferred a non-string column),
so a good file is read once, by HF.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_JSON_LINES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
_MAX_LISTED = 5


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        import gzip

        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _records(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of the non-blank lines of a JSON-lines file."""
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, line


def _is_json_lines(path: Path) -> bool:
    if not path.name.lower().endswith(_JSON_LINES):
        return False
    with _open_text(path) as f:
        head = f.read(4096).lstrip()
    return not head.startswith("[")  # a single JSON array is not line-oriented


def _blank(path: Path) -> bool:
    """Nothing but whitespace in a text file (read until the first other byte)."""
    import gzip

    with (gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")) as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def check_not_empty(files: list[Path]) -> None:
    """Each file holds something: not 0 bytes, not only whitespace, a parquet file has rows."""
    for path in files:
        if path.stat().st_size == 0:
            raise ValueError(f"Dataset file {path} is empty (0 bytes): it holds no documents.")
        if path.name.lower().endswith(".parquet"):
            import pyarrow.parquet as pq

            try:
                rows = pq.ParquetFile(path).metadata.num_rows
            except Exception:  # noqa: BLE001 - not parquet: HF names the problem when loading
                continue
            if rows == 0:
                raise ValueError(f"Dataset file {path} has no rows: it holds no documents.")
            continue
        with _reading(path):
            blank = _blank(path)
        if blank:
            raise ValueError(f"Dataset file {path} holds only whitespace: it holds no documents.")


class Unreadable(ValueError):
    """A data file that cannot be read or decompressed (one line)."""


def unreadable(path: Path, err: BaseException) -> Unreadable:
    """A data file that cannot be read or decompressed, in one line."""
    hint = "; a .gz file must be whole and gzip-compressed (gzip -t checks it)" if (
        path.name.endswith(".gz")) else ""
    return Unreadable(f"Dataset file {path} cannot be read ({type(err).__name__}: {err}){hint}")


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    try:
        yield
    except (OSError, EOFError) as err:  # a .gz cut short, or not gzip at all
        raise unreadable(path, err) from None


def _not_utf8(files: list[Path]) -> list[str]:
    """Descriptions of the lines of text ``files`` that are not UTF-8."""
    import gzip

    bad: list[str] = []
    for path in files:
        if path.name.lower().endswith(".parquet"):
            continue
        with _reading(path), (
            gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")
        ) as f:
            for lineno, line in enumerate(f, 1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as err:
                    bad.append(
                        f"{path}:{lineno}: not UTF-8 (byte 0x{line[err.start]:02x} at column "
                        f"{err.start + 1})"
                    )
    return bad


def not_utf8_error(files: list[Path], err: UnicodeDecodeError | None = None) -> ValueError:
    """Text that failed to decode: the file and line in one line (``err`` when none is found)."""
    bad = _not_utf8(files)
    if not bad:
        return ValueError(f"Dataset files {', '.join(map(str, files))} are not UTF-8 text ({err})")
    more = f"; {len(bad)} lines are not UTF-8 in all" if len(bad) > 1 else ""
    return ValueError(
        f"Dataset {bad[0]}{more}. Save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)."
    )


def _scan(files: list[Path], column: str) -> tuple[list[str], list[str]]:
    """Descriptions of the lines that are not JSON, and of those whose ``column`` is not text."""
    not_json: list[str] = []
    not_text: list[str] = []
    for path in files:
        with _reading(path):
            _scan_file(path, column, not_json, not_text)
    return not_json, not_text


def _scan_file(path: Path, column: str, not_json: list[str], not_text: list[str]) -> None:
    if _is_json_lines(path):
        for lineno, line in _records(path):
            try:
                value = json.loads(line)
            except ValueError as err:
                not_json.append(f"{path}:{lineno}: not valid JSON ({err})")
                continue
            if not isinstance(value, dict):  # a JSON lines row is an object of columns
                shown = line.strip()
                shown = shown if len(shown) <= 40 else shown[:37] + "..."
                not_text.append(f"{path}:{lineno}: the row is a JSON {type(value).__name__} "
                                f"{shown}, not an object with a {column!r} field")
                continue
            text = value.get(column)
            if text is not None and not isinstance(text, str):
                shown = json.dumps(text)
                shown = shown if len(shown) <= 40 else shown[:37] + "..."
                not_text.append(f"{path}:{lineno}: {column!r} is {type(text).__name__} {shown}, not a string")


def _summary(bad: list[str], what: str) -> str:
    first = bad[0]
    more = f"; {len(bad)} lines are {what} in all" if len(bad) > 1 else ""
    them = "them" if len(bad) > 1 else "it"
    return f"{first}{more}. Fix or remove {them} (bad lines are never skipped silently)."


def explain_load_failure(files: list[Path], column: str, err: BaseException) -> ValueError:
    """HF ``datasets`` failed to read local ``files``: the bad line, in one line."""
    try:
        if _not_utf8(files):
            return not_utf8_error(files)
        not_json, not_text = _scan(files, column)
    except Unreadable as unread:
        return unread
    if not_json:
        return ValueError(f"Dataset {_summary(not_json, 'not JSON')}")
    if not_text:
        return ValueError(f"Dataset {_summary(not_text, 'not text')}")
    lines = str(err).strip().splitlines()
    cause = err.__cause__ or err.__context__
    detail = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
    return ValueError(
        f"Dataset files {', '.join(map(str, files))} could not be read: "
        f"{type(err).__name__}: {lines[0] if lines else ''}" + (f" ({detail})" if detail else "")
    )


def check_text_feature(ds: Any, files: list[Path] | None, column: str, name: str) -> None:
    """Stop when HF inferred a non-string ``column`` (numbers, mixed types), naming the line."""
    features = getattr(ds, "features", None)
    if not features or column not in features:
        return
    feature = features[column]
    if getattr(feature, "dtype", None) in ("string", "large_string"):
        return
    if files:
        _, not_text = _scan(files, column)
        if not_text:
            raise ValueError(f"Dataset {_summary(not_text, 'not text')}")
    raise ValueError(
        f"Dataset {name}: column {column!r} holds {feature}, not strings; each document's text "
        f"must be a string."
    )


def bad_document(name: str, index: int, column: str, text: Any) -> ValueError:
    """A document (number ``index`` of this rank's pass) whose text is not a string."""
    shown = repr(text)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return ValueError(
        f"Dataset {name}: document {index} of this rank's shard has {column!r} = {shown} "
        f"({type(text).__name__}), not a string; fix or remove it (bad lines are never skipped "
        "silently)."
    )


def empty_pass(name: str, source: str, docs: int, dp_rank: int) -> ValueError:
    return ValueError(
        f"Dataset {name} ({source}): a whole pass over the {docs} documents of dp rank "
        f"{dp_rank} gave no tokens (every text is empty, whitespace or missing); the loader "
        "would re-loop forever. Check the file and its text column."
    )
