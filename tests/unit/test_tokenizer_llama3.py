"""Meta's Llama 3 tokenizer, from the ``llama-models`` package (``pip install -e ".[llama]"``):
no Hub download. Skipped when the extra is not installed."""

from __future__ import annotations

import importlib.util
import itertools
import json

import pytest

from tests.conftest import C4_TEST_TRAIN
from torchtitan.components.tokenizer import (
    LLAMA3_SPECIAL_TOKENS,
    LLAMA_MODELS_TOKENIZER,
    TikTokenTokenizer,
    build_tokenizer,
    tokenizer_file,
)
from torchtitan.config.job_config import Model

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llama_models") is None,
    reason="llama-models is not installed (pip install -e '.[llama]')",
)

SENTENCE = "This is a test sentence."


@pytest.fixture(scope="module")
def llama3() -> TikTokenTokenizer:
    return build_tokenizer(Model(tokenizer_path=LLAMA_MODELS_TOKENIZER))


def test_ids_of_a_sentence(llama3):
    assert llama3.encode(SENTENCE, bos=True, eos=True) == [
        128000, 2028, 374, 264, 1296, 11914, 13, 128001
    ]
    assert llama3.decode([128000, 2028, 374, 264, 1296, 11914, 13, 128001]) == (
        "<|begin_of_text|>" + SENTENCE + "<|end_of_text|>"
    )


def test_vocabulary_and_llama31_special_tokens(llama3):
    assert llama3.vocab_size == 128256
    assert (llama3.bos_id, llama3.eos_id, llama3.eot_id) == (128000, 128001, 128009)
    assert (llama3.eom_id, llama3.python_tag_id) == (128008, 128010)
    named = {
        "<|finetune_right_pad_id|>": 128004, "<|step_id|>": 128005,
        "<|start_header_id|>": 128006, "<|end_header_id|>": 128007, "<|image|>": 128011,
        "<|reserved_special_token_2|>": 128012, "<|reserved_special_token_245|>": 128255,
    }
    assert {k: llama3.special_tokens[k] for k in named} == named
    assert llama3.decode([128006]) == "<|start_header_id|>"


def test_special_tokens_match_meta_reference(llama3):
    """The names and ids Meta's own tokenizer class gives the same file."""
    from llama_models.llama3.tokenizer import Tokenizer

    reference = Tokenizer(tokenizer_file(Model(tokenizer_path=LLAMA_MODELS_TOKENIZER)))
    assert llama3.special_tokens == reference.special_tokens
    assert list(reference.special_tokens)[: len(LLAMA3_SPECIAL_TOKENS)] == LLAMA3_SPECIAL_TOKENS
    docs = [json.loads(line)["text"] for line in itertools.islice(open(C4_TEST_TRAIN), 20)]
    for doc in docs:
        assert llama3.encode(doc, bos=True, eos=True) == reference.encode(doc, bos=True, eos=True)


@pytest.mark.parametrize("text", [
    "Ünïcödé wörds, 日本語, Ελληνικά, emoji 🙂🚀 and numbers 1234567.",
    "Tabs\tand\nnew lines\r\n  and <|eot_id|> as plain text",
    "",
])
def test_unicode_round_trip(llama3, text):
    ids = llama3.encode(text, bos=False, eos=False)
    assert all(i < 128000 for i in ids)  # special strings in documents stay text
    assert llama3.decode(ids) == text


def test_ways_to_point_training_at_it(llama3, monkeypatch):
    file = tokenizer_file(Model(tokenizer_path=LLAMA_MODELS_TOKENIZER))
    assert file.name == "tokenizer.model" and file.parent.name == "llama3"
    assert file.stat().st_size == 2_183_982
    assert tokenizer_file(Model(hf_assets_path=LLAMA_MODELS_TOKENIZER)) == file
    assert tokenizer_file(Model(hf_assets_path=str(file.parent))) == file
    with pytest.raises(FileNotFoundError, match="only 'llama_models:llama3'"):
        tokenizer_file(Model(tokenizer_path="llama_models:llama4"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"needs the llama-models package: run `pip install -e '\.\[llama\]'`"):
        tokenizer_file(Model(tokenizer_path=LLAMA_MODELS_TOKENIZER))


def test_packed_c4_test_with_document_ids(llama3):
    """Packing and document masking with the real tokenizer: documents split at BOS/EOS."""
    import torch

    from torchtitan.datasets import build_text_dataloader
    from torchtitan.models.common.document_mask import document_ids

    loader = build_text_dataloader(
        dataset_name="c4_test", dataset_path=None, tokenizer=llama3, local_batch_size=2,
        seq_len=512, dp_rank=0, dp_world_size=1,
    )
    x, y = next(iter(loader))
    assert x.shape == (2, 512) and int(x.max()) < 128256 and torch.equal(x[:, 1:], y[:, :-1])
    docs = document_ids(x, llama3.bos_id, llama3.eos_id)
    starts = (x == llama3.bos_id).sum(dim=1)
    assert torch.equal(docs[:, -1], starts - (x[:, 0] == llama3.bos_id).long())
    first = json.loads(next(open(C4_TEST_TRAIN)))["text"]
    assert x[0, : 20].tolist() == llama3.encode(first, bos=True)[:20]
