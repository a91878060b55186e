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

import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend

from torchtitan.models.common.attention_sinks import causal_mask
from torchtitan.models.common.document_mask import attend, flex_supported, uses_attention_mask
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

CHECK_LEN = 1024
"""The correctness check runs on one batch row, one key/value head's query heads and at most
this many positions (a fused kernel's numbers do not depend on the rest)."""
TOLERANCE_FLOOR = {torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 4e-3}
TOLERANCE_FACTOR = 4.0
"""A kernel is correct when its output and every input gradient are within
``max(TOLERANCE_FLOOR[dtype], TOLERANCE_FACTOR x the math kernel's own error in that dtype)``
of the math kernel in float64, errors measured as max |x - ref| / max |ref| (PyTorch's own
SDPA tests bound fused kernels by a multiple of the low-precision math kernel's error)."""

Kernel = Callable[..., torch.Tensor]
"""``kernel(q, k, v, mask, n_rep=, sinks=) -> out``, as ``document_mask.attend`` is called."""
Timer = Callable[[str, Callable[[], Any]], float]
"""``timer(name, fwd_bwd) -> milliseconds per call``."""

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class AttentionShape:
    """One rank's attention call: queries ``[batch, heads, q_len, head_dim]``, keys/values
    ``[batch, kv_heads, kv_len, head_dim]`` (repeated to ``heads`` as the model does), causal
    (``masked`` False: ``is_causal``) or with a boolean mask of ``mask_rows`` rows, and sinks."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: torch.dtype
    masked: bool = False
    mask_rows: int = 1
    sinks: bool = False

    @property
    def n_rep(self) -> int:
        return self.heads // self.kv_heads

    def label(self) -> str:
        """e.g. ``causal [2, 32, 4096, 128] bf16``."""
        kind = "masked" if self.masked else "causal"
        kind += " with sinks" if self.sinks else ""
        keys = f" x {self.kv_len} keys" if self.kv_len != self.q_len else ""
        dims = f"[{self.batch}, {self.heads}, {self.q_len}, {self.head_dim}]"
        return f"{kind} {dims}{keys} {_DTYPE_NAMES.get(self.dtype, str(self.dtype))}"

    def reduced(self, max_len: int) -> AttentionShape:
        """One batch row, one key/value head with its query heads, at most ``max_len``
        positions (the queries stay the last ones, as under context parallel)."""
        kv_len = min(self.kv_len, max_len)
        q_len = min(self.q_len, kv_len)
        return replace(self, batch=1, heads=self.n_rep, kv_heads=1, q_len=q_len, kv_len=kv_len,
                       mask_rows=1)


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


def sdpa_kernel_fn(backend: SDPBackend) -> Kernel:
    """The model's attention (``attend``) forced to ``backend``."""
    return functools.partial(attend, backend=backend)


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


