"""The scripts' number options (torchtitan/tools/cli_args.py): a bad value is argparse's
one error line naming the option, exit code 2, before anything runs (a zero used to run and
report nonsense, a traceback, or a hang)."""

from __future__ import annotations

import argparse
import random

import pytest

from tests.conftest import REPO_ROOT, load_script
from torchtitan.tools.cli_args import (
    available_device,
    int_at_least,
    non_negative_float,
    positive_int,
)


def test_types_accept_good_values_and_say_what_is_wrong():
    assert positive_int("3") == 3 and int_at_least(0)("0") == 0
    assert non_negative_float("0") == 0.0 and available_device("cpu") == "cpu"
    for parse, text, message in [
        (positive_int, "0", "must be >= 1, got 0"),
        (positive_int, "two", "expects an integer, got 'two'"),
        (int_at_least(2), "1", "must be >= 2, got 1"),
        (non_negative_float, "-1e-5", "must be a finite number >= 0, got -1e-5"),
        (non_negative_float, "nan", "must be a finite number >= 0, got nan"),
        (available_device, "bogus", "'bogus' is not a torch device"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=message.replace("(", r"\(")
                           .replace(")", r"\)")):
            parse(text)


@pytest.mark.parametrize(
    "script, argv, message",
    [
        ("chaos_kill_resume", ["--trials", "0"], "argument --trials: must be >= 1, got 0"),
        ("parity_sweep", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
        ("parity_sweep", ["--rtol", "-1"], "argument --rtol: must be a finite number >= 0"),
        ("layout_sweep", ["--ngpus", "2,0"], "argument --ngpus: must be >= 1, got 0"),
        ("parity_sweep", ["--models", "llama4"], "argument --models: no model matches 'llama4'; "
         "the models: llama3_tiny, qwen3, qwen3_moe, deepseek_v3, gpt_oss, llama2"),
        ("benchmark_loss", ["--chunk", "0"], "argument --chunk: must be >= 1, got 0"),
        ("benchmark_grouped_experts", ["--top-k", "9"],
         "--top-k 9 routes each token to more experts than --experts 8"),
        ("benchmark", ["--steps", "3", "--warmup", "3"], "--warmup 3 leaves none of --steps 3"),
        ("benchmark_context_parallel", ["--nproc", "1"], "argument --nproc: must be >= 2, got 1"),
        ("benchmark_expert_parallel", ["--nproc", "3", "--tp", "2"], "--tp 2 must divide --nproc 3"),
        ("run_fault_tolerant", ["--lighthouse-port", "99999"],
         "--lighthouse-port must be a TCP port (1-65535), got 99999"),
    ],
)
def test_a_script_refuses_a_bad_number_before_running(script, argv, message, capsys):
    module = load_script(script)
    with pytest.raises(SystemExit) as stop:
        module.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(message) or message in err[-1], err[-1]


def test_scripts_find_the_package_from_a_checkout_without_installing_it():
    """Every script that imports torchtitan at module level puts the checkout on sys.path
    first (`python scripts/X.py` from a clone that was never `pip install`ed)."""
    for path in sorted((REPO_ROOT / "scripts").glob("*.py")):
        text = path.read_text()
        first = text.find("\nfrom torchtitan")
        if first == -1 or path.name == "benchmark_flavors.py":  # imported by the trainer
            continue
        assert "sys.path.insert(0" in text[:first], (
            f"{path.name} imports torchtitan before putting the checkout on sys.path")


def test_layout_sweep_draws_expert_parallelism_only_where_it_fits():
    """EP borrows data-parallel shard ranks (and the TP ranks without expert TP): on one rank
    a MoE model is drawn without it, instead of wasting a trial on a refused layout."""
    sweep = load_script("layout_sweep")
    rng = random.Random(0)
    one = [sweep.draw_layout(rng, [], True, 2, ngpus=(1,))[1] for _ in range(100)]
    assert not [f for f in one if "--parallelism.expert_parallel_degree" in f]
    four = [sweep.draw_layout(rng, [], True, 2, ngpus=(4,))[1] for _ in range(100)]
    assert len([f for f in four if "--parallelism.expert_parallel_degree" in f]) > 20
    assert "train_configs/gpt_oss_debugmodel.toml" in [m[0] for m in sweep.MODELS]


def test_layout_sweep_that_trained_nothing_fails(monkeypatch, tmp_path, capsys):
    """A sweep whose every run was refused tested nothing: exit 1 with one error line, not a
    green 0; a --folder that is a file is refused before any run."""
    sweep = load_script("layout_sweep")
    monkeypatch.setattr(sweep, "run", lambda *args, **kwargs: "user-error")
    assert sweep.main(["--trials", "2", "--folder", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no run trained")
    monkeypatch.setattr(sweep, "run", lambda *args, **kwargs: "ok")
    assert sweep.main(["--trials", "1", "--folder", str(tmp_path)]) == 0
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert sweep.main(["--trials", "1", "--folder", str(a_file)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --folder {a_file} is a file")
    assert a_file.read_text() == "mine"
