"""Model converters (torchtitan/components/converters.py, float8.py, mx.py) on CPU: names and
refusals in one line, what float8 / MX convert and skip, numerics of the emulated layers,
format-neutral state dicts, float8 TP styles, dry-run adjustments."""

from __future__ import annotations

import copy
import logging
import tempfile
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")
pytestmark = pytest.mark.usefixtures("one_thread")  # 2 shared cores: no OpenMP oversubscription

from torchtitan.components.converters import (  # noqa: E402
    ModelConverters,
    build_converters,
    check_converters,
    converter_class,
    prepare_dry_run,
)
from torchtitan.components.mx import torch_has_mx_training  # noqa: E402
from torchtitan.config.errors import ConfigError  # noqa: E402
from torchtitan.config.manager import ConfigManager  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.models import get_model_spec  # noqa: E402

EMULATED_MX = ("--mx.recipe_name", "mxfp8_emulated_rceil")


def cfg(*flags: str):
    return ConfigManager().parse_args(list(flags))


def build(job, name="llama3", flavor="debugmodel_tiny", seed=0, device="meta"):
    """The model of ``job`` (converted as it says), materialised on CPU with seeded weights."""
    spec = get_model_spec(name)
    args = spec.get_model_args(flavor)
    args.update_from_config(job, tokenizer=None)
    with torch.device("meta"):
        model = spec.model_cls(args)
    converters = build_converters(job, ParallelDims.from_config(job.parallelism, 1), "cpu")
    converters.convert(model)
    torch.manual_seed(seed)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def linear_types(model: nn.Module) -> dict[str, str]:
    """Module name -> class name of every Linear ("Linear" for the decoder's output head: a
    plain Linear that can also compute the loss)."""
    from torchtitan.models.common.decoder import OutputHead

    return {n: "Linear" if type(m) is OutputHead else type(m).__name__
            for n, m in model.named_modules() if isinstance(m, nn.Linear)}


# ----------------------------------------------------------------------------- names, refusals


def test_unknown_converter_is_one_line_naming_the_known_ones():
    with pytest.raises(ConfigError) as info:
        check_converters(cfg("--model.converters", "float8,fp16"))
    assert str(info.value) == "model.converters: unknown converter 'fp16'; known: float8, mx"
    assert converter_class("quantize.linear.float8") is converter_class("float8")
    assert converter_class("quantize.grouped_mm.mx") is converter_class("mx")
    with pytest.raises(ConfigError, match="did you mean 'quantize.linear.float8'"):
        converter_class("quantize.linear.float")
    with pytest.raises(ConfigError, match="did you mean 'float8'"):
        converter_class("floa8")


def test_trainer_exits_2_with_one_line_for_an_unknown_converter(capsys):
    from torchtitan.tools.logging import logger
    from torchtitan.train import main

    handlers = logger.handlers[:]  # main() adds one bound to capsys' stream; drop it after
    try:
        assert main(["--model.converters", "nope", "--training.steps", "1"]) == 2
    finally:
        logger.handlers[:] = handlers
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1
    assert err[0].endswith("error: model.converters: unknown converter 'nope'; known: float8, mx")


