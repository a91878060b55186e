"""The trainer under pipeline parallelism equals the trainer on one device (real gloo ranks).

A seed checkpoint (one process) gives every run the same initial weights. The reference
trainer runs on one rank; the PP runs on two ranks (dp = 1 in both, so they read the same
batches). Each run uses gradient accumulation (global batch 2x local) and validation every
2 steps, so the PP training step, the loss normalisation, the loss broadcast over the pp group
and the pipelined validation path of ``torchtitan/train.py`` are all compared:
per-step loss, grad norm and validation loss within rtol 1e-5 / atol 1e-5 (fp32 reordering
noise; measured <= 2e-6).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import launch

pytestmark = pytest.mark.slow  # the module fixtures launch gloo ranks (seed run, reference, PP)

TOL = dict(rtol=1e-5, atol=1e-5)
STEPS = 4

BASE_ARGS = [
    "--job.config_file",
    "train_configs/debug_model.toml",
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "4",
    "--training.global_batch_size",
    "8",
    "--training.steps",
    str(STEPS),
    "--training.max_norm",
    "0.5",
    "--activation_checkpoint.mode",
    "none",
    "--optimizer.lr",
    "1e-2",
    "--optimizer.implementation",
    "for-loop",
    "--lr_scheduler.warmup_steps",
    "1",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "--validation.dataset",
    "c4_test",
    "--validation.local_batch_size",
    "3",  # not a multiple of the 4 microbatches
    "--validation.seq_len",
    "64",
    "--validation.freq",
    "2",
    "--validation.steps",
    "2",
    "--debug.seed",
    "7",
]


def run_trainer(argv: list[str]) -> dict[str, list[float]]:
    """Build and run a Trainer in this (launched) process; record losses and grad norms."""
    from torchtitan.config.manager import ConfigManager
    from torchtitan.train import Trainer

    trainer = Trainer(ConfigManager().parse_args(argv))
    record: dict[str, list[float]] = {"loss": [], "grad_norm": [], "val": []}
    train_step = trainer.train_step

    def recording_step(data_iterator):
        loss, grad_norm = train_step(data_iterator)
        record["loss"].append(float(loss))
        record["grad_norm"].append(float(grad_norm))
        return loss, grad_norm

    trainer.train_step = recording_step
    if trainer.validator is not None:
        validate = trainer.validator.validate

        def recording_validate(model_parts):
            value = validate(model_parts)
            record["val"].append(float(value))
            return value

        trainer.validator.validate = recording_validate
    try:
        trainer.train()
    finally:
        trainer.close()
    return record


def _args(seed_dir: str, dump: str, *extra: str) -> list[str]:
    return [
        *BASE_ARGS,
        "--job.dump_folder",
        dump,
        "--checkpoint.enable",
        "--checkpoint.load_only",
        "--checkpoint.initial_load_path",
        seed_dir,
        *extra,
    ]


def run_sequence(runs: list[list[str]]) -> list[dict[str, list[float]]]:
    """Several trainer runs, one after another, in the same launched processes."""
    return [run_trainer(argv) for argv in runs]


@pytest.fixture(scope="module")
def seed_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("seed") / "checkpoint" / "step-0")


@pytest.fixture(scope="module")
def reference(seed_dir, tmp_path_factory) -> dict[str, list[float]]:
    """Write the seed checkpoint, then train from it on one rank (one launch)."""
    seed_args = [
        *BASE_ARGS,
        "--job.dump_folder",
        seed_dir.rsplit("/checkpoint/", 1)[0],
        "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint",
    ]
    ref_args = _args(seed_dir, str(tmp_path_factory.mktemp("ref")))
    ref = launch(run_sequence, 1, [seed_args, ref_args], timeout_s=180)[0][1]
    assert len(ref["loss"]) == STEPS and len(ref["val"]) == 2
    assert max(ref["loss"]) - min(ref["loss"]) > 0.05  # training moves the loss
    return ref


PP_VARIANTS = {
    "1F1B": ["--parallelism.pipeline_parallel_schedule", "1F1B"],
    "ZBVZeroBubble": ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
}


@pytest.fixture(scope="module")
def pp_runs(reference, seed_dir, tmp_path_factory) -> dict[str, list[dict[str, list[float]]]]:
    variants = [
        _args(
            seed_dir,
            str(tmp_path_factory.mktemp(name)),
            "--parallelism.pipeline_parallel_degree",
            "2",
            *extra,
        )
        for name, extra in PP_VARIANTS.items()
    ]
    per_rank = launch(run_sequence, 2, variants, timeout_s=240)
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(PP_VARIANTS)}


@pytest.mark.parametrize("name", list(PP_VARIANTS))
def test_trainer_pp2_matches_one_device(name, pp_runs, reference):
    for rank, run in enumerate(pp_runs[name]):  # every pp rank logs the same (last-stage) values
        for key in ("loss", "grad_norm", "val"):
            torch.testing.assert_close(
                run[key], reference[key], **TOL, msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}"
            )
