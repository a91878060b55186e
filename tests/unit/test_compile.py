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


def test_whole_block_ac_is_compiled_inside_its_checkpoint_and_still_recomputes():
    """Full AC: the checkpoint wrapper stays eager around the compiled block (a compiled
    checkpoint region fails under TP), and backward runs each block's forward again. Op-level
    SAC is compiled together with its block (its policy sees the traced ops)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    model = apply_ac(_model(), ActivationCheckpoint(mode="full"))
    calls: list[str] = []
    for layer_id, block in model.layers.items():
        block._checkpoint_wrapped_module.feed_forward.register_forward_pre_hook(
            lambda *_, i=layer_id: calls.append(i)
        )
    apply_compile(model, Compile(enable=True, backend="aot_eager"))
    for block in model.layers.values():
        assert isinstance(block, CheckpointWrapper)
        assert block._checkpoint_wrapped_module._compiled_call_impl is not None  # in place
    assert set(model.state_dict()) == set(_model().state_dict())  # FQNs unchanged
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    loss = model(tokens).sum()
    forward_calls = len(calls)
    loss.backward()
    assert len(calls) == 2 * forward_calls  # recomputed in backward
    torch._dynamo.reset()

    sac = apply_ac(_model(), ActivationCheckpoint(mode="selective", selective_ac_option="op"))
    apply_compile(sac, Compile(enable=True, backend="eager"))
    assert all(isinstance(b, torch._dynamo.eval_frame.OptimizedModule) for b in sac.layers.values())


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


# --- activation_checkpoint.mode = "memory_budget" --------------------------------------------
def _saved_bytes_and_grads(budget: float) -> tuple[int, float, list[torch.Tensor]]:
    """Bytes saved for backward by one step of the compiled model (aot_eager, which partitions
    with the same min-cut partitioner as inductor), its loss and gradients."""
    import torch._functorch.config as functorch_config

    # torch's own patch restores the setting; pytest's monkeypatch would delete it (torch
    # config modules keep values outside __dict__), hiding it from every later compile.
    with functorch_config.patch(activation_memory_budget=1.0):
        return _compile_and_measure(budget)


def _compile_and_measure(budget: float) -> tuple[int, float, list[torch.Tensor]]:
    from torchtitan.distributed.activation_checkpoint import apply_memory_budget

    torch._dynamo.reset()
    cfg = ActivationCheckpoint(mode="memory_budget", memory_budget=budget)
    model = apply_ac(_model(), cfg)
    assert not any("checkpoint" in type(m).__name__.lower() for m in model.modules())
    apply_memory_budget(cfg, dump_folder="unused")
    apply_compile(model, Compile(enable=True, backend="aot_eager"))
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    torch._dynamo.reset()
    return sum(saved), loss.item(), [p.grad for p in model.parameters()]


def test_memory_budget_trades_saved_activations_for_recompute():
    """Budget 0 keeps fewer activations than 0.5, which keeps fewer than 1 (compile's default);
    the numbers do not change."""
    full, loss, grads = _saved_bytes_and_grads(1.0)
    half, loss_half, _ = _saved_bytes_and_grads(0.5)
    least, loss_least, grads_least = _saved_bytes_and_grads(0.0)
    assert least < half < full, (least, half, full)  # measured 0.53 / 0.81 / 1.09 MB
    assert loss_least == loss_half == loss
    for a, b in zip(grads, grads_least):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--activation_checkpoint.mode", "memory_budget"],
         "activation_checkpoint.mode='memory_budget' is carried out by torch.compile's "
         "partitioner: add --compile.enable (with 'model' in compile.components)"),
        (["--activation_checkpoint.mode", "memory_budget", "--compile.enable",
          "--compile.backend", "eager"],
         "activation_checkpoint.mode='memory_budget' needs a compile.backend that partitions the "
         "forward and backward graphs (inductor, aot_eager); 'eager' does not"),
        (["--activation_checkpoint.mode", "memory_budget", "--compile.enable",
          "--parallelism.tensor_parallel_degree", "2"],
         "activation_checkpoint.mode='memory_budget' does not work with tensor parallel: its "
         "collectives put process-group objects in the compiled blocks, which torch.compile's "
         "memory-budget partitioner cannot size (torch 2.13); use mode 'full' or 'selective'"),
    ],
)
def test_memory_budget_needs_a_partitioning_compile(flags, message):
    from torchtitan.config import ConfigError, ConfigManager
    from torchtitan.config.validation import validate

    with pytest.raises(ConfigError) as info:
        validate(ConfigManager().parse_args(flags))
    assert str(info.value) == message


def test_pareto_plots_need_matplotlib_or_write_svgs(tmp_path, request):
    import importlib.util

    import torch._functorch.config as functorch_config

    from torchtitan.distributed.activation_checkpoint import apply_memory_budget

    cfg = ActivationCheckpoint(mode="memory_budget", visualize_memory_budget_pareto=True)
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(ValueError) as info:
            apply_memory_budget(cfg, str(tmp_path))
        assert str(info.value) == (
            "activation_checkpoint.visualize_memory_budget_pareto draws with matplotlib, which "
            "is not installed: pip install matplotlib, or drop the flag"
        )
        return
    keys = ("activation_memory_budget", "visualize_memory_budget_pareto",
            "memory_budget_pareto_dir")  # restored by torch's patch (see above)
    patch = functorch_config.patch({key: getattr(functorch_config, key) for key in keys})
    patch.__enter__()
    request.addfinalizer(lambda: patch.__exit__(None, None, None))
    torch._dynamo.reset()
    model = _model()
    apply_memory_budget(cfg, str(tmp_path))
    apply_compile(model, Compile(enable=True, backend="aot_eager"))
    model(torch.zeros(1, SEQ, dtype=torch.long)).sum().backward()
    torch._dynamo.reset()
    assert list((tmp_path / "memory_budget_pareto").glob("memory_budget_pareto_*.svg"))