@pytest.mark.parametrize(
    "flags, device, needle",
    [
        (["--model.converters", "float8"], "cpu",
         "model.converters float8 needs a GPU with float8 matmuls (CUDA compute capability >= "
         "8.9, e.g. H100); this machine has cpu: set --float8.emulate"),
        (["--model.converters", "float8", "--float8.emulate", "--float8.recipe_name", "rowwise",
          "--float8.enable_fsdp_float8_all_gather"], None,
         "float8.enable_fsdp_float8_all_gather needs tensorwise scaling, but "
         "float8.recipe_name='rowwise'"),
        (["--model.converters", "float8", "--float8.emulate", "--float8.moe_fqns_prototype",
          "experts"], "cpu",
         "float8.moe_fqns_prototype=['experts']: torchao's float8 grouped GEMMs need a CUDA GPU "
         "with compute capability >= 9.0"),
        (["--model.converters", "mx"], "cpu",
         "model.converters mx needs a GPU with MXFP8 matmuls (CUDA compute capability >= 10.0, "
         "e.g. B200); this machine has cpu"),
        (["--model.converters", "mx", "--mx.recipe_name", "fp4"], None,
         "mx.recipe_name='fp4' is not a torchao 0.18 MXFP8 recipe"),
        (["--model.converters", "float8,mx"], None, "float8 and mx both convert"),
        (["--model.converters", "float8,float8"], None, "names float8 more than once"),
        (["--model.converters", "float8,quantize.linear.float8"], None,
         "model.converters names float8 more than once: ['float8', 'quantize.linear.float8'] "
         "(upstream's quantize.linear.float8 is float8 here)"),
        (["--model.converters", "quantize.grouped_mm.float8"], None,
         "model.converters quantize.grouped_mm.float8 converts the MoE experts that "
         "quantize.grouped_mm.float8.fqns (float8.moe_fqns_prototype) names, and it is empty"),
        (["--model.converters", "quantize.linear.float8,quantize.linear.mx"], None,
         "float8 and mx both convert"),
    ],
)
def test_refusals_are_one_line(flags, device, needle):
    with pytest.raises(ValueError) as info:
        check_converters(cfg(*flags), device)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_mx_on_a_torch_without_mx_training_is_one_line(monkeypatch):
    """torch 2.11 lacks what torchao's MXFP8 training asserts on: refused before any work."""
    import torchtitan.components.mx as mx_module

    monkeypatch.setattr(mx_module, "torch_has_mx_training", lambda: False)
    with pytest.raises(ValueError) as info:
        check_converters(cfg("--model.converters", "mx", *EMULATED_MX), "cpu")
    assert str(info.value) == (
        f"model.converters mx needs a newer torch than {torch.__version__} (torchao's MXFP8 "
        "training uses DTensor features that torch 2.13 has): upgrade torch, or use "
        "model.converters float8")


def test_dry_run_emulates_what_this_machine_lacks(caplog):
    job = cfg("--model.converters", "float8", "--float8.moe_fqns_prototype", "experts")
    assert prepare_dry_run(job, "cpu") == [
        "float8.emulate on (no float8 hardware here)",
        "float8.moe_fqns_prototype emptied (float8 grouped GEMMs need CUDA)",
    ]
    assert job.float8.emulate and job.float8.moe_fqns_prototype == []
    check_converters(job, "cpu")  # now runnable here
    mx = cfg("--model.converters", "mx")
    assert prepare_dry_run(mx, "cpu") == ["mx.recipe_name=mxfp8_emulated_rceil (no MXFP8 hardware here)"]
    assert prepare_dry_run(cfg(), "cpu") == []


# ----------------------------------------------------------------------------- float8


def test_float8_converts_the_linears_except_filtered_and_logs_the_skips(caplog):
    job = cfg("--model.converters", "float8", "--float8.emulate")
    with caplog.at_level(logging.INFO):
        model = build(job)
    types = linear_types(model)
    assert types.pop("output") == "Linear"  # float8.filter_fqns default
    assert set(types.values()) == {"Float8Linear"} and len(types) == 2 * 7
    assert "float8: converted 14 Linear layers to Float8Linear (tensorwise, emulated); skipped " \
           "1: output (float8.filter_fqns)" in caplog.text


