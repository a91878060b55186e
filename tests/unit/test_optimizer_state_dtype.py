"""``optimizer.state_dtype``: Adam/AdamW with bfloat16 moments (numerics against a reference
and torch's AdamW, state bytes of a real model, DTensor parameters, checkpoints, plan errors),
and torch's fused AdamW on DTensor parameters."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.conftest import REPO_ROOT
from torchtitan.components.adamw_bf16_state import (
    AdamBF16State,
    adam_bf16_state_step,
    compiled_step,
)
from torchtitan.components.optimizer import OptimizersContainer, build_optimizers
from torchtitan.components.optimizer_in_backward import build_optimizers_in_backward
from torchtitan.config.job_config import Optimizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BF16 = dict(state_dtype="bfloat16", lr=1e-2, weight_decay=0.1)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 16, generator=g)
    return x, torch.sin(x[:, :4]) + 0.1 * torch.randn(64, 4, generator=g)


def _train(model: nn.Module, opts, steps: int) -> float:
    for step in range(steps):
        x, y = _batch(step)
        opts.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        opts.step()
    return loss.item()


def _reference_step(p, g, m, v, step: int, lr: float, beta1, beta2, eps, wd, decoupled):
    """Adam(W) in float32 from the float32 moments; returns (p, m, v) in float32. Scalars are
    0-dim float32 tensors, as in the optimizer."""
    step_t, lr_t = torch.tensor(float(step)), torch.tensor(lr, dtype=torch.float32)
    if decoupled:
        p = p * (1 - lr_t * wd)
    else:
        g = g.add(p, alpha=wd)  # torch.optim.Adam's L2 term
    m = torch.lerp(m, g, 1 - beta1)
    v = torch.addcmul(v * beta2, g, g, value=1 - beta2)
    denom = v.sqrt() / (1 - beta2**step_t).sqrt() + eps
    return p - m / denom * (lr_t / (1 - beta1**step_t)), m, v


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_bf16_state_step_equals_the_reference_exactly(name):
    model = _model()
    opts = build_optimizers([model], Optimizer(name=name, **BF16))
    assert isinstance(opts.optimizers[0], AdamBF16State)
    ref = {n: [p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)]
           for n, p in model.named_parameters()}
    for step in range(1, 21):
        lr = 1e-2 / step  # the lr changes between steps, as under a schedule
        for group in opts.param_groups:
            group["lr"] = lr
        x, y = _batch(step)
        opts.zero_grad()
        (model(x) - y).square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opts.step()
        for n, p in model.named_parameters():
            ref_p, ref_m, ref_v = ref[n]
            rp, rm, rv = _reference_step(ref_p, grads[n], ref_m, ref_v, step, lr, 0.9, 0.95,
                                         1e-8, 0.1, name == "AdamW")
            # the states are stored rounded to bf16, the next step reads them back
            ref[n] = [rp, rm.bfloat16().float(), rv.bfloat16().float()]
            state = opts.optimizers[0].state[p]
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
            assert p.dtype == torch.float32
            assert torch.equal(p.detach(), rp), (n, step)
            assert torch.equal(state["exp_avg"].float(), ref[n][1]), (n, step)
            assert torch.equal(state["exp_avg_sq"].float(), ref[n][2]), (n, step)
            assert float(state["step"]) == step


def test_bf16_state_stays_close_to_torch_adamw_over_50_steps():
    # torch's AdamW and this optimizer with float32 state: the same math up to float rounding
    exact, ours32, ours16 = _model(), _model(), _model()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    loss_exact = _train(exact, torch.optim.AdamW(exact.parameters(), **kw), 50)
    _train(ours32, AdamBF16State(ours32.parameters(), **kw, state_dtype=torch.float32), 50)
    loss16 = _train(ours16, build_optimizers([ours16], Optimizer(**BF16, beta2=0.95)), 50)
    start = _model()
    for p, q, r, s in zip(exact.parameters(), ours32.parameters(), ours16.parameters(),
                          start.parameters()):
        moved = (p - s).abs().max()
        assert moved > 0.05  # 50 steps of lr 1e-2 moved the weights
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
        # the stated tolerance: bf16 moments stay within 2% of the distance travelled
        assert (r - p).abs().max() <= 0.02 * moved
    assert abs(loss16 - loss_exact) <= 1e-3 * loss_exact


def test_float32_is_torch_fused_adamw_and_the_default():
    model = _model()
    opts = build_optimizers([model], Optimizer())
    opt = opts.optimizers[0]
    assert Optimizer().state_dtype == "float32"
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["fused"] is True
    _train(model, opts, 1)
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())


def test_a_real_model_keeps_4_bytes_of_state_per_parameter_instead_of_8(tmp_path, monkeypatch):
    from tests.integration.trainer_utils import TINY, built_trainer

    monkeypatch.chdir(REPO_ROOT)
    per_param = {}
    for dtype in ("float32", "bfloat16"):
        with built_trainer(tmp_path / dtype, "--training.seq_len", "32",
                           "--training.local_batch_size", "1", "--training.steps", "1",
                           "--optimizer.state_dtype", dtype, base=TINY) as trainer:
            trainer.step += 1
            trainer.train_step(iter(trainer.dataloader))
            params = [p for m in trainer.model_parts for p in m.parameters()]
            states = [s for opt in trainer.optimizers.optimizers for s in opt.state.values()]
            moment_bytes = sum(s[k].numel() * s[k].element_size()
                               for s in states for k in ("exp_avg", "exp_avg_sq"))
            per_param[dtype] = moment_bytes / sum(p.numel() for p in params)
            assert all(p.dtype == torch.float32 for p in params)
    assert per_param == {"float32": 8.0, "bfloat16": 4.0}


def test_memory_estimate_counts_half_the_optimizer_state():
    from tests.unit.test_memory_estimation import _cfg, _shard_bytes
    from torchtitan.tools.memory_estimation import estimate_memory

    est = estimate_memory(_cfg("--optimizer.state_dtype", "bfloat16"), 2)
    sharded = _shard_bytes(2)
    # exp_avg + exp_avg_sq in bf16: 4 bytes per fp32 parameter's 4, plus a 4-byte step each
    assert sharded <= est.breakdown["OptState"] <= sharded + 4 * 64


def test_stepping_in_backward_equals_the_usual_bf16_step():
    usual, early = _model(), _model()
    _train(usual, build_optimizers([usual], Optimizer(**BF16)), 3)
    opts = build_optimizers_in_backward([early], Optimizer(**BF16, early_step_in_backward=True))
    for step in range(3):
        x, y = _batch(step)
        opts.zero_grad()
        opts.before_backward(final=True)
        (early(x) - y).square().mean().backward()
        opts.step()
    assert all(isinstance(o, AdamBF16State) for o in opts.optimizers)
    for a, b in zip(usual.parameters(), early.parameters()):
        assert torch.equal(a, b)


# --- DTensor parameters on a one-rank mesh ------------------------------------------------------
@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _distributed(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.tensor import Shard, distribute_tensor

    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    return model


def _train_dt(model: nn.Module, opts, mesh, steps: int) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor

    for step in range(steps):
        x, y = _batch(step)
        opts.zero_grad()
        out = model(distribute_tensor(x, mesh, [Replicate()])).full_tensor()
        (out - y).square().mean().backward()
        opts.step()


def _aten_ops(fn) -> set[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        ops: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    with Record() as rec:
        fn()
    return rec.ops


def test_dtensor_parameters_take_torch_fused_adamw(mesh, caplog):
    model = _distributed(_model(), mesh)
    opts = build_optimizers([model], Optimizer(implementation="fused"))
    _train_dt(model, opts, mesh, 1)  # the state exists; the next step is a plain one
    x, y = _batch(1)
    opts.zero_grad()
    from torch.distributed.tensor import Replicate, distribute_tensor

    (model(distribute_tensor(x, mesh, [Replicate()])).full_tensor() - y).square().mean().backward()
    ops = _aten_ops(opts.step)
    assert "aten._fused_adamw_.default" in ops
    assert not any(op.startswith("aten._foreach_addcdiv") or "lerp" in op for op in ops), ops
    assert "fused optimizer unavailable" not in caplog.text


def test_a_device_without_the_fused_kernel_falls_back_with_one_warning(caplog):
    with torch.device("meta"):
        models = [_model(), _model()]
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        opts = [build_optimizers([m], Optimizer(implementation="fused")) for m in models]
    warnings = [r.getMessage() for r in caplog.records if "fused optimizer" in r.getMessage()]
    assert len(warnings) == 1 and "using foreach" in warnings[0] and "meta" in warnings[0]
    for o, m in zip(opts, models):
        assert o.optimizers[0].param_groups[0]["foreach"] is True
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        o.step()  # torch's fused AdamW would raise here, at its first step


def test_dtensor_parameters_step_like_plain_ones_with_dtensor_bf16_state(mesh):
    from torch.distributed.tensor import DTensor

    plain, dt = _model(), _distributed(_model(), mesh)
    _train(plain, build_optimizers([plain], Optimizer(**BF16)), 3)
    opts = build_optimizers([dt], Optimizer(**BF16))
    _train_dt(dt, opts, mesh, 3)
    for p, q in zip(plain.parameters(), dt.parameters()):
        torch.testing.assert_close(q.full_tensor(), p, rtol=0, atol=1e-6)
        state = opts.optimizers[0].state[q]
        assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].dtype == torch.bfloat16
        assert state["exp_avg_sq"].placements == q.placements
    saved = opts.state_dict()
    assert saved["state.0.weight.exp_avg"].dtype == torch.bfloat16


# --- checkpoints ---------------------------------------------------------------------------------
class _Rig:
    """A model, its optimizers and a CheckpointManager saving every 2 steps."""

    def __init__(self, folder: Path, **opt) -> None:
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.lr_scheduler import LRSchedulersContainer
        from torchtitan.config.job_config import Checkpoint, LRScheduler

        self.model = _model()
        self.opts = OptimizersContainer([self.model], Optimizer(**{**BF16, **opt}))
        self.sched = LRSchedulersContainer(self.opts, LRScheduler(warmup_steps=2), 10)
        self.step = 0
        cfg = Checkpoint(enable=True, interval=2, keep_latest_k=0, last_save_model_only=False)
        self.ckpt = CheckpointManager(None, [self.model], self.opts, self.sched, {}, cfg,
                                      str(folder))
        self.folder = folder / cfg.folder

    def train(self, until: int) -> list[float]:
        losses = []
        while self.step < until:
            x, y = _batch(self.step)
            self.step += 1
            self.opts.zero_grad()
            loss = (self.model(x) - y).square().mean()
            loss.backward()
            self.opts.step()
            self.sched.step()
            losses.append(float(loss))
            self.ckpt.save(self.step)
        return losses

    def resume_from(self, other: _Rig, step: int) -> None:
        shutil.copytree(other.folder / f"step-{step}", self.folder / f"step-{step}")
        assert self.ckpt.load() is True
        self.step = step

    def states(self) -> dict:
        return {k: v for k, v in self.opts.state_dict().items() if isinstance(v, torch.Tensor)}


def test_resume_equals_an_uninterrupted_run_bitwise(tmp_path):
    straight = _Rig(tmp_path / "a")
    losses = straight.train(8)
    resumed = _Rig(tmp_path / "b")
    resumed.resume_from(straight, 4)
    assert resumed.train(8) == losses[4:]
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    for key, value in straight.states().items():
        assert torch.equal(value, resumed.states()[key]), key
    assert resumed.states()["state.0.weight.exp_avg"].dtype == torch.bfloat16
    for rig in (straight, resumed):
        rig.ckpt.close()


@pytest.mark.parametrize(("saved", "loaded"), [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_switching_state_dtype_at_a_resume_casts_the_moments(tmp_path, saved, loaded):
    first = _Rig(tmp_path / "a", state_dtype=saved)
    first.train(4)
    then = _Rig(tmp_path / "b", state_dtype=loaded)
    then.resume_from(first, 4)
    dtype = getattr(torch, loaded)
    for key, value in first.states().items():
        got = then.states()[key]
        if key.endswith(("exp_avg", "exp_avg_sq")):
            assert got.dtype == dtype
            assert torch.equal(got, value.to(dtype)), key  # rounded, or widened exactly
        else:
            assert torch.equal(got, value), key
    group = then.opts.optimizers[0].param_groups[0]
    assert group["fused"] is (True if loaded == "float32" else None)  # this run's kernel
    then.train(6)  # and it trains on
    for rig in (first, then):
        rig.ckpt.close()


# --- what the plan refuses -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--optimizer.implementation", "foreach"],
         "optimizer.implementation=foreach chooses torch's kernel for float32 optimizer state; "
         "optimizer.state_dtype=bfloat16 has its own step (compiled per parameter on CUDA): "
         "leave optimizer.implementation at fused"),
        (["--optimizer.beta2", "0.999"],
         "optimizer.beta2=0.999 with optimizer.state_dtype=bfloat16: a decay by 0.999 is below "
         "bfloat16's precision (2**-8), so the moment would round back to its old value and "
         "stop decaying; use beta2 <= 0.99609375 or optimizer.state_dtype=float32"),
    ],
)
def test_the_plan_refuses_what_bf16_state_cannot_do_in_one_line(capsys, flags, line):
    from torchtitan.config.manager import main

    code = main(["--job.config_file", str(REPO_ROOT / "train_configs" / "debug_model.toml"),
                 "--optimizer.state_dtype", "bfloat16", *flags])
    out = capsys.readouterr()
    assert (code, out.out) == (2, "")
    assert out.err == f"error: {line}\n"


def test_a_decay_by_0_999_is_lost_in_bf16_and_by_0_99_is_not():
    v = torch.tensor([1.0, 1.5, 1.99], dtype=torch.bfloat16)
    assert torch.equal((v.float() * 0.999).bfloat16(), v)  # why the plan refuses it
    assert not torch.equal((v.float() * 0.99).bfloat16(), v)
    assert ((v.float() * 0.99).bfloat16() < v).all()


@pytest.mark.slow
@pytest.mark.parametrize("divisor, state", [(None, torch.bfloat16), (2.5, torch.bfloat16),
                                            (2.5, torch.float32)])
def test_the_compiled_step_equals_the_eager_one(divisor, state):
    """What runs on CUDA (torch.compile of the same function), checked with the CPU backend;
    with a gradient divisor (clipping inside the step) and without; with float32 state and a
    bf16 gradient and weight copy (``training.weight_copies``)."""
    torch.manual_seed(0)
    p, g = torch.randn(257, 33), torch.randn(257, 33)
    m, v = torch.randn(257, 33).to(state), torch.rand(257, 33).to(state)
    copy = torch.zeros(257, 33, dtype=torch.bfloat16) if state == torch.float32 else None
    if copy is not None:
        g = g.bfloat16()
    args = (torch.tensor(3.0), torch.tensor(1e-2), 0.9, 0.95, 1e-8, 0.1, True,
            None if divisor is None else torch.tensor(divisor))
    eager = [t.clone() for t in (p, g, m, v)] + ([copy.clone()] if copy is not None else [])
    compiled = [t.clone() for t in (p, g, m, v)] + ([copy.clone()] if copy is not None else [])
    adam_bf16_state_step(*eager[:4], *args, *eager[4:])
    compiled_step()(*compiled[:4], *args, *compiled[4:])
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-7)
    for a, b in zip(compiled[2:4], eager[2:4]):
        assert a.dtype == state
        if state == torch.float32:  # inductor's lerp: float32 rounding on tiny moments
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=0)
    if copy is not None:
        assert torch.equal(eager[4], eager[0].bfloat16())
        assert torch.equal(compiled[4], compiled[0].bfloat16())


@pytest.mark.slow
def test_fsdp2_on_two_gloo_ranks_equals_one_rank_and_resumes(tmp_path):
    """bf16 moments as FSDP2-sharded DTensors: the same losses as one rank, and a checkpoint
    of them (saved by 2 ranks) resumes to the same next steps."""
    from tests.distributed.launcher import launch
    from tests.distributed.trainer_runs import (
        BASE_ARGS,
        TOL,
        from_seed,
        resume_args,
        run_sequence,
        seed_args,
    )

    bf16 = ["--optimizer.implementation", "fused", "--optimizer.state_dtype", "bfloat16",
            "--training.steps", "6"]  # 2 steps after the resumed one read stored moments
    fsdp = ["--parallelism.data_parallel_shard_degree", "2"]
    seed_dir = str(tmp_path / "seed" / "checkpoint" / "step-0")
    one = launch(run_sequence, 1, [seed_args(str(tmp_path / "seed")),
                                   from_seed(seed_dir, str(tmp_path / "one"), *bf16)],
                 timeout_s=180)[0][1]
    saved = str(tmp_path / "two")
    two, resumed = launch(run_sequence, 2, [
        [*BASE_ARGS, "--job.dump_folder", saved, "--checkpoint.enable",
         "--checkpoint.initial_load_path", seed_dir, "--checkpoint.interval", "2", *bf16, *fsdp],
        resume_args(saved, 2, *bf16, *fsdp),
    ], timeout_s=240)[0]
    assert one["loss"][-1] < one["loss"][0]
    torch.testing.assert_close(two["loss"], one["loss"], **TOL)
    assert resumed["first_step"] == [3]
    assert resumed["loss"] == two["loss"][2:]  # bitwise


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_compiled_step_matches_the_cpu_one():
    import torchtitan.components.adamw_bf16_state as module

    module.compiled_step.cache_clear()
    cpu, gpu = _model(), _model().cuda()
    _train(cpu, build_optimizers([cpu], Optimizer(**BF16)), 3)
    opts = build_optimizers([gpu], Optimizer(**BF16))
    for step in range(3):
        x, y = _batch(step)
        opts.zero_grad()
        (gpu(x.cuda()) - y.cuda()).square().mean().backward()
        opts.step()
    assert module.compiled_step.cache_info().currsize == 1  # the compiled path ran
    for p, q in zip(cpu.parameters(), gpu.parameters()):
        torch.testing.assert_close(q.cpu(), p, rtol=0, atol=5e-4)  # bf16 rounding flips
        assert opts.optimizers[0].state[q]["exp_avg"].dtype == torch.bfloat16
