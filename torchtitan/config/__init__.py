"""Job configuration: the JobConfig schema and the manager that resolves it."""

from torchtitan.config.job_config import JobConfig

__all__ = ["JobConfig"]
