"""Every failure through ./run_train.sh is one ``error:`` line on the console and exit code 2.

Two ranks (NGPU=2), console showing rank 0 only (LOG_RANK=0). Mistakes the config reveals are
caught by the pre-flight check before torchrun starts (no rank output at all); the others stop
inside the ranks, and the launcher names the root cause even when only rank 1 saw it.
A few pre-flight refusals go through ./run_train.sh; the others run the same launcher
(``torchtitan.launch.main``, with the arguments ./run_train.sh execs) in this process, where
torchrun is replaced by a recorder that must stay unused (each subprocess costs ~2 s of imports).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from tests.conftest import REPO_ROOT

FAIL_ON_RANK_1 = "tests.integration.assets.fail_on_rank1"


def run_train(args: list[str], env: dict, timeout: float = 240) -> tuple[int, str]:
    proc = subprocess.Popen(
        ["./run_train.sh", *args], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"./run_train.sh {args} timed out:\n{out[-3000:]}")
    return proc.returncode, out


@pytest.fixture
def launch_env(cpu_env, dump_folder) -> dict:
    return dict(cpu_env, NGPU="2", LOG_RANK="0")


def assert_one_error_line(code: int, out: str, message: str) -> str:
    lines = [line for line in out.splitlines() if "error:" in line]
    assert len(lines) == 1, out[-4000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-4000:]
    assert message in lines[0], lines[0]
    assert code == 2, out[-4000:]
    return lines[0]


@pytest.fixture
def bad_toml(tmp_path) -> str:
    path = tmp_path / "bad.toml"
    path.write_text("[training]\nsteps = 10\nseq_len = \n")
    return str(path)


PREFLIGHT_CASES = {
    "typo-flag": (["--training.stesp", "3"], "did you mean --training.steps?"),
    "bad-int": (["--training.steps", "ten"], "--training.steps: invalid value 'ten'"),
    "out-of-range": (["--optimizer.lr", "-1"], "optimizer.lr must be >= 0"),
    "bool-with-value": (
        ["--profiling.enable_memory_snapshot=False"], "--profiling.no_enable_memory_snapshot"
    ),
    "bad-choice": (
        ["--activation_checkpoint.determinism_check", "strict"], "expected one of 'default'"
    ),
    "degrees-vs-ngpu": (["--parallelism.tensor_parallel_degree", "3"], "world size 2"),
    "explicit-degrees": (
        ["--parallelism.data_parallel_shard_degree", "4"], "but the world size is 2"
    ),
    "pipeline-microbatches": (
        ["--parallelism.pipeline_parallel_degree", "2",
         "--parallelism.pipeline_parallel_microbatch_size", "3"],
        "pipeline_parallel_microbatch_size=3 must be >= 1 and divide",
    ),
    "global-batch": (["--training.global_batch_size", "24"], "global_batch_size=24"),
    "unknown-flavor": (["--model.flavor", "9B"], "model.flavor '9B' is not a flavor"),
    "early-step-with-clipping": (
        ["--optimizer.early_step_in_backward"], "set --training.max_norm 0"
    ),
    "missing-tokenizer": (
        ["--model.hf_assets_path", "./assets/hf/Llama-3.1-8B"],
        "hf download meta-llama/Llama-3.1-8B",
    ),
    "missing-dataset": (
        ["--training.dataset_path", "./nowhere.jsonl"], "training.dataset_path='./nowhere.jsonl'"
    ),
    "unknown-name-in-a-mix": (
        ["--training.dataset", "c4_test:0.5,nope:0.5"], "Unknown dataset 'nope': use one of"
    ),
    "exclude-from-loading-typo": (
        ["--checkpoint.exclude_from_loading", "optimzer"],
        "checkpoint.exclude_from_loading has unknown name(s) ['optimzer']",
    ),
    "async-tp-on-cpu": (
        ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel",
         "--compile.enable"],
        "enable_async_tensor_parallel needs CUDA GPUs",
    ),
}


# A flag the parser refuses, and degrees that do not fit NGPU (the world size comes from
# ./run_train.sh's --nproc_per_node).
THROUGH_RUN_TRAIN = ["typo-flag", "degrees-vs-ngpu"]
# What ./run_train.sh execs for NGPU=2 LOG_RANK=0 (its "+ exec python -m torchtitan.launch" line).
LAUNCH_ARGV = ["--nproc_per_node=2", "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0",
               "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "--", "-m",
               "torchtitan.train", "--job.config_file", "./train_configs/debug_model.toml"]


@pytest.mark.slow
@pytest.mark.parametrize("case", THROUGH_RUN_TRAIN)
def test_bad_config_is_one_line_before_torchrun(launch_env, dump_folder, case):
    args, message = PREFLIGHT_CASES[case]
    code, out = run_train([*args, "--job.dump_folder", str(dump_folder)], launch_env)
    line = assert_one_error_line(code, out, message)
    assert line.startswith("error: "), line  # the launcher's own line, not a rank's
    assert "[rank" not in out, out[-3000:]  # torchrun never started
    assert not dump_folder.exists()


def launch_in_process(monkeypatch, capsys, args: list[str]) -> tuple[int, str, list]:
    """``torchtitan.launch.main`` as ./run_train.sh runs it on this CPU machine (repository
    root, CUDA_VISIBLE_DEVICES=""): exit code, console output, torchrun calls."""
    import torch.distributed.run as torchrun

    import torchtitan.tools.device as device
    from torchtitan.launch import main as launch_main

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(device, "device_type", "cpu")
    started: list = []
    monkeypatch.setattr(torchrun, "run", started.append)
    code = launch_main([*LAUNCH_ARGV, *args])
    out = capsys.readouterr()
    return code, out.out + out.err, started


@pytest.mark.parametrize("case", sorted(set(PREFLIGHT_CASES) - set(THROUGH_RUN_TRAIN)))
def test_bad_config_is_one_line_before_torchrun_in_process(monkeypatch, capsys, dump_folder,
                                                           case):
    args, message = PREFLIGHT_CASES[case]
    code, out, started = launch_in_process(
        monkeypatch, capsys, [*args, "--job.dump_folder", str(dump_folder)])
    line = assert_one_error_line(code, out, message)
    assert line.startswith("error: "), line
    assert started == []  # torchrun never started
    assert not dump_folder.exists()


@pytest.mark.slow
def test_bad_toml_is_one_line_before_torchrun(launch_env, bad_toml):
    code, out = run_train([], dict(launch_env, CONFIG_FILE=bad_toml))
    assert_one_error_line(code, out, "bad.toml")
    assert "[rank" not in out


@pytest.mark.slow
def test_failure_on_rank_1_only_reaches_the_rank_0_console(launch_env, dump_folder):
    code, out = run_train(
        ["--experimental.custom_import", FAIL_ON_RANK_1, "--job.dump_folder", str(dump_folder)],
        launch_env,
    )
    line = assert_one_error_line(code, out, "rank 1 cannot read /data/shard-1")
    assert re.search(r"\(rank 1; every rank's output: \S+\)$", line), line
    log_dir = line.rsplit(" ", 1)[-1].rstrip(")")
    errors = list(os.popen(f"find {log_dir} -name error.json").read().split())
    assert errors, f"no per-rank error file under {log_dir}"


def _bad_files(tmp_path, case: str) -> tuple[list[str], dict, str]:
    """(flags, environment, expected line) of a run whose files the pre-flight refuses."""
    if case == "dump-folder-is-a-file":
        path = tmp_path / "file"
        path.write_text("x")
        return ["--job.dump_folder", str(path)], {}, f"job.dump_folder={path} is a file"
    if case == "garbage-tokenizer":
        (tmp_path / "tokenizer.model").write_text("not a tokenizer\n")
        return ["--model.hf_assets_path", str(tmp_path)], {}, "is neither a tiktoken ranks file"
    if case == "empty-dataset":
        (tmp_path / "empty.jsonl").write_text("\n\n")
        return (["--training.dataset_path", str(tmp_path / "empty.jsonl")], {},
                "holds only whitespace: it holds no documents")
    assert case == "c4-offline"
    return (["--training.dataset", "c4"], {"HF_HUB_OFFLINE": "1"},
            "dataset 'c4' streams allenai/c4 from the Hugging Face Hub, but offline mode is set")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["c4-offline"])  # HF_HUB_OFFLINE is read at import time
def test_bad_files_are_one_line_before_torchrun(launch_env, dump_folder, tmp_path, case):
    args, env, message = _bad_files(tmp_path, case)
    code, out = run_train(["--job.dump_folder", str(dump_folder), *args], dict(launch_env, **env))
    line = assert_one_error_line(code, out, message)
    assert line.startswith("error: "), line
    assert "[rank" not in out, out[-3000:]


@pytest.mark.parametrize("case", ["dump-folder-is-a-file", "garbage-tokenizer", "empty-dataset"])
def test_bad_files_are_one_line_before_torchrun_in_process(monkeypatch, capsys, dump_folder,
                                                           tmp_path, case):
    args, env, message = _bad_files(tmp_path, case)
    assert env == {}
    code, out, started = launch_in_process(
        monkeypatch, capsys, ["--job.dump_folder", str(dump_folder), *args])
    line = assert_one_error_line(code, out, message)
    assert line.startswith("error: "), line
    assert started == []


@pytest.mark.slow
def test_error_inside_every_rank_is_shown_once(launch_env, dump_folder, tmp_path):
    """Text that is not UTF-8 shows only when a rank reads it (the pre-flight reads no data)."""
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"text": "caf\u00e9 au lait"}\n'.encode("latin-1") * 50)
    code, out = run_train(
        ["--training.dataset_path", str(bad), "--job.dump_folder", str(dump_folder)],
        launch_env,
    )
    line = assert_one_error_line(code, out, f"{bad}:1: not UTF-8 (byte 0xe9 at column 14)")
    # rank 0 said it and the launcher did not repeat it; or rank 1 failed first, torchrun
    # stopped rank 0 before it could say it, and the launcher showed rank 1's line (a race:
    # about 1 run in 10)
    assert line.startswith("[rank0]:") or "(rank 1; every rank's output: " in line, line


@pytest.mark.slow
def test_a_model_too_big_for_this_machine_is_one_line_before_allocating(launch_env, dump_folder):
    """70B's weights, gradients and AdamW states (~1 TiB) on a CPU machine: the ranks used
    to allocate until the kernel's OOM killer stopped one (a bare SIGKILL, or a frozen
    machine); now they add up their states on this host and stop in one line."""
    code, out = run_train(
        ["--model.flavor", "70B", "--training.seq_len", "64", "--training.local_batch_size", "1",
         "--job.dump_folder", str(dump_folder)],
        launch_env,
    )
    line = assert_one_error_line(
        code, out, "out of host memory before the first step: the weights, gradients and AdamW "
        "states of the 2 ranks on this machine alone need 1051.3 GiB, and this machine has ")
    assert line.startswith("[rank0]:"), line
