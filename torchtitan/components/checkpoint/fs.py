"""Checkpoint folder layout and bookkeeping: step folders, the commit marker, verification,
scanning, the atomic commit and purge candidates.

A checkpoint is written to ``step-N.tmp`` and becomes ``step-N`` only after every rank finished
writing: rank 0 then writes a commit marker (``.committed``, listing every file with its size and
CRC32) and renames the folder. A folder is *complete* when it is named ``step-N`` and either its
marker's file list matches the disk (sizes; the checksums are checked by ``integrity`` before a
load). A ``step-N`` with DCP's ``.metadata`` but no marker (another tool, or copied by hand) is
*unverified*: never picked automatically, loaded only when asked for by its step. A commit never
deletes a ``step-N`` the run did not write: an existing one is moved aside to
``step-N.superseded-<time>``; a rewind moves the newer ones to ``step-N.abandoned-<time>`` (both
outside the ``step-N`` pattern: never loaded, never purged). Everything here is plain
file-system work, safe without a process group.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

STEP_PREFIX = "step-"
TMP_SUFFIX = ".tmp"
COMMIT_MARKER = ".committed"
DCP_METADATA = ".metadata"
HF_SUBFOLDER = "hf"
FORMAT_VERSION = 2
"""2: the marker also records ``checksums`` (``crc32:<hex>`` per file)."""
CHECKSUM_SIDECAR = ".checksums."
"""``.checksums.<rank>``: the CRC32 of the data files one rank wrote (merged into the marker)."""
SUPERSEDED = ".superseded-"
ABANDONED = ".abandoned-"
UNVERIFIED = (
    f"it has no {COMMIT_MARKER} (written by another tool or copied by hand), so its file sizes "
    "and checksums cannot be checked"
)
DELETING_SUFFIX = ".deleting" + TMP_SUFFIX
"""A checkpoint being deleted is renamed ``step-N.deleting.tmp`` first (see
:func:`delete_checkpoint`); a leftover one is removed by the next purge."""
LEFTOVER_SUFFIXES = (f".replaced{TMP_SUFFIX}", DELETING_SUFFIX)

_STEP_RE = re.compile(r"^step-(\d+)(\.tmp)?$")


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint of ``step``: ``step-N``."""
    return f"{STEP_PREFIX}{step}"


def parse_step_dir(name: str) -> tuple[int, bool] | None:
    """``("step-12") -> (12, False)``, ``("step-12.tmp") -> (12, True)``; None for other names."""
    m = _STEP_RE.match(name)
    if m is None:
        return None
    return int(m.group(1)), m.group(2) is not None


@dataclass
class CheckpointEntry:
    """One ``step-N`` (or ``step-N.tmp``) folder and whether it can be loaded."""

    step: int
    path: str
    complete: bool
    reason: str = ""
    """Why it is not complete (empty when complete)."""
    marker: dict[str, Any] | None = None
    """The commit marker's content (None for foreign or incomplete checkpoints)."""
    unverified: bool = False
    """DCP's ``.metadata`` is there but no commit marker: loadable only when asked for."""


def file_checksum(path: str, chunk: int = 8 << 20) -> str:
    """``crc32:<8 hex digits>`` of a file (streamed; about 3 GB/s from the page cache)."""
    crc = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"crc32:{crc:08x}"


def write_checksum_sidecar(folder: str, rank: int, rel_paths: Iterable[str]) -> None:
    """Record the checksums of the files ``rank`` wrote into ``folder`` (called right after the
    write, in the writing thread: for async saves, off the training thread)."""
    sums = {rel: file_checksum(os.path.join(folder, rel)) for rel in sorted(set(rel_paths))}
    tmp = os.path.join(folder, f"{CHECKSUM_SIDECAR}{rank}.part")
    with open(tmp, "w") as f:
        json.dump(sums, f)
    os.replace(tmp, os.path.join(folder, f"{CHECKSUM_SIDECAR}{rank}"))


def _collect_checksums(root: str, files: Iterable[str]) -> dict[str, str]:
    """Checksums of ``files``: from the ranks' sidecars (removed), the rest computed here."""
    sums: dict[str, str] = {}
    for name in os.listdir(root):
        if name.startswith(CHECKSUM_SIDECAR) and not name.endswith(".part"):
            with open(os.path.join(root, name)) as f:
                sums.update(json.load(f))
            os.remove(os.path.join(root, name))
    return {rel: sums.get(rel) or file_checksum(os.path.join(root, rel)) for rel in files}


