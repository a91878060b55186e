"""Checks on what the config alone can tell: value ranges and simple cross-field rules.

Every rule names a field by dotted key; :func:`unknown_rule_keys` checks them against the
JobConfig schema and this module refuses to import when one names no field, so a typo in a
rule fails loudly instead of silently checking nothing. (Custom config classes extend
JobConfig, so rules about its fields hold for them too.)

Checks that need the world size (degrees multiplying up to it, batch divisibility)
happen where the device mesh is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from torchtitan.config.errors import ConfigError
from torchtitan.config.fields import get_field, leaf_fields, split_optional
from torchtitan.config.job_config import JobConfig

__all__ = ["CHECKS", "unknown_rule_keys", "validate"]

Check = tuple[Callable[[Any], bool], str]


def _ge(n: float) -> Check:
    return (lambda v: v >= n), f"must be >= {n}"


def _gt(n: float) -> Check:
    return (lambda v: v > n), f"must be > {n}"


def _unit(lo_open: bool = False, hi_open: bool = False) -> Check:
    def ok(v: float) -> bool:
        return (0 < v if lo_open else 0 <= v) and (v < 1 if hi_open else v <= 1)

    return ok, f"must be in {'(' if lo_open else '['}0, 1{')' if hi_open else ']'}"


def _opt(check: Check) -> Check:
    fn, msg = check
    return (lambda v: v is None or fn(v)), msg + " (or None)"


def _or_minus_one(check: Check) -> Check:
    fn, msg = check
    return (lambda v: v == -1 or fn(v)), msg + " or -1"


CHECKS: dict[str, Check] = {
    "parallelism.data_parallel_replicate_degree": _ge(1),
    "parallelism.data_parallel_shard_degree": (
        lambda v: v == -1 or v >= 1,
        "must be >= 1, or -1 to use the ranks left over by the other degrees",
    ),
    "parallelism.tensor_parallel_degree": _ge(1),
    "parallelism.pipeline_parallel_degree": _ge(1),
    "parallelism.context_parallel_degree": _ge(1),
    "parallelism.expert_parallel_degree": _ge(1),
    "parallelism.expert_tensor_parallel_degree": _ge(1),
    "parallelism.pipeline_parallel_microbatch_size": _ge(1),
    "parallelism.pipeline_parallel_first_stage_less_layers": _ge(0),
    "parallelism.pipeline_parallel_last_stage_less_layers": _ge(0),
    "parallelism.pipeline_parallel_layers_per_stage": _opt(_ge(1)),
    "parallelism.pipeline_parallel_microbatches": _opt(_ge(1)),
    "training.steps": _gt(0),
    "training.local_batch_size": _gt(0),
    "training.global_batch_size": _or_minus_one(_gt(0)),
    "training.seq_len": _gt(0),
    "training.gc_freq": _gt(0),
    "training.dataloader.num_workers": _ge(0),
    "training.dataloader.prefetch_factor": _opt(_gt(0)),
    "model.sliding_window_size": _opt(_ge(1)),
    "optimizer.lr": _ge(0),
    "optimizer.eps": _ge(0),
    "optimizer.weight_decay": _ge(0),
    "optimizer.beta1": _unit(hi_open=True),
    "optimizer.beta2": _unit(hi_open=True),
    "lr_scheduler.warmup_steps": _ge(0),
    "lr_scheduler.decay_ratio": _opt(_unit()),
    "lr_scheduler.min_lr_factor": _unit(),
    "checkpoint.interval": _gt(0),
    "checkpoint.keep_latest_k": _ge(0),
    "checkpoint.load_step": _ge(-1),
    "metrics.log_freq": _gt(0),
    "profiling.profile_freq": _gt(0),
    "profiling.profiler_active": _gt(0),
    "profiling.profiler_warmup": _ge(0),
    "comm.init_timeout_seconds": _gt(0),
    "comm.train_timeout_seconds": _gt(0),
    "comm.trace_buf_size": _ge(0),
    "activation_checkpoint.memory_budget": _unit(),
    "validation.local_batch_size": _gt(0),
    "validation.seq_len": _gt(0),
    "validation.freq": _gt(0),
    "validation.steps": _or_minus_one(_gt(0)),
    "fault_tolerance.replica_id": _ge(0),
    "fault_tolerance.group_size": _ge(0),
    "fault_tolerance.min_replica_size": _ge(1),
    "fault_tolerance.process_group_timeout_ms": _gt(0),
    "fault_tolerance.quorum_timeout_seconds": _gt(0),
    "fault_tolerance.startup_wait_seconds": _ge(0),
    "fault_tolerance.sync_steps": _ge(1),
    "fault_tolerance.num_fragments": _ge(1),
    "fault_tolerance.fragment_sync_delay": _ge(0),
    "fault_tolerance.fragment_update_alpha": _unit(),
    "fault_tolerance.outer_lr": _gt(0),
    "fault_tolerance.outer_momentum": _unit(hi_open=True),
}
"""Range rules: dotted key -> (predicate on the value, what the value must be)."""


_FLOAT_KEYS = [key for key, f in leaf_fields(JobConfig).items() if split_optional(f.tp)[0] is float]
_INT_KEYS = [key for key, f in leaf_fields(JobConfig).items() if split_optional(f.tp)[0] is int]
_INT64 = 2**63


def unknown_rule_keys(keys: Iterable[str], cls: type = JobConfig) -> list[str]:
    """The keys that name no leaf field of ``cls`` (a rule about them would check nothing)."""
    known = leaf_fields(cls)
    return [k for k in keys if k not in known]


def validate(cfg: Any) -> None:
    """Check what the config alone can tell (ranges, formats); raise ConfigError."""
    for key, (ok, msg) in CHECKS.items():
        value = get_field(cfg, key)  # every key is a JobConfig field (checked at import)
        bad = isinstance(value, float) and math.isnan(value)
        if bad or not ok(value):
            raise ConfigError(f"{key} {msg}, got {value!r}")
    for key in _INT_KEYS:  # TOML and the CLI take any integer; tensors, counters and seeds do not
        value = get_field(cfg, key)
        if isinstance(value, int) and not -_INT64 <= value < _INT64:
            raise ConfigError(f"{key} {value} does not fit in a 64-bit integer (at most {_INT64 - 1})")
    for key in _FLOAT_KEYS:  # inf passes a range rule (lr >= 0) but trains nothing sensible
        value = get_field(cfg, key)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
    option = cfg.activation_checkpoint.selective_ac_option
    if option != "op" and not (option.isdigit() and int(option) > 0):
        raise ConfigError(
            f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer "
            f"(checkpoint every Nth block), got {option!r}"
        )
    ac = cfg.activation_checkpoint
    if ac.debug and ac.mode != "none" and cfg.compile.enable and "model" in cfg.compile.components:
        raise ConfigError(
            "activation_checkpoint.debug records the ops of eager blocks; compiled blocks run "
            "none of them one by one: turn compile off (--compile.no_enable) to debug AC"
        )
    if ac.mode == "memory_budget":
        if not (cfg.compile.enable and "model" in cfg.compile.components):
            raise ConfigError(
                "activation_checkpoint.mode='memory_budget' is carried out by torch.compile's "
                "partitioner: add --compile.enable (with 'model' in compile.components)"
            )
        if cfg.compile.backend == "eager":
            raise ConfigError(
                "activation_checkpoint.mode='memory_budget' needs a compile.backend that "
                "partitions the forward and backward graphs (inductor, aot_eager); 'eager' "
                "does not"
            )
        par = cfg.parallelism
        inside = [
            name for name, degree in (
                ("tensor", par.tensor_parallel_degree), ("context", par.context_parallel_degree),
                ("expert", par.expert_parallel_degree),
            ) if degree > 1
        ]
        if inside:
            raise ConfigError(
                f"activation_checkpoint.mode='memory_budget' does not work with {inside[0]} "
                "parallel: its collectives put process-group objects in the compiled blocks, "
                "which torch.compile's memory-budget partitioner cannot size (torch 2.13); use "
                "mode 'full' or 'selective'"
            )
    ck = cfg.checkpoint
    if ck.start_fresh and ck.load_step != -1:
        raise ConfigError(
            f"checkpoint.start_fresh loads nothing, and checkpoint.load_step={ck.load_step} asks "
            f"to load step-{ck.load_step}: drop one of them"
        )
    _check_dataset_specs(cfg)
    _check_save_config_file(cfg.job.save_config_file)
    _check_fault_tolerance(cfg.fault_tolerance)
    dl = cfg.training.dataloader
    if dl.num_workers == 0:
        for name in ("persistent_workers", "prefetch_factor"):
            if getattr(dl, name) not in (None, False):
                raise ConfigError(
                    f"training.dataloader.{name} needs training.dataloader.num_workers > 0"
                )


def _check_save_config_file(name: str | None) -> None:
    """A file name inside ``job.dump_folder``: '.', 'sub/' or '/abs' would replace the dump
    folder itself, a folder, or a file of another run."""
    if not name:  # "" is unset, as in TOML (which has no None)
        return
    parts = name.split("/")
    if name.startswith("/") or not parts[-1].strip() or parts[-1] == "." or ".." in parts:
        raise ConfigError(
            f"job.save_config_file={name!r} must be a file name inside job.dump_folder, e.g. "
            "resolved.toml (not a folder, an absolute path or one with '..')"
        )


def _check_dataset_specs(cfg: Any) -> None:
    """``training.dataset`` / ``validation.dataset``: a name or a mix ``NAME[=PATH]:WEIGHT,...``."""
    from torchtitan.datasets.mix import parse_dataset_spec

    for key, section in (("training.dataset", cfg.training), ("validation.dataset", cfg.validation)):
        try:
            parse_dataset_spec(section.dataset, section.dataset_path, key)
        except ValueError as err:
            raise ConfigError(str(err)) from None


_UNKNOWN = unknown_rule_keys(CHECKS)
if _UNKNOWN:
    raise RuntimeError(
        f"torchtitan/config/validation.py: CHECKS names fields JobConfig does not have: "
        f"{_UNKNOWN}; fix the rule or the field name"
    )


SEMI_SYNC_METHODS = ("local_sgd", "diloco")


def _check_fault_tolerance(ft: Any) -> None:
    """Cross-field rules of ``[fault_tolerance]`` (only when it is enabled)."""
    if not ft.enable:
        return
    if ft.group_size < 1:
        raise ConfigError(
            "fault_tolerance.group_size must be the number of replica groups (>= 1) with "
            f"fault_tolerance.enable, got {ft.group_size}"
        )
    if ft.replica_id >= ft.group_size:
        raise ConfigError(
            f"fault_tolerance.replica_id={ft.replica_id} must be < fault_tolerance.group_size="
            f"{ft.group_size} (ids are 0 .. group_size-1)"
        )
    if ft.min_replica_size > ft.group_size:
        raise ConfigError(
            f"fault_tolerance.min_replica_size={ft.min_replica_size} must be <= "
            f"fault_tolerance.group_size={ft.group_size} (no step could ever commit)"
        )
    if ft.process_group not in ("gloo", "nccl"):
        raise ConfigError(
            f"fault_tolerance.process_group must be gloo or nccl, got {ft.process_group!r}"
        )
    if ft.semi_sync_method is not None and ft.semi_sync_method not in SEMI_SYNC_METHODS:
        raise ConfigError(
            "fault_tolerance.semi_sync_method must be one of "
            f"{', '.join(SEMI_SYNC_METHODS)} (or unset), got {ft.semi_sync_method!r}"
        )
    if ft.should_quantize and ft.semi_sync_method != "diloco":
        raise ConfigError(
            "fault_tolerance.should_quantize quantizes DiLoCo's pseudo-gradients (torchft sends "
            "gradients and local_sgd's weights at full precision); set "
            "--fault_tolerance.semi_sync_method diloco, or drop should_quantize"
        )
    if ft.should_quantize and ft.process_group != "nccl":
        raise ConfigError(
            "fault_tolerance.should_quantize needs --fault_tolerance.process_group nccl (torchft's "
            f"quantized all-reduce runs on CUDA tensors), got {ft.process_group!r}"
        )
    _check_fragments(ft)


def _check_fragments(ft: Any) -> None:
    """Streaming DiLoCo: the fragment count, and the interval each fragment sync gets."""
    explicit = len(ft.module_fqns_per_model_fragment)
    n = explicit or ft.num_fragments
    if n > 1 and ft.semi_sync_method != "diloco":
        raise ConfigError(
            "fault_tolerance.num_fragments / module_fqns_per_model_fragment split the model for "
            "DiLoCo's synchronisations; set --fault_tolerance.semi_sync_method diloco"
        )
    if explicit and ft.num_fragments not in (1, explicit):
        raise ConfigError(
            f"fault_tolerance.num_fragments={ft.num_fragments} disagrees with the {explicit} "
            "fragments of fault_tolerance.module_fqns_per_model_fragment; leave num_fragments "
            "at 1 or set it to the same count"
        )
    if ft.semi_sync_method != "diloco":
        return
    if ft.sync_steps % n:
        raise ConfigError(
            f"fault_tolerance.sync_steps={ft.sync_steps} must be a multiple of the {n} "
            "fragments (one fragment synchronises every sync_steps / num_fragments steps)"
        )
    if n == 1 and ft.fragment_sync_delay >= ft.sync_steps:
        raise ConfigError(
            f"fault_tolerance.fragment_sync_delay={ft.fragment_sync_delay} must be < "
            f"fault_tolerance.sync_steps={ft.sync_steps}"
        )
    if n > 1 and ft.fragment_sync_delay >= ft.sync_steps // n:
        raise ConfigError(
            f"fault_tolerance.fragment_sync_delay={ft.fragment_sync_delay} must be < "
            f"sync_steps / num_fragments = {ft.sync_steps // n} (a fragment's sync must end "
            "before the next fragment's starts)"
        )
