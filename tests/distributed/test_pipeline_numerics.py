"""Pipeline parallelism trains the same model as one device (real gloo ranks on CPU).

A 4-layer tiny Llama (fp32) starts from the same full state dict in every run, sees the same
global batch per step (dp ranks take contiguous slices, tp/pp ranks of one dp rank share them)
and uses the trainer's loss definition: summed token CE times ``dp / global_tokens`` (the PP
schedule applies it per microbatch through the ``Pipeline`` object), AdamW, ``clip_grad_norm_`` (max norm
0.5, acting on every step) reduced over pp. Checked against a single-process reference:
  * per-step loss and grad norm, and a forward-only (validation) loss between steps 3 and 4:
    rtol 1e-5, atol 1e-5 (measured <= 1e-6). Microbatching and sharding only reorder fp32 sums;
    a wrong normalisation, a lost microbatch or a missing stage gradient moves the loss by
    >= 1e-3 from step 2 on.
  * final parameters: atol 1e-4 (measured <= 1e-5; AdamW amplifies last-bit noise of tiny gradients up to ~lr,
    see test_parallel_numerics.py); a real bug moves them by >= 1e-3.
One launch per world size runs all its cases (process start-up dominates the cost).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import GLOBAL_BATCH, SEQ_LEN, global_batch, tiny_args
from tests.distributed.launcher import launch
from torchtitan.components.loss import cross_entropy_loss_sum
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import maybe_loss_parallel
from torchtitan.models.llama3.model import Transformer

pytestmark = pytest.mark.slow  # every test reads results of 2-, 4- or 8-rank gloo launches

N_LAYERS = 4
STEPS = 4
LR = 1e-2
MAX_NORM = 0.5
INIT_SEED = 4321
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
PARAM_ATOL = 1e-4
EVAL_STEP = 99  # batch used for the forward-only (validation) check ...
EVAL_AFTER = 3  # ... run after this many steps, before the next training step


def pp_args():
    args = tiny_args()
    args.n_layers = N_LAYERS
    return args


def initial_state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(INIT_SEED)
    model = Transformer(pp_args())
    model.init_weights()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclass
class Case:
    """One layout. ``pp == 1`` runs the plain (non-pipelined) path."""

    name: str
    pp: int = 2
    dp_shard: int = 1
    dp_replicate: int = 1
    tp: int = 1
    schedule: str = "1F1B"
    microbatch: int = 1
    grad_accum: int = 1
    csv: str | None = None
    layers_per_stage: int | None = None
    first_less: int = 1
    last_less: int = 1
    steps: int = STEPS
    save_after: int | None = None  # checkpoint after this step (to ckpt_dir)
    load_step: int | None = None  # start from this checkpoint step (from ckpt_dir)
    ckpt_dir: str | None = None


@dataclass
class Result:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    eval_loss: float | None = None
    final_state: dict[str, torch.Tensor] = field(default_factory=dict)
    stage_ids: tuple[int, ...] = ()
    seconds: float = 0.0


def _job_config(case: Case) -> JobConfig:
    cfg = JobConfig()
    cfg.training.seq_len = SEQ_LEN
    cfg.training.local_batch_size = GLOBAL_BATCH // (
        case.dp_shard * case.dp_replicate * case.grad_accum
    )
    cfg.training.mixed_precision_param = "float32"
    cfg.training.mixed_precision_reduce = "float32"
    cfg.activation_checkpoint.mode = "none"
    cfg.optimizer.lr = LR
    cfg.optimizer.implementation = "for-loop"
    par = cfg.parallelism
    par.pipeline_parallel_degree = case.pp
    par.data_parallel_shard_degree = case.dp_shard
    par.data_parallel_replicate_degree = case.dp_replicate
    par.tensor_parallel_degree = case.tp
    par.pipeline_parallel_schedule = case.schedule
    par.pipeline_parallel_schedule_csv = case.csv or ""
    par.pipeline_parallel_microbatch_size = case.microbatch
    par.pipeline_parallel_layers_per_stage = case.layers_per_stage
    par.pipeline_parallel_first_stage_less_layers = case.first_less
    par.pipeline_parallel_last_stage_less_layers = case.last_less
    if case.ckpt_dir:
        cfg.checkpoint.enable = True
        cfg.checkpoint.folder = "ckpt"
        cfg.checkpoint.interval = 10_000
        cfg.checkpoint.last_save_model_only = False
    return cfg


def _checkpointer(cfg: JobConfig, case: Case, parts, optimizers):
    from torchtitan.components.checkpoint import CheckpointManager

    return CheckpointManager(
        dataloader=None,
        model_parts=parts,
        optimizers=optimizers,
        lr_schedulers=None,
        states=None,
        checkpoint_config=cfg.checkpoint,
        dump_folder=case.ckpt_dir,
    )


def run_case(case: Case) -> Result:
    """Train ``case`` on the current process group (every rank calls this)."""
    from torchtitan.components.checkpoint import ModelWrapper
    from torchtitan.models.llama3.parallelize import parallelize_llama
    from torchtitan.models.llama3.pipeline import pipeline_llama

    start = time.perf_counter()
    cfg = _job_config(case)
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims.from_config(cfg.parallelism, world)
    dims.build_mesh("cpu")
    args = pp_args()
    with torch.device("meta"):
        model = Transformer(args)
    result = Result()
    pipeline = None
    if case.pp > 1:
        pipeline = pipeline_llama(
            model, dims, cfg, torch.device("cpu"), args, parallelize_llama, cross_entropy_loss_sum
        )
        parts = pipeline.model_parts
        result.stage_ids = tuple(stage.stage_index for stage in pipeline.stages)
    else:
        parts = [parallelize_llama(model, dims, cfg)]
    for part in parts:
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights()
    ModelWrapper(parts).load_full_state_dict(initial_state_dict())
    optimizers = build_optimizers(parts, cfg.optimizer)
    checkpointer = _checkpointer(cfg, case, parts, optimizers) if case.ckpt_dir else None
    first_step = 0
    if case.load_step is not None:
        assert checkpointer.load(step=case.load_step)
        first_step = case.load_step

    dp, dp_rank = dims.dp_degree, dims.mesh_local_rank("dp")
    loss_mesh, pp_mesh = dims.get_mesh("dp_cp"), dims.get_mesh("pp")
    rows_per_rank = GLOBAL_BATCH // dp
    lp = dims.tp_enabled and not cfg.parallelism.disable_loss_parallel
    params = [p for part in parts for p in part.parameters()]

    scale = dp / float(GLOBAL_BATCH * SEQ_LEN)

    def forward_loss(inputs, labels, train: bool) -> torch.Tensor:
        """This rank's share of the scaled loss (0 on pp ranks without the last stage)."""
        with maybe_loss_parallel(lp):
            if pipeline is not None and train:
                return pipeline.train_step(inputs, labels, scale)
            if pipeline is not None:  # eval_loss is the same on every pp rank: count it once
                total = pipeline.eval_loss(inputs, labels) * scale
                return total if pipeline.has_last_stage else torch.zeros_like(total)
            out = cross_entropy_loss_sum(parts[0](inputs), labels) * scale
            if train:
                out.backward()
            return out.detach()

    def global_mean(local: torch.Tensor) -> float:
        value = dist_utils.dist_reduce(local / dp, "sum", loss_mesh)
        return dist_utils.dist_reduce(value, "sum", pp_mesh)

    for step in range(first_step, case.steps):
        inputs, labels = global_batch(step)
        rows = slice(dp_rank * rows_per_rank, (dp_rank + 1) * rows_per_rank)
        chunks = zip(inputs[rows].chunk(case.grad_accum), labels[rows].chunk(case.grad_accum))
        optimizers.zero_grad()
        local = sum(forward_loss(x, y, train=True) for x, y in chunks)
        norm = dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=pp_mesh)
        optimizers.step()
        result.losses.append(global_mean(local))
        result.grad_norms.append(float(norm))
        if checkpointer is not None and case.save_after == step + 1:
            checkpointer.save(step + 1, force=True)
        if step + 1 == EVAL_AFTER:  # validation between training steps
            x, y = global_batch(EVAL_STEP)
            with torch.no_grad():
                result.eval_loss = global_mean(forward_loss(x[rows], y[rows], train=False))
    if checkpointer is not None:
        checkpointer.close()
    result.final_state = _full_state(parts)
    result.seconds = time.perf_counter() - start
    return result


