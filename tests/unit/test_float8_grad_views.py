"""Float8Linear gradient views (``training.weight_copies=auto`` with float8 tensorwise): the
float32 weight is cast to float8 as torchao casts it, and its gradient stays bfloat16 through
a view of the weight's own storage: no copy, no widening pass, the plain float8 path's
numbers (CPU, emulated float8)."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from torch import nn

from tests.integration.trainer_utils import run_tiny
from torchtitan.components.float8_grad_views import supports_grad_view
from torchtitan.components.weight_copies import build_weight_copies

F8 = ["--training.mixed_precision_param", "bfloat16", "--training.max_norm", "0.05",
      "--training.steps", "4", "--model.converters", "float8", "--float8.emulate"]


def _converted(recipe: str = "tensorwise", bias: bool = False) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=bias), nn.ReLU(), nn.Linear(128, 64, bias=bias))
    config = Float8LinearConfig.from_recipe_name(recipe)
    config = Float8LinearConfig(**{**config.__dict__, "emulate": True})
    return convert_to_float8_training(model, config=config)


@pytest.mark.parametrize("recipe,bias", [("tensorwise", False), ("tensorwise", True),
                                         ("rowwise", False), ("rowwise_with_gw_hp", False)])
def test_a_view_gives_the_plain_paths_values_in_bf16(recipe, bias):
    """Forward, input gradient and weight gradient equal torchao's (eager) for every recipe,
    the weight's
    gradient arriving in bf16 on the view and none on the float32 weight. bf16 inputs, as
    CUDA autocast gives them (torchao's rule), so torchao's weight gradient is bf16 too."""
    plain, viewed = _converted(recipe, bias), _converted(recipe, bias)
    copies = build_weight_copies([viewed], torch.bfloat16, float8=False)
    assert copies.modules == [] and copies.view_modules == [viewed[0], viewed[2]]
    for view, weight in zip(copies.views, copies.view_masters):
        assert view.dtype == torch.bfloat16 and view.untyped_storage().data_ptr() == \
            weight.untyped_storage().data_ptr()  # no memory of its own
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    grads = []
    for model, ctx in ((plain, torch.autograd.grad_mode.enable_grad()), (viewed, copies.active())):
        xi = x.clone().requires_grad_()
        with ctx:
            loss = model(xi).float().square().mean()
            loss.backward()
        grads.append((loss.detach(), xi.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    for module, ref in ((viewed[0], plain[0]), (viewed[2], plain[2])):
        assert module.weight.grad is None  # the float32 weight's stays empty
        got = copies.grad_of(module.weight)
        assert got.dtype == torch.bfloat16 and torch.equal(got.float(), ref.weight.grad)
    copies.zero_grad()
    assert all(v.grad is None for v in copies.views)
    # outside the step the module is torchao's Float8Linear on its float32 weight
    assert torch.equal(viewed(x), plain(x))


def test_which_weights_get_views():
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        assert all(supports_grad_view(m) for m in _converted(recipe) if hasattr(m, "config"))
    assert not supports_grad_view(nn.Linear(4, 4))  # plain linears get copies
    # --float8.no_weight_grad_views: torchao's float32 gradients
    off = build_weight_copies([_converted()], torch.bfloat16, float8=False, grad_views=False)
    assert not off and off.views == []
    # ``on`` copies the float8 weights instead (faster casts, 2 bytes a parameter)
    on = build_weight_copies([_converted()], torch.bfloat16, float8=True)
    assert len(on) == 2 and on.views == []


@pytest.fixture(scope="module")
def trainings(tmp_path_factory):
    """The trainer with float8 (emulated) and views (auto, forced on the CPU), against the
    plain float8 path stepped by the same AdamW step (the project's own, float32 state)."""
    import torchtitan.build as build
    import torchtitan.components.optimizer as optimizer

    mp = pytest.MonkeyPatch()
    out = {}
    try:
        torch_choice = optimizer.optimizer_class
        mp.setattr(optimizer, "optimizer_class",
                   lambda cfg, own_step=False: torch_choice(cfg, own_step=True))
        out["plain"] = run_tiny(tmp_path_factory.mktemp("plain"), *F8,
                                "--training.weight_copies", "off")
        gc.enable()
        mp.setattr(build, "choose_weight_copies", lambda *a, **k: True)
        out["views"] = run_tiny(tmp_path_factory.mktemp("views"), *F8)
        gc.enable()
    finally:
        mp.undo()
    return out


def test_training_with_views_equals_the_plain_float8_path(trainings):
    plain, views = trainings["plain"], trainings["views"]
    copies = views.run.weight_copies
    assert plain.run.weight_copies is None
    assert len(copies.views) == 14 and len(copies) == 1  # the float8 linears; the output head
    losses = [[h[0] for h in t.history] for t in (plain, views)]
    norms = [[h[1] for h in t.history] for t in (plain, views)]
    assert min(norms[0]) > 0.05  # every step clipped
    assert losses[0][-1] < losses[0][0]
    # the same forward and gradients; the norm sums bf16 gradients with float32
    # accumulation, the output head's copy is autocast's cast: float32 rounding apart
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(norms[1], norms[0], rtol=1e-5, atol=0)
    ref = dict(plain.model_parts[0].named_parameters())
    for name, p in views.model_parts[0].named_parameters():
        assert p.dtype == torch.float32, name  # checkpoints and the optimizer see these
        torch.testing.assert_close(p, ref[name], rtol=0, atol=1e-5, msg=name)


def test_views_alias_the_stepped_weights(trainings):
    copies = trainings["views"].run.weight_copies
    for view, weight in zip(copies.views, copies.view_masters):
        high = (weight.detach().view(torch.int32) & -65536).view(torch.float32)
        assert torch.equal(view.float(), high)  # the weight's high halves, after 4 steps


@pytest.mark.slow  # ~1 min: inductor compiles the blocks twice
def test_compiled_blocks_with_views_equal_the_plain_float8_path(tmp_path, monkeypatch):
    """What runs on the GPU: the blocks compiled, the views standing in for the weights
    (one compilation: a step's views are the same tensors every step)."""
    import torchtitan.build as build
    import torchtitan.components.optimizer as optimizer

    torch_choice = optimizer.optimizer_class
    monkeypatch.setattr(optimizer, "optimizer_class",
                        lambda cfg, own_step=False: torch_choice(cfg, own_step=True))
    flags = [*F8, "--compile.enable"]
    plain = run_tiny(tmp_path / "plain", *flags, "--training.weight_copies", "off")
    gc.enable()
    torch._dynamo.reset()
    monkeypatch.setattr(build, "choose_weight_copies", lambda *a, **k: True)
    counters = torch._dynamo.utils.counters
    counters.clear()
    views = run_tiny(tmp_path / "views", *flags)
    gc.enable()
    assert len(views.run.weight_copies.views) == 14
    assert counters["stats"]["unique_graphs"] <= 3  # block graphs: no recompilation per step
    torch.testing.assert_close([h[0] for h in views.history], [h[0] for h in plain.history],
                               rtol=1e-5, atol=0)
    torch.testing.assert_close([h[1] for h in views.history], [h[1] for h in plain.history],
                               rtol=1e-4, atol=0)


def _saved_for_backward(views: bool) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """What a compiled feed-forward of ``Float8Linear``s keeps for its backward (the min-cut
    partitioner inductor uses; real float8 casts and ``_scaled_mm`` on meta tensors, so no
    float8 hardware is needed), graph inputs (weights, the input) left out: they cost nothing."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = nn.Linear(64, 256, bias=False), nn.Linear(64, 256, bias=False)
            self.w2 = nn.Linear(256, 64, bias=False)

        def forward(self, x):
            return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))

    saved = []

    def forward_compiler(gm, example_inputs):
        for node in gm.graph.output_node().args[0]:
            value = getattr(node, "meta", {}).get("val")
            if isinstance(value, torch.Tensor) and node.op != "placeholder":
                saved.append((value.dtype, tuple(value.shape)))
        return gm

    with torch.device("meta"):
        model = convert_to_float8_training(
            FeedForward(), config=Float8LinearConfig.from_recipe_name("tensorwise"))
    ctx = contextlib.nullcontext()
    if views:
        ctx = build_weight_copies([model], torch.bfloat16, float8=False).active()
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm,
                           partition_fn=min_cut_rematerialization_partition)
    with ctx:
        torch.compile(model, backend=backend)(
            torch.empty(128, 64, dtype=torch.bfloat16, device="meta", requires_grad=True))
    torch._dynamo.reset()
    return saved


def test_a_compiled_layer_with_views_keeps_what_torchaos_keeps_for_the_backward():
    """The float32 weight goes to the views' autograd function as the parameter it is: handed
    in detached, the partitioner kept every weight's float8 cast for the backward (1 byte a
    parameter more activation memory than the plain float8 path) instead of recasting it."""
    plain, viewed = _saved_for_backward(False), _saved_for_backward(True)
    assert (torch.bfloat16, (128, 256)) in plain  # activations: the partitioner ran
    float8_weights = [s for s in viewed if s[0] == torch.float8_e4m3fn and 128 not in s[1]]
    assert float8_weights == [] and sorted(viewed, key=str) == sorted(plain, key=str)
