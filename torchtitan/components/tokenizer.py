"""Tokenizers: tiktoken (Llama 3), sentencepiece (Llama 2) and, optionally, HF ``tokenizer.json``.

``build_tokenizer(model_cfg)`` picks the file from ``model.tokenizer_path`` or the
``model.hf_assets_path`` folder and detects its kind from the content.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

from torchtitan.components.tokenizer_files import (  # noqa: F401 - re-exported
    HF_ORGS,
    LLAMA_MODELS_TOKENIZER,
    _tokenizer_file,
    download_hint,
    hf_repo_for,
    tokenizer_file,
)

if TYPE_CHECKING:
    from torchtitan.config.job_config import Model

__all__ = [
    "BaseTokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "TikTokenTokenizer",
    "build_tokenizer",
    "check_tokenizer_file",
    "detect_tokenizer_kind",
    "LLAMA3_PAT_STR",
    "LLAMA3_SPECIAL_TOKENS",
]

REPO_ROOT = Path(__file__).resolve().parents[2]

# Llama 3's pre-tokenization pattern.
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_NUM_RESERVED_SPECIAL_TOKENS = 256
# Llama 3.1's 256 special tokens (names as in Meta's llama-models), appended after the regular
# ranks (ids num_base .. num_base + 255): 128000 BOS, 128001 EOS, 128004 pad, 128008 eom,
# 128009 eot, 128010 python_tag ... for the real 128,000-rank file.
_LLAMA31_NAMED = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",  # end of message
    "<|eot_id|>",  # end of turn
    "<|python_tag|>",
    "<|image|>",
]
LLAMA3_SPECIAL_TOKENS: list[str] = _LLAMA31_NAMED + [
    f"<|reserved_special_token_{2 + i}|>"
    for i in range(_NUM_RESERVED_SPECIAL_TOKENS - len(_LLAMA31_NAMED))
]

# tiktoken's Rust core can overflow its stack on huge inputs or very long runs without whitespace.
_TIKTOKEN_MAX_ENCODE_CHARS = 400_000
_MAX_NO_WHITESPACES_CHARS = 25_000
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+\r?$")


class BaseTokenizer(ABC):
    """What the rest of torchtitan needs from a tokenizer. An id of -1 means "none"."""

    @abstractmethod
    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of ``text``, with the BOS / EOS id prepended / appended when asked."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (regular + special); the model's embedding size."""

    @property
    @abstractmethod
    def bos_id(self) -> int:
        """Beginning-of-sequence id."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """End-of-sequence id."""

    @property
    def pad_id(self) -> int:
        """Padding id (-1: the tokenizer has none)."""
        return -1

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        if bos and self.bos_id >= 0:
            ids = [self.bos_id, *ids]
        if eos and self.eos_id >= 0:
            ids = [*ids, self.eos_id]
        return ids


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a tiktoken BPE ranks file (``base64(token) rank`` per line) without tiktoken's cache."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error) as e:
                raise ValueError(
                    f"{path}:{lineno} is not a tiktoken ranks line ('<base64 token> <rank>'): {line[:60]!r}"
                ) from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: tiktoken ranks must be the unique integers 0..{len(ranks) - 1}")
    return ranks


class TikTokenTokenizer(BaseTokenizer):
    """Llama 3 tokenizer: a tiktoken byte-level BPE ranks file plus Llama 3.1's 256 special
    tokens (``eot_id``, ``eom_id``, ``python_tag_id`` are attributes).

    BOS is ``<|begin_of_text|>``, EOS ``<|end_of_text|>``; ``pad_id`` is -1 (pretraining packs,
    never pads; ``<|finetune_right_pad_id|>`` is a named special token like the others).
    Special-token strings inside the text are encoded as plain text, never as special ids.
    """

    def __init__(self, path: str | Path):
        import tiktoken

        self.path = str(path)
        ranks = load_tiktoken_ranks(path)
        num_base = len(ranks)
        self.special_tokens = {tok: num_base + i for i, tok in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self.model = tiktoken.Encoding(
            name=Path(path).name,
            pat_str=LLAMA3_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self._vocab_size = num_base + len(self.special_tokens)
        self._bos_id = self.special_tokens["<|begin_of_text|>"]
        self._eos_id = self.special_tokens["<|end_of_text|>"]
        self.eot_id = self.special_tokens["<|eot_id|>"]
        self.eom_id = self.special_tokens["<|eom_id|>"]
        self.python_tag_id = self.special_tokens["<|python_tag|>"]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids: list[int] = []
        for i in range(0, len(text), _TIKTOKEN_MAX_ENCODE_CHARS):
            chunk = text[i : i + _TIKTOKEN_MAX_ENCODE_CHARS]
            if len(chunk) <= _MAX_NO_WHITESPACES_CHARS:  # no run can be too long: skip the scan
                ids.extend(self.model.encode(chunk, allowed_special=set(), disallowed_special=()))
                continue
            for piece in _split_long_runs(chunk, _MAX_NO_WHITESPACES_CHARS):
                ids.extend(self.model.encode(piece, allowed_special=set(), disallowed_special=()))
        return self._wrap(ids, bos, eos)

    def decode(self, ids: list[int]) -> str:
        return self.model.decode(list(ids))


def _split_long_runs(s: str, max_run: int):
    """Split ``s`` so that no piece holds more than ``max_run`` consecutive (non-)space chars."""
    start, run, prev_space = 0, 0, False
    for i, ch in enumerate(s):
        space = ch.isspace()
        run = run + 1 if space == prev_space else 1
        prev_space = space
        if run > max_run:
            yield s[start:i]
            start, run = i, 1
    yield s[start:]


class SentencePieceTokenizer(BaseTokenizer):
    """Llama 2 tokenizer: a sentencepiece model (ids of BOS, EOS and pad come from the model)."""

    def __init__(self, path: str | Path):
        import sentencepiece as spm

        self.path = str(path)
        self.model = spm.SentencePieceProcessor()
        try:
            self.model.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{path} is not a sentencepiece model: {e}") from e

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size()

    @property
    def bos_id(self) -> int:
        return self.model.bos_id()

    @property
    def eos_id(self) -> int:
        return self.model.eos_id()

    @property
    def pad_id(self) -> int:
        return self.model.pad_id()

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return self._wrap(list(self.model.encode(text)), bos, eos)

    def decode(self, ids: list[int]) -> str:
        return self.model.decode(list(ids))


_HF_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_HF_EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")


class HuggingFaceTokenizer(BaseTokenizer):
    """A HF ``tokenizer.json`` (needs the optional ``tokenizers`` package).

    BOS/EOS come from ``tokenizer_config.json`` next to the file when present, else from common
    token names; a tokenizer without them reports -1 and ``encode`` does not add them.
    """

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError(
                f"{path} is a HF tokenizer.json, which needs the 'tokenizers' package: "
                "run `pip install tokenizers`, or point model.hf_assets_path at a tokenizer.model."
            ) from e
        self.path = str(path)
        _check_hf_json(path)
        try:
            self.model = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the Rust error type is a bare Exception
            raise ValueError(f"Tokenizer file {path} could not be loaded as a HF tokenizer.json: {e}") from None
        cfg = _read_tokenizer_config(Path(path).parent / "tokenizer_config.json")
        self._bos_id = self._special_id(cfg.get("bos_token"), _HF_BOS_CANDIDATES)
        self._eos_id = self._special_id(cfg.get("eos_token"), _HF_EOS_CANDIDATES)
        self._pad_id = self._special_id(cfg.get("pad_token"), ())

    def _special_id(self, configured, candidates: tuple[str, ...]) -> int:
        if isinstance(configured, dict):
            configured = configured.get("content")
        names = (configured,) if configured else candidates
        for name in names:
            tid = self.model.token_to_id(name)
            if tid is not None:
                return tid
        return -1

    @property
    def vocab_size(self) -> int:
        return self.model.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return self._wrap(self.model.encode(text, add_special_tokens=False).ids, bos, eos)

    def decode(self, ids: list[int]) -> str:
        return self.model.decode(list(ids), skip_special_tokens=False)


def _read_tokenizer_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _check_hf_json(path: str | Path) -> None:
    """One line for a ``tokenizer.json`` that is not JSON (with the line and column) or not a
    HF tokenizer (no ``model`` entry)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"Tokenizer file {path} is not a HF tokenizer.json: not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"Tokenizer file {path} is not a HF tokenizer.json: not valid JSON at line {e.lineno}, "
            f"column {e.colno} ({e.msg})"
        ) from None
    if not isinstance(data, dict) or "model" not in data:
        raise ValueError(f"Tokenizer file {path} is JSON but not a HF tokenizer.json (it has no 'model' entry)")


