"""A rank's one-line error, written to torchrun's per-rank error file.

torchrun gives each rank ``TORCHELASTIC_ERROR_FILE``; its failure summary reads the file, and
``torchtitan.launch`` prints the first such line when the console did not show it (the rank is
not in ``LOG_RANK``). Kept free of heavy imports: any module may report through it.
"""

from __future__ import annotations

import json
import os
import time

__all__ = ["TRAINER_MARK", "record_error"]

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
