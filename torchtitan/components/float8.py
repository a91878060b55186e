"""float8 training through torchao (``model.converters = ["float8"]``, the ``[float8]`` section).

* Linear layers become torchao ``Float8Linear`` (dynamic scaling; ``float8.recipe_name``
  ``tensorwise`` (default), ``rowwise`` or ``rowwise_with_gw_hp``). Skipped, and logged: layers
  whose FQN contains an entry of ``float8.filter_fqns`` (default ``output``), layers whose
  weight dims are not multiples of 16 (float8 matmuls need them), and with
  ``auto_filter_small_kn`` in ``filter_fqns`` the layers torchao deems too small to gain.
* ``float8.enable_fsdp_float8_all_gather`` (tensorwise, FSDP on): FSDP all-gathers weights
  in float8; ``float8.precompute_float8_dynamic_scale_for_fsdp`` computes their scales for
  the next step in one all-reduce after each optimizer step (:meth:`post_optimizer_hook`).
* TP uses torchao's float8 styles for tensorwise scaling (:func:`float8_tensorwise_tp`,
  read by the llama3 ``parallelize``): activations are all-gathered in float8.
* ``float8.moe_fqns_prototype``: MoE ``GroupedExperts`` whose FQN contains an entry get
  torchao's float8 rowwise grouped GEMMs (CUDA with compute capability >= 9.0 only: torchao
  0.18 has Triton kernels for them and no CPU path).
* ``float8.emulate`` runs the float8 casts and matmuls in higher precision (same rounding):
  how float8 trains on machines without float8 hardware (CPU, CI). Without it float8 needs a
  CUDA GPU with compute capability >= 8.9, and the run refuses otherwise in one line.

Weights keep their FQNs, shapes and dtype (``Float8Linear`` is an ``nn.Linear`` whose weight is
the high-precision master weight), so checkpoints load across converter settings.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

from torchtitan.components.converters import ModelConverter, converts_linears
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Float8, JobConfig
from torchtitan.tools.logging import logger

FLOAT8_CAPABILITY = (8, 9)
MOE_CAPABILITY = (9, 0)
MIN_TORCHAO = (0, 18)
AUTO_FILTER = "auto_filter_small_kn"


def cuda_capability() -> tuple[int, int] | None:
    """This machine's CUDA compute capability, or None without a CUDA GPU."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def has_float8_hardware(device_type: str) -> bool:
    cap = cuda_capability()
    return device_type == "cuda" and cap is not None and cap >= FLOAT8_CAPABILITY


def describe_device(device_type: str) -> str:
    cap = cuda_capability()
    if device_type == "cuda" and cap is not None:
        return f"{torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]})"
    return device_type


def require_torchao(what: str) -> Any:
    """Import torchao (>= 0.18); ImportError in one line naming the install command."""
    try:
        import torchao
    except ImportError:
        raise ImportError(
            f"{what} needs torchao>=0.18: pip install 'torchtitan[float8]' (or pip install "
            "torchao), then run again"
        ) from None
    version = tuple(int(p) for p in re.findall(r"\d+", torchao.__version__)[:2])
    if version < MIN_TORCHAO:
        raise ImportError(f"{what} needs torchao>=0.18; installed: {torchao.__version__}")
    return torchao


def recipe_of(float8: Float8) -> str:
    """The float8 recipe (``float8.recipe_name``, tensorwise when unset)."""
    return float8.recipe_name or "tensorwise"


def float8_tensorwise_tp(job_config: JobConfig) -> bool:
    """True when TP should all-gather in float8: the float8 converter with tensorwise scaling
    (rowwise recipes use the plain TP styles; Float8Linear then all-gathers high precision)."""
    return converts_linears(job_config.model.converters, "float8") and recipe_of(job_config.float8) == "tensorwise"


def _layer_pattern(fqn: str) -> str:
    return re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.*.", fqn)


def summarize(fqns: dict[str, str]) -> str:
    """``{fqn: reason}`` -> ``"layers.*.x (8, reason); output (reason)"``."""
    groups: dict[tuple[str, str], int] = {}
    for fqn, reason in fqns.items():
        key = (_layer_pattern(fqn), reason)
        groups[key] = groups.get(key, 0) + 1
    return "; ".join(
        f"{name} ({f'{n}, ' if n > 1 else ''}{reason})" for (name, reason), n in groups.items()
    )


