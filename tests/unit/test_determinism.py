"""Seeds and deterministic mode: set_determinism on fake meshes, and bitwise-identical trainer runs."""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.config.job_config import Debug
from torchtitan.distributed.utils import DEFAULT_DETERMINISTIC_SEED, set_determinism


@pytest.fixture
def fake_world():
    """``fake_world(rank, world_size)`` -> a fake process group playing ``rank``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(rank: int, world_size: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def restore_determinism():
    state = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    yield
    torch.use_deterministic_algorithms(state[0], warn_only=state[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = state[2], state[3]
    if state[4] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = state[4]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "rank, expected_offset",
    # mesh (pp=2, dp_shard=2, tp=2): global rank = pp*4 + dp*2 + tp
    [(0, 0), (1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (7, 1)],
)
def test_seed_is_shared_except_per_pp_stage(fake_world, rank, expected_offset):
    fake_world(rank, 8)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_shard", "tp"))
    seed = set_determinism(mesh, torch.device("cpu"), Debug(seed=42))
    assert seed == 42 + expected_offset
    assert torch.initial_seed() == 42 + expected_offset


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_without_pp_every_rank_gets_the_seed(fake_world):
    draws = []
    for rank in (0, 3):
        fake_world(rank, 4)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        assert set_determinism(mesh, torch.device("cpu"), Debug(seed=7)) == 7
        draws.append(torch.rand(4))
    assert torch.equal(draws[0], draws[1])


def test_single_process_seed_and_deterministic_flags(restore_determinism):
    seed = set_determinism(
        None, torch.device("cpu"), Debug(seed=3, deterministic=True, deterministic_warn_only=True)
    )
    assert seed == 3 and torch.initial_seed() == 3
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


@pytest.fixture
def titan_log(caplog):
    """caplog that also sees the ``torchtitan`` logger when init_logger() turned propagation off."""
    import logging

    titan = logging.getLogger("torchtitan")
    titan.addHandler(caplog.handler)
    old = titan.level
    titan.setLevel(logging.INFO)
    yield caplog
    titan.removeHandler(caplog.handler)
    titan.setLevel(old)


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_no_seed_picks_a_fresh_one_and_logs_it(titan_log):
    a = set_determinism(None, torch.device("cpu"), Debug())
    b = set_determinism(None, torch.device("cpu"), Debug())
    assert a != b
    assert f"Seed {a} (random, as debug.seed is unset; --debug.seed {a} repeats this run)" in _messages(titan_log)


def test_deterministic_without_seed_uses_a_fixed_seed(restore_determinism, titan_log):
    seeds = [set_determinism(None, torch.device("cpu"), Debug(deterministic=True)) for _ in range(2)]
    assert seeds == [DEFAULT_DETERMINISTIC_SEED] * 2 and torch.initial_seed() == DEFAULT_DETERMINISTIC_SEED
    assert f"Seed {DEFAULT_DETERMINISTIC_SEED} (the default seed of deterministic runs)" in _messages(titan_log)
    titan_log.clear()
    set_determinism(None, torch.device("cpu"), Debug(seed=5))
    assert "Seed 5 (debug.seed)" in _messages(titan_log)


def test_warn_only_alone_implies_deterministic(restore_determinism, titan_log):
    torch.use_deterministic_algorithms(False)
    seed = set_determinism(None, torch.device("cpu"), Debug(deterministic_warn_only=True))
    assert seed == DEFAULT_DETERMINISTIC_SEED
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert "debug.deterministic_warn_only implies debug.deterministic: turning it on" in _messages(titan_log)


def _losses(flags: list[str], steps: int = 3) -> list[float]:
    from torchtitan.config.manager import ConfigManager
    from torchtitan.train import Trainer

    cfg = ConfigManager().parse_args(
        ["--job.config_file", "train_configs/debug_model.toml", "--model.flavor",
         "debugmodel_tiny", "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--training.steps", str(steps), "--activation_checkpoint.mode", "none", *flags]
    )
    trainer = Trainer(cfg)
    try:
        it = iter(trainer.dataloader)
        out = []
        for _ in range(steps):
            trainer.step += 1
            out.append(trainer.train_step(it)[0])
        return out
    finally:
        trainer.close()
        gc.enable()  # the trainer turns automatic GC off


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_same_seed_bitwise_identical_losses_different_seed_differs(restore_determinism, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    old = os.getcwd()
    os.chdir(root)
    try:
        dump = ["--job.dump_folder", str(tmp_path)]
        first = _losses(["--debug.seed", "42", "--debug.deterministic", *dump])
        # the seeds' older spelling of the same flags
        second = _losses(["--training.seed", "42", "--training.deterministic", *dump])
        other = _losses(["--debug.seed", "43", "--debug.deterministic", *dump])
    finally:
        os.chdir(old)
    assert first == second, (first, second)  # bitwise: exact float equality
    assert first[0] != other[0], (first, other)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_deterministic_runs_without_a_seed_are_identical(restore_determinism, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    old = os.getcwd()
    os.chdir(root)
    try:
        dump = ["--job.dump_folder", str(tmp_path)]
        runs = [_losses(["--debug.deterministic", *dump], steps=2) for _ in range(2)]
    finally:
        os.chdir(old)
    assert runs[0] == runs[1], runs  # bitwise: exact float equality
