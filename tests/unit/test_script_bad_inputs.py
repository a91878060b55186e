"""Bad input to the scripts in scripts/: one ``error:`` line on stderr, exit code 2, no
traceback, before anything runs, and the user's own files and folders left as they were.
Each script's ``main(argv)`` runs in-process (``python scripts/X.py`` is ``sys.exit(main())``)."""

from __future__ import annotations

import json
import pickle
import sys

import pytest

from tests.conftest import load_script


@pytest.fixture
def refused(capsys, monkeypatch):
    """``refused(script, *argv)``: run ``scripts/<script>.py``'s main; assert it refused in one
    ``error:`` line with exit code 2 and printed nothing else; return the line."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("NGPU", raising=False)

    def run(script: str, *argv: str) -> str:
        module = load_script(script)
        try:
            code = module.main(list(argv))
        except SystemExit as stop:
            code = stop.code
        finally:
            sys.modules.pop(script, None)
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err[-3000:]
        lines = err.splitlines()
        assert code == 2, (code, err[-3000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        assert out == "", out[-2000:]
        return lines[0]

    return run


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("the user's own file\n")
    yield path
    assert path.read_text() == "the user's own file\n"  # untouched


def _trace(path, kernel="nvjet_tst_gemm"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "ProfilerStep#1", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": kernel, "ts": 1, "dur": 5},
    ]}))
    return path


# scripts/generate_test_assets.py

def test_generate_test_assets_out_dir_that_is_a_file(refused, user_file):
    line = refused("generate_test_assets", "--out-dir", str(user_file), "--only", "corpus")
    assert line.startswith(f"error: --out-dir {user_file} is an existing file, not a folder")


@pytest.mark.parametrize("only", ["", " , "])
def test_generate_test_assets_empty_selection_names_the_choices(refused, tmp_path, only):
    line = refused("generate_test_assets", "--out-dir", str(tmp_path / "out"), "--only", only)
    assert line.startswith(f"error: --only {only!r} selects nothing; use one or more of "
                           "corpus, tiktoken, sentencepiece")
    assert not (tmp_path / "out").exists()


# scripts/kernel_breakdown.py

def test_kernel_breakdown_json_that_is_a_folder(refused, tmp_path):
    trace, folder = _trace(tmp_path / "a.json"), tmp_path / "figures"
    folder.mkdir()
    (folder / "kept.txt").write_text("kept")
    line = refused("kernel_breakdown", f"ours={trace}", "--json", str(folder))
    assert line.startswith(f"error: --json {folder} is a folder")
    assert [p.name for p in folder.iterdir()] == ["kept.txt"]


def test_kernel_breakdown_same_label_twice(refused, tmp_path):
    """One of the two traces was dropped from the tables without a word."""
    a, b = _trace(tmp_path / "a.json"), _trace(tmp_path / "b.json")
    line = refused("kernel_breakdown", f"x={a}", f"x={b}")
    assert line.startswith(f"error: label 'x' is given twice ({a}, {b})")
    a, b = (_trace(tmp_path / run / "traces" / "rank0_trace.json").parent for run in "ab")
    line = refused("kernel_breakdown", str(a), str(b))  # unlabeled: both named after the folder
    assert line.startswith(f"error: label 'traces' is given twice ({a}, {b})")


def test_kernel_breakdown_negative_top(refused, tmp_path):
    line = refused("kernel_breakdown", f"x={_trace(tmp_path / 'a.json')}", "--top", "-1")
    assert line.startswith("error: argument --top: must be >= 0, got -1")


@pytest.mark.parametrize("given", ["file", "folder"])
def test_kernel_breakdown_json_onto_an_input_trace(refused, tmp_path, given):
    trace = _trace(tmp_path / "profile_traces" / "iteration_2" / "rank0_trace.json")
    before = trace.read_bytes()
    source = trace if given == "file" else tmp_path / "profile_traces"
    line = refused("kernel_breakdown", f"ours={source}", "--json", str(trace))
    assert line.startswith(f"error: --json {trace} is the trace of 'ours'")
    assert trace.read_bytes() == before


# scripts/analyze_flight_recorder.py

@pytest.mark.parametrize("content, why", [
    (bytes(range(256))[::-7] * 3, "not a pickle: invalid load key"),
    (b"", "not a pickle: Ran out of input"),
    (pickle.dumps(5), "it holds a pickled int"),
    (pickle.dumps({"pg_config": {}}), "it holds a pickled dict without 'entries'"),
], ids=["random_bytes", "empty", "int", "dict"])
def test_analyze_flight_recorder_on_what_is_not_a_dump(refused, tmp_path, content, why):
    dumps = tmp_path / "comm_traces"
    dumps.mkdir()
    (dumps / "rank_0").write_bytes(content)
    assert refused("analyze_flight_recorder", str(dumps)).startswith(
        f"error: {dumps / 'rank_0'} is not a Flight Recorder dump ({why}")
    assert refused("analyze_flight_recorder", str(dumps / "rank_0")).startswith(
        f"error: {dumps / 'rank_0'} is not a Flight Recorder dump ({why}")
    assert (dumps / "rank_0").read_bytes() == content


# scripts/chaos_kill_resume.py, run_fault_tolerant.py, parity_sweep.py: a folder option naming
# a file, refused before any run starts.

@pytest.mark.parametrize("script, option", [
    ("chaos_kill_resume", "--keep"),
    ("run_fault_tolerant", "--log-dir"),
    ("parity_sweep", "--folder"),
])
def test_folder_option_that_is_a_file(refused, user_file, script, option):
    line = refused(script, option, str(user_file))
    assert line.startswith(f"error: {option} {user_file} is an existing file, not a folder")


# scripts/estimate_memory.py

@pytest.mark.parametrize("name, value", [("WORLD_SIZE", "abc"), ("NGPU", "0")])
def test_estimate_memory_bad_world_size_in_the_environment(refused, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    line = refused("estimate_memory", "--job.config_file", "train_configs/debug_model.toml")
    assert line == (f"error: {name}={value!r} in the environment is not a number of ranks (an "
                    "integer >= 1): fix it or give --world-size")


@pytest.mark.parametrize("argv, env, expected", [
    (["--", "--fault_tolerance.replica_id", "3"], {}, "error: --fault_tolerance.replica_id is "
     "set for each group by this script (group i is replica i): leave it out of the trainer "
     "flags (see --help)"),
    (["--", "--fault-tolerance.group-size=4"], {}, "error: --fault-tolerance.group-size is set "
     "for each group by this script (--groups): leave it out of the trainer flags (see --help)"),
    ([], {"NGPU": "two"}, "error: NGPU='two' in the environment is not a number of ranks per "
     "group (an integer >= 1): fix it or give --ranks-per-group (see --help)"),
])
def test_run_fault_tolerant_refuses_what_it_sets_itself(capsys, monkeypatch, argv, env, expected):
    """The script appended its own replica_id/group_size after the user's (the user's lost,
    silently), and ran 1 rank per group whatever NGPU said."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        load_script("run_fault_tolerant").parse_args(argv)
    assert e.value.code == 2 and capsys.readouterr().err.strip() == expected


