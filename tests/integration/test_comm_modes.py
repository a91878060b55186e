"""COMM_MODE dry runs through ./run_train.sh on CPU (torchtitan/distributed/comm_mode/).

The debugging guide's 70B-at-128-ranks example takes over a minute on 2 cores, so CI runs the same
config (TP 8, full AC, 128 ranks) with the 1B flavor; see docs/debugging.md for the 70B numbers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.trainer_hooks import train_step_hook
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.comm_mode import COMM_MODES, comm_mode_from_env, get_comm_mode
from torchtitan.distributed.parallel_dims import ParallelDims, ParallelismError

ROOT = Path(__file__).resolve().parents[2]

# Prints every step's loss and grad norm at full precision (imported via custom_import).
LOSS_PROBE = train_step_hook(
    """
    loss, grad_norm = _orig(self, data_iterator)
    print(f"LOSS_PROBE step={self.step} loss={float(loss)!r} grad_norm={float(grad_norm)!r}",
          flush=True)
    return loss, grad_norm
    """
)


# Builds the flavors with 2 layers (appended to the probe where the depth does not matter: each
# layer adds its collectives, simulated or real, to every step).
TWO_LAYERS = textwrap.dedent(
    """
    from torchtitan.models.spec import ModelSpec
    _get_model_args = ModelSpec.get_model_args
    def _two_layers(self, flavor):
        args = _get_model_args(self, flavor)
        args.n_layers = 2
        return args
    ModelSpec.get_model_args = _two_layers
    """
)


def _run(env: dict[str, str], *flags: str, tmp: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", **env)
    full_env.pop("COMM_MODE", None) if "COMM_MODE" not in env else None
    return subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(tmp / "out"), *flags],
        cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout,
    )


def _probed(proc: subprocess.CompletedProcess) -> list[tuple[int, float, float]]:
    number = r"(-?[0-9.]+(?:e[-+]?[0-9]+)?|nan|inf)"  # output of other ranks may follow it
    found = re.findall(rf"LOSS_PROBE step=(\d+) loss={number} grad_norm={number}",
                       proc.stdout + proc.stderr)
    return [(int(s), float(loss), float(g)) for s, loss, g in found]


@pytest.mark.slow
def test_fake_backend_32_ranks_debug_model(tmp_path):
    proc = _run({"NGPU": "32", "COMM_MODE": "fake_backend"}, tmp=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "one process playing rank 0 of 32 on a fake process group" in out
    assert "Applied FSDP to the model (mesh {'dp_shard': 32}" in out
    assert "step 1 ran forward, backward and the optimizer on fake tensors" in out
    assert "Training completed" in out
    assert not (tmp_path / "out" / "checkpoint").exists()


@pytest.mark.slow
def test_fake_backend_128_ranks_70b_config_with_1b_flavor_and_cp4(tmp_path):
    """llama3_70b.toml's layout (TP 8, full AC, seq 8192) at 128 ranks with context parallel 4
    (FSDP over dp_shard 4 x cp 4); no tokenizer."""
    proc = _run(
        {"NGPU": "128", "COMM_MODE": "fake_backend", "CONFIG_FILE": "./train_configs/llama3_70b.toml"},
        "--model.flavor", "1B", "--parallelism.context_parallel_degree", "4", tmp=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "no tokenizer" in out  # ./assets/hf/Llama-3.1-70B is absent: flavor vocab is used
    assert "dp_shard=4, cp=4, tp=8" in out
    assert "Applied FSDP to the model (mesh {'dp_shard_cp': 16}" in out
    assert "Applied tensor parallel (degree 8" in out
    assert "step 1 ran forward, backward and the optimizer on fake tensors" in out


@pytest.mark.slow
def test_fake_backend_expert_parallel_with_hsdp_and_cp(tmp_path):
    """The 671B EP dry run's path (docs/composability.md) with the DeepSeek-V3 debug flavor:
    16 ranks, EP4 borrowed from dp_shard 4 x cp 2, experts HSDP over (dp_replicate 2,
    dp_shard_mod_ep 2); the all-to-all is sized for balanced routing."""
    proc = _run(
        {"NGPU": "16", "COMM_MODE": "fake_backend", "MODULE": "deepseek_v3",
         "CONFIG": "deepseek_v3_debugmodel"},
        "--parallelism.expert_parallel_degree", "4",
        "--parallelism.data_parallel_replicate_degree", "2",
        "--parallelism.context_parallel_degree", "2", tmp=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("assumes balanced routing (each rank sends 1/4 of its routed tokens") == 1
    assert "Applied expert parallel to 5 MoE layer(s) (ep=4: 2 experts per rank" in out
    assert ("Applied HSDP to the model (mesh {'dp_replicate': 2, 'dp_shard_cp': 8}" in out
            and "experts on {'dp_replicate': 2, 'dp_shard_mod_ep': 2})" in out)
    assert "step 1 ran forward, backward and the optimizer on fake tensors" in out


@pytest.mark.slow
def test_fake_backend_expert_tensor_parallel(tmp_path):
    """The 671B expert-TP dry run's path with the DeepSeek-V3 debug flavor (shared experts):
    8 ranks, TP2 with the experts' hidden dims over tp, EP2 borrowed from dp_shard 4."""
    proc = _run(
        {"NGPU": "8", "COMM_MODE": "fake_backend", "MODULE": "deepseek_v3",
         "CONFIG": "deepseek_v3_debugmodel"},
        "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
        "--parallelism.expert_tensor_parallel_degree", "2", tmp=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert ("Applied expert parallel to 5 MoE layer(s) (ep=2: 4 experts per rank, all-to-all "
            "dispatch, balanced routing assumed; etp=2: expert hidden dims split over tp)") in out
    assert "dp_shard=4, cp=1, tp=2, pp=1, ep=2, etp=2" in out
    assert "step 1 ran forward, backward and the optimizer on fake tensors" in out


@pytest.mark.slow
def test_local_tensor_matches_real_gloo_tp2_fsdp2(tmp_path):
    (tmp_path / "loss_probe.py").write_text(LOSS_PROBE)
    flags = ["--model.flavor", "debugmodel_tiny", "--training.seq_len", "64",
             "--training.local_batch_size", "2", "--training.steps", "2", "--debug.seed", "42",
             "--parallelism.tensor_parallel_degree", "2",
             "--parallelism.data_parallel_shard_degree", "2",
             "--experimental.custom_import", "loss_probe"]
    env = {"NGPU": "4", "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    simulated = _run({**env, "COMM_MODE": "local_tensor"}, *flags, tmp=tmp_path)
    assert simulated.returncode == 0, (simulated.stdout + simulated.stderr)[-3000:]
    real = _run(env, *flags, tmp=tmp_path)
    assert real.returncode == 0, (real.stdout + real.stderr)[-3000:]
    sim_losses, real_losses = _probed(simulated), _probed(real)
    assert [s for s, _, _ in sim_losses] == [1, 2], simulated.stdout[-2000:]
    # Same data per dp rank, same per-rank init, same collectives: bitwise-equal losses. The
    # grad norm's float32 sums over the per-mesh groups may be ordered differently by the
    # simulated and the real collectives (measured: 6e-8 apart at step 2).
    assert [(s, loss) for s, loss, _ in sim_losses] == [(s, loss) for s, loss, _ in real_losses]
    for (_, _, sim_norm), (_, _, real_norm) in zip(sim_losses, real_losses):
        assert sim_norm == pytest.approx(real_norm, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layout, logged", [
    # experts on the (ep, tp) mesh, gathered on use over dp_shard_mod_ep
    (dict(data_parallel_shard_degree=2, tensor_parallel_degree=2),
     "ep=2: 4 experts per rank, all-to-all dispatch; etp=2: expert hidden dims split over tp"),
    # two TP groups of two ranks: ep = the groups, their routed token counts differ
    (dict(data_parallel_shard_degree=1, tensor_parallel_degree=4),
     "tp=4: 2 TP groups route their own tokens; ep=2: 4 experts per rank, all-to-all "
     "dispatch; etp=2: expert hidden dims split over each TP group"),
], ids=["ep2_tp2_etp2_fsdp2", "ep2_tp4_etp2"])
def test_local_tensor_matches_real_gloo_expert_parallel_with_expert_tp(tmp_path, layout, logged):
    """EP2 x ETP2 (Qwen3 MoE debug flavor, 2 of its 4 layers): the token all-to-all's per-rank
    splits, the experts' DTensors and the expert TP all-reduce, simulated in one process, give
    the real 4-rank run's losses."""
    (tmp_path / "loss_probe.py").write_text(LOSS_PROBE + TWO_LAYERS)
    flags = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe",
             "--training.seq_len", "64", "--training.local_batch_size", "2",
             "--training.steps", "3", "--debug.seed", "42",
             "--parallelism.expert_parallel_degree", "2",
             "--parallelism.expert_tensor_parallel_degree", "2",
             "--experimental.custom_import", "loss_probe"]
    flags += [arg for key, value in layout.items() for arg in (f"--parallelism.{key}", str(value))]
    env = {"NGPU": "4", "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    simulated = _run({**env, "COMM_MODE": "local_tensor"}, *flags, tmp=tmp_path)
    out = simulated.stdout + simulated.stderr
    assert simulated.returncode == 0, out[-3000:]
    assert logged in out and "n_layers=2," in out
    real = _run(env, *flags, tmp=tmp_path)
    assert real.returncode == 0, (real.stdout + real.stderr)[-3000:]
    sim_losses, real_losses = _probed(simulated), _probed(real)
    assert [s for s, _, _ in sim_losses] == [1, 2, 3] == [s for s, _, _ in real_losses]
    # measured: losses equal bit for bit, grad norms 1e-7 apart (float32 sums in another
    # order); a routing flip from a wrong gradient moves the loss by 1e-4 or more
    for (_, sim_loss, sim_norm), (_, real_loss, real_norm) in zip(sim_losses, real_losses):
        assert sim_loss == pytest.approx(real_loss, rel=1e-6, abs=0)
        assert sim_norm == pytest.approx(real_norm, rel=1e-6)


def _dims(**degrees) -> ParallelDims:
    base = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1)
    base.update(degrees)
    return ParallelDims(**base)


