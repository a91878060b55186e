"""Content checks of a checkpoint before it is loaded, and one-line reports of failed saves.

``.committed`` records the CRC32 of every file (fs.py). Before a checkpoint is loaded every rank
re-reads a share of its files (rank r checks files r, r + world, ...) and the ranks agree on the
result, so a flipped byte, a truncated-then-padded file or a corrupt header is found before DCP
or the training loop ever sees it. ``describe_save_failure`` turns DCP's many-line
``CheckpointException`` (which derives from ``BaseException``) into one line naming the path
and the OS error.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import torch.distributed as dist

from torchtitan.components.checkpoint import fs
from torchtitan.components.checkpoint.common import rank, world_size

_ERRNO_WORDS = {
    errno.ENOSPC: "no space left on the device (disk full)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "I/O error",
}


def content_problem(path: str, files: list[str] | None = None) -> str:
    """The first file of checkpoint ``path`` whose CRC32 differs from its commit marker ("" when
    all match, the marker records none, or the checkpoint has no marker). ``files``: only these."""
    marker = fs.read_marker(path)
    sums = (marker or {}).get("checksums")
    if not isinstance(sums, dict):
        return ""
    for rel in sorted(sums) if files is None else files:
        want = sums.get(rel)
        full = os.path.join(path, rel)
        if want is None:
            continue
        try:
            have = fs.file_checksum(full)
        except OSError as err:
            return f"file {rel} cannot be read ({err.strerror or err})"
        if have != want:
            return f"file {rel} has checksum {have}, {fs.COMMIT_MARKER} says {want} (its content changed)"
    return ""


def verify_content(path: str) -> str:
    """``content_problem`` computed by all ranks together (each reads a share of the files);
    every rank gets the same answer. Call on every rank, or without a process group."""
    marker = fs.read_marker(path)
    sums = (marker or {}).get("checksums")
    if not isinstance(sums, dict):
        return ""
    names = sorted(sums)
    ws = world_size() if dist.is_initialized() else 1
    mine = names[rank() :: ws] if ws > 1 else names
    problem = content_problem(path, mine)
    if ws == 1:
        return problem
    problems: list[Any] = [None] * ws
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), "")


def root_os_error(err: BaseException) -> OSError | None:
    """The OSError behind ``err``: DCP's per-rank failures, causes and contexts included."""
    seen: set[int] = set()
    todo: list[Any] = [err]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for item in failures.values():
                todo.append(item[0] if isinstance(item, tuple) else item)
        todo += [e.__cause__, e.__context__]
    return None


def first_line(err: BaseException) -> str:
    """A one-line summary of ``err`` (DCP's CheckpointException: its first rank's error)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        r, item = next(iter(failures.items()))
        inner = item[0] if isinstance(item, tuple) else item
        if isinstance(inner, BaseException):
            return f"rank {r}: {first_line(inner)}"
    text = str(err).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(err).__name__}: {line}" if line else type(err).__name__


def describe_os_error(err: OSError) -> str:
    words = _ERRNO_WORDS.get(err.errno or 0, err.strerror or os.strerror(err.errno or 0))
    where = f" ({err.filename})" if err.filename else ""
    return f"{words}{where} [errno {errno.errorcode.get(err.errno or 0, err.errno)}]"


def describe_save_failure(step: int, tmp: str, err: BaseException, intact: list[int]) -> str:
    """One line: what failed, where, why, and which older checkpoints are intact."""
    oserr = root_os_error(err)
    why = describe_os_error(oserr) if oserr is not None else first_line(err)
    kept = ", ".join(fs.step_dir_name(s) for s in intact) if intact else "none (nothing was saved before)"
    return (
        f"saving checkpoint step-{step} to {tmp} failed: {why}; the partial write was removed "
        f"and no older checkpoint was touched (intact: {kept})"
    )


def is_fatal_interrupt(err: BaseException) -> bool:
    """Errors a save must not swallow (Ctrl-C, sys.exit)."""
    return isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit))
