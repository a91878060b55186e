"""Job configuration: the JobConfig schema and the manager that resolves it.

``ConfigManager``/``ConfigError`` and friends are imported lazily so that
``python -m torchtitan.config.manager`` runs without a double-import warning.
"""

from typing import Any

from torchtitan.config.job_config import JobConfig

_MANAGER_EXPORTS = (
    "ConfigError",
    "ConfigManager",
    "config_save_path",
    "config_to_toml",
    "parse_args_or_exit",
    "reject_planned_settings",
    "save_config",
)

__all__ = ["JobConfig", *_MANAGER_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _MANAGER_EXPORTS:
        import torchtitan.config.manager as manager

        return getattr(manager, name)
    raise AttributeError(f"module 'torchtitan.config' has no attribute {name!r}")
