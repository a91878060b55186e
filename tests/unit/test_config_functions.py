"""``--module M --config F`` naming a Python function that returns a JobConfig (upstream's
config-registry style), with CLI flags on top; TOML files keep precedence."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.conftest import REPO_ROOT
from torchtitan.config.manager import ConfigError, ConfigManager, main

FUNCS = ("--module", "tests.assets.config_functions")


def parse(*argv: str):
    return ConfigManager().parse_args(list(argv))


def test_function_config_with_cli_overrides():
    cfg = parse(*FUNCS, "--config", "tiny_debug", "--training.steps", "5",
                "--profiling.no_enable_memory_snapshot")
    assert (cfg.model.flavor, cfg.training.seq_len) == ("debugmodel_tiny", 64)  # the function
    assert cfg.training.steps == 5 and cfg.profiling.enable_memory_snapshot is False  # the CLI
    assert parse(*FUNCS, "--config", "tiny_debug").profiling.enable_memory_snapshot is True


def test_config_tool_prints_and_checks_a_function_config(capsys):
    assert main([*FUNCS, "--config", "tiny_debug", "--check"]) == 0
    assert capsys.readouterr().out == "ok: llama3 debugmodel_tiny on 1 rank(s) (one rank), 3 steps\n"
    assert main([*FUNCS, "--config", "tiny_debug"]) == 0
    assert 'flavor = "debugmodel_tiny"\n' in capsys.readouterr().out


def test_help_shows_the_functions_values(capsys):
    with pytest.raises(SystemExit) as info:
        parse(*FUNCS, "--config", "tiny_debug", "--help")
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--training.seq_len INT" in out and "(default: 64)" in out


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ("not_a_config", "config function tests.assets.config_functions.not_a_config() must "
                         "return a JobConfig (or a subclass), got dict"),
        ("broken", "config function tests.assets.config_functions.broken() failed: the cluster "
                   "table is unreachable"),
        ("nothing_here", "no function nothing_here() in "
                         "torchtitan.models.tests.assets.config_functions.config_registry or "
                         "tests.assets.config_functions"),
    ],
)
def test_bad_function_configs_are_one_line(config, needle):
    with pytest.raises(ConfigError) as info:
        parse(*FUNCS, "--config", config)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_toml_keeps_precedence():
    cfg = parse("--module", "llama3", "--config", "llama3_debugmodel")
    assert cfg.job.config_file.endswith("train_configs/debug_model.toml")


@pytest.mark.slow
def test_run_train_trains_from_a_function_config(cpu_env, dump_folder):
    env = dict(cpu_env, MODULE="tests.assets.config_functions", CONFIG="tiny_debug")
    proc = subprocess.run(
        ["./run_train.sh", "--training.steps", "2", "--job.dump_folder", str(dump_folder),
         "--profiling.no_enable_memory_snapshot", "--metrics.disable_color_printing"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert len(re.findall(r"step:\s*\d+\s+loss:", out)) == 2, out[-3000:]
    assert "Training completed" in out