def _list_files(root: str) -> dict[str, int]:
    files: dict[str, int] = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if rel == COMMIT_MARKER or rel.startswith(CHECKSUM_SIDECAR):
                continue
            files[rel] = os.path.getsize(full)
    return files


def read_marker(path: str) -> dict[str, Any] | None:
    """The commit marker of checkpoint folder ``path``; None if absent or unreadable."""
    try:
        with open(os.path.join(path, COMMIT_MARKER)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def verify_checkpoint(path: str) -> tuple[str, dict[str, Any] | None]:
    """Check a ``step-N`` folder: returns ``(reason, marker)`` with ``reason == ""`` when complete.

    With a commit marker every listed file must exist with its recorded size; without one (a
    checkpoint from another tool) DCP's ``.metadata`` (written last by DCP) must be present.
    """
    if not os.path.isdir(path):
        return "not a folder", None
    marker_path = os.path.join(path, COMMIT_MARKER)
    if os.path.exists(marker_path):
        marker = read_marker(path)
        if marker is None or not isinstance(marker.get("files"), dict):
            return f"its commit marker {COMMIT_MARKER} is unreadable", None
        for rel, size in marker["files"].items():
            full = os.path.join(path, rel)
            if not os.path.exists(full):
                return f"file {rel} listed in {COMMIT_MARKER} is missing", marker
            actual = os.path.getsize(full)
            if actual != size:
                return f"file {rel} has {actual} bytes, {COMMIT_MARKER} says {size}", marker
        return "", marker
    if os.path.exists(os.path.join(path, DCP_METADATA)):
        return "", None
    return f"it has no {DCP_METADATA} and no {COMMIT_MARKER} (an interrupted or foreign write)", None


def scan_checkpoints(folder: str) -> list[CheckpointEntry]:
    """Every ``step-N``/``step-N.tmp`` folder in ``folder``, oldest first (tmp after final)."""
    if not os.path.isdir(folder):
        return []
    entries: list[CheckpointEntry] = []
    for name in os.listdir(folder):
        parsed = parse_step_dir(name)
        path = os.path.join(folder, name)
        if parsed is None or not os.path.isdir(path):
            continue
        step, is_tmp = parsed
        if is_tmp:
            entries.append(
                CheckpointEntry(step, path, False, "an unfinished write (never committed)")
            )
            continue
        reason, marker = verify_checkpoint(path)
        if not reason and marker is None:
            entries.append(CheckpointEntry(step, path, False, UNVERIFIED, None, unverified=True))
            continue
        entries.append(CheckpointEntry(step, path, reason == "", reason, marker))
    entries.sort(key=lambda e: (e.step, e.path.endswith(TMP_SUFFIX)))
    return entries


def complete_checkpoints(folder: str) -> list[CheckpointEntry]:
    """The complete checkpoints in ``folder``, oldest first."""
    return [e for e in scan_checkpoints(folder) if e.complete]


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def superseded_name(final_path: str, tag: str = SUPERSEDED) -> str:
    """A free ``step-N.superseded-<time>`` (or other ``tag``) name next to ``final_path``."""
    base = f"{final_path}{tag}{time.strftime('%Y%m%dT%H%M%S')}"
    name, n = base, 1
    while os.path.exists(name):
        n += 1
        name = f"{base}-{n}"
    return name


def check_output_folder(path: str, flag: str, checkpoint_ok: bool = False) -> None:
    """Raise ValueError unless ``path`` (a script's ``flag``, e.g. OUT_DIR) is new or an empty
    folder: files already there would mix with the new ones (a stale shard or index beside a new
    export is loaded as part of it). With ``checkpoint_ok`` a DCP checkpoint folder may be
    there (it is moved aside when the new one is committed, as a re-saved step is)."""
    if not os.path.exists(path):
        return
    if not os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a file, not a folder")
    entries = sorted(os.listdir(path))
    if not entries or (checkpoint_ok and DCP_METADATA in entries):
        return
    shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
    raise ValueError(
        f"{flag} {path} already holds files ({shown}), which would mix with the ones written "
        "now; give a new or empty folder"
    )


def _check_listed(tmp_path: str, files: dict[str, int]) -> None:
    """Raise OSError unless DCP's ``.metadata`` and every file the marker lists are in
    ``tmp_path`` with their sizes: never rename a folder whose marker names missing files (e.g.
    another process removed the shared ``step-N.tmp`` while it was committed)."""
    for rel in (DCP_METADATA, *files):
        full = os.path.join(tmp_path, rel)
        try:
            size = os.path.getsize(full)
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT, f"{rel} is gone before the commit (removed by another process?)", full
            ) from None
        if rel in files and size != files[rel]:
            why = f"{rel} changed size during the commit ({files[rel]} -> {size} bytes)"
            raise OSError(errno.ESTALE, why, full)


