"""Flight Recorder on gloo: a rank that stalls ends the job with dumps and a clear message."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import REPO_ROOT as REPO
from tests.trainer_hooks import train_step_hook
from torchtitan.tools.flight_recorder import (
    EXIT_CODE,
    fix_pg_config,
    is_collective_failure,
    last_collectives,
)

WORKER = textwrap.dedent(
    """
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    from torchtitan.config.job_config import Comm
    from torchtitan.tools.flight_recorder import CollectiveWatchdog, configure_env
    from torchtitan.tools.logging import init_logger

    init_logger()
    comm = Comm(init_timeout_seconds=int(sys.argv[2]))
    dump_folder = sys.argv[1]
    configure_env(comm, dump_folder, "cpu")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=comm.init_timeout_seconds))
    rank = dist.get_rank()
    t = torch.ones(8)
    with CollectiveWatchdog(comm, dump_folder, poll_seconds=0.5) as watchdog:
        for step in (1, 2, 3):
            watchdog.set_step(step)
            if step == 2 and rank == 1:
                time.sleep(120)  # the stall: rank 1 never joins step 2's all_reduce
            dist.all_reduce(t)
    print("finished", flush=True)
    os._exit(0)
    """
)


@pytest.mark.slow
def test_stalled_rank_ends_job_with_dumps_and_message(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    dump = tmp_path / "out"
    timeout_s = 5
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script), str(dump), str(timeout_s)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "finished" not in out
    # start-up (a few s on 2 busy cores) + the 5 s timeout + dump/exchange; far below the sleep
    assert elapsed < 60, (elapsed, out)
    assert f"exitcode  : {EXIT_CODE}" in out or f"exitcode: {EXIT_CODE}" in out, out
    line = next((ln for ln in out.splitlines() if "Collective timeout/failure on rank 0" in ln), out)
    assert "all_reduce (collective #2 on process group 0 'default_pg'" in line, line
    assert "stalled: rank 1 (at step 2" in line and "never joined it" in line, line
    assert "Stopping rank 1 at step 2: rank 0 reported that all_reduce #2" in out, out

    traces = dump / "comm_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["rank_0", "rank_1"]
    dumps = {}
    for r in (0, 1):
        with open(traces / f"rank_{r}", "rb") as f:
            dumps[r] = pickle.load(f)
        assert dumps[r]["pg_config"]["0"]["ranks"] == "[0, 1]"
    assert last_collectives(dumps[0])["0"]["seq"] == 2
    assert last_collectives(dumps[1])["0"]["seq"] == 1



STALL_HOOK = train_step_hook(
    """
    if self.step == 2 and self.rank == 1:
        time.sleep(300)  # rank 1 stops taking part in collectives at step 2
    return _orig(self, data_iterator)
    """,
    imports="import time",
)


@pytest.mark.slow
def test_trainer_stall_after_step_one_uses_train_timeout(tmp_path):
    """Through ./run_train.sh: the 5 s comm.train_timeout_seconds applies after step 1."""
    (tmp_path / "stall_rank1.py").write_text(STALL_HOOK)
    env = dict(os.environ, NGPU="2", LOG_RANK="0,1", PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}",
               PYTHONWARNINGS="ignore")
    start = time.monotonic()
    proc = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(tmp_path / "out"), "--model.flavor",
         "debugmodel_tiny", "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--training.steps", "3", "--comm.init_timeout_seconds", "60",
         "--comm.train_timeout_seconds", "5", "--experimental.custom_import", "stall_rank1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=150,
    )
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert elapsed < 60, (elapsed, out[-3000:])  # not the 60 s init timeout, nor the 300 s sleep
    assert "step:  1" in out and "step:  2" not in out
    assert re.search(r"Collective timeout/failure on rank 0 at step 2: all_reduce \(collective #\d+ "
                     r"on process group 0 'default_pg'", out), out[-3000:]
    assert "Timed out waiting 5000ms" in out
    assert "stalled: rank 1 (at step 2;" in out and "never joined it" in out
    assert re.search(r"Stopping rank 1 at step 2: rank 0 reported that all_reduce #\d+", out)
    traces = tmp_path / "out" / "comm_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["rank_0", "rank_1"]

    # torch's analyser reads the dumps as they are and finds the missing rank.
    analysis = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(traces),
         "-p", "rank_"],
        capture_output=True, text=True, timeout=60,
    )
    report = analysis.stdout + analysis.stderr
    assert "Not all ranks joining collective" in report, report
    assert "missing ranks: {1}" in report, report


def _entry(record_id, pg, seq, op="gloo:all_reduce"):
    return {
        "record_id": record_id, "process_group": pg, "collective_seq_id": seq, "p2p_seq_id": 0,
        "is_p2p": False, "profiling_name": op, "input_sizes": [[4]], "time_created_ns": record_id,
    }


def test_fix_pg_config_rekeys_gloo_dump():
    trace = {
        "pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1, 2, 3]"}},
        "entries": [_entry(0, ("0", "default_pg"), 1), _entry(1, ("3", "mesh_tp"), 1)],
    }
    fixed = fix_pg_config(trace)
    assert set(fixed["pg_config"]) == {"0", "3"}
    assert fixed["pg_config"]["0"] == {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}
    known = {"3": {"name": "3", "desc": "mesh_tp", "ranks": "[0, 1]"}}
    assert fix_pg_config(trace, known)["pg_config"]["3"]["ranks"] == "[0, 1]"


def test_last_collectives_per_group():
    trace = {"entries": [_entry(0, ("0", "default_pg"), 1), _entry(1, ("1", "mesh_dp"), 1),
                         _entry(2, ("0", "default_pg"), 2, "gloo:broadcast")]}
    last = last_collectives(trace)
    assert last["0"]["seq"] == 2 and last["0"]["op"] == "broadcast"
    assert last["1"]["seq"] == 1 and last["1"]["desc"] == "mesh_dp"


def test_is_collective_failure():
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv")
    assert is_collective_failure(gloo)
    assert is_collective_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert not is_collective_failure(RuntimeError("shape mismatch"))
    assert not is_collective_failure(ValueError("timed out"))
