"""run_train.sh and multinode_trainer.slurm, run for real with a probe in place of the trainer.

The probe (tests/integration/assets/dist_probe.py) records its argv and launch environment
per rank; the slurm script runs against stub `srun`/`scontrol` (tests/integration/stubs/)
that emulate a two-node allocation on localhost.
"""

from __future__ import annotations

import json
import os
import pty
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT as REPO

pytestmark = pytest.mark.slow  # every test runs the shell scripts (and torchrun) in subprocesses

STUBS = REPO / "tests" / "integration" / "stubs"
PROBE = "tests.integration.assets.dist_probe"
PROBE_PY = "tests/integration/assets/dist_probe.py"

_CLEAN_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PROBE_", "STUB_")
_CLEAN_KEYS = {
    "NGPU",
    "LOG_RANK",
    "CONFIG_FILE",
    "CONFIG",
    "MODULE",
    "COMM_MODE",
    "TRAIN_FILE",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "GPUS_PER_NODE",
    "RDZV_PORT",
    "RDZV_ID",
    "LOGLEVEL",
    "PYTHONFAULTHANDLER",
    "NCCL_DEBUG",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCHTITAN_COLOR",
    "NO_COLOR",
}


def _fake_bin(tmp_path: Path, gpus: int = 0, nproc: int = 2) -> Path:
    """A bin dir with a fake `nvidia-smi` (showing `gpus` GPUs) and `nproc`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if gpus:
        lines = "\n".join(
            f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:04d})" for i in range(gpus)
        )
        smi = f"#!/bin/sh\ncat <<'EOF'\n{lines}\nEOF\n"
    else:
        smi = "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'\nexit 9\n"
    (bin_dir / "nvidia-smi").write_text(smi)
    (bin_dir / "nproc").write_text(f"#!/bin/sh\necho {nproc}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _env(tmp_path: Path, *, gpus: int = 0, nproc: int = 2, extra_path=(), **overrides) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _CLEAN_KEYS and not k.startswith(_CLEAN_PREFIXES)
    }
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    path = [str(p) for p in extra_path] + [str(_fake_bin(tmp_path, gpus, nproc)), env["PATH"]]
    env.update(PATH=os.pathsep.join(path), PROBE_OUT_DIR=str(out))
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def _run(cmd: list[str], env: dict, timeout: float = 90) -> subprocess.CompletedProcess:
    """Run from the repo root; on timeout kill the whole process group and fail."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} timed out after {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _ranks(tmp_path: Path) -> dict[int, dict]:
    files = sorted((tmp_path / "out").glob("rank_*.json"))
    return {int(f.stem.split("_")[1]): json.loads(f.read_text()) for f in files}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- run_train.sh


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_env_vars_and_trainer_flags(tmp_path, flag):
    res = _run(["./run_train.sh", flag], _env(tmp_path))
    assert res.returncode == 0, res.stderr
    for var in ("NGPU", "LOG_RANK", "CONFIG_FILE", "TRAIN_FILE", "COMM_MODE", "MODULE, CONFIG"):
        assert var in res.stdout
    assert not list((tmp_path / "out").iterdir()), "--help must not launch anything"
    if any((REPO / "torchtitan" / p).exists() for p in ("config_manager.py", "config/manager.py")):
        # The trainer's own flag help follows the env-var usage.
        assert "--job.config_file" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]


def test_torchrun_two_ranks_get_config_file_and_extra_flags(tmp_path):
    flags = ["--training.steps", "3", "--profiling.enable_memory_snapshot"]
    env = _env(
        tmp_path, nproc=8, NGPU=2, TRAIN_FILE=PROBE, CONFIG_FILE="./train_configs/llama3_8b.toml"
    )
    res = _run(["./run_train.sh", *flags], env)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = _ranks(tmp_path)
    assert sorted(ranks) == [0, 1]
    for rank, rec in ranks.items():
        assert rec["argv"] == ["--job.config_file", "./train_configs/llama3_8b.toml", *flags]
        assert rec["env"]["WORLD_SIZE"] == "2"
        assert rec["env"]["LOCAL_RANK"] == str(rank)
        assert rec["env"]["TORCHELASTIC_RUN_ID"] is not None  # launched by torchrun
        # CPU, 8 cores, 2 ranks: 4 threads each (torchrun alone would have set 1).
        assert rec["env"]["OMP_NUM_THREADS"] == "4"


