"""The Hugging Face import boundary refuses what it cannot convert faithfully, in one
``error:`` line naming the file or field, with nothing written. Both import paths
(scripts/convert_hf_to_dcp.py and ``checkpoint.initial_load_in_hf``): a shard missing (with or
without the index), truncated, with a corrupt header, or with a zeroed tail; a ``config.json``
that disagrees with the flavor or is another family's than the weights. DeepSeek's RoPE layout
is the imported folder's, and its YaRN keys survive HF -> DCP -> HF. Exports:
test_hf_boundary_export.py.

Random models are built offline (transformers configs, no downloads).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.conftest import REPO_ROOT, load_script  # noqa: E402
from torchtitan.components.checkpoint import (  # noqa: E402
    CheckpointError,
    CheckpointManager,
    fs,
    hf,
    hf_check,
    hf_files,
)
from torchtitan.config.job_config import Checkpoint  # noqa: E402
from torchtitan.models import get_model_spec  # noqa: E402
from torchtitan.models.common.moe import MoEArgs  # noqa: E402
from torchtitan.models.deepseek_v3 import DeepSeekV3Model  # noqa: E402
from torchtitan.models.deepseek_v3.hf_config import model_args_from_hf_config as ds_args  # noqa: E402
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter  # noqa: E402
from torchtitan.models.llama3 import llama3_args  # noqa: E402
from torchtitan.models.llama3.model import Transformer  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter  # noqa: E402
from torchtitan.models.qwen3.args import Qwen3ModelArgs  # noqa: E402
from torchtitan.models.qwen3.model import Qwen3Model  # noqa: E402
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter  # noqa: E402

VOCAB = 2256  # the test tokenizer's: the Llama folder is debugmodel_tiny's shape




def _randomize(model) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.25)


def _llama_folder(tmp_path: Path, sharded: bool = True) -> Path:
    """A LlamaForCausalLM of debugmodel_tiny's shape (21 tensors), sharded with an index."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=2048,
    )
    model = transformers.LlamaForCausalLM(cfg)
    _randomize(model)
    folder = tmp_path / "hf"
    model.save_pretrained(folder, max_shard_size="300KB" if sharded else "50MB")
    return folder


def _tiny_llama() -> Transformer:
    args = copy.deepcopy(llama3_args["debugmodel_tiny"])
    args.vocab_size = VOCAB
    model = Transformer(args)
    model.init_weights()
    return model


def _initial_load(tmp_path: Path, folder: Path, model, adapter) -> CheckpointManager:
    cfg = Checkpoint(enable=True, initial_load_path=str(folder), initial_load_in_hf=True)
    return CheckpointManager(None, [model], None, None, {}, cfg, str(tmp_path / "run"), adapter)


def _shard_of(folder: Path, key: str) -> Path:
    index = json.loads((folder / hf_files.INDEX).read_text())
    return folder / index["weight_map"][key]


def _damage(folder: Path, kind: str) -> str:
    """Damage an HF folder as a failed download or disk would; returns the file the error names."""
    emb = _shard_of(folder, "model.embed_tokens.weight")
    last = _shard_of(folder, "model.norm.weight")
    if kind == "missing":
        emb.unlink()
        return emb.name
    if kind == "missing_no_index":
        (folder / hf_files.INDEX).unlink()
        last.unlink()
        return last.name
    if kind == "truncated":
        os.truncate(emb, emb.stat().st_size - 100)
        return emb.name
    if kind == "header":
        with open(emb, "r+b") as f:
            f.seek(8)
            f.write(b"\x00garbage")
        return emb.name
    if kind == "zeroed_tail":  # the file's last tensor is the final norm
        header = hf_files.read_header(str(last))
        assert max(header, key=lambda k: header[k]["data_offsets"][1]) == "model.norm.weight"
        with open(last, "r+b") as f:
            f.seek(last.stat().st_size - 1024)
            f.write(bytes(1024))
        return last.name
    raise AssertionError(kind)


