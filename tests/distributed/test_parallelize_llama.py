"""parallelize_llama structure and errors, in one process on the ``fake`` backend (8 ranks).

The fake backend builds real meshes without peers, so sharding plans, FSDP units and meta-device
handling can be checked in milliseconds; numerics are covered by test_parallel_numerics.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

import torchtitan.distributed.fsdp as fsdp_mod
from tests.distributed.harness import Layout, _job_config, tiny_args
from torchtitan.distributed.fsdp import apply_fsdp, get_fsdp_mesh, resolve_reshard_after_forward
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import parallelize_llama

WORLD = 8


@pytest.fixture(scope="module", autouse=True)
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


def _build(layout: Layout, world: int = WORLD, **cfg_changes):
    cfg = _job_config(layout)
    for key, value in cfg_changes.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(tiny_args(layout.tied))
    return parallelize_llama(model, dims, cfg), dims


@pytest.fixture
def shard_calls(monkeypatch):
    """Record (module names, reshard_after_forward, kwargs) of every fully_shard call."""
    calls = []
    real = fsdp_mod.fully_shard

    def spy(module, **kwargs):
        mods = module if isinstance(module, list) else [module]
        calls.append(([type(m).__name__ for m in mods], kwargs["reshard_after_forward"], kwargs))
        return real(module, **kwargs)

    monkeypatch.setattr(fsdp_mod, "fully_shard", spy)
    return calls


def test_hsdp_x_tp_placements_and_meta():
    model, dims = _build(Layout("x", dp_replicate=2, dp_shard=2, tp=2))
    wq = model.layers["0"].attention.wq.weight
    assert isinstance(wq, DTensor) and wq.device.type == "meta"
    assert wq.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
    assert wq.placements[0] == Replicate() and wq.placements[2] == Shard(0)
    assert wq.placements[1].dim == 0  # _StridedShard(0) under TP, Shard(0) otherwise
    norm_w = model.layers["0"].attention_norm.weight
    assert norm_w.placements[2] == Replicate()  # sequence-parallel norms are replicated on tp
    assert all(p.device.type == "meta" for p in model.parameters())
    assert isinstance(model, FSDPModule)


def test_fsdp_units_and_default_reshard(shard_calls):
    _build(Layout("fsdp", dp_shard=8))
    names = [(mods, reshard) for mods, reshard, _ in shard_calls]
    assert names == [
        (["Embedding"], True),
        (["TransformerBlock"], True),
        (["TransformerBlock"], False),  # last block: backward needs it first
        (["RMSNorm", "OutputHead"], False),  # norm + output together, kept for backward
        (["Transformer"], True),
    ]
    mp = shard_calls[0][2]["mp_policy"]
    assert mp.param_dtype == torch.float32 and mp.reduce_dtype == torch.float32


@pytest.mark.parametrize("policy,expected", [("always", True), ("never", False)])
def test_reshard_policy_applies_to_every_unit(shard_calls, policy, expected):
    _build(Layout("fsdp", dp_shard=8), parallelism__fsdp_reshard_after_forward=policy)
    assert [reshard for _, reshard, _ in shard_calls] == [expected] * 5


def test_reshard_policy_resolution():
    assert resolve_reshard_after_forward("default", pp_enabled=False) is True
    assert resolve_reshard_after_forward("default", pp_enabled=True) is False
    with pytest.raises(ValueError, match="parallelism.fsdp_reshard_after_forward='sometimes'"):
        resolve_reshard_after_forward("sometimes", pp_enabled=False)


def test_pipeline_stage_without_embeddings(shard_calls):
    dims = ParallelDims(dp_replicate=1, dp_shard=8, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=8)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        stage = Transformer(tiny_args())
    stage.tok_embeddings = None
    del stage.layers["0"]
    apply_fsdp(stage, get_fsdp_mesh(dims), torch.bfloat16, torch.float32, pp_enabled=True)
    assert [(m, r) for m, r, _ in shard_calls] == [
        (["TransformerBlock"], False),
        (["RMSNorm", "OutputHead"], False),
        (["Transformer"], False),
    ]
    assert shard_calls[0][2]["mp_policy"].param_dtype == torch.bfloat16


def test_tied_embeddings_stay_in_the_root_unit(shard_calls):
    model, _ = _build(Layout("fsdp", dp_shard=8, tied=True))
    assert [m for m, _, _ in shard_calls] == [
        ["TransformerBlock"],
        ["TransformerBlock"],
        ["Transformer"],
    ]
    assert model.output.weight is model.tok_embeddings.weight


def test_tp_keeps_tied_embeddings_tied():
    model, _ = _build(Layout("tp", dp_shard=4, tp=2, tied=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.placements[-1] == Shard(0)


def test_cpu_offload_and_mixed_precision(shard_calls):
    _build(
        Layout("fsdp", dp_shard=8),
        training__enable_cpu_offload=True,
        training__mixed_precision_param="bfloat16",
    )
    kwargs = shard_calls[0][2]
    assert isinstance(kwargs["offload_policy"], CPUOffloadPolicy)
    assert kwargs["offload_policy"].pin_memory is torch.cuda.is_available()
    assert kwargs["mp_policy"].param_dtype == torch.bfloat16


def test_ddp_when_only_replicating(caplog):
    from torch.distributed._composable.replicate import replicate

    with caplog.at_level("INFO", logger="torchtitan"):
        model, _ = _build(Layout("ddp", dp_replicate=8),
                          parallelism__fsdp_reshard_after_forward="always")
    assert "fsdp_reshard_after_forward=always has no effect without FSDP" in caplog.text
    assert replicate.state(model) is not None  # DDP's state is registered on the model
    assert not isinstance(model, FSDPModule)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_ddp_with_tp_replicates_through_fsdp2():
    """Classic DDP cannot hold TP's DTensor parameters: with TP, replication is FSDP2's
    replicate (whole parameters, Replicate on dp_replicate, gradients all-reduced per unit)."""
    from torch.distributed._composable.replicate_with_fsdp import ReplicateModule

    model, _ = _build(Layout("ddp_tp", dp_replicate=4, tp=2))
    units = [name for name, m in model.named_modules() if isinstance(m, ReplicateModule)]
    assert units == ["", "tok_embeddings", "layers.0", "layers.1", "norm", "output"]
    assert not any(isinstance(m, FSDPModule) and not isinstance(m, ReplicateModule)
                   for m in model.modules())  # nothing sharded
    wq = model.layers["0"].attention.wq.weight
    assert wq.device_mesh.mesh_dim_names == ("dp_replicate", "tp")
    assert wq.placements == (Replicate(), Shard(0))
    assert tuple(wq.to_local().shape) == (wq.shape[0] // 2, wq.shape[1])  # whole on dp


def test_fsdp_meshes():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=1, pp=1, ep=1, etp=1, world_size=8)
    dims.build_mesh("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the flattened-dim slice must not warn
        mesh = get_fsdp_mesh(dims)
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard_cp") and tuple(mesh.shape) == (2, 4)
    dims = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=2, pp=1, ep=1, etp=1, world_size=8)
    dims.build_mesh("cpu")
    assert get_fsdp_mesh(dims).mesh_dim_names == ("dp_shard",)
    dims = ParallelDims(dp_replicate=8, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=8)
    assert get_fsdp_mesh(dims) is None


@pytest.mark.parametrize(
    "tp,heads,match",
    [
        (4, (4, 2), "must divide the model's n_kv_heads=2"),
        (8, (8, 4), "must divide the model's n_kv_heads=4"),
        (8, (4, 4), "must divide the model's n_heads=4"),
    ],
)
def test_tp_must_divide_heads(tp, heads, match):
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=tp)
    with pytest.raises(ValueError, match=f"parallelism.tensor_parallel_degree={tp} {match}"):
        dims.validate_for_model(n_heads=heads[0], n_kv_heads=heads[1], n_layers=2, seq_len=64)


def test_async_tp_requirements():
    assert maybe_enable_async_tp(False, False, None, "cpu") is False
    with pytest.raises(ValueError, match="enable_async_tensor_parallel needs CUDA"):
        maybe_enable_async_tp(True, True, None, "cpu")
    with pytest.raises(ValueError, match="needs torch.compile: set compile.enable"):
        maybe_enable_async_tp(True, False, None, "cuda")
    with pytest.raises(ValueError, match="needs CUDA"):
        _build(Layout("tp", dp_shard=4, tp=2), parallelism__enable_async_tensor_parallel=True)
