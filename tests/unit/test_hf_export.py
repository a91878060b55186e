"""HF exports that transformers can use: a debug model trained and exported by the Trainer
(``checkpoint.last_save_in_hf``) loads offline with AutoModelForCausalLM + AutoTokenizer, gives
torchtitan's token ids, and ``generate()`` stops at EOS / ``<|eot_id|>``;
scripts/convert_dcp_to_hf.py writes the same folder and checks every dimension.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tests.conftest import C4_TEST_TRAIN, REPO_ROOT, TIKTOKEN_FILE  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.tokenizer import TikTokenTokenizer  # noqa: E402
from torchtitan.config.job_config import Checkpoint  # noqa: E402
from torchtitan.models.llama3 import llama3_args  # noqa: E402
from torchtitan.models.llama3.model import Transformer  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter  # noqa: E402

SEQ_LEN = 64
TEXTS = [
    "hello world",
    "  leading spaces\n\nnew lines\ttabs",
    "Ünïcödé — ✓ 日本語 🙂, numbers 1234567 and 3.14",
]


def _script():
    spec = importlib.util.spec_from_file_location("convert_dcp_to_hf", REPO_ROOT / "scripts" / "convert_dcp_to_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_thread) -> Path:
    """dump folder of a 2-step debugmodel_tiny run that ends with an HF export (step-2/hf)."""
    from torchtitan.config.manager import ConfigManager
    from torchtitan.train import Trainer

    dump = tmp_path_factory.mktemp("run")
    old = os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        cfg = ConfigManager().parse_args([
            "--job.config_file", "train_configs/debug_model.toml", "--model.flavor", "debugmodel_tiny",
            "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", "2",
            "--training.steps", "2", "--activation_checkpoint.mode", "none", "--debug.seed", "3",
            "--checkpoint.enable", "--checkpoint.last_save_in_hf", "--job.dump_folder", str(dump),
        ])
        trainer = Trainer(cfg)
        try:
            trainer.train()
        finally:
            trainer.close()
            gc.enable()  # the trainer turns automatic GC off
    finally:
        os.chdir(old)
    return dump


def _force_next_token(model, token_id: int) -> None:
    """Make greedy decoding always pick ``token_id``: the residual stream is the embedding (all
    blocks output 0), whose first coordinate is 1, and only ``token_id`` reads it."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[token_id, 0] = 10.0


def test_export_loads_in_transformers_and_generate_stops_at_eos(trained):
    export = trained / "checkpoint" / "step-2" / "hf"
    ours = TikTokenTokenizer(TIKTOKEN_FILE)
    tok = transformers.AutoTokenizer.from_pretrained(export, local_files_only=True)
    texts = TEXTS + [json.loads(line)["text"] for line in C4_TEST_TRAIN.open()][:50]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids == ours.encode(text, bos=True, eos=False), text[:60]
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.bos_token, tok.bos_token_id) == ("<|begin_of_text|>", ours.bos_id)
    assert (tok.eos_token, tok.eos_token_id) == ("<|end_of_text|>", ours.eos_id)
    assert tok.convert_tokens_to_ids("<|eot_id|>") == ours.eot_id

    config = json.loads((export / "config.json").read_text())
    assert "torch_dtype" not in config and config["dtype"] == "float32"
    assert config["max_position_embeddings"] == 2048  # the flavor's, not training.seq_len (64)
    assert (config["bos_token_id"], config["eos_token_id"]) == (ours.bos_id, ours.eos_id)

    model = transformers.AutoModelForCausalLM.from_pretrained(export, local_files_only=True).eval()
    # Llama 3.1 stops at EOS, <|eot_id|> and <|eom_id|> (as Meta's generation_config)
    assert model.generation_config.eos_token_id == [ours.eos_id, ours.eot_id, ours.eom_id]
    prompt = tok("hello world", return_tensors="pt")
    n = prompt["input_ids"].shape[1]
    for stop in (ours.eot_id, ours.eos_id):
        _force_next_token(model, stop)
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=ours.eos_id)
        assert out[0, n:].tolist() == [stop]  # one token, then it stopped
    _force_next_token(model, 100)  # an ordinary token: runs to max_new_tokens
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=ours.eos_id)
    assert out[0, n:].tolist() == [100] * 8