def _inputs(shape: AttentionShape, device: torch.device, dtype: torch.dtype,
            seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
    """``([q, k, v(, sinks)] leaves with grad, mask, grad_out)`` from a private generator
    (the run's RNG streams stay as they were)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    s = shape

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device, dtype=dtype)

    leaves = [randn(s.batch, s.heads, s.q_len, s.head_dim),
              randn(s.batch, s.kv_heads, s.kv_len, s.head_dim),
              randn(s.batch, s.kv_heads, s.kv_len, s.head_dim)]
    if s.sinks:
        leaves.append(randn(s.heads))
    for t in leaves:
        t.requires_grad_(True)
    mask = None
    if s.masked:
        mask = causal_mask(s.q_len, s.kv_len, device).expand(s.mask_rows, 1, -1, -1)
    return leaves, mask, randn(s.batch, s.heads, s.q_len, s.head_dim)


def _cast(inputs, dtype: torch.dtype):
    leaves, mask, grad = inputs
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in leaves]
    return leaves, mask, grad.to(dtype)


def _fwd_bwd(kernel: Kernel, shape: AttentionShape, inputs) -> list[torch.Tensor]:
    """``[out, grad q, grad k, grad v(, grad sinks)]``."""
    leaves, mask, grad = inputs
    sinks = leaves[3] if shape.sinks else None
    out = kernel(leaves[0], leaves[1], leaves[2], mask, n_rep=shape.n_rep, sinks=sinks)
    return [out, *torch.autograd.grad(out, leaves, grad)]


_RESULT_NAMES = ("output", "grad q", "grad k", "grad v", "grad sinks")


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double(), ref.detach()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def check_kernel(kernel: Kernel, shape: AttentionShape, device: torch.device,
                 max_len: int = CHECK_LEN) -> str | None:
    """None when ``kernel`` matches the math kernel (float64) on the reduced shape within the
    tolerance (:data:`TOLERANCE_FACTOR`); else what is wrong. Raises what the kernel raises."""
    small = shape.reduced(max_len)
    inputs = _inputs(small, device, small.dtype)
    math_fn = sdpa_kernel_fn(SDPBackend.MATH)
    ref = _fwd_bwd(math_fn, small, _cast(inputs, torch.float64))
    low = _fwd_bwd(math_fn, small, _cast(inputs, small.dtype))
    got = _fwd_bwd(kernel, small, _cast(inputs, small.dtype))
    floor = TOLERANCE_FLOOR.get(small.dtype, 1e-3)
    for name, x, m, r in zip(_RESULT_NAMES, got, low, ref):
        if x.shape != r.shape:
            return f"{name} shape {list(x.shape)} != {list(r.shape)}"
        err, tol = _rel_err(x, r), max(floor, TOLERANCE_FACTOR * _rel_err(m, r))
        if not err <= tol:  # also NaN
            return f"{name} error {err:.1e} > {tol:.1e}"
    return None


def cuda_event_timer(fn: Callable[[], Any], warmup: int = 3, iters: int = 10) -> float:
    """Milliseconds per call of ``fn`` on the current CUDA stream (CUDA events)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _default_timer(name: str, fn: Callable[[], Any]) -> float:
    return cuda_event_timer(fn)


@dataclass
class Outcome:
    """One kernel's result: ``ms`` (fwd+bwd, when timed), or why it is out."""

    name: str
    ms: float | None = None
    failed: str | None = None
    wrong: str | None = None

    @property
    def ok(self) -> bool:
        return self.failed is None and self.wrong is None

    def describe(self) -> str:
        if self.failed is not None:
            return f"{self.name} failed ({self.failed})"
        if self.wrong is not None:
            return f"{self.name} wrong ({self.wrong})"
        return f"{self.name} {self.ms:.2f} ms" if self.ms is not None else self.name


def _why(err: BaseException, caught: Sequence[warnings.WarningMessage]) -> str:
    """The first line of ``err``, with PyTorch's reason for refusing a kernel (a warning)."""
    text = (str(err).strip().splitlines() or [""])[0][:120]
    reasons = [str(w.message).splitlines()[0][:160] for w in caught
               if "kernel not used because" in str(w.message) or "does not support" in str(w.message)]
    return f"{type(err).__name__}: {text}" + (f" [{reasons[0]}]" if reasons else "")


def evaluate(name: str, kernel: Kernel, shape: AttentionShape, device: torch.device,
             timer: Timer | None) -> Outcome:
    """Check ``kernel`` (:func:`check_kernel`), then (``timer`` given) time forward+backward
    on the full ``shape``. Never raises: a failure is the outcome."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            problem = check_kernel(kernel, shape, device)
            if problem is not None:
                return Outcome(name, wrong=problem)
            if timer is None:
                return Outcome(name)
            inputs = _inputs(shape, device, shape.dtype)
            return Outcome(name, ms=float(timer(name, lambda: _fwd_bwd(kernel, shape, inputs))))
        except Exception as err:  # a kernel that cannot run this shape, dtype or memory
            return Outcome(name, failed=_why(err, caught))
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()


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
