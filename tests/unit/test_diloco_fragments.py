"""Streaming DiLoCo fragments: which modules each fragment holds, by the model's names."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import REPO_ROOT
from torchtitan.components.fault_tolerance.fragments import (
    PLACEHOLDER,
    build_fragments,
    fragment_units,
    model_units,
)
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import ConfigManager
from torchtitan.config.validation import validate
from torchtitan.distributed.pipeline.planning import split_model_part
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model import Transformer

UNITS4 = ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "output"]


def _model(n_layers: int = 4, tied: bool = False) -> Transformer:
    args = copy.deepcopy(llama3_args["debugmodel_tiny"])
    args.n_layers, args.vocab_size, args.max_seq_len = n_layers, 64, 16
    args.tie_word_embeddings = tied
    torch.manual_seed(0)
    return Transformer(args)


def test_even_split_puts_embedding_first_and_output_last():
    assert fragment_units(2, [], UNITS4, 4) == [
        ["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]
    ]
    assert fragment_units(1, [], UNITS4, 4) == [UNITS4]
    assert fragment_units(3, [], UNITS4, 4)[1] == ["layers.1", "layers.2"]


def test_explicit_fragments_expand_layers_and_are_checked():
    assert fragment_units(1, [["tok_embeddings"], ["layers", "norm", "output"]], UNITS4, 4) == [
        ["tok_embeddings"], ["layers.0", "layers.1", "layers.2", "layers.3", "norm", "output"]
    ]
    key = "fault_tolerance.module_fqns_per_model_fragment"
    bad = [
        ([["tok_embeddings", "layers.9"], ["layers", "norm", "output"]],
         f"{key}: fragment 0 names 'layers.9', which is not a module of the model; use names "
         "like tok_embeddings, layers.0, ..., output"),
        ([["tok_embeddings", "layers.0"], ["layers", "norm", "output"]],
         f"{key}: 'layers.0' is in both fragment 0 and fragment 1; list it once"),
        ([["tok_embeddings", "layers"], ["norm"]], f"{key}: 'output' is in no fragment; every "
         "module must belong to one fragment"),
        ([[], UNITS4], f"{key}: fragment 0 is empty; give every fragment at least one module"),
    ]
    for fragments, message in bad:
        with pytest.raises(ValueError) as info:
            fragment_units(1, fragments, UNITS4, 4)
        assert str(info.value) == message
    with pytest.raises(ValueError, match=r"num_fragments=7 is more than the model's 4 layers"):
        fragment_units(7, [], UNITS4, 4)


def test_fragments_hold_every_parameter_once_by_its_model_name():
    model = _model()
    fragments = build_fragments([model], fragment_units(2, [], UNITS4, 4))
    names = [[n for n, _ in f.named_parameters()] for f in fragments]
    assert names[0][0] == "tok_embeddings.weight" and names[1][-1] == "output.weight"
    assert all(n.startswith(("tok_embeddings.", "layers.0.", "layers.1.")) for n in names[0])
    model_params = dict(model.named_parameters())
    assert sorted(names[0] + names[1]) == sorted(model_params)
    for fragment in fragments:  # the model's own tensors, not copies
        for name, p in fragment.named_parameters():
            assert p is model_params[name]


def test_a_pipeline_stage_without_a_fragments_modules_holds_a_zero_placeholder():
    model = _model()
    stages = [UNITS4[:3], UNITS4[3:]]
    assert model_units([], [["tok_embeddings", "layers"], ["norm", "output"]], 4) == UNITS4
    units = fragment_units(1, [["tok_embeddings", "layers.0"], UNITS4[2:]], UNITS4, 4)
    first_stage = split_model_part(model, stages[0])  # tok_embeddings, layers.0, layers.1
    only, rest = build_fragments([first_stage], units)
    assert [n for n, _ in only.named_parameters()][0] == "tok_embeddings.weight"
    assert any(n.startswith("layers.1.") for n, _ in rest.named_parameters())
    last_stage = split_model_part(model, stages[1])
    empty, _ = build_fragments([last_stage], units)
    assert [(n, p.tolist()) for n, p in empty.named_parameters()] == [(PLACEHOLDER, [0.0])]


def test_tied_weights_in_two_fragments_are_refused():
    model = _model(tied=True)
    with pytest.raises(ValueError, match=r"tok_embeddings.weight \(fragment 0\) and output.weight "
                                         r"\(fragment 1\) are one tied weight"):
        build_fragments([model], fragment_units(2, [], UNITS4, 4))


def test_tied_units_in_two_fragments_are_refused_before_any_parameter_is_seen():
    """Under pipeline parallelism the embedding and output are two copies (two parameters):
    only the model's tie tells they must sync together."""
    tied = ("tok_embeddings", "output")
    with pytest.raises(ValueError, match=r"tok_embeddings \(fragment 0\) and output \(fragment 1\) "
                                         r"share one tied weight"):
        fragment_units(2, [], UNITS4, 4, tied)
    together = [["tok_embeddings", "layers.0", "layers.1", "norm", "output"], ["layers.2", "layers.3"]]
    assert fragment_units(2, together, UNITS4, 4, tied) == together


