"""COMM_MODE: how a run reaches its ranks, chosen from the environment.

Unset: a real run (torchrun, or one process). ``COMM_MODE=fake_backend`` and
``COMM_MODE=local_tensor`` are dry runs in one process, no torchrun, no GPU (see their
modules). Each is a :class:`CommMode`: the trainer and ``build_run`` call its seams.
"""

from __future__ import annotations

import os

from torchtitan.distributed.comm_mode.base import CommMode
from torchtitan.distributed.comm_mode.fake_backend import FakeBackend, init_fake_process_group
from torchtitan.distributed.comm_mode.local_tensor import LocalTensorSim

__all__ = [
    "COMM_MODES",
    "CommMode",
    "FakeBackend",
    "LocalTensorSim",
    "comm_mode_from_env",
    "get_comm_mode",
    "init_fake_process_group",
]

COMM_MODES: dict[str, type[CommMode]] = {"fake_backend": FakeBackend, "local_tensor": LocalTensorSim}


def get_comm_mode() -> str | None:
    """The ``COMM_MODE`` environment variable (None when unset or empty)."""
    mode = os.environ.get("COMM_MODE", "").strip()
    if not mode:
        return None
    if mode not in COMM_MODES:
        raise ValueError(
            f"COMM_MODE={mode!r} is not a comm mode; use fake_backend or local_tensor, or unset it"
        )
    return mode


def comm_mode_from_env(world_size: int) -> CommMode:
    """The run's CommMode: a real run unless ``COMM_MODE`` names a dry run (RANK picks the
    rank a fake_backend run plays)."""
    mode = get_comm_mode()
    from torchtitan.distributed.utils import env_int

    rank = env_int("RANK", 0)
    if mode is None:
        return CommMode(world_size, rank)
    return COMM_MODES[mode](world_size, rank)
