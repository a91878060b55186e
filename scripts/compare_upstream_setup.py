"""Installs and the scratch folder for scripts/compare_upstream.py.

Upstream torchtitan and this project are both the package ``torchtitan``, so upstream goes
into a private ``pip install --no-deps --target`` folder and runs from a scratch folder that
holds only what its defaults read: ``tests/assets/tokenizer/tokenizer.json`` (+
``tokenizer_config.json``), ``tests/assets/c4_test/data.json`` and ``benchmark_flavors.py``.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_VERSION = "0.2.2"
# What upstream and the trainers need beside torch on a GPU machine (pinned as measured).
EXTRA_WHEELS = ("tyro==1.0.17", "docstring_parser==0.18.0", "typeguard==4.6.1",
                "torchdata==0.11.0", "datasets==4.4.2", "dill==0.4.0", "multiprocess==0.70.18",
                "torchao==0.18.0")
# Llama 3's pre-tokenization pattern (as in torchtitan/components/tokenizer.py).
LLAMA3_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# Upstream 0.2.2 spells FlexAttention + document masking as a flavor (attn_type="flex"):
# register "<flavor>_flex" for every Llama 3 flavor, after this project's benchmark flavors.
_UPSTREAM_FLEX = '''
# Added by scripts/compare_upstream_setup.py for upstream torchtitan: "<flavor>_flex".
for _k in [k for k in llama3_args if not k.endswith("_flex")]:
    llama3_args[f"{_k}_flex"] = dataclasses.replace(
        llama3_args[_k], attn_type="flex", attn_mask_type="block_causal")
'''


class SetupError(RuntimeError):
    """Something the comparison needs could not be installed or written (one line)."""


def _pip(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args, "-q", "--disable-pip-version-check"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise SetupError(f"pip {args[0]} failed: {last}")


def find_upstream_wheel(wheels: Path | None, work: Path, version: str = UPSTREAM_VERSION,
                        download: bool = True) -> Path:
    """Upstream's wheel: from ``wheels``, else ``work/download``, else ``pip download``."""
    for folder in (wheels, work / "download"):
        if folder is not None:
            found = sorted(Path(folder).glob(f"torchtitan-{version}-*.whl"))
            if found:
                return found[0]
    if not download:
        raise SetupError(f"no torchtitan-{version}-*.whl in {wheels}")
    _pip("download", "--no-deps", "-d", str(work / "download"), f"torchtitan=={version}")
    return find_upstream_wheel(None, work, version, download=False)


def install_upstream(wheel: Path, target: Path, version: str = UPSTREAM_VERSION) -> Path:
    """``pip install --no-deps --target`` upstream's wheel (kept when already there)."""
    if not (target / f"torchtitan-{version}.dist-info").is_dir():
        shutil.rmtree(target, ignore_errors=True)
        _pip("install", "--no-deps", "--no-index", "--no-compile", "--target", str(target),
             str(wheel))
    if not (target / "torchtitan" / "train.py").is_file():
        raise SetupError(f"{wheel.name} installed no torchtitan/train.py into {target}")
    return target


def install_wheels(wheels: Path, target: Path) -> list[str]:
    """Every wheel in ``wheels`` but torchtitan's into the shared ``target``; their names."""
    found = sorted(w for w in wheels.glob("*.whl") if not w.name.startswith("torchtitan-"))
    if found:
        _pip("install", "--no-deps", "--no-index", "--no-compile", "--upgrade", "--target",
             str(target), *map(str, found))
    return [w.name for w in found]


def fetch_wheels(dest: Path, python_version: str = "3.12") -> None:
    """``pip download`` upstream's wheel and ``EXTRA_WHEELS`` for a Linux x86-64 machine."""
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28)]
    _pip("download", "--no-deps", "--only-binary=:all:", f"--python-version={python_version}",
         "--implementation=cp", *platforms, "--platform=manylinux2014_x86_64",
         "--platform=any", "-d", str(dest), f"torchtitan=={UPSTREAM_VERSION}", *EXTRA_WHEELS)


def _byte_encoder() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE vocabularies use it)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)  # 188 printable bytes above; the rest from 256
    return dict(zip(bs, map(chr, cs)))


def tiktoken_to_tokenizer_json(ranks_file: Path, out_dir: Path) -> int:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` equal to a tiktoken ranks file
    (same ids, BOS/EOS right after the regular tokens, as this project's Llama 3 tokenizer
    numbers them); returns the vocabulary size."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks = {}
    for line in ranks_file.read_bytes().splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    enc = _byte_encoder()

    def text(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    def halves(token: bytes, rank: int) -> list[bytes]:  # BPE with the merges ranked below
        parts = [bytes([b]) for b in token]
        while True:
            best = min(((ranks.get(a + b), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))
                        if ranks.get(a + b, rank) < rank), default=None)
            if best is None:
                return parts
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]

    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1:
            a, b = halves(tok, rank)
            merges.append((text(a), text(b)))
    tk = Tokenizer(models.BPE({text(k): v for k, v in ranks.items()}, merges,
                              ignore_merges=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PAT), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    out_dir.mkdir(parents=True, exist_ok=True)
    tk.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS}) + "\n")
    return tk.get_vocab_size()


def make_scratch(scratch: Path, repo: Path = REPO_ROOT) -> Path:
    """The folder upstream runs from (rewritten each time)."""
    shutil.rmtree(scratch, ignore_errors=True)
    assets = scratch / "tests" / "assets"
    tiktoken_to_tokenizer_json(repo / "tests/assets/tokenizer/tokenizer.model",
                               assets / "tokenizer")
    # Only the train file: upstream loads the folder with datasets' split inference, and a
    # validation.json beside it would leave no "train" split.
    (assets / "c4_test").mkdir(parents=True)
    shutil.copy2(repo / "tests/assets/c4_test/data.json", assets / "c4_test" / "data.json")
    flavors = (repo / "scripts" / "benchmark_flavors.py").read_text()
    (scratch / "benchmark_flavors.py").write_text(flavors + _UPSTREAM_FLEX)
    shutil.copy2(repo / "scripts" / "upstream_cpu_shim.py", scratch / "upstream_cpu_shim.py")
    return scratch
