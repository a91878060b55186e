"""RoPE's rotation (torchtitan/models/common/rope.py): eagerly a complex product, compiled the
same arithmetic written out in reals, to the bit; a compiled graph holds no complex op (which
inductor cannot generate code for: it would run eagerly on float32 copies of q and k)."""

from __future__ import annotations

import pytest
import torch

from torchtitan.models.common.rope import (
    YaRNScalingArgs,
    apply_rotary_emb,
    apply_rotary_emb_half,
    precompute_freqs_cis,
    rotate_pairs_real,
)

B, S, H, KV, D = 2, 48, 4, 2, 32


def _complex_reference(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """The rotation as a complex product: pair (2i, 2i+1) times freqs_cis[s, i]."""
    freqs = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)
    rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * freqs
    return torch.view_as_real(rotated).flatten(3).type_as(x)


def _half_reference(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half: x * cos + rotate_half(x) * sin, cos/sin from the complex table."""
    freqs = freqs_cis[: x.shape[1]]
    cos = torch.cat([freqs.real, freqs.real], -1)[None, :, None]
    sin = torch.cat([freqs.imag, freqs.imag], -1)[None, :, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).type_as(x)


def _tables() -> dict[str, torch.Tensor]:
    yarn = YaRNScalingArgs(factor=4.0, original_max_position_embeddings=16,
                           attention_factor=1.0 + 0.1 * 1.386)
    return {"plain": precompute_freqs_cis(D, 64, 10000.0),
            "yarn": precompute_freqs_cis(D, 64, 50000.0, yarn)}  # magnitude != 1


@pytest.mark.parametrize("table", ["plain", "yarn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_the_complex_product_bitwise(table, dtype):
    freqs_cis = _tables()[table]
    gen = torch.Generator().manual_seed(0)
    xq = torch.randn(B, S, H, D, generator=gen).to(dtype)
    xk = torch.randn(B, S, KV, D, generator=gen).to(dtype)
    # eager (the complex product) and compiled code's real arithmetic, either form of the table
    for rotary in (apply_rotary_emb, rotate_pairs_real):
        for table_form in (freqs_cis, torch.view_as_real(freqs_cis)):
            q, k = rotary(xq, xk, table_form)
            assert q.dtype == dtype and torch.equal(q, _complex_reference(xq, freqs_cis))
            assert torch.equal(k, _complex_reference(xk, freqs_cis))
    q, k = apply_rotary_emb_half(xq, xk, freqs_cis)
    assert torch.equal(q, _half_reference(xq, freqs_cis))
    assert torch.equal(k, _half_reference(xk, freqs_cis))


def _complex_activations_in_graph(fn, *args) -> list[str]:
    """The nodes of the graph dynamo captures for ``fn(*args)`` that hold a complex tensor of
    more than 2 dims: an activation (q, k), not the ``[seq, head_dim/2]`` RoPE table."""
    found: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor) and value.is_complex() and value.dim() > 2:
                found.append(node.name)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return found


def _eager_complex_rotation(xq, xk, freqs_cis):
    """The rotation as the eager path computes it, traced as is (q, k made complex)."""
    freqs = freqs_cis[: xq.shape[1]].unsqueeze(0).unsqueeze(2)
    return tuple(
        torch.view_as_real(torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * freqs)
        .flatten(3).type_as(x) for x in (xq, xk)
    )


@pytest.mark.parametrize("rotary", [apply_rotary_emb, apply_rotary_emb_half])
def test_a_compiled_rotation_keeps_q_and_k_real(rotary):
    freqs_cis = _tables()["yarn"]
    xq, xk = torch.randn(B, S, H, D), torch.randn(B, S, KV, D)
    assert _complex_activations_in_graph(rotary, xq, xk, freqs_cis) == []
    assert _complex_activations_in_graph(_eager_complex_rotation, xq, xk, freqs_cis)  # it sees them


def test_compiled_decoder_blocks_keep_q_and_k_real_and_give_the_eager_logits():
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model import Transformer

    args = llama3_args["debugmodel_tiny"]
    args = type(args)(**{**args.__dict__, "vocab_size": 64, "max_seq_len": S})
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    seen = []
    model.layers["0"].register_forward_pre_hook(lambda _m, a: seen.append(a[1]))
    tokens = torch.randint(0, 64, (B, S))
    eager = model(tokens)
    # the complex table: FSDP's mixed precision casts floating inputs of a block to bfloat16
    assert seen[0].is_complex() and seen[0].shape == (S, args.head_dim // 2)
    x = torch.randn(B, S, args.dim)
    assert _complex_activations_in_graph(model.layers["0"], x, seen[0]) == []
    torch._dynamo.reset()
    for key in list(model.layers):
        model.layers[key] = torch.compile(model.layers[key], backend="aot_eager")
    torch.testing.assert_close(model(tokens), eager, rtol=1e-5, atol=1e-5)


def test_a_sequence_longer_than_the_table_is_one_clear_error():
    freqs_cis = precompute_freqs_cis(D, 8)
    x = torch.zeros(1, 9, 1, D)
    for rotary in (apply_rotary_emb, apply_rotary_emb_half):
        with pytest.raises(ValueError, match="sequence length 9 exceeds the RoPE table"):
            rotary(x, x, freqs_cis)
