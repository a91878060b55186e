"""Attention sinks: one learned logit per head in the softmax denominator, with no value.

``softmax_sink(s)_j = exp(s_j) / (sum_k exp(s_k) + exp(sink))``: a head can put part of its
attention "nowhere" (gpt-oss). Two exact ways to compute it, one per kernel family:

* SDPA (:func:`sdpa_with_sinks`): the sink becomes one extra key whose logit is the sink and
  whose value is zero. Queries get one more dimension holding 1 (after the softmax scale is
  folded into them, so SDPA runs with scale 1), keys a 0 there, and the sink key is zero but for
  the sink in that dimension; its logit is ``1 * sink`` exactly, for every query. The explicit
  boolean mask gains a column of True for it. Any SDPA backend, autograd included, gives the
  sinks their gradient.
* FlexAttention (:func:`rescale_by_sinks`): the kernel returns its log-sum-exp ``lse`` (and
  its gradient flows), and ``out * sigmoid(lse - sink)`` is the sink softmax's output, since
  ``Z / (Z + e^sink) = sigmoid(log Z - sink)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``bool[1, 1, q_len, kv_len]``: query ``i`` attends keys ``<= i`` (bottom-right aligned
    when ``kv_len > q_len``, as the queries are the last ``q_len`` positions)."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    return (q_pos[:, None] >= torch.arange(kv_len, device=device)[None, :])[None, None]


def sdpa_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    sinks: torch.Tensor, scale: float | None = None,
) -> torch.Tensor:
    """SDPA over ``[B, H, S, D]`` tensors (``k``/``v`` with ``H`` heads too) with a boolean
    ``mask`` (``[B|1, 1, S_q, S_kv]``, True = attend; None: causal) and per-head ``sinks``
    ``[H]`` in the softmax denominator; ``scale`` defaults to ``1/sqrt(D)``."""
    b, h, s_q, d = q.shape
    s_kv = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    if mask is None:
        mask = causal_mask(s_q, s_kv, q.device)
    sink = sinks.to(k.dtype).view(1, h, 1, 1).expand(b, h, 1, 1)
    q_aug = torch.cat([q * scale, q.new_ones(b, h, s_q, 1)], dim=-1)
    k_aug = torch.cat([
        torch.cat([k, k.new_zeros(b, h, s_kv, 1)], dim=-1),
        torch.cat([k.new_zeros(b, h, 1, d), sink], dim=-1),
    ], dim=2)
    v_aug = torch.cat([v, v.new_zeros(b, h, 1, v.shape[-1])], dim=2)
    mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)
    return F.scaled_dot_product_attention(q_aug, k_aug, v_aug, attn_mask=mask, scale=1.0)


def rescale_by_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """A kernel's softmax output ``out`` ``[B, H, S, D]`` with its log-sum-exp ``lse``
    ``[B, H, S]`` turned into the sink softmax's: ``out * sigmoid(lse - sink)`` (float32)."""
    weight = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * weight.unsqueeze(-1)).to(out.dtype)


def reference_attention_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    sinks: torch.Tensor, scale: float | None = None,
) -> torch.Tensor:
    """The definition, materialising the scores with a sink column (tests, small inputs)."""
    b, h, s_q, d = q.shape
    scale = d**-0.5 if scale is None else scale
    mask = causal_mask(s_q, k.shape[2], q.device) if mask is None else mask
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, h, 1, 1).expand(b, h, s_q, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return probs @ v
