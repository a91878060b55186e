"""Activation checkpointing: same losses/grads as without it, real recomputation, clean FQNs."""

from __future__ import annotations

import copy
import re
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import (
    _op_sac_policy,
    apply_ac,
    default_op_sac_save_list,
)
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model import Transformer

aten = torch.ops.aten
SEQ, VOCAB, STEPS = 32, 256, 5
pytestmark = pytest.mark.usefixtures("one_thread")


def _model(n_layers: int = 4) -> Transformer:
    args = copy.deepcopy(llama3_args["debugmodel_tiny"])
    args.vocab_size, args.max_seq_len, args.n_layers = VOCAB, SEQ, n_layers
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model


def _cfg(mode: str, option: str = "2", **kw) -> ActivationCheckpoint:
    return ActivationCheckpoint(mode=mode, selective_ac_option=option, **kw)


def _train(model: torch.nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS AdamW steps on fixed random data; returns losses and the first step's grads."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses, first_grads = [], {}
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if step == 0:
            first_grads = {k: v.grad.clone() for k, v in model.state_dict(keep_vars=True).items()}
        opt.step()
        losses.append(loss.item())
    return losses, first_grads


@pytest.fixture(scope="module")
def baseline():
    return _train(_model())


@pytest.mark.parametrize(
    "cfg,wrapped",
    [
        (_cfg("full"), ["0", "1", "2", "3"]),
        (_cfg("selective", "2"), ["1", "3"]),
        (_cfg("selective", "3"), ["2"]),
        (_cfg("selective", "1"), ["0", "1", "2", "3"]),
        (_cfg("selective", "op"), ["0", "1", "2", "3"]),
    ],
    ids=["full", "sel2", "sel3", "sel1", "op"],
)
def test_ac_matches_no_ac(cfg, wrapped, baseline):
    model = apply_ac(_model(), cfg)
    assert [k for k, b in model.layers.items() if isinstance(b, CheckpointWrapper)] == wrapped
    # recomputation really happens: a wrapped block's FFN runs again during backward
    calls = defaultdict(int)
    for layer_id, block in model.layers.items():
        block.feed_forward.register_forward_hook(
            lambda *a, i=layer_id: calls.__setitem__(i, calls[i] + 1)
        )
    losses, grads = _train(model)
    assert calls == {k: STEPS * (2 if k in wrapped else 1) for k in model.layers}
    # Eager recomputation replays the same kernels on the same inputs: results are bitwise equal.
    torch.testing.assert_close(losses, baseline[0], rtol=0, atol=0)
    assert set(grads) == set(baseline[1])
    for k, g in grads.items():
        torch.testing.assert_close(
            g, baseline[1][k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}"
        )


def test_state_dict_keys_stay_clean():
    plain = _model()
    model = apply_ac(_model(), _cfg("full"))
    assert list(model.state_dict()) == list(plain.state_dict())
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    assert list(get_model_state_dict(model)) == list(plain.state_dict())
    # checkpoints load across AC on/off, both ways
    model.load_state_dict(plain.state_dict())
    plain.load_state_dict(model.state_dict())
    # the raw parameter names show the wrapper (what optimizers/FSDP see)
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())


def test_debug_options_reach_torch_checkpoint():
    cfg = _cfg("full", preserve_rng_state=True, determinism_check="none", early_stop=True)
    block = apply_ac(_model(1), cfg).layers["0"]
    kw = block.checkpoint_fn.keywords
    assert kw["use_reentrant"] is False
    assert (kw["preserve_rng_state"], kw["determinism_check"], kw["early_stop"]) == (
        True,
        "none",
        True,
    )


@pytest.mark.parametrize(("mode", "option"), [("full", "2"), ("selective", "op")])
def test_debug_shows_the_ops_it_captured(mode, option, caplog):
    """activation_checkpoint.debug logs, once per block, the ops its forward and its recompute
    ran (torch's debug=True only shows them inside an error)."""
    model = apply_ac(_model(2), _cfg(mode, option, debug=True))
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with caplog.at_level("INFO", logger="torchtitan"):
        for _ in range(2):
            model(tokens).sum().backward()
    lines = sorted(m for m in caplog.messages if "activation_checkpoint.debug" in m)
    assert len(lines) == 2, lines  # one per block, first backward only
    for block, line in enumerate(lines):
        assert re.fullmatch(
            rf"activation_checkpoint.debug: layers.{block} recomputed the same \d+ ops as its "
            r"forward \(aten\.\w+.*x\d+, \.\.\.\)", line
        ), line
    assert "aten.mm x" in lines[0]


def test_debug_names_the_first_op_that_differs(caplog):
    from torchtitan.distributed.activation_checkpoint import OpCapture

    capture = OpCapture("layers.3")
    capture.forward = ["aten.mm.default", "aten.add.Tensor", "aten.mul.Tensor"]
    with caplog.at_level("WARNING", logger="torchtitan"):
        capture.report(["aten.mm.default", "aten.sub.Tensor"])
    assert caplog.messages == [
        "activation_checkpoint.debug: layers.3 recomputed 2 ops but its forward ran 3; first "
        "difference at op 2: aten.add.Tensor vs aten.sub.Tensor"
    ]


def test_none_changes_nothing():
    model = _model()
    blocks = list(model.layers.values())
    apply_ac(model, _cfg("none"))
    assert list(model.layers.values()) == blocks


