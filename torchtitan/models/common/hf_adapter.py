"""Hugging Face state-dict adapters: one base, each family a declaration.

A family's adapter subclasses :class:`HFStateDictAdapter` and declares:

- ``hf_name``: how errors name the family (``"Llama"``: "cannot map 2 key(s) to HF Llama names").
- ``key_map``: our FQN pattern -> HF key pattern, one tensor each. ``{layer}`` is the layer index.
- ``expert_map``: our stacked ``[E, ...]`` experts -> HF's one tensor per expert (``{expert}``).
- ``fused_hf_keys``: HF-only layouts read on import: HF pattern -> our patterns its dim 1 splits
  into (transformers' in-memory fused experts, :data:`FUSED_EXPERTS`).
- ``transforms``: our pattern -> :class:`Transform` (a layout change, e.g. :class:`RopeHalfSplit`).
- ``export_drops``: our pattern -> :class:`Dropped` (what HF cannot hold; exports refuse a
  non-zero one unless asked to be lossy); ``import_zeros``: our pattern -> the pattern whose
  presence makes an import give it zeros (``[num_experts]``, float32).
- ``hf_ignored``: regex of HF keys an import drops (buffers both sides recompute).
- the ``config.json`` side: ``args_from_hf_config``, ``hf_config_from_args`` and the fields
  that are not architecture (``not_compared``, never checked against a flavor).

``to_hf`` / ``from_hf`` are written here once: they take and return plain (full, unsharded)
tensors keyed by name and raise one-line ValueErrors naming what they cannot map.
Patterns write ``{layer}`` as the first and ``{expert}`` as the second all-digit segment.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

LAYER, EXPERT = "{layer}", "{expert}"
_INDEX = re.compile(r"(?:^|(?<=\.))\d+(?=\.|$)")
# Module names that activation checkpointing, compile and FSDP1 insert into FQNs.
_WRAPPERS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")

def layer_keys(names: dict[str, str]) -> dict[str, str]:
    """Layer-relative names (ours -> HF) as patterns under ``layers.{layer}.`` (ours) and
    ``model.layers.{layer}.`` (HF)."""
    return {f"layers.{LAYER}.{k}": f"model.layers.{LAYER}.{v}" for k, v in names.items()}


def swiglu(ours: str, hf: str) -> dict[str, str]:
    """A shared ``FeedForward`` at ``ours`` <-> HF's ``gate/down/up_proj`` at ``hf``."""
    return {f"{ours}.{w}.weight": f"{hf}.{proj}.weight"
            for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))}


TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
"""The decoder's embedding, final norm and output under HF's names (every family)."""

BLOCK_NORMS = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
"""A ``TransformerBlock``'s two norms (layer-relative)."""

GQA_ATTENTION = {f"attention.w{x}.weight": f"self_attn.{x}_proj.weight" for x in "qkvo"}
"""``GroupedQueryAttention``'s projections (layer-relative)."""

MOE_ROUTER = {"moe.router.gate.weight": "mlp.gate.weight"}
"""The MoE router (layer-relative)."""

MOE_EXPERTS = {
    f"layers.{LAYER}.moe.experts.{w}": f"model.layers.{LAYER}.mlp.experts.{EXPERT}.{proj}.weight"
    for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))
}
"""Stacked SwiGLU experts (``models/common/moe.py``) <-> the Hub's one tensor per expert."""

FUSED_EXPERTS = {
    f"model.layers.{LAYER}.mlp.experts.gate_up_proj": (
        f"layers.{LAYER}.moe.experts.w1", f"layers.{LAYER}.moe.experts.w3"),
    f"model.layers.{LAYER}.mlp.experts.down_proj": (f"layers.{LAYER}.moe.experts.w2",),
}
"""transformers 5's in-memory experts (``model.state_dict()``): ``gate_up_proj`` ``[E, 2I, D]``."""


def canonical_key(key: str) -> tuple[str, list[int]]:
    """``key`` with its all-digit segments replaced by ``{layer}`` then ``{expert}``, and them."""
    found: list[int] = []

    def repl(m: re.Match) -> str:
        found.append(int(m.group()))
        return LAYER if len(found) == 1 else EXPERT

    return _INDEX.sub(repl, key), found


def fill(pattern: str, layer: int | None = None, expert: int | None = None) -> str:
    """``pattern`` with its placeholders filled in."""
    out = pattern if layer is None else pattern.replace(LAYER, str(layer))
    return out if expert is None else out.replace(EXPERT, str(expert))


