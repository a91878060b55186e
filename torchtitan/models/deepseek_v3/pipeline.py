"""Pipeline hook for DeepSeek-V3 (``ModelSpec.pipelining_fn``): the Llama pipeline helpers
apply unchanged, since the module layout (``tok_embeddings / layers / norm / output``) is the
same; MoE and dense blocks are split like any other block."""

from __future__ import annotations

from torchtitan.models.llama3.pipeline import pipeline_llama

pipeline_deepseekv3 = pipeline_llama

__all__ = ["pipeline_deepseekv3"]
