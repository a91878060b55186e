"""What an HF export needs besides weights and ``config.json``: tokenizer files that
``AutoTokenizer.from_pretrained`` reads with the same ids, and ``generation_config.json``.

* tiktoken (Llama 3): ``tokenizer.json`` is built from the BPE ranks file (byte-level BPE with
  the Llama 3 split pattern and its 256 special tokens, BOS prepended), as transformers' own
  Llama 3 conversion does; needs the ``tokenizers`` package.
* HF ``tokenizer.json``: copied with its ``tokenizer_config.json`` / ``special_tokens_map.json``.
* sentencepiece (Llama 2): ``tokenizer.model`` copied, loaded as ``LlamaTokenizer``.

Text containing special-token strings (e.g. a literal ``<|eot_id|>``) is the one known
difference: transformers turns it into the special id, torchtitan's tokenizer encodes it as text.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from torchtitan.tools.logging import logger

# Ids at which generation stops besides EOS, when the vocabulary has them (Llama 3 / 3.1 chat).
_STOP_TOKENS = ("<|eot_id|>", "<|eom_id|>")


def _token_id(tokenizer: Any, name: str) -> int | None:
    special = getattr(tokenizer, "special_tokens", None)  # TikTokenTokenizer
    if isinstance(special, dict):
        return special.get(name)
    model = getattr(tokenizer, "model", None)
    to_id = getattr(model, "token_to_id", None)  # tokenizers.Tokenizer
    return to_id(name) if callable(to_id) else None


def special_ids(tokenizer: Any) -> dict[str, Any]:
    """``bos_token_id``, ``eos_token_id`` (config.json) and ``stop_ids`` (every id that ends
    generation: EOS first, then end-of-turn ids such as ``<|eot_id|>``)."""
    bos = tokenizer.bos_id if tokenizer.bos_id >= 0 else None
    eos = tokenizer.eos_id if tokenizer.eos_id >= 0 else None
    stops = [] if eos is None else [eos]
    for name in _STOP_TOKENS:
        tid = _token_id(tokenizer, name)
        if tid is not None and tid not in stops:
            stops.append(tid)
    return {"bos_token_id": bos, "eos_token_id": eos, "stop_ids": stops}


def generation_config(tokenizer: Any) -> dict[str, Any]:
    """``generation_config.json``: stop at EOS and at end-of-turn tokens."""
    ids = special_ids(tokenizer)
    stops = ids["stop_ids"]
    config: dict[str, Any] = {"bos_token_id": ids["bos_token_id"]}
    config["eos_token_id"] = stops[0] if len(stops) == 1 else (stops or None)
    if tokenizer.pad_id >= 0:
        config["pad_token_id"] = tokenizer.pad_id
    return config


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def tiktoken_to_tokenizers(tokenizer: Any) -> Any:
    """A ``tokenizers.Tokenizer`` equal to a TikTokenTokenizer (same ids, BOS prepended)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    from torchtitan.components.tokenizer import LLAMA3_PAT_STR, load_tiktoken_ranks

    ranks = load_tiktoken_ranks(tokenizer.path)
    table = _bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(table[b] for b in token)

    merges: list[tuple[bytes, bytes, int]] = []
    for token, rank in ranks.items():
        pairs = [
            (token[:i], token[i:], rank)
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        merges.extend(sorted(pairs, key=lambda m: (ranks[m[0]], ranks[m[1]])))
    merges.sort(key=lambda m: m[2])
    bpe = BPE(
        {text(t): r for t, r in ranks.items()},
        [(text(a), text(b)) for a, b, _ in merges],
        fuse_unk=False,
        ignore_merges=True,  # tiktoken: a piece that is a whole token is that token
    )
    hf = Tokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    specials = sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])
    hf.add_special_tokens([AddedToken(name, normalized=False, special=True) for name, _ in specials])
    wrong = [(n, i) for n, i in specials if hf.token_to_id(n) != i]
    if wrong:
        raise ValueError(f"special token {wrong[0][0]} would get id {hf.token_to_id(wrong[0][0])}, not {wrong[0][1]}")
    bos = next(n for n, i in specials if i == tokenizer.bos_id)
    hf.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tokenizer.bos_id)],
        ),
    ])
    return hf


def _name_of(tokenizer: Any, tid: int | None) -> str | None:
    if tid is None or tid < 0:
        return None
    special = getattr(tokenizer, "special_tokens", None)
    if isinstance(special, dict):
        return next((n for n, i in special.items() if i == tid), None)
    return tokenizer.decode([tid])


def save_tokenizer_files(tokenizer: Any, out_dir: str, model_max_length: int) -> list[str]:
    """Write the tokenizer files of ``tokenizer`` into ``out_dir``; returns their names
    (empty, with one warning, when the tokenizer cannot be exported here)."""
    from torchtitan.components.tokenizer import (
        HuggingFaceTokenizer,
        SentencePieceTokenizer,
        TikTokenTokenizer,
    )

    os.makedirs(out_dir, exist_ok=True)
    config: dict[str, Any] = {
        "bos_token": _name_of(tokenizer, tokenizer.bos_id),
        "eos_token": _name_of(tokenizer, tokenizer.eos_id),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    if isinstance(tokenizer, TikTokenTokenizer):
        try:
            hf = tiktoken_to_tokenizers(tokenizer)
        except ImportError:
            logger.warning(
                f"HF export: no tokenizer files in {out_dir}: converting the tiktoken tokenizer "
                "needs the 'tokenizers' package (pip install tokenizers)"
            )
            return []
        hf.save(os.path.join(out_dir, "tokenizer.json"))
        names = ["tokenizer.json"]
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    elif isinstance(tokenizer, HuggingFaceTokenizer):
        folder = Path(tokenizer.path).parent
        names = []
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            source = Path(tokenizer.path) if name == "tokenizer.json" else folder / name
            if source.is_file():
                shutil.copyfile(source, os.path.join(out_dir, name))
                names.append(name)
        if "tokenizer_config.json" in names:
            return names
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    elif isinstance(tokenizer, SentencePieceTokenizer):
        shutil.copyfile(tokenizer.path, os.path.join(out_dir, "tokenizer.model"))
        names = ["tokenizer.model"]
        config.update(
            tokenizer_class="LlamaTokenizer", unk_token="<unk>", add_bos_token=True,
            add_eos_token=False, legacy=False,
        )
    else:
        logger.warning(f"HF export: no tokenizer files in {out_dir}: unknown tokenizer {type(tokenizer).__name__}")
        return []
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({k: v for k, v in config.items() if v is not None}, f, indent=2)
    return names + ["tokenizer_config.json"]