def interleaved_to_half(w: torch.Tensor, period: int, start: int = 0, width: int | None = None,
                        inverse: bool = False) -> torch.Tensor:
    """Reorder rows ``[start, start + width)`` of every ``period`` rows of ``w`` from RoPE pairs
    ``(2i, 2i+1)`` (ours) to HF's rotate-half ``(i, i + width/2)``; ``inverse`` goes back."""
    width = period if width is None else width
    out = w.clone()
    blocks = out.view(-1, period, *w.shape[1:])
    rope = blocks[:, start : start + width]
    shape = (2, width // 2) if inverse else (width // 2, 2)
    reordered = rope.reshape(rope.shape[0], *shape, *w.shape[1:]).transpose(1, 2)
    blocks[:, start : start + width] = reordered.reshape(rope.shape)
    return out


class Transform:
    """A per-key change of a tensor between our layout and HF's (identity here)."""

    def to_hf(self, adapter: HFStateDictAdapter, w: torch.Tensor) -> torch.Tensor:
        return w

    def from_hf(self, adapter: HFStateDictAdapter, w: torch.Tensor) -> torch.Tensor:
        return w


@dataclass(frozen=True)
class RopeHalfSplit(Transform):
    """Rows rotated by RoPE, reordered between our interleaved pairs and HF's half split.

    ``period``, ``start`` and ``width`` take the model args (``period`` None: the whole
    tensor; ``width`` None: ``period``); ``applies`` takes the adapter (default: always).
    """

    period: Callable[[Any], int] | None
    start: Callable[[Any], int] = lambda args: 0
    width: Callable[[Any], int] | None = None
    applies: Callable[[Any], bool] = lambda adapter: True

    def _convert(self, adapter: HFStateDictAdapter, w: torch.Tensor, inverse: bool) -> torch.Tensor:
        if not self.applies(adapter):
            return w
        a = adapter.model_args
        period = w.shape[0] if self.period is None else self.period(a)
        width = None if self.width is None else self.width(a)
        return interleaved_to_half(w, period, self.start(a), width, inverse)

    def to_hf(self, adapter: HFStateDictAdapter, w: torch.Tensor) -> torch.Tensor:
        return self._convert(adapter, w, inverse=False)

    def from_hf(self, adapter: HFStateDictAdapter, w: torch.Tensor) -> torch.Tensor:
        return self._convert(adapter, w, inverse=True)


@dataclass(frozen=True)
class Dropped:
    """What an HF export drops: ``message`` formats ``{n}`` (tensors not zero) and ``{top}``
    (their largest magnitude); a zero tensor drops silently."""

    message: str


def require_moe_settings(moe_args: Any, required: dict[str, Any], hf_name: str) -> None:
    """One-line ValueError for the first MoE setting (``moe_args`` field -> the value HF's
    architecture fixes) that HF ``hf_name`` cannot express."""
    for name, hf_value in required.items():
        value = getattr(moe_args, name)
        if value != hf_value:
            raise ValueError(
                f"moe {name}={value!r} cannot be expressed in HF {hf_name} (which has {hf_value!r})"
            )


def decoder_hf_config(args: Any, architecture: str, model_type: str, intermediate_size: int,
                      dtype: str, **family: Any) -> dict[str, Any]:
    """The ``config.json`` keys every decoder family writes alike (sizes, heads, norm, RoPE
    base, context, tied embeddings, dtype), then the family's own (``family``, which may
    override one of them)."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.effective_n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "tie_word_embeddings": args.tie_word_embeddings,
        "dtype": dtype,  # transformers >= 4.56 reads "dtype" ("torch_dtype" is deprecated)
        **family,
    }


def routing_bias_dropped(hf_lacks: str) -> Dropped:
    """The MoE load-balancing bias that HF's model (``hf_lacks`` says how) routes without."""
    return Dropped(
        "the load-balancing expert_bias of {n} MoE layer(s) is not zero (max |bias| {top:.3g}), "
        f"but {hf_lacks}: the exported model would route tokens to other experts"
    )


class HFStateDictAdapter:
    """Converts a family's state dicts between torchtitan FQNs and HF names (see the module
    docstring for what a family declares)."""

    hf_name: ClassVar[str] = "model"
    key_map: ClassVar[dict[str, str]] = {}
    expert_map: ClassVar[dict[str, str]] = {}
    fused_hf_keys: ClassVar[dict[str, tuple[str, ...]]] = {}
    transforms: ClassVar[dict[str, Transform]] = {}
    export_drops: ClassVar[dict[str, Dropped]] = {}
    import_zeros: ClassVar[dict[str, str]] = {}
    hf_ignored: ClassVar[str] = r"rotary_emb\.inv_freq$"
    not_compared: ClassVar[frozenset[str]] = frozenset(
        {"architectures", "dtype", "max_position_embeddings"})
    """config.json fields that are not architecture: the context length (a run picks its
    own) and the export dtype."""
    args_from_hf_config: ClassVar[Callable[[dict[str, Any]], Any]]
    """``(config.json dict) -> model args``; ValueError naming a field it cannot represent."""
    hf_config_from_args: ClassVar[Callable[..., dict[str, Any]]]
    """``(model args, dtype) -> config.json dict``; ValueError for what HF cannot express."""

    def __init__(self, model_args: Any, hf_assets_path: str | None = None):
        self.model_args = model_args
        self.hf_assets_path = hf_assets_path

    # --- declarations, indexed once per class ----------------------------------------------
    @classmethod
    def _tables(cls) -> dict[str, Any]:
        if "_tables_cache" not in cls.__dict__:
            ours = {**cls.key_map, **cls.expert_map}
            hf = {v: ("one", k) for k, v in cls.key_map.items()}
            hf.update({v: ("expert", k) for k, v in cls.expert_map.items()})
            hf.update({k: ("fused", v) for k, v in cls.fused_hf_keys.items()})
            cls._tables_cache = {"ours": ours, "hf": hf, "ignored": re.compile(cls.hf_ignored)}
        return cls._tables_cache

    @classmethod
    def our_patterns(cls) -> set[str]:
        """Every FQN pattern the family's state dicts may hold."""
        return set(cls.key_map) | set(cls.expert_map) | set(cls.export_drops)

    @classmethod
    def hf_patterns(cls) -> set[str]:
        """Every HF key pattern an import reads."""
        return set(cls._tables()["hf"])

    @classmethod
    def hf_pattern_of(cls, key: str) -> str | None:
        """The HF pattern ``key`` is an instance of; ``""`` for an ignored key; None: unknown."""
        if cls.is_extra_hf_key(key):
            return ""
        pattern, _ = canonical_key(key)
        return pattern if pattern in cls._tables()["hf"] else None

    @classmethod
    def is_extra_hf_key(cls, key: str) -> bool:
        """An HF key the import handles without mapping it (ignored buffers; families add
        their own, e.g. quantization scales)."""
        return cls._tables()["ignored"].search(key) is not None

    # --- hooks a family may override -----------------------------------------------------------
    def active_export_drops(self) -> dict[str, Dropped]:
        """``export_drops`` that apply to this model (all, unless the family says otherwise)."""
        return self.export_drops

    def check_exportable(self) -> None:
        """ValueError when HF cannot express this model (nothing by default)."""

    def prepare_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The HF state dict before mapping (families dequantize or drop extra layers here)."""
        return hf_state_dict

    def missing_experts_message(self, layer: int, hf_proj: str, present: list[int], n: int) -> str:
        """One line for an HF layer whose experts are not exactly ``0..n-1``."""
        missing = sorted(set(range(n)) - set(present))
        extra = sorted(set(present) - set(range(n)))
        what = f"lacks expert(s) {missing[:3]}" if missing else f"has expert(s) {extra[:3]}"
        return f"HF layer {layer} {what} ({hf_proj}); the model has {n} experts: check model.flavor"

    # --- the conversion, once ------------------------------------------------------------------
    @property
    def _tied(self) -> bool:
        return bool(getattr(self.model_args, "tie_word_embeddings", False))

    @property
    def _n_experts(self) -> int:
        moe = getattr(self.model_args, "moe_args", None)
        return moe.num_experts if moe is not None else 0

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our FQNs -> HF names (experts split one by one, transforms applied, what HF cannot
        hold dropped: see ``dropped_by_export``); ValueError naming unknown keys."""
        self.check_exportable()
        drops = self.active_export_drops()
        hf: dict[str, torch.Tensor] = {}
        unknown: list[str] = []
        for key, value in state_dict.items():
            pattern, idx = canonical_key(key)
            layer = idx[0] if idx else None
            if pattern in drops or (key == "output.weight" and self._tied):
                continue  # HF ties lm_head to embed_tokens itself
            if pattern not in self.key_map and pattern not in self.expert_map:
                unknown.append(key)
            elif pattern in self.expert_map:
                for j, expert in enumerate(value.unbind(0)):
                    hf[fill(self.expert_map[pattern], layer, j)] = expert
            else:
                transform = self.transforms.get(pattern)
                hf[fill(self.key_map[pattern], layer)] = (
                    value if transform is None else transform.to_hf(self, value))
        if unknown:
            raise ValueError(
                f"cannot map {len(unknown)} key(s) to HF {self.hf_name} names, e.g. {unknown[:3]}"
            )
        return hf

    def dropped_by_export(self, state_dict: dict[str, torch.Tensor]) -> str:
        """What ``to_hf`` loses of ``state_dict`` that is not zero ("" when nothing)."""
        lost = []
        for pattern, dropped in self.active_export_drops().items():
            values = [v for k, v in state_dict.items()
                      if canonical_key(_WRAPPERS.sub("", k))[0] == pattern]
            nonzero = [v for v in values if v.numel() and v.abs().max() > 0]
            if nonzero:
                top = max(float(v.abs().max()) for v in nonzero)
                lost.append(dropped.message.format(n=len(nonzero), top=top))
        return "; ".join(lost)

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names -> our FQNs (per-expert or fused experts stacked, transforms undone, what
        HF lacks zero-filled, tied output); ValueError naming unknown keys, layers beyond the
        model's or experts that are not ``0..E-1``."""
        hf_state_dict = self.prepare_hf(hf_state_dict)
        tables = self._tables()
        n_layers = getattr(self.model_args, "n_layers", None)
        sd: dict[str, torch.Tensor] = {}
        unknown: list[str] = []
        experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        for key, value in hf_state_dict.items():
            if tables["ignored"].search(key):
                continue
            pattern, idx = canonical_key(key)
            kind, ours = tables["hf"].get(pattern, (None, None))
            layer = idx[0] if idx else None
            if kind is None:
                unknown.append(key)
            elif layer is not None and n_layers is not None and layer >= n_layers:
                unknown.append(f"{key} (the model has {n_layers} layers)")
            elif kind == "expert":
                experts.setdefault((layer, ours), {})[idx[1]] = value
            elif kind == "fused":
                for name, part in zip(ours, value.chunk(len(ours), dim=1)):
                    sd[fill(name, layer)] = part
            else:
                transform = self.transforms.get(ours)
                sd[fill(ours, layer)] = value if transform is None else transform.from_hf(self, value)
        if unknown:
            raise ValueError(
                f"cannot map {len(unknown)} HF key(s) to torchtitan {self.hf_name} FQNs, e.g. "
                f"{unknown[:3]}"
            )
        n = self._n_experts
        for (layer, ours), by_index in experts.items():
            if sorted(by_index) != list(range(n)):
                hf_proj = self.expert_map[ours].rsplit(".", 2)[-2]
                raise ValueError(self.missing_experts_message(layer, hf_proj, sorted(by_index), n))
            sd[fill(ours, layer)] = torch.stack([by_index[j] for j in range(n)])
        for target, anchor in self.import_zeros.items():
            for key in [k for k in sd if canonical_key(k)[0] == anchor]:
                name = fill(target, canonical_key(key)[1][0])
                if name not in sd:
                    sd[name] = torch.zeros(n, dtype=torch.float32)
        if "output.weight" not in sd and "tok_embeddings.weight" in sd and self._tied:
            sd["output.weight"] = sd["tok_embeddings.weight"]
        return sd

    # --- config.json ---------------------------------------------------------------------------
    def hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        """HF ``config.json`` contents for this model."""
        return type(self).hf_config_from_args(self.model_args, dtype)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> HFStateDictAdapter:
        """The adapter (model args and weight layout) for an HF ``config.json`` dict."""
        return cls(cls.args_from_hf_config(config)).with_hf_layout(config)

    def with_hf_layout(self, config: dict[str, Any]) -> HFStateDictAdapter:
        """This adapter for weights stored as HF ``config`` says (the same by default)."""
        return self


def covers(adapter_cls: type, keys: Iterable[str], hf: bool) -> float | None:
    """How well ``keys`` (HF names if ``hf``, else our FQNs) fit ``adapter_cls``: None when a
    key is not the family's or no layer key is there, else the share of its patterns used."""
    if not isinstance(adapter_cls, type) or not issubclass(adapter_cls, HFStateDictAdapter):
        return None
    patterns = adapter_cls.hf_patterns() if hf else adapter_cls.our_patterns()
    used: set[str] = set()
    for key in keys:
        pattern = adapter_cls.hf_pattern_of(key) if hf else canonical_key(key)[0]
        if pattern == "":
            continue
        if pattern not in patterns:
            return None
        used.add(pattern)
    if not any(LAYER in p for p in used):
        return None
    return len(used) / len(patterns)
