"""Parse trainer logs and build the side-by-side table of scripts/compare_upstream.py.

Both trainers (this project and upstream torchtitan) log one console line per ``log_freq``
steps, e.g. ``step: 20  loss: 7.1  grad_norm: 0.9  memory: 35.14GiB(44.4%)  tps: 53,438
tflops: 2,431.9  mfu: 31.20%``; tokens/s and MFU there are averages over the steps since the
previous line, memory the peak reserved since then. No torch or torchtitan import here.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>-?[\d.]+|nan|inf)?.*?"
    r"memory:\s*(?P<mem>-?[\d.]+)GiB.*?"
    r"tps:\s*(?P<tps>[\d,]+)\s+"
    r"tflops:\s*(?P<tflops>[\d,.]+)\s+"
    r"mfu:\s*(?:(?P<mfu>[\d.]+)%|n/a)"
)


class ReportError(ValueError):
    """A log that holds no usable step lines."""


@dataclass(frozen=True)
class StepLine:
    """One logged training step."""

    step: int
    tps: float
    tflops: float
    mfu: float | None  # percent; None where the trainer knows no peak for the device
    memory_gib: float | None  # None where the trainer has no reading (negative in the log)
    loss: float | None = None


@dataclass(frozen=True)
class RunSummary:
    """A run's logged steps after warm-up, averaged."""

    tps: float
    tflops: float
    mfu: float | None
    memory_gib: float | None  # the largest peak among the averaged lines
    steps: tuple[int, ...]
    last_loss: float | None = None  # the last logged step's (a sanity check across variants)


def parse_steps(text: str) -> list[StepLine]:
    """Every training-step line in a console log (colors and ``[rankN]:`` prefixes allowed;
    validation lines are skipped)."""
    out = []
    for line in _ANSI.sub("", text).splitlines():
        if "validate step" in line:
            continue
        m = _STEP.search(line)
        if m is None:
            continue
        out.append(StepLine(
            step=int(m["step"]),
            tps=float(m["tps"].replace(",", "")),
            tflops=float(m["tflops"].replace(",", "")),
            mfu=None if m["mfu"] is None else float(m["mfu"]),
            memory_gib=None if m["mem"].startswith("-") else float(m["mem"]),
            loss=None if m["loss"] is None else float(m["loss"]),
        ))
    return out


def summarize(text: str, warmup: int) -> RunSummary:
    """Mean tokens/s, TFLOP/s and MFU of the logged steps after ``warmup`` (their windows
    hold no compilation), and the largest peak memory among them."""
    lines = [s for s in parse_steps(text) if s.step > warmup]
    if not lines:
        raise ReportError(f"no training-step lines after step {warmup} in the log")
    mfus = [s.mfu for s in lines]
    mems = [s.memory_gib for s in lines if s.memory_gib is not None]
    return RunSummary(
        tps=statistics.fmean(s.tps for s in lines),
        tflops=statistics.fmean(s.tflops for s in lines),
        mfu=None if None in mfus else statistics.fmean(mfus),
        memory_gib=max(mems) if mems else None,
        steps=tuple(s.step for s in lines),
        last_loss=lines[-1].loss,
    )


def combine(runs: list[RunSummary]) -> RunSummary | None:
    """Repeats of one setting on one side: means of the runs' means (None for no runs)."""
    if not runs:
        return None
    mfus = [r.mfu for r in runs]
    mems = [r.memory_gib for r in runs if r.memory_gib is not None]
    return RunSummary(
        tps=statistics.fmean(r.tps for r in runs),
        tflops=statistics.fmean(r.tflops for r in runs),
        mfu=None if None in mfus else statistics.fmean(mfus),
        memory_gib=max(mems) if mems else None,
        steps=runs[0].steps,
        last_loss=None if any(r.last_loss is None for r in runs)
        else statistics.fmean(r.last_loss for r in runs),
    )


def ratio(ours: RunSummary | None, upstream: RunSummary | None) -> float | None:
    """ours / upstream tokens per second (above 1: this project is faster)."""
    if ours is None or upstream is None or upstream.tps <= 0:
        return None
    return ours.tps / upstream.tps


def _pair(a: float | None, b: float | None, fmt: str) -> str:
    return " / ".join("n/a" if v is None else format(v, fmt) for v in (a, b))


def markdown_table(rows: list[tuple[str, RunSummary | None, RunSummary | None]],
                   upstream_version: str) -> str:
    """The table for docs/performance.md: one row per (label, ours, upstream); a side that
    failed shows ``failed``."""
    head = (f"| setting | this project tok/s | upstream {upstream_version} tok/s | ratio "
            "| MFU % (ours / upstream) | peak GiB (ours / upstream) "
            "| last loss (ours / upstream) |\n"
            "|---|---|---|---|---|---|---|\n")
    body = []
    for label, ours, up in rows:
        r = ratio(ours, up)
        body.append(
            f"| {label} | {'failed' if ours is None else f'{ours.tps:,.0f}'} "
            f"| {'failed' if up is None else f'{up.tps:,.0f}'} "
            f"| {'n/a' if r is None else f'{r:.3f}'} "
            f"| {_pair(ours and ours.mfu, up and up.mfu, '.2f')} "
            f"| {_pair(ours and ours.memory_gib, up and up.memory_gib, '.2f')} "
            f"| {_pair(ours and ours.last_loss, up and up.last_loss, '.4f')} |"
        )
    return head + "\n".join(body) + "\n"


def _as_dict(s: RunSummary | None) -> dict | None:
    if s is None:
        return None
    return {"tokens_per_s": round(s.tps, 1), "tflops": round(s.tflops, 2),
            "mfu_pct": None if s.mfu is None else round(s.mfu, 2),
            "peak_memory_gib": None if s.memory_gib is None else round(s.memory_gib, 2),
            "last_loss": s.last_loss, "steps": list(s.steps)}


def json_line(rows: list[tuple[str, RunSummary | None, RunSummary | None]], **meta) -> str:
    """One JSON line: ``meta`` (device, versions, commands, ...) plus each setting's results."""
    results = []
    for label, ours, up in rows:
        r = ratio(ours, up)
        results.append({"setting": label, "ours": _as_dict(ours), "upstream": _as_dict(up),
                        "ratio": None if r is None else round(r, 4)})
    return json.dumps({**meta, "results": results})
