"""Memory estimation on a fake process group (torchtitan/tools/memory_estimation.py)."""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan.config.manager import ConfigManager
from torchtitan.models import get_model_spec
from torchtitan.tools.memory_estimation import estimate_memory, log_memory_estimate

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--job.config_file", str(ROOT / "train_configs/debug_model.toml"), "--model.flavor",
        "debugmodel_tiny", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--model.hf_assets_path", str(ROOT / "tests/assets/tokenizer")]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module", autouse=True)
def _earlier_objects_frozen():
    """The estimator runs a full collection after each step (so that freed storages leave its
    count); with the objects made before this module frozen, each walks this module's objects
    instead of every object of the session."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def _cfg(*flags: str):
    return ConfigManager().parse_args([*TINY, *flags])


def _shard_bytes(world_size: int) -> int:
    """FSDP2 pads dim 0 to a multiple of the world size: ceil(d0 / ws) rows per rank, fp32."""
    from torchtitan.components.tokenizer import build_tokenizer

    cfg = _cfg()
    spec = get_model_spec("llama3")
    args = spec.get_model_args("debugmodel_tiny")
    args.update_from_config(cfg, tokenizer=build_tokenizer(cfg.model))
    with torch.device("meta"):
        model = spec.model_cls(args)
    return 4 * sum(
        math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0]) for p in model.parameters()
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp_shards_and_adamw_state_add_up(world_size):
    est = estimate_memory(_cfg(), world_size)
    assert est.fake and est.world_size == world_size
    sharded = _shard_bytes(world_size)
    assert est.breakdown["Sharded Param"] == sharded
    # AdamW: exp_avg + exp_avg_sq per parameter, plus a 4-byte step per parameter tensor
    assert 2 * sharded <= est.breakdown["OptState"] <= 2 * sharded + 4 * 64
    assert est.peak_bytes == sum(est.breakdown.values())
    assert len(est.step_peak_bytes) == 2 and est.step_peak_bytes[1] >= est.step_peak_bytes[0]
    assert f"at world size {world_size}" in est.format()


def test_modules_answer_the_trackers_weakref_question_only_while_it_runs(monkeypatch):
    """The tracker dereferences its module keys millions of times on a large model, each time
    asking hasattr(module, "_fix_weakref"); a no-op answers it during the estimate (a third
    of the 120B estimate's time) and is gone after, the estimate unchanged."""
    import torchtitan.step

    seen = []
    step = torchtitan.step.compute_gradients

    def spying(run, microbatches):
        seen.append("_fix_weakref" in torch.nn.Module.__dict__)
        return step(run, microbatches)

    monkeypatch.setattr(torchtitan.step, "compute_gradients", spying)
    est = estimate_memory(_cfg(), 2)
    assert seen == [True, True]  # both tracked steps
    assert "_fix_weakref" not in torch.nn.Module.__dict__
    assert est.breakdown["Sharded Param"] == _shard_bytes(2)


def test_more_ranks_less_memory_and_fake_equals_real():
    small, large = estimate_memory(_cfg(), 2), estimate_memory(_cfg(), 4)
    assert large.peak_bytes < small.peak_bytes
    real = estimate_memory(_cfg(), 4, fake=False)
    assert not real.fake
    assert real.breakdown == large.breakdown  # fake tensors predict exactly what real ones hold


def test_tensor_parallel_and_single_rank():
    tp = estimate_memory(_cfg("--parallelism.tensor_parallel_degree", "2"), 4)
    # 2-way TP x 2-way FSDP holds a quarter of the model (padding differs by a few rows)
    assert abs(tp.breakdown["Sharded Param"] - _shard_bytes(4)) < 1024
    single = estimate_memory(_cfg(), 1)  # no FSDP: torch's generic MemTracker
    assert single.breakdown["Parameter"] == _shard_bytes(1)


def test_refuses_pipeline_parallel():
    with pytest.raises(ValueError, match=r"does not support pipeline parallel"):
        estimate_memory(_cfg("--parallelism.pipeline_parallel_degree", "2"), 4)


def test_trainer_hook_logs_and_survives_failure():
    est = log_memory_estimate(_cfg("--memory_estimation.enable"), 2)
    assert est is not None and est.peak_bytes > 0
    bad = _cfg("--parallelism.pipeline_parallel_degree", "2")
    assert log_memory_estimate(bad, 4) is None  # warns, training would go on


@pytest.mark.slow
def test_script_prints_estimates_for_each_world_size():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/estimate_memory.py"), *TINY, "--world-size", "2",
         "4", "--json"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Estimated peak memory of rank 0 at world size 2" in proc.stdout
    assert "Estimated peak memory of rank 0 at world size 4" in proc.stdout
    assert proc.stdout.count('"world_size"') == 2


def test_context_parallel_halves_activations():
    """CP2 on the same two ranks keeps the FSDP shard and halves each rank's sequence."""
    flags = ["--training.seq_len", "256", "--activation_checkpoint.mode", "none"]
    fsdp = estimate_memory(_cfg(*flags), 2)
    cp = estimate_memory(_cfg(*flags, "--parallelism.context_parallel_degree", "2"), 2)
    assert cp.breakdown["Sharded Param"] == fsdp.breakdown["Sharded Param"]
    ratio = cp.breakdown["Activation"] / fsdp.breakdown["Activation"]
    assert 0.45 < ratio < 0.6, ratio  # ideal 0.5; ring attention keeps a little per-step state


MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]