@pytest.mark.parametrize("terminal", [True, False])
def test_ranks_learn_whether_the_launchers_console_is_a_terminal(tmp_path, terminal):
    """The ranks print through torchrun's pipes, so the launcher tells them (TORCHTITAN_COLOR)
    whether to colour their step lines: a terminal yes, a log file or a pipe no."""
    env = _env(tmp_path, TRAIN_FILE=PROBE)
    if terminal:
        main, sub = pty.openpty()
        try:
            proc = subprocess.run(["./run_train.sh"], cwd=REPO, env=env, stdout=sub,
                                  stderr=subprocess.PIPE, timeout=90)
        finally:
            os.close(sub)
            os.close(main)
    else:
        proc = subprocess.run(["./run_train.sh"], cwd=REPO, env=env, capture_output=True,
                              timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _ranks(tmp_path)[0]["env"]["TORCHTITAN_COLOR"] == ("1" if terminal else "0")


def test_module_and_config_pass_through_with_one_cpu_rank(tmp_path):
    env = _env(tmp_path, TRAIN_FILE=PROBE, MODULE="llama3", CONFIG="llama3_debugmodel")
    res = _run(["./run_train.sh", "--debug.seed", "42"], env)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = _ranks(tmp_path)
    assert list(ranks) == [0]  # no GPU -> NGPU defaults to 1
    rec = ranks[0]
    assert rec["argv"] == [
        "--module",
        "llama3",
        "--config",
        "llama3_debugmodel",
        "--debug.seed",
        "42",
    ]
    assert rec["env"]["WORLD_SIZE"] == "1"
    assert rec["env"]["OMP_NUM_THREADS"] is None  # one rank: nothing to split


@pytest.mark.parametrize("mode", ["fake_backend", "local_tensor"])
def test_comm_mode_runs_one_process_simulating_ngpu_ranks(tmp_path, mode):
    env = _env(tmp_path, COMM_MODE=mode, NGPU=8, TRAIN_FILE=PROBE)
    res = _run(["./run_train.sh", "--parallelism.tensor_parallel_degree", "8"], env)
    assert res.returncode == 0, res.stderr
    ranks = _ranks(tmp_path)
    assert list(ranks) == [0]
    rec = ranks[0]
    assert rec["env"]["COMM_MODE"] == mode
    assert rec["env"]["WORLD_SIZE"] == "8"
    assert rec["env"]["NGPU"] == "8"
    assert (rec["env"]["RANK"], rec["env"]["LOCAL_RANK"]) == ("0", "0")
    assert rec["env"]["TORCHELASTIC_RUN_ID"] is None  # plain python, no torchrun
    assert rec["argv"] == [
        "--job.config_file",
        "./train_configs/debug_model.toml",
        "--training.steps",
        "1",
        "--parallelism.tensor_parallel_degree",
        "8",
    ]


@pytest.mark.parametrize("steps_args", [["--training.steps", "5"], ["--training.steps=5"]])
def test_comm_mode_keeps_user_steps(tmp_path, steps_args):
    env = _env(tmp_path, COMM_MODE="fake_backend", NGPU=4, RANK=3, TRAIN_FILE=PROBE)
    res = _run(["./run_train.sh", *steps_args], env)
    assert res.returncode == 0, res.stderr
    rec = _ranks(tmp_path)[3]
    assert rec["argv"] == ["--job.config_file", "./train_configs/debug_model.toml", *steps_args]
    assert rec["env"]["RANK"] == "3"


@pytest.mark.parametrize(
    ("gpus", "visible", "expected"),
    [(0, None, "1"), (3, None, "3"), (4, "0,2", "2"), (4, "", "1")],
)
def test_ngpu_default_follows_visible_gpus(tmp_path, gpus, visible, expected):
    extra = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    env = _env(tmp_path, gpus=gpus, COMM_MODE="fake_backend", TRAIN_FILE=PROBE, **extra)
    res = _run(["./run_train.sh"], env)
    assert res.returncode == 0, res.stderr
    assert _ranks(tmp_path)[0]["env"]["WORLD_SIZE"] == expected


def test_train_file_path_and_exit_code_propagate(tmp_path):
    env = _env(tmp_path, COMM_MODE="fake_backend", TRAIN_FILE=PROBE_PY, PROBE_EXIT_CODE=7)
    res = _run(["./run_train.sh"], env)
    assert res.returncode == 7
    assert _ranks(tmp_path)[0]["argv"][:2] == [
        "--job.config_file",
        "./train_configs/debug_model.toml",
    ]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"COMM_MODE": "fake"},
            "COMM_MODE must be empty, fake_backend or local_tensor; got 'fake'",
        ),
        ({"MODULE": "llama3"}, "set both MODULE and CONFIG"),
        ({"CONFIG": "llama3_8b"}, "set both MODULE and CONFIG"),
        (
            {"CONFIG_FILE": "./train_configs/nope.toml"},
            "CONFIG_FILE './train_configs/nope.toml' does not exist",
        ),
        # Before: "does not exist", for a folder that does.
        ({"CONFIG_FILE": "./train_configs"}, "CONFIG_FILE './train_configs' is a folder, not a "
         "TOML file; give one of its .toml files, e.g. CONFIG_FILE=./train_configs/debug_model.toml"),
        ({"NGPU": "two"}, "NGPU must be a positive integer, got 'two'"),
        ({"CONFIG_FILE": "./train_configs/debug_model.toml", "MODULE": "llama3",
          "CONFIG": "llama3_8b"}, "set CONFIG_FILE or MODULE+CONFIG, not both"),
        ({"NGPU": "2", "LOG_RANK": "2"},
         "LOG_RANK='2' must name local ranks among 0..1 (NGPU=2)"),
        ({"NGPU": "2", "LOG_RANK": "0,one"},
         "LOG_RANK='0,one' must name local ranks among 0..1 (NGPU=2)"),
        ({"TRAIN_FILE": "missing/train.py"}, "TRAIN_FILE 'missing/train.py' does not exist"),
        # Before: "rank 0 failed (exit code 1)" from torchrun, without the reason.
        ({"TRAIN_FILE": "torchtitan.trian"},
         "TRAIN_FILE 'torchtitan.trian' is neither a .py file nor a module Python can import"),
        # Before: bash's "No such file or directory", exit 127.
        ({"PYTHON": "/no/such/python"}, "PYTHON='/no/such/python' is not an executable"),
        # Before: accepted and ignored by the OpenMP runtime.
        ({"OMP_NUM_THREADS": "four"},
         "OMP_NUM_THREADS must be a positive integer (CPU threads per rank), got 'four'"),
    ],
)
def test_bad_settings_fail_with_one_clear_line(tmp_path, overrides, message):
    env = _env(tmp_path, **{"TRAIN_FILE": PROBE, **overrides})
    res = _run(["./run_train.sh"], env)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run_train.sh: "), res.stderr
    assert message in lines[0]
    assert not _ranks(tmp_path)


