"""scripts/loss_compare.py: equal layouts pass, different ones are caught."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT as ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import loss_compare  # noqa: E402

TINY = (
    "--model.flavor debugmodel_tiny --training.seq_len 64 --activation_checkpoint.mode none "
    "--lr_scheduler.warmup_steps 1"
)


def test_read_metrics_full_precision_last_record_wins(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "loss": 8.205012345678, "grad_norm": 0.6}\n'
        '{"step": 2, "loss": 7.84123456, "grad_norm": 1.2}\n'
        '{"step": 2, "validation/loss": 6.0}\n'
        '{"step": 2, "loss": 7.84120001, "grad_norm": 1.3}\n'  # resumed run repeats step 2
    )
    assert loss_compare.read_metrics(path) == {1: 8.205012345678, 2: 7.84120001}
    assert loss_compare.read_metrics(path, "grad_norm") == {1: 0.6, 2: 1.3}
    # two losses equal to 4 decimals (the console) are still told apart
    rows, ok = loss_compare.compare({1: 8.20501}, {1: 8.20509}, 1e-6, 1e-6)
    assert not ok and rows[0][3] > 5e-5


def test_compare_verdict():
    rows, ok = loss_compare.compare({1: 8.0, 2: 7.0}, {1: 8.0, 2: 7.00001}, 1e-5, 1e-5)
    assert ok and len(rows) == 2
    _, ok = loss_compare.compare({1: 8.0, 2: 7.0}, {1: 8.0, 2: 7.01}, 1e-5, 1e-5)
    assert not ok


@pytest.mark.slow
def test_different_global_batch_is_reported_different(tmp_path):
    """A different global batch is a different run: the tool must say so and exit 1. (Equal
    layouts giving EQUAL: the --help examples below.)"""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    differ = subprocess.run(
        [sys.executable, "scripts/loss_compare.py", "--steps", "3", "--dump-folder",
         str(tmp_path / "cmp"), "--assert-equal",
         "--a", f"NGPU=1 {TINY} --training.local_batch_size 4",
         "--b", f"NGPU=1 {TINY} --training.local_batch_size 2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert differ.returncode == 1, differ.stdout + differ.stderr[-3000:]
    assert "verdict: DIFFERENT" in differ.stdout


def help_examples() -> list[list[str]]:
    """The example commands of ``loss_compare.py --help``, as argument lists."""
    block = loss_compare.__doc__.split("Examples", 1)[1].split("\n\n", 1)[0]
    lines = block.splitlines()[1:]  # after the "Examples (...):" line
    commands, current = [], ""
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#") or not stripped:
            continue
        current += " " + stripped.rstrip("\\")
        if not stripped.endswith("\\"):
            commands.append(shlex.split(current))
            current = ""
    return commands


@pytest.mark.subprocess_ok  # git rev-parse only
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--rtol", "-1"], "--rtol must be a finite number >= 0, got -1.0"),
        (["--atol", "nan"], "--atol must be a finite number >= 0, got nan"),
        (["--config", "no/such.toml"], "--config no/such.toml does not exist"),
        (["--b-rev", "no-such-revision"], "--b-rev no-such-revision is not a commit"),
        # a traceback from shlex; a steps flag the script's own --steps silently replaced
        (["--flags", '--training.seq_len "64'], "--flags '--training.seq_len \"64' cannot be "
                                                 "split into flags: No closing quotation"),
        (["--a", "--training.steps 3"], "--a sets --training.steps, which this script sets "
                                        "itself: use --steps"),
    ],
)
def test_bad_arguments_are_one_line_before_any_run(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(loss_compare, "_run", lambda *a: pytest.fail("a run started"))
    assert loss_compare.main([*argv, "--dump-folder", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message}") and "\n" not in err


def test_a_run_refused_by_the_trainer_exits_2_and_an_unknown_metric_names_the_fields(
    tmp_path, capsys, monkeypatch
):
    class Proc:
        returncode, stdout, stderr = 2, "", "error: unknown flag --bogus\n"

    monkeypatch.setattr(loss_compare.subprocess, "run", lambda *a, **k: Proc())
    with pytest.raises(SystemExit) as stop:
        loss_compare._run("a", {}, ["true"], tmp_path)
    assert stop.value.code == 2 and "run a failed with exit code 2" in capsys.readouterr().err
    Proc.returncode = 1  # a crash stays 1
    with pytest.raises(SystemExit) as stop:
        loss_compare._run("a", {}, ["true"], tmp_path)
    assert stop.value.code == 1
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text('{"step": 1, "loss": 8.2, "grad_norm": 0.5}\n')
    monkeypatch.setattr(loss_compare, "_run", lambda *a: None)
    monkeypatch.setattr(loss_compare.shutil, "rmtree", lambda *a, **k: None)
    args = loss_compare.argparse.Namespace(
        flags="", steps=1, deterministic=False, dump_folder=str(tmp_path), config="x.toml",
        metric="bogus",
    )
    with pytest.raises(SystemExit) as stop:
        loss_compare.run_side("a", "", args, tmp_path, None)
    assert stop.value.code == 2
    assert "--metric bogus:" in capsys.readouterr().err.splitlines()[-1]
    assert loss_compare.metric_fields(tmp_path / "a" / "metrics.jsonl") == ["grad_norm", "loss"]


def test_help_shows_the_examples():
    examples = help_examples()
    assert len(examples) == 3 and all(c[:2] == ["python", "scripts/loss_compare.py"] for c in examples)
    assert "--seed-checkpoint" in examples[0] and "COMM_MODE=local_tensor" in " ".join(examples[1])


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1], ids=["fsdp2_vs_ddp2", "local_tensor_tp2_fsdp2_vs_fsdp2"])
def test_help_example_works_as_written(tmp_path, cpu_env, index):
    """The --help examples (seed checkpoint; real ranks, then simulated ones) verbatim, plus a
    temporary --dump-folder. Without the seed checkpoint the simulated layouts start from
    different weights (step-1 losses differ by ~8e-2), so EQUAL shows it was loaded."""
    cmd = help_examples()[index]
    proc = subprocess.run(
        [sys.executable, *cmd[1:], "--dump-folder", str(tmp_path / "cmp")],
        cwd=ROOT, env=cpu_env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "verdict: EQUAL" in proc.stdout
    for side in ("a", "b"):
        steps = [json.loads(line)["step"] for line in (tmp_path / "cmp" / side / "metrics.jsonl").open()]
        assert steps == list(range(1, int(cmd[cmd.index("--steps") + 1]) + 1))
