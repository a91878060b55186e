#!/usr/bin/env python3
"""Analyse Flight Recorder dumps with torch's analyser, repairing gloo dumps first.

  python scripts/analyze_flight_recorder.py outputs/comm_traces            # prefix rank_
  python scripts/analyze_flight_recorder.py outputs/comm_traces -p trace_ -j   # extra flags go to fr_trace

Dumps written by torchtitan's watchdog (torchtitan/tools/flight_recorder.py) and NCCL's own
dumps work with ``python -m torch.distributed.flight_recorder.fr_trace DIR -p PREFIX`` directly.
Dumps taken by hand on gloo (``torch._C._distributed_c10d._dump_fr_trace()``) carry a
``pg_config`` keyed ``''`` in torch 2.13, on which the analyser fails with ``KeyError: ('0', 0)``;
this wrapper copies the dumps to a temporary folder with ``pg_config`` rebuilt from the entries
and runs the analyser there. Exit status is the analyser's.

A rank that stalled hard (SIGSTOP, stuck in native code, killed) leaves no dump, and torch's
analyser then stops with "Missing dump files from ranks {...}". This wrapper names such ranks
as the suspects (with what every other rank last called) and runs the analyser on the dumps
that exist (``--allow-incomplete-ranks``).
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.tools.cli_args import OneLineParser  # noqa: E402
from torchtitan.tools.flight_recorder import fix_pg_config, last_collectives  # noqa: E402


def _ranks_in(trace: dict) -> set[int]:
    """Every global rank named by a dump's process groups."""
    ranks: set[int] = set()
    for cfg in (trace.get("pg_config") or {}).values():
        text = str(cfg.get("ranks", "")).strip("[] ")
        ranks.update(int(r) for r in text.split(",") if r.strip().isdigit())
    return ranks


def report_missing(traces: dict[int, dict]) -> set[int]:
    """Print the ranks that left no dump as the suspects; returns them."""
    expected: set[int] = set()
    for trace in traces.values():
        expected |= _ranks_in(trace)
    missing = expected - set(traces)
    if not missing:
        return missing
    names = ", ".join(map(str, sorted(missing)))
    print(
        f"suspect: rank(s) {names} left no Flight Recorder dump: a rank that stalls hard "
        "(stopped, stuck in native code or killed) cannot write one, so it is the likely "
        "culprit; the others waited for it:"
    )
    for rank, trace in sorted(traces.items()):
        newest = max(last_collectives(trace).items(), key=lambda kv: kv[1]["record_id"], default=None)
        if newest is not None:
            pg, c = newest
            print(f"  rank {rank}: last called {c['op']} #{c['seq']} on process group {pg} '{c['desc']}'")
    return missing


def read_dump(path: Path) -> dict:
    """The dump pickled in ``path``; ValueError naming the file when it is not one."""
    with open(path, "rb") as f:
        try:
            trace = pickle.load(f)
        except Exception as err:  # unpickling arbitrary bytes raises about anything
            why = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ValueError(f"{path} is not a Flight Recorder dump (not a pickle: {why})") from None
    if not isinstance(trace, dict) or "entries" not in trace:
        what = "dict without 'entries'" if isinstance(trace, dict) else type(trace).__name__
        raise ValueError(f"{path} is not a Flight Recorder dump (it holds a pickled {what})")
    return trace



def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("trace_dir")
    parser.add_argument("-p", "--prefix", default="rank_")
    args, rest = parser.parse_known_args(argv)
    folder = Path(args.trace_dir)
    if folder.is_file():
        try:
            read_dump(folder)
        except (OSError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"error: {folder} is one dump: give the folder holding the {args.prefix}<rank> "
              "dumps", file=sys.stderr)
        return 2
    files = sorted(p for p in folder.iterdir() if p.name.startswith(args.prefix)) if folder.is_dir() else []
    if not files:
        print(f"error: no files named {args.prefix}<rank> in {folder}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        repaired = 0
        traces: dict[int, dict] = {}
        for path in files:
            try:
                trace = read_dump(path)
            except (OSError, ValueError) as err:
                print(f"error: {err}", file=sys.stderr)
                return 2
            suffix = path.name[len(args.prefix):]
            if suffix.isdigit():
                traces[int(suffix)] = trace
            if "" in trace.get("pg_config", {}):
                fix_pg_config(trace)
                repaired += 1
            with open(os.path.join(tmp, path.name), "wb") as f:
                pickle.dump(trace, f)
        if repaired:
            print(f"repaired pg_config of {repaired} gloo dump(s)", file=sys.stderr)
        incomplete = ["--allow-incomplete-ranks"] if report_missing(traces) else []
        cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", tmp,
               "-p", args.prefix, *incomplete, *rest]
        return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