DAMAGE = ["missing", "missing_no_index", "truncated", "header", "zeroed_tail"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_convert_hf_to_dcp_refuses_a_damaged_folder(tmp_path, capsys, kind):
    folder = _llama_folder(tmp_path)
    name = _damage(folder, kind)
    out = tmp_path / "dcp"
    capsys.readouterr()  # transformers' progress bar
    assert load_script("convert_hf_to_dcp").main([str(folder), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and name in err, err
    assert not out.exists() and not Path(f"{out}.tmp").exists()


@pytest.mark.parametrize("kind", DAMAGE)
def test_initial_load_in_hf_refuses_a_damaged_folder(tmp_path, kind):
    folder = _llama_folder(tmp_path)
    name = _damage(folder, kind)
    model = _tiny_llama()
    manager = _initial_load(tmp_path, folder, model, Llama3StateDictAdapter(model.model_args))
    with pytest.raises(CheckpointError) as info:
        manager.load()
    assert name in str(info.value) and "\n" not in str(info.value), info.value


def test_a_tensor_missing_from_a_single_file_is_named(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = _llama_folder(tmp_path, sharded=False)
    sd = load_file(folder / "model.safetensors")
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "dcp"
    assert load_script("convert_hf_to_dcp").main([str(folder), str(out)]) == 2
    err = capsys.readouterr().err
    assert "has no weights for ['layers.1.feed_forward.w2.weight'] (1 of 21 missing)" in err, err
    assert not out.exists()


def test_an_intact_folder_converts_and_round_trips(tmp_path, capsys):
    """The checks refuse nothing whole: sharded HF -> DCP (records the architecture) -> HF."""
    folder = _llama_folder(tmp_path)
    out = tmp_path / "dcp"
    assert load_script("convert_hf_to_dcp").main([str(folder), str(out), "--flavor", "debugmodel_tiny"]) == 0
    assert hf.MODEL_ARGS_KEY in fs.read_marker(str(out))
    back = tmp_path / "back"
    assert load_script("convert_dcp_to_hf").main([str(out), str(back)]) == 0  # no --model/--flavor
    a, b = hf.load_safetensors_folder(str(folder)), hf.load_safetensors_folder(str(back))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- config.json


def test_config_json_disagreeing_with_the_flavor_is_refused(tmp_path):
    """Qwen3-MoE saved with norm_topk_prob false and rope theta 1e6, loaded into a flavor
    with routing renormalisation and theta 1e4: every shape matches, the model does not."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, rope_theta=1e6,
        max_position_embeddings=64,
    )
    hf_model = transformers.Qwen3MoeForCausalLM(cfg)
    _randomize(hf_model)
    folder = tmp_path / "hf"
    hf_model.save_pretrained(folder)
    args = Qwen3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128,
                          hidden_dim=96, moe_hidden_dim=32, rope_theta=1e4, max_seq_len=64,
                          moe_args=MoEArgs(num_experts=4, top_k=2, route_norm=True))
    model = Qwen3Model(args)
    model.init_weights()
    manager = _initial_load(tmp_path, folder, model, Qwen3StateDictAdapter(args))
    with pytest.raises(CheckpointError) as info:
        manager.load()
    assert str(info.value) == (
        f"{folder}/config.json: rope_theta is 1000000.0, the flavor has 10000.0 (also "
        "different: norm_topk_prob)"
    )
    args.rope_theta, args.moe_args.route_norm = 1e6, False  # the folder's own: loads
    model = Qwen3Model(args)
    assert _initial_load(tmp_path, folder, model, Qwen3StateDictAdapter(args)).load()


def test_convert_hf_to_dcp_flavor_check(tmp_path, capsys):
    folder = _llama_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    out = tmp_path / "dcp"
    script = load_script("convert_hf_to_dcp")
    capsys.readouterr()
    assert script.main([str(folder), str(out), "--flavor", "debugmodel_tiny"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {folder}/config.json: rms_norm_eps is 1e-06, the flavor has 1e-05\n"
    assert not out.exists()


def test_a_qwen3_config_over_llama_weights_is_refused(tmp_path, capsys):
    folder = _llama_folder(tmp_path)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    ).to_dict()
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "dcp"
    capsys.readouterr()
    assert load_script("convert_hf_to_dcp").main([str(folder), str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {folder}/config.json: model_type is qwen3, but the weights are a llama model's "
        "(this config.json does not belong to them)\n"
    )
    assert not out.exists()
    # the trainer: a llama run given that folder is told so by the config check
    model = _tiny_llama()
    with pytest.raises(CheckpointError, match=r"config.json: model_type is qwen3, the flavor is a llama3 model"):
        _initial_load(tmp_path, folder, model, Llama3StateDictAdapter(model.model_args)).load()


def _deepseek_config(**kw):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
            "beta_slow": 1, "original_max_position_embeddings": 16, "mscale": 1.0,
            "mscale_all_dim": 0.8}
    base = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=64, rope_parameters=rope,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )
    return transformers.DeepseekV3Config(**{**base, **kw})


def _deepseek_folder(tmp_path: Path, **kw):
    model = transformers.DeepseekV3ForCausalLM(_deepseek_config(**kw)).eval()
    _randomize(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.1)
    folder = tmp_path / "hf_ds"
    model.save_pretrained(folder)
    return model, folder


def _logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


def test_deepseek_rope_layout_comes_from_the_imported_folder(tmp_path):
    """A rope_interleave=false folder loaded while model.hf_assets_path (the tokenizer folder)
    says nothing (interleaved): the import follows the folder and matches HF's logits."""
    hf_model, folder = _deepseek_folder(tmp_path, rope_interleave=False)
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps({"rope_interleave": True}))
    args = ds_args(json.loads((folder / "config.json").read_text()))
    adapter = DeepSeekV3StateDictAdapter(args, hf_assets_path=str(assets))
    assert adapter.rope_interleave  # the tokenizer folder's layout
    model = DeepSeekV3Model(args)
    model.init_weights()
    assert _initial_load(tmp_path, folder, model, adapter).load()
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    assert (_logits(model.eval(), tokens) - _logits(hf_model, tokens)).abs().max().item() < 1e-4


# Hub config.json values of published releases: each must load into its flavor.
HUB = {
    ("llama3", "8B"): dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-05,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, hidden_act="silu", torch_dtype="bfloat16",
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    ("qwen3", "30B-A3B"): dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        rms_norm_eps=1e-06, rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=40960,
        tie_word_embeddings=False, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        use_sliding_window=False, sliding_window=None, max_window_layers=48),
    ("deepseek_v3", "671B"): dict(
        model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, kv_lora_rank=512,
        first_k_dense_replace=3, max_position_embeddings=163840, moe_intermediate_size=2048,
        n_group=8, n_routed_experts=256, n_shared_experts=1, norm_topk_prob=True,
        num_attention_heads=128, num_experts_per_tok=8, num_hidden_layers=61,
        num_key_value_heads=128, num_nextn_predict_layers=1, q_lora_rank=1536,
        qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-06, rope_theta=10000,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
        routed_scaling_factor=2.5, scoring_func="sigmoid", topk_group=4, topk_method="noaux_tc",
        v_head_dim=128, vocab_size=129280, tie_word_embeddings=False),
    ("deepseek_v3", "16B"): dict(
        model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, kv_lora_rank=512,
        first_k_dense_replace=1, max_position_embeddings=163840, moe_intermediate_size=1408,
        n_group=1, n_routed_experts=64, n_shared_experts=2, norm_topk_prob=False,
        num_attention_heads=16, num_experts_per_tok=6, num_hidden_layers=27,
        num_key_value_heads=16, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        rms_norm_eps=1e-06, rope_theta=10000,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                      "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"},
        routed_scaling_factor=1.0, scoring_func="softmax", topk_group=1, topk_method="greedy",
        v_head_dim=128, vocab_size=102400, tie_word_embeddings=False),
}


@pytest.mark.parametrize("model, flavor", list(HUB))
def test_published_configs_agree_with_their_flavors(model, flavor):
    spec = get_model_spec(model)
    adapter = spec.state_dict_adapter(spec.get_model_args(flavor))
    hf_check.compare_with_flavor(HUB[model, flavor], adapter, "config.json")  # no error
    wrong = {**HUB[model, flavor], "num_hidden_layers": 5}
    with pytest.raises(CheckpointError, match=r"^config.json: num_hidden_layers is 5, the flavor has \d+$"):
        hf_check.compare_with_flavor(wrong, adapter, "config.json")


def _yarn(config: dict) -> dict:
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    return {k: v for k, v in rope.items() if k not in ("type", "rope_type", "rope_theta")}


def test_deepseek_yarn_round_trip_keeps_hf_keys(tmp_path, capsys):
    """HF (mscale 1.0, mscale_all_dim 0.8) -> DCP -> HF: the same YaRN keys and values, and
    transformers computes the same logits from the export."""
    hf_model, folder = _deepseek_folder(tmp_path)
    original = json.loads((folder / "config.json").read_text())
    assert _yarn(DeepSeekV3StateDictAdapter.from_hf_config(original).hf_config()) == _yarn(original)
    dcp_dir, out = tmp_path / "dcp", tmp_path / "out"
    assert load_script("convert_hf_to_dcp").main([str(folder), str(dcp_dir)]) == 0
    assert load_script("convert_dcp_to_hf").main([str(dcp_dir), str(out), "--model", "deepseek_v3"]) == 0
    capsys.readouterr()
    exported = json.loads((out / "config.json").read_text())
    assert _yarn(exported) == _yarn(original) == {
        "factor": 4.0, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.8}
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    assert (_logits(back, tokens) - _logits(hf_model, tokens)).abs().max().item() < 1e-4


# --------------------------------------------------------------------------- the trainer


@pytest.mark.slow
def test_trainer_refuses_a_truncated_shard_in_one_line(tmp_path, cpu_env):
    folder = _llama_folder(tmp_path)
    name = _damage(folder, "truncated")
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan.train", "--job.config_file", "train_configs/debug_model.toml",
         "--model.flavor", "debugmodel_tiny", "--training.steps", "1", "--training.seq_len", "32",
         "--training.local_batch_size", "1", "--activation_checkpoint.mode", "none",
         "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf",
         "--job.dump_folder", str(tmp_path / "dump")],
        cwd=REPO_ROOT, env=cpu_env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if "error:" in line]
    assert proc.returncode == 2, out[-3000:]
    assert len(errors) == 1 and name in errors[0] and "truncated" in errors[0], errors
    assert "Traceback" not in out
