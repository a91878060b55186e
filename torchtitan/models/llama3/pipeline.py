"""Llama's pipeline hook: the shared decoder split (torchtitan/distributed/parallelize.py);
``pipeline_llama`` is its older name."""

from __future__ import annotations

from torchtitan.distributed.parallelize import pipeline_decoder

pipeline_llama = pipeline_decoder

__all__ = ["pipeline_llama"]
