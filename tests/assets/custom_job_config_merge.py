"""A user's JobConfig extension in upstream's style: not a subclass, merged by the manager."""

from dataclasses import dataclass, field


@dataclass
class Training:
    extra_steps: int = 11
    """Extra steps (merged into [training])."""


@dataclass
class Widgets:
    color: str = "blue"
    """Widget colour."""


@dataclass
class JobConfig:
    training: Training = field(default_factory=Training)
    widgets: Widgets = field(default_factory=Widgets)