def plan_linears(model: nn.Module, filter_fqns: list[str], recipe: str = "tensorwise",
                 what: str = "float8.filter_fqns") -> tuple[set[str], dict[str, str]]:
    """FQNs of the ``nn.Linear`` layers to convert, and ``{fqn: why}`` of those skipped."""
    fqns = [f for f in filter_fqns if f != AUTO_FILTER]
    auto = None
    if AUTO_FILTER in filter_fqns:
        from torchao.float8 import _auto_filter_for_recipe

        auto = _auto_filter_for_recipe(recipe, filter_fqns=fqns)
    from torchtitan.models.common.decoder import OutputHead  # a plain Linear too

    convert, skipped = set(), {}
    linears = [fqn for fqn, mod in model.named_modules() if type(mod) in (nn.Linear, OutputHead)]
    unmatched = [f for f in fqns if not any(f in fqn for fqn, _ in model.named_modules())]
    if unmatched:  # a typo ('outptu') would convert the very layer it meant to keep
        logger.warning(
            f"{what}: {', '.join(map(repr, unmatched))} matches no module of the model, so it "
            f"keeps nothing in high precision (Linear layers: "
            f"{', '.join(dict.fromkeys(map(_layer_pattern, linears))) or '-'}); "
            "an entry is a part of a module's name, e.g. output"
        )
    for fqn, mod in model.named_modules():
        if type(mod) not in (nn.Linear, OutputHead):  # not already converted
            continue
        out_features, in_features = mod.weight.shape
        if any(f in fqn for f in fqns):
            skipped[fqn] = what
        elif out_features % 16 or in_features % 16:
            skipped[fqn] = f"{out_features}x{in_features}: dims not multiples of 16"
        elif auto is not None and not auto(mod, fqn):
            skipped[fqn] = f"too small to gain ({AUTO_FILTER})"
        else:
            convert.add(fqn)
    return convert, skipped


def moe_filter(moe_fqns: list[str]):
    """Filter selecting the MoE ``GroupedExperts`` modules whose FQN contains an entry."""
    from torchtitan.models.common.moe import GroupedExperts

    def keep(mod: nn.Module, fqn: str) -> bool:
        return isinstance(mod, GroupedExperts) and any(f in fqn for f in moe_fqns)

    return keep


def count_moe(model: nn.Module, keep) -> int:
    return sum(1 for fqn, mod in model.named_modules() if keep(mod, fqn))