def _full_state(parts) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True)
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        full.update(
            {k: v.detach().clone() for k, v in get_model_state_dict(part, options=opts).items()}
        )
    return full


def run_cases(cases: list[Case]) -> dict[str, Result]:
    """Worker entry: every case in turn on this process group."""
    return {case.name: run_case(case) for case in cases}


def train_reference(steps: int = STEPS, start_state: Any = None) -> Result:
    """One process, full global batch, same loss definition and optimizer."""
    cfg = _job_config(Case("reference", pp=1))
    model = Transformer(pp_args())
    model.load_state_dict(initial_state_dict())
    optimizers = build_optimizers([model], cfg.optimizer)
    result = Result()
    tokens = float(GLOBAL_BATCH * SEQ_LEN)
    for step in range(steps):
        inputs, labels = global_batch(step)
        optimizers.zero_grad()
        loss = cross_entropy_loss_sum(model(inputs), labels) / tokens
        loss.backward()
        norm = dist_utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
        optimizers.step()
        result.losses.append(loss.item())
        result.grad_norms.append(float(norm))
        if step + 1 == EVAL_AFTER:
            x, y = global_batch(EVAL_STEP)
            with torch.no_grad():
                result.eval_loss = (cross_entropy_loss_sum(model(x), y) / tokens).item()
    result.final_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result


