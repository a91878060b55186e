"""Document-aware attention: causal or block-causal masks, an optional sliding window, and two
kernels (SDPA with a boolean mask, FlexAttention with a ``BlockMask``).

A packed training sequence holds several documents (``[BOS] doc [EOS] [BOS] doc ...``).
``attn_mask_type="block_causal"`` lets a token attend only to earlier tokens *of its own
document*; the document boundaries come from the tokens themselves (:func:`document_ids`),
computed once per batch outside the model (``torchtitan.step``) and handed to the model's
forward, which builds one mask per batch (:func:`build_attention_mask`) shared by every layer.

Kernels: FlexAttention (``use_flex_attn``, compiled) on GPUs; FlexAttention has no backward on
CPU (torch 2.13), so on CPU the model uses SDPA with the equivalent boolean mask and says so
once. Both kernels see the same mask definition (:func:`mask_mod` / :func:`boolean_mask`).

Split sequences: a context-parallel layer that gives each rank part of every sequence hands the
model a :class:`SequenceShard` (which global positions this rank's queries are, and how to
gather the keys/values of the whole sequence: ``Decoder.sequence_shard``, set for the
duration of the step). With it the mask covers this rank's queries against every key, and
:func:`attend` gathers keys/values first; the model code is the same either way.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "MASK_TYPES",
    "SequenceShard",
    "ShardedMask",
    "apply_attention_config",
    "attend",
    "batch_attention_mask",
    "boolean_mask",
    "build_attention_mask",
    "check_document_separators",
    "document_ids",
    "flex_supported",
    "mask_mod",
    "repeat_kv",
    "uses_attention_mask",
    "validate_mask_settings",
]

logger = logging.getLogger(__name__)

MASK_TYPES = ("causal", "block_causal")
_cpu_fallback_logged = False


@dataclass(frozen=True)
class SequenceShard:
    """This rank's part of every sequence when a context-parallel layer splits it.

    ``q_positions`` (int64 ``[S_local]``): the global positions of the tokens this rank holds,
    in order; ``kv_positions`` (int64 ``[S]``): the global position of each key/value
    ``gather_kv(k, v)`` returns (it gathers ``[B, H, S_local, D]`` blocks from every rank along
    dim 2, with autograd).
    """

    q_positions: torch.Tensor
    kv_positions: torch.Tensor
    gather_kv: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ShardedMask:
    """A mask of this rank's queries against every key (boolean ``[B|1, 1, S_local, S]`` or a
    ``BlockMask``), with the gather that gives :func:`attend` those keys."""

    mask: Any
    gather_kv: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def document_ids(tokens: torch.Tensor, bos_id: int, eos_id: int) -> torch.Tensor:
    """``int32[B, S]``: the index of each position's document within its row.

    A document starts at a BOS token and right after an EOS token (so ``[BOS] a b [EOS]`` is one
    document and works with tokenizers that add only one of them); ids below 0 mean "none".
    The first position of a row always belongs to document 0 (a document cut by the window).
    """
    if tokens.dim() != 2:
        raise ValueError(f"document_ids expects token ids [batch, seq], got shape {tuple(tokens.shape)}")
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    if bos_id >= 0:
        starts |= tokens == bos_id
    if eos_id >= 0:
        starts[:, 1:] |= tokens[:, :-1] == eos_id
    starts[:, 0] = False
    return starts.to(torch.int32).cumsum(dim=1, dtype=torch.int32)


def mask_mod(doc_ids: torch.Tensor | None, sliding_window: int | None):
    """FlexAttention ``mask_mod(b, h, q, kv)``: causal, within one document (when ``doc_ids``),
    and within ``sliding_window`` positions (``q - kv < window``) when set."""

    def causal(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        if doc_ids is not None:
            keep = keep & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
        if sliding_window:
            keep = keep & (q_idx - kv_idx < sliding_window)
        return keep

    return causal


def boolean_mask(
    doc_ids: torch.Tensor | None, seq_len: int, sliding_window: int | None, device: Any,
    shard: SequenceShard | None = None,
) -> torch.Tensor:
    """SDPA's ``attn_mask`` (True = attend): ``bool[B, 1, S, S]`` with ``doc_ids``, else
    ``[1, 1, S, S]``; the same rule as :func:`mask_mod`. With ``shard``, the rows are its
    queries and the columns its gathered keys (``[., 1, S_local, S]``)."""
    if shard is None:
        q_pos = kv_pos = torch.arange(seq_len, device=device)
    else:
        q_pos, kv_pos = shard.q_positions.to(device), shard.kv_positions.to(device)
    keep = q_pos[:, None] >= kv_pos[None, :]
    if sliding_window:
        keep = keep & (q_pos[:, None] - kv_pos[None, :] < sliding_window)
    keep = keep[None, None]
    if doc_ids is not None:
        q_docs, kv_docs = doc_ids[:, q_pos], doc_ids[:, kv_pos]
        keep = keep & (q_docs[:, None, :, None] == kv_docs[:, None, None, :])
    return keep


def _sharded_mask_mod(inner: Callable, shard: SequenceShard, device: Any) -> Callable:
    """``inner`` (on global positions) seen from a shard's local query and gathered key
    indices; indices past the end (block padding) are clamped, their rows are discarded."""
    q_pos, kv_pos = shard.q_positions.to(device), shard.kv_positions.to(device)
    q_last, kv_last = q_pos.numel() - 1, kv_pos.numel() - 1

    def remapped(b, h, q_idx, kv_idx):
        return inner(b, h, q_pos[q_idx.clamp(max=q_last)], kv_pos[kv_idx.clamp(max=kv_last)])

    return remapped


def flex_supported(device: torch.device) -> bool:
    """FlexAttention trains on this device (it has no backward on CPU in torch 2.13)."""
    return device.type != "cpu"


def _log_cpu_fallback() -> None:
    global _cpu_fallback_logged
    if not _cpu_fallback_logged:
        _cpu_fallback_logged = True
        logger.info(
            "model.use_flex_attn: FlexAttention has no backward on CPU; using SDPA with the "
            "equivalent boolean mask (same attention, more memory: batch x seq^2 booleans)"
        )


def build_attention_mask(
    *,
    mask_type: str,
    doc_ids: torch.Tensor | None,
    seq_len: int,
    batch_size: int,
    device: torch.device,
    sliding_window: int | None = None,
    use_flex: bool = False,
    shard: SequenceShard | None = None,
) -> Any:
    """The mask of one batch, shared by every layer: ``None`` (plain causal SDPA), a boolean
    ``[B|1, 1, S, S]`` tensor (SDPA) or a FlexAttention ``BlockMask``; with ``shard`` (``S``
    is then the whole sequence's length), a :class:`ShardedMask` of its queries.

    ``block_causal`` needs ``doc_ids`` (:func:`document_ids`). ``use_flex`` on a device where
    FlexAttention cannot train (CPU) falls back to the boolean mask with one info line.
    """
    if mask_type not in MASK_TYPES:
        raise ValueError(f"attn_mask_type={mask_type!r} is not one of {', '.join(MASK_TYPES)}")
    if mask_type == "block_causal" and doc_ids is None:
        raise ValueError(
            "attn_mask_type='block_causal' needs document_ids: call the model as "
            "model(tokens, document_ids=document_ids(tokens, bos_id, eos_id))"
        )
    docs = doc_ids if mask_type == "block_causal" else None
    if use_flex and not flex_supported(device):
        _log_cpu_fallback()
        use_flex = False
    if use_flex:
        rows = batch_size if docs is not None else None
        rule = mask_mod(docs, sliding_window)
        q_len = seq_len
        if shard is not None:
            rule, q_len = _sharded_mask_mod(rule, shard, device), shard.q_positions.numel()
        compiled = torch.device(device).type == "cuda"
        mask = block_mask(rule, rows, q_len, seq_len, device, compiled=compiled)
    elif docs is None and not sliding_window and shard is None:
        return None
    else:
        mask = boolean_mask(docs, seq_len, sliding_window, device, shard)
    return mask if shard is None else ShardedMask(mask, shard.gather_kv)


_compile_block_masks = True


def block_mask(rule: Callable, rows: int | None, q_len: int, kv_len: int, device: Any,
               compiled: bool) -> Any:
    """FlexAttention ``BlockMask`` of ``rule``. ``compiled``: built by a compiled
    ``create_block_mask``, block by block, instead of materialising the ``rows x q_len x kv_len``
    boolean mask first (gigabytes at long sequences); if compiling fails, every later mask of
    this process is built eagerly, with one warning."""
    global _compile_block_masks
    from torch.nn.attention.flex_attention import create_block_mask

    if compiled and _compile_block_masks:
        try:
            return _compiled_create_block_mask()(rule, rows, None, q_len, kv_len, device=device)
        except Exception as err:  # an inductor limitation must not stop training
            _compile_block_masks = False
            logger.warning(
                f"FlexAttention masks: compiling create_block_mask failed "
                f"({type(err).__name__}: {str(err).splitlines()[0][:200]}); building masks "
                "eagerly (each materialises a boolean mask of the batch first)"
            )
    return create_block_mask(rule, rows, None, q_len, kv_len, device=device)


@functools.cache
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Repeat each key/value head ``n_rep`` times: ``[B, S, Hkv, D] -> [B, S, Hkv * n_rep, D]``."""
    if n_rep == 1:
        return x
    bs, seqlen, n_kv_heads, head_dim = x.shape
    return (
        x[:, :, :, None, :]
        .expand(bs, seqlen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, seqlen, n_kv_heads * n_rep, head_dim)
    )


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None,
           compiled_flex: bool = True, scale: float | None = None, n_rep: int = 1,
           sinks: torch.Tensor | None = None, backend: Any = None) -> torch.Tensor:
    """Attention on ``[B, H, S, D]`` tensors with a mask from :func:`build_attention_mask`
    (``scale``: the softmax scale, default ``1/sqrt(D)``). Grouped-query attention: ``k`` and
    ``v`` have ``H / n_rep`` heads, each shared by ``n_rep`` query heads. A
    :class:`ShardedMask` gathers the whole sequence's keys/values first (before the heads are
    repeated, so ``n_rep`` times less traffic). ``sinks`` (``[H]``): one more logit per head in
    the softmax denominator (``attention_sinks.py``: an extra key for SDPA, an ``lse``
    rescale for FlexAttention). ``backend`` (a ``torch.nn.attention.SDPBackend``): the SDPA
    paths run under ``sdpa_kernel([backend])`` (no fallback); None lets PyTorch choose
    (``tools/attention_kernels.py`` decides it per run)."""
    if isinstance(mask, ShardedMask):
        k, v = mask.gather_kv(k, v)
        mask = mask.mask
    if n_rep > 1:
        k = repeat_kv(k.transpose(1, 2), n_rep).transpose(1, 2)
        v = repeat_kv(v.transpose(1, 2), n_rep).transpose(1, 2)
    if mask is None or isinstance(mask, torch.Tensor):
        if backend is None:
            return _sdpa(q, k, v, mask, scale, sinks)
        # Inside the traced code on purpose: dynamo keeps the context manager in the graph
        # (no graph break), and activation checkpointing recomputes under it too.
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel([backend]):
            return _sdpa(q, k, v, mask, scale, sinks)
    if compiled_flex:
        flex = _compiled_flex_attention()
    else:
        from torch.nn.attention.flex_attention import flex_attention as flex
    if sinks is None:
        return flex(q, k, v, block_mask=mask, scale=scale)
    from torch.nn.attention.flex_attention import AuxRequest

    from torchtitan.models.common.attention_sinks import rescale_by_sinks

    out, aux = flex(q, k, v, block_mask=mask, scale=scale, return_aux=AuxRequest(lse=True))
    return rescale_by_sinks(out, aux.lse, sinks)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA: causal without ``mask``, else with the boolean ``mask``; ``sinks`` as an extra key."""
    if sinks is not None:
        from torchtitan.models.common.attention_sinks import sdpa_with_sinks

        return sdpa_with_sinks(q, k, v, mask, sinks, scale)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def validate_mask_settings(args: Any) -> None:
    """ValueError (one line) for a model's ``attn_mask_type`` / ``sliding_window_size``."""
    if args.attn_mask_type not in MASK_TYPES:
        raise ValueError(
            f"model attn_mask_type={args.attn_mask_type!r} must be 'causal' or 'block_causal'"
        )
    if args.sliding_window_size is not None and args.sliding_window_size < 1:
        raise ValueError(
            f"model sliding_window_size={args.sliding_window_size} must be >= 1 (or None)"
        )