@pytest.fixture
def two_moe_layers(monkeypatch):
    """The MoE flavor built with 2 of its 4 layers: the per-layer counts below are the same,
    and the tracker's cost grows with the layers (ops x tensors)."""
    from torchtitan.models.spec import ModelSpec

    get_model_args = ModelSpec.get_model_args

    def with_two_layers(spec, flavor):
        args = get_model_args(spec, flavor)
        if flavor == "debugmodel_moe":
            args.n_layers = 2
        return args

    monkeypatch.setattr(ModelSpec, "get_model_args", with_two_layers)


def _moe_shard_bytes(world_size: int, ep: int) -> tuple[int, int, int]:
    """(bytes of one rank's parameter shards, bytes of one MoE layer's experts, parameter
    tensors), fp32: dense
    parameters FSDP-shard dim 0 over all ranks; expert weights hold ``E / ep`` experts
    (``Shard(0)`` over ep), FSDP-sharded over the other ``world_size / ep`` ranks (padded)."""
    spec = get_model_spec("qwen3")
    args = spec.get_model_args("debugmodel_moe")
    args.update_from_config(_cfg(*MOE), tokenizer=None)
    with torch.device("meta"):
        model = spec.model_cls(args)
    total, layer_experts = 0, 0
    for name, p in model.named_parameters():
        rows, per_row = p.shape[0], p.numel() // p.shape[0]
        if ".experts." in name:
            rows, shards = rows // ep, world_size // ep
            if name.startswith("layers.0."):
                layer_experts += 4 * p.numel()
        else:
            shards = world_size
        total += 4 * math.ceil(rows / shards) * per_row
    return total, layer_experts, len(list(model.parameters()))


def test_expert_parallel_counts_expert_shards(two_moe_layers):
    """EP2 over 4 ranks: each rank holds 4 of the 8 experts, FSDP-sharded over the other 2
    ranks (dp_shard_mod_ep): per-rank parameter and AdamW bytes equal an exact count from the
    model (the same as FSDP4 without EP: experts are sharded over ep x dp_shard_mod_ep = 4
    ranks either way). What EP changes is the all-gather: at the peak one MoE layer's experts
    are gathered, and under EP only its 4 local experts, so the gathered parameters shrink
    by exactly half a layer's experts, and the peak drops."""
    no_ep = estimate_memory(_cfg(*MOE), 4)
    ep = estimate_memory(_cfg(*MOE, "--parallelism.expert_parallel_degree", "2"), 4)
    sharded, layer_experts, n_tensors = _moe_shard_bytes(4, 2)
    assert ep.breakdown["Sharded Param"] == sharded == no_ep.breakdown["Sharded Param"]
    # AdamW: exp_avg + exp_avg_sq per parameter, plus a 4-byte step per parameter tensor
    assert ep.breakdown["OptState"] == 2 * sharded + 4 * n_tensors
    gathered_saving = no_ep.breakdown["Unsharded Param"] - ep.breakdown["Unsharded Param"]
    assert gathered_saving == layer_experts // 2
    assert ep.peak_bytes < no_ep.peak_bytes
    assert "ep=2" in ep.parallelism


def test_expert_tensor_parallel_splits_the_expert_bytes_over_tp(two_moe_layers):
    """TP2 x FSDP2 on 4 ranks: without expert TP each TP rank stores its experts whole (FSDP
    shards them over dp_shard 2 only); with it their hidden dims are split over tp as well, so
    each rank stores exactly a quarter of every expert weight instead of half."""
    tp2 = [*MOE, "--parallelism.tensor_parallel_degree", "2"]
    whole = estimate_memory(_cfg(*tp2), 4)
    split = estimate_memory(_cfg(*tp2, "--parallelism.expert_tensor_parallel_degree", "2"), 4)
    spec = get_model_spec("qwen3")
    args = spec.get_model_args("debugmodel_moe")
    args.update_from_config(_cfg(*MOE), tokenizer=None)
    with torch.device("meta"):
        model = spec.model_cls(args)
    experts = sum(4 * p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert whole.breakdown["Sharded Param"] - split.breakdown["Sharded Param"] == experts // 4
    assert "etp=2" in split.parallelism


def test_script_refuses_a_world_size_below_one(capsys):
    """Before: 'error: world size 0: RANK=0 must be in [0, WORLD_SIZE=0)'."""
    import importlib.util

    from tests.conftest import REPO_ROOT

    spec = importlib.util.spec_from_file_location(
        "estimate_memory_script", REPO_ROOT / "scripts" / "estimate_memory.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    code = script.main(["--job.config_file", str(REPO_ROOT / "train_configs" / "debug_model.toml"),
                        "--world-size", "8", "0"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --world-size must be at least 1 (got 0)")
