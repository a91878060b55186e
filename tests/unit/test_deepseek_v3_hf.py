"""HF <-> torchtitan DeepSeek-V3: converted weights give the same logits as transformers'
DeepseekV3ForCausalLM (fp32, max abs diff < 1e-4 on logits of magnitude ~8; measured 1e-5 to
4e-5), in both directions, with q LoRA on and off, group-limited sigmoid routing with a non-zero
routing bias, shared experts, first-k dense layers, YaRN (mscale != 1) and both RoPE layouts
(``rope_interleave``). DeepSeek-V2 (softmax routing, the 16B flavor's kind) against
DeepseekV2ForCausalLM. Random models are built offline from a config (no downloads), weights
scaled up so attention and routing are far from uniform (see the negative controls).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.conftest import load_script  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager, hf, load, save  # noqa: E402
from torchtitan.config.job_config import Checkpoint  # noqa: E402
from torchtitan.models.deepseek_v3 import DeepSeekV3Model  # noqa: E402
from torchtitan.models.deepseek_v3.hf_config import model_args_from_hf_config  # noqa: E402
from torchtitan.models.deepseek_v3.state_dict_adapter import (  # noqa: E402
    DeepSeekV3StateDictAdapter,
    dequantize_fp8,
)

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4
VOCAB = 128




def _config(q_lora: int | None = 24, interleave: bool = True, yarn: bool = True, **kw):
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                "beta_slow": 1, "original_max_position_embeddings": 16, "mscale": 0.8,
                "mscale_all_dim": 0.8}
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        q_lora_rank=q_lora, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        max_position_embeddings=64, rope_parameters=rope, rope_interleave=interleave,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )
    return transformers.DeepseekV3Config(**{**base, **kw})


def _randomize(model) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.25)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.1)


def _hf_model(tmp_path: Path, cls=None, **kw):
    cls = cls or transformers.DeepseekV3ForCausalLM
    config = kw.pop("config", None) or _config(**kw)
    model = cls(config).eval()
    _randomize(model)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return model, folder


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


def _logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


def _ours(args, sd) -> DeepSeekV3Model:
    model = DeepSeekV3Model(args)
    model.init_weights()
    model.load_state_dict(sd, strict=True)
    return model.eval()


@pytest.mark.parametrize(
    "q_lora, interleave, yarn",
    [(24, True, True), (None, False, True), (24, False, False), (None, True, False)],
)
def test_hf_to_ours_logits_match(tmp_path, capsys, q_lora, interleave, yarn):
    ref_model, folder = _hf_model(tmp_path, q_lora=q_lora, interleave=interleave, yarn=yarn)
    keys = set(hf.load_safetensors_folder(str(folder)))
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys  # the Hub's per-expert names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in keys
    out = tmp_path / "dcp"
    assert load_script("convert_hf_to_dcp").main([str(folder), str(out)]) == 0
    assert "--checkpoint.initial_load_path" in capsys.readouterr().out
    config = json.loads((folder / "config.json").read_text())
    args = model_args_from_hf_config(config)
    assert (args.q_lora_rank, args.n_dense_layers, args.moe_args.num_expert_groups) == (q_lora or 0, 1, 4)
    ours = _ours(args, load.load_dcp_model_tensors(str(out)))
    tokens = _tokens()
    ref = _logits(ref_model, tokens)
    diff = (_logits(ours, tokens) - ref).abs().max().item()
    assert diff < TOL, diff
    if not interleave:  # negative control: the rope rows must be permuted
        raw = DeepSeekV3StateDictAdapter(args, rope_interleave=True).from_hf(
            hf.load_safetensors_folder(str(folder)))
        assert (_logits(_ours(args, raw), tokens) - ref).abs().max().item() > 0.1
    if yarn:  # negative control: routing without the group limit picks other experts
        args.moe_args.num_expert_groups = args.moe_args.num_limited_groups = None
        wrong = _ours(args, load.load_dcp_model_tensors(str(out)))
        assert (_logits(wrong, tokens) - ref).abs().max().item() > 0.1


@pytest.mark.parametrize("interleave", [True, False])
def test_ours_to_hf_export_matches(tmp_path, interleave):
    """Ours (random init) -> DCP -> scripts/convert_dcp_to_hf.py -> transformers."""
    _, folder = _hf_model(tmp_path, interleave=interleave)
    adapter = DeepSeekV3StateDictAdapter.from_hf_config(json.loads((folder / "config.json").read_text()))
    torch.manual_seed(3)
    ours = DeepSeekV3Model(adapter.model_args)
    ours.init_weights()
    with torch.no_grad():
        for layer in (ours.layers["1"], ours.layers["2"]):
            layer.moe.expert_bias.normal_(0.0, 0.1)  # as after load balancing
    ckpt = tmp_path / "step-7"
    state = {k: v.detach() for k, v in ours.state_dict().items()}
    save.save_dcp_single_process(state, str(ckpt), {"step": 7, **hf.model_info(adapter)})
    out = tmp_path / "export"
    assert load_script("convert_dcp_to_hf").main([str(ckpt), str(out), "--model", "deepseek_v3"]) == 0
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == ["DeepseekV3ForCausalLM"] and exported["rope_interleave"]
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = _tokens()
    diff = (_logits(back, tokens) - _logits(ours, tokens)).abs().max().item()
    assert diff < TOL, diff


def test_deepseek_v2_softmax_routing_matches(tmp_path):
    """DeepSeek-V2(-Lite) layout and routing (softmax top-k, no bias): HF -> ours -> HF."""
    config = transformers.DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=2, n_routed_experts=8, num_experts_per_tok=3, q_lora_rank=None,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        max_position_embeddings=64, topk_method="greedy", routed_scaling_factor=1.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "mscale": 0.707,
                         "mscale_all_dim": 0.707},
    )
    ref_model, folder = _hf_model(tmp_path, cls=transformers.DeepseekV2ForCausalLM, config=config)
    adapter = DeepSeekV3StateDictAdapter.from_hf_config(json.loads((folder / "config.json").read_text()))
    args = adapter.model_args
    assert (args.moe_args.score_func, args.moe_args.load_balance_coeff) == ("softmax", None)
    sd = adapter.from_hf(hf.load_safetensors_folder(str(folder)))
    assert torch.equal(sd["layers.2.moe.expert_bias"], torch.zeros(8))  # V2 has no routing bias
    ours = _ours(args, sd)
    tokens = _tokens()
    assert (_logits(ours, tokens) - _logits(ref_model, tokens)).abs().max().item() < TOL
    out = tmp_path / "export"
    hf.write_hf_folder(str(out), ours.state_dict(), adapter, "float32")
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v2"
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert (_logits(back, tokens) - _logits(ref_model, tokens)).abs().max().item() < TOL


def test_checkpoint_manager_hf_initial_load_and_last_save(tmp_path):
    ref_model, folder = _hf_model(tmp_path)
    adapter = DeepSeekV3StateDictAdapter(
        model_args_from_hf_config(json.loads((folder / "config.json").read_text())),
        hf_assets_path=str(folder),
    )
    model = DeepSeekV3Model(adapter.model_args)
    model.init_weights()

    def manager(**kw) -> CheckpointManager:
        cfg = Checkpoint(enable=True, interval=100, **kw)
        return CheckpointManager(None, [model], None, None, {}, cfg, str(tmp_path / "run"), adapter)

    assert manager(initial_load_path=str(folder), initial_load_in_hf=True).load()
    tokens = _tokens()
    ref = _logits(ref_model, tokens)
    assert (_logits(model.eval(), tokens) - ref).abs().max().item() < TOL
    manager(last_save_in_hf=True, last_save_model_only=True).save(5, last_step=True)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "run" / "checkpoint" / "step-5" / "hf").eval()
    assert (_logits(back, tokens) - ref).abs().max().item() < TOL


def test_fp8_dequantization_and_mtp_layer_dropped():
    w = torch.randn(200, 130)
    scale = torch.rand(2, 2) + 0.5
    fp8 = (w / scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :130]).to(
        torch.float8_e4m3fn)
    deq = dequantize_fp8(fp8, scale).float()
    assert deq.dtype == torch.float32 and (deq - w).abs().max() < 0.1 * w.abs().max()
    assert deq[0, 0] == pytest.approx(fp8[0, 0].float().item() * scale[0, 0].item(), rel=1e-2)
    assert deq[150, 129] == pytest.approx(fp8[150, 129].float().item() * scale[1, 1].item(), rel=1e-2)

    args = model_args_from_hf_config(_config().to_dict())
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    ours = {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}
    adapter = DeepSeekV3StateDictAdapter(args)
    hf_sd = adapter.to_hf(ours)
    hf_sd["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # DeepSeek-V3's MTP layer
    hf_sd["model.layers.3.self_attn.o_proj.weight"] = torch.zeros(64, 48)
    key = "model.layers.0.self_attn.o_proj.weight"
    hf_sd[key] = torch.ones(64, 48).to(torch.float8_e4m3fn)
    hf_sd[key + "_scale_inv"] = torch.full((1, 1), 3.0)
    back = adapter.from_hf(hf_sd)
    assert set(back) == set(ours)
    assert torch.equal(back["layers.0.attention.wo.weight"], torch.full((64, 48), 3.0, dtype=torch.bfloat16))
    hf_sd.pop("model.layers.3.eh_proj.weight")
    with pytest.raises(ValueError, match="cannot map 1 HF key"):
        adapter.from_hf(hf_sd)
    hf_sd.pop("model.layers.3.self_attn.o_proj.weight")
    hf_sd.pop("model.layers.2.mlp.experts.5.up_proj.weight")
    with pytest.raises(ValueError, match=r"HF layer 2 lacks expert\(s\) \[5\] \(up_proj\)"):
        adapter.from_hf(hf_sd)