def test_a_recompute_filter_matching_no_module_is_warned(caplog):
    """A typo ('attention.wqq') recomputed nothing, silently; the default entry (MoE's router
    gate, absent from dense models) says nothing."""
    fqns = ["attention.wqq", "feed_forward.w1", "moe.router.gate"]
    apply_ac(_model(2), _cfg("selective", "op", per_op_sac_force_recompute_mm_shapes_by_fqns=fqns))
    assert ("per_op_sac_force_recompute_mm_shapes_by_fqns: 'attention.wqq' matches no module of "
            "the blocks here, so no matmul is recomputed for it") in caplog.text
    caplog.clear()
    apply_ac(_model(2), _cfg("selective", "op"))
    assert "matches no module" not in caplog.text


@pytest.mark.parametrize("option", ["abc", "0", "-1", "1.5", ""])
def test_bad_selective_option(option):
    with pytest.raises(ValueError, match="activation_checkpoint.selective_ac_option="):
        apply_ac(_model(1), _cfg("selective", option))


def test_bad_mode_and_determinism_check():
    with pytest.raises(ValueError, match="activation_checkpoint.mode='partial'"):
        apply_ac(_model(1), _cfg("partial"))
    with pytest.raises(ValueError, match="activation_checkpoint.determinism_check='strict'"):
        apply_ac(_model(1), _cfg("full", determinism_check="strict"))


def test_op_policy_saves_every_other_mm_and_attention():
    counts = defaultdict(int)
    save_list = default_op_sac_save_list()
    w = torch.empty(64, 128)

    def decide(func, *args, shapes=frozenset()):
        return _op_sac_policy(save_list, set(shapes), counts, None, func, *args)

    must, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert [decide(aten.mm.default, None, w) for _ in range(4)] == [must, recompute] * 2
    assert decide(aten._scaled_dot_product_flash_attention_for_cpu.default) == must
    assert decide(aten._scaled_dot_product_flash_attention.default) == must
    assert decide(aten._scaled_dot_product_efficient_attention.default) == must
    assert decide(aten.max.default) == must
    assert decide(aten.add.Tensor) == recompute
    # forced-recompute shapes neither save nor advance the every-other counter
    assert decide(aten.mm.default, None, w, shapes={(64, 128)}) == recompute
    assert decide(aten.mm.default, None, w) == must


def test_op_policy_repeats_forward_choices_when_called_in_recompute():
    """torch <= 2.12 calls the policy again in the recompute (ctx.is_recompute=True): the
    recompute must make the forward's choices, whatever count the forward ended on."""
    counts = defaultdict(int)
    save_list = default_op_sac_save_list()
    w = torch.empty(64, 128)

    def decide(is_recompute):
        ctx = SelectiveCheckpointContext(is_recompute=is_recompute)
        return _op_sac_policy(save_list, set(), counts, ctx, aten.mm.default, None, w)

    forward = [decide(False) for _ in range(3)]  # an odd count: a shared counter flips
    assert [decide(True) for _ in range(3)] == forward


def test_force_recompute_fqns_must_name_linears():
    cfg = _cfg("selective", "op", per_op_sac_force_recompute_mm_shapes_by_fqns=["attention_norm"])
    with pytest.raises(
        ValueError, match="must name nn.Linear modules, but layers.0.attention_norm"
    ):
        apply_ac(_model(1), cfg)


class _BlockWithGraphBreak(torch.nn.Module):
    """Like an MoE block: a data-dependent count (a graph break) sizes the code after it."""

    def __init__(self, keep: int):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("keep", torch.tensor(keep))

    def forward(self, x):
        h = torch.relu(self.lin(x))
        n = int(self.keep)
        top = h[:n]
        return x + F.pad(torch.tanh(top) * top, (0, 0, 0, x.shape[0] - n))


def test_recompute_runs_the_graphs_its_forward_ran():
    """The first block's resume graph is static, the next blocks' dynamic; the first block's
    recompute must run its static graph again (the dynamic one saves other tensors: torch's
    CheckpointError with inductor)."""
    torch._dynamo.reset()
    graphs_run: list[int] = []

    def backend(gm, example_inputs):
        graph_id = backend.compiled
        backend.compiled += 1

        def run(*args):
            graphs_run.append(graph_id)
            return gm.forward(*args)

        return run

    backend.compiled = 0
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({str(i): _BlockWithGraphBreak(k) for i, k in enumerate([3, 5, 7])})
    apply_ac(model, _cfg("full"))
    for block in model.layers.values():
        block._checkpoint_wrapped_module.compile(backend=backend)
    y = torch.randn(10, 8, requires_grad=True)
    forward_graphs = []
    for block in model.layers.values():
        y = block(y)
        forward_graphs.append(graphs_run.copy())
        graphs_run.clear()
    assert forward_graphs[0] != forward_graphs[1], "the blocks should need different graphs"
    y.sum().backward()  # recomputes the last block first
    recompute_graphs = [graphs_run[i : i + 2] for i in range(0, len(graphs_run), 2)][::-1]
    assert recompute_graphs == forward_graphs


def test_selective_every_n_beyond_the_blocks_warns_that_nothing_is_checkpointed(caplog):
    with caplog.at_level("WARNING", logger="torchtitan"):
        model = apply_ac(_model(4), _cfg("selective", "5"))
    assert not any(isinstance(b, CheckpointWrapper) for b in model.layers.values())
    assert [m for m in caplog.messages if "selective_ac_option=5" in m] == [
        "activation_checkpoint.selective_ac_option=5 checkpoints the blocks whose layer id + 1 is "
        "a multiple of 5, and none of the 4 blocks here (layers 0..3) is one: no activation "
        "checkpointing; choose a smaller number, 'op', or --activation_checkpoint.mode none"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="torchtitan"):
        model = apply_ac(_model(4), _cfg("selective", "4"))  # layer 3 is checkpointed
    assert isinstance(model.layers["3"], CheckpointWrapper) and not caplog.messages
