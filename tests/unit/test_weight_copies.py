"""``training.weight_copies``: the linear weights' low-precision copies, written by the
optimizer step, stand in for autocast's per-step casts. Training equals the autocast path
within float32 rounding (the norm and the AdamW step), checkpoints hold the float32 weights,
a loaded weight refreshes its copy, and the plan refuses ``on`` where it cannot apply."""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import REPO_ROOT
from tests.integration.trainer_utils import built_trainer, run_tiny
from torchtitan.components.weight_copies import (
    WeightCopies,
    build_weight_copies,
    choose_weight_copies,
    uncopied_float8_linears,
)
from torchtitan.config.manager import ConfigManager
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.plan import plan_run

# bf16 autocast on the CPU, a max_norm every step exceeds (the clip divisor is exercised)
BF16 = ["--training.mixed_precision_param", "bfloat16", "--training.max_norm", "0.05",
        "--training.steps", "5", "--validation.enable", "--validation.dataset",
        "c4_test_validation", "--validation.freq", "5", "--validation.steps", "2",
        "--validation.seq_len", "64", "--validation.local_batch_size", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for mode in ("off", "on"):
        root = tmp_path_factory.mktemp(f"copies_{mode}")
        trainer = run_tiny(root, *BF16, "--training.weight_copies", mode)
        gc.enable()
        out[mode] = trainer
    return out


def test_training_with_copies_equals_the_autocast_path(runs, caplog):
    plain, copies = runs["off"], runs["on"]
    assert plain.run.weight_copies is None and len(copies.run.weight_copies) > 0
    losses = [[h[0] for h in t.history] for t in (plain, copies)]
    norms = [[h[1] for h in t.history] for t in (plain, copies)]
    assert min(norms[0]) > 0.05  # every step clipped
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(norms[1], norms[0], rtol=1e-5, atol=0)
    ref = dict(plain.model_parts[0].named_parameters())
    for name, p in copies.model_parts[0].named_parameters():
        assert p.dtype == torch.float32, name  # outside the step: the float32 weights
        # float32 rounding in the step, then a copy rounding to the other side of a
        # bf16 boundary: measured <= 2.4e-6 after 5 steps (each moves a weight by ~lr, 8e-4)
        torch.testing.assert_close(p, ref[name], rtol=0, atol=1e-5, msg=name)


def test_the_copies_change_nothing_but_the_optimizer_kernel(runs, tmp_path, monkeypatch):
    """The autocast path stepped by the same (own, float32-state) AdamW step as the copies:
    the copies' losses and grad norms within 1e-6 (the norm sums bf16 rather than float32
    gradients in another order: last-bit differences); what differs from torch's fused AdamW
    above (1e-5) is that kernel's float32 rounding, not the copies."""
    import torchtitan.components.optimizer as optimizer

    torch_choice = optimizer.optimizer_class
    monkeypatch.setattr(optimizer, "optimizer_class",
                        lambda cfg, own_step=False: torch_choice(cfg, own_step=True))
    own_step = run_tiny(tmp_path, *BF16, "--training.weight_copies", "off")
    gc.enable()
    assert own_step.run.weight_copies is None
    torch.testing.assert_close(own_step.history, runs["on"].history, rtol=1e-6, atol=0)


def _validation_loss(trainer) -> float:
    path = Path(trainer.job_config.job.dump_folder) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return next(r["validation/loss"] for r in rows if "validation/loss" in r)


def test_validation_with_copies_equals_the_autocast_path(runs):
    val = [_validation_loss(t) for t in (runs["off"], runs["on"])]
    assert val[1] == pytest.approx(val[0], rel=1e-6)


@pytest.mark.parametrize("ac", [["none"], ["full"], ["selective",
                                 "--activation_checkpoint.selective_ac_option", "op"]])
def test_the_step_runs_on_the_copies_and_writes_them(tmp_path, monkeypatch, ac):
    """Activation checkpointing recomputes inside the backward: the copies are still in."""
    from torchtitan.step import compute_gradients, optimizer_step

    monkeypatch.chdir(REPO_ROOT)
    with built_trainer(tmp_path, *BF16[:4], "--training.weight_copies", "on",
                       "--activation_checkpoint.mode", *ac) as trainer:
        copies = trainer.run.weight_copies
        module, master, copy = copies.modules[0], copies.masters[0], copies.copies[0]
        seen = []
        module.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
        before = master.detach().clone()
        compute_gradients(trainer.run, [next(iter(trainer.dataloader))])
        assert set(seen) == {torch.bfloat16} and module.weight is master  # AC: seen twice
        assert master.grad is None and copy.grad.dtype == torch.bfloat16
        assert all(w.grad is None for w in copies.masters)
        assert all(c.grad is not None for c in copies.copies)
        optimizer_step(trainer.run)
        assert not torch.equal(master, before)
        assert torch.equal(copy, master.to(torch.bfloat16))  # written by the step
        trainer.optimizers.zero_grad()
        assert copy.grad is None


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linears_cast_their_copies_to_float8(tmp_path, recipe):
    """A float8 run copies its Float8Linear weights too: the forward casts the bf16 copy to
    float8 (the last bits of its scale can differ from the float32 weight's), the gradient
    stays bf16, and the run keeps the plain float8 path's losses and norms (measured within
    2.5e-5 and 1.1e-4 over these steps)."""
    from torchao.float8.float8_linear import Float8Linear

    flags = [*BF16[:4], "--training.steps", "4", "--model.converters", "float8",
             "--float8.emulate", "--float8.recipe_name", recipe]
    plain = run_tiny(tmp_path / "off", *flags, "--training.weight_copies", "off")
    copies = run_tiny(tmp_path / "on", *flags, "--training.weight_copies", "on")
    gc.enable()
    f8 = [(m, c) for m, c in zip(copies.run.weight_copies.modules,
                                 copies.run.weight_copies.copies) if type(m) is Float8Linear]
    assert len(f8) == 14  # every converted linear (the output head is filtered out)
    for module, copy in f8:
        assert torch.equal(copy, module.weight.to(torch.bfloat16))  # written by the step
    losses = [[h[0] for h in t.history] for t in (plain, copies)]
    norms = [[h[1] for h in t.history] for t in (plain, copies)]
    torch.testing.assert_close(losses[1], losses[0], rtol=5e-5, atol=0)
    torch.testing.assert_close(norms[1], norms[0], rtol=3e-4, atol=0)


def test_a_weight_changed_in_place_refreshes_its_copy():
    lin = nn.Linear(4, 3)
    copies = WeightCopies([lin], torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.full((3, 4), 0.5))  # e.g. a checkpoint load
    with copies.active():
        assert lin.weight.dtype == torch.bfloat16
        assert torch.equal(lin.weight, torch.full((3, 4), 0.5, dtype=torch.bfloat16))
        with copies.active():  # e.g. a validation inside a step
            pass
        assert lin.weight.dtype == torch.bfloat16
    assert lin.weight.dtype == torch.float32


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    ckpt = ["--training.weight_copies", "on", "--checkpoint.enable", "--checkpoint.interval", "2"]
    full = run_tiny(tmp_path / "full", *BF16[:4], "--training.steps", "4",
                    "--training.weight_copies", "on")
    run_tiny(tmp_path / "resumed", *BF16[:4], "--training.steps", "2", *ckpt)
    resumed = run_tiny(tmp_path / "resumed", *BF16[:4], "--training.steps", "4", *ckpt)
    gc.enable()
    assert resumed.history[-2:] == full.history[2:]
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(tmp_path / "resumed" / "checkpoint" / "step-2")).read_metadata()
    dtypes = {k: v.properties.dtype for k, v in meta.state_dict_metadata.items()
              if k.endswith("feed_forward.w1.weight") or k == "output.weight"}
    assert len(dtypes) == 3 and set(dtypes.values()) == {torch.float32}  # the weights, and
    assert any(k.endswith("w1.weight.exp_avg") for k in meta.state_dict_metadata)  # state


