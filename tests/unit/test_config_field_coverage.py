"""No accepted-but-ignored setting: every JobConfig field is read by the code, or listed.

A field counts as *read* when a torchtitan/ source file (other than the schema, the legacy
key table and the rule/planned lists, which name every field without acting on it) reads it:

* ``x.section.name`` or ``getattr(x.section, "name")`` -- an attribute load of the field on
  its section -- anywhere; or
* ``.name`` (or ``getattr(x, "name")``) in a file that also refers to the field's section,
  by attribute (``cfg.section``) or by importing the section's class from job_config.py;
  when ``name`` is unique in the schema the section reference is not needed.

Otherwise the field must be listed in torchtitan/config/planned.py: ``PLANNED_FIELDS``
(the trainer refuses a non-default value) or ``METADATA_FIELDS`` (describes the config, by
design not acted on). An obsolete field is dropped through a legacy.py rule instead.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from collections import Counter
from pathlib import Path

import pytest

from torchtitan.config import legacy
from torchtitan.config.job_config import JobConfig, Training
from torchtitan.config.planned import METADATA_FIELDS, PLANNED_FIELDS

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "torchtitan"
NOT_READERS = {
    "torchtitan/config/job_config.py",  # the schema
    "torchtitan/config/scale_sections.py",  # the schema's scale-out sections
    "torchtitan/config/legacy.py",  # old key names
    "torchtitan/config/validation.py",  # range rules name fields without using them
    "torchtitan/config/planned.py",  # the lists themselves
}
JOB_CONFIG_MODULES = {
    "torchtitan.config.job_config", "torchtitan.config.scale_sections", "torchtitan.config"
}


@dataclasses.dataclass
class Reads:
    """What one source file reads."""

    attrs: set[str] = dataclasses.field(default_factory=set)
    """Attribute names loaded (``x.name``) or passed to getattr/hasattr as a constant."""

    pairs: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    """(owner, name) for ``<...>.owner.name`` loads and ``getattr(<...>.owner, "name")``."""

    classes: set[str] = dataclasses.field(default_factory=set)
    """Names imported from torchtitan/config/job_config.py."""


def scan_source(source: str) -> Reads:
    reads = Reads()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            reads.attrs.add(node.attr)
            if isinstance(node.value, ast.Attribute):
                reads.pairs.add((node.value.attr, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name = node.args[1].value
            reads.attrs.add(name)
            if isinstance(node.args[0], ast.Attribute):
                reads.pairs.add((node.args[0].attr, name))
        elif isinstance(node, ast.ImportFrom) and node.module in JOB_CONFIG_MODULES:
            reads.classes.update(alias.name for alias in node.names)
    return reads


def reader_files() -> dict[str, Reads]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel not in NOT_READERS:
            out[rel] = scan_source(path.read_text())
    return out


def schema(cls: type, prefix: str = "") -> tuple[dict[str, type], dict[str, type]]:
    """(leaf key -> owning section class, section key -> section class) of a config class."""
    leaves: dict[str, type] = {}
    sections: dict[str, type] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            sections[key] = tp
            sub_leaves, sub_sections = schema(tp, key + ".")
            leaves.update(sub_leaves)
            sections.update(sub_sections)
        else:
            leaves[key] = cls
    return leaves, sections


def is_read(key: str, owner: type, files: dict[str, Reads], ambiguous: set[str]) -> bool:
    section, _, name = key.rpartition(".")
    section_attr = section.rpartition(".")[2]
    for reads in files.values():
        if (section_attr, name) in reads.pairs:
            return True
        if name in reads.attrs:
            if name not in ambiguous:
                return True
            if section_attr in reads.attrs or owner.__name__ in reads.classes:
                return True
    return False


def unread_fields(cls: type, files: dict[str, Reads]) -> list[str]:
    """Fields of ``cls`` that no file reads and no list in planned.py names."""
    leaves, sections = schema(cls)
    counts = Counter(k.rpartition(".")[2] for k in [*leaves, *sections])
    ambiguous = {name for name, n in counts.items() if n > 1}
    listed = set(PLANNED_FIELDS) | set(METADATA_FIELDS)
    return [
        key
        for key, owner in leaves.items()
        if key not in listed and not is_read(key, owner, files, ambiguous)
    ]


@pytest.fixture(scope="module")
def files() -> dict[str, Reads]:
    return reader_files()


def test_every_field_is_read_or_listed(files):
    unread = unread_fields(JobConfig, files)
    assert not unread, (
        f"JobConfig fields that no code under torchtitan/ reads: {unread}. Read them where "
        "their feature is implemented, list them in torchtitan/config/planned.py "
        "(PLANNED_FIELDS: refused when set; METADATA_FIELDS: describes the config), or drop "
        "an obsolete field with a legacy.py rule (new=None)."
    )


def stale_planned(planned: dict[str, str], files: dict[str, Reads]) -> list[str]:
    """Planned fields the code reads directly (``x.section.name``): implemented by now."""
    return [
        key
        for key in planned
        if any(tuple(key.split(".")[-2:]) in reads.pairs for reads in files.values())
    ]


def test_planned_entries_are_still_unread(files):
    """A planned field the code now reads is implemented: delete its PLANNED_FIELDS entry."""
    stale = stale_planned(PLANNED_FIELDS, files)
    assert not stale, f"remove these from PLANNED_FIELDS in torchtitan/config/planned.py: {stale}"


def test_a_stale_planned_entry_is_caught(files):
    planned = {**PLANNED_FIELDS, "job.use_for_integration_test": "a feature that got built"}
    source = "def f(cfg):\n    return cfg.job.use_for_integration_test\n"
    reader = {"torchtitan/job.py": scan_source(source)}
    assert stale_planned(planned, files) == []
    assert stale_planned(planned, {**files, **reader}) == ["job.use_for_integration_test"]


def test_an_added_unread_field_is_caught(files):
    """The check works: a new leaf in an existing section and a new section are reported."""

    @dataclasses.dataclass
    class MoreTraining(Training):
        dummy_unread_knob: int = 0

    @dataclasses.dataclass
    class Gadget:
        sprocket_teeth: int = 12

    extended = dataclasses.make_dataclass(
        "JobConfig",
        [
            ("training", MoreTraining, dataclasses.field(default_factory=MoreTraining)),
            ("gadget", Gadget, dataclasses.field(default_factory=Gadget)),
        ],
        bases=(JobConfig,),
    )
    added = set(unread_fields(extended, files)) - set(unread_fields(JobConfig, files))
    assert added == {"gadget.sprocket_teeth", "training.dummy_unread_knob"}


def test_scanner_recognises_reads():
    reads = scan_source(
        "from torchtitan.config.job_config import Checkpoint as C\n"
        "def f(cfg, ck: C):\n"
        "    a = cfg.float8.emulate\n"
        "    b = getattr(cfg.debug, 'seed')\n"
        "    cfg.job.description = 'x'\n"  # a store is not a read
        "    return ck.enable\n"
    )
    assert ("float8", "emulate") in reads.pairs and ("debug", "seed") in reads.pairs
    assert "description" not in reads.attrs and "enable" in reads.attrs
    assert reads.classes == {"Checkpoint"}


def test_dropped_legacy_keys_are_not_fields():
    """A dropped (obsolete) key must not shadow a live field, or its value would be ignored."""
    leaves, sections = schema(JobConfig)
    for rule in legacy.RULES:
        if rule.new is None:
            prefix = rule.old[:-2] if rule.old.endswith(".*") else None
            if prefix is None:
                assert rule.old not in leaves, rule.old
            else:
                assert prefix not in sections and not any(
                    k.startswith(prefix + ".") for k in leaves
                ), rule.old


def test_lists_do_not_overlap():
    assert not set(PLANNED_FIELDS) & set(METADATA_FIELDS)
