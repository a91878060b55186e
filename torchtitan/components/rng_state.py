"""Every rank's RNG state in the checkpoint, for exact resume of any randomness on any rank.

Ranks' generators differ (pipeline stages are seeded ``seed + stage``; dropout or router noise
advance them differently), so each rank saves its own state. DCP keeps one copy of a key that
every rank saves (as if replicated), so the state goes under a rank-specific key,
``rng.rank<R>``, next to ``rng.layout`` (the parallel layout that wrote them).

A state is restored only on the layout that saved it (rank R gets ``rng.rank<R>``). On another
layout, or from a checkpoint without per-rank states, rank 0 logs one warning and every rank
keeps the generators ``set_determinism`` seeded at start-up.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.tools.logging import logger

RNG_KEY = "rng"
"""The key of :class:`RNGState` inside its owner's state dict (e.g. ``train_state.rng``)."""


class RNGState(Stateful):
    """This rank's CPU (and CUDA) generator states, saved under a rank-specific key.

    Args:
        rank: this process's global rank.
        layout: the parallel layout, e.g. ``repr(parallel_dims)``; states are restored only
            when the checkpoint's layout string equals it.
        cuda: also save the current CUDA device's generator.
    """

    def __init__(self, rank: int, layout: str, cuda: bool = False) -> None:
        self.rank = rank
        self.layout = layout
        self.cuda = cuda

    @property
    def rank_key(self) -> str:
        return f"rank{self.rank}"

    def state_dict(self) -> dict[str, Any]:
        mine = {"cpu": torch.get_rng_state()}
        if self.cuda:
            mine["cuda"] = torch.cuda.get_rng_state()
        return {"layout": self.layout, self.rank_key: mine}

    def load_state_dict(self, state_dict: dict[str, Any] | None) -> bool:
        """Restore this rank's generators; returns False (rank 0 warns) when it cannot."""
        state_dict = state_dict or {}
        saved_layout = state_dict.get("layout")
        mine = state_dict.get(self.rank_key)
        if saved_layout is None or mine is None:
            why = "the checkpoint has no per-rank RNG state for this layout"
        elif saved_layout != self.layout:
            why = f"it was saved under {saved_layout}, this run is {self.layout}"
        else:
            torch.set_rng_state(mine["cpu"])
            if self.cuda and "cuda" in mine:
                torch.cuda.set_rng_state(mine["cuda"])
            return True
        if self.rank == 0:
            logger.warning(
                f"Checkpoint: RNG states not restored ({why}); random streams continue from "
                "this run's seed"
            )
        return False
