"""A non-finite step says where: weights that were already non-finite (named), a forward that
produced it from finite weights, or a backward that made gradients non-finite (the parameter
nearest the output named); across ranks, a bad shard on another rank is named too."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.integration.trainer_utils import built_trainer
from tests.trainer_hooks import train_step_hook
from torchtitan.train import TrainingError


def _error_of(trainer) -> str:
    with pytest.raises(TrainingError) as info:
        trainer.train()
    return str(info.value)


def test_a_non_finite_weight_is_named(tmp_path):
    with built_trainer(tmp_path) as trainer:
        with torch.no_grad():
            trainer.model_parts[0].layers["1"].feed_forward.w2.weight[0, 0] = float("nan")
        message = _error_of(trainer)
    assert ("at step 1; the optimizer step was skipped. The weights were already non-finite "
            "before this step: 1 of 21 parameters (layers.1.feed_forward.w2.weight).") in message


def test_a_forward_from_finite_weights_is_told_apart(tmp_path):
    with built_trainer(tmp_path) as trainer:
        trainer.model_parts[0].layers["0"].register_forward_hook(
            lambda module, args, out: out * float("nan"))
        message = _error_of(trainer)
    assert "loss became nan" in message
    assert "The weights were finite, so the forward pass produced it" in message


@pytest.mark.parametrize("flags", [
    [], ["--training.global_batch_size", "8", "--training.local_batch_size", "4"]])
def test_a_forward_overflow_is_located_by_a_re_run(tmp_path, flags):
    """A linear whose output overflows (as an fp16 / bf16 overflow looks: an inf out of a
    finite layer) inside a block: the re-run of the step's batch (eager, hooks on every
    module) names that linear, not the block or a later layer that only passed the inf on."""
    with built_trainer(tmp_path, *flags) as trainer:
        trainer.model_parts[0].layers["1"].feed_forward.w2.register_forward_hook(
            lambda module, args, out: out * float("inf"))
        message = _error_of(trainer)
    n = 2 if "--training.global_batch_size" in flags else 1
    assert ("The weights were finite, so the forward pass produced it (an overflow or bad "
            "input). Re-run on the same batch, the first non-finite value comes out of "
            f"layers.1.feed_forward.w2 (microbatch 1 of {n}).") in message, message


def test_a_non_finite_buffer_the_model_passes_on_names_the_models_own_code(tmp_path):
    """A NaN in the RoPE table (a buffer: no weight check sees it) reaches every block as an
    argument: the model's own code, before its first block, is named (not the ModuleDict)."""
    with built_trainer(tmp_path) as trainer:
        with torch.no_grad():
            trainer.model_parts[0].freqs_cis[3] = float("nan")
        message = _error_of(trainer)
    assert ("The weights were finite, so the forward pass produced it (an overflow or bad "
            "input). Re-run on the same batch, the first non-finite value comes out of the model "
            "(its own code, before layers.0) (microbatch 1 of 1).") in message, message


@pytest.mark.slow  # inductor compiles the blocks
def test_a_functional_op_inside_a_compiled_checkpointed_block_is_located(tmp_path, monkeypatch):
    """The activation between two linears overflows inside compiled, checkpointed blocks: the
    re-run runs them eagerly, and the linear that received the inf names its parent's own
    code before it."""
    import torch.nn.functional as F

    silu = F.silu
    monkeypatch.setattr(F, "silu", lambda x, *a, **k: silu(x, *a, **k) * float("inf"))
    with built_trainer(tmp_path, "--compile.enable", "--activation_checkpoint.mode",
                       "full") as trainer:
        message = _error_of(trainer)
    assert ("Re-run on the same batch, the first non-finite value comes out of "
            "layers.0.feed_forward (its own code, before layers.0.feed_forward.w2) "
            "(microbatch 1 of 1).") in message, message


@pytest.mark.parametrize("copies", ["off", "on"])
def test_a_backward_that_went_wrong_names_the_parameter_nearest_the_output(tmp_path, copies):
    """A gradient made infinite where it enters layer 1's feed-forward: every parameter before
    it gets a non-finite gradient, the finite loss says the backward did it (with weight
    copies, their gradients are the copies')."""
    flags = ["--training.mixed_precision_param", "bfloat16", "--training.weight_copies", copies]
    with built_trainer(tmp_path, *flags) as trainer:
        assert (trainer.run.weight_copies is not None) == (copies == "on")
        trainer.model_parts[0].layers["1"].feed_forward.register_full_backward_pre_hook(
            lambda module, grad_out: (grad_out[0] * float("inf"),))
        message = _error_of(trainer)
    assert "(grad norm nan) at step 1" in message and "loss became nan" not in message
    assert ("The loss was finite; the backward made the gradients of 19 of 21 parameters "
            "(tok_embeddings.weight, layers.0.attention_norm.weight, layers.0.attention.wq.weight,"
            " ...) non-finite, nearest the output (in model order) "
            "layers.1.feed_forward.w3.weight: the backward went wrong there or just after it."
            ) in message


def test_gradients_rescaled_by_a_non_finite_norm_are_not_used_to_locate(tmp_path):
    """Clipping by rescaling every gradient (optimizer.no_clip_in_step) multiplies them all by
    the non-finite norm: the line says so instead of naming the output head."""
    with built_trainer(tmp_path, "--optimizer.no_clip_in_step") as trainer:
        trainer.model_parts[0].layers["1"].feed_forward.register_full_backward_pre_hook(
            lambda module, grad_out: (grad_out[0] * float("inf"),))
        message = _error_of(trainer)
    assert ("The loss was finite; the backward made the grad norm non-finite, and clipping "
            "rescaled every gradient by it, so they cannot say where") in message, message


NAN_ON_RANK_1 = train_step_hook(
    """
    if self.step == 1 and self.rank == 1:  # only rank 1's shard of the weight
        weight = self.model_parts[0].layers["1"].feed_forward.w2.weight
        with torch.no_grad():
            weight.to_local()[0, 0] = float("nan")
    return _orig(self, data_iterator)
    """,
    imports="import torch",
)


@pytest.mark.slow
def test_a_non_finite_shard_on_another_rank_is_named_on_the_console(tmp_path, cpu_env):
    (tmp_path / "nan_on_rank1.py").write_text(NAN_ON_RANK_1)
    env = {**cpu_env, "NGPU": "2", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}"}
    proc = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(tmp_path / "out"), "--model.flavor",
         "debugmodel_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
         "--training.steps", "2", "--parallelism.data_parallel_shard_degree", "2",
         "--comm.init_timeout_seconds", "60", "--comm.train_timeout_seconds", "30",
         "--experimental.custom_import", "nan_on_rank1"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    errors = [ln for ln in out.splitlines() if "error: " in ln]
    assert errors and ("The weights were already non-finite before this step: 1 of 21 "
                       "parameters (layers.1.feed_forward.w2.weight)") in errors[0], out[-3000:]
