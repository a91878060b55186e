"""The data stream resumes across data-parallel degrees: save at FSDP2 after 2 steps, resume at
one rank and at FSDP4; the sequences read before + after are those of the run that never
stopped, none twice, none missed.

Real Trainers in launched gloo ranks, real dataloader and a DCP checkpoint (the stream position
is one value all ranks save; DCP stores it once). The global batch stays 8 sequences: 2 ranks x
4, then 1 rank x 4 x 2 accumulation steps, or 4 ranks x 2. Every document is a run of
increasing numbers, so no two sequences are equal and the rows themselves show what was read.
The model trains with ``--model.attn_mask_type block_causal`` (the trainer path of document
masking under FSDP).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import launch

pytestmark = [
    pytest.mark.slow,  # 2- and 4-rank gloo launches
    pytest.mark.usefixtures("one_thread"),  # the in-process one-rank resume, as the workers
]

STEPS_BEFORE, STEPS_AFTER, GLOBAL_BATCH, SEQ_LEN = 2, 2, 8, 32


def _args(root: str, data: str, dump: str, local_batch: int, steps: int) -> list[str]:
    return [
        "--job.config_file", "train_configs/debug_model.toml",
        "--job.dump_folder", str(Path(root) / dump),
        "--model.flavor", "debugmodel_tiny",
        "--model.attn_mask_type", "block_causal",
        "--training.dataset", "numbers", "--training.dataset_path", data,
        "--training.seq_len", str(SEQ_LEN),
        "--training.local_batch_size", str(local_batch),
        "--training.global_batch_size", str(GLOBAL_BATCH),
        "--training.steps", str(steps),
        "--activation_checkpoint.mode", "none",
        "--checkpoint.enable", "--checkpoint.interval", "1000",
        "--metrics.log_freq", "100",
    ]


def _recorded(batches, rows: list[list[int]]):
    for x, y in batches:
        rows.extend(torch.cat([x, y[:, -1:]], dim=1).tolist())
        yield x, y


def train_recording(runs: list[tuple[list[str], int | None, bool]]) -> list[list[list[int]]]:
    """Worker: each ``(argv, load_step, save)`` in turn; the rows (inputs + last label) this
    rank read, per run."""
    from torchtitan.config.manager import ConfigManager
    from torchtitan.train import Trainer

    out = []
    for argv, load_step, save in runs:
        trainer = Trainer(ConfigManager().parse_args(argv))
        rows: list[list[int]] = []
        try:
            if load_step is not None:
                assert trainer.checkpointer.load(step=load_step)

            iterator = _recorded(iter(trainer.dataloader), rows)
            while trainer.step < trainer.job_config.training.steps:
                trainer.step += 1
                trainer.train_step(iterator)
            if save:
                trainer.checkpointer.save(trainer.step, force=True)
        finally:
            trainer.close()
        out.append(rows)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("numbers") / "numbers.jsonl"
    docs, n = [], 0
    for i in range(300):
        length = 3 + (i * 7) % 23
        docs.append(" ".join(str(n + k) for k in range(length)))
        n += length
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def test_save_at_fsdp2_resume_at_one_and_four_ranks(tmp_path, data):
    root, total = str(tmp_path), STEPS_BEFORE + STEPS_AFTER
    two = launch(train_recording, 2, [
        (_args(root, data, "straight", 4, total), None, False),
        (_args(root, data, "saved", 4, STEPS_BEFORE), None, True),
    ], timeout_s=240)
    uninterrupted = [row for rank in two for row in rank[0]]
    before = [row for rank in two for row in rank[1]]
    assert len(uninterrupted) == total * GLOBAL_BATCH and len(before) == STEPS_BEFORE * GLOBAL_BATCH
    saved = str(tmp_path / "saved")
    after = {1: train_recording([(_args(root, data, "saved", 4, total), STEPS_BEFORE, False)])[0]}
    four = launch(train_recording, 4, [(_args(root, data, "saved", 2, total), STEPS_BEFORE, False)],
                  timeout_s=240)
    after[4] = [row for rank in four for row in rank[0]]
    assert Path(saved, "checkpoint", f"step-{STEPS_BEFORE}").is_dir()
    for world, rows in after.items():
        assert len(rows) == STEPS_AFTER * GLOBAL_BATCH, world
        consumed = before + rows
        assert len({tuple(r) for r in consumed}) == len(consumed), f"a sequence twice at dp {world}"
        assert sorted(consumed) == sorted(uninterrupted), f"dp 2 -> {world}: not the same sequences"
    # and the steps after the resume read what the uninterrupted run read in those steps
    per_rank_before = STEPS_BEFORE * GLOBAL_BATCH // 2
    last_steps = sorted(row for rank in two for row in rank[0][per_rank_before:])
    assert sorted(after[1]) == sorted(after[4]) == last_steps
