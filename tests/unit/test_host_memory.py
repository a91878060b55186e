"""Host memory (torchtitan/tools/host_memory.py): a CPU run whose training state cannot fit is
refused in one line before its weights are allocated, and a rank the kernel's OOM killer
stopped is named as such by the launcher (before, both were a bare SIGKILL)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.integration.trainer_utils import TINY
from torchtitan.config.manager import ConfigManager
from torchtitan.distributed.parallel_dims import ParallelismError
from torchtitan.tools import host_memory
from torchtitan.tools.host_memory import (
    available_host_bytes,
    check_training_state_fits,
    killed_by_oom_killer,
    oom_kill_count,
    training_state_bytes,
)

GiB = 1024**3


def _files(tmp_path, meminfo: str, cgroup: str = "0::/\n", **cgroup_files: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "meminfo").write_text(meminfo)
    (tmp_path / "cgroup").write_text(cgroup)
    root = tmp_path / "sys"
    for rel, text in cgroup_files.items():
        path = root / rel.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return dict(meminfo=str(tmp_path / "meminfo"), proc_cgroup=str(tmp_path / "cgroup"),
                cgroup_root=str(root))


MEMINFO = "MemTotal:       24684092 kB\nMemAvailable:    2097152 kB\nSwapFree:        1048576 kB\n"


def test_available_is_free_memory_plus_swap_capped_by_the_cgroup(tmp_path):
    assert available_host_bytes(**_files(tmp_path / "a", MEMINFO)) == 3 * GiB
    v2 = _files(tmp_path / "b", MEMINFO, "0::/job\n",
                **{"job__memory.max": str(2 * GiB), "job__memory.current": str(GiB // 2)})
    assert available_host_bytes(**v2) == GiB * 3 // 2
    no_limit = _files(tmp_path / "c", MEMINFO, "0::/job\n",
                      **{"job__memory.max": "max", "job__memory.current": "5"})
    assert available_host_bytes(**no_limit) == 3 * GiB
    v1 = _files(tmp_path / "d", MEMINFO, "4:memory:/pod\n1:cpu:/\n",
                **{"memory__pod__memory.limit_in_bytes": str(GiB),
                   "memory__pod__memory.usage_in_bytes": str(GiB // 4)})
    assert available_host_bytes(**v1) == GiB * 3 // 4
    v1_unlimited = _files(tmp_path / "e", MEMINFO, "4:memory:/\n",
                          **{"memory__memory.limit_in_bytes": "9223372036854771712"})
    assert available_host_bytes(**v1_unlimited) == 3 * GiB
    assert available_host_bytes(meminfo=str(tmp_path / "missing")) is None


def test_training_state_counts_weights_gradients_and_two_states():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10, bias=False))  # 210 params
    assert training_state_bytes(model.parameters(), "float32") == 210 * 16
    assert training_state_bytes(model.parameters(), "bfloat16") == 210 * 12
    with torch.device("meta"):
        meta = nn.Linear(10, 10).to(torch.bfloat16)
    assert training_state_bytes(meta.parameters(), "float32") == 110 * 8
    assert training_state_bytes(model.parameters(), "float32", param_itemsize=2) == 210 * 8


def test_a_state_that_cannot_fit_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 2 * GiB)
    check_training_state_fits(2 * GiB, "AdamW")  # fits exactly
    with pytest.raises(ParallelismError) as err:
        check_training_state_fits(3 * GiB, "AdamW")
    assert str(err.value) == (
        "out of host memory before the first step: the weights, gradients and AdamW states "
        "alone need 3.0 GiB, and this machine has 2.0 GiB available (free memory and swap); "
        "pick a smaller model.flavor, or shard the model over more machines or GPUs"
    )
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: None)  # not Linux
    check_training_state_fits(1 << 50, "AdamW")


def test_the_trainer_refuses_before_allocating_the_weights(tmp_path, monkeypatch):
    """The debug model's training state (~100 MiB) with 10 MiB left: the trainer stops before
    ``to_empty``."""
    from torchtitan.train import Trainer

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    materialized = []
    monkeypatch.setattr(nn.Module, "to_empty",
                        lambda self, **kw: materialized.append(self) or self)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 10 * 1024**2)
    cfg = ConfigManager().parse_args([*TINY, "--job.dump_folder", str(tmp_path),
                                      "--model.flavor", "debugmodel"])
    with pytest.raises(ParallelismError, match=r"AdamW states alone need \d+ MiB, and this machine has 10 MiB available"):
        Trainer(cfg)
    assert materialized == []


def test_an_async_save_stages_weights_and_states_in_host_memory(monkeypatch, caplog):
    """checkpoint.async_mode copies each rank's weights and AdamW states to host memory at every
    save: on the CPU that copy counts in the start-up refusal, on a GPU it gets a warning."""
    from torchtitan.config.job_config import JobConfig
    from torchtitan.distributed.comm_mode.base import CommMode

    with torch.device("meta"):
        model = nn.Linear(1024, 1024, bias=False)  # 1 Mi parameters
    assert host_memory.staged_checkpoint_bytes(model.parameters(), "float32") == 12 * 1024**2
    assert host_memory.staged_checkpoint_bytes(model.parameters(), "bfloat16") == 8 * 1024**2
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 20 * 1024**2)

    cfg = JobConfig()
    cfg.checkpoint.enable = True
    CommMode(1).check_state_memory([model], cfg, "cpu", None)  # 16 MiB of training state fit
    cfg.checkpoint.async_mode = "async"
    with pytest.raises(ParallelismError) as err:
        CommMode(1).check_state_memory([model], cfg, "cpu", None)
    assert str(err.value) == (
        "out of host memory before the first step: the weights, gradients and AdamW states, "
        "with the copy checkpoint.async_mode stages at each save (12 MiB), need 28 MiB, and "
        "this machine has 20 MiB available (free memory and swap); use --checkpoint.async_mode "
        "disabled, or pick a smaller model.flavor, or shard the model over more machines or GPUs"
    )
    cfg.checkpoint.load_only = True  # nothing is saved
    CommMode(1).check_state_memory([model], cfg, "cpu", None)

    cfg.checkpoint.load_only = False
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 10 * 1024**2)
    caplog.clear()
    with caplog.at_level("WARNING", logger="torchtitan"):
        CommMode(1).check_state_memory([model], cfg, "cuda", None)  # GPU state is not host's
    assert [r.getMessage() for r in caplog.records] == [
        "Checkpoint: checkpoint.async_mode=async stages a host copy of the weights and optimizer "
        "state at each save, 12 MiB for this rank, but this machine has 10 MiB available: the "
        "first save is likely to be killed for memory; use --checkpoint.async_mode disabled (or "
        "shard over more machines)"
    ]
    caplog.clear()
    cfg.checkpoint.async_mode = "disabled"
    with caplog.at_level("WARNING", logger="torchtitan"):
        CommMode(1).check_state_memory([model], cfg, "cuda", None)
    assert caplog.records == []


def test_oom_kill_counter(tmp_path):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("pgfault 10\noom_kill 3\n")
    assert oom_kill_count(str(vmstat)) == 3
    assert not killed_by_oom_killer(3, str(vmstat))
    vmstat.write_text("pgfault 10\noom_kill 4\n")
    assert killed_by_oom_killer(3, str(vmstat))
    assert not killed_by_oom_killer(None, str(vmstat))
    assert oom_kill_count(str(tmp_path / "none")) is None


@pytest.mark.parametrize("entry, estimate", [
    (["-m", "torchtitan.train", "--job.config_file", "./train_configs/debug_model.toml"],
     "; lower training.local_batch_size or training.seq_len, turn on activation checkpointing, "
     "or spread the model over more ranks; `python scripts/estimate_memory.py --world-size 2 "
     "--job.config_file ./train_configs/debug_model.toml` shows this config's peak per rank "
     "by part"),
    (["-m", "some.module"], ""),
])
@pytest.mark.parametrize("oom_killer", [True, False])
def test_the_launcher_names_the_oom_killer(monkeypatch, tmp_path, capsys, entry, estimate,
                                           oom_killer):
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    import torchtitan.launch as launch

    def killed(args):
        err = ChildFailedError.__new__(ChildFailedError)
        err.failures = {1: SimpleNamespace(local_rank=1, message="", error_file_data={},
                                           exitcode=-9, timestamp=1, signal_name=lambda: "SIGKILL")}
        raise err

    monkeypatch.setattr(torchrun, "run", killed)
    monkeypatch.setattr(launch, "oom_kill_count", lambda: 7)
    monkeypatch.setattr(launch, "killed_by_oom_killer", lambda before: oom_killer and before == 7)
    code = launch.main(["--nproc_per_node=2", "--log-dir", str(tmp_path), "--", *entry])
    assert code == 137
    what = ("killed by the kernel's out-of-memory killer (SIGKILL): the ranks ran out of host "
            f"memory{estimate}" if oom_killer else "killed by signal SIGKILL")
    assert capsys.readouterr().err == f"error: rank 1 failed ({what}); its output: {tmp_path}\n"
