"""torch.compile applied per transformer block (the repeated structure compiles once)."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.config.job_config import Compile
from torchtitan.tools.logging import logger

COMPILE_COMPONENTS = ("model", "loss")


_shared_cache_dir: str | None = None


def isolate_compile_cache(rank: int, world_size: int) -> str | None:
    """Give this rank its own subfolder of inductor's cache (``TORCHINDUCTOR_CACHE_DIR``, or
    inductor's default) when several ranks run; returns the folder chosen, None for one rank.

    Inductor's FX-graph and AOTAutograd caches key a compiled graph by its code and inputs, not
    by the rank. Ranks on the same device type (every CPU rank, or GPUs that each see only
    "cuda:0") trace graphs that look alike but bake rank-dependent values in (loss parallel's
    vocabulary offset of this TP rank), so a rank could load another rank's graph: measured on
    CPU, TP2 with the compiled loss logged 2.71 instead of 8.19 on a second run. One folder
    per rank keeps every rank on its own graphs.
    """
    import os

    if world_size <= 1:
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    global _shared_cache_dir
    if _shared_cache_dir is None:  # a process may build several runs (tests): nest once
        _shared_cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    folder = os.path.join(_shared_cache_dir, f"rank{rank}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


def validate_compile_components(cfg: Compile) -> None:
    """Raise ValueError for an unknown entry of ``compile.components``, or for
    ``compile.enable`` with no component (it would compile nothing). Part of the plan."""
    unknown = [c for c in cfg.components if c not in COMPILE_COMPONENTS]
    if unknown:
        raise ValueError(
            f"compile.components has unknown entries {unknown}; use any of {list(COMPILE_COMPONENTS)}"
        )
    if cfg.enable and not cfg.components:
        raise ValueError(
            "compile.enable compiles nothing: compile.components is empty; name what to compile "
            f"(--compile.components {','.join(COMPILE_COMPONENTS)}) or drop --compile.enable"
        )


def check_compile_backend(cfg: Compile) -> None:
    """Raise ValueError when ``compile.enable`` names a ``compile.backend`` torch.compile does
    not know (after ``experimental.custom_import``, which may register one). Part of the plan."""
    if not cfg.enable:
        return
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.exc import InvalidBackend

    try:
        lookup_backend(cfg.backend)
    except InvalidBackend:
        raise ValueError(
            f"compile.backend={cfg.backend!r} is not a torch.compile backend: use inductor (the "
            "default), aot_eager or eager, another name torch._dynamo.list_backends() lists, or "
            "one registered by experimental.custom_import"
        ) from None


def model_compile_enabled(cfg: Compile) -> bool:
    """True when ``compile.enable`` is set and ``compile.components`` includes ``model``."""
    validate_compile_components(cfg)
    return cfg.enable and "model" in cfg.components


def apply_compile(model: nn.Module, cfg: Compile) -> nn.Module:
    """Replace every block of ``model.layers`` by ``torch.compile(block, fullgraph=True)``
    (``fullgraph=False`` for blocks with an MoE layer: in float32 its experts run a per-expert
    loop whose split sizes are data-dependent, a graph break).

    Apply after AC and before FSDP, so FSDP's hooks stay outside the compiled graphs. A block
    that full / every-Nth-block AC recomputes whole keeps its checkpoint wrapper outside and
    has its inside compiled: recomputing the compiled block is the same work, and a compiled
    checkpoint region under tensor parallel fails in torch 2.13 (it saves a DeviceMesh for
    backward). Op-level SAC is compiled with its block (its policy acts on the traced ops).
    The compiled wrapper adds ``_orig_mod.`` to raw ``named_parameters()`` / ``state_dict()``
    keys; ``torch.distributed.checkpoint.state_dict`` (which checkpointing uses) strips it.
    """
    from torchtitan.models.common.moe import MoE

    layers: nn.ModuleDict = model.layers
    for layer_id, block in list(layers.items()):
        if block is None:
            continue
        fullgraph = not any(isinstance(m, MoE) for m in block.modules())
        if getattr(block, "recomputes_whole_block", False):
            # in place (no ``_orig_mod`` level): the wrapper's state-dict hooks keep FQNs
            block._checkpoint_wrapped_module.compile(backend=cfg.backend, fullgraph=fullgraph)
        else:
            layers[layer_id] = torch.compile(block, backend=cfg.backend, fullgraph=fullgraph)
    logger.info(f"Compiled {len(layers)} transformer blocks with torch.compile ({cfg.backend})")
    return model
