"""gpt-oss <-> transformers' GptOssForCausalLM: logits parity both ways (fp32, eager attention
with sinks), the interleaved gate/up layout, MXFP4-packed experts, the conversion scripts and
one-line refusals.

HF models are built offline from small configs (no downloads) with random weights scaled up so
attention, sinks and routing are far from uniform, biases and sinks non-zero, the SwiGLU clamp
active, and windows shorter than the sequence. Negative controls (sinks zeroed, window removed,
gate and up swapped) move the logits by O(1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.conftest import load_script  # noqa: E402
from torchtitan.components.checkpoint import fs, hf, load, save  # noqa: E402
from torchtitan.models.gpt_oss.args import GptOssModelArgs  # noqa: E402
from torchtitan.models.gpt_oss.model import GptOssModel  # noqa: E402
from torchtitan.models.gpt_oss.state_dict_adapter import (  # noqa: E402
    GptOssStateDictAdapter,
    dequantize_mxfp4,
    model_args_from_hf_config,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # 2 shared cores: OpenMP spin otherwise

REPO = Path(__file__).resolve().parents[2]
TOL = 5e-5
VOCAB = 128
SEQ = 24
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}
# three shapes: GQA + YaRN; MQA, custom layer types, plain RoPE, clamp at 1.5; top-3 of 6,
# YaRN with truncation and 8 heads of dim 8
CONFIGS = {
    "gqa_yarn": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, head_dim=16,
                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                     num_experts_per_tok=2, sliding_window=5, rope_parameters=YARN),
    "mqa_layer_types": dict(hidden_size=48, intermediate_size=40, num_hidden_layers=3, head_dim=12,
                            num_attention_heads=4, num_key_value_heads=1, num_local_experts=8,
                            num_experts_per_tok=4, sliding_window=7, swiglu_limit=1.5,
                            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "top3_truncate": dict(hidden_size=64, intermediate_size=24, num_hidden_layers=4, head_dim=8,
                          num_attention_heads=8, num_key_value_heads=4, num_local_experts=6,
                          num_experts_per_tok=3, sliding_window=3,
                          rope_parameters={**YARN, "truncate": True, "factor": 8.0}),
}




def _scale_up(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "sinks" in name:
                p.normal_(0.0, 2.0)
            else:
                p.normal_(0.0, 0.25)


def _hf_model(name: str):
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, max_position_embeddings=64,
                                    **CONFIGS[name])
    cfg._attn_implementation = "eager"  # the reference: scores with a sink column
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).eval()
    _scale_up(model)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


def _ours(args: GptOssModelArgs, sd: dict[str, torch.Tensor]) -> GptOssModel:
    args.max_seq_len = SEQ
    model = GptOssModel(args)
    model.init_weights()
    model.load_state_dict(sd, strict=True)
    return model.eval()


def _args_of(hf_model) -> GptOssModelArgs:
    return model_args_from_hf_config(hf_model.config.to_dict())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_to_ours_logits_match_and_controls_move_them(name):
    ref_model = _hf_model(name)
    args = _args_of(ref_model)
    sd = GptOssStateDictAdapter(args).from_hf(ref_model.state_dict())
    tokens = _tokens()
    ref = _logits(ref_model, tokens)
    ours = _ours(args, sd)
    diff = (_logits(ours, tokens) - ref).abs().max().item()
    assert diff < TOL and ref.abs().max() > 3, diff
    assert any(args.attention_window(i) for i in range(args.n_layers))  # windows < SEQ bite
    # negative controls: each change moves the logits by O(1)
    no_sinks = {k: torch.zeros_like(v) if k.endswith("sinks") else v for k, v in sd.items()}
    assert (_logits(_ours(args, no_sinks), tokens) - ref).abs().max() > 0.1
    args_full = _args_of(ref_model)
    args_full.sliding_window_size = None
    assert (_logits(_ours(args_full, sd), tokens) - ref).abs().max() > 0.1
    swapped = dict(sd)
    for key in [k for k in sd if k.endswith("experts.w1")]:
        swapped[key], swapped[key.replace("w1", "w3")] = sd[key.replace("w1", "w3")], sd[key]
    assert (_logits(_ours(args, swapped), tokens) - ref).abs().max() > 0.1


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ours_to_hf_logits_match(name):
    args = _args_of(_hf_model(name))
    args.max_seq_len = SEQ
    torch.manual_seed(3)
    ours = GptOssModel(args)
    ours.init_weights()
    _scale_up(ours)
    hf_sd = GptOssStateDictAdapter(args).to_hf(ours.state_dict())
    cfg = transformers.AutoConfig.for_model(**GptOssStateDictAdapter(args).hf_config())
    cfg._attn_implementation = "eager"
    back = transformers.GptOssForCausalLM(cfg).eval()
    back.load_state_dict(hf_sd, strict=True)
    tokens = _tokens()
    ref = _logits(ours, tokens)
    assert (_logits(back, tokens) - ref).abs().max().item() < TOL and ref.abs().max() > 3


def _mxfp4_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The published MXFP4 decode, written out: each byte holds two e2m1 values (low nibble
    first), each group of 32 shares the power of two ``scale - 127`` (e8m0)."""
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    b = blocks.to(torch.int64)
    pairs = torch.stack([e2m1[b & 0x0F], e2m1[b >> 4]], dim=-1).flatten(-2)  # [E, R, G, 32]
    values = pairs * torch.exp2(scales.to(torch.float32) - 127).unsqueeze(-1)
    return values.flatten(-2).transpose(1, 2)  # [E, G * 32, R]: HF's x @ W layout


