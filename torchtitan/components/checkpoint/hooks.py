"""Save hooks: an injectable observer of the phases of a checkpoint save.

The CheckpointManager calls a ``SaveHooks`` object (``save_hooks=`` argument) at fixed points of
every save, synchronous or async. The default does nothing. Uses: fault injection in tests (a
hook that SIGKILLs the process at a chosen phase proves that an interrupted save never damages
the last complete checkpoint), timing, or mirroring committed checkpoints elsewhere.

When no object is passed, ``TORCHTITAN_CHECKPOINT_HOOKS=module:attr`` names one to import (a
debugging / fault-injection hook for runs started from the command line, see
docs/checkpoint.md); ``attr`` is a SaveHooks instance, or a class / factory called without
arguments to make one.
"""

from __future__ import annotations

import importlib
import os

from torchtitan.components.checkpoint.common import CheckpointError

HOOKS_ENV = "TORCHTITAN_CHECKPOINT_HOOKS"


class SaveHooks:
    """Phases of saving step ``step`` into ``path`` (the ``step-N.tmp`` folder); override any.

    Order within one save: ``data_written`` -> ``before_commit`` -> ``after_commit``. For async
    saves the first runs in DCP's background thread, the others when the manager finishes the
    save (before the next optimizer step, the next save, or at close).
    """

    def data_written(self, step: int, path: str) -> None:
        """Every rank's data files are written; DCP's ``.metadata`` is not yet (called once, on
        the rank that writes ``.metadata``: rank 0, or the only process)."""

    def before_commit(self, step: int, path: str) -> None:
        """All files, ``.metadata`` included, are on disk; rank 0 has not yet written
        ``.committed`` nor renamed the folder. Called on every rank."""

    def after_commit(self, step: int, path: str) -> None:
        """The checkpoint is committed as ``path`` (the final ``step-N`` folder). Rank 0 only."""


def hooks_from_env() -> SaveHooks | None:
    """The hooks named by ``TORCHTITAN_CHECKPOINT_HOOKS=module:attr``; None when it is unset."""
    spec = os.environ.get(HOOKS_ENV, "").strip()
    if not spec:
        return None
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CheckpointError(f"{HOOKS_ENV}={spec!r}: use module:attr (e.g. mypkg.hooks:HOOKS)")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise CheckpointError(f"{HOOKS_ENV}={spec!r}: cannot import it: {err}") from err
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "before_commit")):
        obj = obj()
    missing = [m for m in ("data_written", "before_commit", "after_commit") if not hasattr(obj, m)]
    if missing:
        raise CheckpointError(f"{HOOKS_ENV}={spec!r}: the object has no {', '.join(missing)} method")
    return obj
