#!/usr/bin/env python3
"""Where a training step's GPU time goes, from torch.profiler chrome traces, side by side.

  python scripts/kernel_breakdown.py ours=DUMP_A/profile_traces upstream=DUMP_B/profile_traces

Each ``LABEL=PATH`` is a trace file (``.json`` or ``.json.gz``) or a folder searched for the
newest ``rank0_trace.json`` (both this project and upstream torchtitan write
``{dump_folder}/{save_traces_folder}/iteration_N/[...]/rank0_trace.json``). Per trace: the
profiled steps (``ProfilerStep#N`` spans), the GPU kernels', copies' and memsets' time per step
by category (matmuls, attention, optimizer, gradient norm and clipping, loss, casts and copies,
compiled fusions, ...), how busy the GPU was between its first and last kernel (a host
synchronisation or a slow data loader shows as idle time), and the kernels taking the most
time. Prints markdown tables; ``--json FILE`` also writes the figures.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.tools.cli_args import OneLineParser, non_negative_int  # noqa: E402

# First match wins; matched against the kernel's name.
CATEGORIES: list[tuple[str, re.Pattern]] = [(name, re.compile(rx, re.I)) for name, rx in [
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter"),
    ("optimizer step", r"adam"),
    ("grad norm", r"lpnorm|norm_functor|LpMax|l2norm"),
    ("attention", r"flash|fmha|attention|_sdpa|sdpa_|mha_|flex"),
    ("matmul (float8)", r"(e4m3|e5m2|fp8|float8).*(gemm|cutlass|xmma|nvjet|scaled_mm)|"
                        r"(gemm|cutlass|xmma|nvjet|scaled_mm).*(e4m3|e5m2|fp8|float8)"),
    ("matmul", r"gemm|cutlass|cublas|nvjet|xmma|sm90_|sm80_|ampere_|Kernel2|splitK|triton_tem"),
    ("loss", r"cross_entropy|nll_loss|log_softmax|logsumexp"),
    ("embedding", r"embedding|index_select|indexSelect|indexing_backward|index_put|radix|"
                  r"sort_|segment|vectorized_gather"),
    ("compiled fusion", r"^triton_"),
    ("foreach (clip, scale)", r"multi_tensor_apply|foreach"),
    ("cast / copy", r"copy|cast|convert|CatArray|memcpy|memset|fill"),
    ("other elementwise / reduce", r"elementwise|vectorized|reduce_kernel|unrolled"),
]]
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
OPTIMIZER = "optimizer step"


def categorize(name: str, cat: str = "kernel") -> str:
    """The category of one GPU event (its kernel name; copies and memsets by their kind)."""
    if cat == "gpu_memcpy":
        return "host <-> device copy" if re.search(r"HtoD|DtoH", name) else "cast / copy"
    if cat == "gpu_memset":
        return "cast / copy"
    for label, rx in CATEGORIES:
        if rx.search(name):
            return label
    return "other"


@dataclass
class Breakdown:
    """One trace's figures: per category and per kernel, microseconds summed over the
    profiled steps."""

    path: str
    steps: int
    span_us: float  # first GPU event's start to last one's end
    busy_us: float  # the union of GPU events over that span
    by_category: dict[str, float] = field(default_factory=dict)
    by_kernel: dict[str, float] = field(default_factory=dict)

    @property
    def gpu_us(self) -> float:
        return sum(self.by_category.values())

    def per_step_ms(self, us: float) -> float:
        return us / 1000 / max(self.steps, 1)


def load_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        try:
            trace = json.load(f)
        except ValueError as err:
            raise ValueError(f"{path} is not a torch.profiler chrome trace (JSON): {err}") from None
    if not isinstance(trace, dict):
        raise ValueError(f"{path} is not a torch.profiler chrome trace (a JSON object)")
    return trace


def find_trace(path: Path) -> Path:
    """``path`` itself, or the newest ``rank0_trace.json[.gz]`` below it."""
    if path.is_file():
        return path
    found = [*path.rglob("rank0_trace.json"), *path.rglob("rank0_trace.json.gz")]
    if not found:
        raise FileNotFoundError(f"no rank0_trace.json under {path}")
    return max(found, key=lambda p: p.stat().st_mtime)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


OPTIMIZER_STEP = "Optimizer.step#"
"""torch.optim wraps every ``step`` in a profiler range named ``Optimizer.step#<class>.step``."""


