"""Keys from older torchtitan TOML schemas (2024 onwards) and how they map to today's.

Each :class:`Rule` maps an old dotted key (``section.key``) either to a new key,
optionally through a value transform, or to nothing (an obsolete key that is
dropped). Both TOML files and command-line flags go through the same table, and
every hit logs one deprecation line naming the old and the new key.

Keys that still exist but are deprecated (``model.tokenizer_path``) live in
:data:`DEPRECATED`: they keep working and only warn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# One operation produced by a rule: ("set", key, value) or ("append", key, item).
Op = tuple[str, str, Any]


class LegacyValueError(ValueError):
    """A legacy key holds a value its rule cannot translate (the manager reports it)."""


@dataclass(frozen=True)
class Rule:
    """How one old key maps onto the current schema."""

    old: str
    """Old dotted key; a trailing ``.*`` matches every key below that prefix."""

    new: str | None
    """New dotted key, or None when the key is obsolete and dropped."""

    note: str = ""
    """Extra explanation appended to the warning."""

    transform: Callable[[Any], list[Op]] | None = None
    """Value transform; None means the value moves unchanged to ``new``."""

    flag_kind: str = "auto"
    """On the command line: 'bool' (an action flag), 'value' (takes one value) or
    'auto' (same as the new key's field)."""

    def ops(self, value: Any) -> list[Op]:
        """The operations that apply ``value`` (given under the old key) to the new schema."""
        if self.transform is not None:
            return self.transform(value)
        if self.new is None:
            return []
        return [("set", self.new, value)]


def _need_bool(old: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise LegacyValueError(f"{old}: invalid value {value!r} (expected true or false)")
    return value


def _inverted(old: str, new: str) -> Rule:
    def transform(value: Any) -> list[Op]:
        return [("set", new, not _need_bool(old, value))]

    return Rule(old, new, "with the opposite meaning", transform, "bool")


def _add_float8(old: str) -> Rule:
    def transform(value: Any) -> list[Op]:
        if isinstance(value, str):
            on = value.strip().lower() not in ("", "none", "false", "0", "no", "off")
        else:
            on = bool(value)
        return [("append", "model.converters", "float8")] if on else []

    kind = "value" if old == "training.fp8_linear" else "bool"
    return Rule(old, "model.converters", 'true adds "float8"', transform, kind)


def _fused(value: Any) -> list[Op]:
    fused = _need_bool("optimizer.fused", value)
    return [("set", "optimizer.implementation", "fused" if fused else "foreach")]


def _moved(section: str, keys: tuple[str, ...], new_section: str) -> list[Rule]:
    return [Rule(f"{section}.{k}", f"{new_section}.{k}") for k in keys]


def _dropped(old: str, note: str, flag_kind: str = "value") -> Rule:
    return Rule(old, None, note, None, flag_kind)


def _dropped_unless_set(
    old: str, default: Any, refusal: str, note: str, flag_kind: str = "value"
) -> Rule:
    """Upstream's default is dropped with a warning; any other value (a feature this build
    lacks) is refused: ``{old}={value!r} {refusal}``."""

    def transform(value: Any) -> list[Op]:
        as_text = str(value).lower() == str(default).lower()  # a CLI value is text
        if value != default and not (isinstance(default, bool) and as_text):
            raise LegacyValueError(f"{old}={value!r} {refusal}")
        return []

    transform.accepted = default  # type: ignore[attr-defined]
    return Rule(old, None, note, transform, flag_kind)


_PARALLEL_KEYS = (
    "data_parallel_replicate_degree",
    "data_parallel_shard_degree",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "context_parallel_degree",
    "expert_parallel_degree",
    "disable_loss_parallel",
    "enable_async_tensor_parallel",
    "enable_compiled_autograd",
    "fsdp_reshard_after_forward",
)
_EXPERIMENTAL_PARALLEL_KEYS = (
    "pipeline_parallel_degree",
    "pipeline_parallel_schedule",
    "pipeline_parallel_schedule_csv",
    "pipeline_parallel_layers_per_stage",
    "pipeline_parallel_microbatch_size",
    "context_parallel_degree",
    "context_parallel_rotate_method",
    "enable_async_tensor_parallel",
    "enable_compiled_autograd",
    "expert_parallel_degree",
)
_QUANTIZE_FLOAT8_KEYS = (
    "enable_fsdp_float8_all_gather",
    "precompute_float8_dynamic_scale_for_fsdp",
    "recipe_name",
    "filter_fqns",
    "emulate",
)

_FLOAT8_SCALING = "only dynamic scaling remains; choose a recipe with float8.recipe_name"

RULES: tuple[Rule, ...] = (
    # job
    Rule("job.print_args", "job.print_config"),
    # metrics
    _inverted("metrics.rank_0_only", "metrics.save_for_all_ranks"),
    _inverted("metrics.enable_color_printing", "metrics.disable_color_printing"),
    # model
    _dropped("model.norm_type", "RMSNorm is the only norm"),
    # optimizer / lr_scheduler
    Rule(
        "optimizer.fused",
        "optimizer.implementation",
        'true -> "fused", false -> "foreach"',
        _fused,
        "bool",
    ),
    Rule("lr_scheduler.lr_min", "lr_scheduler.min_lr_factor"),
    Rule("training.warmup_steps", "lr_scheduler.warmup_steps"),
    # training -> elsewhere
    Rule("training.batch_size", "training.local_batch_size"),
    Rule("training.data_parallel_degree", "parallelism.data_parallel_shard_degree"),
    *_moved("training", _PARALLEL_KEYS, "parallelism"),
    _inverted("training.enable_loss_parallel", "parallelism.disable_loss_parallel"),
    Rule("training.compile", "compile.enable"),
    Rule("training.seed", "debug.seed"),
    Rule("training.deterministic", "debug.deterministic"),
    Rule("training.use_cpu_offload", "training.enable_cpu_offload"),
    _add_float8("training.fp8_linear"),
    _add_float8("training.enable_fp8_linear"),
    _add_float8("training.enable_float8_linear"),
    Rule("training.enable_fsdp_fp8_all_gather", "float8.enable_fsdp_float8_all_gather"),
    Rule("training.enable_fsdp_float8_all_gather", "float8.enable_fsdp_float8_all_gather"),
    Rule(
        "training.precompute_float8_dynamic_scale_for_fsdp",
        "float8.precompute_float8_dynamic_scale_for_fsdp",
    ),
    _dropped(
        "training.data_parallel_type",
        "DDP/FSDP/HSDP follow from parallelism.data_parallel_*_degree",
    ),
    # experimental -> parallelism / job
    *_moved("experimental", _EXPERIMENTAL_PARALLEL_KEYS, "parallelism"),
    Rule("experimental.pipeline_parallel_split_points", "parallelism.pipeline_parallel_split_points"),
    Rule("experimental.pipeline_parallel_microbatches", "parallelism.pipeline_parallel_microbatches"),
    _dropped("experimental.pipeline_parallel_split_mode", "stages are split from module FQNs"),
    Rule("experimental.custom_model_path", "experimental.custom_import"),
    Rule("experimental.custom_args_module", "job.custom_config_module"),
    # parallelism keys of newer upstream schemas that this build does not implement
    _dropped_unless_set(
        "parallelism.expert_parallel_comm_backend", "standard",
        "is not built in (tokens travel by the standard all-to-all); remove it or set 'standard'",
        "only the standard all-to-all is built in",
    ),
    _dropped_unless_set(
        "parallelism.pipeline_parallel_expert_parallel_overlap", False,
        "is not built in (DualPipeV overlapping expert-parallel all-to-alls with compute); "
        "remove it",
        "not implemented in this build", "bool",
    ),
    # checkpoint
    Rule("checkpoint.enable_checkpoint", "checkpoint.enable"),
    Rule("checkpoint.model_weights_only", "checkpoint.last_save_model_only"),
    _dropped("checkpoint.interval_type", "checkpoint.interval always counts steps"),
    # float8 / mx / quantize
    _add_float8("float8.enable_float8_linear"),
    Rule("float8.enable_fsdp_fp8_all_gather", "float8.enable_fsdp_float8_all_gather"),
    _dropped("float8.scaling_type_input", _FLOAT8_SCALING),
    _dropped("float8.scaling_type_weight", _FLOAT8_SCALING),
    _dropped("float8.scaling_type_grad_output", _FLOAT8_SCALING),
    _dropped("float8.force_recompute_fp8_weight_in_bwd", "not needed with FSDP2 float8", "bool"),
    *_moved("quantize.linear.float8", _QUANTIZE_FLOAT8_KEYS, "float8"),
    Rule("quantize.grouped_mm.float8.fqns", "float8.moe_fqns_prototype"),
    *_moved("quantize.linear.mx", ("recipe_name", "filter_fqns"), "mx"),
    Rule("quantize.grouped_mm.mx.fqns", "mx.moe_fqns_prototype"),
    _dropped("quantize.linear.mx.mxfp8_dim1_cast_kernel_choice",
             "torchao 0.18 picks the MXFP8 cast kernels"),
    _dropped("quantize.grouped_mm.mx.recipe_name",
             "the MoE grouped GEMMs use mx.recipe_name (quantize.linear.mx.recipe_name)"),
    _dropped("quantize.*", "this quantization setting is not supported in this build"),
    _dropped("mx.mxfp8_dim1_cast_kernel_choice", "torchao 0.18 picks the MXFP8 cast kernels"),
    _dropped("mx.mxfp8_dim0_cast_kernel_choice", "torchao 0.18 picks the MXFP8 cast kernels"),
    # memory estimation / validation
    Rule("memory_estimation.enabled", "memory_estimation.enable"),
    Rule("validation.enabled", "validation.enable"),
    Rule("validation.batch_size", "validation.local_batch_size"),
)

DEPRECATED: dict[str, str] = {
    "model.tokenizer_path": "prefer model.hf_assets_path (the folder holding the tokenizer)",
}
"""Keys that still work but warn."""

_EXACT = {r.old: r for r in RULES if not r.old.endswith(".*")}
_PREFIX = sorted(((r.old[:-2], r) for r in RULES if r.old.endswith(".*")), key=lambda p: -len(p[0]))


def find_rule(key: str) -> Rule | None:
    """The rule for an old dotted key, or None when the key is not a legacy key."""
    rule = _EXACT.get(key)
    if rule is not None:
        return rule
    for prefix, rule in _PREFIX:
        if key.startswith(prefix + "."):
            return rule
    return None


def describe(rule: Rule, key: str, flag: bool = False) -> str:
    """One-line deprecation message for ``key`` (matched by ``rule``)."""
    dash = "--" if flag else ""
    what = "flag" if flag else "config key"
    if rule.new is None:
        msg = f"obsolete {what} {dash}{key} is ignored"
    else:
        msg = f"deprecated {what} {dash}{key}: use {dash}{rule.new} instead"
    return f"{msg} ({rule.note})" if rule.note else msg


def warn(message: str) -> None:
    """Log one deprecation line."""
    logger.warning(message)


def _get_path(data: dict, key: str) -> tuple[bool, Any]:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _set_path(data: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise LegacyValueError(f"{part} must be a table ([{part}]) to receive {key}")
    node[last] = value


def _collect(data: dict, prefix: str, found: list[tuple[str, Any]]) -> None:
    """Pop every legacy leaf below ``data`` into ``found``; prune tables emptied by it."""
    for name in list(data):
        key = f"{prefix}{name}"
        value = data[name]
        if key in _EXACT or (not isinstance(value, dict) and find_rule(key) is not None):
            found.append((key, data.pop(name)))
        elif isinstance(value, dict):
            _collect(value, key + ".", found)
            if not value:
                del data[name]


def migrate_toml(data: dict, source: str) -> dict:
    """Rewrite legacy keys of a parsed TOML document in place and return it.

    Every legacy key logs one warning naming ``source``. When the new key is also
    present, the new key wins and the old one is ignored (with a warning).
    Raises :class:`LegacyValueError` for values a transform cannot translate.
    """
    for key, note in DEPRECATED.items():
        present, _ = _get_path(data, key)
        if present:
            warn(f"{source}: deprecated config key {key}: {note}")
    found: list[tuple[str, Any]] = []
    _collect(data, "", found)
    for key, value in found:
        rule = find_rule(key)
        assert rule is not None
        for op, new_key, new_value in rule.ops(value):
            if op == "set":
                present, _ = _get_path(data, new_key)
                if present:
                    warn(f"{source}: {key} is ignored because {new_key} is also set")
                    break
                _set_path(data, new_key, new_value)
            else:
                present, current = _get_path(data, new_key)
                items = _as_list(current) if present else []
                if new_value not in items:
                    items.append(new_value)
                _set_path(data, new_key, items)
        else:
            warn(f"{source}: {describe(rule, key)}")
    return data


def _as_list(value: Any) -> list:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, list):
        return list(value)
    return [value]


def table() -> list[tuple[str, str, str]]:
    """(old key, new key or 'dropped', note) rows, for docs and tests."""
    return [(r.old, r.new or "(dropped)", r.note) for r in RULES]
