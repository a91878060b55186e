"""Modules for ``--experimental.custom_import`` that wrap ``Trainer.train_step`` inside a trainer
run as a subprocess (a stall, a stop, a NaN on one rank, a loss printout).

``python -m torchtitan.train`` runs the trainer module as ``__main__`` (and ``torchtitan.train``
may be imported too), so the hook patches the Trainer class of both, once each.
"""

from __future__ import annotations

import textwrap


def train_step_hook(body: str, imports: str = "") -> str:
    """Source of a module that wraps ``Trainer.train_step``: ``body`` runs with ``self`` (the
    Trainer), ``data_iterator`` and ``_orig`` (the original method) and returns what the step
    returns, e.g. ``return _orig(self, data_iterator)``."""
    return (
        f"import sys\n{textwrap.dedent(imports)}\n"
        'for _mod in {sys.modules.get("__main__"), sys.modules.get("torchtitan.train")}:\n'
        '    _cls = getattr(_mod, "Trainer", None)\n'
        '    if _cls is None or getattr(_cls, "_test_hooked", False):\n'
        "        continue\n"
        "    def _train_step(self, data_iterator, _orig=_cls.train_step):\n"
        f"{textwrap.indent(textwrap.dedent(body).strip(), ' ' * 8)}\n"
        "    _cls.train_step = _train_step\n"
        "    _cls._test_hooked = True\n"
    )
