"""scripts/compare_upstream.py: log parsing, averages, the table, commands and the scratch
folder (fast), and the whole CPU smoke run against upstream torchtitan 0.2.2 (slow)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ASSETS, C4_TEST_VALID, REPO_ROOT, TIKTOKEN_FILE, load_script

LOGS = ASSETS / "compare_upstream"  # recorded with --device cpu (upstream through its shim)
# Upstream 0.2.2's step line on a GPU, as components/metrics.py formats it (colors on).
GPU_LINE = ("[titan] 2026-11-27 10:00:00,000 - root - INFO - \x1b[31mstep: 20  \x1b[32mloss:  "
            "7.12345  \x1b[33mgrad_norm:  0.9876  \x1b[36mmemory: 34.87GiB(44.07%)  "
            "\x1b[34mtps: 53,924  \x1b[36mtflops: 2,467.31  \x1b[35mmfu: 31.53%\x1b[39m")


@pytest.fixture(scope="module")
def cu():
    path = sys.path[:]
    try:
        yield load_script("compare_upstream")  # puts scripts/ on sys.path for its two helpers
    finally:
        sys.path[:] = path
        for name in ("compare_upstream", "compare_upstream_report", "compare_upstream_setup"):
            sys.modules.pop(name, None)


def test_parse_upstream_and_our_logs(cu):
    up = cu.report.parse_steps((LOGS / "upstream_0.2.2_cpu.log").read_text())
    assert [s.step for s in up] == [1, 2, 3, 4]
    assert [s.tps for s in up] == [1774, 3602, 3825, 3779]
    assert up[1].mfu == 0.04 and up[1].tflops == 0.13
    assert all(s.memory_gib is None for s in up)  # upstream logs -0.00GiB without CUDA stats
    ours = cu.report.parse_steps((LOGS / "ours_cpu.log").read_text())  # "[rank0]:" prefixed
    assert [s.tps for s in ours] == [1736, 2609, 2718, 2557]
    assert ours[0].mfu is None and ours[0].memory_gib == 0.55  # "mfu: n/a (unknown device)"
    (gpu,) = cu.report.parse_steps(GPU_LINE + "\n[titan] validate step: 20  loss: 7.1\n")
    assert (gpu.step, gpu.tps, gpu.tflops, gpu.mfu, gpu.memory_gib) == (
        20, 53924, 2467.31, 31.53, 34.87)
    assert [s.loss for s in up][0] > [s.loss for s in up][-1] > 0  # the logged losses


def test_summary_averages_the_steps_after_warmup(cu):
    text = (LOGS / "upstream_0.2.2_cpu.log").read_text()
    s = cu.report.summarize(text, warmup=1)
    assert s.steps == (2, 3, 4)
    assert s.tps == pytest.approx((3602 + 3825 + 3779) / 3)
    assert s.mfu == pytest.approx(0.04) and s.memory_gib is None
    lines = "\n".join(GPU_LINE.replace("step: 20", f"step: {n}").replace("53,924", f"{t:,}")
                      .replace("34.87", m) for n, t, m in
                      [(10, 1000, "40.00"), (20, 50000, "35.00"), (30, 52000, "36.50")])
    s = cu.report.summarize(lines, warmup=10)  # step 10's window holds compilation
    assert s.tps == 51000 and s.memory_gib == 36.5 and s.steps == (20, 30)
    with pytest.raises(cu.report.ReportError, match="no training-step lines after step 30"):
        cu.report.summarize(lines, warmup=30)


def test_table_ratio_and_json(cu):
    rs = cu.report.RunSummary
    ours = cu.report.combine([rs(50000, 2000, 30.0, 35.0, (20, 30), 7.0),
                              rs(52000, 2100, 32.0, 35.2, (20, 30), 7.5)])
    up = rs(50000, 2050, 31.0, 34.9, (20, 30), 7.1)
    assert ours.tps == 51000 and ours.mfu == 31.0 and ours.memory_gib == 35.2
    assert cu.report.ratio(ours, up) == pytest.approx(1.02)
    rows = [("bf16, AC none", ours, up), ("float8 tensorwise", None, up)]
    table = cu.report.markdown_table(rows, "0.2.2").splitlines()
    assert table[0].startswith("| setting | this project tok/s | upstream 0.2.2 tok/s | ratio")
    assert table[2] == ("| bf16, AC none | 51,000 | 50,000 | 1.020 | 31.00 / 31.00 | 35.20 / 34.90 "
                        "| 7.2500 / 7.1000 |")
    assert table[3] == ("| float8 tensorwise | failed | 50,000 | n/a | n/a / 31.00 | n/a / 34.90 "
                        "| n/a / 7.1000 |")
    data = json.loads(cu.report.json_line(rows, device="NVIDIA H100", torch="2.11"))
    assert data["device"] == "NVIDIA H100" and data["results"][0]["ratio"] == 1.02
    assert data["results"][1]["ours"] is None
    assert data["results"][0]["upstream"]["tokens_per_s"] == 50000
    assert data["results"][0]["ours"]["last_loss"] == 7.25


def test_same_flags_on_both_sides_except_the_setting(cu, tmp_path):
    args = cu.parse_args(["--work-dir", str(tmp_path), "--settings", "bf16,flex,float8"])
    assert (args.flavor, args.seq_len, args.batch, args.steps, args.warmup) == (
        "8B_4layers", 4096, 2, 40, 10)
    ours, env_o, cwd_o = cu.build_run(args, "ours", "flex", 0)
    up, env_u, cwd_u = cu.build_run(args, "upstream", "flex", 0)
    assert ours[0] == "./run_train.sh" and cwd_o == REPO_ROOT and env_o["NGPU"] == "1"
    assert up[up.index("-m", 3) + 1] == "torchtitan.train" and cwd_u == tmp_path / "scratch"
    # upstream's own folder first; this checkout is never on its path
    assert env_u["PYTHONPATH"].split(os.pathsep)[:3] == [
        str(tmp_path / "upstream"), str(tmp_path / "site"), str(tmp_path / "scratch")]
    assert str(REPO_ROOT) not in env_u["PYTHONPATH"].split(os.pathsep)
    tail_o, tail_u = ours[1:], up[up.index("torchtitan.train") + 1:]
    assert tail_o[tail_o.index("--model.flavor") + 1] == "8B_4layers"
    assert tail_u[tail_u.index("--model.flavor") + 1] == "8B_4layers_flex"
    assert "--compile.enable" in tail_u and tail_o[-3:] == [
        "--model.use_flex_attn", "--model.attn_mask_type", "block_causal"]
    for name in ("bf16", "float8"):  # identical flags but the dump folder
        o = cu.build_run(args, "ours", name, 0)[0][1:]
        u = cu.build_run(args, "upstream", name, 0)[0]
        u = u[u.index("torchtitan.train") + 1:]
        assert [f.replace("upstream_", "ours_") for f in u] == o
    assert "quantize.linear.float8" in o


def test_cpu_smoke_defaults_and_one_line_errors(cu, tmp_path, capsys):
    args = cu.parse_args(["--device", "cpu", "--work-dir", str(tmp_path)])
    assert (args.flavor, args.steps, args.compile, args.settings) == (
        "debugmodel", 4, False, ["bf16"])
    cmd, env, _ = cu.build_run(args, "upstream", "bf16", 0)
    assert "upstream_cpu_shim.py" in cmd and env["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(SystemExit) as e:
        cu.parse_args(["--settings", "bf16,fp4"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --settings: unknown ['fp4']") and err.count("\n") == 1
    log = (LOGS / "upstream_0.2.2_float8_cpu_failure.log").read_text()
    assert cu._reason(log).startswith("ValueError: Failed to swap to Float8Linear")
    assert cu._reason("[rank0]: x\n[rank0]:error: model.converters float8 needs a GPU\n") == (
        "error: model.converters float8 needs a GPU")


@pytest.mark.parametrize("make_argv, expected", [
    (lambda t: ["--flavor", "8B_3layers"], "error: --flavor '8B_3layers' is no Llama 3 flavor"),
    (lambda t: ["--batch", "-1"], "error: argument --batch: must be >= 1, got -1"),
    (lambda t: ["--run-timeout", "0"], "error: argument --run-timeout: must be > 0"),
    (lambda t: ["--work-dir", str(t / "a_file")], "error: --work-dir {t}/a_file is a file"),
    (lambda t: ["--wheels", str(t / "none")], "error: --wheels {t}/none is not a folder"),
    (lambda t: ["--out", str(t / "none" / "table.md")], "error: --out {t}/none/table.md: its "
     "folder {t}/none does not exist"),
    (lambda t: ["--out", str(t)], "error: --out {t} is a folder"),
])
def test_dry_run_checks_its_arguments_too(cu, tmp_path, capsys, make_argv, expected):
    """What a run would trip over is one line before anything runs, --dry-run included."""
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(SystemExit) as e:
        cu.main(["--dry-run", *make_argv(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(expected.format(t=tmp_path)), err
    assert (tmp_path / "a_file").read_text() == "mine"


def test_tokenizer_json_matches_our_tiktoken_ids(cu, tmp_path, tiktoken_tokenizer):
    tokenizers = pytest.importorskip("tokenizers")
    assert cu.setup.tiktoken_to_tokenizer_json(TIKTOKEN_FILE, tmp_path) == 2002
    tk = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    docs = [json.loads(line)["text"] for line in C4_TEST_VALID.read_text().splitlines()[:40]]
    for doc in docs + ["Hello, world!\n\n  123456 it's ünïcode: 5 € — “quoted”"]:
        assert tk.encode(doc).ids == tiktoken_tokenizer.encode(doc, bos=False, eos=False)
    assert (tk.token_to_id("<|begin_of_text|>"), tk.token_to_id("<|end_of_text|>")) == (
        tiktoken_tokenizer.bos_id, tiktoken_tokenizer.eos_id)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}


def test_scratch_folder_holds_what_upstream_reads(cu, tmp_path):
    scratch = cu.setup.make_scratch(tmp_path / "scratch")
    files = sorted(str(p.relative_to(scratch)) for p in scratch.rglob("*") if p.is_file())
    assert files == ["benchmark_flavors.py", "tests/assets/c4_test/data.json",
                     "tests/assets/tokenizer/tokenizer.json",
                     "tests/assets/tokenizer/tokenizer_config.json", "upstream_cpu_shim.py"]

    @dataclasses.dataclass
    class Args:  # upstream's TransformerModelArgs fields that the flex flavors set
        n_layers: int = 32
        attn_type: str = "sdpa"
        attn_mask_type: str = "causal"

    flavors = {"8B": Args(), "8B_flex": Args(attn_type="flex", attn_mask_type="block_causal")}
    exec(cu.setup._UPSTREAM_FLEX, {"llama3_args": flavors, "dataclasses": dataclasses})
    assert sorted(flavors) == ["8B", "8B_flex"]  # upstream's own 8B_flex is kept
    flavors["8B_4layers"] = Args(n_layers=4)
    exec(cu.setup._UPSTREAM_FLEX, {"llama3_args": flavors, "dataclasses": dataclasses})
    assert flavors["8B_4layers_flex"] == Args(4, "flex", "block_causal")


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


@pytest.mark.subprocess_ok  # two sleeping processes, ended at once
def test_a_stopped_run_leaves_no_worker_behind(cu):
    # like torchrun: the worker runs in a session of its own, out of the launcher's group
    code = ("import subprocess, time; p = subprocess.Popen(['sleep', '60'], "
            "start_new_session=True); print(p.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    worker = int(proc.stdout.readline())
    assert _alive(worker)
    cu._stop(proc)
    deadline = time.monotonic() + 5
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker) and proc.returncode is not None


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("UPSTREAM_TORCHTITAN_WHEEL"),
    reason="needs upstream's wheel: UPSTREAM_TORCHTITAN_WHEEL=path of `pip download --no-deps "
           "torchtitan==0.2.2` (tests download nothing at run time)",
)
def test_cpu_smoke_end_to_end(tmp_path):
    """Both trainers for real on the CPU (upstream 0.2.2 through its shim): install, scratch
    folder, alternating runs, table and JSON; about 20 s."""
    wheel = os.environ["UPSTREAM_TORCHTITAN_WHEEL"]
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "compare_upstream.py"), "--device", "cpu",
           "--work-dir", str(tmp_path), "--out", str(tmp_path / "table.md"),
           "--upstream-wheel", wheel]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    (row,) = data["results"]
    assert row["setting"] == "bf16, AC none" and row["ratio"] > 0
    assert row["ours"]["steps"] == row["upstream"]["steps"] == [2, 3, 4]
    assert data["upstream"] == "torchtitan 0.2.2" and data["device"] == "cpu"
    assert "upstream_cpu_shim.py" in data["commands"]["upstream bf16"]
    assert "torchtitan version: 0.2.2" in (tmp_path / "logs/upstream_bf16_0.log").read_text()
    assert "| bf16, AC none |" in (tmp_path / "table.md").read_text()


def test_ours_variant_adds_flags_and_a_run_per_setting(cu, tmp_path, capsys):
    args = cu.parse_args(["--work-dir", str(tmp_path), "--ours-variant",
                          "logits=--training.loss_implementation logits", "--repeats", "2"])
    assert cu.sides(args, 0) == ["ours", "ours:logits", "upstream"]
    assert cu.sides(args, 1) == ["upstream", "ours:logits", "ours"]
    base = cu.build_run(args, "ours", "float8", 0)[0]
    variant = cu.build_run(args, "ours:logits", "float8", 0)[0]
    assert variant[-2:] == ["--training.loss_implementation", "logits"]
    assert [f.replace("ours-logits_", "ours_") for f in variant[:-2]] == base
    with pytest.raises(SystemExit) as e:
        cu.parse_args(["--ours-variant", "no flags here"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: --ours-variant 'no flags here': expected")
    with pytest.raises(SystemExit) as e:  # a shlex traceback before
        cu.parse_args(["--both-flags", '--x "y'])
    assert e.value.code == 2
    assert "error: --both-flags '--x \"y' cannot be split into flags: No closing quotation" in \
        capsys.readouterr().err


def test_both_flags_reach_every_run_of_both_sides(cu, tmp_path):
    trace = "--profiling.enable_profiling --profiling.profile_freq 20"
    args = cu.parse_args(["--work-dir", str(tmp_path), "--both-flags", trace,
                          "--ours-variant", "off=--optimizer.no_clip_in_step"])
    for side in ("ours", "ours:off", "upstream"):
        cmd = cu.build_run(args, side, "bf16", 0)[0]
        at = cmd.index("--profiling.enable_profiling")
        assert cmd[at:at + 3] == trace.split(), side
    assert "--profiling.enable_profiling" not in cu.build_run(
        cu.parse_args(["--work-dir", str(tmp_path)]), "ours", "bf16", 0)[0]


@pytest.mark.slow  # ~25 s: the loss benchmark and the memory comparison at toy sizes
def test_gpu_speed_check_levers_phase_runs_on_the_cpu(tmp_path):
    """The prepared GPU script's plumbing (SMOKE=1: CPU, toy sizes; no upstream needed)."""
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    wheels.mkdir()
    env = {**os.environ, "SMOKE": "1", "WORK": str(tmp_path / "work")}
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "gpu_speed_check.sh"),
                           str(wheels), str(out), "levers"], env=env, capture_output=True,
                          text=True, timeout=300)
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "loss_path: exit 0" in summary and "memory: exit 0" in summary
    assert "chunked / logits: time" in summary and "CPU STAND-IN" in summary


