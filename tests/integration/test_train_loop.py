"""The single-device training loop: accumulation, NaN stop, validation, TensorBoard."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.integration.trainer_utils import built_trainer, run_tiny
from torchtitan.train import TrainingError


def test_loss_falls_and_steps_run(tmp_path):
    trainer = run_tiny(tmp_path, "--training.steps", "12", "--optimizer.lr", "5e-3",
                       "--lr_scheduler.warmup_steps", "1")
    losses = [loss for loss, _ in trainer.history]
    assert len(losses) == 12 and trainer.step == 12
    assert math.isclose(losses[0], math.log(2256), rel_tol=0.1)  # near uniform at init
    assert losses[-1] < losses[0] - 0.5


def test_gradient_accumulation_equals_big_batch(tmp_path):
    """4 microbatches of 2 give the same losses and grad norms as 1 batch of 8."""
    big = run_tiny(tmp_path / "big", "--training.local_batch_size", "8")
    accum = run_tiny(
        tmp_path / "acc", "--training.local_batch_size", "2", "--training.global_batch_size", "8"
    )
    assert accum.gradient_accumulation_steps == 4 and big.gradient_accumulation_steps == 1
    for (l_big, g_big), (l_acc, g_acc) in zip(big.history, accum.history):
        # fp32: only the summation order differs, so agreement is to ~1e-6 relative.
        assert l_acc == pytest.approx(l_big, rel=1e-5)
        assert g_acc == pytest.approx(g_big, rel=1e-4)


def test_global_batch_must_be_multiple(tmp_path):
    from torchtitan.distributed.parallel_dims import ParallelismError

    with pytest.raises(ParallelismError, match="global_batch_size=6 must be a multiple"):
        run_tiny(tmp_path, "--training.local_batch_size", "4", "--training.global_batch_size", "6")


def test_nan_loss_stops_with_step_and_skips_update(tmp_path, monkeypatch):
    """A NaN at step 3 stops the run naming the step, and the weights stay those of step 2."""
    import torchtitan.step as step_module
    from tests.integration.trainer_utils import TINY, RecordingTrainer
    from torchtitan.config.manager import ConfigManager

    cfg = ConfigManager().parse_args([*TINY, "--job.dump_folder", str(tmp_path), "--training.steps", "5"])
    trainer = RecordingTrainer(cfg)
    original = step_module.forward_backward
    before_step_3 = {}

    def poisoned(run, inputs, labels, loss_scale):
        loss = original(run, inputs, labels, loss_scale)
        if trainer.step == 3:
            if not before_step_3:  # gradients exist now; the weights are still step 2's
                before_step_3.update(
                    {k: v.detach().clone() for k, v in run.model_parts[0].state_dict().items()}
                )
            for p in run.model_parts[0].parameters():
                p.grad.fill_(float("nan"))
            return loss * float("nan")
        return loss

    monkeypatch.setattr(step_module, "forward_backward", poisoned)
    try:
        with pytest.raises(
            TrainingError, match=r"loss became nan .* at step 3; the optimizer step was skipped"
        ):
            trainer.train()
        after = trainer.model_parts[0].state_dict()
        assert before_step_3 and set(after) == set(before_step_3)
        for name, value in before_step_3.items():
            assert torch.equal(after[name], value), f"{name} changed by the failed step"
        assert len(trainer.history) == 2  # steps 1 and 2 finished, step 3 did not
    finally:
        trainer.close()


def test_validation_loop(tmp_path, caplog):
    trainer = run_tiny(
        tmp_path, "--validation.enable", "--validation.dataset", "c4_test_validation",
        "--validation.freq", "2", "--validation.steps", "3", "--validation.seq_len", "64",
        "--validation.local_batch_size", "4",
    )
    first = trainer.validator.validate(trainer.model_parts)
    again = trainer.validator.validate(trainer.model_parts)
    assert math.isfinite(first) and first == again  # eval is deterministic and leaves no state
    assert 0 < first < math.log(2256) + 1
    assert all(m.training for m in trainer.model_parts)


@pytest.mark.parametrize("rows, error, message", [
    (None, FileNotFoundError, r"validation dataset: Dataset path .*missing\.jsonl does not exist: "
     r"fix --validation\.dataset_path\.$"),
    ('{"content": "no text field"}\n', ValueError,
     r"validation dataset: Dataset mine has no 'text' column \(columns: \['content'\]\)"),
])
def test_a_bad_validation_dataset_stops_the_build_not_step_freq(tmp_path, rows, error, message):
    """A validation set that cannot be read was found at the first validation, after
    ``validation.freq`` steps of training (by ``python -m torchtitan.train``, which runs no
    launcher pre-flight)."""
    data = tmp_path / "missing.jsonl"
    if rows is not None:
        data.write_text(rows)
    with pytest.raises(error, match=message):
        with built_trainer(tmp_path / "run", "--validation.enable", "--validation.dataset", "mine",
                           "--validation.dataset_path", str(data), "--validation.freq", "2",
                           "--validation.seq_len", "64"):
            pass


def test_the_checkpoint_is_saved_before_the_validation_of_its_step(tmp_path, monkeypatch):
    """A validation that fails (memory, data) loses no trained step: the step saves first."""
    from torchtitan.components.validate import Validator

    def failing(self, model_parts):
        raise RuntimeError("validation ran out of memory")

    monkeypatch.setattr(Validator, "validate", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        run_tiny(tmp_path, "--validation.enable", "--validation.dataset", "c4_test_validation",
                 "--validation.freq", "2", "--validation.seq_len", "64", "--checkpoint.enable",
                 "--checkpoint.interval", "2", "--training.steps", "4")
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2"]


def test_tensorboard_from_trainer(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_tiny(tmp_path, "--metrics.enable_tensorboard", "--training.steps", "3")
    event_files = list(tmp_path.rglob("events.out.tfevents.*"))
    assert len(event_files) == 1
    acc = EventAccumulator(str(event_files[0].parent))
    acc.Reload()
    assert {"loss", "lr", "grad_norm", "tps"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3]


@pytest.mark.parametrize(
    "kw,flags,needle",
    [
        ({}, ["--model.converters", "fp8"], "unknown converter 'fp8'; known: float8, mx"),
    ],
)
def test_planned_features_fail_clearly(kw, flags, needle):
    from torchtitan.config.job_config import Parallelism
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.plan import reject_planned_features

    cfg = ConfigManager().parse_args(flags)
    dims = ParallelDims.from_config(Parallelism(**kw), 2)
    with pytest.raises(ValueError, match=needle):
        reject_planned_features(cfg, dims)


@pytest.mark.parametrize(
    "degrees, world, seq_len, needle",
    [
        (dict(context_parallel_degree=2), 2, 66,
         r"training.seq_len=66 must be divisible by 4 \(tp=1 for sequence parallel, 2\*cp=4 "
         r"for context parallel load balancing\)"),
        (dict(context_parallel_degree=2, tensor_parallel_degree=2), 4, 36,
         r"training.seq_len=36 must be divisible by 8"),
        (dict(context_parallel_degree=3), 4, 64, r"world size 4 is not divisible by"),
    ],
)
def test_context_parallel_layout_errors(degrees, world, seq_len, needle):
    from torchtitan.config.job_config import Parallelism
    from torchtitan.distributed.parallel_dims import ParallelDims

    with pytest.raises(ValueError, match=needle):
        dims = ParallelDims.from_config(Parallelism(**degrees), world)
        dims.validate_for_model(n_heads=4, n_kv_heads=2, n_layers=2, seq_len=seq_len)


@pytest.mark.parametrize(
    "degrees, world, needle",
    [
        (dict(expert_parallel_degree=3), 4, r"expert_parallel_degree=3 must divide data_parallel_shard_degree=4"),
        (dict(expert_parallel_degree=8, context_parallel_degree=2), 4,
         r"expert_parallel_degree=8 must divide data_parallel_shard_degree\*context_parallel_"
         r"degree = 2\*2 = 4 \(expert-parallel ranks are borrowed from the ranks with "
         r"different tokens\): 2, 4 fit here$"),
        (dict(expert_tensor_parallel_degree=3, tensor_parallel_degree=4), 4,
         r"^parallelism.expert_tensor_parallel_degree=3 must divide parallelism.tensor_parallel_"
         r"degree=4 \(the TP ranks form tp/etp groups that route their own MoE tokens, each "
         r"expert split over the etp ranks of a group; 1 keeps experts whole\): 1, 2, 4 fit here$"),
        # expert_tensor_parallel_degree 1: the TP ranks split the MoE tokens and join ep
        (dict(expert_parallel_degree=2, tensor_parallel_degree=4), 8,
         r"^parallelism.expert_parallel_degree=2 must be a multiple of tensor_parallel_degree=4 "
         r"that divides 4 x data_parallel_shard_degree=2 \(with expert_tensor_parallel_degree=1 "
         r"the TP ranks split the MoE tokens and join one ep group\): 4, 8 fit here; or set "
         r"expert_tensor_parallel_degree=2 or 4 \(the TP ranks split the MoE tokens 2 ways and "
         r"each expert 2 ways; the TP ranks share their tokens and split each expert\)$"),
        (dict(expert_parallel_degree=4, tensor_parallel_degree=2, expert_tensor_parallel_degree=2),
         4, r"expert_parallel_degree=4 must divide data_parallel_shard_degree=2 .*with "
         r"expert_tensor_parallel_degree=2 the TP ranks share their tokens and split each expert"),
    ],
)
def test_expert_parallel_layout_errors(degrees, world, needle):
    from torchtitan.config.job_config import Parallelism
    from torchtitan.distributed.parallel_dims import ParallelDims

    with pytest.raises(ValueError, match=needle):
        ParallelDims.from_config(Parallelism(**degrees), world)


@pytest.mark.parametrize("degrees, rank, ep_ranks, mod_ep_ranks", [
    # world ranks (pp, dp_replicate, dp_shard, cp, tp), tp innermost
    (dict(expert_parallel_degree=8, tensor_parallel_degree=2), 5, range(8), [5]),
    (dict(expert_parallel_degree=2, tensor_parallel_degree=2, data_parallel_shard_degree=1,
          data_parallel_replicate_degree=4), 5, [4, 5], [5]),  # ep = the TP ranks
    (dict(expert_parallel_degree=4, tensor_parallel_degree=2, context_parallel_degree=2,
          data_parallel_shard_degree=2), 5, [4, 5, 6, 7], [1, 5]),  # ep = tp x cp
    (dict(expert_parallel_degree=2, tensor_parallel_degree=2, data_parallel_shard_degree=4),
     5, [4, 5], [1, 3, 5, 7]),  # experts FSDP-sharded over the dp_shard ranks
    # expert TP: ep from dp_shard alone, the TP ranks share their tokens
    (dict(expert_parallel_degree=2, tensor_parallel_degree=2, expert_tensor_parallel_degree=2,
          data_parallel_shard_degree=4), 5, [5, 7], [1, 5]),
    # 2 of the 4 TP ranks split each expert (etp: consecutive tp ranks), the 2 token groups
    # join ep with dp_shard: the rank's etp peers are 4, 5 and its token-group peers 5, 7
    (dict(expert_parallel_degree=4, tensor_parallel_degree=4, expert_tensor_parallel_degree=2,
          data_parallel_shard_degree=2), 5, [1, 3, 5, 7], [5]),
])
def test_expert_parallel_borrows_the_tp_ranks_that_split_the_moe_tokens(
    degrees, rank, ep_ranks, mod_ep_ranks
):
    import torch.distributed as dist

    from torchtitan.config.job_config import Parallelism
    from torchtitan.distributed.comm_mode.fake_backend import init_fake_process_group
    from torchtitan.distributed.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(Parallelism(**degrees), 8)
    assert dims.tp_splits_moe_tokens == (dims.etp < dims.tp)
    init_fake_process_group(8, rank)
    try:
        dims.build_mesh("cpu")
        assert dims.get_mesh("ep").mesh.flatten().tolist() == list(ep_ranks)
        assert dims.get_mesh("dp_shard_mod_ep").mesh.flatten().tolist() == list(mod_ep_ranks)
        if 1 < dims.etp < dims.tp:
            assert dims.get_mesh("etp").mesh.tolist() == [4, 5]
            assert dims.get_mesh("tp_tokens").mesh.tolist() == [5, 7]
            assert dims.get_mesh("ep_etp").mesh.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    finally:
        dist.destroy_process_group()


def test_context_parallel_refuses_settings_it_cannot_honour():
    from torchtitan.config.manager import ConfigManager
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.plan import check_context_parallel

    cfg = ConfigManager().parse_args(["--validation.enable", "--validation.seq_len", "128"])
    args = llama3_args["debugmodel"]
    with pytest.raises(ValueError, match=r"validation.seq_len=128 must equal training.seq_len=2048"):
        check_context_parallel(cfg, args, 2)
    cfg.validation.seq_len = cfg.training.seq_len
    check_context_parallel(cfg, args, 2)
    cfg.parallelism.context_parallel_rotate_method = "alltoall"
    check_context_parallel(cfg, args, 2)  # ring attention passes blocks one hop at a time
    for masked in (dict(attn_mask_type="block_causal"), dict(sliding_window_size=64),
                   dict(use_flex_attn=True)):
        with pytest.raises(ValueError, match=r"rotate_method=alltoall passes key/value blocks "
                                             r"around a ring.*use allgather \(the default\)"):
            check_context_parallel(cfg, dataclasses.replace(args, **masked), 2)


def test_bfloat16_training_dtype(tmp_path):
    trainer = run_tiny(tmp_path, "--training.dtype", "bfloat16", "--training.steps", "6",
                       "--optimizer.lr", "5e-3", "--lr_scheduler.warmup_steps", "1")
    params = list(trainer.model_parts[0].parameters())
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert trainer.model_parts[0].freqs_cis.is_complex()  # RoPE table survives the cast
    losses = [loss for loss, _ in trainer.history]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_save_config_file_written_and_round_trips(tmp_path):
    from torchtitan.config.manager import ConfigManager

    trainer = run_tiny(tmp_path, "--job.save_config_file", "resolved.toml", "--training.steps", "1")
    saved = tmp_path / "resolved.toml"
    assert saved.is_file()
    again = ConfigManager().parse_args(["--job.config_file", str(saved)])
    again.job.config_file = trainer.job_config.job.config_file
    assert again == trainer.job_config


def test_a_resume_at_or_past_the_last_step_says_nothing_is_trained(tmp_path, caplog):
    """A finished job started again (or training.steps lowered below the checkpoint) used to
    log "Training starts at step 5" and end without a word about why nothing ran."""
    import logging

    run_tiny(tmp_path, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2")
    for steps in ("2", "1"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="torchtitan"):
            again = run_tiny(tmp_path, "--training.steps", steps, "--checkpoint.enable")
        assert again.history == [] and again.step == 2
        assert (f"Nothing to train: the checkpoint loaded is at step 2 and training.steps={steps}; "
                "raise --training.steps to train on") in caplog.text
        assert "Training starts" not in caplog.text


def test_a_resume_under_another_lr_schedule_says_how_the_lr_changed(tmp_path, caplog):
    """Extending a finished run (training.steps 4 -> 8) recomputes the decay: the LR jumps from
    the end of the old decay back up. It used to do so in silence."""
    import logging

    flags = ["--checkpoint.enable", "--checkpoint.interval", "2", "--lr_scheduler.warmup_steps",
             "1", "--lr_scheduler.decay_ratio", "0.5"]
    run_tiny(tmp_path, "--training.steps", "4", *flags)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        run_tiny(tmp_path / "same", "--training.steps", "4", *flags)  # a fresh run: no line
        run_tiny(tmp_path, "--training.steps", "4", "--checkpoint.load_step", "2", *flags)
        assert "LR schedule" not in caplog.text  # the same schedule at step 2
        run_tiny(tmp_path, "--training.steps", "8", *flags)
    (line,) = [r.getMessage() for r in caplog.records if "LR schedule" in r.getMessage()]
    assert line == (
        "Checkpoint: this config's LR schedule is not the one step-4 was trained with "
        "(training.steps or [lr_scheduler] changed): the LR was 0 after step 4 and is 0.0008 "
        "now; training goes on with this config's schedule"
    )
