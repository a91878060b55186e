"""Which SDPA kernel a run's attention uses (``model.attention_backend``).

Forced (``flash``, ``cudnn``, ``efficient``, ``math``): every SDPA call of the model runs under
``sdpa_kernel([that])`` (``document_mask.attend``), with no fallback. The plan refuses what the
config shows the device cannot run (:func:`check_attention_backend`); the build runs the kernel
once on this run's attention shape and refuses it in one line if it fails or disagrees with the
math kernel.

``auto``: on CUDA, once per process at build time, each fused kernel (cuDNN, flash, efficient,
and compiled FlexAttention where the config leaves ``use_flex_attn`` unset and context parallel
is off) runs forward+backward on random inputs of the per-rank attention shape
(:func:`run_attention_shape`), is checked against the math kernel (:func:`check_kernel`) and
timed with CUDA events; the fastest correct one is kept (the same on every rank: times are
max-reduced over the ranks) and named in one info line. Elsewhere ``auto`` is PyTorch's own
choice, untouched. The choice reaches the model as the ``sdpa_backend`` attribute of its
attention modules (:func:`set_attention_backend`); FlexAttention as ``use_flex_attn`` on the
model args, set before the model is built.

The timer, the candidates and the cross-rank reduction can be injected (tests).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend

from torchtitan.models.common.document_mask import attend, flex_supported, uses_attention_mask
from torchtitan.tools.attention_kernel_trial import (
    AttentionShape,
    Kernel,
    Outcome,
    Timer,
    check_kernel,
    cuda_event_timer,
    evaluate,
    sdpa_kernel_fn,
)
from torchtitan.tools.logging import logger

__all__ = [
    "AUTO_CANDIDATES",
    "BACKENDS",
    "AttentionShape",
    "Outcome",
    "Selection",
    "check_attention_backend",
    "check_kernel",
    "cuda_event_timer",
    "evaluate",
    "resolve_attention_backend",
    "run_attention_shape",
    "sdpa_kernel_fn",
    "select_kernel",
    "set_attention_backend",
]

BACKENDS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
AUTO_CANDIDATES = ("cudnn", "flash", "efficient")
"""What ``auto`` times on CUDA (math is the reference, never the fastest at training shapes)."""
FLEX = "flex"
"""``auto``'s name for compiled FlexAttention (a causal ``BlockMask`` of the shape)."""
CPU_BACKENDS = ("flash", "math")
"""The SDPA kernels PyTorch has for the CPU."""

def run_attention_shape(cfg: Any, parallel_dims: Any, model_args: Any) -> AttentionShape:
    """The attention shape of one rank of this run: batch = local batch / pipeline
    microbatches, heads / tp, seq_len / cp (keys: the whole sequence on context parallel's
    masked path), the widest head dim (DeepSeek pads to it), the compute dtype."""
    from torchtitan.distributed.fsdp import to_torch_dtype
    from torchtitan.distributed.mixed_precision import compute_dtype

    batch = cfg.training.local_batch_size
    if parallel_dims.pp_enabled:
        from torchtitan.distributed.pipeline import n_microbatches_for

        batch //= n_microbatches_for(cfg.parallelism, batch)
    tp, cp, seq = parallel_dims.tp, parallel_dims.cp, cfg.training.seq_len
    masked = uses_attention_mask(model_args)
    sinks = bool(getattr(model_args, "attention_sinks", False))
    dtype = to_torch_dtype(compute_dtype(cfg.training, parallel_dims), "training.dtype")
    return AttentionShape(
        batch=batch, heads=model_args.n_heads // tp,
        kv_heads=model_args.effective_n_kv_heads // tp, q_len=seq // cp,
        kv_len=seq if masked and cp > 1 else seq // cp,
        head_dim=max(model_args.attention_head_dims), dtype=dtype, masked=masked or sinks,
        mask_rows=batch if model_args.attn_mask_type == "block_causal" else 1, sinks=sinks,
    )