@pytest.mark.parametrize("spelling", ["toml", "cli"])
def test_upstreams_converter_names_convert_what_they_name(tmp_path, spelling, caplog):
    """upstream's 2026 names: quantize.linear.float8 converts the Linear layers as float8
    does (with its [quantize.linear.float8] settings); quantize.grouped_mm.float8 alone leaves
    them in high precision (it converts the MoE experts its fqns name)."""
    if spelling == "toml":
        path = tmp_path / "job.toml"
        path.write_text('[model]\nconverters = ["quantize.linear.float8"]\n'
                        '[quantize.linear.float8]\nemulate = true\nfilter_fqns = ["output", "w2"]\n')
        job = cfg("--job.config_file", str(path))
    else:
        job = cfg("--model.converters", "quantize.linear.float8", "--float8.emulate",
                  "--float8.filter_fqns", "output,w2")
    check_converters(job, "cpu")
    types = linear_types(build(job))
    assert {n for n, t in types.items() if t == "Float8Linear"} == {
        n for n in types if n != "output" and not n.endswith("w2")} != set()

    moe_only = cfg("--model.name", "qwen3", "--model.flavor", "debugmodel_moe",
                   "--model.converters", "quantize.grouped_mm.float8", "--float8.emulate",
                   "--float8.moe_fqns_prototype", "experts")
    spec = get_model_spec("qwen3")
    args = spec.get_model_args("debugmodel_moe")
    args.update_from_config(moe_only, tokenizer=None)
    with torch.device("meta"):
        model = spec.model_cls(args)
    check_converters(moe_only)  # float8 grouped GEMMs run on CUDA only: no device check here
    converters = ModelConverters([converter_class("quantize.grouped_mm.float8")(moe_only, None,
                                                                                "cpu")])
    assert not converters.float8_tensorwise_tp  # no Float8Linear for TP to all-gather into
    converters.convert(model)
    assert type(model.layers["0"].moe.experts.w1).__name__ == "Float8TrainingWeightWrapperTensor"
    assert set(linear_types(model).values()) == {"Linear"}


def test_dims_not_multiples_of_16_are_skipped_and_named():
    from torchtitan.components.float8 import plan_linears, summarize

    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(64, 20), nn.Linear(32, 64))
                                  for i in range(3)})
    model.head = nn.Linear(64, 64)
    chosen, skipped = plan_linears(model, ["head"])
    assert chosen == {f"layers.{i}.1" for i in range(3)}
    assert summarize(skipped) == (
        "layers.*.0 (3, 20x64: dims not multiples of 16); head (float8.filter_fqns)"
    )


def test_rowwise_recipe_and_auto_filter():
    job = cfg("--model.converters", "float8", "--float8.emulate", "--float8.recipe_name",
              "rowwise", "--float8.filter_fqns", "output,auto_filter_small_kn")
    with pytest.raises(ValueError, match="no Linear layer"):  # all too small for torchao's rule
        _raise_on_warning(lambda: build(job))
    job = cfg("--model.converters", "float8", "--float8.emulate", "--float8.recipe_name", "rowwise")
    model = build(job)
    layer = model.get_submodule("layers.0.attention.wq")
    assert type(layer).__name__ == "Float8Linear"
    assert layer.config.cast_config_weight.scaling_granularity.name == "AXISWISE"
    assert layer.config.emulate


