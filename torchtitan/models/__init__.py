"""Model registry: ``model.name`` -> ``ModelSpec``.

Built-in families (``_BUILTIN_FAMILIES``: every folder here but ``common``) are imported on
first lookup, so all of them are known and suggested from the first error on. A family
is one folder ``torchtitan/models/<name>/`` whose ``__init__`` calls ``register_model_spec``; such a
folder is imported automatically when ``get_model_spec("<name>")`` is first asked for it.
"""

from __future__ import annotations

import importlib
import importlib.util

from torchtitan.models.spec import LazyCallable, ModelSpec, did_you_mean, lazy

__all__ = [
    "LazyCallable",
    "ModelSpec",
    "get_model_spec",
    "lazy",
    "list_model_specs",
    "register_model_spec",
]

_BUILTIN_FAMILIES = ("llama3", "llama2", "qwen3", "deepseek_v3", "gpt_oss")
_REGISTRY: dict[str, ModelSpec] = {}
_builtins_loaded = False


def register_model_spec(spec: ModelSpec) -> None:
    """Register ``spec`` under ``spec.name``; ValueError if another spec has that name."""
    existing = _REGISTRY.get(spec.name)
    if existing is not None and existing is not spec:
        raise ValueError(f"a model spec named {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for family in _BUILTIN_FAMILIES:
            importlib.import_module(f"{__name__}.{family}")


def _try_import_family(name: str) -> None:
    if not name.isidentifier():
        return
    module_name = f"{__name__}.{name}"
    if importlib.util.find_spec(module_name) is not None:
        importlib.import_module(module_name)


def list_model_specs() -> list[str]:
    """Names of the registered model families (built-ins included), sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def get_model_spec(name: str) -> ModelSpec:
    """The spec registered as ``name``; ValueError listing the known names otherwise."""
    _load_builtins()
    if name not in _REGISTRY:
        _try_import_family(name)
    if name not in _REGISTRY:
        known = sorted(_REGISTRY)
        suggestion = did_you_mean(name, known)
        raise ValueError(
            f"model.name {name!r} is not a registered model; known models: "
            f"{', '.join(known)}.{suggestion}"
        )
    return _REGISTRY[name]
