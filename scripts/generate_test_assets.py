"""Generate the offline test assets shipped in ``tests/assets/``.

Writes, deterministically (re-running reproduces byte-identical files):

* ``c4_test/data.json`` and ``c4_test/validation.json``: synthetic English-like documents in C4's
  JSON-lines format (``{"text", "timestamp", "url"}``), from the templates of
  ``scripts/synthetic_corpus.py``; it is NOT C4 text (the project cannot ship C4).
* ``tokenizer/tokenizer.model``: a Llama 3 style tiktoken BPE ranks file (base64 token, space, rank)
  trained on ``data.json`` with the small byte-level BPE trainer below and Llama 3's
  pre-tokenization regex. Llama 3's 256 special tokens are added by the tokenizer class at load time.
* ``tokenizer_sp/tokenizer.model``: a Llama 2 style sentencepiece BPE model (unk=0, bos=1, eos=2,
  byte fallback) trained with sentencepiece's own trainer on ``data.json``.

Usage::

    python scripts/generate_test_assets.py                 # writes into tests/assets/
    python scripts/generate_test_assets.py --out-dir /tmp/a --only corpus,tiktoken
"""

from __future__ import annotations

import base64
import heapq
import io
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import regex

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when imported by path (tests)
from synthetic_corpus import generate_corpus, write_jsonl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout run without installing it
from torchtitan.tools.cli_args import OneLineParser  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = REPO_ROOT / "tests" / "assets"

TRAIN_DOCS, TRAIN_SEED = 2000, 1234
VALID_DOCS, VALID_SEED = 200, 5678
TIKTOKEN_VOCAB = 2000  # regular tokens: 256 bytes + merges (special tokens come on top)
SP_VOCAB = 2000

# Llama 3's pre-tokenization pattern (same string as torchtitan/components/tokenizer.py).
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ----------------------------------------------------------------------------------------------
# Byte-level BPE trainer (tiktoken / Llama 3 format)
# ----------------------------------------------------------------------------------------------


def train_bpe(texts: list[str], vocab_size: int, pat_str: str = LLAMA3_PAT_STR) -> dict[bytes, int]:
    """Train byte-level BPE ranks (token bytes -> rank) with ``vocab_size`` regular tokens.

    Ranks 0..255 are the single bytes; each merge of the most frequent adjacent pair (ties broken
    by the pair's bytes) adds the next rank, so tiktoken's lowest-rank-first merging reproduces the
    training segmentation. Stops early if no pair is left to merge.
    """
    pat = regex.compile(pat_str)
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(pat.findall(text))
    pieces = sorted(counts)
    words = [list(p.encode("utf-8")) for p in pieces]
    freqs = [counts[p] for p in pieces]

    vocab: dict[int, bytes] = {i: bytes([i]) for i in range(256)}
    ranks: dict[bytes, int] = {bytes([i]): i for i in range(256)}
    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, (w, f) in enumerate(zip(words, freqs)):
        for pair in zip(w, w[1:]):
            pair_counts[pair] += f
            where[pair].add(wi)

    def entry(pair: tuple[int, int]) -> tuple[int, bytes, bytes, int, int]:
        return (-pair_counts[pair], vocab[pair[0]], vocab[pair[1]], pair[0], pair[1])

    heap = [entry(p) for p in pair_counts if pair_counts[p] > 0]
    heapq.heapify(heap)
    while len(ranks) < vocab_size and heap:
        neg, _, _, a, b = heapq.heappop(heap)
        pair = (a, b)
        if -neg != pair_counts.get(pair, 0) or neg == 0:
            continue  # stale heap entry
        merged = vocab[a] + vocab[b]
        new_id = ranks.get(merged)
        if new_id is None:
            new_id = len(ranks)
            ranks[merged] = new_id
            vocab[new_id] = merged
        touched: set[tuple[int, int]] = set()
        for wi in sorted(where.pop(pair)):
            w, f = words[wi], freqs[wi]
            for p in zip(w, w[1:]):
                pair_counts[p] -= f
                touched.add(p)
            new_w, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    new_w.append(new_id)
                    i += 2
                else:
                    new_w.append(w[i])
                    i += 1
            for p in zip(new_w, new_w[1:]):
                pair_counts[p] += f
                where[p].add(wi)
                touched.add(p)
            words[wi] = new_w
        pair_counts.pop(pair, None)
        for p in sorted(touched):
            if pair_counts.get(p, 0) > 0:
                heapq.heappush(heap, entry(p))
    return ranks


def write_tiktoken_ranks(ranks: dict[bytes, int], path: Path) -> None:
    """Write ranks in tiktoken's ``load_tiktoken_bpe`` format: ``base64(token) rank`` per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        f"{base64.b64encode(tok).decode('ascii')} {rank}\n"
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    with open(path, "w", encoding="ascii", newline="\n") as f:
        f.writelines(lines)


# ----------------------------------------------------------------------------------------------
# Sentencepiece (Llama 2 format)
# ----------------------------------------------------------------------------------------------


def train_sentencepiece(texts: list[str], vocab_size: int, path: Path) -> None:
    """Train a Llama 2 style sentencepiece BPE model (single-threaded, deterministic)."""
    import sentencepiece as spm

    sentences = [line for text in texts for line in text.split("\n") if line.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=buf,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        shuffle_input_sentence=False,
        input_sentence_size=0,
        seed_sentencepiece_size=1_000_000,
        minloglevel=2,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


# ----------------------------------------------------------------------------------------------



def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="assets folder")
    parser.add_argument(
        "--only",
        default="corpus,tiktoken,sentencepiece",
        help="comma-separated subset of: corpus, tiktoken, sentencepiece",
    )
    args = parser.parse_args(argv)
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    unknown = parts - {"corpus", "tiktoken", "sentencepiece"}
    if unknown:
        parser.error(
            f"unknown --only part(s) {sorted(unknown)}; use corpus, tiktoken, sentencepiece"
        )
    if not parts:
        parser.error(f"--only {args.only!r} selects nothing; use one or more of corpus, "
                     "tiktoken, sentencepiece")

    out: Path = args.out_dir
    if out.exists() and not out.is_dir():
        parser.error(f"--out-dir {out} is an existing file, not a folder")
    t0 = time.perf_counter()
    train = generate_corpus(TRAIN_DOCS, TRAIN_SEED)
    texts = [d["text"] for d in train]
    if "corpus" in parts:
        write_jsonl(train, out / "c4_test" / "data.json")
        write_jsonl(generate_corpus(VALID_DOCS, VALID_SEED), out / "c4_test" / "validation.json")
        print(f"corpus: {len(train)} + {VALID_DOCS} documents -> {out / 'c4_test'}")
    if "tiktoken" in parts:
        ranks = train_bpe(texts, TIKTOKEN_VOCAB)
        write_tiktoken_ranks(ranks, out / "tokenizer" / "tokenizer.model")
        print(f"tiktoken: {len(ranks)} regular tokens -> {out / 'tokenizer' / 'tokenizer.model'}")
    if "sentencepiece" in parts:
        train_sentencepiece(texts, SP_VOCAB, out / "tokenizer_sp" / "tokenizer.model")
        print(f"sentencepiece: {SP_VOCAB} pieces -> {out / 'tokenizer_sp' / 'tokenizer.model'}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
