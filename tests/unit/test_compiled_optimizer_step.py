"""The compiled optimizer step (``compiled_step`` in adamw_bf16_state.py): one static graph
per parameter shape, equal to the eager step."""

from __future__ import annotations

import torch

from torchtitan.components.adamw_bf16_state import AdamBF16State, adam_bf16_state_step


def test_the_compiled_step_has_a_static_graph_per_shape(monkeypatch):
    """Every graph the compiled step traces has concrete sizes, for a decoder's sequence of
    parameter shapes (Llama's: embedding, attention, MLP both ways, norm, output head): the
    kernel of a dynamic ``[s0, s1]`` graph cannot vectorise its loads. The steps' values
    equal the eager step's."""
    import torchtitan.components.adamw_bf16_state as module

    shapes = {"graphs": []}

    def recording_backend(gm, example_inputs):
        shapes["graphs"].append([
            tuple(n.meta["example_value"].shape) for n in gm.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)
        ])
        return gm

    torch._dynamo.reset()
    stepped = module.compiled_step(recording_backend)
    monkeypatch.setattr(module, "_step_fn", lambda p: stepped)
    torch.manual_seed(0)
    sizes = [(500, 32), (32, 32), (8, 32), (8, 32), (32, 32), (112, 32), (32, 112), (112, 32),
             (32,), (32,), (500, 32)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in sizes * 2]  # two "layers"
    eager = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opts = [AdamBF16State(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                          state_dtype=torch.float32) for ps in (params, eager)]
    for step in range(2):
        for ps in (params, eager):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
        opts[0].step()
        monkeypatch.setattr(module, "_step_fn", lambda p: adam_bf16_state_step)
        opts[1].step()
        monkeypatch.setattr(module, "_step_fn", lambda p: stepped)
    assert len(shapes["graphs"]) == len(set(sizes))  # one per shape, none after step 1
    for graph in shapes["graphs"]:
        for shape in graph:
            assert all(isinstance(d, int) for d in shape), f"dynamic graph: {graph}"
    for a, b in zip(params, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    torch._dynamo.reset()
