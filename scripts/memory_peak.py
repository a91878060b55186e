#!/usr/bin/env python3
"""What was live at a CUDA memory snapshot's peak, by where it was allocated, in text.

  python scripts/memory_peak.py outputs/memory_snapshot/iteration_10/rank0_memory_snapshot.pickle
  python scripts/memory_peak.py ours=DUMP_A upstream=DUMP_B --top 15

Reads the pickles ``--profiling.enable_memory_snapshot`` writes (torch's
``torch.cuda.memory._snapshot()``; upstream torchtitan writes the same files), or a folder
searched for the newest ``rank{R}_memory_snapshot.pickle``. Replays the allocator's recorded
history backwards from the snapshot and prints, per snapshot: the allocated peak in the recorded
window and when it happened, the reserved memory then and at its own peak, allocated and
reserved over the window in slices (a first step's one-off peak shows in the first slices), and
the blocks live at the peak grouped by the first frame of their allocation stack that belongs to
the training code (torchtitan's, or a script's), else the compiled graph or library frame that
allocated them. ``--after S`` looks for the peak only S seconds or more into the window
(the steady state, past a first step; ``--after 50%`` the window's second half). The browser view of the same file is
https://pytorch.org/memory_viz; this is the text a log or a review can hold.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.tools.cli_args import (  # noqa: E402
    OneLineParser,
    non_negative_float,
    non_negative_int,
    positive_int,
)  # noqa: E402

GIB = 1024**3
# Path components that mark a library's file (the harness installs wheels with --target,
# outside site-packages, so the package names count too).
LIBRARIES = {"torch", "torchao", "torchdata", "torchft", "triton", "numpy", "datasets",
             "transformers", "tyro", "safetensors", "wandb", "tensorboard", "site-packages",
             "dist-packages", "functorch"}
_STDLIB = re.compile(r"/lib/python\d+(\.\d+)?/")
BEFORE_WINDOW = "(allocated before the recorded history)"
NO_STACK = "(no stack recorded for this block)"
NO_PYTHON = "(no Python frame: C++ code, e.g. the autograd engine)"


class SnapshotError(ValueError):
    """A file that is not a usable CUDA memory snapshot."""


@dataclass
class PeakReport:
    """One snapshot's figures (bytes; seconds from the first recorded event)."""

    path: str
    device: int
    entries: int
    span_s: float
    peak_allocated: int
    peak_time_s: float
    reserved_at_peak: int
    peak_reserved: int
    peak_reserved_time_s: float
    live_blocks: int
    groups: list[tuple[str, int, int]] = field(default_factory=list)  # label, bytes, blocks
    slices: list[tuple[float, int, int]] = field(default_factory=list)  # start s, max alloc, max reserved
    has_history: bool = True


def find_snapshot(path: Path, rank: int) -> Path:
    """``path`` itself, or the newest ``rank{rank}_memory_snapshot.pickle`` below a folder."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise SnapshotError(f"{path}: no such file or folder")
    found = sorted(path.rglob(f"rank{rank}_memory_snapshot.pickle"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SnapshotError(f"{path}: no rank{rank}_memory_snapshot.pickle below this folder")
    return found[-1]


def load_snapshot(path: Path) -> dict:
    """The snapshot dict of a pickle written from ``torch.cuda.memory._snapshot()``."""
    try:
        with open(path, "rb") as f:
            snapshot = pickle.load(f)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            ImportError, IndexError, KeyError) as err:
        raise SnapshotError(f"{path}: not a memory snapshot pickle ({type(err).__name__}: {err})") from None
    except OSError as err:
        raise SnapshotError(f"{path}: cannot read it ({err.strerror or err})") from None
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise SnapshotError(
            f"{path}: not a CUDA memory snapshot (expected torch.cuda.memory._snapshot()'s dict "
            "with 'segments' and 'device_traces')"
        )
    return snapshot


def frame_kind(filename: str) -> str:
    """``project``, ``compiled`` (inductor's generated code), ``library`` or ``native`` (C++)."""
    if not filename.endswith(".py") or filename.startswith("<"):
        return "native"
    if "torchinductor" in filename:
        return "compiled"
    parts = PurePosixPath(filename).parts
    if "torchtitan" in parts:
        return "project"
    if LIBRARIES.intersection(parts) or _STDLIB.search(filename):
        return "library"
    return "project"


def _short(filename: str) -> str:
    """The path from its package on (``torchtitan/...``, ``torch/...``), else its last two
    components."""
    parts = PurePosixPath(filename).parts
    packages = {"torchtitan"} | (LIBRARIES - {"site-packages", "dist-packages"})
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] in packages:
            return "/".join(parts[i:])
    return "/".join(parts[-2:])