class Float8Converter(ModelConverter):
    name = "float8"

    @classmethod
    def check(cls, job_config: JobConfig) -> None:
        f8 = job_config.float8
        recipe = recipe_of(job_config.float8)
        if f8.enable_fsdp_float8_all_gather and recipe != "tensorwise":
            raise ConfigError(
                "float8.enable_fsdp_float8_all_gather needs tensorwise scaling, but "
                f"float8.recipe_name={recipe!r} (its weights are all-gathered in high precision): "
                "turn one of them off"
            )
        if AUTO_FILTER in f8.filter_fqns and recipe == "rowwise_with_gw_hp":
            raise ConfigError(
                f"float8.filter_fqns: {AUTO_FILTER} has no rule for recipe rowwise_with_gw_hp; "
                "use tensorwise or rowwise, or list the FQNs to skip"
            )

    @classmethod
    def check_device(cls, job_config: JobConfig, device_type: str) -> None:
        f8 = job_config.float8
        cap = cuda_capability() if device_type == "cuda" else None
        if not f8.emulate and not has_float8_hardware(device_type):
            raise ValueError(
                "model.converters float8 needs a GPU with float8 matmuls (CUDA compute "
                f"capability >= 8.9, e.g. H100); this machine has {describe_device(device_type)}: "
                "set --float8.emulate to train with emulated float8 (slow; for tests), or "
                "dry-run the layout with COMM_MODE=fake_backend"
            )
        if f8.emulate and cap is not None and cap < FLOAT8_CAPABILITY:
            compiled = job_config.compile.enable and "model" in job_config.compile.components
            if compiled:
                raise ValueError(
                    "float8.emulate with torch.compile needs compute capability >= 8.9 on CUDA "
                    f"(Triton emits float8 casts); this GPU is {describe_device(device_type)}: "
                    "turn compile off (--compile.no_enable)"
                )
        if f8.moe_fqns_prototype and (cap is None or cap < MOE_CAPABILITY):
            raise ValueError(
                f"float8.moe_fqns_prototype={f8.moe_fqns_prototype}: torchao's float8 grouped "
                "GEMMs need a CUDA GPU with compute capability >= 9.0 (torchao 0.18 has Triton "
                f"kernels for them, no CPU or emulated path); this machine has "
                f"{describe_device(device_type)}: leave it empty (--float8.moe_fqns_prototype=)"
            )

    @classmethod
    def prepare_dry_run(cls, job_config: JobConfig, device_type: str) -> list[str]:
        f8, changes = job_config.float8, []
        if not f8.emulate and not has_float8_hardware(device_type):
            f8.emulate = True
            changes.append("float8.emulate on (no float8 hardware here)")
        cap = cuda_capability() if device_type == "cuda" else None
        if f8.moe_fqns_prototype and (cap is None or cap < MOE_CAPABILITY):
            f8.moe_fqns_prototype = []
            changes.append("float8.moe_fqns_prototype emptied (float8 grouped GEMMs need CUDA)")
        return changes

    def __init__(self, job_config: JobConfig, parallel_dims: Any, device_type: str) -> None:
        super().__init__(job_config, parallel_dims, device_type)
        require_torchao("model.converters float8")
        from torchao.float8 import Float8LinearConfig

        f8 = job_config.float8
        self.recipe = recipe_of(job_config.float8)
        fsdp = bool(getattr(parallel_dims, "fsdp_enabled", False))
        self.all_gather = f8.enable_fsdp_float8_all_gather and fsdp
        if f8.enable_fsdp_float8_all_gather and not fsdp:
            logger.info("float8.enable_fsdp_float8_all_gather has no effect without FSDP")
        self.precompute = self.all_gather and f8.precompute_float8_dynamic_scale_for_fsdp
        if f8.precompute_float8_dynamic_scale_for_fsdp and not self.all_gather:
            logger.info(
                "float8.precompute_float8_dynamic_scale_for_fsdp has no effect without float8 "
                "all-gather (float8.enable_fsdp_float8_all_gather with FSDP)"
            )
        if self.recipe == "tensorwise":
            config = Float8LinearConfig(enable_fsdp_float8_all_gather=self.all_gather)
        else:
            config = Float8LinearConfig.from_recipe_name(self.recipe)
            if job_config.compile.enable:  # pytorch/pytorch#150859: match eager's rounding
                import torch._inductor.config as inductor_config

                inductor_config.emulate_precision_casts = True
        self.config = dataclasses.replace(config, emulate=f8.emulate)
        self.filter_fqns = list(f8.filter_fqns)
        self.moe_fqns = list(f8.moe_fqns_prototype)
        self.linears = converts_linears(job_config.model.converters, self.name)

    @property
    def float8_tensorwise_tp(self) -> bool:
        return self.linears and self.recipe == "tensorwise"

    def convert(self, model: nn.Module) -> None:
        # MoE first: torchao's quantize_ would turn Float8Linear layers back into nn.Linear.
        if self.moe_fqns:
            from torchao.prototype.moe_training.config import Float8TrainingOpConfig
            from torchao.quantization import quantize_

            keep = moe_filter(self.moe_fqns)
            n_moe = count_moe(model, keep)
            if not n_moe:
                logger.warning(
                    f"float8.moe_fqns_prototype={self.moe_fqns} matches no MoE experts of the model"
                )
            quantize_(model, config=Float8TrainingOpConfig(), filter_fn=keep)
            logger.info(f"float8: {n_moe} MoE expert groups use float8 rowwise grouped GEMMs")
        if not self.linears:  # upstream's quantize.grouped_mm.float8 alone: MoE experts only
            logger.info("float8: Linear layers stay in high precision (no quantize.linear.float8)")
            return
        from torchao.float8 import convert_to_float8_training

        chosen, skipped = plan_linears(model, self.filter_fqns, self.recipe)
        convert_to_float8_training(
            model, config=self.config, module_filter_fn=lambda _mod, fqn: fqn in chosen
        )
        mode = "emulated" if self.config.emulate else "float8 matmuls"
        gather = ", float8 FSDP all-gather" if self.all_gather else ""
        gather += ", precomputed scales" if self.precompute else ""
        logger.info(
            f"float8: converted {len(chosen)} Linear layers to Float8Linear ({self.recipe}, "
            f"{mode}{gather}); skipped {len(skipped)}: {summarize(skipped) or '-'}"
        )
        if not chosen:
            logger.warning("float8: no Linear layer was converted; the run trains in high precision")

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        if not self.precompute:
            return
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)
