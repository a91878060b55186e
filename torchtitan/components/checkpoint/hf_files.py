"""Reading a Hugging Face safetensors folder without trusting it: every problem is one
``CheckpointError`` line naming the file.

What is checked before any tensor is read: ``model.safetensors.index.json`` (when present) is
valid and every shard it names exists and holds the tensors it maps there; without an index,
``-0000k-of-0000n`` names must be complete; every shard's header parses, its tensors' byte
ranges tile the data area exactly, and the file is exactly as long as the header says (a
truncated download or copy is caught here). After reading: a norm weight that is all zero
bytes is refused (the model needs a non-zero gain; it is what a zeroed file tail looks like),
other all-zero weight matrices get one warning. Safetensors carry no checksums, so changed bytes
inside a tensor that is not entirely zeroed cannot be detected from the format alone.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable

import torch

from torchtitan.components.checkpoint.common import CheckpointError

INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100 << 20  # safetensors' own limit
_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
    "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}
_SHARD_NAME = re.compile(r"^(.*)-(\d+)-of-(\d+)\.safetensors$")
_NORM = re.compile(r"norm\.weight$")


def read_header(path: str) -> dict[str, dict]:
    """``name -> {dtype, shape, data_offsets}`` of safetensors file ``path``, once the header
    parses and matches the file's size; CheckpointError naming the file otherwise."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            raw = f.read(n) if 0 <= n <= min(size - 8, _MAX_HEADER) else b""
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({err.strerror or err})") from None
    if n < 0 or len(raw) != n or n == 0:
        raise CheckpointError(
            f"{path}: {size} bytes, too short for the safetensors header it starts with "
            "(a truncated file, or not a safetensors file)"
        )
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except ValueError:
        raise CheckpointError(
            f"{path}: its safetensors header is not valid JSON (a corrupt file)"
        ) from None
    header.pop("__metadata__", None)
    spans = []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end)) and begin <= end
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"{path}: the header entry of {name!r} is malformed (a corrupt file)")
        width = _DTYPE_BYTES.get(dtype)
        if width is not None and math.prod(shape) * width != end - begin:
            raise CheckpointError(
                f"{path}: {name} ({dtype} {list(shape)}) needs {math.prod(shape) * width} bytes, "
                f"its header gives it {end - begin} (a corrupt header)"
            )
        spans.append((begin, end, name))
    covered = 0
    for begin, end, name in sorted(spans):
        if begin != covered:
            raise CheckpointError(
                f"{path}: the data of {name} does not follow the previous tensor's (a corrupt header)"
            )
        covered = end
    want = 8 + n + covered
    if size != want:
        why = "truncated: an incomplete download or copy" if size < want else "trailing bytes"
        raise CheckpointError(
            f"{path}: the file has {size} bytes, its safetensors header says {want} ({why})"
        )
    return header


def shard_files(folder: str) -> tuple[list[str], dict[str, str]]:
    """The shard file names of HF folder ``folder`` and the index's ``weight_map`` (empty
    without an index); CheckpointError naming a missing shard or a bad index."""
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()
            ):
                raise ValueError("weight_map is not a name -> file mapping")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"{index} is unreadable ({err}): a corrupt or partial download"
            ) from None
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not os.path.isfile(os.path.join(folder, name))]
        if missing:
            held = sum(1 for v in weight_map.values() if v == missing[0])
            more = f"; {len(missing)} of {len(files)} shards are missing" if len(missing) > 1 else ""
            raise CheckpointError(
                f"{os.path.join(folder, missing[0])} is missing: {INDEX} maps {held} of "
                f"{len(weight_map)} tensors to it{more} (an incomplete download or copy)"
            )
        return files, weight_map
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    for name in files:
        m = _SHARD_NAME.match(name)
        if m:
            prefix, width, total = m.group(1), len(m.group(2)), int(m.group(3))
            for i in range(1, total + 1):
                shard = f"{prefix}-{i:0{width}d}-of-{m.group(3)}.safetensors"
                if shard not in files:
                    raise CheckpointError(
                        f"{os.path.join(folder, shard)} is missing (shard {i} of {total}; an "
                        "incomplete download or copy)"
                    )
    return files, {}



def check_hf_folder(path: str) -> None:
    """HF safetensors weights at ``path`` (their index's shards all there), or one line."""
    try:
        shard_files(path)
    except (FileNotFoundError, NotADirectoryError) as err:
        raise CheckpointError(
            f"checkpoint.initial_load_path={path} with checkpoint.initial_load_in_hf: "
            f"{err.strerror or err}; point it at a folder of HF *.safetensors weights, or drop "
            "--checkpoint.initial_load_in_hf for a DCP checkpoint"
        ) from None

def _read(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as err:  # noqa: BLE001 - SafetensorError and friends: one line, the file
        line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CheckpointError(f"{path} cannot be read: {line}") from None


def _all_zero(t: torch.Tensor) -> bool:
    if t.numel() == 0:
        return False
    return not bool(t.contiguous().reshape(-1).view(torch.uint8).any())


def check_zeroed(
    tensors: dict[str, torch.Tensor], where: dict[str, str], warn: Callable[[str], None]
) -> None:
    """A norm weight that is all zero bytes is an error naming its file; other all-zero weight
    matrices one warning. ``where``: tensor name -> file."""
    zero_mats = []
    for name, t in tensors.items():
        if not name.endswith(".weight") or not _all_zero(t):
            continue
        if _NORM.search(name):
            raise CheckpointError(
                f"{where[name]}: {name} is all zeros, which no trained model has (a zeroed or "
                "damaged file region); restore the file from its source"
            )
        if t.dim() >= 2:
            zero_mats.append(name)
    if zero_mats:
        warn(
            f"{where[zero_mats[0]]}: {len(zero_mats)} weight matrices are all zeros (e.g. "
            f"{zero_mats[0]}); loading them as they are (check the file if that is unexpected)"
        )


def load_folder(path: str, warn: Callable[[str], None]) -> dict[str, torch.Tensor]:
    """Every tensor of the HF safetensors folder (or single file) ``path``, after the checks of
    the module docstring; CheckpointError naming the file otherwise."""
    if os.path.isfile(path) and path.endswith(".safetensors"):
        folder, files, weight_map = os.path.dirname(path), [os.path.basename(path)], {}
    elif os.path.isdir(path):
        folder = path
        files, weight_map = shard_files(folder)
    else:
        raise FileNotFoundError(f"{path}: no such HF checkpoint folder")
    headers = {name: read_header(os.path.join(folder, name)) for name in files}
    for key, name in weight_map.items():
        if key not in headers[name]:
            raise CheckpointError(
                f"{os.path.join(folder, name)} has no tensor {key}, which {INDEX} maps to it "
                "(a shard from another download)"
            )
    where: dict[str, str] = {}
    for name, header in headers.items():
        for key in header:
            if key in where:
                raise CheckpointError(
                    f"{os.path.join(folder, name)} and {where[key]} both hold {key} (files of two "
                    "models in one folder?)"
                )
            where[key] = os.path.join(folder, name)
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(_read(os.path.join(folder, name)))
    check_zeroed(tensors, where, warn)
    return tensors