def group_label(frames: list[dict] | None) -> str:
    """Where a block was allocated: its innermost training-code frame, else the compiled graph
    or the library frame nearest to the allocation."""
    if not frames:
        return NO_STACK
    kinds = [frame_kind(f.get("filename", "")) for f in frames]
    for wanted in ("project", "compiled", "library"):
        for frame, kind in zip(frames, kinds):
            if kind != wanted:
                continue
            if kind == "compiled":  # one file per graph; its lines are single buffers
                return f"compiled graph {PurePosixPath(frame['filename']).name} ({frame.get('name', '?')})"
            return f"{_short(frame['filename'])}:{frame.get('line', '?')} {frame.get('name', '?')}"
    return NO_PYTHON


def _device_index(snapshot: dict, device: int | None) -> int:
    traces = snapshot.get("device_traces") or []
    if device is not None:
        if device >= max(len(traces), 1):
            raise SnapshotError(f"--device {device}: the snapshot has {len(traces)} device trace(s)")
        return device
    sizes = [len(t) for t in traces]
    return sizes.index(max(sizes)) if sizes and max(sizes) else 0


def after_arg(text: str) -> tuple[float, bool]:
    """``--after``: seconds (``12.5``) or a share of the window (``50%``)."""
    percent = text.endswith("%")
    value = non_negative_float(text[:-1] if percent else text)
    if percent and value > 100:
        raise argparse.ArgumentTypeError(f"a share of the window is at most 100%, got {text}")
    return value, percent


def analyze(snapshot: dict, path: str = "", device: int | None = None,
            after: tuple[float, bool] = (0.0, False), n_slices: int = 8) -> PeakReport:
    """Replay the allocator history of ``snapshot`` (see the module docstring); the peak is
    looked for from ``after`` on: (seconds, False) or (percent of the window, True)."""
    dev = _device_index(snapshot, device)
    segments = [s for s in snapshot["segments"] if s.get("device", dev) == dev]
    live: dict[int, tuple[int, list | None]] = {}
    for seg in segments:
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated":
                live[block["address"]] = (block["size"], block.get("frames"))
    reserved = sum(s["total_size"] for s in segments)
    traces = snapshot.get("device_traces") or []
    trace = traces[dev] if dev < len(traces) else []
    if not trace:
        return _report_without_history(path, dev, live, reserved)
    # the point a block stops counting: its free request where the trace records them
    free_action = "free_requested" if any(e["action"] == "free_requested" for e in trace) \
        else "free_completed"
    times = [e.get("time_us") for e in trace]
    t0 = times[0] if times[0] is not None else 0
    secs = [((t if t is not None else t0) - t0) / 1e6 for t in times]
    allocated = sum(size for size, _ in live.values())
    states: list[tuple[int, int]] = [(0, 0)] * len(trace)  # after each entry: allocated, reserved
    for i in range(len(trace) - 1, -1, -1):  # backwards from the snapshot's state
        states[i] = (allocated, reserved)
        e = trace[i]
        action, size = e["action"], e.get("size", 0)
        if action == "alloc":
            if live.pop(e["addr"], None) is not None:
                allocated -= size
        elif action == free_action:
            live[e["addr"]] = (size, None)
            allocated += size
        elif action in ("segment_alloc", "segment_map"):
            reserved -= size
        elif action in ("segment_free", "segment_unmap"):
            reserved += size
    after_s = after[0] * secs[-1] / 100 if after[1] else after[0]
    window = [i for i in range(len(trace)) if secs[i] >= after_s] or list(range(len(trace)))
    peak = max(window, key=lambda i: states[i][0])
    peak_res = max(window, key=lambda i: states[i][1])
    report = PeakReport(
        path=path, device=dev, entries=len(trace), span_s=secs[-1],
        peak_allocated=states[peak][0], peak_time_s=secs[peak], reserved_at_peak=states[peak][1],
        peak_reserved=states[peak_res][1], peak_reserved_time_s=secs[peak_res], live_blocks=0,
    )
    blocks = _live_at(snapshot, segments, trace, peak, free_action)
    report.live_blocks = len(blocks)
    report.groups = _grouped(blocks)
    report.slices = _slices(states, secs, n_slices)
    return report


def _live_at(snapshot, segments, trace, index, free_action) -> list[tuple[int, str]]:
    """(size, label) of every block live right after ``trace[index]``."""
    live: dict[int, tuple[int, str | None]] = {}
    for seg in segments:
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated":
                live[block["address"]] = (block["size"], group_label(block.get("frames")))
    for e in reversed(trace[index + 1:]):  # back to the peak: labels not known yet
        if e["action"] == "alloc":
            live.pop(e["addr"], None)
        elif e["action"] == free_action:
            live[e["addr"]] = (e.get("size", 0), None)
    labels = {addr: label for addr, (_, label) in live.items()}
    unlabeled = {addr for addr, label in labels.items() if label is None}
    for e in reversed(trace[:index + 1]):  # each block's own allocation, before the peak
        if not unlabeled:
            break
        if e["action"] == "alloc" and e["addr"] in unlabeled:
            labels[e["addr"]] = group_label(e.get("frames"))
            unlabeled.discard(e["addr"])
    return [(size, labels[addr] or BEFORE_WINDOW) for addr, (size, _) in live.items()]


