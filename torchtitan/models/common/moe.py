"""Mixture-of-experts layer: token-choice top-k router, grouped-GEMM experts, shared experts.

Plain model code (no parallelism). ``MoE.forward`` routes each token to ``top_k`` of
``num_experts`` gated experts (``grouped_experts.py``: SwiGLU or clamped SwiGLU, optionally
with biases), runs every expert on its tokens at once with grouped GEMM
(``torch._grouped_mm``; a per-expert loop is the reference and the fallback), weights the
expert outputs by the routing scores and adds the shared experts' output. The router's linear
may have a bias (``router_bias``).

Load balancing without an auxiliary loss (DeepSeek-V3): a per-expert bias is added to the
scores used to *choose* experts (not to the weights); after every optimizer step
:func:`update_load_balance_bias` moves it by ``load_balance_coeff`` toward the less-loaded
experts, from the token counts accumulated over all microbatches of the step (and summed over
data-parallel ranks by the caller's reduction). The bias is a persistent buffer, so it is
checkpointed. An optional sequence-level auxiliary loss (``aux_loss_coeff``) adds its gradient
through :class:`AddAuxiliaryLoss` without changing the reported loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.grouped_experts import (  # noqa: F401  (re-exported)
    GroupedExperts,
    clamped_swiglu,
    swiglu,
)


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
    router_bias: bool = False
    """The router's scores are a linear layer with a bias (gpt-oss)."""
    expert_linear_bias: bool = False
    """Every expert's gate, up and down projections have biases (gpt-oss; not the
    load-balancing ``expert_bias``)."""
    expert_activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    """The experts' gate: ``silu(gate) * up``, or gpt-oss's ``clamped_swiglu``."""
    swiglu_alpha: float = 1.702
    """``clamped_swiglu``: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ..."""
    swiglu_limit: float = 7.0
    """... ``g = min(gate, limit)``."""
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
        if self.expert_activation not in ("swiglu", "clamped_swiglu"):
            raise ValueError(
                f"moe expert_activation={self.expert_activation!r} must be 'swiglu' or "
                "'clamped_swiglu'"
            )
        if self.expert_activation == "clamped_swiglu" and self.swiglu_limit <= 0:
            raise ValueError(f"moe swiglu_limit={self.swiglu_limit} must be positive")
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
        self.gate = nn.Linear(dim, args.num_experts, bias=args.router_bias)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)
        if self.gate.bias is not None:
            nn.init.zeros_(self.gate.bias)

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


def _activation(args: MoEArgs):
    if args.expert_activation == "clamped_swiglu":
        return functools.partial(clamped_swiglu, alpha=args.swiglu_alpha, limit=args.swiglu_limit)
    return swiglu


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
        self.experts = GroupedExperts(
            dim, hidden_dim, args.num_experts, args.use_grouped_mm,
            bias=args.expert_linear_bias, activation=_activation(args),
        )
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
