"""checkpoint.initial_load_path without checkpoint.enable loads that checkpoint (never the run's
own folder) and saves nothing; it is not silently ignored."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.config.job_config import Checkpoint


@pytest.fixture
def titan_log(caplog):
    titan = logging.getLogger("torchtitan")
    titan.addHandler(caplog.handler)
    old = titan.level
    titan.setLevel(logging.INFO)
    yield caplog
    titan.removeHandler(caplog.handler)
    titan.setLevel(old)


def _manager(model: nn.Module, dump, **cfg) -> CheckpointManager:
    return CheckpointManager(None, [model], None, None, {}, Checkpoint(**cfg), str(dump))


def test_initial_load_path_without_enable_loads_it(tmp_path, titan_log):
    torch.manual_seed(0)
    seed_model = nn.Linear(4, 3)
    _manager(seed_model, tmp_path / "seed", create_seed_checkpoint=True).save_seed_checkpoint()
    seed_path = tmp_path / "seed" / "checkpoint" / "step-0"
    # the run's own folder holds another checkpoint: without checkpoint.enable it is not resumed
    other = nn.Linear(4, 3)
    writer = _manager(other, tmp_path / "run", enable=True)
    writer.save(5, force=True)
    writer.close()  # releases the folder's writer lock

    model = nn.Linear(4, 3)
    manager = _manager(model, tmp_path / "run", initial_load_path=str(seed_path))
    assert manager.load()
    assert torch.equal(model.weight, seed_model.weight) and torch.equal(model.bias, seed_model.bias)
    lines = [r.getMessage() for r in titan_log.records]
    assert any(
        f"from {seed_path} (checkpoint.initial_load_path without checkpoint.enable: loaded, "
        "nothing saved)" in line
        for line in lines
    ), lines
    manager.save(10, last_step=True)
    assert sorted(os.listdir(tmp_path / "run" / "checkpoint")) == ["step-5"]  # nothing new


def test_without_enable_or_initial_path_nothing_is_loaded(tmp_path):
    model = nn.Linear(4, 3)
    before = model.weight.detach().clone()
    assert not _manager(model, tmp_path / "run").load()
    assert torch.equal(model.weight, before)


def _dims(world_size: int):
    from torchtitan.distributed.parallel_dims import ParallelDims

    return ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world_size)


def test_comm_modes_take_initial_load_path_off_the_manager(tmp_path):
    """fake_backend cannot load values (dropped); local_tensor loads it itself (taken)."""
    from torchtitan.config.job_config import JobConfig
    from torchtitan.distributed.comm_mode import COMM_MODES

    cfg = JobConfig()
    cfg.checkpoint.initial_load_path = str(tmp_path)
    COMM_MODES["fake_backend"](8).prepare(cfg, _dims(8))
    assert cfg.checkpoint.initial_load_path is None

    cfg = JobConfig()
    cfg.checkpoint.initial_load_path = str(tmp_path)
    sim = COMM_MODES["local_tensor"](4)
    sim.prepare(cfg, _dims(4))
    assert cfg.checkpoint.initial_load_path is None and not cfg.checkpoint.enable
    assert sim._initial_load.initial_load_path == str(tmp_path)

    cfg.checkpoint.initial_load_path, cfg.checkpoint.initial_load_in_hf = str(tmp_path), True
    with pytest.raises(ValueError, match="^COMM_MODE=local_tensor loads DCP checkpoints only, not "
                       "checkpoint.initial_load_in_hf; convert the HF weights"):
        COMM_MODES["local_tensor"](4).prepare(cfg, _dims(4))


def test_an_hf_folder_without_initial_load_in_hf_says_to_add_it(tmp_path):
    """Pointing initial_load_path at HF weights is a common slip: the error names the flag."""
    from torchtitan.components.checkpoint import CheckpointError

    hf = tmp_path / "Llama-3.1-8B"
    hf.mkdir()
    (hf / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 8)
    (hf / "config.json").write_text("{}")
    manager = _manager(nn.Linear(4, 3), tmp_path / "run", initial_load_path=str(hf))
    with pytest.raises(CheckpointError) as err:
        manager.load()
    assert str(err.value) == (
        f"checkpoint.initial_load_path={hf} holds HF *.safetensors weights, not a DCP "
        "checkpoint: add --checkpoint.initial_load_in_hf to load them"
    )


def test_a_file_as_initial_load_path_names_its_folder(tmp_path):
    from torchtitan.components.checkpoint import CheckpointError

    shard = tmp_path / "hf" / "model.safetensors"
    shard.parent.mkdir()
    shard.write_bytes(b"\0" * 8)
    for hf, hint in ((False, " with --checkpoint.initial_load_in_hf"), (True, "")):
        manager = CheckpointManager(
            None, [nn.Linear(4, 3)], None, None, {},
            Checkpoint(initial_load_path=str(shard), initial_load_in_hf=hf),
            str(tmp_path / f"run{hf}"), sd_adapter=object(),  # never reached: the path is refused
        )
        with pytest.raises(CheckpointError) as err:
            manager.load()
        assert str(err.value) == (
            f"checkpoint.initial_load_path={shard} is a file; give the folder that holds the "
            f"checkpoint ({shard.parent}){hint}"
        )


def test_a_dump_folder_as_initial_load_path_names_its_checkpoint_folder(tmp_path):
    """A run's dump folder given where its checkpoint folder was meant: the error says which
    subfolder holds the steps."""
    from torchtitan.components.checkpoint import CheckpointError

    writer = _manager(nn.Linear(4, 3), tmp_path / "run", enable=True)
    writer.save(5, force=True)
    writer.close()
    manager = _manager(nn.Linear(4, 3), tmp_path / "new",
                       initial_load_path=str(tmp_path / "run"))
    with pytest.raises(CheckpointError) as err:
        manager.load()
    assert str(err.value).endswith(
        "holds no complete step-N folder; its subfolder checkpoint/ holds complete steps (a "
        f"run's dump folder?): --checkpoint.initial_load_path {tmp_path / 'run' / 'checkpoint'}")
