"""``ModelSpec``: everything the trainer needs to build and train one model family."""

from __future__ import annotations

import copy
import difflib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class LazyCallable:
    """A callable named by ``"package.module:attr"``, imported on first call.

    Lets a spec reference builders whose modules may not exist yet (or are heavy to import)
    without importing them when the spec is registered.
    """

    def __init__(self, target: str):
        if ":" not in target:
            raise ValueError(f"lazy target {target!r} must look like 'package.module:function'")
        self.target = target
        self._fn: Callable[..., Any] | None = None

    def resolve(self) -> Callable[..., Any]:
        """Import and return the target; ImportError with the target's path if it is missing."""
        if self._fn is None:
            module_name, attr = self.target.split(":", 1)
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as e:
                raise ImportError(
                    f"{self.target} is not available: module {module_name} cannot be imported ({e})"
                ) from e
            try:
                self._fn = getattr(module, attr)
            except AttributeError as e:
                raise ImportError(
                    f"{self.target} is not available: {module_name} has no attribute {attr!r}"
                ) from e
        return self._fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LazyCallable({self.target!r})"


def did_you_mean(name: str, known: list[str]) -> str:
    """`` Did you mean 'x'?`` for the closest of ``known`` (case-insensitive), or ``""``."""
    lowered = {k.lower(): k for k in known}
    hint = difflib.get_close_matches(name.lower(), list(lowered), n=1)
    return f" Did you mean {lowered[hint[0]]!r}?" if hint else ""


def lazy(target: str) -> LazyCallable:
    """Shorthand for ``LazyCallable(target)``; ``target`` is ``"package.module:attr"``."""
    return LazyCallable(target)


def _default(target: str):
    return field(default_factory=lambda: lazy(target))


@dataclass
class ModelSpec:
    """A model family: its class, flavors (name -> args) and the hooks that build a run.

    The hooks default to what every decoder family shares: the decoder parallelization with
    the default TP plan, the decoder pipeline split, the text tokenizer, dataloader and loss.
    A family with its own TP plan names its ``parallelize_fn``.
    """

    name: str
    model_cls: type
    model_args: dict[str, Any]
    """Flavor name -> model-args object (e.g. ``TransformerModelArgs``); never mutate these."""
    parallelize_fn: Callable[..., Any] | None = _default(
        "torchtitan.distributed.parallelize:parallelize_decoder"
    )
    pipelining_fn: Callable[..., Any] | None = _default(
        "torchtitan.distributed.parallelize:pipeline_decoder"
    )
    build_tokenizer_fn: Callable[..., Any] | None = _default(
        "torchtitan.components.tokenizer:build_tokenizer"
    )
    build_dataloader_fn: Callable[..., Any] | None = _default(
        "torchtitan.datasets.hf_datasets:build_text_dataloader"
    )
    build_loss_fn: Callable[..., Any] = _default(
        "torchtitan.components.loss:build_cross_entropy_loss"
    )
    """``build_loss_fn(compile: bool, backend: str)`` -> summed token loss ``fn(pred, labels)``."""
    state_dict_adapter: Any | None = None
    """HF <-> torchtitan state-dict converter class (None: not available); a subclass of
    ``models/common/hf_adapter.HFStateDictAdapter``."""
    hf_model_types: tuple[str, ...] = ()
    """The HF ``config.json`` ``model_type`` values this family reads and writes (e.g.
    ``("qwen3", "qwen3_moe")``); HF imports find the family from them (``models/hf_lookup.py``)."""

    @property
    def flavors(self) -> list[str]:
        """Flavor names, in registration order."""
        return list(self.model_args)

    def get_model_args(self, flavor: str) -> Any:
        """A deep copy of ``flavor``'s args (safe to mutate); ValueError for unknown flavors."""
        if flavor not in self.model_args:
            suggestion = did_you_mean(flavor, self.flavors)
            raise ValueError(
                f"model.flavor {flavor!r} is not a flavor of model {self.name!r}; "
                f"known flavors: {', '.join(self.flavors)}.{suggestion}"
            )
        return copy.deepcopy(self.model_args[flavor])
