"""Data parallelism through ``Trainer.train_step`` equals one rank on the same global batch.

A seed checkpoint gives every run the same weights. Batches come from a fixed global batch
per step: one rank reads it as two gradient-accumulation microbatches (rows 0-3, then 4-7),
two data-parallel ranks (FSDP, then DDP) read one half each. Rank 0's rows carry many ignored
labels (-100) and rank 1's none, so the per-rank token counts differ: the loss normalisation
(summed token loss x n_loss_ranks / global valid tokens) is only right if the number of
loss ranks and the global token count are both used. Per-step loss and grad norm (clipping
at 0.5 is active) agree within rtol/atol 1e-5 (fp32 reduction-order noise).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import launch

pytestmark = pytest.mark.slow  # launches gloo ranks

TOL = dict(rtol=1e-5, atol=1e-5)
STEPS = 3
GLOBAL_BATCH, SEQ_LEN, VOCAB = 8, 64, 2256

BASE_ARGS = [
    "--job.config_file", "train_configs/debug_model.toml",
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", str(SEQ_LEN),
    "--training.local_batch_size", "4",
    "--training.global_batch_size", str(GLOBAL_BATCH),
    "--training.steps", str(STEPS),
    "--training.max_norm", "0.5",
    "--activation_checkpoint.mode", "none",
    "--optimizer.lr", "1e-2",
    "--optimizer.implementation", "for-loop",
    "--lr_scheduler.warmup_steps", "1",
    "--debug.seed", "3",
]


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=g)
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    labels[:4, : SEQ_LEN * 3 // 4] = -100  # rank 0's half: a quarter of its labels count
    return inputs, labels


class FixedBatches:
    """This data-parallel rank's rows of each step's global batch, ``rows`` at a time."""

    def __init__(self, dp_rank: int, dp_degree: int, rows: int):
        self.dp_rank, self.dp_degree, self.rows = dp_rank, dp_degree, rows

    def __iter__(self):
        per_rank = GLOBAL_BATCH // self.dp_degree
        step = 0
        while True:
            inputs, labels = global_batch(step)
            lo = self.dp_rank * per_rank
            for start in range(lo, lo + per_rank, self.rows):
                yield inputs[start : start + self.rows], labels[start : start + self.rows]
            step += 1


def run_trainer(argv: list[str]) -> dict[str, list[float]]:
    """Build a Trainer in this (launched) process, feed it fixed batches, record its steps."""
    from torchtitan.config.manager import ConfigManager
    from torchtitan.train import Trainer

    trainer = Trainer(ConfigManager().parse_args(argv))
    dims = trainer.parallel_dims
    trainer.dataloader = FixedBatches(
        dims.mesh_local_rank("dp"), dims.dp_degree, trainer.job_config.training.local_batch_size
    )
    record: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    try:
        assert trainer.checkpointer.load()  # the seed checkpoint's weights
        iterator = iter(trainer.dataloader)
        for _ in range(STEPS):
            trainer.step += 1
            loss, grad_norm = trainer.train_step(iterator)
            record["loss"].append(loss)
            record["grad_norm"].append(grad_norm)
        record["accumulation"] = [trainer.gradient_accumulation_steps]
    finally:
        trainer.close()
    return record


def run_sequence(runs: list[list[str]]) -> list[dict[str, list[float]]]:
    from torchtitan.config.manager import ConfigManager
    from torchtitan.train import Trainer

    results = []
    for argv in runs:
        if "--checkpoint.create_seed_checkpoint" in argv:
            trainer = Trainer(ConfigManager().parse_args(argv))
            try:
                trainer.train()
            finally:
                trainer.close()
            results.append({})
        else:
            results.append(run_trainer(argv))
    return results


def _from_seed(seed_dir: str, dump: str, *extra: str) -> list[str]:
    return [*BASE_ARGS, "--job.dump_folder", dump, "--checkpoint.enable",
            "--checkpoint.load_only", "--checkpoint.initial_load_path", seed_dir, *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, list[float]]]]:
    root = tmp_path_factory.mktemp("dp")
    seed_dir = str(root / "seed" / "checkpoint" / "step-0")
    seed = [*BASE_ARGS, "--job.dump_folder", str(root / "seed"), "--checkpoint.enable",
            "--checkpoint.create_seed_checkpoint"]
    one = launch(run_sequence, 1, [seed, _from_seed(seed_dir, str(root / "one"))], timeout_s=180)
    layouts = {
        "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
        "ddp2": ["--parallelism.data_parallel_shard_degree", "1",
                 "--parallelism.data_parallel_replicate_degree", "2"],
    }
    argvs = [_from_seed(seed_dir, str(root / name), *flags) for name, flags in layouts.items()]
    per_rank = launch(run_sequence, 2, argvs, timeout_s=240)
    out = {"one": [one[0][1]]}
    for i, name in enumerate(layouts):
        out[name] = [rank[i] for rank in per_rank]
    return out


def test_one_rank_accumulates_what_two_ranks_split(runs):
    assert runs["one"][0]["accumulation"] == [2]
    assert runs["fsdp2"][0]["accumulation"] == [1] and runs["ddp2"][0]["accumulation"] == [1]
    losses = runs["one"][0]["loss"]
    assert len(losses) == STEPS and losses[-1] < losses[0]


@pytest.mark.parametrize("layout", ["fsdp2", "ddp2"])
def test_two_data_parallel_ranks_match_one_rank(layout, runs):
    reference = runs["one"][0]
    for rank, run in enumerate(runs[layout]):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(
                run[key], reference[key], **TOL,
                msg=lambda m, k=key, r=rank: f"{layout} rank {r} {k}: {m}",
            )
