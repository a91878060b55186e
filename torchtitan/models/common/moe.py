"""Mixture-of-experts layer: token-choice top-k router, grouped-GEMM experts, shared experts.

Plain model code (no parallelism). ``MoE.forward`` routes each token to ``top_k`` of
``num_experts`` SwiGLU experts, runs every expert on its tokens at once with grouped GEMM
(``torch._grouped_mm``; a per-expert loop is the reference and the fallback), weights the
expert outputs by the routing scores and adds the shared experts' output.

Load balancing without an auxiliary loss (DeepSeek-V3): a per-expert bias is added to the
scores used to *choose* experts (not to the weights); after every optimizer step
:func:`update_load_balance_bias` moves it by ``load_balance_coeff`` toward the less-loaded
experts, from the token counts accumulated over all microbatches of the step (and summed over
data-parallel ranks by the caller's reduction). The bias is a persistent buffer, so it is
checkpointed. An optional sequence-level auxiliary loss (``aux_loss_coeff``) adds its gradient
through :class:`AddAuxiliaryLoss` without changing the reported loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.feed_forward import FeedForward


@dataclass
class MoEArgs:
    """Routing and expert settings of one MoE layer (shared by every MoE layer of a model)."""

    num_experts: int = 8
    num_shared_experts: int = 0
    top_k: int = 2
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = False
    """Renormalise the top-k weights of each token to sum to one."""
    route_scale: float = 1.0
    """Multiply the (renormalised) top-k weights by this."""
    num_expert_groups: int | None = None
    """Group-limited routing (DeepSeek-V3 ``n_group``): experts form this many groups ..."""
    num_limited_groups: int | None = None
    """... and each token picks experts from its best ``topk_group`` groups only."""
    load_balance_coeff: float | None = 1e-3
    """Step size of the load-balancing bias update; None turns the bias off."""
    aux_loss_coeff: float = 0.0
    """Weight of the sequence-level auxiliary balance loss (0: off)."""
    use_grouped_mm: bool = True
    force_load_balance: bool = False
    """Route tokens round-robin over the experts (``debug.moe_force_load_balance``)."""

    def validate(self) -> None:
        """ValueError (one line) for impossible settings."""
        if self.num_experts < 1:
            raise ValueError(f"moe num_experts={self.num_experts} must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"moe top_k={self.top_k} must be between 1 and num_experts={self.num_experts}"
            )
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"moe score_func={self.score_func!r} must be 'softmax' or 'sigmoid'")
        groups, limited = self.num_expert_groups, self.num_limited_groups
        if (groups is None) != (limited is None):
            raise ValueError("moe num_expert_groups and num_limited_groups must be set together")
        if groups is not None:
            if self.num_experts % groups:
                raise ValueError(
                    f"moe num_expert_groups={groups} must divide num_experts={self.num_experts}"
                )
            if not 1 <= limited <= groups:
                raise ValueError(
                    f"moe num_limited_groups={limited} must be between 1 and "
                    f"num_expert_groups={groups}"
                )
            if limited * (self.num_experts // groups) < self.top_k:
                raise ValueError(
                    f"moe top_k={self.top_k} exceeds the experts in the {limited} allowed groups"
                )


class TokenChoiceTopKRouter(nn.Module):
    """Scores every expert per token and picks ``top_k`` (optionally group-limited)."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[T, D]`` -> (top-k weights ``[T, k]``, expert ids ``[T, k]``, tokens per
        expert ``[E]``, all scores ``[T, E]``)."""
        a = self.args
        logits = self.gate(x).float()
        scores = torch.sigmoid(logits) if a.score_func == "sigmoid" else logits.softmax(dim=-1)
        if a.force_load_balance:
            n = x.shape[0]
            selected = torch.arange(n * a.top_k, device=x.device).view(n, a.top_k) % a.num_experts
        else:
            choice = scores if expert_bias is None else scores + expert_bias.float()
            if a.num_expert_groups is not None:
                choice = _limit_to_groups(choice, a.num_expert_groups, a.num_limited_groups)
            selected = choice.topk(a.top_k, dim=-1).indices
        weights = scores.gather(-1, selected)
        if a.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * a.route_scale
        # scatter_add, not bincount: a fixed output shape, so fake-tensor dry runs trace it
        flat = selected.flatten()
        counts = torch.zeros(a.num_experts, dtype=flat.dtype, device=flat.device)
        counts = counts.scatter_add_(0, flat, torch.ones_like(flat))
        return weights, selected, counts, scores


def _limit_to_groups(choice: torch.Tensor, n_groups: int, n_limited: int) -> torch.Tensor:
    """Mask (-inf) the scores of experts outside each token's ``n_limited`` best groups (a
    group's score is the sum of its two best expert scores, as in DeepSeek-V3). -inf, not 0:
    a negative load-balancing bias can push allowed experts' scores below zero."""
    tokens, n_experts = choice.shape
    grouped = choice.view(tokens, n_groups, n_experts // n_groups)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(n_limited, dim=-1).indices, True)
    mask = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, n_experts)
    return choice.masked_fill(~mask, float("-inf"))


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
    """``num_experts`` SwiGLU experts as stacked weights ``w1, w3: [E, H, D]``, ``w2: [E, D, H]``
    (each slice laid out like an ``nn.Linear`` weight)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, D]``: tokens sorted by expert, ``num_tokens_per_expert[e]`` of expert e."""
        w1, w2, w3 = (_autocast(_local(w), x.device.type) for w in (self.w1, self.w2, self.w3))
        if self.use_grouped_mm and _grouped_mm_supported(w1):
            return _run_grouped(x, num_tokens_per_expert, w1, w2, w3)
        return _run_loop(x, num_tokens_per_expert, w1, w2, w3)


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


