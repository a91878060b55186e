"""Pipeline parallelism with tied input/output embeddings equals the unsplit model (gloo ranks).

The Qwen3 debug model ties ``tok_embeddings.weight`` and ``output.weight``; the pipeline puts
them in the first and the last stage, each with its own copy. From one seed checkpoint and
the same global batches (tests/distributed/trainer_runs.py), PP2 with 1F1B (copies on two
ranks), PP2 with ZBVZeroBubble (both copies on rank 0), PP2 x FSDP2 and PP2 x TP2 must give the
one-device run's per-step losses (rtol 1e-5) and grad norms (rtol 1e-4): the copies' gradients
are summed into both, the norm counts the matrix once. Without the sum the losses differ from
step 2; counting both copies raises the grad norm by ~10 %. Checkpoints cross in both
directions (one device -> PP2 needs the output copy's optimizer state under the embedding's
name), a Hugging Face export (which holds the embedding only) loads into both copies, and a
fresh PP2 run (no seed checkpoint: stages initialise with different seeds) saves two equal
copies.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.distributed.launcher import launch
from tests.distributed.trainer_runs import (
    BASE_ARGS,
    NORM_TOL,
    STEPS,
    TOL,
    from_seed,
    resume_args,
    run_sequence,
    seed_args,
)

pytestmark = pytest.mark.slow  # launches gloo ranks

TIED = ["--model.name", "qwen3", "--model.flavor", "debugmodel"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
LOAD_ONLY = ["--checkpoint.load_only"]  # a resumed run leaves the folder it resumed from as it was


def _schedule(name: str) -> list[str]:
    return ["--parallelism.pipeline_parallel_schedule", name]


TWO_RANKS = {
    "pp2_1f1b": [*PP2, *_schedule("1F1B")],
    "pp2_zbv": [*PP2, *_schedule("ZBVZeroBubble")],
}
FOUR_RANKS = {
    "pp2_fsdp2": [*PP2, *_schedule("Interleaved1F1B"),
                  "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"],
    "pp2_tp2": [*PP2, *_schedule("1F1B"), "--parallelism.tensor_parallel_degree", "2"],
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tied")


@pytest.fixture(scope="module")
def runs(root) -> dict[str, list[dict[str, list[float]]]]:
    seed_dir = str(root / "seed" / "checkpoint" / "step-0")

    def saving(name: str, *flags: str) -> list[str]:  # from the seed, saving at step 2
        return [*BASE_ARGS, *TIED, *flags, "--job.dump_folder", str(root / name),
                "--checkpoint.enable", "--checkpoint.initial_load_path", seed_dir,
                "--checkpoint.interval", "2"]

    def from_hf(name: str, *flags: str) -> list[str]:  # one_saved's final HF export
        hf = str(root / "one_saved" / "checkpoint" / f"step-{STEPS}" / "hf")
        return [*BASE_ARGS, *TIED, *flags, "--job.dump_folder", str(root / name),
                "--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.initial_load_path",
                hf, "--checkpoint.initial_load_in_hf"]

    out: dict[str, list[dict[str, list[float]]]] = {}
    for world, first, layouts in (
        (1, [[*seed_args(str(root / "seed")), *TIED]],
         {"one": from_seed(seed_dir, str(root / "one"), *TIED),
          "one_saved": [*saving("one_saved"), "--checkpoint.last_save_in_hf"]}),
        (2, [], {**{name: from_seed(seed_dir, str(root / name), *TIED, *flags)
                    for name, flags in TWO_RANKS.items()},
                 "pp2_saved": saving("pp2_saved", *TWO_RANKS["pp2_1f1b"]),
                 "pp2_from_one": resume_args(str(root / "one_saved"), 2, *TIED,
                                             *TWO_RANKS["pp2_1f1b"], *LOAD_ONLY),
                 "pp2_from_hf": from_hf("pp2_from_hf", *TWO_RANKS["pp2_1f1b"])}),
        (4, [], {name: from_seed(seed_dir, str(root / name), *TIED, *flags)
                 for name, flags in FOUR_RANKS.items()}),
        (1, [], {"one_from_pp2": resume_args(str(root / "pp2_saved"), 2, *TIED, *LOAD_ONLY),
                 "one_from_hf": from_hf("one_from_hf")}),
    ):
        per_rank = launch(run_sequence, world, [*first, *layouts.values()], timeout_s=400)
        for i, name in enumerate(layouts):
            out[name] = [rank[len(first) + i] for rank in per_rank]
    return out


@pytest.mark.parametrize("layout", [*TWO_RANKS, *FOUR_RANKS])
def test_pipeline_with_tied_embeddings_matches_one_device(layout, runs):
    expected = runs["one"][0]
    assert len(expected["loss"]) == STEPS and expected["loss"][-1] < expected["loss"][0]
    for rank in runs[layout]:
        torch.testing.assert_close(rank["loss"], expected["loss"], **TOL)
        torch.testing.assert_close(rank["grad_norm"], expected["grad_norm"], **NORM_TOL)


@pytest.mark.parametrize("resumed, uninterrupted", [("pp2_from_one", "one_saved"),
                                                    ("one_from_pp2", "pp2_saved")])
def test_checkpoints_cross_between_pipeline_and_one_device(resumed, uninterrupted, runs):
    assert runs[resumed][0]["first_step"] == [3]
    expected = runs[uninterrupted][0]
    torch.testing.assert_close(runs[resumed][0]["loss"], expected["loss"][2:], **TOL)
    torch.testing.assert_close(runs[resumed][0]["grad_norm"], expected["grad_norm"][2:], **NORM_TOL)


def test_pipeline_loads_a_tied_hf_export_like_one_device(runs):
    """The HF folder holds ``embed_tokens`` only (HF ties ``lm_head`` to it): the output copy
    of the last stage must get it too."""
    expected = runs["one_from_hf"][0]
    assert expected["loss"][0] < runs["one"][0]["loss"][0] - 1  # trained weights were loaded
    # From these trained weights lr 1e-2 overshoots (the loss rises), which amplifies the
    # layouts' fp32 reordering noise to 1e-4 by step 4: the first two steps show the weights.
    for rank in runs["pp2_from_hf"]:
        torch.testing.assert_close(rank["loss"][:2], expected["loss"][:2], **TOL)
        torch.testing.assert_close(rank["grad_norm"][:2], expected["grad_norm"][:2], **NORM_TOL)


def _load_dcp(step_dir: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = step_dir.parent.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, target)
    return torch.load(target, weights_only=False)


def test_pipeline_checkpoint_keeps_one_optimizer_state_for_the_tied_matrix(root, runs):
    state = _load_dcp(root / "pp2_saved" / "checkpoint" / "step-2")  # model keys at the top
    assert torch.equal(state["tok_embeddings.weight"], state["output.weight"])
    optimizer = state["optimizer"]
    assert "state.tok_embeddings.weight.exp_avg" in optimizer, sorted(optimizer)[:20]
    assert not [k for k in optimizer if "output.weight" in k]


def test_fresh_pipeline_run_starts_with_equal_copies(tmp_path):
    env = dict(os.environ, NGPU="2", CONFIG_FILE="train_configs/qwen3_debugmodel.toml")
    env.pop("COMM_MODE", None)
    proc = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(tmp_path), *PP2, "--training.seq_len", "64",
         "--training.steps", "1", "--checkpoint.enable", "--checkpoint.interval", "1",
         "--optimizer.lr", "0"],  # no update: the saved copies are the initial ones
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    state = _load_dcp(tmp_path / "checkpoint" / "step-1")
    assert torch.equal(state["tok_embeddings.weight"], state["output.weight"])