def test_tied_and_converted_weights_are_not_copied():
    class Float8LikeLinear(nn.Linear):  # converts its weight itself
        pass

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight  # tied
            self.proj = nn.Linear(4, 4)
            self.conv = Float8LikeLinear(4, 4)

    model = Model()
    copies = build_weight_copies([model], torch.bfloat16)
    assert copies.modules == [model.proj]


def test_auto_leaves_float8_linears_to_cast_their_own_weights():
    """A Float8Linear's copy is memory the plain float8 path never holds: only ``on`` (the
    builder's ``float8=True``) copies it; plain linears are copied either way."""
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 16, bias=False))
    model.add_module("head", nn.Linear(16, 8, bias=False))
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True),
                               module_filter_fn=lambda m, fqn: fqn != "head")
    assert build_weight_copies([model], torch.bfloat16, float8=False).modules == [model.head]
    assert build_weight_copies([model], torch.bfloat16).modules == list(model)
    assert uncopied_float8_linears([model]) == 2


def test_fake_weights_are_copied_and_wrapper_subclass_weights_are_not():
    """The memory estimator builds the model on fake tensors: its linears count their copies.
    A weight that is a wrapper subclass (DTensor, float8 all-gather weights) converts itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.two_tensor import TwoTensor

    with FakeTensorMode():
        fake = nn.Linear(4, 4)
    assert build_weight_copies([fake], torch.bfloat16).modules == [fake]
    wrapped = nn.Linear(4, 4)
    wrapped.weight = nn.Parameter(TwoTensor(torch.zeros(4, 4), torch.zeros(4, 4)))
    assert build_weight_copies([wrapped], torch.bfloat16).modules == []


def _cfg(*flags):
    return ConfigManager().parse_args(["--job.config_file", "train_configs/debug_model.toml",
                                       "--training.mixed_precision_param", "bfloat16", *flags])


@pytest.mark.parametrize("flags, world, why", [
    (["--training.mixed_precision_param", "float32"], 1, "the run does not autocast"),
    (["--parallelism.data_parallel_shard_degree", "2"], 2, "the run does not autocast"),
    (["--parallelism.data_parallel_replicate_degree", "2"], 2,
     "this run is parallel (dp_replicate=2)"),
    (["--optimizer.no_clip_in_step"], 1, "clipping must happen in the optimizer step"),
    (["--optimizer.implementation", "foreach"], 1, "optimizer.implementation=foreach"),
    (["--training.global_batch_size", "16", "--training.local_batch_size", "8"], 1,
     "gradient accumulation (2 microbatches per step) would sum the gradients"),
])
def test_the_plan_refuses_on_where_it_cannot_apply(monkeypatch, flags, world, why):
    monkeypatch.chdir(REPO_ROOT)
    cfg = _cfg("--training.weight_copies", "on", *flags)
    with pytest.raises(ValueError) as e:
        plan_run(cfg, world)
    line = str(e.value)
    assert line.startswith("training.weight_copies=on cannot apply: ") and why in line
    assert "\n" not in line
    cfg.training.weight_copies = "auto"
    plan_run(cfg, world)  # auto: the plain path, no error


def test_auto_copies_on_cuda_only(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    cfg = _cfg()
    dims = ParallelDims.from_config(cfg.parallelism, 1)
    assert cfg.training.weight_copies == "auto"
    assert choose_weight_copies(cfg, dims, torch.bfloat16, "cuda")
    assert not choose_weight_copies(cfg, dims, torch.bfloat16, "cpu")
    assert not choose_weight_copies(cfg, dims, None, "cuda")
    cfg.training.weight_copies = "off"
    assert not choose_weight_copies(cfg, dims, torch.bfloat16, "cuda")


def test_the_norm_of_bf16_gradients_accumulates_in_float32(caplog):
    torch.manual_seed(0)
    grads = [torch.randn(1000) * 3, torch.randn(77, 13)]
    low = [g.bfloat16() for g in grads]
    exact = torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in low]).double())
    got = dist_utils.total_norm({None: low})
    assert got.dtype == torch.float32
    assert float(got) == pytest.approx(float(exact), rel=1e-6)
    mixed = dist_utils.total_norm({None: [low[0], grads[1]]})
    exact = torch.linalg.vector_norm(torch.cat([low[0].double(), grads[1].double().flatten()]))
    assert float(mixed) == pytest.approx(float(exact), rel=1e-6)
    with caplog.at_level(logging.WARNING):
        assert dist_utils.total_norm({None: low}, norm_type=float("inf")) == low[0].abs().max()


def _float8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("converter", [
    [], pytest.param(["--model.converters", "float8"], id="float8", marks=pytest.mark.skipif(
        not _float8_gpu(), reason="needs float8 hardware (compute capability >= 8.9)"))])
def test_on_cuda_compiled_training_with_copies_equals_the_autocast_path(tmp_path, converter):
    """The GPU path: compiled blocks under the copies, the compiled optimizer step writing
    them (auto turns the copies on by itself on CUDA); float8: Float8Linear casts its copy."""
    import torchtitan.components.adamw_bf16_state as module

    module.compiled_step.cache_clear()
    flags = [*BF16[:6], "--compile.enable", *converter]
    plain = run_tiny(tmp_path / "plain", *flags, "--training.weight_copies", "off")
    copies = run_tiny(tmp_path / "copies", *flags)
    gc.enable()
    assert plain.run.weight_copies is None and len(copies.run.weight_copies) > 0
    if converter:  # auto: the output head only (the 14 float8 linears: gradient views);
        assert len(copies.run.weight_copies) == 1  # on: the 14 float8 linears copied too
        assert len(copies.run.weight_copies.views) == 14
        every = run_tiny(tmp_path / "every", *flags, "--training.weight_copies", "on")
        assert len(every.run.weight_copies) == 15
        for a, b in zip(every.history, plain.history):
            assert a == pytest.approx(b, rel=1e-4)
    assert module.compiled_step.cache_info().currsize == 1  # the compiled path ran
    for a, b in zip(copies.history, plain.history):
        assert a == pytest.approx(b, rel=1e-4)
