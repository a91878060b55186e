"""Settings whose feature is planned but not built yet, and settings that only describe the run.

Every JobConfig field is either read by the code that runs a job or listed here
(tests/unit/test_config_field_coverage.py enforces it), so no setting is accepted and then
silently ignored:

* :data:`PLANNED_FIELDS` keep their keys (TOML files written for upstream torchtitan set
  them), but a value other than the default is refused before training starts by
  :func:`reject_planned_settings`. Whoever implements a feature deletes its entries here.
* :data:`METADATA_FIELDS` describe the config itself; no training code acts on them by design.

Empty today. Some settings are refused in some layouts with their own message instead
(``parallelism.expert_tensor_parallel_degree`` that does not divide the TP degree,
``optimizer.early_step_in_backward`` with clipping or pipeline parallel...), and two upstream keys whose features this build lacks
(``parallelism.expert_parallel_comm_backend`` other than "standard",
``parallelism.pipeline_parallel_expert_parallel_overlap``) are legacy rules that drop
upstream's default and refuse any other value (config/legacy.py).
"""

from __future__ import annotations

from typing import Any

from torchtitan.config.errors import ConfigError
from torchtitan.config.fields import field_default, get_field
from torchtitan.config.validation import unknown_rule_keys

__all__ = [
    "METADATA_FIELDS",
    "PLANNED_FIELDS",
    "planned_settings",
    "reject_planned_settings",
]

PLANNED_FIELDS: dict[str, str] = {}
"""Field -> the feature area it belongs to. Delete an entry when its feature is implemented."""

METADATA_FIELDS: dict[str, str] = {
    "job.config_file": "set by the config manager to the file the config was read from",
    "job.custom_config_module": "read by the config manager to pick the config class",
    "job.use_for_integration_test": "marks a bundled config for the integration test suite",
}
"""Field -> why no training code acts on it."""


def planned_settings(cfg: Any) -> list[tuple[str, Any, str]]:
    """(key, value, feature area) of each planned field that ``cfg`` sets to a non-default."""
    found = []
    for key, area in PLANNED_FIELDS.items():
        value = get_field(cfg, key)
        if value != field_default(type(cfg), key):
            found.append((key, value, area))
    return found


def planned_message(key: str, value: Any, area: str) -> str:
    return f"{key}={value!r} is planned but not implemented yet ({area})"


def reject_planned_settings(cfg: Any) -> None:
    """Raise ConfigError (one line) if ``cfg`` sets a planned-but-unimplemented field."""
    found = planned_settings(cfg)
    if not found:
        return
    message = planned_message(*found[0]) + "; remove it or leave the default"
    if len(found) > 1:
        others = ", ".join(f"{key}={value!r}" for key, value, _ in found[1:])
        message += f" (also planned: {others})"
    raise ConfigError(message)


_UNKNOWN = unknown_rule_keys([*PLANNED_FIELDS, *METADATA_FIELDS])
if _UNKNOWN:
    raise RuntimeError(
        f"torchtitan/config/planned.py names fields JobConfig does not have: {_UNKNOWN}"
    )