def uses_attention_mask(args: Any) -> bool:
    """The model's attention needs a per-batch mask (documents, a window, FlexAttention or
    attention sinks), not plain causal SDPA (context parallel then takes its masked path)."""
    return getattr(args, "attn_mask_type", "causal") != "causal" or bool(
        getattr(args, "sliding_window_size", None) or getattr(args, "use_flex_attn", False)
        or getattr(args, "attention_sinks", False)
    )


_ARGS_WINDOW: Any = object()


def batch_attention_mask(
    args: Any, tokens: torch.Tensor, document_ids: torch.Tensor | None, device: torch.device,
    sliding_window: int | None = _ARGS_WINDOW, shard: SequenceShard | None = None,
) -> Any:
    """The mask a model's forward builds once per batch for its layers, from its args
    (``attn_mask_type``, ``sliding_window_size`` unless ``sliding_window`` is given, for layers
    with their own window, ``use_flex_attn``): None for plain causal attention.
    ``document_ids`` give the batch shape to pipeline stages whose input is hidden
    states ``[B, S, D]`` rather than tokens. With a context-parallel ``shard`` ``tokens`` hold
    this rank's part of each sequence and ``document_ids`` the whole sequence's, and the mask
    covers this rank's queries against every key."""
    if sliding_window is _ARGS_WINDOW:
        sliding_window = args.sliding_window_size
    if not uses_attention_mask(args) and shard is None:
        return None
    shape = (document_ids if document_ids is not None else tokens).shape
    if len(shape) != 2:
        raise ValueError(
            "this model's attention mask needs document_ids [batch, seq] on a "
            "pipeline stage without the token embedding"
        )
    seq_len = shape[1] if shard is None else shard.kv_positions.numel()
    return build_attention_mask(
        mask_type=args.attn_mask_type, doc_ids=document_ids, seq_len=seq_len,
        batch_size=shape[0], device=device,
        sliding_window=sliding_window, use_flex=args.use_flex_attn, shard=shard,
    )