@pytest.mark.parametrize(
    "mode, degrees, refused",
    [
        ("fake_backend", dict(pp=2, world_size=8), "pipeline parallel"),
        ("local_tensor", dict(pp=2, world_size=8), "pipeline parallel"),
        ("local_tensor", dict(cp=2, world_size=8), "context parallel"),
    ],
)
def test_refusals_name_the_parallelism(mode, degrees, refused):
    with pytest.raises(ParallelismError, match=rf"COMM_MODE={mode} cannot run {refused}"):
        COMM_MODES[mode](degrees["world_size"]).prepare(JobConfig(), _dims(**degrees))


def test_fake_backend_turns_off_checkpoint_and_validation():
    cfg = JobConfig()
    cfg.checkpoint.enable = cfg.validation.enable = cfg.metrics.enable_tensorboard = True
    COMM_MODES["fake_backend"](8).prepare(cfg, _dims(world_size=8))
    assert not (cfg.checkpoint.enable or cfg.validation.enable or cfg.metrics.enable_tensorboard)


def test_comm_mode_env(monkeypatch):
    monkeypatch.setenv("COMM_MODE", "")
    assert get_comm_mode() is None
    monkeypatch.setenv("COMM_MODE", "local_tensor")
    assert comm_mode_from_env(16).name == "local_tensor"
    monkeypatch.delenv("COMM_MODE")
    real = comm_mode_from_env(1)
    assert real.name == "torchrun" and real.computes_values
    monkeypatch.setenv("COMM_MODE", "fake")
    with pytest.raises(ValueError, match="COMM_MODE='fake' is not a comm mode"):
        get_comm_mode()


def test_rank_and_world_size_that_are_no_integers_are_named(monkeypatch):
    from torchtitan.distributed.utils import world_size_from_env

    monkeypatch.delenv("COMM_MODE", raising=False)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError) as e:
        comm_mode_from_env(1)
    assert str(e.value) == "RANK='x' must be an integer"
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError) as e:
        world_size_from_env()
    assert str(e.value) == "WORLD_SIZE='two' must be an integer"
    monkeypatch.setenv("WORLD_SIZE", " 4 ")
    assert world_size_from_env() == 4


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
