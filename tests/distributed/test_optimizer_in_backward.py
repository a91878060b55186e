"""``optimizer.early_step_in_backward`` through ``Trainer.train_step`` equals the usual step.

From one seed checkpoint, no clipping (``max_norm 0``, which stepping in backward needs), the
fixed global batches of trainer_runs.py:
* one rank, 2 microbatches of gradient accumulation: the usual optimizer step, and stepping in
  backward (only the last microbatch's backward steps);
* FSDP2 on 2 ranks stepping in backward (the hooks run on the sharded gradients after the
  reduce-scatter), checkpointed at step 2, then resumed with the usual optimizer: the
  optimizer state keys are the same, so the resumed steps equal the uninterrupted ones.
Losses and grad norms (measured by the hooks) agree within 1e-5 (fp32 reduction order).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import launch
from tests.distributed.trainer_runs import (
    BASE_ARGS,
    STEPS,
    from_seed,
    resume_args,
    run_sequence,
    seed_args,
)

pytestmark = pytest.mark.slow  # launches gloo ranks

TOL = dict(rtol=1e-5, atol=1e-5)
NO_CLIP = ["--training.max_norm", "0"]
EARLY = [*NO_CLIP, "--optimizer.early_step_in_backward"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, list[float]]]:
    root = tmp_path_factory.mktemp("early_step")
    seed_dir = str(root / "seed" / "checkpoint" / "step-0")
    one = launch(run_sequence, 1, [
        seed_args(str(root / "seed")),
        from_seed(seed_dir, str(root / "usual"), *NO_CLIP),
        from_seed(seed_dir, str(root / "early"), *EARLY),
    ], timeout_s=180)[0]
    saved = str(root / "fsdp2")
    two = launch(run_sequence, 2, [
        [*BASE_ARGS, "--job.dump_folder", saved, "--checkpoint.enable",
         "--checkpoint.initial_load_path", seed_dir, "--checkpoint.interval", "2", *EARLY,
         "--parallelism.data_parallel_shard_degree", "2"],
        resume_args(saved, 2, *NO_CLIP, "--parallelism.data_parallel_shard_degree", "2"),
    ], timeout_s=240)[0]
    return {"usual": one[1], "early": one[2], "fsdp2_early": two[0], "resumed_usual": two[1]}


@pytest.mark.parametrize("name", ["early", "fsdp2_early"])
def test_stepping_in_backward_equals_the_usual_step(runs, name):
    reference = runs["usual"]
    assert runs["early"]["accumulation"] == [2] and runs["fsdp2_early"]["accumulation"] == [1]
    assert len(reference["loss"]) == STEPS and reference["loss"][-1] < reference["loss"][0]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(runs[name][key], reference[key], **TOL, msg=key)


def test_its_checkpoint_resumes_with_the_usual_optimizer(runs):
    resumed = runs["resumed_usual"]
    assert resumed["first_step"] == [3]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(resumed[key], runs["usual"][key][2:], **TOL, msg=key)