def apply_attention_config(model_cfg: Any, model_args: Any) -> None:
    """Apply ``model.attn_mask_type`` / ``model.use_flex_attn`` / ``model.sliding_window_size``
    (None: the flavor's) to ``model_args`` and validate them: a family without the field refuses
    the key in one line (ValueError), never ignores it."""
    settings = {
        "attn_mask_type": model_cfg.attn_mask_type,
        "use_flex_attn": model_cfg.use_flex_attn,
        "sliding_window_size": model_cfg.sliding_window_size,
    }
    for key, value in settings.items():
        if value is None:
            continue
        if not hasattr(model_args, key):
            raise ValueError(
                f"model.{key}={value!r} is not supported by model {model_cfg.name}: its flavors "
                "have no such setting; unset it"
            )
        setattr(model_args, key, value)
    validate = getattr(model_args, "validate", None)
    if validate is not None and any(v is not None for v in settings.values()):
        validate()


def check_document_separators(model_args: Any, tokenizer: Any) -> None:
    """``block_causal`` finds documents by the tokenizer's BOS/EOS: refuse one without both."""
    if getattr(model_args, "attn_mask_type", "causal") != "block_causal" or tokenizer is None:
        return
    if getattr(tokenizer, "bos_id", -1) < 0 and getattr(tokenizer, "eos_id", -1) < 0:
        raise ValueError(
            "model.attn_mask_type='block_causal' finds documents by the tokenizer's BOS/EOS "
            "tokens, and this tokenizer has neither; use attn_mask_type='causal'"
        )
