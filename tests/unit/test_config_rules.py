"""Validation rules name real JobConfig fields; a rule with a typo fails loudly, never skips."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchtitan.config import planned, validation
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ConfigManager

RULE_LISTS = {
    "validation.CHECKS": validation.CHECKS,
    "planned.PLANNED_FIELDS": planned.PLANNED_FIELDS,
    "planned.METADATA_FIELDS": planned.METADATA_FIELDS,
}


@pytest.mark.parametrize("name", sorted(RULE_LISTS))
def test_every_rule_key_is_a_jobconfig_field(name):
    assert validation.unknown_rule_keys(RULE_LISTS[name]) == []


def test_unknown_rule_keys_reports_typos():
    keys = ["training.steps", "training.stpes", "bogus.section", "training"]
    assert validation.unknown_rule_keys(keys) == ["training.stpes", "bogus.section", "training"]


def _exec_with(module, anchor: str, inserted: str) -> None:
    """Run ``module``'s source with ``inserted`` after ``anchor`` (a fresh copy, not imported)."""
    source = Path(module.__file__).read_text()
    assert anchor in source
    code = compile(source.replace(anchor, anchor + inserted), module.__file__, "exec")
    exec(code, {"__name__": f"{module.__name__}_copy"})


def test_validation_module_refuses_to_load_with_a_bogus_rule():
    _exec_with(validation, "CHECKS: dict[str, Check] = {\n", "")  # the unchanged copy loads
    with pytest.raises(RuntimeError, match=r"CHECKS names fields .*'training\.stpes'"):
        _exec_with(validation, "CHECKS: dict[str, Check] = {\n", '    "training.stpes": _gt(0),\n')


def test_planned_module_refuses_to_load_with_a_bogus_field():
    anchor = "PLANNED_FIELDS: dict[str, str] = {"
    _exec_with(planned, anchor, "")
    with pytest.raises(RuntimeError, match=r"'float8\.recipe'"):
        _exec_with(planned, anchor, '"float8.recipe": "float8 training"')


def test_validate_does_not_skip_a_rule_it_cannot_apply(monkeypatch):
    monkeypatch.setitem(validation.CHECKS, "training.stpes", (lambda v: True, "x"))
    with pytest.raises(AttributeError, match="stpes"):
        validation.validate(JobConfig())


def test_rules_apply_to_custom_config_classes():
    cfg = ConfigManager().parse_args(
        ["--job.custom_config_module", "tests.assets.custom_job_config_merge"]
    )
    assert type(cfg) is not JobConfig
    validation.validate(cfg)
    assert planned.planned_settings(cfg) == []
