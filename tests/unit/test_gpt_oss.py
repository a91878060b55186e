"""gpt-oss: published sizes (params equal transformers' GptOssForCausalLM on meta), FLOPs,
YaRN table, per-layer windows, one-line errors."""

from __future__ import annotations

import pytest
import torch

from torchtitan.models import get_model_spec
from torchtitan.models.gpt_oss.args import GptOssModelArgs

transformers = pytest.importorskip("transformers")

# The Hub config.json of each release, written out (not derived from our flavors).
OFFICIAL = dict(
    hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
    num_key_value_heads=8, num_experts_per_tok=4, vocab_size=201088, rms_norm_eps=1e-5,
    sliding_window=128, swiglu_limit=7.0, attention_bias=True, tie_word_embeddings=False,
    max_position_embeddings=131072,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
)
RELEASES = {"20B": dict(num_hidden_layers=24, num_local_experts=32),
            "120B": dict(num_hidden_layers=36, num_local_experts=128)}
# (params, active params without the embedding, FLOPs/token at T=8192)
EXPECTED = {"20B": (20_914_757_184, 3_608_307_264, 3.1314e10),
            "120B": (116_829_156_672, 5_132_849_472, 4.5293e10)}


def _meta_model(flavor: str, seq_len: int = 8192):
    spec = get_model_spec("gpt_oss")
    args = spec.get_model_args(flavor)
    args.max_seq_len = seq_len
    with torch.device("meta"):
        return spec.model_cls(args), args


@pytest.mark.parametrize("flavor", list(RELEASES))
def test_published_sizes_equal_transformers_on_meta(flavor):
    model, args = _meta_model(flavor)
    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(
            transformers.GptOssConfig(**OFFICIAL, **RELEASES[flavor]))
    n_hf = sum(p.numel() for p in hf.parameters())
    nparams, flops = args.get_nparams_and_flops(model, 8192)
    params, active, expected_flops = EXPECTED[flavor]
    assert nparams == n_hf == params  # ~21B / ~117B published
    attention = 6 * args.n_layers * args.n_heads * 8192 * 2 * args.head_dim
    assert (flops - attention) / 6 == active  # 3.6B / 5.1B active published
    assert flops == pytest.approx(expected_flops, rel=1e-4)


def test_rope_table_is_transformers_yarn():
    """Frequencies, truncate=False and the attention factor on cos/sin, as HF computes them."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    model, args = _meta_model("20B", seq_len=64)
    ours = model._precompute_freqs_cis(device=torch.device("cpu"))
    hf = GptOssRotaryEmbedding(transformers.GptOssConfig(**OFFICIAL, **RELEASES["20B"]))
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), torch.arange(64)[None])
    torch.testing.assert_close(ours.real, cos[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(ours.imag, sin[0], rtol=0, atol=2e-6)
    assert abs(hf.attention_scaling - 1.3465735902799727) < 1e-12  # 0.1 ln 32 + 1


def test_windows_alternate_from_layer_zero_unless_layer_types_say_otherwise():
    args = GptOssModelArgs(n_layers=4)
    assert [args.attention_window(i) for i in range(4)] == [128, None, 128, None]
    hf = transformers.GptOssConfig(**OFFICIAL, num_hidden_layers=4)
    assert hf.layer_types == ["sliding_attention", "full_attention"] * 2
    custom = GptOssModelArgs(n_layers=2, layer_types=["full_attention", "sliding_attention"],
                             sliding_window_size=16)
    assert [custom.attention_window(i) for i in range(2)] == [None, 16]


def test_every_layer_gets_its_own_mask():
    spec = get_model_spec("gpt_oss")
    args = spec.get_model_args("debugmodel")
    args.max_seq_len, args.vocab_size, args.sliding_window_size = 16, 64, 4
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    seen = {}
    for key, layer in model.layers.items():
        layer.register_forward_pre_hook(
            lambda m, a, kw, key=key: seen.__setitem__(key, kw["attention_mask"]), with_kwargs=True)
    model(torch.randint(0, 64, (2, 16)))
    window = torch.ones(16, 16, dtype=torch.bool).tril() & ~torch.ones(16, 16, dtype=torch.bool).tril(-4)
    assert torch.equal(seen["0"][0, 0], window) and torch.equal(seen["2"][0, 0], window)
    assert seen["1"] is None and seen["3"] is None  # full causal (sinks: causal mask inside)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("layer_types", ["full_attention"], "layer_types has 1 entries for n_layers=4"),
    ("layer_types", ["full_attention", "local", "full_attention", "full_attention"],
     r"layer_types \['local'\] must be one of"),
    ("n_kv_heads", 3, "n_heads=8 must be divisible by n_kv_heads=3"),
    ("tie_word_embeddings", True, "tie_word_embeddings=True is not supported"),
    ("sliding_window_size", 0, "sliding_window_size=0 must be >= 1"),
])
def test_bad_settings_are_one_line(field, value, message):
    args = get_model_spec("gpt_oss").get_model_args("debugmodel")
    setattr(args, field, value)
    with pytest.raises(ValueError, match=message) as info:
        args.validate()
    assert "\n" not in str(info.value)


def test_block_causal_composes_with_windows_and_sinks():
    """With document masking, a packed document's logits equal the document run alone (RoPE,
    windows and sinks are all relative to the document's own tokens)."""
    from torchtitan.models.common.document_mask import document_ids

    spec = get_model_spec("gpt_oss")
    args = spec.get_model_args("debugmodel")
    args.max_seq_len, args.vocab_size, args.sliding_window_size = 24, 64, 5
    args.attn_mask_type = "block_causal"
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 2)
    tokens = torch.randint(2, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    tokens[0, 10] = 1  # BOS: a second document starts at position 10
    with torch.no_grad():
        packed = model(tokens, document_ids=document_ids(tokens, bos_id=1, eos_id=-1))
        alone = model(tokens[:, 10:], document_ids=torch.zeros(1, 14, dtype=torch.int32))
        causal_args = spec.get_model_args("debugmodel")
        causal_args.max_seq_len, causal_args.vocab_size, causal_args.sliding_window_size = 24, 64, 5
        causal = spec.model_cls(causal_args)
        causal.load_state_dict(model.state_dict())
        across = causal(tokens)
    torch.testing.assert_close(packed[:, 10:], alone, rtol=0, atol=2e-5)
    assert (across[:, 10:] - alone).abs().max() > 1e-2  # without the mask, doc 1 leaks in


def test_sinks_take_context_parallels_masked_path_even_without_windows():
    """Ring attention merges plain causal SDPA blocks and cannot add a sink: a model with sinks
    always takes the masked all-gather path (tests/distributed/test_gpt_oss_parallel.py, CP2)."""
    from torchtitan.models.common.document_mask import uses_attention_mask

    args = GptOssModelArgs(sliding_window_size=None, use_flex_attn=False)
    assert uses_attention_mask(args)
    args.attention_sinks = False
    assert not uses_attention_mask(args)
