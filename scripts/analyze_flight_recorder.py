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

from torchtitan.tools.flight_recorder import fix_pg_config  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("trace_dir")
    parser.add_argument("-p", "--prefix", default="rank_")
    args, rest = parser.parse_known_args(argv)
    folder = Path(args.trace_dir)
    files = sorted(p for p in folder.iterdir() if p.name.startswith(args.prefix)) if folder.is_dir() else []
    if not files:
        print(f"error: no files named {args.prefix}<rank> in {folder}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        repaired = 0
        for path in files:
            with open(path, "rb") as f:
                trace = pickle.load(f)
            if "" in trace.get("pg_config", {}):
                fix_pg_config(trace)
                repaired += 1
            with open(os.path.join(tmp, path.name), "wb") as f:
                pickle.dump(trace, f)
        if repaired:
            print(f"repaired pg_config of {repaired} gloo dump(s)", file=sys.stderr)
        cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", tmp,
               "-p", args.prefix, *rest]
        return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
