"""Routed experts of an MoE layer as stacked weights, run with grouped GEMM.

``GroupedExperts`` holds ``num_experts`` gated feed-forwards: ``w1`` (gate), ``w3`` (up):
``[E, H, D]`` and ``w2`` (down): ``[E, D, H]``, each slice laid out like an ``nn.Linear``
weight, optionally with biases ``b1``, ``b3``: ``[E, H]`` and ``b2``: ``[E, D]`` (gpt-oss).
The gate is SwiGLU (``silu(gate) * up``) or gpt-oss's clamped SwiGLU
(:func:`clamped_swiglu`). All experts run at once with ``torch._grouped_mm``; a per-expert
loop is the reference and the fallback.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return F.silu(gate) * up


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """gpt-oss's gate: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = min(gate, limit)`` (as transformers' ``GptOssExperts``)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped GEMM's
    backward rejects expanded, stride-0 gradients)."""

    @staticmethod
    def forward(ctx, x):  # noqa: ARG004
        return x

    @staticmethod
    def backward(ctx, grad):  # noqa: ARG004
        return grad.contiguous()


class GroupedExperts(nn.Module):
    """``num_experts`` gated experts as stacked weights ``w1, w3: [E, H, D]``, ``w2: [E, D, H]``
    (each slice laid out like an ``nn.Linear`` weight); with ``bias``, ``b1, b3: [E, H]`` and
    ``b2: [E, D]``. ``activation(gate, up)`` defaults to SwiGLU."""

    hidden_dims = {"w1": 1, "w3": 1, "w2": 2, "b1": 1, "b3": 1, "b2": None}
    """Per parameter, the dim that holds the hidden units (None: none), which expert tensor
    parallelism splits."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True,
                 *, bias: bool = False, activation: Activation = swiglu):
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.activation = activation
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        if bias:
            self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.b2 = nn.Parameter(torch.empty(num_experts, dim))
            self.b3 = nn.Parameter(torch.empty(num_experts, hidden_dim))
        self.output_is_partial = False
        """Set when the hidden units are split over ranks (expert tensor parallel): each rank's
        output is then a partial sum, and ``b2`` is added once, after the sum, by
        :meth:`add_down_bias`."""

    @property
    def has_bias(self) -> bool:
        return "b1" in self._parameters

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=init_std)
        if self.has_bias:
            for b in (self.b1, self.b2, self.b3):
                nn.init.zeros_(b)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, D]``: tokens sorted by expert, ``num_tokens_per_expert[e]`` of expert e."""
        w1, w2, w3 = (_autocast(_local(w), x.device.type) for w in (self.w1, self.w2, self.w3))
        biases = None
        if self.has_bias:
            b1, b2, b3 = (_autocast(_local(b), x.device.type) for b in (self.b1, self.b2, self.b3))
            biases = (b1, None if self.output_is_partial else b2, b3)
        if self.use_grouped_mm and _grouped_mm_supported(w1):
            return _run_grouped(x, num_tokens_per_expert, w1, w2, w3, self.activation, biases)
        return _run_loop(x, num_tokens_per_expert, w1, w2, w3, self.activation, biases)

    def add_down_bias(self, out: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``out`` (``[N, D]``, sorted by expert) plus each token's expert's ``b2``."""
        if not self.has_bias:
            return out
        b2 = _autocast(_local(self.b2), out.device.type)
        return out + b2[_expert_ids(num_tokens_per_expert, out.shape[0])].to(out.dtype)


def _expert_ids(counts: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """The local expert index of each of ``n_tokens`` tokens sorted by expert."""
    experts = torch.arange(counts.numel(), device=counts.device)
    return torch.repeat_interleave(experts, counts, output_size=n_tokens)


def _autocast(w: torch.Tensor, device_type: str) -> torch.Tensor:
    """``w`` in the autocast dtype when autocast is on: autocast casts matmuls but not
    ``torch._grouped_mm``, so the experts cast their weights themselves. Converter weight
    wrappers (float8 / MX) choose their own dtypes and are left as they are."""
    if not torch.is_autocast_enabled(device_type) or type(w) not in (torch.Tensor, nn.Parameter):
        return w
    dtype = torch.get_autocast_dtype(device_type)
    return w if w.dtype == dtype else w.to(dtype)


def _local(w: torch.Tensor) -> torch.Tensor:
    """The local shard of a parameter (experts run per rank on the experts it holds)."""
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


def _grouped_mm_supported(w: torch.Tensor) -> bool:
    """Whether the grouped GEMM runs in ``w``'s dtype (the inputs are cast to it)."""
    if w.dtype == torch.float32 and torch.compiler.is_compiling():
        return False  # grouped GEMM's meta kernel (used by torch.compile) accepts bf16 only
    return hasattr(torch, "_grouped_mm") and w.dtype in (torch.float32, torch.bfloat16)


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    from torch._subclasses.fake_tensor import is_fake

    if a.dtype != torch.bfloat16 and is_fake(a):
        # Fake-tensor dry runs (COMM_MODE=fake_backend): the meta kernel accepts bf16 only,
        # and only the shapes matter there.
        return torch._grouped_mm(a.bfloat16(), b.bfloat16(), offs=offs).to(a.dtype)
    return torch._grouped_mm(a, b, offs=offs)


def _run_grouped(x, counts, w1, w2, w3, activation=swiglu, biases=None) -> torch.Tensor:
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    x = x.to(w1.dtype)
    gate = _ContiguousGrad.apply(_gmm(x, w1.transpose(-2, -1), offsets))
    up = _ContiguousGrad.apply(_gmm(x, w3.transpose(-2, -1), offsets))
    if biases is not None:
        ids = _expert_ids(counts, x.shape[0])
        b1, b2, b3 = biases
        gate, up = gate + b1[ids], up + b3[ids]
    out = _ContiguousGrad.apply(_gmm(activation(gate, up), w2.transpose(-2, -1), offsets))
    if biases is not None and b2 is not None:
        out = out + b2[ids]
    return out


def _run_loop(x, counts, w1, w2, w3, activation=swiglu, biases=None) -> torch.Tensor:
    b1, b2, b3 = biases if biases is not None else (None, None, None)
    outs = []
    for e, chunk in enumerate(torch.split(x, counts.tolist(), dim=0)):
        gate, up = chunk @ w1[e].transpose(0, 1), chunk @ w3[e].transpose(0, 1)
        if b1 is not None:
            gate, up = gate + b1[e], up + b3[e]
        out = activation(gate, up) @ w2[e].transpose(0, 1)
        outs.append(out + b2[e] if b2 is not None else out)
    return torch.cat(outs, dim=0) if outs else x.new_zeros(0, w2.shape[1])
