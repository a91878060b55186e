"""Tokenizers (tiktoken / sentencepiece / HF), their detection and errors, and the test assets."""

import hashlib
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import (
    ASSETS,
    C4_TEST_TRAIN,
    C4_TEST_VALID,
    REPO_ROOT,
    SP_FILE,
    SP_TOKENIZER_DIR,
    TIKTOKEN_FILE,
)
from torchtitan.components.tokenizer import (
    LLAMA3_PAT_STR,
    LLAMA3_SPECIAL_TOKENS,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    TikTokenTokenizer,
    build_tokenizer,
    detect_tokenizer_kind,
)
from torchtitan.config.job_config import Model

SCRIPT = REPO_ROOT / "scripts" / "generate_test_assets.py"

TEXTS = [
    "Preheat the oven to 350 degrees and bake the bread for 25 minutes.",
    "Hello, world!\n\nTwo  spaces\tand a tab.",
    "Ünïcödé wörds, 日本語, emoji 🙂 and numbers 1234567.",
    "Special strings stay text: <|begin_of_text|> <|eot_id|> </s> <s>",
    "",
]


@pytest.fixture(scope="module")
def tik(tiktoken_tokenizer) -> TikTokenTokenizer:
    return tiktoken_tokenizer


@pytest.fixture(scope="module")
def generator():
    """scripts/generate_test_assets.py, imported in this process."""
    spec = importlib.util.spec_from_file_location("generate_test_assets", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def sp() -> SentencePieceTokenizer:
    return SentencePieceTokenizer(SP_FILE)


# --- tiktoken --------------------------------------------------------------------------------


def test_tiktoken_vocab_and_special_ids(tik):
    assert len(LLAMA3_SPECIAL_TOKENS) == 256
    assert tik.vocab_size == 2000 + 256
    assert tik.bos_id == 2000 == tik.special_tokens["<|begin_of_text|>"]
    assert tik.eos_id == 2001 == tik.special_tokens["<|end_of_text|>"]
    assert tik.special_tokens["<|start_header_id|>"] == 2006
    assert tik.special_tokens["<|end_header_id|>"] == 2007
    assert tik.eot_id == tik.special_tokens["<|eot_id|>"] == 2009
    # Llama 3.1's names, not reserved placeholders
    assert tik.special_tokens["<|finetune_right_pad_id|>"] == 2004
    assert tik.eom_id == tik.special_tokens["<|eom_id|>"] == 2008
    assert tik.python_tag_id == tik.special_tokens["<|python_tag|>"] == 2010
    assert tik.special_tokens["<|reserved_special_token_2|>"] == 2012
    assert tik.special_tokens["<|reserved_special_token_245|>"] == 2255
    assert len(set(LLAMA3_SPECIAL_TOKENS)) == 256
    assert tik.pad_id == -1


@pytest.mark.parametrize("text", TEXTS)
def test_tiktoken_round_trip(tik, text):
    ids = tik.encode(text, bos=False, eos=False)
    assert all(0 <= i < 2000 for i in ids)  # special strings in text are never special ids
    assert tik.decode(ids) == text
    both = tik.encode(text, bos=True, eos=True)
    assert both == [tik.bos_id, *ids, tik.eos_id]
    assert tik.encode(text) == [tik.bos_id, *ids]  # defaults: bos=True, eos=False
    assert tik.decode(both) == "<|begin_of_text|>" + text + "<|end_of_text|>"


def test_tiktoken_compresses_the_corpus(tik):
    docs = [json.loads(line)["text"] for line in open(C4_TEST_TRAIN)][:200]
    chars = sum(len(d) for d in docs)
    tokens = sum(len(tik.encode(d, bos=False)) for d in docs)
    assert tokens < chars / 3.5  # a trained BPE, not bytes (the corpus gives about 4.4 chars/token)
    assert tik.encode(" the", bos=False) == [tik.model.encode_single_token(b" the")]


def test_tiktoken_long_runs_without_whitespace(tik):
    text = "a" * 30_000 + " " * 30_000 + "b"
    assert tik.decode(tik.encode(text, bos=False)) == text


def test_tiktoken_bad_file(tmp_path):
    bad = tmp_path / "tokenizer.model"
    bad.write_text("IQ== 0\nnot base64!! x\n")
    with pytest.raises(ValueError, match=r"tokenizer.model:2 is not a tiktoken ranks line"):
        TikTokenTokenizer(bad)
    gap = tmp_path / "gap.model"
    gap.write_text("IQ== 0\nIg== 2\n")
    with pytest.raises(ValueError, match=r"ranks must be the unique integers 0\.\.1"):
        TikTokenTokenizer(gap)


def test_generator_uses_llama3_pattern(generator):
    mod = generator
    assert mod.LLAMA3_PAT_STR == LLAMA3_PAT_STR
    ranks = mod.train_bpe(["abab abab abab", "ab"], vocab_size=259)
    assert ranks[b"ab"] == 256 and len(ranks) == 259  # the most frequent pair merges first


# --- sentencepiece ---------------------------------------------------------------------------


def test_sentencepiece_vocab_and_special_ids(sp):
    assert sp.vocab_size == 2000
    assert (sp.bos_id, sp.eos_id, sp.pad_id) == (1, 2, -1)
    assert sp.model.unk_id() == 0
    assert sp.model.id_to_piece(3) == "<0x00>"  # byte fallback pieces follow the specials


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_round_trip(sp, text):
    ids = sp.encode(text, bos=False, eos=False)
    assert 0 not in ids  # byte fallback: nothing is <unk>
    assert sp.decode(ids) == text
    assert sp.encode(text, bos=True, eos=True) == [1, *ids, 2]
    assert sp.encode(text) == [1, *ids]


# --- HF tokenizer.json -----------------------------------------------------------------------


def test_hf_tokenizer_without_package_names_the_fix(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails
    with pytest.raises(ImportError, match=r"needs the 'tokenizers' package: run `pip install"):
        HuggingFaceTokenizer(path)
    assert detect_tokenizer_kind(path) == "huggingface"


def test_hf_tokenizer_round_trip(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the oven bakes bread", "the garden grows"], trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = build_tokenizer(Model(hf_assets_path=str(tmp_path)))
    assert isinstance(hf, HuggingFaceTokenizer)
    assert (hf.bos_id, hf.eos_id) == (1, 2)
    ids = hf.encode("the oven grows", bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2
    assert hf.decode(ids[1:-1]) == "the oven grows"
    assert hf.vocab_size == tok.get_vocab_size(with_added_tokens=True)


def test_hf_tokenizer_without_bos_or_eos_warns_that_documents_run_together(tmp_path, caplog):
    """A tokenizer.json with no special tokens (and no tokenizer_config.json naming them) packs
    documents back to back with nothing between them; that used to happen in silence."""
    import logging

    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<unk>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the oven bakes bread"], trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        hf = build_tokenizer(Model(hf_assets_path=str(tmp_path)))
    assert (hf.bos_id, hf.eos_id) == (-1, -1)
    assert (f"Tokenizer {tmp_path / 'tokenizer.json'} has neither a BOS nor an EOS token: packed "
            "documents run into each other") in caplog.text
    caplog.clear()
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<unk>"}')
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        assert build_tokenizer(Model(hf_assets_path=str(tmp_path))).eos_id == 0
    assert "neither a BOS nor an EOS" not in caplog.text


# --- detection and build_tokenizer -----------------------------------------------------------


def test_detection_by_content(tmp_path):
    assert detect_tokenizer_kind(TIKTOKEN_FILE) == "tiktoken"
    assert detect_tokenizer_kind(SP_FILE) == "sentencepiece"
    garbage = tmp_path / "tokenizer.model"
    garbage.write_bytes(b"\x00\x01garbage")
    with pytest.raises(ValueError, match=r"neither a tiktoken ranks file, a sentencepiece model"):
        detect_tokenizer_kind(garbage)
    empty = tmp_path / "empty.model"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"is empty \(0 bytes\): restore it, or point "
                       r"--model\.hf_assets_path at a folder holding a tokenizer"):
        detect_tokenizer_kind(empty)


def test_build_tokenizer_picks_by_content(tmp_path):
    assert isinstance(build_tokenizer(Model()), TikTokenTokenizer)  # default hf_assets_path
    sp_tok = build_tokenizer(Model(hf_assets_path=str(SP_TOKENIZER_DIR)))
    assert isinstance(sp_tok, SentencePieceTokenizer)
    # The content decides, not the name: a sentencepiece model under any file name.
    renamed = tmp_path / "anything.bin"
    renamed.write_bytes(SP_FILE.read_bytes())
    tok = build_tokenizer(Model(hf_assets_path="/nonexistent", tokenizer_path=str(renamed)))
    assert isinstance(tok, SentencePieceTokenizer)
    # tokenizer_path may also be a folder.
    tok = build_tokenizer(Model(tokenizer_path=str(SP_TOKENIZER_DIR)))
    assert isinstance(tok, SentencePieceTokenizer)


def test_build_tokenizer_relative_path_falls_back_to_repo_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tok = build_tokenizer(Model(hf_assets_path="./tests/assets/tokenizer"))
    assert tok.vocab_size == 2256


def test_build_tokenizer_missing_paths_name_the_key(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        build_tokenizer(Model(hf_assets_path=str(tmp_path / "nope")))
    assert str(tmp_path / "nope") in str(e.value) and "model.hf_assets_path" in str(e.value)

    with pytest.raises(FileNotFoundError) as e:
        build_tokenizer(Model(hf_assets_path=str(tmp_path)))  # exists, but no tokenizer in it
    assert "No tokenizer.model or tokenizer.json in" in str(e.value)
    assert "model.hf_assets_path" in str(e.value)

    with pytest.raises(FileNotFoundError) as e:
        build_tokenizer(Model(tokenizer_path=str(tmp_path / "tok.model")))
    assert str(tmp_path / "tok.model") in str(e.value) and "model.tokenizer_path" in str(e.value)

    with pytest.raises(FileNotFoundError, match="model.hf_assets_path"):
        build_tokenizer(Model(hf_assets_path=""))


# --- generated assets ------------------------------------------------------------------------


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


ASSET_FILES = [
    "c4_test/data.json",
    "c4_test/validation.json",
    "tokenizer/tokenizer.model",
    "tokenizer_sp/tokenizer.model",
]


def test_generated_assets_are_reproducible(tmp_path, generator):
    assert generator.main(["--out-dir", str(tmp_path)]) == 0  # in-process: no interpreter start
    for rel in ASSET_FILES:
        assert _sha(tmp_path / rel) == _sha(ASSETS / rel), f"{rel} differs from a fresh generation"


def test_corpus_shape():
    train = [json.loads(line) for line in open(C4_TEST_TRAIN)]
    valid = [json.loads(line) for line in open(C4_TEST_VALID)]
    assert len(train) == 2000 and len(valid) == 200
    assert all(list(d) == ["text", "timestamp", "url"] for d in train + valid)
    assert C4_TEST_TRAIN.stat().st_size < 3_000_000
    assert {d["text"] for d in train}.isdisjoint({d["text"] for d in valid})
    assert len({d["text"] for d in train}) == 2000  # varied, no duplicate documents
    words = Counter(w for d in train for w in d["text"].split())
    assert 300 <= len({w.strip(".,!?;:").lower() for w in words}) <= 2000