DEBUG = str(REPO_ROOT / "train_configs" / "debug_model.toml")
DILOCO = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
          "--fault_tolerance.semi_sync_method", "diloco"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
          "--fault_tolerance.num_fragments", "2"],
         "fault_tolerance.num_fragments / module_fqns_per_model_fragment split the model for "
         "DiLoCo's synchronisations; set --fault_tolerance.semi_sync_method diloco"),
        ([*DILOCO, "--fault_tolerance.num_fragments", "0"],
         "fault_tolerance.num_fragments must be >= 1, got 0"),
        ([*DILOCO, "--fault_tolerance.sync_steps", "5", "--fault_tolerance.num_fragments", "2"],
         "fault_tolerance.sync_steps=5 must be a multiple of the 2 fragments (one fragment "
         "synchronises every sync_steps / num_fragments steps)"),
        ([*DILOCO, "--fault_tolerance.sync_steps", "6", "--fault_tolerance.num_fragments", "3",
          "--fault_tolerance.fragment_sync_delay", "2"],
         "fault_tolerance.fragment_sync_delay=2 must be < sync_steps / num_fragments = 2 (a "
         "fragment's sync must end before the next fragment's starts)"),
        ([*DILOCO, "--fault_tolerance.sync_steps", "6", "--fault_tolerance.num_fragments", "3",
          "--fault_tolerance.module_fqns_per_model_fragment=tok_embeddings,layers;norm,output"],
         "fault_tolerance.num_fragments=3 disagrees with the 2 fragments of "
         "fault_tolerance.module_fqns_per_model_fragment; leave num_fragments at 1 or set it to "
         "the same count"),
        ([*DILOCO[:-1], "local_sgd", "--fault_tolerance.should_quantize"],
         "fault_tolerance.should_quantize quantizes DiLoCo's pseudo-gradients (torchft sends "
         "gradients and local_sgd's weights at full precision); set "
         "--fault_tolerance.semi_sync_method diloco, or drop should_quantize"),
        ([*DILOCO, "--fault_tolerance.should_quantize"],
         "fault_tolerance.should_quantize needs --fault_tolerance.process_group nccl (torchft's "
         "quantized all-reduce runs on CUDA tensors), got 'gloo'"),
    ],
)
def test_bad_fragment_settings_are_one_line(flags, message):
    with pytest.raises(ConfigError) as info:
        validate(ConfigManager().parse_args(["--job.config_file", DEBUG, *flags]))
    assert str(info.value) == message


def test_should_quantize_reaches_torchfts_pseudo_gradient_all_reduce():
    """The flag is DiLoCo's: every fragment's pseudo-gradient all-reduce asks torchft for the
    quantized path (torchft takes it when triton and CUDA are there)."""
    from unittest import mock

    pytest.importorskip("torchft")

    from torchtitan.components.fault_tolerance.semi_sync import SemiSync

    flags = [*DILOCO, "--fault_tolerance.process_group", "nccl", "--fault_tolerance.should_quantize",
             "--fault_tolerance.num_fragments", "2", "--fault_tolerance.sync_steps", "2"]
    cfg = ConfigManager().parse_args(["--job.config_file", DEBUG, *flags])
    validate(cfg)
    model = _model()
    manager = mock.MagicMock(_use_async_quorum=False)
    semi = SemiSync(manager, cfg.fault_tolerance, [model], lambda: None,
                    fragment_units(2, [], UNITS4, 4))
    try:
        for fragment in semi.algorithm._fragments:
            fragment.prepare_sync()
    finally:
        semi.close()
    calls = manager.allreduce.call_args_list
    assert len(calls) == len(list(model.parameters()))  # one per parameter, both fragments
    assert all(call.kwargs.get("should_quantize") is True for call in calls)


def test_fragments_hold_moe_routing_biases_as_aliases_of_the_buffers():
    from torchtitan.components.fault_tolerance.fragments import ROUTING_BIASES
    from torchtitan.models.qwen3 import qwen3_args
    from torchtitan.models.qwen3.model import Qwen3Model

    args = copy.deepcopy(qwen3_args["debugmodel_moe"])
    args.vocab_size, args.max_seq_len = 64, 16
    model = Qwen3Model(args)
    moe_layers = [i for i, block in model.layers.items() if getattr(block, "moe", None) is not None]
    assert moe_layers
    units = model_units([model], None, args.n_layers)
    first, second = build_fragments([model], fragment_units(2, [], units, args.n_layers))
    held = {}
    for fragment in (first, second):
        if hasattr(fragment, ROUTING_BIASES):
            biases = fragment.get_submodule(ROUTING_BIASES)
            held.update({biases.fqns[n]: p for n, p in biases.named_parameters()})
    assert sorted(held) == sorted(f"layers.{i}.moe.expert_bias" for i in moe_layers)
    # a sync writes the parameter; the model routes by the buffer: they are one tensor
    fqn, param = next(iter(held.items()))
    with torch.no_grad():
        param.add_(0.25)
    assert torch.equal(model.get_buffer(fqn), param.detach())
    assert not param.requires_grad
