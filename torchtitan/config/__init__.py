"""Job configuration: the JobConfig schema and the manager that resolves it.

``ConfigManager``/``ConfigError`` and friends are imported lazily so that
``python -m torchtitan.config.manager`` runs without a double-import warning.
"""

from importlib import import_module
from typing import Any

from torchtitan.config.job_config import JobConfig

_LAZY_EXPORTS = {
    "ConfigError": "torchtitan.config.errors",
    "ConfigManager": "torchtitan.config.manager",
    "config_save_path": "torchtitan.config.toml_io",
    "config_to_toml": "torchtitan.config.toml_io",
    "parse_args_or_exit": "torchtitan.config.manager",
    "reject_planned_settings": "torchtitan.config.planned",
    "save_config": "torchtitan.config.toml_io",
}

__all__ = ["JobConfig", *_LAZY_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _LAZY_EXPORTS.get(name)
    if module is not None:
        return getattr(import_module(module), name)
    raise AttributeError(f"module 'torchtitan.config' has no attribute {name!r}")
