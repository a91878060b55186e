"""Per-block torch.compile: structure, config errors, and one numeric check against eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from torchtitan.config.job_config import ActivationCheckpoint, Compile
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile, model_compile_enabled
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model import Transformer

SEQ, VOCAB, STEPS = 32, 256, 5
pytestmark = pytest.mark.usefixtures("one_thread")


def _model() -> Transformer:
    args = copy.deepcopy(llama3_args["debugmodel_tiny"])
    args.vocab_size, args.max_seq_len = VOCAB, SEQ
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model


def _train(model: torch.nn.Module) -> tuple[list[float], list[float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses, norms = [], []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        losses.append(loss.item())
    return losses, norms


def test_apply_compile_wraps_each_block():
    model = _model()
    blocks = dict(model.layers.items())
    apply_compile(model, Compile(enable=True, backend="eager"))
    assert list(model.layers) == list(blocks)
    for layer_id, block in model.layers.items():
        assert isinstance(block, torch._dynamo.eval_frame.OptimizedModule)
        assert block._orig_mod is blocks[layer_id]
    # DCP's state-dict API (used by checkpointing) reports the original FQNs
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    assert set(get_model_state_dict(model)) == set(_model().state_dict())


def test_compile_components():
    assert model_compile_enabled(Compile(enable=True, components=["model", "loss"]))
    assert not model_compile_enabled(Compile(enable=True, components=["loss"]))
    assert not model_compile_enabled(Compile(enable=False))
    with pytest.raises(ValueError, match="compile.components has unknown entries \\['modle'\\]"):
        model_compile_enabled(Compile(enable=True, components=["modle"]))


@pytest.mark.slow
def test_compiled_op_sac_matches_eager():
    """Inductor-compiled blocks with op-level SAC (the GPU production setup) vs plain eager.

    One test covers compile and its composition with AC (a cold inductor compile costs ~10-20 s
    on 2 CPU cores). Tolerance 1e-5: inductor fuses and reorders fp32 reductions (RMSNorm,
    softmax), moving results by ~1e-7 relative per op.
    """
    from torch._dynamo.utils import counters

    eager_losses, eager_norms = _train(_model())
    counters.clear()
    model = apply_ac(_model(), ActivationCheckpoint(mode="selective", selective_ac_option="op"))
    apply_compile(model, Compile(enable=True, backend="inductor"))
    losses, norms = _train(model)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norms, eager_norms, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks really ran compiled