def commit_checkpoint(
    tmp_path: str, final_path: str, info: dict[str, Any], replace: bool = False
) -> str | None:
    """Write the commit marker into ``tmp_path`` and rename it to ``final_path`` (rank 0 only).

    Call only after every rank has finished writing. An existing ``final_path`` (the same step
    saved again) is replaced when ``replace`` (this run wrote it), else moved aside to
    ``step-N.superseded-<time>``; returns that name (None when nothing was moved).
    """
    marker = dict(info)
    marker["format_version"] = FORMAT_VERSION
    marker["committed_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    marker["files"] = _list_files(tmp_path)
    marker["checksums"] = _collect_checksums(tmp_path, marker["files"])
    marker_tmp = os.path.join(tmp_path, COMMIT_MARKER + ".part")
    with open(marker_tmp, "w") as f:
        json.dump(marker, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker_tmp, os.path.join(tmp_path, COMMIT_MARKER))
    _fsync_dir(tmp_path)
    _check_listed(tmp_path, marker["files"])
    aside = None
    if os.path.exists(final_path):
        # Re-saving a step: move the old copy aside first so the rename below is atomic.
        aside = f"{final_path}.replaced{TMP_SUFFIX}" if replace else superseded_name(final_path)
        if replace:
            shutil.rmtree(aside, ignore_errors=True)
        os.rename(final_path, aside)
        os.rename(tmp_path, final_path)
        if replace:
            shutil.rmtree(aside, ignore_errors=True)
            aside = None
    else:
        os.rename(tmp_path, final_path)
    _fsync_dir(os.path.dirname(final_path) or ".")
    return aside


def set_aside_newer(folder: str, step: int) -> list[tuple[str, str]]:
    """Rename every ``step-N`` of ``folder`` newer than ``step`` (a rewind's abandoned
    trajectory) to ``step-N.abandoned-<time>``; returns ``(old, new)`` paths. Nothing is deleted.
    Unfinished writes (``*.tmp``) are left to the purge."""
    moved = []
    for entry in scan_checkpoints(folder):
        if entry.step <= step or entry.path.endswith(TMP_SUFFIX):
            continue
        aside = superseded_name(entry.path, ABANDONED)
        try:
            os.rename(entry.path, aside)
        except FileNotFoundError:  # another replica group's rank 0 moved it first
            continue
        moved.append((entry.path, aside))
    if moved:
        _fsync_dir(folder)
    return moved


def delete_checkpoint(path: str) -> None:
    """Delete a checkpoint folder so that no interruption leaves a half-deleted ``step-N``
    that still looks committed: a committed one is renamed ``step-N.deleting.tmp`` first (an
    atomic rename), then removed. Unfinished writes (``*.tmp``) are removed directly."""
    doomed = path
    if not path.rstrip("/").endswith(TMP_SUFFIX):
        doomed = path.rstrip("/") + DELETING_SUFFIX
        shutil.rmtree(doomed, ignore_errors=True)  # a leftover of an earlier interrupted delete
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return
        _fsync_dir(os.path.dirname(doomed) or ".")
    shutil.rmtree(doomed, ignore_errors=True)


def purge_candidates(
    folder: str, keep_latest_k: int, protect: Iterable[str] = ()
) -> list[str]:
    """Folders to delete so that only the newest ``keep_latest_k`` complete checkpoints remain.

    Also lists leftover ``*.tmp`` folders (interrupted writes) except the protected ones (the
    checkpoints being written now). The newest complete checkpoint is never listed, nor any
    ``step-N`` that does not verify, nor a protected one (protected ones do not count toward
    the k). ``keep_latest_k <= 0`` keeps everything.
    """
    if keep_latest_k <= 0:
        return []
    protected = {os.path.abspath(p) for p in protect}
    entries = scan_checkpoints(folder)
    complete = [e for e in entries if e.complete and os.path.abspath(e.path) not in protected]
    doomed = [e.path for e in complete[:-keep_latest_k]]
    for e in entries:
        if e.path.endswith(TMP_SUFFIX) and os.path.abspath(e.path) not in protected:
            doomed.append(e.path)
    # leftovers of an interrupted replace or delete are *.tmp but not step-N.tmp: remove them too
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.endswith(LEFTOVER_SUFFIXES):
                doomed.append(os.path.join(folder, name))
    newest = complete[-1].path if complete else None
    return [p for p in doomed if p != newest and os.path.abspath(p) not in protected]
