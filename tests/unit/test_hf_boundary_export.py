"""The Hugging Face export boundary (scripts/convert_dcp_to_hf.py, ``last_save_in_hf``): the
checkpoint's CRC32s are verified first; a trained routing bias that HF cannot hold is refused
unless ``--allow-lossy``; the model family comes from the weight names; files get a normal mode.
Imports: test_hf_boundary.py.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from tests.conftest import load_script  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager, fs, hf, save  # noqa: E402
from torchtitan.config.job_config import Checkpoint  # noqa: E402
from torchtitan.models.common.moe import MoEArgs  # noqa: E402
from torchtitan.models.llama3 import llama3_args  # noqa: E402
from torchtitan.models.llama3.model import Transformer  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter  # noqa: E402
from torchtitan.models.qwen3.args import Qwen3ModelArgs  # noqa: E402
from torchtitan.models.qwen3.model import Qwen3Model  # noqa: E402
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter  # noqa: E402


def _tiny_llama() -> Transformer:
    args = copy.deepcopy(llama3_args["debugmodel_tiny"])
    args.vocab_size = 300
    model = Transformer(args)
    model.init_weights()
    return model



def _save_llama(tmp_path: Path) -> Path:
    model = _tiny_llama()
    CheckpointManager(None, [model], None, None, {}, Checkpoint(enable=True), str(tmp_path / "run"),
                      Llama3StateDictAdapter(model.model_args)).save(1, force=True)
    return tmp_path / "run" / "checkpoint" / "step-1"


def test_export_verifies_the_checkpoint_first(tmp_path, capsys):
    """One flipped byte in a .distcp (same size): refused as the trainer refuses it."""
    ckpt = _save_llama(tmp_path)
    data = sorted(p for p in ckpt.iterdir() if p.suffix == ".distcp")[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    out = tmp_path / "out"
    assert load_script("convert_dcp_to_hf").main([str(ckpt), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot export {ckpt}: file {data.name} has checksum crc32:"), err
    assert err.count("\n") == 1 and "(its content changed)" in err
    assert not out.exists()


def test_last_save_in_hf_verifies_the_written_files(tmp_path, caplog):
    """The trainer's export reads the just-written files: checked against the CRC32s their
    writer recorded; a mismatch skips hf/ with one warning (the save itself is not lost)."""
    import torch.distributed.checkpoint as dcp

    from torchtitan.components.checkpoint.common import quiet_dcp

    model = _tiny_llama()
    tmp = tmp_path / "step-3.tmp"
    with quiet_dcp():
        dcp.save({k: v.detach() for k, v in model.state_dict().items()}, checkpoint_id=str(tmp), no_dist=True)
    files = [p.name for p in tmp.iterdir() if p.suffix == ".distcp"]
    fs.write_checksum_sidecar(str(tmp), 0, files)
    with open(tmp / files[0], "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))
    hf.export_hf(str(tmp), Llama3StateDictAdapter(model.model_args), "float32")
    assert not (tmp / "hf").exists()
    assert any(f"file {files[0]} has checksum" in m and "not writing" in m for m in caplog.messages)


def _qwen3_moe_checkpoint(tmp_path: Path, bias: float) -> tuple[Qwen3Model, Path]:
    args = Qwen3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128,
                          hidden_dim=96, moe_hidden_dim=32, max_seq_len=64,
                          moe_args=MoEArgs(num_experts=4, top_k=2, route_norm=True))
    model = Qwen3Model(args)
    model.init_weights()
    with torch.no_grad():
        model.layers["1"].moe.expert_bias.copy_(torch.tensor([bias, 0.0, -bias, 0.0]))
    adapter = Qwen3StateDictAdapter(args)
    ckpt = tmp_path / "step-7"
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    save.save_dcp_single_process(weights, str(ckpt), {"step": 7, **hf.model_info(adapter)})
    return model, ckpt


def test_qwen3_moe_export_refuses_to_drop_a_trained_routing_bias(tmp_path, capsys):
    _, ckpt = _qwen3_moe_checkpoint(tmp_path, bias=0.3)
    script = load_script("convert_dcp_to_hf")
    out = tmp_path / "out"
    assert script.main([str(ckpt), str(out), "--model", "qwen3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the load-balancing expert_bias of 1 MoE layer(s) is not zero "
                          "(max |bias| 0.3)") and "--allow-lossy" in err and err.count("\n") == 1, err
    assert not out.exists()
    assert script.main([str(ckpt), str(out), "--model", "qwen3", "--allow-lossy"]) == 0
    err = capsys.readouterr().err
    assert "warning: HF export: the load-balancing expert_bias" in err and (out / "model.safetensors").exists()
    _, zero = _qwen3_moe_checkpoint(tmp_path / "zero", bias=0.0)
    assert script.main([str(zero), str(tmp_path / "zero_out")]) == 0  # nothing lost: no flag needed
    assert "expert_bias" not in capsys.readouterr().err


def test_last_save_in_hf_skips_a_lossy_export(tmp_path, caplog):
    model, _ = _qwen3_moe_checkpoint(tmp_path, bias=0.3)
    cfg = Checkpoint(enable=True, last_save_in_hf=True, last_save_model_only=True)
    CheckpointManager(None, [model], None, None, {}, cfg, str(tmp_path / "run"),
                      Qwen3StateDictAdapter(model.model_args)).save(5, last_step=True)
    step = tmp_path / "run" / "checkpoint" / "step-5"
    assert fs.verify_checkpoint(str(step))[0] == "" and not (step / "hf").exists()
    assert any("not writing" in m and "--allow-lossy" in m for m in caplog.messages)


def _ours(caplog) -> list[str]:
    """torchtitan's log lines (DCP's own logger records state-dict keys too)."""
    return [r.getMessage() for r in caplog.records if r.name == "torchtitan"]


def test_last_save_in_hf_allow_lossy_exports_with_one_warning(tmp_path, caplog):
    model, _ = _qwen3_moe_checkpoint(tmp_path, bias=0.3)
    cfg = Checkpoint(enable=True, last_save_in_hf=True, last_save_in_hf_allow_lossy=True)
    CheckpointManager(None, [model], None, None, {}, cfg, str(tmp_path / "run"),
                      Qwen3StateDictAdapter(model.model_args)).save(5, last_step=True)
    step = tmp_path / "run" / "checkpoint" / "step-5"
    assert fs.verify_checkpoint(str(step))[0] == "" and (step / "hf" / "model.safetensors").exists()
    (line,) = [m for m in _ours(caplog) if "expert_bias" in m]
    assert line.startswith("HF export: the load-balancing expert_bias of 1 MoE layer(s)") and \
        line.endswith("(exported anyway, as asked)"), line


def _start_warnings(tmp_path: Path, model, adapter, caplog, **flags) -> list[str]:
    caplog.clear()
    cfg = Checkpoint(enable=True, last_save_in_hf=True, **flags)
    CheckpointManager(None, [model], None, None, {}, cfg, str(tmp_path), adapter).close()
    return [m for m in _ours(caplog) if "last_save_in_hf" in m]


def test_last_save_in_hf_says_at_start_that_a_trained_routing_bias_will_skip_the_export(
    tmp_path, caplog
):
    model, _ = _qwen3_moe_checkpoint(tmp_path, bias=0.0)  # zero now; load_balance_coeff trains it
    adapter = Qwen3StateDictAdapter(model.model_args)
    (line,) = _start_warnings(tmp_path / "a", model, adapter, caplog)
    assert line == (
        "Checkpoint: checkpoint.last_save_in_hf will skip hf/ at the end: this model trains a "
        "load-balancing routing bias (load_balance_coeff) that its HF format has no place for; "
        "add --checkpoint.last_save_in_hf_allow_lossy to export it anyway (transformers then "
        "routes some tokens to other experts)"
    )
    assert _start_warnings(tmp_path / "b", model, adapter, caplog, last_save_in_hf_allow_lossy=True) == []
    for layer in model.layers.values():  # no load balancing: the bias stays zero
        if getattr(layer, "moe", None) is not None:
            layer.moe.args.load_balance_coeff = None
    assert _start_warnings(tmp_path / "c", model, adapter, caplog) == []
    llama = _tiny_llama()
    assert _start_warnings(tmp_path / "d", llama, Llama3StateDictAdapter(llama.model_args), caplog) == []


def test_export_finds_the_model_from_the_weight_names(tmp_path, capsys):
    _, qwen = _qwen3_moe_checkpoint(tmp_path, bias=0.0)
    script = load_script("convert_dcp_to_hf")
    assert script.main([str(qwen), str(tmp_path / "q")]) == 0  # no --model: qwen3
    assert json.loads((tmp_path / "q" / "config.json").read_text())["model_type"] == "qwen3_moe"
    capsys.readouterr()
    assert script.main([str(qwen), str(tmp_path / "x"), "--model", "llama3"]) == 2
    assert capsys.readouterr().err == "error: this checkpoint is a qwen3 model; pass --model qwen3\n"
    llama = _save_llama(tmp_path)
    assert script.main([str(llama), str(tmp_path / "y"), "--model", "qwen3"]) == 2
    assert capsys.readouterr().err == "error: this checkpoint is a llama3 model; pass --model llama3\n"
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_exported_safetensors_have_a_normal_file_mode(tmp_path):
    old = os.umask(0o022)
    try:
        files = hf.save_safetensors_folder({"w": torch.ones(2)}, str(tmp_path / "a"))
        assert (tmp_path / "a" / files[0]).stat().st_mode & 0o777 == 0o644
        os.umask(0o027)
        files = hf.save_safetensors_folder({"w": torch.ones(2)}, str(tmp_path / "b"))
        assert (tmp_path / "b" / files[0]).stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)
