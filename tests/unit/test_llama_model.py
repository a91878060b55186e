"""Llama model: shapes, parameter counts, FLOPs, init statistics, forward behaviour."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from torchtitan.config.job_config import JobConfig
from torchtitan.models.common.rope import (
    RoPEScalingArgs,
    apply_rope_scaling,
    precompute_freqs_cis,
    rope_frequencies,
)
from torchtitan.models.llama2 import llama2_args
from torchtitan.models.llama3 import args as args_module
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Attention, Transformer

TINY = TransformerModelArgs(
    dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=32, max_seq_len=64
)


def meta_model(args: TransformerModelArgs) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def real_model(args: TransformerModelArgs, seed: int = 0) -> Transformer:
    """Build on meta, materialise on CPU, then initialise (the trainer's path)."""
    model = meta_model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


@pytest.fixture(scope="module")
def debug_model() -> Transformer:
    return real_model(copy.deepcopy(llama3_args["debugmodel"]), seed=0)


# published parameter counts (HF model cards / safetensors totals)
PUBLISHED = [
    (llama3_args, "1B", 1.24e9),
    (llama3_args, "8B", 8.03e9),
    (llama3_args, "70B", 70.6e9),
    (llama3_args, "405B", 405.9e9),
    (llama2_args, "7B", 6.74e9),
    (llama2_args, "13B", 13.0e9),
    (llama2_args, "70B", 69.0e9),
]


@pytest.mark.parametrize("flavors,flavor,published", PUBLISHED)
def test_param_counts_match_published(flavors, flavor, published):
    args = flavors[flavor]
    nparams, flops = args.get_nparams_and_flops(meta_model(args), seq_len=8192)
    assert abs(nparams - published) / published < 0.01, (flavor, nparams)
    assert flops > 6 * nparams * 0.5


@pytest.mark.parametrize(
    "flavor,dim,kv_dim,hidden",
    [
        ("1B", 2048, 512, 8192),
        ("8B", 4096, 1024, 14336),
        ("70B", 8192, 1024, 28672),
        ("405B", 16384, 1024, 53248),
    ],
)
def test_llama3_shapes(flavor, dim, kv_dim, hidden):
    args = llama3_args[flavor]
    model = meta_model(args)
    assert list(model.layers.keys()) == [str(i) for i in range(args.n_layers)]
    block = model.layers["0"]
    assert block.attention.wq.weight.shape == (dim, dim)
    assert block.attention.wk.weight.shape == (kv_dim, dim)
    assert block.attention.wv.weight.shape == (kv_dim, dim)
    assert block.attention.wo.weight.shape == (dim, dim)
    assert block.feed_forward.w1.weight.shape == (hidden, dim)
    assert block.feed_forward.w2.weight.shape == (dim, hidden)
    assert model.tok_embeddings.weight.shape == (128256, dim)
    assert (
        model.freqs_cis.shape == (args.max_seq_len, args.head_dim // 2)
        and model.freqs_cis.is_complex()
    )
    assert model.output.weight.is_meta
    assert (model.output.weight is model.tok_embeddings.weight) == (flavor == "1B")
    assert "freqs_cis" not in model.state_dict()


def test_llama2_shapes():
    m7 = meta_model(llama2_args["7B"])
    assert m7.layers["0"].attention.wk.weight.shape == (4096, 4096)  # multi-head
    assert m7.layers["0"].feed_forward.w1.weight.shape == (11008, 4096)
    assert m7.tok_embeddings.weight.shape == (32000, 4096)
    m13 = meta_model(llama2_args["13B"])
    assert len(m13.layers) == 40 and m13.layers["0"].feed_forward.w3.weight.shape == (13824, 5120)


def test_flops_formula_by_hand():
    args = replace(llama3_args["debugmodel"], vocab_size=2256)
    d, n_layers, hidden, vocab = 256, 8, 768, 2256
    per_layer = 4 * d * d + 3 * d * hidden + 2 * d  # wq wk wv wo, w1 w2 w3, two norms
    n_total = n_layers * per_layer + d + 2 * vocab * d  # final norm, embedding, output
    n_no_embedding = n_total - vocab * d
    nparams, flops = args.get_nparams_and_flops(meta_model(args), seq_len=2048)
    assert nparams == n_total == 7_975_168
    assert flops == 6 * n_no_embedding + 12 * 8 * 16 * 16 * 2048


def test_tied_flops_keep_output_matmul():
    args = replace(TINY, tie_word_embeddings=True)
    untied = replace(TINY, tie_word_embeddings=False)
    n_tied, f_tied = args.get_nparams_and_flops(meta_model(args), seq_len=16)
    n_untied, f_untied = untied.get_nparams_and_flops(meta_model(untied), seq_len=16)
    assert n_untied - n_tied == 97 * 64
    # both do the same matmuls: embedding excluded once in each
    assert f_tied == f_untied


def test_init_statistics(debug_model):
    model = debug_model
    emb = model.tok_embeddings.weight
    assert abs(emb.std().item() - 1.0) < 0.02
    for layer_id, block in model.layers.items():
        depth_std = 0.02 / math.sqrt(2 * (int(layer_id) + 1))
        assert abs(block.attention.wq.weight.std().item() - 0.02) < 0.001
        assert abs(block.feed_forward.w1.weight.std().item() - 0.02) < 0.001
        for w in (
            block.attention.wo.weight,
            block.feed_forward.w2.weight,
            block.feed_forward.w3.weight,
        ):
            assert abs(w.std().item() - depth_std) / depth_std < 0.05, layer_id
        assert torch.equal(block.attention_norm.weight, torch.ones(256))
        assert torch.equal(block.ffn_norm.weight, torch.ones(256))
    assert torch.equal(model.norm.weight, torch.ones(256))
    out = model.output.weight
    out_std = 256**-0.5
    assert out.abs().max().item() <= 3 * out_std + 1e-6  # truncated at 3 std
    assert abs(out.std().item() - 0.9866 * out_std) / out_std < 0.03  # 3-sigma truncation
    assert torch.allclose(model.freqs_cis, precompute_freqs_cis(16, 2048, 500000))


def test_init_without_depth_init():
    args = replace(TINY, depth_init=False, n_layers=4, dim=256, n_heads=4, n_kv_heads=None)
    model = real_model(args)
    expected = 0.02 / math.sqrt(2 * 4)
    for block in model.layers.values():
        assert abs(block.attention.wo.weight.std().item() - expected) / expected < 0.05


def test_forward_shape_and_finite_loss(debug_model):
    tokens = torch.randint(0, 2256, (2, 32))
    logits = debug_model(tokens)
    assert logits.shape == (2, 32, 2256) and logits.dtype == torch.float32
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    assert torch.isfinite(loss)
    # output std dim**-0.5 over RMS-normalised hidden states: loss near ln(V) at init
    assert abs(loss.item() - math.log(2256)) < 1.5


def test_causal(debug_model):
    torch.manual_seed(1)
    tokens = torch.randint(0, 2256, (1, 24))
    changed = tokens.clone()
    changed[0, 15] = (changed[0, 15] + 7) % 2256
    a, b = debug_model(tokens), debug_model(changed)
    assert torch.allclose(a[:, :15], b[:, :15], atol=1e-5)
    assert not torch.allclose(a[:, 15:], b[:, 15:], atol=1e-3)


def test_gqa_equals_mha_with_repeated_kv_heads():
    torch.manual_seed(0)
    gqa_args = replace(TINY, n_heads=4, n_kv_heads=2)
    gqa = Attention(gqa_args)
    mha = Attention(replace(gqa_args, n_kv_heads=None))
    head_dim = gqa_args.head_dim
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for src, dst in ((gqa.wk, mha.wk), (gqa.wv, mha.wv)):
            heads = src.weight.view(2, head_dim, -1)
            dst.weight.copy_(heads.repeat_interleave(2, dim=0).reshape(-1, 64))
    freqs = precompute_freqs_cis(head_dim, 16, 10000.0)
    x = torch.randn(2, 16, 64)
    assert torch.allclose(gqa(x, freqs), mha(x, freqs), atol=1e-5)


def test_attention_takes_head_count_from_weights():
    """Column-sharding wq/wk/wv and row-sharding wo (tensor parallel) needs no model change."""
    torch.manual_seed(0)
    full = Attention(TINY)
    freqs = precompute_freqs_cis(TINY.head_dim, 16, 10000.0)
    x = torch.randn(2, 16, 64)
    expected = full(x, freqs)
    total = torch.zeros_like(expected)
    q_rows, kv_rows = 2 * TINY.head_dim, 1 * TINY.head_dim  # 2 of 4 q heads, 1 of 2 kv heads
    for shard in range(2):
        part = copy.deepcopy(full)
        with torch.no_grad():
            part.wq.weight = torch.nn.Parameter(
                full.wq.weight[shard * q_rows : (shard + 1) * q_rows]
            )
            part.wk.weight = torch.nn.Parameter(
                full.wk.weight[shard * kv_rows : (shard + 1) * kv_rows]
            )
            part.wv.weight = torch.nn.Parameter(
                full.wv.weight[shard * kv_rows : (shard + 1) * kv_rows]
            )
            part.wo.weight = torch.nn.Parameter(
                full.wo.weight[:, shard * q_rows : (shard + 1) * q_rows]
            )
        total += part(x, freqs)
    assert torch.allclose(total, expected, atol=1e-5)


def test_tied_embeddings_survive_meta_init_and_dtype_cast():
    args = replace(TINY, tie_word_embeddings=True)
    model = real_model(args)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    std = 64**-0.5
    assert model.tok_embeddings.weight.abs().max().item() <= 3 * std + 1e-6
    model.to(torch.bfloat16)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.freqs_cis.is_complex()  # not silently cast to real
    assert torch.allclose(model.freqs_cis, precompute_freqs_cis(16, 64, 10000.0))
    logits = model(torch.randint(0, 97, (1, 8)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_pipeline_style_pruning_composes_to_full_model(debug_model):
    tokens = torch.randint(0, 2256, (2, 16))
    expected = debug_model(tokens)
    first, last = copy.deepcopy(debug_model), copy.deepcopy(debug_model)
    for i in range(4, 8):
        del first.layers[str(i)]
    for i in range(4):
        del last.layers[str(i)]
    first.norm = None
    first.output = None
    last.tok_embeddings = None
    hidden = first(tokens)
    assert hidden.shape == (2, 16, 256)
    assert torch.allclose(last(hidden), expected, atol=1e-5)
    # a stage can be initialised on its own: missing parts are skipped
    first.init_weights()
    last.init_weights()


def test_seeded_init_is_reproducible():
    a, b, c = real_model(TINY, seed=3), real_model(TINY, seed=3), real_model(TINY, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])


def test_rope_scaling_follows_llama31():
    scaling = RoPEScalingArgs(
        scale_factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    freqs = rope_frequencies(128, 500000.0)
    scaled = apply_rope_scaling(freqs, scaling)
    wavelen = 2 * math.pi / freqs
    high = wavelen < 8192 / 4.0  # short wavelengths: kept
    low = wavelen > 8192 / 1.0  # long wavelengths: divided by the factor
    mid = ~high & ~low
    assert high.sum() > 0 and low.sum() > 0 and mid.sum() > 0
    assert torch.equal(scaled[high], freqs[high])
    assert torch.allclose(scaled[low], freqs[low] / 8.0)
    assert (scaled[mid] < freqs[mid]).all() and (scaled[mid] > freqs[mid] / 8.0).all()
    # the table uses the scaled frequencies
    table = precompute_freqs_cis(128, 3, 500000.0, scaling)
    assert torch.allclose(torch.angle(table[1]), torch.angle(torch.polar(torch.ones(64), scaled)))


def test_flavor_rope_scaling():
    assert llama3_args["8B"].rope_scaling.scale_factor == 8.0
    assert llama3_args["1B"].rope_scaling.scale_factor == 32.0
    assert llama3_args["debugmodel"].rope_scaling is None
    assert all(a.rope_scaling is None and a.rope_theta == 10000 for a in llama2_args.values())


def test_invalid_args_raise_clear_errors():
    with pytest.raises(ValueError, match="attn_mask_type='sliding' must be 'causal' or 'block_causal'"):
        meta_model(replace(TINY, attn_mask_type="sliding"))
    with pytest.raises(ValueError, match="sliding_window_size=0 must be >= 1"):
        meta_model(replace(TINY, sliding_window_size=0))
    with pytest.raises(ValueError, match="n_heads=4 must be divisible by n_kv_heads=3"):
        meta_model(replace(TINY, n_kv_heads=3))
    with pytest.raises(ValueError, match="dim=66 must be divisible by n_heads=4"):
        meta_model(replace(TINY, dim=66))


def test_sequence_longer_than_rope_table_errors():
    model = real_model(replace(TINY, max_seq_len=8))
    with pytest.raises(ValueError, match="sequence length 9 exceeds the RoPE table"):
        model(torch.randint(0, 97, (1, 9)))


def test_update_from_config(monkeypatch):
    job = JobConfig()
    job.training.seq_len = 512
    debug = copy.deepcopy(llama3_args["debugmodel"])
    debug.update_from_config(job, tokenizer=SimpleNamespace(vocab_size=300))
    assert (debug.max_seq_len, debug.vocab_size) == (512, 300)

    warnings: list[str] = []
    monkeypatch.setattr(args_module.logger, "warning", warnings.append)
    real = copy.deepcopy(llama2_args["7B"])
    real.update_from_config(job, tokenizer=SimpleNamespace(vocab_size=128256))
    assert (real.max_seq_len, real.vocab_size) == (512, 32000)
    assert len(warnings) == 1 and "larger than the model's vocab_size 32000" in warnings[0]
    real.update_from_config(job, tokenizer=SimpleNamespace(vocab_size=100))
    assert real.vocab_size == 32000 and len(warnings) == 1
    assert llama3_args["debugmodel"].max_seq_len == 2048  # the registry's flavor is untouched
