"""Llama's parallelization: the shared decoder composition with the default TP plan
(torchtitan/distributed/parallelize.py); ``parallelize_llama`` is its older name."""

from __future__ import annotations

from torchtitan.distributed.parallelize import parallelize_decoder

parallelize_llama = parallelize_decoder

__all__ = ["parallelize_llama"]
