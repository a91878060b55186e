"""One attention kernel on trial: is it correct on a run's attention shape (against the math
kernel in float64), and how long does its forward+backward take (CUDA events).

``tools/attention_kernels.py`` decides from these trials which kernel a run uses.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.nn.attention import SDPBackend

from torchtitan.models.common.attention_sinks import causal_mask
from torchtitan.models.common.document_mask import attend

__all__ = [
    "AttentionShape",
    "Kernel",
    "Outcome",
    "Timer",
    "check_kernel",
    "cuda_event_timer",
    "evaluate",
    "sdpa_kernel_fn",
]

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


def sdpa_kernel_fn(backend: SDPBackend) -> Kernel:
    """The model's attention (``attend``) forced to ``backend``."""
    return functools.partial(attend, backend=backend)


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
