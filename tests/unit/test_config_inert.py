"""A flag whose feature is switched off warns that it does nothing (torchtitan/config/inert.py):
``--validation.freq 5`` without ``--validation.enable`` used to be accepted in silence."""

from __future__ import annotations

import logging

import pytest

from tests.conftest import REPO_ROOT
from torchtitan.config.inert import INERT_RULES, inert_flags
from torchtitan.config.manager import ConfigManager

DEBUG = str(REPO_ROOT / "train_configs" / "debug_model.toml")

# For each rule (by its first flag): the flags that switch its feature on.
SWITCH_ON = {
    "validation.dataset": ["--validation.enable"],
    "checkpoint.interval": ["--checkpoint.enable"],
    "checkpoint.export_dtype": ["--checkpoint.enable", "--checkpoint.last_save_model_only"],
    "checkpoint.last_save_in_hf_allow_lossy": ["--checkpoint.enable", "--checkpoint.last_save_in_hf"],
    "profiling.save_traces_folder": ["--profiling.enable_profiling"],
    "profiling.profile_freq": ["--profiling.enable_memory_snapshot"],
    "profiling.save_memory_snapshot_folder": ["--profiling.enable_memory_snapshot"],
    "metrics.save_tb_folder": ["--metrics.enable_tensorboard"],
    "metrics.save_for_all_ranks": ["--metrics.enable_wandb"],
    "compile.components": ["--compile.enable"],
    "parallelism.module_fqns_per_model_part": ["--parallelism.pipeline_parallel_degree", "2"],
    "parallelism.context_parallel_rotate_method": ["--parallelism.context_parallel_degree", "2"],
    "parallelism.enable_async_tensor_parallel": ["--parallelism.tensor_parallel_degree", "2"],
    "parallelism.enable_compiled_autograd": ["--compile.enable",
                                             "--parallelism.data_parallel_replicate_degree", "2"],
    "activation_checkpoint.selective_ac_option": ["--activation_checkpoint.mode", "selective"],
    "activation_checkpoint.memory_budget": ["--activation_checkpoint.mode", "memory_budget",
                                            "--compile.enable"],
    "float8.recipe_name": ["--model.converters", "float8"],
    "mx.recipe_name": ["--model.converters", "mx"],
    "fault_tolerance.process_group": ["--fault_tolerance.enable", "--fault_tolerance.group_size",
                                      "2"],
}
RULES = {keys[0]: keys for keys, _, _ in INERT_RULES}


def cfg_of(*flags: str):
    return ConfigManager().parse_args(["--job.config_file", DEBUG, "--activation_checkpoint.mode",
                                       "none", *flags])


def test_every_rule_has_a_switch_case():
    assert set(SWITCH_ON) == set(RULES)


@pytest.mark.parametrize("first", sorted(RULES))
def test_each_flag_warns_while_its_feature_is_off_and_not_once_it_is_on(first):
    keys = RULES[first]
    off = cfg_of()
    lines = inert_flags(off, keys)
    assert len(lines) == 1, lines
    assert lines[0].startswith(", ".join(f"--{k}" for k in keys) + " ")
    assert " no effect: " in lines[0]
    assert inert_flags(cfg_of(*SWITCH_ON[first]), keys) == []


def test_flags_warn_and_toml_settings_do_not(caplog):
    """debug_model.toml sets checkpoint.interval and profiling.profile_freq with both features
    off (as every bundled config does): no line. The same keys as flags: a line each."""
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        cfg_of("--training.steps", "3")
        assert "no effect" not in caplog.text
        cfg_of("--validation.freq", "5", "--validation.steps", "2", "--checkpoint.interval", "3",
               "--parallelism.pipeline_parallel_schedule", "GPipe",
               "--activation_checkpoint.selective_ac_option", "op")
    lines = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert lines == [
        "--validation.freq, --validation.steps have no effect: validation.enable is off "
        "(add --validation.enable)",
        "--checkpoint.interval has no effect: checkpoint.enable is off (add --checkpoint.enable)",
        "--parallelism.pipeline_parallel_schedule has no effect: "
        "parallelism.pipeline_parallel_degree=1",
        "--activation_checkpoint.selective_ac_option has no effect: "
        "activation_checkpoint.mode='none', not 'selective'",
    ]