def _grouped(blocks: list[tuple[int, str]]) -> list[tuple[str, int, int]]:
    by_label: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, label in blocks:
        by_label[label][0] += size
        by_label[label][1] += 1
    return sorted(((lbl, b, n) for lbl, (b, n) in by_label.items()), key=lambda g: -g[1])


def _slices(states, secs, n) -> list[tuple[float, int, int]]:
    out = []
    count = len(states)
    for k in range(min(n, count)):
        lo, hi = k * count // n, max((k + 1) * count // n, k * count // n + 1)
        part = states[lo:hi]
        out.append((secs[lo], max(a for a, _ in part), max(r for _, r in part)))
    return out


def _report_without_history(path, dev, live, reserved) -> PeakReport:
    blocks = [(size, group_label(frames)) for size, frames in live.values()]
    total = sum(size for size, _ in blocks)
    return PeakReport(path=path, device=dev, entries=0, span_s=0.0, peak_allocated=total,
                      peak_time_s=0.0, reserved_at_peak=reserved, peak_reserved=reserved,
                      peak_reserved_time_s=0.0, live_blocks=len(blocks), groups=_grouped(blocks),
                      has_history=False)


def format_report(label: str, r: PeakReport, top: int) -> str:
    """The text of one report: figures, slices, the largest groups."""
    g = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
    name = f"{label}: " if label else ""
    lines = [f"## {name}{r.path} (device {r.device})"]
    if not r.has_history:
        lines.append(
            "no allocator history in this snapshot (recorded without "
            "_record_memory_history): what was live when it was taken, "
            f"{g(r.peak_allocated)} allocated, {g(r.reserved_at_peak)} reserved"
        )
    else:
        lines += [
            f"history: {r.entries:,} allocator events over {r.span_s:.2f} s",
            f"peak allocated: {g(r.peak_allocated)} at {r.peak_time_s:.2f} s "
            f"({r.live_blocks:,} blocks live); reserved then {g(r.reserved_at_peak)}",
            f"peak reserved: {g(r.peak_reserved)} at {r.peak_reserved_time_s:.2f} s",
            "",
            "| from s | max allocated GiB | max reserved GiB |",
            "|---|---|---|",
            *(f"| {s:.2f} | {a / GIB:.2f} | {res / GIB:.2f} |" for s, a, res in r.slices),
        ]
    lines += ["", "| GiB | blocks | allocated at |", "|---|---|---|"]
    lines += [f"| {b / GIB:.3f} | {n:,} | {lbl} |" for lbl, b, n in r.groups[:top]]
    rest = r.groups[top:]
    if rest:
        lines.append(f"| {sum(b for _, b, _ in rest) / GIB:.3f} | {sum(n for *_, n in rest):,} "
                     f"| ({len(rest)} more places) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0],
                           usage="memory_peak.py [LABEL=]PATH [[LABEL=]PATH ...] [options]")
    parser.add_argument("inputs", nargs="+", metavar="[LABEL=]PATH",
                        help="a snapshot pickle or a folder holding rank{R}_memory_snapshot.pickle")
    parser.add_argument("--rank", type=non_negative_int, default=0, help="which rank's file a folder gives (0)")
    parser.add_argument("--device", type=non_negative_int, default=None,
                        help="the device trace to read (default: the one with the most events)")
    parser.add_argument("--after", type=after_arg, default=(0.0, False), metavar="S|P%",
                        help="look for the peak only S seconds (or P%% of the window) after the "
                             "first event: the steady state past a first step")
    parser.add_argument("--top", type=positive_int, default=20, help="places listed (20)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.json is not None and args.json.is_dir():
        parser.error(f"--json {args.json} is a folder; give a file name")
    reports = []
    try:
        for item in args.inputs:
            label, path = "", item
            if "=" in item and not Path(item).exists():
                label, _, path = item.partition("=")
            file = find_snapshot(Path(path), args.rank)
            reports.append((label, analyze(load_snapshot(file), str(file), args.device, args.after)))
    except SnapshotError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n\n".join(format_report(label, r, args.top) for label, r in reports))
    if args.json is not None:
        args.json.write_text(json.dumps({label or r.path: asdict(r) for label, r in reports}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
