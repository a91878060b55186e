"""Trainer runs in launched gloo ranks, fed fixed global batches, from one seed checkpoint.

``run_sequence(argvs)`` runs several trainers one after another in the same ranks: an argv with
``--checkpoint.create_seed_checkpoint`` writes the seed checkpoint, any other loads it and
runs ``STEPS`` steps through ``Trainer.train_step`` on batches cut from one global batch per
step (each data-parallel rank takes its rows, ``local_batch_size`` at a time), so layouts with
different data-parallel degrees or gradient-accumulation splits see the same global batch.
Rank 0's rows carry many ignored labels (-100) and rank 1's none, so per-rank token counts
differ and the loss normalisation is exercised.
"""

from __future__ import annotations

from pathlib import Path

import torch

STEPS = 4
GLOBAL_BATCH, SEQ_LEN, VOCAB = 8, 64, 2256

TOL = dict(rtol=1e-5, atol=1e-5)
"""Per-step losses of two layouts from one seed checkpoint (fp32: only sum orders differ)."""
# The total grad norm is a float32 sum of squares over ~1M gradient elements; CPU norm kernels
# accumulate it with ~5e-5 relative error (measured against float64 on the Qwen3 MoE debug
# model: one device -8e-5, FSDP2 -3e-5), so grad norms of layouts whose shards differ are
# held to 1e-4.
NORM_TOL = dict(rtol=1e-4, atol=1e-5)

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


def dp(shard: int) -> list[str]:
    """FSDP over ``shard`` ranks (1: no data parallelism)."""
    return ["--parallelism.data_parallel_shard_degree", str(shard)]


ONE_BATCH = ["--training.local_batch_size", str(GLOBAL_BATCH)]
"""With data parallelism 1: the whole global batch in one microbatch (no accumulation)."""

TWO_RANK_LAYOUTS = {
    "fsdp2": dp(2),
    "tp2": [*dp(1), "--parallelism.tensor_parallel_degree", "2", *ONE_BATCH],
    "pp2": [*dp(1), "--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_schedule", "1F1B", *ONE_BATCH],
    "cp2": [*dp(1), "--parallelism.context_parallel_degree", "2", *ONE_BATCH],
}
"""The two-rank layouts a feature is checked under against one device: each takes the same
global batch per step (FSDP2 two local halves; TP2, PP2, CP2 the whole batch on both ranks)."""


