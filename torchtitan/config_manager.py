"""``python -m torchtitan.config_manager [flags]``: print the resolved job config.

Same tool as ``python -m torchtitan.config.manager``; the API lives in
:mod:`torchtitan.config.manager` and is re-exported here for old imports.
"""

from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import (
    ConfigError,
    ConfigManager,
    config_save_path,
    config_to_toml,
    main,
    parse_args_or_exit,
    reject_planned_settings,
    save_config,
)

__all__ = [
    "ConfigError",
    "ConfigManager",
    "JobConfig",
    "config_save_path",
    "config_to_toml",
    "main",
    "parse_args_or_exit",
    "reject_planned_settings",
    "save_config",
]

if __name__ == "__main__":
    raise SystemExit(main())