# ------------------------------------------------------------------- multinode_trainer.slurm


def test_slurm_two_nodes_rendezvous_and_all_reduce(tmp_path):
    port = _free_port()
    srun_log = tmp_path / "srun.log"
    env = _env(
        tmp_path,
        extra_path=[STUBS],
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_NNODES=2,
        SLURM_JOB_ID=4242,
        GPUS_PER_NODE=1,
        RDZV_PORT=port,
        TRAIN_FILE=PROBE,
        CONFIG_FILE="./train_configs/debug_model.toml",
        PROBE_INIT_PG=1,
        STUB_SRUN_LOG=srun_log,
    )
    res = _run(
        ["bash", "multinode_trainer.slurm", "--training.steps", "2", "--debug.deterministic"], env
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]

    ranks = _ranks(tmp_path)
    assert sorted(ranks) == [0, 1]
    for rec in ranks.values():
        assert rec["world_size"] == 2
        assert rec["sum"] == 3.0  # all_reduce of rank+1 over ranks 0 and 1
        assert rec["argv"] == [
            "--job.config_file",
            "./train_configs/debug_model.toml",
            "--training.steps",
            "2",
            "--debug.deterministic",
        ]
        assert rec["env"]["TORCHELASTIC_RUN_ID"] == "4242"
        assert rec["env"]["LOGLEVEL"] == "INFO"
        assert rec["env"]["PYTHONFAULTHANDLER"] == "1"
    # One torchrun per "node", each with one rank.
    assert sorted(rec["env"]["SLURM_NODEID"] for rec in ranks.values()) == ["0", "1"]
    assert all(rec["env"]["LOCAL_RANK"] == "0" for rec in ranks.values())

    calls = [json.loads(line) for line in srun_log.read_text().splitlines()]
    assert calls[0] == ["--nodes=1", "--ntasks=1", "-w", "node1", "hostname", "--ip-address"]
    torchrun = calls[1]
    assert torchrun[1:3] == ["-m", "torchtitan.launch"]  # $PYTHON -m torchtitan.launch
    assert torchrun[3:13] == [
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv_id",
        "4242",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{port}",
    ]


