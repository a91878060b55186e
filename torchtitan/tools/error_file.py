"""A rank's one-line error, written to torchrun's per-rank error file.

torchrun gives each rank ``TORCHELASTIC_ERROR_FILE``; its failure summary reads the file, and
``torchtitan.launch`` prints the first such line when the console did not show it (the rank is
not in ``LOG_RANK``). Kept free of heavy imports at module level: any module may report
through it. Also the entry point's classification of failures (out of memory, a peer gone).
"""

from __future__ import annotations

import json
import os
import time

__all__ = [
    "TRAINER_MARK", "host_out_of_memory_message", "is_out_of_memory", "is_peer_failure",
    "out_of_memory_message", "record_error", "report_error",
]

TRAINER_MARK = "torchtitan"
"""Key of the trainer's own entry in a rank's error file."""


def record_error(message: str, exit_code: int) -> None:
    """Write ``message`` (one line) and ``exit_code`` to this rank's error file, if any."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": message,
        "timestamp": int(time.time()),
        TRAINER_MARK: {"exitcode": exit_code, "time": time.time()},
    }
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the rank's own log still has the line


def report_error(err: BaseException | str, code: int) -> int:
    """Log ``err`` as one ``error:`` line, record it for torchrun, and return ``code``."""
    from torchtitan.tools.logging import logger

    message = " ".join(str(err).split())
    logger.error(f"error: {message}")
    record_error(message, code)
    return code


def is_out_of_memory(err: BaseException) -> bool:
    """torch's CUDA OOM, or the CPU allocator failing (e.g. a large COMM_MODE=local_tensor)."""
    import torch

    return isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err)


def out_of_memory_message(err: BaseException, argv: list[str], world_size: int) -> str:
    """The error line of an out-of-memory failure: torch's first line, what to change, and the
    command that shows this config's predicted peak per rank, part by part."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    return f"out of memory ({first}); {_what_to_change(argv, world_size)}"


def host_out_of_memory_message(argv: list[str] | None, world_size: int | None) -> str:
    """The launcher's line for a rank that the kernel's out-of-memory killer stopped; what to
    change when the rank ran the trainer with flags ``argv``."""
    what = "killed by the kernel's out-of-memory killer (SIGKILL): the ranks ran out of host memory"
    return what if argv is None else f"{what}; {_what_to_change(argv, world_size)}"


def _what_to_change(argv: list[str], world_size: int | None) -> str:
    import shlex

    estimate = shlex.join(["python", "scripts/estimate_memory.py", "--world-size",
                           str(world_size or 1), *argv])
    return ("lower training.local_batch_size or training.seq_len, turn on activation "
            "checkpointing, or spread the model over more ranks; "
            f"`{estimate}` shows this config's peak per rank by part")


def is_peer_failure(err: BaseException) -> bool:
    """A collective failed because another rank went away (it reports its own error)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    text = str(err)
    return isinstance(err, dist.DistError) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
    )
