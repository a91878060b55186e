"""gpt-oss (debugmodel) under FSDP2, TP2, EP2 x FSDP2, PP2 and CP2 on two gloo ranks, and
EP2 x TP2 x ETP2 on four, equals one device; an EP2 x FSDP2 checkpoint resumes at FSDP4.

Same method as test_deepseek_v3_parallel.py (tests/distributed/trainer_runs.py): one seed
checkpoint, fixed global batches (seq 64, so the 32-token window of layer 0 bites), per-step
loss and grad norm compared, on the flavor built with 2 of its 4 layers (one windowed, one
full). TP2 shards the heads with their biases and sinks; EP2 puts 4 of the 8 experts (with
their biases) on each rank; ETP2 also splits every expert's hidden units (the gate/up biases
with them, the down bias added once after the sum); PP2 puts one block on each stage; CP2
runs the window and sinks through the masked all-gather path. The biases start at zero and
move with the first AdamW step, so later steps exercise them; :func:`tp_gradients` compares
every gradient after one backward with random non-zero biases and sinks (all 4 layers).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import launch
from tests.distributed.trainer_runs import (
    BASE_ARGS,
    NORM_TOL,
    STEPS,
    TOL,
    TWO_RANK_LAYOUTS,
    dp,
    from_seed,
    resume_args,
    run_sequence,
    seed_args,
)

pytestmark = pytest.mark.slow  # launches gloo ranks

MODEL = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"]
N_LAYERS = 2  # of the flavor's 4 (run_sequence): a windowed and a full layer


EP2 = ["--parallelism.expert_parallel_degree", "2"]
TWO_RANKS = {**TWO_RANK_LAYOUTS, "ep2_fsdp2": [*dp(2), *EP2]}
FOUR_RANKS = {
    "ep2_tp2_etp2": [*dp(2), "--parallelism.tensor_parallel_degree", "2", *EP2,
                     "--parallelism.expert_tensor_parallel_degree", "2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, list[float]]]]:
    root = tmp_path_factory.mktemp("gpt_oss")
    seed_dir = str(root / "seed" / "checkpoint" / "step-0")
    saved = str(root / "ep2_saved")
    save = [*BASE_ARGS, *MODEL, "--job.dump_folder", saved, "--checkpoint.enable",
            "--checkpoint.initial_load_path", seed_dir, "--training.steps", "2",
            "--checkpoint.interval", "2", *dp(2), *EP2]
    resumed = resume_args(saved, 2, *MODEL, *dp(4), "--training.local_batch_size", "2")
    out: dict[str, list[dict[str, list[float]]]] = {}
    for world, first, layouts, last in (
        (1, [[*seed_args(str(root / "seed")), *MODEL]], {"one": []}, {}),
        (2, [], TWO_RANKS, {"saved": save}),
        (4, [], FOUR_RANKS, {"resumed_fsdp4": resumed}),
    ):
        argvs = first + [
            from_seed(seed_dir, str(root / name), *MODEL, *flags) for name, flags in layouts.items()
        ] + list(last.values())
        per_rank = launch(run_sequence, world, argvs, N_LAYERS, timeout_s=600)
        for i, name in enumerate([*layouts, *last]):
            out[name] = [rank[len(first) + i] for rank in per_rank]
    return out


def test_one_device_trains(runs):
    losses = runs["one"][0]["loss"]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("layout", [*TWO_RANKS, *FOUR_RANKS])
def test_parallel_layouts_match_one_device(layout, runs):
    reference = runs["one"][0]
    for rank, run in enumerate(runs[layout]):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(
                run[key], reference[key], **(TOL if key == "loss" else NORM_TOL),
                msg=lambda m, k=key, r=rank: f"{layout} rank {r} {k}: {m}",
            )


def test_ep2_fsdp2_checkpoint_resumes_at_fsdp4(runs):
    uninterrupted = runs["ep2_fsdp2"][0]
    torch.testing.assert_close(runs["saved"][0]["loss"], uninterrupted["loss"][:2], **TOL)
    for rank, run in enumerate(runs["resumed_fsdp4"]):
        assert run["first_step"] == [3]
        torch.testing.assert_close(run["loss"], uninterrupted["loss"][2:], **TOL,
                                   msg=lambda m, r=rank: f"resumed rank {r}: {m}")


def tp_gradients() -> list[tuple[float, str]]:
    """Worker: the debugmodel with random biases, sinks and routing bias on one device and
    under TP2 with the same weights and batch; per parameter, max |grad difference| / max
    |grad| (worst first)."""
    from tests.distributed.harness import tp2_gradient_errors
    from torchtitan.models import get_model_spec

    spec = get_model_spec("gpt_oss")
    args = spec.get_model_args("debugmodel")
    args.max_seq_len, args.vocab_size, args.sliding_window_size = 32, 256, 8
    torch.manual_seed(0)
    ref = spec.model_cls(args)
    ref.init_weights()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("bias", "sinks")) or ".b" in name:
                p.normal_(0, 0.3)
        for layer in ref.layers.values():
            layer.moe.expert_bias.normal_(0, 0.01)
    return tp2_gradient_errors(spec, args, ref)


def test_tp2_gradients_equal_one_device():
    for rank, worst in enumerate(launch(tp_gradients, 2, timeout_s=240)):
        # 3 outer + 4 layers x (9 attention (4 weights, 4 biases, sinks) + 2 norms
        # + 2 router + 6 experts)
        assert len(worst) == 3 + 4 * 19 and worst[0][0] < 1e-5, (rank, worst[:3])