def global_batch(
    step: int, separators: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; with ``separators`` (BOS, EOS ids) each row holds three documents, cut
    at row-dependent places (so block-causal attention differs from causal)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=g)
    if separators is not None:
        bos, eos = separators
        for row in range(GLOBAL_BATCH):
            for end in (9 + 3 * row, 37 + row):
                tokens[row, end], tokens[row, end + 1] = eos, bos
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    labels[:4, : SEQ_LEN * 3 // 4] = -100  # rank 0's half: a quarter of its labels count
    return inputs, labels


class FixedBatches:
    """This data-parallel rank's rows of each step's global batch, ``rows`` at a time."""

    def __init__(self, dp_rank: int, dp_degree: int, rows: int, first_step: int = 0,
                 separators: tuple[int, int] | None = None):
        self.dp_rank, self.dp_degree, self.rows = dp_rank, dp_degree, rows
        self.first_step, self.separators = first_step, separators

    def __iter__(self):
        per_rank = GLOBAL_BATCH // self.dp_degree
        step = self.first_step
        while True:
            inputs, labels = global_batch(step, self.separators)
            lo = self.dp_rank * per_rank
            for start in range(lo, lo + per_rank, self.rows):
                yield inputs[start : start + self.rows], labels[start : start + self.rows]
            step += 1


def seed_args(dump: str) -> list[str]:
    """Write a seed checkpoint to ``dump/checkpoint/step-0``."""
    return [*BASE_ARGS, "--job.dump_folder", dump, "--checkpoint.enable",
            "--checkpoint.create_seed_checkpoint"]


def from_seed(seed_dir: str, dump: str, *extra: str) -> list[str]:
    """Train from the seed checkpoint at ``seed_dir`` (weights only)."""
    return [*BASE_ARGS, "--job.dump_folder", dump, "--checkpoint.enable",
            "--checkpoint.load_only", "--checkpoint.initial_load_path", seed_dir, *extra]


def resume_args(dump: str, step: int, *extra: str) -> list[str]:
    """Resume from ``dump``'s checkpoint at ``step`` under another layout (the fixed batches
    stand in for the dataloader, so its saved position is not loaded)."""
    return [*BASE_ARGS, "--job.dump_folder", dump, "--checkpoint.enable", "--checkpoint.load_step",
            str(step), "--checkpoint.exclude_from_loading", "dataloader", *extra]


REAL_DATA = "real-data"
"""Put first in an argv list to train on the configured dataloader instead of fixed batches."""


def run_trainer(argv: list[str]) -> dict[str, list[float]]:
    """Build a Trainer in this (launched) process, load its checkpoint, run the remaining steps
    on fixed batches (or the real dataloader after ``REAL_DATA``), saving as configured, and
    record them."""
    real_data = argv[:1] == [REAL_DATA]
    argv = argv[1:] if real_data else argv
    from torchtitan.config.manager import ConfigManager
    from torchtitan.train import Trainer

    trainer = Trainer(ConfigManager().parse_args(argv))
    dims = trainer.parallel_dims
    cfg = trainer.job_config
    record: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    try:
        assert trainer.checkpointer.load(step=cfg.checkpoint.load_step)  # seed or resume
        record["first_step"] = [trainer.step + 1]
        tokenizer = trainer.run.tokenizer
        batches = FixedBatches(
            dims.mesh_local_rank("dp"), dims.dp_degree, cfg.training.local_batch_size, trainer.step,
            separators=(tokenizer.bos_id, tokenizer.eos_id),
        )
        iterator = iter(trainer.dataloader if real_data else batches)
        while trainer.step < cfg.training.steps:
            trainer.step += 1
            loss, grad_norm = trainer.train_step(iterator)
            record["loss"].append(float(loss))
            record["grad_norm"].append(float(grad_norm))
            trainer.checkpointer.save(trainer.step, last_step=trainer.step == cfg.training.steps)
        record["accumulation"] = [trainer.gradient_accumulation_steps]
        if trainer.run.moe_layers:  # this rank's MoE layers (a pipeline stage holds some)
            record["expert_bias"] = torch.cat(
                [layer.expert_bias.flatten() for layer in trainer.run.moe_layers]
            ).tolist()
        if trainer.validator is not None:
            record["val"] = [trainer.validator.validate(trainer.model_parts)]
    finally:
        trainer.close()
    return record


def run_sequence(
    runs: list[list[str]], n_layers: int | None = None
) -> list[dict[str, list[float]]]:
    """Worker entry: each argv in turn (seed checkpoint writes return ``{}``). With
    ``n_layers``, every flavor is built with that many layers (a layout's equality does not
    depend on the depth, and each layer costs every run its collectives)."""
    from torchtitan.config.manager import ConfigManager
    from torchtitan.models.spec import ModelSpec
    from torchtitan.train import Trainer

    get_model_args = ModelSpec.get_model_args
    if n_layers is not None:
        def with_layers(spec: ModelSpec, flavor: str):
            args = get_model_args(spec, flavor)
            args.n_layers = n_layers
            return args

        ModelSpec.get_model_args = with_layers
    results = []
    try:
        for argv in runs:
            if "--checkpoint.create_seed_checkpoint" in argv and REAL_DATA not in argv:
                trainer = Trainer(ConfigManager().parse_args(argv))
                try:
                    trainer.train()
                finally:
                    trainer.close()
                results.append({})
            else:
                results.append(run_trainer(argv))
    finally:
        ModelSpec.get_model_args = get_model_args
    return results


def lever_runs(root: Path, flags: list[str], lever_off: list[str],
               two_ranks: dict[str, list[str]]) -> dict[str, list[dict[str, list[float]]]]:
    """A lever (a kernel path with its own switch) against its plain path, from one seed
    checkpoint: on one rank ``flags + lever_off`` (``"plain"``) and ``flags`` (``"one"``), then
    every layout of ``two_ranks`` with ``flags`` on two ranks. Per name, each rank's record."""
    from tests.distributed.launcher import launch

    seed_dir = str(root / "seed" / "checkpoint" / "step-0")
    _, plain, one = launch(run_sequence, 1, [
        seed_args(str(root / "seed")),
        from_seed(seed_dir, str(root / "plain"), *flags, *lever_off),
        from_seed(seed_dir, str(root / "one"), *flags),
    ], timeout_s=300)[0]
    out = {"plain": [plain], "one": [one]}
    argvs = [from_seed(seed_dir, str(root / name), *flags, *layout)
             for name, layout in two_ranks.items()]
    per_rank = launch(run_sequence, 2, argvs, timeout_s=600)
    for i, name in enumerate(two_ranks):
        out[name] = [rank[i] for rank in per_rank]
    return out