def _run_grouped(x, counts, w1, w2, w3) -> torch.Tensor:
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    x = x.to(w1.dtype)
    gate = _ContiguousGrad.apply(_gmm(x, w1.transpose(-2, -1), offsets))
    up = _ContiguousGrad.apply(_gmm(x, w3.transpose(-2, -1), offsets))
    h = F.silu(gate) * up
    return _ContiguousGrad.apply(_gmm(h, w2.transpose(-2, -1), offsets))


def _run_loop(x, counts, w1, w2, w3) -> torch.Tensor:
    outs = []
    for e, chunk in enumerate(torch.split(x, counts.tolist(), dim=0)):
        h = F.silu(chunk @ w1[e].transpose(0, 1)) * (chunk @ w3[e].transpose(0, 1))
        outs.append(h @ w2[e].transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else x.new_zeros(0, w2.shape[1])


class SharedExperts(FeedForward):
    """The always-on SwiGLU expert(s) of a layer, fused into one wider feed-forward."""


class AddAuxiliaryLoss(torch.autograd.Function):
    """Returns ``x`` unchanged; in backward, ``aux_loss`` receives gradient 1, so it is
    minimised along with the training loss without appearing in it."""

    @staticmethod
    def forward(ctx, x, aux_loss):
        ctx.dtype, ctx.shape = aux_loss.dtype, aux_loss.shape
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones(ctx.shape, dtype=ctx.dtype, device=grad.device)


class MoE(nn.Module):
    """A mixture-of-experts feed-forward: ``[B, S, D] -> [B, S, D]``."""

    float32_buffers = ("expert_bias", "tokens_per_expert")
    """Kept float32 by the decoder's dtype casts (exact counts; HF keeps the bias float32)."""

    def __init__(self, args: MoEArgs, dim: int, hidden_dim: int):
        super().__init__()
        args.validate()
        self.args = args
        self.router = TokenChoiceTopKRouter(dim, args)
        self.experts = GroupedExperts(dim, hidden_dim, args.num_experts, args.use_grouped_mm)
        self.shared_experts = (
            SharedExperts(dim, hidden_dim * args.num_shared_experts)
            if args.num_shared_experts > 0
            else None
        )
        self.aux_loss_scale = 1.0
        """Multiplies ``aux_loss_coeff`` (the trainer sets 1 / gradient-accumulation steps)."""
        self.sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Sums per-sequence statistics over the ranks that hold the other positions of this
        rank's sequences (set by context / tensor parallelism; None: whole sequences here)."""
        # Routing bias (checkpointed) and the tokens each expert received since the last
        # optimizer step (not checkpointed: it is zeroed after every step).
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        self.register_buffer(
            "tokens_per_expert", torch.zeros(args.num_experts), persistent=False
        )

    @property
    def uses_load_balance_bias(self) -> bool:
        return self.args.load_balance_coeff is not None

    def init_weights(self, init_std: float, buffer_device: torch.device | None = None) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        device = buffer_device or self.expert_bias.device
        with torch.no_grad():
            self.expert_bias = torch.zeros(self.args.num_experts, device=device)
            self.tokens_per_expert = torch.zeros(self.args.num_experts, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        tokens = x.reshape(-1, dim)
        bias = self.expert_bias if self.uses_load_balance_bias else None
        weights, selected, counts, scores = self.router(tokens, bias)
        if torch.is_grad_enabled():  # training forwards only: not validation or shape probes
            with torch.no_grad():
                count_routed_tokens(self.tokens_per_expert, counts)
        # Sort the (token, choice) pairs by expert so each expert's tokens are contiguous.
        order = torch.argsort(selected.flatten(), stable=True)
        token_ids = order // self.args.top_k
        routed = self.experts(tokens[token_ids], counts)
        routed = routed.float() * weights.flatten()[order].unsqueeze(-1)
        out = torch.zeros_like(tokens, dtype=routed.dtype).index_add_(0, token_ids, routed)
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        if self.args.aux_loss_coeff > 0 and self.training:
            aux = sequence_balance_loss(scores, selected, bs, self.args, self.sequence_sum)
            out = AddAuxiliaryLoss.apply(out, aux * self.args.aux_loss_coeff * self.aux_loss_scale)
        return out.view(bs, slen, dim)


@torch.library.custom_op("torchtitan::count_routed_tokens", mutates_args=("total",))
def count_routed_tokens(total: torch.Tensor, counts: torch.Tensor) -> None:
    """``total += counts``, except while activation checkpointing re-runs a forward inside
    backward (that would count the tokens twice).

    An opaque op, so the check runs when the op runs, compiled or not: a compiled block that
    block-level AC recomputes runs its whole graph again, buffer updates included (a check
    traced into the graph would be decided once, at trace time).
    """
    if torch._C._current_graph_task_id() == -1:  # not inside autograd's backward
        total.add_(counts.to(total.dtype))


@count_routed_tokens.register_fake
def _(total: torch.Tensor, counts: torch.Tensor) -> None:
    return None


def sequence_balance_loss(
    scores: torch.Tensor,
    selected: torch.Tensor,
    batch_size: int,
    args: MoEArgs,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss ``sum_i f_i * P_i``, averaged over sequences:
    ``f_i`` is expert i's share of the sequence's choices times ``E``, ``P_i`` its mean
    (normalised) score. ``sequence_sum`` completes the per-sequence sums when this rank holds
    only some positions of each sequence."""
    n_experts, k = args.num_experts, args.top_k
    probs = scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    probs = probs.view(batch_size, -1, n_experts)
    local_len = probs.shape[1]
    chosen = F.one_hot(selected.view(batch_size, local_len * k), n_experts).float().sum(dim=1)
    prob_sum = probs.sum(dim=1)
    if sequence_sum is not None:
        chosen, prob_sum = sequence_sum(chosen), sequence_sum(prob_sum)
    seq_len = chosen.sum(dim=-1, keepdim=True) / k  # every position chose k experts
    f = chosen * n_experts / (k * seq_len)
    return (f * prob_sum / seq_len).sum(dim=-1).mean()


def moe_layers(modules: Iterable[nn.Module]) -> list[MoE]:
    """Every MoE layer inside ``modules`` (e.g. the model parts). Each is given its block's
    FQN as ``metrics_name`` (``layers.3``), which names its figures in the metrics."""
    found = []
    for part in modules:
        for fqn, m in part.named_modules():
            if isinstance(m, MoE):
                m.metrics_name = fqn.removesuffix(".moe")
                found.append(m)
    return found


@torch.no_grad()
def update_load_balance_bias(
    layers: list[MoE], reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """After an optimizer step: move each layer's ``expert_bias`` toward its under-loaded
    experts by ``load_balance_coeff * sign(mean_load - load)`` (centred), from the tokens
    counted since the last call, then zero the counts.

    ``reduce_sum`` sums a tensor over the ranks that saw different tokens (data and context
    parallel), in place; every rank then applies the same update. Returns load figures of the
    step as 0-dim tensors: ``moe/max_load`` (the largest max/mean expert load over layers; 1.0
    is perfect balance), ``moe/mean_max_load`` (max/mean averaged over layers: the headline
    figure, which one lagging layer does not dominate), ``moe/max_load/<layer>`` per layer,
    ``moe/min_load`` (the smallest min/mean) and ``moe/dropped_tokens`` (always 0: token-choice
    routing drops nothing).
    """
    if not layers:
        return {}
    counts = torch.stack([layer.tokens_per_expert for layer in layers])
    if reduce_sum is not None:
        counts = reduce_sum(counts)
    mean = counts.mean(dim=-1, keepdim=True).clamp_min(1e-9)
    load = counts / mean
    for layer, layer_counts in zip(layers, counts):
        coeff = layer.args.load_balance_coeff
        if coeff is not None:
            delta = coeff * torch.sign(layer_counts.mean() - layer_counts)
            layer.expert_bias.add_(delta - delta.mean())
        layer.tokens_per_expert.zero_()
    per_layer = load.amax(dim=-1)
    figures = {
        "moe/max_load": per_layer.max(),
        "moe/mean_max_load": per_layer.mean(),
        "moe/min_load": load.min(),
        "moe/dropped_tokens": torch.zeros((), device=load.device),
    }
    for i, (layer, value) in enumerate(zip(layers, per_layer.unbind())):
        figures[f"moe/max_load/{getattr(layer, 'metrics_name', '') or i}"] = value
    return figures