# --- the launches ---------------------------------------------------------------------------------
CUSTOM_CSV = (  # a hand-written V-shaped GPipe-like table for 2 ranks, 4 stages, 2 microbatches
    "0F0,0F1,3F0,3F1,3B0,3B1,0B0,0B1\n1F0,1F1,2F0,2F1,2B0,2B1,1B0,1B1\n"
)

SCHEDULE_CASES = [
    Case("GPipe", schedule="GPipe"),
    Case("1F1B", schedule="1F1B"),
    Case("Interleaved1F1B", schedule="Interleaved1F1B"),
    Case("LoopedBFS", schedule="LoopedBFS"),
    Case("InterleavedZeroBubble", schedule="InterleavedZeroBubble"),
    Case("ZBVZeroBubble", schedule="ZBVZeroBubble"),
    Case("DualPipeV", schedule="DualPipeV"),
    # 2 microbatches of 2 rows, and gradient accumulation: 2 schedule steps per optimizer step
    Case("1F1B_mbs2_accum2", schedule="1F1B", microbatch=1, grad_accum=2),
    Case("Interleaved1F1B_mbs2", schedule="Interleaved1F1B", microbatch=2),
    # 4 layers + 0 + 0 = 4 units -> 1 layer per stage, 2 stages per rank
    Case(
        "LoopedBFS_layers_per_stage_1",
        schedule="LoopedBFS",
        layers_per_stage=1,
        first_less=0,
        last_less=0,
    ),
]


@pytest.fixture(scope="module")
def reference() -> Result:
    ref = train_reference()
    assert max(ref.losses) - min(ref.losses) > 0.1  # training moves the loss
    assert all(n > MAX_NORM for n in ref.grad_norms)  # clipping acts on every step
    return ref


@pytest.fixture(scope="module")
def results_pp2(tmp_path_factory) -> dict[str, list[Result]]:
    csv_path = tmp_path_factory.mktemp("csv") / "custom.csv"
    csv_path.write_text(CUSTOM_CSV)
    cases = [*SCHEDULE_CASES, Case("custom_csv", csv=str(csv_path), microbatch=2)]
    return _by_case(launch(run_cases, 2, cases, timeout_s=240))


def _by_case(per_rank: list[dict[str, Result]]) -> dict[str, list[Result]]:
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def _assert_matches(runs: list[Result], ref: Result, first_step: int = 0) -> None:
    for rank, run in enumerate(runs):
        torch.testing.assert_close(
            run.losses,
            ref.losses[first_step:],
            **LOSS_TOL,
            msg=lambda m, r=rank: f"rank {r} losses: {m}",
        )
        torch.testing.assert_close(
            run.grad_norms,
            ref.grad_norms[first_step:],
            **LOSS_TOL,
            msg=lambda m, r=rank: f"rank {r} grad norms: {m}",
        )
        torch.testing.assert_close(run.eval_loss, ref.eval_loss, **LOSS_TOL)
    merged: dict[str, torch.Tensor] = {}
    for run in runs:
        merged.update(run.final_state)
    assert set(merged) == set(ref.final_state)  # every parameter lives on some stage
    for key, value in ref.final_state.items():
        torch.testing.assert_close(
            merged[key], value, rtol=0, atol=PARAM_ATOL, msg=lambda m, k=key: f"{k}: {m}"
        )


