"""HF <-> torchtitan Llama: converted weights give the same logits (fp32, max abs diff < 1e-4
on logits of magnitude ~5, i.e. a few ulps; the two models compute RoPE differently).

A random ``transformers`` LlamaForCausalLM is built offline from a LlamaConfig (no downloads),
with weights scaled up so attention is far from uniform (a wrong wq/wk permutation then moves
the logits by O(1), see the negative control).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.conftest import load_script  # noqa: E402
from torchtitan.components.checkpoint import (  # noqa: E402
    CheckpointError,
    CheckpointManager,
    fs,
    load,
    save,
)
from torchtitan.config.job_config import Checkpoint  # noqa: E402
from torchtitan.models.llama3 import llama3_args  # noqa: E402
from torchtitan.models.llama3.model import Transformer  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import (  # noqa: E402
    Llama3StateDictAdapter,
    hf_config_from_model_args,
    model_args_from_hf_config,
    permute_from_hf,
    permute_to_hf,
)

REPO = Path(__file__).resolve().parents[2]



TOL = 1e-4
VOCAB = 256


def _hf_model(tmp_path: Path, tied: bool = False) -> tuple[object, Path]:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.25)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return model, folder


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))


def _hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def _ours(folder_or_sd, args) -> Transformer:
    model = Transformer(args)
    model.init_weights()
    sd = load.load_dcp_model_tensors(str(folder_or_sd)) if not isinstance(folder_or_sd, dict) else folder_or_sd
    model.load_state_dict(sd, strict=True)
    return model.eval()


def test_permutation_roundtrip():
    w = torch.randn(32, 8)
    assert torch.equal(permute_from_hf(permute_to_hf(w, 4), 4), w)
    assert not torch.equal(permute_to_hf(w, 4), w)


@pytest.mark.parametrize("tied", [False, True])
def test_hf_to_ours_logits_match(tmp_path, capsys, tied):
    hf, folder = _hf_model(tmp_path, tied)
    out = tmp_path / "dcp"
    assert load_script("convert_hf_to_dcp").main([str(folder), str(out)]) == 0
    assert "--checkpoint.initial_load_path" in capsys.readouterr().out
    assert fs.verify_checkpoint(str(out)) == ("", fs.read_marker(str(out)))  # a committed checkpoint
    args = model_args_from_hf_config(json.loads((folder / "config.json").read_text()))
    assert args.ffn_hidden_dim == 192 and args.rope_scaling is not None and args.tie_word_embeddings == tied
    ours = _ours(out, args)
    tokens = _tokens()
    ref = _hf_logits(hf, tokens)
    with torch.no_grad():
        got = ours(tokens)
    assert (got - ref).abs().max().item() < TOL
    # negative control: without the wq/wk permutation the logits are clearly different
    raw = load.load_dcp_model_tensors(str(out))
    for i in range(args.n_layers):
        raw[f"layers.{i}.attention.wq.weight"] = permute_to_hf(raw[f"layers.{i}.attention.wq.weight"], 4)
        raw[f"layers.{i}.attention.wk.weight"] = permute_to_hf(raw[f"layers.{i}.attention.wk.weight"], 2)
    with torch.no_grad():
        wrong = _ours(raw, args)(tokens)
    assert (wrong - ref).abs().max().item() > 0.1


def test_ours_to_hf_export_matches(tmp_path, capsys):
    args = llama3_args["debugmodel_tiny"]
    args = type(args)(**{**args.__dict__, "vocab_size": VOCAB, "max_seq_len": 64})
    torch.manual_seed(3)
    ours = Transformer(args)
    ours.init_weights()
    ckpt = tmp_path / "step-7"
    save.save_dcp_single_process({k: v.detach() for k, v in ours.state_dict().items()}, str(ckpt), {"step": 7})
    out = tmp_path / "export"
    script = load_script("convert_dcp_to_hf")
    assert script.main([str(ckpt), str(out), "--flavor", "debugmodel_tiny"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = _tokens()
    with torch.no_grad():
        ref = ours.eval()(tokens)
    assert (_hf_logits(hf, tokens) - ref).abs().max().item() < TOL
    capsys.readouterr()
    assert script.main([str(ckpt), str(tmp_path / "x"), "--flavor", "8B"]) == 2
    assert "vocab size is 256, flavor 8B has 128256" in capsys.readouterr().err


def test_converters_never_mix_into_a_folder_that_holds_files(tmp_path, capsys):
    """OUT_DIR must be new or empty (an earlier export's stale shards would load with the new
    ones); HF -> DCP may replace a checkpoint, which is moved aside, never lost."""
    _, folder = _hf_model(tmp_path)
    to_dcp, to_hf = load_script("convert_hf_to_dcp"), load_script("convert_dcp_to_hf")
    ckpt = tmp_path / "ckpt"
    (tmp_path / "empty").mkdir()
    assert to_dcp.main([str(folder), str(tmp_path / "empty")]) == 0
    assert fs.verify_checkpoint(str(tmp_path / "empty"))[0] == ""
    assert to_dcp.main([str(folder), str(ckpt)]) == 0
    before = sorted(os.listdir(ckpt))
    capsys.readouterr()
    assert to_dcp.main([str(folder), str(ckpt)]) == 0  # again: the first one is set aside
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("ckpt.superseded-")]
    assert len(aside) == 1 and sorted(os.listdir(aside[0])) == before
    assert f"is now {aside[0]}" in capsys.readouterr().err
    for out, argv, script in [
        (folder, [str(folder), str(folder)], to_dcp),  # an HF folder is no checkpoint
        (ckpt, [str(ckpt), str(ckpt)], to_hf),  # the checkpoint itself
        (folder, [str(ckpt), str(folder)], to_hf),  # an earlier export
    ]:
        held = sorted(os.listdir(out))
        assert script.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: OUT_DIR {out} already holds files (") and "\n" not in err
        assert sorted(os.listdir(out)) == held
    (tmp_path / "a_file").write_text("x")
    assert to_hf.main([str(ckpt), str(tmp_path / "a_file")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert to_dcp.main([str(folder), "/proc/no_such_dir"]) == 2  # DCP's wrapped error: one line
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot write /proc/no_such_dir.tmp: ") and "\n" not in err


def test_checkpoint_manager_hf_initial_load_and_last_save(tmp_path):
    hf, folder = _hf_model(tmp_path)
    args = model_args_from_hf_config(json.loads((folder / "config.json").read_text()))
    model = Transformer(args)
    model.init_weights()

    def manager(dump: Path, **kw) -> CheckpointManager:
        cfg = Checkpoint(enable=True, interval=100, **kw)
        return CheckpointManager(None, [model], None, None, {}, cfg, str(dump), Llama3StateDictAdapter(args))

    first = manager(tmp_path / "run", initial_load_path=str(folder), initial_load_in_hf=True)
    assert first.load()
    tokens = _tokens()
    with torch.no_grad():
        diff = (model.eval()(tokens) - _hf_logits(hf, tokens)).abs().max().item()
    assert diff < TOL
    last = manager(tmp_path / "run", last_save_in_hf=True, last_save_model_only=True)
    last.save(5, last_step=True)
    export = tmp_path / "run" / "checkpoint" / "step-5" / "hf"
    marker = fs.read_marker(str(export.parent))
    assert "hf/model.safetensors" in marker["files"] and "hf/config.json" in marker["files"]
    back = transformers.LlamaForCausalLM.from_pretrained(export).eval()
    assert (_hf_logits(back, tokens) - _hf_logits(hf, tokens)).abs().max().item() < TOL


def test_hf_load_into_another_shape_is_one_clear_error(tmp_path):
    """The HF load uses the same shape check as DCP loads: key, both shapes, the path (without
    a config.json, which would be refused first: test_hf_boundary.py)."""
    _, folder = _hf_model(tmp_path)
    args = model_args_from_hf_config(json.loads((folder / "config.json").read_text()))
    args = type(args)(**{**args.__dict__, "vocab_size": 2 * VOCAB})
    (folder / "config.json").unlink()
    cfg = Checkpoint(enable=True, initial_load_path=str(folder), initial_load_in_hf=True)
    manager = CheckpointManager(
        None, [Transformer(args)], None, None, {}, cfg, str(tmp_path / "run"), Llama3StateDictAdapter(args)
    )
    with pytest.raises(
        CheckpointError,
        match=rf"^HF checkpoint {folder}: tok_embeddings.weight has shape \(256, 64\) but the "
        r"model expects \(512, 64\); check model.flavor",
    ):
        manager.load()


def test_hf_config_roundtrip_and_errors():
    for flavor in ("debugmodel_tiny", "1B", "8B", "70B", "405B"):
        args = llama3_args[flavor]
        back = model_args_from_hf_config(hf_config_from_model_args(args))
        assert back.ffn_hidden_dim == args.ffn_hidden_dim, flavor
        assert back.rope_scaling == args.rope_scaling and back.n_kv_heads == args.effective_n_kv_heads
    cfg = hf_config_from_model_args(llama3_args["debugmodel_tiny"])
    with pytest.raises(ValueError, match="attention_bias=true is not supported"):
        model_args_from_hf_config({**cfg, "attention_bias": True})
    with pytest.raises(ValueError, match="head_dim=32 differs"):
        model_args_from_hf_config({**cfg, "head_dim": 32})
    adapter = Llama3StateDictAdapter(llama3_args["debugmodel_tiny"])
    with pytest.raises(ValueError, match="cannot map 1 HF key"):
        adapter.from_hf({"model.layers.0.self_attn.q_norm.weight": torch.zeros(1)})


def test_hf_to_dcp_refuses_to_replace_a_training_step(tmp_path, capsys):
    """Converting into a run's step-N set the trained step aside and made the run resume from
    the HF weights; a step a conversion wrote may still be replaced."""
    from torch import nn

    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.config.job_config import Checkpoint

    writer = CheckpointManager(None, [nn.Linear(4, 3)], None, None, {},
                               Checkpoint(enable=True), str(tmp_path / "run"))
    writer.save(5, force=True)
    writer.close()
    step = tmp_path / "run" / "checkpoint" / "step-5"
    before = sorted(p.name for p in step.iterdir())
    assert load_script("convert_hf_to_dcp").main([str(tmp_path / "hf"), str(step)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: OUT_DIR {step} is a training run's checkpoint (step 5, with its "
                   "training state): converting over it would make the run resume from the HF "
                   "weights; give a folder of its own and load it with "
                   "--checkpoint.initial_load_path")
    assert sorted(p.name for p in step.iterdir()) == before
    _, folder = _hf_model(tmp_path, False)
    out = tmp_path / "converted"
    for _ in range(2):  # an earlier conversion is replaced (set aside), as before
        assert load_script("convert_hf_to_dcp").main([str(folder), str(out)]) == 0
    assert "the checkpoint that was at" in capsys.readouterr().err
