"""Bad inputs found by probing the trainer and the launcher with ~220 user mistakes: each is
one clear line naming its setting (exit 2 through the entry points), or a warning where the
run can go on."""

from __future__ import annotations

import pytest

from tests.unit.test_preflight_files import cfg_of, refused
from torchtitan.config.manager import main

EXITS_ON_IMPORT = {
    "exiter": ("import sys\nsys.exit(3)\n", "exited while importing (sys.exit(3)): a module to "
               "import must not exit or parse the command line"),
    "argparser": (
        "import argparse\nparser = argparse.ArgumentParser()\nparser.add_argument('--foo')\n"
        "parser.parse_args()\n",
        "exited while importing (sys.exit(2) after printing '",
    ),
}


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    for name, (source, _) in EXITS_ON_IMPORT.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("name", sorted(EXITS_ON_IMPORT))
def test_custom_import_that_exits_is_one_line_naming_the_setting(user_modules, capsys, name):
    """A module calling sys.exit (or argparse reading the trainer's flags) at import ended the
    run with its own exit code and no word, or with argparse's usage, as if the trainer's
    flags were wrong."""
    message = refused(user_modules, "--experimental.custom_import", name)
    assert message.startswith(f"experimental.custom_import={name!r} {EXITS_ON_IMPORT[name][1]}")
    assert "usage:" not in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(EXITS_ON_IMPORT))
def test_custom_config_module_that_exits_is_one_line_and_exit_2(user_modules, capsys, name):
    assert main(["--job.custom_config_module", name]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: job.custom_config_module={name!r} "
                             f"{EXITS_ON_IMPORT[name][1]}")


def test_a_module_printing_while_it_imports_still_prints(user_modules, capsys):
    (user_modules / "chatty.py").write_text("import sys\nprint('registered', file=sys.stderr)\n")
    refused_or_not = cfg_of(user_modules, "--experimental.custom_import", "chatty")
    from torchtitan.plan import import_custom_module

    import_custom_module(refused_or_not.experimental)
    assert capsys.readouterr().err == "registered\n"


@pytest.mark.parametrize("name", [".register", ".."])
def test_relative_custom_import_is_named(tmp_path, name):
    message = refused(tmp_path, "--experimental.custom_import", name)
    assert message == (f"experimental.custom_import={name!r} is a relative module name: give "
                       "the module's full dotted name on the Python path (e.g. "
                       "my_pkg.register_model)")


def test_toml_with_a_byte_order_mark_is_read(tmp_path, capsys):
    """Windows editors may start a UTF-8 file with a BOM; it read as 'invalid TOML at line 1'."""
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[training]\nsteps = 7\n")
    assert main(["--job.config_file", str(path)]) == 0
    assert "\nsteps = 7\n" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value", [
    ("--training.steps", "99999999999999999999"),
    ("--debug.seed", "-99999999999999999999"),
    ("--checkpoint.interval", str(2**63)),
])
def test_integers_beyond_64_bits_are_refused(capsys, flag, value):
    """``steps = 99999999999999999999`` trained on as if it were a number of steps."""
    assert main([flag, value]) == 2
    key = flag[2:]
    assert capsys.readouterr().err == (
        f"error: {key} {value} does not fit in a 64-bit integer (at most {2**63 - 1})\n")


def test_start_fresh_with_a_load_step_is_refused(capsys):
    """load_step won: the run loaded step-1 and set the newer checkpoints aside, in the folder
    start_fresh promises to leave untouched."""
    assert main(["--checkpoint.enable", "--checkpoint.start_fresh", "--checkpoint.load_step",
                 "1"]) == 2
    assert capsys.readouterr().err == (
        "error: checkpoint.start_fresh loads nothing, and checkpoint.load_step=1 asks to load "
        "step-1: drop one of them\n")


@pytest.mark.parametrize("flags, warned", [
    (["--checkpoint.no_last_save_model_only"], True),
    (["--checkpoint.no_last_save_model_only", "--checkpoint.last_save_in_hf"], False),
    (["--checkpoint.last_save_model_only"], False),
])
def test_export_dtype_of_full_checkpoints_is_warned(caplog, flags, warned):
    """Every save kept the float32 training state: --checkpoint.export_dtype did nothing."""
    assert main(["--checkpoint.enable", *flags, "--checkpoint.export_dtype", "bfloat16"]) == 0
    assert ("--checkpoint.export_dtype has no effect: it is the dtype of a last save holding "
            "the model only" in caplog.text) is warned