@pytest.mark.parametrize("name", [c.name for c in SCHEDULE_CASES] + ["custom_csv"])
def test_pp2_schedule_matches_single_device(name, results_pp2, reference):
    _assert_matches(results_pp2[name], reference)


def test_pp2_stage_placement(results_pp2):
    assert [r.stage_ids for r in results_pp2["1F1B"]] == [(0,), (1,)]
    assert [r.stage_ids for r in results_pp2["Interleaved1F1B"]] == [(0, 2), (1, 3)]
    assert [r.stage_ids for r in results_pp2["ZBVZeroBubble"]] == [(0, 3), (1, 2)]
    assert [r.stage_ids for r in results_pp2["custom_csv"]] == [(0, 3), (1, 2)]


# --- 4 ranks: PP x FSDP, PP x TP, and checkpoints across layouts ------------------------------------
def _cases_4(ckpt_a: str, ckpt_b: str) -> list[Case]:
    return [
        Case("pp2_fsdp2_interleaved", dp_shard=2, schedule="Interleaved1F1B"),
        Case("pp2_tp2", tp=2),
        # PP2 x FSDP2 saves after step 2; FSDP4 (no PP) resumes from it, and the reverse
        Case("pp2_fsdp2_save", dp_shard=2, save_after=2, ckpt_dir=ckpt_a),
        Case("fsdp4_from_pp2_fsdp2", pp=1, dp_shard=4, load_step=2, ckpt_dir=ckpt_a),
        Case("fsdp4_save", pp=1, dp_shard=4, save_after=2, ckpt_dir=ckpt_b),
        Case("pp2_fsdp2_from_fsdp4", dp_shard=2, load_step=2, ckpt_dir=ckpt_b),
    ]


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory) -> tuple[str, str]:
    return str(tmp_path_factory.mktemp("ckpt_a")), str(tmp_path_factory.mktemp("ckpt_b"))


@pytest.fixture(scope="module")
def results_4(ckpt_dirs) -> dict[str, list[Result]]:
    return _by_case(launch(run_cases, 4, _cases_4(*ckpt_dirs), timeout_s=240))


@pytest.mark.parametrize("name", ["pp2_fsdp2_save", "pp2_fsdp2_interleaved", "pp2_tp2"])
def test_pp2_composed_matches_single_device(name, results_4, reference):
    _assert_matches(results_4[name], reference)


@pytest.mark.parametrize("name", ["fsdp4_from_pp2_fsdp2", "pp2_fsdp2_from_fsdp4"])
def test_checkpoint_resumes_across_pp_and_fsdp_layouts(name, results_4, reference):
    # steps 3..4 after loading the step-2 checkpoint equal the uninterrupted run
    assert len(results_4[name][0].losses) == STEPS - 2
    _assert_matches(results_4[name], reference, first_step=2)


def test_pp2_fsdp2_checkpoint_loads_on_one_device(results_4, ckpt_dirs, reference):
    result = run_case(Case("one_device", pp=1, load_step=2, ckpt_dir=ckpt_dirs[0]))
    _assert_matches([result], reference, first_step=2)


# --- 8 ranks: PP2 x FSDP2 x TP2 and PP2 x HSDP (2 x 2) -----------------------------------------------
EIGHT_RANK_CASES = [
    Case("pp2_fsdp2_tp2", dp_shard=2, tp=2),
    Case("pp2_hsdp2x2_interleaved", dp_replicate=2, dp_shard=2, schedule="Interleaved1F1B"),
]


def test_pp2_with_dp_and_tp_on_8_ranks_matches_single_device(reference):
    results = _by_case(launch(run_cases, 8, EIGHT_RANK_CASES, timeout_s=300))
    for case in EIGHT_RANK_CASES:
        _assert_matches(results[case.name], reference)