def detect_tokenizer_kind(path: str | Path) -> str:
    """``"tiktoken"``, ``"sentencepiece"`` or ``"huggingface"``, from the file's content.

    A tiktoken file is text lines ``<base64> <rank>``; a sentencepiece model is a protobuf;
    a HF tokenizer is a JSON object with a ``"model"`` key.
    """
    with open(path, "rb") as f:
        head = f.read(4096)
    if not head:
        raise ValueError(
            f"Tokenizer file {path} is empty (0 bytes): restore it, or point "
            "--model.hf_assets_path at a folder holding a tokenizer (tokenizer.json, "
            "tokenizer.model)"
        )
    first_line = head.split(b"\n", 1)[0]
    if _TIKTOKEN_LINE.match(first_line):
        return "tiktoken"
    if head.lstrip()[:1] == b"{" or str(path).endswith(".json"):
        return "huggingface"
    # sentencepiece ModelProto starts with field 1 (repeated SentencePiece, length-delimited).
    if head[:1] == b"\x0a":
        return "sentencepiece"
    raise ValueError(
        f"Tokenizer file {path} is neither a tiktoken ranks file, a sentencepiece model "
        "nor a HF tokenizer.json."
    )


def check_tokenizer_file(model_cfg: Model) -> Path:
    """The tokenizer file ``build_tokenizer`` reads, checked without building the tokenizer:
    present, not empty, one of the three formats (a ``tokenizer.json`` is parsed as JSON).
    The pre-flight runs it; one-line errors as ``build_tokenizer``'s."""
    path = _tokenizer_file(model_cfg)
    if detect_tokenizer_kind(path) == "huggingface":
        _check_hf_json(path)
    return path


def build_tokenizer(model_cfg: Model) -> BaseTokenizer:
    """The tokenizer for the ``[model]`` config section.

    Uses ``model.tokenizer_path`` when set, else ``tokenizer.model`` / ``tokenizer.json`` in
    ``model.hf_assets_path``; tiktoken vs sentencepiece vs HF is detected from the file content.
    Raises ``FileNotFoundError`` naming the path and config key when nothing is found.
    """
    path = _tokenizer_file(model_cfg)
    kind = detect_tokenizer_kind(path)
    if kind == "tiktoken":
        tokenizer: BaseTokenizer = TikTokenTokenizer(path)
    elif kind == "sentencepiece":
        tokenizer = SentencePieceTokenizer(path)
    else:
        tokenizer = HuggingFaceTokenizer(path)
    if tokenizer.bos_id < 0 and tokenizer.eos_id < 0:
        from torchtitan.tools.logging import logger

        logger.warning(
            f"Tokenizer {path} has neither a BOS nor an EOS token: packed documents run into "
            "each other with nothing between them (name them in a tokenizer_config.json next "
            "to it: bos_token / eos_token)"
        )
    return tokenizer