def test_run_fault_tolerant_takes_ngpu_as_ranks_per_group(monkeypatch):
    module = load_script("run_fault_tolerant")
    monkeypatch.setenv("NGPU", "4")
    assert module.parse_args([])[0].ranks_per_group == 4
    assert module.parse_args(["--ranks-per-group", "2"])[0].ranks_per_group == 2
    monkeypatch.delenv("NGPU")
    assert module.parse_args([])[0].ranks_per_group == 1


def test_estimate_memory_real_refuses_what_the_host_cannot_hold(monkeypatch, capsys):
    """--real on the CPU allocates the rank's real tensors: past the free memory the kernel's
    OOM killer ended the run (or the machine's other work); now the fake estimate gates it."""
    import torchtitan.tools.host_memory as host_memory

    module = load_script("estimate_memory")
    argv = ["--job.config_file", "train_configs/debug_model.toml", "--world-size", "1", "--real",
            "--training.seq_len", "32", "--training.local_batch_size", "1"]
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda *a, **k: 1 << 20)
    assert module.main(argv) == 2
    out = capsys.readouterr().err
    err = [line for line in out.splitlines() if line.startswith("error:")]
    assert "Traceback" not in out and len(err) == 1 and err[0].startswith(
        "error: world size 1: --real holds rank 0's tensors in this machine's memory: about ")
    assert err[0].endswith("and it has 1 MiB available; leave out --real for the estimate")
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda *a, **k: 1 << 40)
    assert module.main(argv) == 0