def _raise_on_warning(fn):
    from torchtitan.tools.logging import logger

    class Raise(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING and "no Linear layer" in record.getMessage():
                raise ValueError(record.getMessage())

    handler = Raise()
    logger.addHandler(handler)
    try:
        return fn()
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_float8_is_close_to_high_precision_but_not_equal(recipe):
    """One forward+backward of the tiny model: float8 rounding moves the loss a little
    (measured 4e-6 tensorwise, 9e-7 rowwise) and a weight gradient by several percent (9.6% /
    6.8%: tensorwise casts gradients to e5m2, 2 mantissa bits); equal results would mean
    nothing was converted."""
    plain = build(cfg())
    f8 = build(cfg("--model.converters", "float8", "--float8.emulate", "--float8.recipe_name",
                   recipe))
    f8.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 2000, (2, 33), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for model in (plain, f8):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        grads.append(model.get_submodule("layers.0.feed_forward.w1").weight.grad)
    rel_loss = abs(losses[1] - losses[0]) / losses[0]
    rel_grad = ((grads[1] - grads[0]).norm() / grads[0].norm()).item()
    assert 0 < rel_loss < 1e-4, rel_loss
    assert 1e-4 < rel_grad < 0.15, rel_grad


def test_float8_state_dict_is_the_plain_models():
    """Same FQNs, shapes, dtypes and plain tensors: checkpoints load across converter settings."""
    plain = build(cfg())
    for flags in (["--float8.emulate"], ["--float8.emulate", "--float8.recipe_name", "rowwise"]):
        f8 = build(cfg("--model.converters", "float8", *flags), seed=1)
        sd_plain, sd_f8 = plain.state_dict(), f8.state_dict()
        assert list(sd_plain) == list(sd_f8)
        for key, value in sd_f8.items():
            assert type(value) is torch.Tensor, key
            assert (value.shape, value.dtype) == (sd_plain[key].shape, sd_plain[key].dtype), key
        copy.deepcopy(plain).load_state_dict(sd_f8)  # strict, both ways
        f8.load_state_dict(sd_plain)
        assert torch.equal(f8.state_dict()["layers.1.attention.wq.weight"],
                           sd_plain["layers.1.attention.wq.weight"])


def test_print_after_conversion(caplog):
    job = cfg("--model.converters", "float8", "--float8.emulate", "--model.print_after_conversion")
    with caplog.at_level(logging.INFO):
        build(job)
    assert "Model after conversion (float8):" in caplog.text
    assert "(wq): Float8Linear(" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        ModelConverters([], print_after_conversion=False).convert(nn.Linear(2, 2))
    assert "Model after conversion" not in caplog.text


def test_float8_tp_plan_uses_float8_styles_only_for_float8_linears():
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from torchtitan.components.float8 import float8_tensorwise_tp
    from torchtitan.distributed.tensor_parallel import block_tp_plan

    block = build(cfg("--model.converters", "float8", "--float8.emulate")).layers["0"]
    plan = block_tp_plan(block, float8_tensorwise=True)
    assert type(plan["attention"]) is PrepareFloat8ModuleInput
    assert type(plan["attention.wq"]) is Float8ColwiseParallel
    assert type(plan["feed_forward.w2"]) is Float8RowwiseParallel
    # a skipped column-wise linear keeps its module's input in high precision
    block.attention.wk = nn.Linear(64, 32, bias=False)
    plan = block_tp_plan(block, float8_tensorwise=True)
    assert type(plan["attention"]).__name__ == "PrepareModuleInput"
    assert type(plan["attention.wk"]).__name__ == "ColwiseParallel"
    assert type(plan["attention.wq"]) is Float8ColwiseParallel
    assert type(plan["feed_forward"]) is PrepareFloat8ModuleInput
    assert float8_tensorwise_tp(cfg("--model.converters", "float8"))
    assert not float8_tensorwise_tp(cfg("--model.converters", "float8", "--float8.recipe_name", "rowwise"))
    assert not float8_tensorwise_tp(cfg())


def test_precompute_needs_fsdp_float8_all_gather(caplog):
    job = cfg("--model.converters", "float8", "--float8.emulate",
              "--float8.enable_fsdp_float8_all_gather",
              "--float8.precompute_float8_dynamic_scale_for_fsdp")
    with caplog.at_level(logging.INFO):
        (converter,) = build_converters(job, ParallelDims.from_config(job.parallelism, 1), "cpu").converters
    assert not converter.all_gather and not converter.precompute
    assert "float8.enable_fsdp_float8_all_gather has no effect without FSDP" in caplog.text


def test_moe_experts_convert_to_float8_grouped_gemm_weights_on_meta():
    """The conversion runs anywhere (forward needs CUDA >= 9.0, refused on CPU above)."""
    job = cfg("--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--model.converters",
              "float8", "--float8.emulate", "--float8.moe_fqns_prototype", "experts")
    spec = get_model_spec("qwen3")
    args = spec.get_model_args("debugmodel_moe")
    args.update_from_config(job, tokenizer=None)
    with torch.device("meta"):
        model = spec.model_cls(args)
    converters = ModelConverters([converter_class("float8")(job, None, "cpu")])
    converters.convert(model)
    experts = model.layers["0"].moe.experts
    assert type(experts.w1).__name__ == "Float8TrainingWeightWrapperTensor"
    assert type(model.layers["0"].moe.router.gate).__name__ == "Linear"  # 8x256: not 16s
    assert type(model.layers["0"].attention.wq).__name__ == "Float8Linear"
    assert type(model.state_dict()["layers.0.moe.experts.w1"]) is torch.Tensor


# ----------------------------------------------------------------------------- MX


NEEDS_MX_TORCH = pytest.mark.skipif(not torch_has_mx_training(),
                                    reason="torchao's MXFP8 training needs torch 2.13")


@NEEDS_MX_TORCH
def test_emulated_mx_trains_and_keeps_checkpoints_plain():
    """MXFP8 (emulated recipe): linears converted, loss within 1% of high precision, state
    dict plain; a plain DCP checkpoint loads into the converted model."""
    import torch.distributed.checkpoint as dcp

    plain = build(cfg())
    mx = build(cfg("--model.converters", "mx", *EMULATED_MX), seed=1)
    converted = [n for n, p in mx.named_parameters() if "MXFP8" in type(p).__name__]
    assert "layers.0.attention.wq.weight" in converted and "output.weight" not in converted
    with tempfile.TemporaryDirectory() as d:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP: "assuming the intent is ... single process"
            dcp.save(plain.state_dict(), checkpoint_id=d)
            state = mx.state_dict()
            assert all(type(v) is torch.Tensor for v in state.values())
            dcp.load(state, checkpoint_id=d)  # plain checkpoint -> converted model
    for key, value in plain.state_dict().items():
        assert torch.equal(mx.state_dict()[key], value), key
    tokens = torch.randint(0, 2000, (2, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (plain, mx):
        logits = model(tokens[:, :-1]).float()
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
    assert 0 < abs(losses[1] - losses[0]) / losses[0] < 1e-2, losses


@NEEDS_MX_TORCH
def test_emulated_mx_moe_experts_run_grouped_gemms_in_mxfp8():
    """mx.moe_fqns_prototype: the experts' grouped GEMMs in (emulated) MXFP8, close to the
    high-precision layer; the router gate (dims not multiples of 32) stays plain."""
    from torchtitan.models.common.moe import MoE, MoEArgs

    def layer(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Module()
        model.moe = MoE(MoEArgs(num_experts=4, top_k=2), dim=64, hidden_dim=64)
        model.moe.init_weights(0.02)
        return model

    plain, mx = layer(0), layer(0)
    job = cfg("--model.converters", "mx", *EMULATED_MX, "--mx.moe_fqns_prototype", "experts",
              "--mx.filter_fqns", "gate")
    ModelConverters([converter_class("mx")(job, None, "cpu")]).convert(mx)
    assert type(mx.moe.experts.w1).__name__ == "MXFP8TrainingWeightWrapperTensor"
    assert type(mx.moe.router.gate.weight) is nn.Parameter
    assert all(type(v) is torch.Tensor for v in mx.state_dict().values())
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    out_plain, out_mx = plain.moe(x.unsqueeze(0)), mx.moe(x.unsqueeze(0))
    rel = ((out_mx - out_plain).norm() / out_plain.norm()).item()
    assert 1e-4 < rel < 0.1, rel
    out_mx.float().square().mean().backward()
    assert mx.moe.experts.w1.grad is not None


def test_float8_without_output_in_the_filter_converts_the_output_head():
    """The decoder's output head (a Linear with the chunked-loss path) converts like any Linear
    when ``filter_fqns`` leaves it in; the chunked loss then steps aside (docs/performance.md)."""
    from torchtitan.components.chunked_loss import choose_loss_path

    job = cfg("--model.converters", "float8", "--float8.emulate", "--float8.filter_fqns", "")
    model = build(job)
    assert linear_types(model)["output"] == "Float8Linear"
    assert choose_loss_path("auto", 64, "cuda", model, False, False) is False
    with pytest.raises(ValueError, match="the output projection is a Float8Linear"):
        choose_loss_path("chunked", 64, "cuda", model, False, False)