def check_attention_backend(backend: str, model_args: Any, *, compute_dtype: str, cp: int,
                            device_type: str | None) -> None:
    """The plan's rule: ValueError (one line) for a forced kernel that the config shows cannot
    run; ``device_type`` None (a config checked for another machine) skips the device rules."""
    if backend == "auto":
        return
    key = f"model.attention_backend={backend}"
    masked = uses_attention_mask(model_args)
    if getattr(model_args, "use_flex_attn", False):
        raise ValueError(f"{key} picks the SDPA kernel, and model.use_flex_attn runs "
                         "FlexAttention instead: unset one of them")
    if backend == "math" and cp > 1 and not masked:
        raise ValueError(f"{key}: context parallel's ring attention merges the outputs of the "
                         "flash, efficient or cudnn kernels, not math's: use auto or flash")
    if backend == "flash" and getattr(model_args, "attention_sinks", False):
        raise ValueError(f"{key} cannot run attention sinks (their SDPA keys are one dimension "
                         "wider than the values): use auto or math")
    if device_type is None:
        return
    if device_type != "cuda":
        if backend not in CPU_BACKENDS:
            raise ValueError(f"{key} needs a CUDA GPU, and this run's device is "
                             f"{device_type}: use auto, flash or math")
        return
    if backend in ("flash", "cudnn") and compute_dtype == "float32":
        raise ValueError(f"{key} runs in bfloat16 or float16 only, and this run computes in "
                         "float32 (training.mixed_precision_param / training.dtype): use auto, "
                         "efficient or math")
    if backend == "flash" and masked:
        raise ValueError(f"{key} takes no attention mask, and this model's attention has one "
                         "(attn_mask_type block_causal or a sliding window): use auto, cudnn, "
                         "efficient or math")


def flex_kernel_fn(device: torch.device) -> Kernel:
    """The model's FlexAttention path (compiled on CUDA) with a causal ``BlockMask`` per shape."""
    from torchtitan.models.common.document_mask import block_mask, mask_mod

    masks: dict[tuple[int, int], Any] = {}

    def kernel(q, k, v, mask=None, n_rep=1, sinks=None):
        key = (q.shape[2], k.shape[2])
        if key not in masks:
            masks[key] = block_mask(mask_mod(None, None), None, *key, device,
                                    compiled=device.type == "cuda")
        return attend(q, k, v, masks[key], n_rep=n_rep, sinks=sinks)

    return kernel


def flex_is_candidate(cfg: Any, parallel_dims: Any, device: torch.device) -> bool:
    """``auto`` also times FlexAttention: on CUDA, ``model.use_flex_attn`` left to the flavor
    (not set either way) and no context parallel (its causal path is ring attention)."""
    return (device.type == "cuda" and flex_supported(device)
            and cfg.model.use_flex_attn is None and parallel_dims.cp == 1)


def _default_timer(name: str, fn: Callable[[], Any]) -> float:
    return cuda_event_timer(fn)


def _max_over_ranks(times: list[float]) -> list[float]:
    """Each kernel's slowest rank (inf: failed somewhere), so every rank picks the same."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return times
    t = torch.tensor(times, dtype=torch.float64,
                     device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


@dataclass
class Selection:
    """What ``auto`` measured and chose (``chosen`` None: no kernel passed)."""

    shape: AttentionShape
    outcomes: list[Outcome]
    chosen: str | None

    def log_line(self) -> str:
        """The one info line naming the kernel, the shape and every candidate's time."""
        others = [o.describe() for o in self.outcomes if o.name != self.chosen]
        if self.chosen is None:
            head = f"PyTorch's choice for {self.shape.label()} (no SDPA kernel passed: "
            detail = ", ".join(others)
        else:
            best = next(o for o in self.outcomes if o.name == self.chosen)
            kind = "FlexAttention (compiled)" if self.chosen == FLEX else f"SDPA {self.chosen}"
            head = f"{kind} for {self.shape.label()} (fwd+bwd {best.ms:.2f} ms"
            detail = "; " + ", ".join(others) if others else ""
        return f"attention kernel: {head}{detail}); override with --model.attention_backend"