@pytest.mark.slow  # ~15 s: the optimizer benchmark at toy sizes
def test_gpu_speed_check_next_phase_runs_what_fits_in_its_budget(tmp_path):
    """The next GPU call as one command: a phase whose usual time exceeds what is left of
    BUDGET_S is skipped with a line saying so; the rest run (SMOKE=1: CPU, toy sizes)."""
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    wheels.mkdir()
    env = {**os.environ, "SMOKE": "1", "WORK": str(tmp_path / "work"), "BUDGET_S": "120",
           "NEXT_PHASES": "memsnap:1000 optstep:60"}
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "gpu_speed_check.sh"),
                           str(wheels), str(out), "next"], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "memsnap: skipped, needs ~1000 s" in summary
    assert "optimizer_step: exit 0" in summary and "| static |" in summary


def test_our_version_says_when_the_tree_differs_from_its_commit(cu, tmp_path, monkeypatch):
    """The table names the code it measured: a GPU machine's copy of an edited tree must not
    pass for its checkout's commit."""
    import subprocess

    (tmp_path / "pyproject.toml").write_text('[project]\nversion = "9.9"\n')
    git = ["git", "-C", str(tmp_path), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "pyproject.toml"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    monkeypatch.setattr(cu, "REPO_ROOT", tmp_path)
    clean = cu.ours_version()
    assert clean.startswith("9.9+g") and not clean.endswith(".dirty")
    (tmp_path / "pyproject.toml").write_text('[project]\nversion = "9.9"\n# edited\n')
    assert cu.ours_version() == clean + ".dirty"
