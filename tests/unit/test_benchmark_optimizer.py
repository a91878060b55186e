"""scripts/benchmark_optimizer.py: the optimizer step per implementation (CPU, dynamo only)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def bo():
    yield load_script("benchmark_optimizer")
    sys.modules.pop("benchmark_optimizer", None)


def test_static_compiles_one_graph_per_shape_and_dynamic_does_not(bo, capsys):
    import torchtitan.components.adamw_bf16_state as module

    before = module._step_fn
    assert bo.main(["--backend", "eager", "--layers", "1", "--warmup", "1", "--iters", "1"]) == 0
    assert module._step_fn is before  # the trainer's choice restored
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    r = out["results"]
    assert set(r) == {"fused", "static", "dynamic", "copies"}
    # the decoder's shapes: embedding, wq/wo, wk/wv, w1/w3, w2, norms (the output head shares
    # the embedding's shape); the copies' graphs differ by their bf16 gradient and copy
    assert (r["static"]["graphs"], r["static"]["dynamic_graphs"]) == (6, 0)
    assert r["copies"]["dynamic_graphs"] == 0
    # what torch's automatic dynamic shapes make of the same calls: the step compiled before
    assert r["dynamic"]["dynamic_graphs"] > 0
    assert out["parameters"] == 2000 * 64 * 2 + 2 * 64 * 64 + 2 * 16 * 64 + 3 * 224 * 64 + 3 * 64


def test_bad_implementation_is_one_line(bo, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bo.main(["--impl", "fused,fast"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: argument --impl: unknown implementation(s) fast") and err.count("\n") == 1