def test_mxfp4_packed_experts_are_dequantized_on_import():
    ref_model = _hf_model("gqa_yarn")
    args = _args_of(ref_model)
    adapter = GptOssStateDictAdapter(args)
    g = torch.Generator().manual_seed(5)
    packed, dense = {}, dict(ref_model.state_dict())
    e, d, inter = 4, 64, 32
    for proj, rows, cols in (("gate_up_proj", 2 * inter, d), ("down_proj", d, inter)):
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(120, 130, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
        for layer in range(args.n_layers):
            key = f"model.layers.{layer}.mlp.experts.{proj}"
            packed[f"{key}_blocks"], packed[f"{key}_scales"] = blocks, scales
            dense[key] = _mxfp4_reference(blocks, scales)
        decoded = dequantize_mxfp4(blocks, scales)
        assert decoded.dtype == torch.bfloat16 and decoded.shape == (e, cols, rows)
        assert torch.equal(decoded.float(), _mxfp4_reference(blocks, scales))
    hf_keys = {k: v for k, v in ref_model.state_dict().items()
               if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    from_packed = adapter.from_hf({**hf_keys, **packed})
    from_dense = adapter.from_hf(dense)
    assert sorted(from_packed) == sorted(from_dense)
    for key, value in from_dense.items():
        torch.testing.assert_close(from_packed[key].float(), value.float(), rtol=0, atol=0,
                                   msg=key)
    assert GptOssStateDictAdapter.hf_pattern_of("model.layers.3.mlp.experts.down_proj_scales") == ""
    with pytest.raises(ValueError, match="has model.layers.0.mlp.experts.down_proj_blocks but no"):
        adapter.from_hf({"model.layers.0.mlp.experts.down_proj_blocks": packed[
            "model.layers.0.mlp.experts.down_proj_blocks"]})


def test_scripts_convert_both_ways_and_transformers_loads_the_export(tmp_path, capsys):
    """HF folder -> convert_hf_to_dcp (family from config.json) -> DCP -> our logits; our
    checkpoint -> convert_dcp_to_hf -> AutoModelForCausalLM, offline."""
    ref_model = _hf_model("gqa_yarn")
    folder = tmp_path / "hf"
    ref_model.save_pretrained(folder)
    args = model_args_from_hf_config(json.loads((folder / "config.json").read_text()))
    out = tmp_path / "dcp"
    assert load_script("convert_hf_to_dcp").main([str(folder), str(out)]) == 0
    assert fs.verify_checkpoint(str(out))[0] == ""
    tokens = _tokens()
    ref = _logits(ref_model, tokens)
    ours = _ours(args, load.load_dcp_model_tensors(str(out)))
    assert (_logits(ours, tokens) - ref).abs().max().item() < TOL

    ckpt = tmp_path / "step-3"
    weights = {k: v.detach() for k, v in ours.state_dict().items()}
    save.save_dcp_single_process(weights, str(ckpt),
                                 {"step": 3, **hf.model_info(GptOssStateDictAdapter(args))})
    export = tmp_path / "export"
    assert load_script("convert_dcp_to_hf").main([str(ckpt), str(export), "--model", "gpt_oss"]) == 0
    capsys.readouterr()
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["rope_parameters"]["truncate"] is False
    back = transformers.AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager")
    assert type(back).__name__ == "GptOssForCausalLM"
    assert (_logits(back.eval(), tokens) - ref).abs().max().item() < TOL


def test_published_config_reads_as_the_flavors():
    """The official config.json values (legacy rope_scaling + rope_theta, MXFP4 quantization
    config) give the 20B / 120B flavors."""
    from torchtitan.components.checkpoint import hf_check
    from torchtitan.models import get_model_spec

    spec = get_model_spec("gpt_oss")
    for flavor, (layers, experts) in {"20B": (24, 32), "120B": (36, 128)}.items():
        official = {
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "attention_bias": True, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
            "hidden_size": 2880, "initial_context_length": 4096, "intermediate_size": 2880,
            "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
            "max_position_embeddings": 131072, "num_attention_heads": 64,
            "num_experts_per_tok": 4, "num_hidden_layers": layers, "num_key_value_heads": 8,
            "num_local_experts": experts, "rms_norm_eps": 1e-05, "rope_theta": 150000,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "rope_type": "yarn",
                             "truncate": False},
            "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
            "vocab_size": 201088, "quantization_config": {"quant_method": "mxfp4"},
        }
        adapter = spec.state_dict_adapter(spec.get_model_args(flavor))
        hf_check.compare_with_flavor(official, adapter, "config.json")  # no difference
        args = model_args_from_hf_config(official)
        assert (args.n_layers, args.moe_args.num_experts, args.rope_truncate) == (layers, experts, False)


def test_refusals_are_one_line():
    args = _args_of(_hf_model("gqa_yarn"))
    adapter = GptOssStateDictAdapter(args)
    with pytest.raises(ValueError, match="cannot map 1 HF key"):
        adapter.from_hf({"model.layers.0.mlp.shared_expert.weight": torch.zeros(1)})
    args.moe_args.expert_activation = "swiglu"
    with pytest.raises(ValueError, match="expert_activation='swiglu' cannot be expressed in HF gpt-oss"):
        GptOssStateDictAdapter(args).hf_config()
    with pytest.raises(ValueError, match="tie_word_embeddings=true is not supported"):
        model_args_from_hf_config({"model_type": "gpt_oss", "tie_word_embeddings": True})
    with pytest.raises(ValueError, match="rope type 'llama3' is not supported"):
        model_args_from_hf_config({"model_type": "gpt_oss", "rope_scaling": {"rope_type": "llama3"}})


def test_bf16_round_trip_is_exact():
    args = _args_of(_hf_model("mqa_layer_types"))
    with torch.device("meta"):
        shapes = GptOssModel(args).state_dict()
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(v.shape, generator=g).to(torch.bfloat16) for k, v in shapes.items()
          if not k.endswith("expert_bias")}
    adapter = GptOssStateDictAdapter(args)
    hf_sd = adapter.to_hf(sd)
    assert hf_sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 48, 80)
    # gate at even, up at odd columns of HF's x @ W layout
    assert torch.equal(hf_sd["model.layers.0.mlp.experts.gate_up_proj"][1, :, 2 * 5],
                       sd["layers.0.moe.experts.w1"][1, 5])
    assert torch.equal(hf_sd["model.layers.0.mlp.experts.gate_up_proj_bias"][1, 2 * 5 + 1],
                       sd["layers.0.moe.experts.b3"][1, 5])
    back = adapter.from_hf(hf_sd)
    for key, value in sd.items():
        assert back[key].dtype == torch.bfloat16 and torch.equal(back[key], value), key
    assert torch.equal(back["layers.2.moe.expert_bias"], torch.zeros(8))  # HF has none