def select_kernel(shape: AttentionShape, device: torch.device,
                  candidates: Mapping[str, Kernel] | None = None, timer: Timer | None = None,
                  reduce: Callable[[list[float]], list[float]] | None = None) -> Selection:
    """Check and time every candidate (default: :data:`AUTO_CANDIDATES` as the model runs
    them, CUDA events), keep the fastest correct one. ``reduce`` agrees over ranks (default:
    max over the default process group)."""
    if candidates is None:
        candidates = {name: sdpa_kernel_fn(BACKENDS[name]) for name in AUTO_CANDIDATES}
    timer = timer or _default_timer
    outcomes = [evaluate(name, kernel, shape, device, timer) for name, kernel in candidates.items()]
    times = [o.ms if o.ok else math.inf for o in outcomes]
    times = (reduce or _max_over_ranks)(times)
    for o, ms in zip(outcomes, times):
        if o.ok and not math.isfinite(ms):
            o.failed = "failed on another rank"
        elif o.ok:
            o.ms = ms
    passed = [o for o in outcomes if o.ok]
    chosen = min(passed, key=lambda o: o.ms).name if passed else None
    return Selection(shape, outcomes, chosen)


def resolve_attention_backend(cfg: Any, parallel_dims: Any, model_args: Any,
                              device: torch.device, timer: Timer | None = None,
                              reduce: Callable[[list[float]], list[float]] | None = None,
                              ) -> SDPBackend | None:
    """The run's SDPA kernel (None: PyTorch chooses), logged in one line. A forced kernel
    that fails or disagrees with math on this run's shape is a ValueError (one line). When
    ``auto`` finds compiled FlexAttention fastest, it sets ``model_args.use_flex_attn`` (call
    before the model is built) and returns None."""
    name = cfg.model.attention_backend
    if name == "auto" and device.type != "cuda":
        return None  # PyTorch's own choice, as always
    if getattr(model_args, "use_flex_attn", False) and flex_supported(device):
        logger.info("attention kernel: FlexAttention (model.use_flex_attn); "
                    "model.attention_backend picks SDPA kernels only")
        return None
    shape = run_attention_shape(cfg, parallel_dims, model_args)
    if name == "auto":
        candidates: dict[str, Kernel] = {n: sdpa_kernel_fn(BACKENDS[n]) for n in AUTO_CANDIDATES}
        if flex_is_candidate(cfg, parallel_dims, device):
            candidates[FLEX] = flex_kernel_fn(device)
        selection = select_kernel(shape, device, candidates, timer=timer, reduce=reduce)
        logger.info(selection.log_line())
        if selection.chosen == FLEX:
            model_args.use_flex_attn = True
            return None
        return BACKENDS[selection.chosen] if selection.chosen is not None else None
    if device.type == "cuda":
        timer = timer or _default_timer
    outcome = evaluate(name, sdpa_kernel_fn(BACKENDS[name]), shape, device,
                       timer if device.type == "cuda" else None)
    if not outcome.ok:
        why = outcome.failed if outcome.failed is not None else f"wrong: {outcome.wrong}"
        raise ValueError(f"model.attention_backend={name} cannot run this run's attention "
                         f"({shape.label()}) on {device.type}: {why}; use auto or another kernel")
    timing = f"; fwd+bwd {outcome.ms:.2f} ms" if outcome.ms is not None else ""
    logger.info(f"attention kernel: SDPA {name} for {shape.label()} "
                f"(model.attention_backend{timing})")
    return BACKENDS[name]


def set_attention_backend(model_parts: Sequence[nn.Module], backend: SDPBackend | None,
                          forced: bool = True) -> int:
    """Hand ``backend`` to every attention module (those declaring ``sdpa_backend``); returns
    how many. A ``forced`` kernel that no module takes is a ValueError (``auto``'s: a
    warning), never ignored in silence."""
    count = 0
    for part in model_parts:
        for module in part.modules():
            if hasattr(type(module), "sdpa_backend"):
                module.sdpa_backend = backend
                count += 1
    if backend is not None and count == 0:
        why = "the model has no attention module that takes an SDPA kernel"
        if forced:
            raise ValueError(f"model.attention_backend: {why}; set model.attention_backend=auto")
        logger.warning(f"attention kernel: {why}; PyTorch chooses instead of {backend.name}")
    return count
