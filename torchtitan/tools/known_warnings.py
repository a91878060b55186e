"""torch warnings that are known to be harmless for torchtitan's plans: explained once, not
repeated on every run.

:func:`install` (called by the trainer) replaces each such warning by one ``INFO`` line saying
why it does not matter here, the first time it fires in the process; later ones are dropped.
Any other warning is shown as usual.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable
from typing import Any

from torchtitan.tools.logging import logger

__all__ = ["KNOWN", "explain", "explaining", "install"]

KNOWN: dict[str, str] = {
    r"DTensor random operators may not have complete support on cpu device mesh": (
        "torch warns that DTensor random ops are not fully supported on CPU meshes: DTensor's "
        "RNG tracker is CUDA-only, so on CPU each rank fills its own parameter shards from its "
        "(same-seeded) generator. Training is unaffected; initial weights depend on the layout, "
        "so compare layouts from a seed checkpoint (docs/debugging.md)"
    ),
    r"FSDP2-wrapped module \(.*\) returned a view tensor": (
        "torch warns that an FSDP-wrapped module returned a view (the TP-sharded embedding "
        "does, and so do the experts' all-to-all under fake-tensor dry runs): only an in-place op on that output would lose FSDP's pre-backward hook, and the "
        "model applies none (h = h + ..., never h += ...)"
    ),
    r"While redistributing from .* sequential \w+ operations will be performed": (
        "torch notes that a DTensor on two mesh dims (e.g. the grad norm under FSDP x TP) is "
        "reduced one dim after the other: correct, slightly slower, done once per step"
    ),
    r"Failed to load .*torchao.*\.so": (
        "torchao could not load its CUDA kernel libraries (CUDA-built wheel on a machine "
        "without that CUDA): the float8 / MX converters use torch ops and Triton, not these"
    ),
    r"Torchinductor does not support code generation for complex operators": (
        "inductor leaves ops on complex tensors out of its generated code; in torchtitan's "
        "models that is only the view of the RoPE table as cos/sin (a few KB per block): q "
        "and k are rotated in real arithmetic, which inductor fuses"
    ),
    r"is an Enum subclass and is now natively supported by torch.compile": (
        "torchao 0.18 registers its enums with an older torch API that torch now deprecates; "
        "harmless"
    ),
}
"""Message pattern (regex, searched) -> why it is harmless here."""

_explained: set[str] = set()


def explain(message: str) -> bool:
    """True when ``message`` is a known warning (explained at its first sighting)."""
    for pattern, why in KNOWN.items():
        if re.search(pattern, message):
            if pattern not in _explained:
                _explained.add(pattern)
                logger.info(f"known torch warning: {why}")
            return True
    return False


class _LogFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not explain(record.getMessage())


_installed = False


def install() -> None:
    """Route Python warnings and torch's DTensor log records through :func:`explain`."""
    global _installed
    if _installed:
        return
    _installed = True
    warnings.showwarning = explaining(warnings.showwarning)
    for name in ("torch.distributed.tensor._redistribute", "torchao", "torch.utils._pytree"):
        logging.getLogger(name).addFilter(_LogFilter())


def explaining(show: Callable[..., None]) -> Callable[..., None]:
    """A ``warnings.showwarning`` that explains known warnings and passes others to ``show``."""

    def showwarning(message: Any, category: type, filename: str, lineno: int, *args: Any) -> None:
        if not explain(str(message)):
            show(message, category, filename, lineno, *args)

    return showwarning