@pytest.mark.parametrize("what", ["float8.filter_fqns", "mx.filter_fqns"])
def test_a_filter_entry_matching_no_module_is_warned(caplog, what):
    """``--float8.filter_fqns outptu`` converted the output layer it meant to keep, silently."""
    from torch import nn

    from torchtitan.components.float8 import plan_linears

    model = nn.ModuleDict({"layers": nn.ModuleDict({"0": nn.ModuleDict({
        "wq": nn.Linear(32, 32)})}), "output": nn.Linear(32, 64)})
    chosen, _ = plan_linears(model, ["outptu", "wq"], what=what)
    assert chosen == {"output"}
    assert (f"{what}: 'outptu' matches no module of the model, so it keeps nothing in high "
            "precision (Linear layers: layers.*.wq, output)") in caplog.text
    caplog.clear()
    assert plan_linears(model, ["output"], what=what)[0] == {"layers.0.wq"}
    assert "matches no module" not in caplog.text


def test_a_negative_microbatch_count_is_refused_on_one_stage_too(tmp_path, capsys):
    """From a TOML file with one pipeline stage, -4 microbatches passed without a word."""
    path = tmp_path / "job.toml"
    path.write_text("[parallelism]\npipeline_parallel_microbatches = -4\n")
    assert main(["--job.config_file", str(path)]) == 2
    assert capsys.readouterr().err == (
        "error: parallelism.pipeline_parallel_microbatches must be >= 1 (or None), got -4\n")


def test_several_ranks_without_a_rendezvous_address_name_the_launcher(monkeypatch):
    """WORLD_SIZE=2 with ``python -m``: torch's 'env:// rendezvous: MASTER_ADDR expected'."""
    import torch.distributed as dist

    from torchtitan.config.job_config import Comm
    from torchtitan.distributed.utils import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert not dist.is_initialized()
    with pytest.raises(ValueError) as info:
        init_distributed(Comm(), "cpu")
    assert str(info.value) == (
        "WORLD_SIZE=2 asks for several ranks, but MASTER_ADDR and MASTER_PORT are not set: "
        "launch them with ./run_train.sh (NGPU=N) or torchrun, which set them, or unset "
        "WORLD_SIZE for one process")


def test_more_cpu_ranks_than_cores_is_warned(monkeypatch, capsys):
    """NGPU=8 on 2 cores trained ~10x slower than one rank, without a word."""
    import os

    import torchtitan.tools.device as device
    from torchtitan.launch import check_local_gpus

    monkeypatch.setattr(device, "device_type", "cpu")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    check_local_gpus("2")
    assert capsys.readouterr().err == ""
    check_local_gpus("8")
    assert capsys.readouterr().err == (
        "warning: NGPU=8 starts 8 CPU ranks on 2 cores: they take turns, and each step is about "
        "4x slower than on enough cores (fine for trying a layout; lower NGPU for speed)\n")


@pytest.mark.parametrize("value, tty, colored, warned", [
    ("true", False, True, False), ("off", True, False, False), ("1", False, True, False),
    ("maybe", True, True, True), ("maybe", False, False, True),
])
def test_color_setting_spellings(monkeypatch, caplog, value, tty, colored, warned):
    """TORCHTITAN_COLOR=true was ignored without a word (only 0 and 1 were read)."""
    import sys

    from torchtitan.tools import logging as titan_logging

    titan_logging._unknown_color.cache_clear()
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TORCHTITAN_COLOR", value)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty, raising=False)
    assert titan_logging.console_wants_color() is colored
    assert ("TORCHTITAN_COLOR='maybe' is neither 1 nor 0" in caplog.text) is warned


@pytest.mark.parametrize("argv, expected", [
    (["--help=x"], "error: --help takes no value (got '--help=x'); run with --help alone"),
    (["--json=yes"], "error: --json takes no value (got '--json=yes')"),
    (["--check=1"], "error: --check takes no value (got '--check=1')"),
    (["train_configs/debug_model.toml"], "error: unexpected argument "
     "'train_configs/debug_model.toml': every setting is a --section.key flag (a config file is "
     "given as --job.config_file train_configs/debug_model.toml)"),
])
def test_valueless_flags_and_a_bare_toml_path_say_what_to_type(capsys, argv, expected):
    """`--help=x` and the config tool's `--json=yes` were "unknown flag" (the flag exists), and
    a TOML path given as a bare argument did not say how a config file is given."""
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == expected
