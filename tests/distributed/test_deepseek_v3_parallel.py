"""DeepSeek-V3 (debugmodel) under FSDP2, TP2, PP2, CP2 and EP2 on two gloo ranks equals one device.

Same method as test_trainer_data_parallel.py (tests/distributed/trainer_runs.py): one seed
checkpoint, fixed global batches, per-step loss and grad norm compared. FSDP2 shards every
parameter (experts included); TP2 covers the MLA plan (``wq_b``/``wkv_b`` column-wise, ``wo``
row-wise, the latent ``wq_a``/``wkv_a`` and their norms replicated with whole gradients on
each rank), the dense FFN split and MoE layers run whole on every TP rank; PP2 splits the
blocks with the Llama pipeline helpers (1F1B); CP2 shards the sequence and the RoPE table
(ring attention over v zero-padded to the q/k head dim); EP2 puts 4 of the 8 routed experts on
each rank (group-limited routing picks experts on both; the shared experts stay FSDP). The MoE
load-balancing bias is updated every step, so later steps' routing depends on it matching.
The runs build the flavor with 2 of its 6 layers (its dense layer and one MoE layer; each
pipeline stage holds one).

Measured (worst step and rank): loss 1.1e-6 absolute for FSDP2, 9.5e-7 TP2, 4.8e-7 PP2,
9.5e-7 CP2, 1.1e-6 EP2 (expert gradients scaled 1.5x wrong fail it); grad norms
4.6e-5 relative (the CPU fp32 norm kernel, see test_qwen3_parallel.py), hence rtol 1e-4 there.
The loss alone is a weak check of TP (AdamW hides gradient scale errors; a rope key whose
gradient was not summed over the TP ranks moved the loss by only 1.5e-4 at step 3), so
:func:`tp_gradients` also compares every parameter's gradient after one backward (measured
worst 8.5e-7 relative to the largest entry; 5e-2 with that bug).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import launch
from tests.distributed.trainer_runs import STEPS, from_seed, run_sequence, seed_args

pytestmark = pytest.mark.slow  # launches gloo ranks

TOL = {"loss": dict(rtol=1e-5, atol=1e-5), "grad_norm": dict(rtol=1e-4, atol=1e-5)}
MODEL = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
N_LAYERS = 2  # of the flavor's 6 (run_sequence): its dense layer and one MoE layer
LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp2": ["--parallelism.data_parallel_shard_degree", "1",
            "--parallelism.tensor_parallel_degree", "2"],
    "pp2": ["--parallelism.data_parallel_shard_degree", "1",
            "--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_schedule", "1F1B"],
    "cp2": ["--parallelism.data_parallel_shard_degree", "1",
            "--parallelism.context_parallel_degree", "2"],
    # routed experts split over the 2 ranks (shared experts and MLA stay FSDP-sharded)
    "ep2": ["--parallelism.data_parallel_shard_degree", "2",
            "--parallelism.expert_parallel_degree", "2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, list[float]]]]:
    root = tmp_path_factory.mktemp("deepseek_v3")
    seed_dir = str(root / "seed" / "checkpoint" / "step-0")
    single = [[*seed_args(str(root / "seed")), *MODEL], from_seed(seed_dir, str(root / "one"), *MODEL)]
    one = launch(run_sequence, 1, single, N_LAYERS, timeout_s=240)[0]
    argvs = [from_seed(seed_dir, str(root / name), *MODEL, *flags) for name, flags in LAYOUTS.items()]
    per_rank = launch(run_sequence, 2, argvs, N_LAYERS, timeout_s=300)
    out = {"one": [one[1]]}
    for i, name in enumerate(LAYOUTS):
        out[name] = [rank[i] for rank in per_rank]
    return out


def test_one_device_trains(runs):
    losses = runs["one"][0]["loss"]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_match_one_device(layout, runs):
    reference = runs["one"][0]
    for rank, run in enumerate(runs[layout]):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(
                run[key], reference[key], **TOL[key],
                msg=lambda m, k=key, r=rank: f"{layout} rank {r} {k}: {m}",
            )


def tp_gradients() -> list[tuple[float, str]]:
    """Worker: the debugmodel (random routing bias) on one device and under TP2 with the same
    weights and batch; per parameter, max |grad difference| / max |grad| (worst first)."""
    from tests.distributed.harness import tp2_gradient_errors
    from torchtitan.models import get_model_spec

    spec = get_model_spec("deepseek_v3")
    args = spec.get_model_args("debugmodel")
    args.max_seq_len, args.vocab_size = 32, 256
    torch.manual_seed(0)
    ref = spec.model_cls(args)
    ref.init_weights()
    with torch.no_grad():
        for layer in list(ref.layers.values())[args.n_dense_layers:]:
            layer.moe.expert_bias.normal_(0, 0.01)
    return tp2_gradient_errors(spec, args, ref)


def test_tp2_gradients_equal_one_device():
    for rank, worst in enumerate(launch(tp_gradients, 2, timeout_s=240)):
        # 3 outer + layer 0 (9 attention + 3 FFN) + 5 MoE layers (9 + 7) parameters
        assert len(worst) == 95 and worst[0][0] < 1e-5, (rank, worst[:3])