def _fake_torchrun(tmp_path: Path) -> tuple[Path, Path]:
    """A `python` whose ``-m torchtitan.launch`` (torchrun, through the project's launcher) only
    records its argv (one JSON line per call); anything else runs the real Python."""
    import sys

    bin_dir = tmp_path / "fake_torchrun"
    bin_dir.mkdir()
    log = tmp_path / "torchrun.log"
    script = bin_dir / "python"
    script.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "if sys.argv[1:3] != ['-m', 'torchtitan.launch']:\n"
        f"    os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])\n"
        f"open({str(log)!r}, 'a').write(json.dumps([os.environ['SLURM_NODEID'], *sys.argv[3:]]) + '\\n')\n"
    )
    script.chmod(0o755)
    return bin_dir, log


@pytest.mark.parametrize(
    ("node_ip", "endpoint_host"),
    [
        ("", "gpu01"),  # no address: fall back to the host name
        ("fe80::1 10.1.2.3", "10.1.2.3"),  # several: first IPv4
        ("fe80::1", "[fe80::1]"),  # IPv6 only: bracketed
    ],
)
def test_slurm_head_node_address_and_module_config(tmp_path, node_ip, endpoint_host):
    fake_bin, log = _fake_torchrun(tmp_path)
    env = _env(
        tmp_path,
        extra_path=[fake_bin, STUBS],
        SLURM_JOB_NODELIST="gpu[01-03]",
        SLURM_NNODES=3,
        STUB_NODE_IP=node_ip,
        MODULE="llama3",
        CONFIG="llama3_70b",
    )
    res = _run(["bash", "multinode_trainer.slurm", "--x.y", "1"], env)
    assert res.returncode == 0, res.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(c[0] for c in calls) == ["0", "1", "2"]  # one torchrun per node
    args = calls[0][1:]
    assert args[args.index("--nnodes") + 1] == "3"
    assert args[args.index("--nproc_per_node") + 1] == "8"  # GPUS_PER_NODE default
    assert args[args.index("--rdzv_endpoint") + 1] == f"{endpoint_host}:29500"
    assert args[-7:] == [
        "torchtitan.train",
        "--module",
        "llama3",
        "--config",
        "llama3_70b",
        "--x.y",
        "1",
    ]
    assert args[-9:-7] == ["--", "-m"]


def test_slurm_outside_an_allocation_fails_clearly(tmp_path):
    res = _run(["bash", "multinode_trainer.slurm"], _env(tmp_path, extra_path=[STUBS]))
    assert res.returncode == 2
    assert "SLURM_JOB_NODELIST is not set: submit with sbatch" in res.stderr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"MODULE": "llama3"}, "set both MODULE and CONFIG"),
     ({"CONFIG_FILE": "./train_configs/llama3_8b.toml", "MODULE": "llama3",
       "CONFIG": "llama3_70b"}, "set CONFIG_FILE or MODULE+CONFIG, not both"),
     # each was passed on to every node, which failed (or waited) there
     ({"CONFIG_FILE": "/nope.toml"}, "CONFIG_FILE '/nope.toml' is not a file"),
     ({"GPUS_PER_NODE": "abc"}, "GPUS_PER_NODE must be a positive integer (ranks per node), "
                                "got 'abc'"),
     ({"GPUS_PER_NODE": "8", "SLURM_GPUS_ON_NODE": "4"},
      "GPUS_PER_NODE=8 ranks per node, but the allocation has 4 GPUs per node"),
     ({"RDZV_PORT": "99999x"}, "RDZV_PORT must be a TCP port (1-65535), got '99999x'"),
     ({"SLURM_NNODES": "5"}, "SLURM_NNODES=5, but the node list 'gpu[01-02]' has 2 nodes"),
     ({"TRAIN_FILE": "nope.py"}, "TRAIN_FILE 'nope.py' does not exist"),
     ({"TRAIN_FILE": "no.such.module"}, "TRAIN_FILE 'no.such.module' is neither a .py file nor "
                                        "a module Python can import")],
)
def test_slurm_config_choice_that_would_ignore_a_setting_is_refused(tmp_path, overrides,
                                                                     message):
    fake_bin, log = _fake_torchrun(tmp_path)
    settings = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": 2, "STUB_NODE_IP": "10.0.0.1",
                **overrides}
    env = _env(tmp_path, extra_path=[fake_bin, STUBS], **settings)
    res = _run(["bash", "multinode_trainer.slurm"], env)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not log.exists()  # no torchrun started


def test_slurm_help_is_printed_here_not_launched(tmp_path):
    fake_bin, log = _fake_torchrun(tmp_path)
    env = _env(tmp_path, extra_path=[fake_bin, STUBS], SLURM_JOB_NODELIST="gpu[01-02]")
    res = _run(["bash", "multinode_trainer.slurm", "--help"], env)
    assert res.returncode == 0 and "sbatch multinode_trainer.slurm [trainer flags...]" in res.stdout
    assert not log.exists()