def test_convert_script_writes_the_same_folder(trained, tmp_path, capsys):
    ckpt = trained / "checkpoint" / "step-2"
    script = _script()
    for name, flavor in (("recorded", []), ("flavor", ["--flavor", "debugmodel_tiny"])):
        out = tmp_path / name
        assert script.main([str(ckpt), str(out), "--tokenizer", "tests/assets/tokenizer", *flavor]) == 0
        assert sorted(os.listdir(out)) == sorted(os.listdir(ckpt / "hf"))
        for f in ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json"):
            assert (out / f).read_text() == (ckpt / "hf" / f).read_text(), f
        from safetensors.torch import load_file

        a, b = load_file(out / "model.safetensors"), load_file(ckpt / "hf" / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    capsys.readouterr()
    assert script.main([str(ckpt), str(tmp_path / "x")]) == 0
    assert "no --tokenizer" in capsys.readouterr().err


def _save(tmp_path: Path, name: str, record: bool = True, **changes) -> Path:
    args = type(llama3_args["debugmodel_tiny"])(**{**llama3_args["debugmodel_tiny"].__dict__, **changes})
    model = Transformer(args)
    model.init_weights()
    adapter = Llama3StateDictAdapter(args) if record else None
    CheckpointManager(
        None, [model], None, None, {}, Checkpoint(enable=True), str(tmp_path / name), adapter
    ).save(1, force=True)
    return tmp_path / name / "checkpoint" / "step-1"


@pytest.mark.parametrize(
    "changes, record, flavor, message",
    [
        (dict(n_layers=3), False, "debugmodel_tiny", "has 3 layers, the flavor has 2"),
        (dict(n_kv_heads=4), False, "debugmodel_tiny",
         "attention has 4 kv heads of dim 16 (dim/n_heads), the flavor has 2"),
        # 8 heads x 4 kv heads of dim 8: every weight has debugmodel_tiny's shape
        (dict(n_heads=8, n_kv_heads=4), True, "debugmodel_tiny",
         "trained with n_heads=8 (recorded in its .committed), flavor debugmodel_tiny has 4"),
        (dict(vocab_size=300), False, "8B", "vocab size is 300, flavor 8B has 128256"),
        (dict(dim=128), False, "debugmodel_tiny", "the checkpoint's dim is 128, the flavor has 64"),
        ({}, False, None, "records no model architecture in .committed"),
    ],
)
def test_convert_checks_every_dimension(tmp_path, capsys, changes, record, flavor, message):
    ckpt = _save(tmp_path, "ckpt", record=record, **{"vocab_size": 300, **changes})
    argv = [str(ckpt), str(tmp_path / "out")] + (["--flavor", flavor] if flavor else [])
    assert _script().main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("vocab, code, message", [
    (300, 2, "error: the tokenizer tests/assets/tokenizer has 2256 ids, the checkpoint's "
     "vocabulary only 300: is it the run's tokenizer?"),
    (4000, 0, "warning: the tokenizer tests/assets/tokenizer has 2256 ids, the checkpoint's "
     "vocabulary 4000: 1744 embedding rows no token of it reaches (more than padding); is it "
     "the run's tokenizer?"),
    (2300, 0, None),  # padding
])
def test_convert_compares_the_tokenizer_with_the_embedding(tmp_path, capsys, vocab, code, message):
    ckpt = _save(tmp_path, "ckpt", record=True, vocab_size=vocab)
    argv = [str(ckpt), str(tmp_path / "out"), "--tokenizer", "tests/assets/tokenizer"]
    assert _script().main(argv) == code
    err = [line for line in capsys.readouterr().err.splitlines() if "tokenizer" in line]
    assert err == ([message] if message else []), err


def test_convert_exports_a_custom_flavor(tmp_path, monkeypatch):
    """A 3-layer, 8-head model: from its recorded architecture, or via custom_import."""
    ckpt = _save(tmp_path, "custom", record=True, n_layers=3, n_heads=8, n_kv_heads=4, vocab_size=300)
    script = _script()
    assert script.main([str(ckpt), str(tmp_path / "recorded")]) == 0
    config = json.loads((tmp_path / "recorded" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (3, 8, 4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "recorded", local_files_only=True)
    assert hf.config.num_hidden_layers == 3

    (tmp_path / "my_flavors.py").write_text(
        "import copy\n"
        "from torchtitan.models.llama3 import llama3_args\n"
        "args = copy.deepcopy(llama3_args['debugmodel_tiny'])\n"
        "args.n_layers, args.n_heads, args.n_kv_heads = 3, 8, 4\n"
        "llama3_args['tiny_3x8'] = args\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        argv = [str(ckpt), str(tmp_path / "imported"), "--flavor", "tiny_3x8",
                "--experimental.custom_import", "my_flavors"]
        assert script.main(argv) == 0
    finally:
        llama3_args.pop("tiny_3x8", None)
        sys.modules.pop("my_flavors", None)
    imported = json.loads((tmp_path / "imported" / "config.json").read_text())
    assert imported == config