def _launched_in_optimizer_step(events: list[dict]) -> set[object]:
    """Correlation ids of the kernels launched inside an optimizer step's range: a compiled
    step's kernels are named after their fused ops, not after Adam."""
    ranges = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
                    if e.get("ph") == "X" and str(e.get("name", "")).startswith(OPTIMIZER_STEP))
    found = set()
    if not ranges:
        return found
    for e in events:
        if e.get("cat") not in ("cuda_runtime", "cuda_driver") or e.get("ph") != "X":
            continue
        correlation = (e.get("args") or {}).get("correlation")
        ts = float(e.get("ts", 0.0))
        if correlation is not None and any(lo <= ts <= hi for lo, hi in ranges):
            found.add(correlation)
    return found


def breakdown(trace: dict, path: str = "") -> Breakdown:
    """The figures of one chrome trace (torch.profiler's ``export_chrome_trace``). A kernel
    launched inside an optimizer step counts as the optimizer's, whatever its name."""
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    steps = {e["name"] for e in events
             if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")}
    in_step = _launched_in_optimizer_step(events)
    by_category: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, float] = defaultdict(float)
    intervals = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATEGORIES:
            continue
        dur, ts = float(e.get("dur", 0.0)), float(e.get("ts", 0.0))
        name = str(e.get("name", ""))
        if e["cat"] == "kernel" and (e.get("args") or {}).get("correlation") in in_step:
            by_category[OPTIMIZER] += dur
        else:
            by_category[categorize(name, e["cat"])] += dur
        by_kernel[name] += dur
        intervals.append((ts, ts + dur))
    span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    return Breakdown(path, len(steps), span, _union_us(intervals), dict(by_category),
                     dict(by_kernel))


def _short(name: str, width: int = 90) -> str:
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[: width - 3] + "..."


def tables(results: dict[str, Breakdown], top: int = 12) -> str:
    """Markdown: the categories side by side (ms per step), then each trace's top kernels."""
    labels = list(results)
    cats = sorted({c for b in results.values() for c in b.by_category},
                  key=lambda c: -max(b.by_category.get(c, 0.0) for b in results.values()))
    lines = ["| GPU time per step, ms | " + " | ".join(labels) + " |",
             "|---|" + "---|" * len(labels)]
    for c in cats:
        lines.append(f"| {c} | " + " | ".join(
            f"{b.per_step_ms(b.by_category.get(c, 0.0)):.2f}" for b in results.values()) + " |")
    for title, value in (
        ("**all GPU work**", lambda b: f"{b.per_step_ms(b.gpu_us):.2f}"),
        ("GPU span (first to last kernel)", lambda b: f"{b.per_step_ms(b.span_us):.2f}"),
        ("GPU busy over the span", lambda b: f"{100 * b.busy_us / b.span_us:.1f} %"
         if b.span_us else "n/a"),
        ("profiled steps", lambda b: str(b.steps)),
    ):
        lines.append(f"| {title} | " + " | ".join(value(b) for b in results.values()) + " |")
    for label, b in results.items():
        lines += ["", f"Top kernels, {label} ({b.path}):", "",
                  "| ms per step | category | kernel |", "|---|---|---|"]
        for name, us in sorted(b.by_kernel.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"| {b.per_step_ms(us):.2f} | {categorize(name)} | "
                         f"`{_short(name).replace('|', '/')}` |")
    return "\n".join(lines) + "\n"



def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", metavar="LABEL=PATH")
    p.add_argument("--top", type=non_negative_int, default=12, help="kernels listed per trace")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    if args.json is not None and args.json.is_dir():
        p.error(f"--json {args.json} is a folder: give the file to write the figures to")
    if args.json is not None and not args.json.parent.is_dir():
        p.error(f"--json {args.json}: there is no folder {args.json.parent}")
    paths: dict[str, str] = {}
    for spec in args.traces:
        label, sep, path = spec.partition("=")
        if not sep:
            label, path = Path(spec).name, spec
        if label in paths:
            p.error(f"label {label!r} is given twice ({paths[label]}, {path}): give each trace "
                    "its own LABEL=PATH")
        paths[label] = path
    results: dict[str, Breakdown] = {}
    for label, path in paths.items():
        try:
            trace_path = find_trace(Path(path))
            results[label] = breakdown(load_trace(trace_path), str(trace_path))
        except (OSError, ValueError) as e:
            print(f"error: {label}: {e}", file=sys.stderr)
            return 2
        if not results[label].by_category:
            print(f"error: {label}: {trace_path} holds no GPU kernels (a CPU-only trace?)",
                  file=sys.stderr)
            return 2
    if args.json is not None and args.json.exists():
        for label, b in results.items():
            if os.path.samefile(args.json, b.path):
                p.error(f"--json {args.json} is the trace of {label!r}: writing the figures "
                        "there would overwrite it")
    print(tables(results, args.top), end="")
    if args.json is not None:
        args.json.write_text(json.dumps({k: vars(v) for k, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
