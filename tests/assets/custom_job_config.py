"""A user's JobConfig extension (used by tests of --job.custom_config_module): a subclass."""

from dataclasses import dataclass, field

from torchtitan.config.job_config import JobConfig as BaseJobConfig
from torchtitan.config.job_config import Training as BaseTraining


@dataclass
class CustomSection:
    how_many: int = 3
    """How many widgets to build."""

    tags: list[str] = field(default_factory=list)
    """Widget tags (comma separated)."""

    verbose: bool = False
    """Talk about the widgets."""


@dataclass
class Training(BaseTraining):
    my_knob: float = 0.5
    """An extra training knob."""


@dataclass
class JobConfig(BaseJobConfig):
    custom_section: CustomSection = field(default_factory=CustomSection)
    training: Training = field(default_factory=Training)
