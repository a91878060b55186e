#!/usr/bin/env python3
"""Run two training configurations (or two git revisions) and compare their per-step losses.

Examples:
  # FSDP on 2 ranks vs a single device, same seed checkpoint, 10 steps
  python scripts/loss_compare.py --steps 10 \
      --a "NGPU=1 --checkpoint.initial_load_path outputs/seed/checkpoint/step-0" \
      --b "NGPU=2 --checkpoint.initial_load_path outputs/seed/checkpoint/step-0" --assert-equal
  # this checkout vs the main branch, same flags
  python scripts/loss_compare.py --steps 10 --b-rev main --assert-equal

Each side is a string of ``ENV=value`` words followed by trainer flags; both sides share
``--config`` and ``--steps`` and get ``--debug.seed`` and ``--debug.deterministic`` unless
``--no-deterministic``. Prints a table and a verdict line; ``--assert-equal`` exits 1 when any
step differs by more than the tolerance.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"(?<!validate )step:\s*(\d+)\s+loss:\s*([-+0-9.eE]+|nan|inf)")


def parse_losses(log: str) -> dict[int, float]:
    """Per-step losses from trainer console output (the ``step: N  loss: X`` lines)."""
    losses: dict[int, float] = {}
    for match in STEP_LINE.finditer(re.sub(r"\x1b\[[0-9;]*m", "", log)):
        losses[int(match.group(1))] = float(match.group(2))
    return losses


def split_side(spec: str) -> tuple[dict[str, str], list[str]]:
    env, flags = {}, []
    for word in shlex.split(spec):
        if not flags and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word):
            key, value = word.split("=", 1)
            env[key] = value
        else:
            flags.append(word)
    return env, flags


def run_side(name: str, spec: str, args: argparse.Namespace, workdir: Path) -> dict[int, float]:
    env_over, flags = split_side(spec)
    env = {**os.environ, **env_over, "LOG_RANK": env_over.get("LOG_RANK", "0")}
    env.setdefault("CONFIG_FILE", args.config)
    cmd = [
        "bash",
        str(workdir / "run_train.sh"),
        "--training.steps",
        str(args.steps),
        "--metrics.log_freq",
        "1",
        "--metrics.disable_color_printing",
        "--job.dump_folder",
        str(Path(args.dump_folder) / name),
    ]
    if args.deterministic:
        cmd += ["--debug.seed", str(args.seed), "--debug.deterministic"]
    cmd += flags
    print(f"[{name}] {' '.join(f'{k}={v}' for k, v in env_over.items())} {shlex.join(cmd)}", file=sys.stderr)
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"error: run {name} failed with exit code {proc.returncode}")
    losses = parse_losses(proc.stdout + proc.stderr)
    if not losses:
        raise SystemExit(f"error: run {name} printed no 'step: N  loss: X' lines")
    return losses


def compare(a: dict[int, float], b: dict[int, float], rtol: float, atol: float) -> tuple[list, bool]:
    rows, ok = [], True
    for step in sorted(set(a) | set(b)):
        la, lb = a.get(step, math.nan), b.get(step, math.nan)
        diff = abs(la - lb)
        within = diff <= atol + rtol * abs(lb)
        ok &= within
        rows.append((step, la, lb, diff, within))
    return rows, ok


def checkout_rev(rev: str) -> Path:
    target = Path(tempfile.mkdtemp(prefix="loss_compare_"))
    subprocess.run(["git", "worktree", "add", "--detach", str(target), rev], cwd=ROOT, check=True,
                   capture_output=True)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="./train_configs/debug_model.toml", help="TOML for both sides")
    p.add_argument("--a", default="", help="side A: 'ENV=v ... --flags' (default: plain run)")
    p.add_argument("--b", default="", help="side B: 'ENV=v ... --flags' (default: plain run)")
    p.add_argument("--b-rev", default=None, help="run side B from this git revision")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--assert-equal", action="store_true", help="exit 1 unless every step matches")
    p.add_argument("--dump-folder", default="./outputs/loss_compare")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    args = p.parse_args(argv)

    losses_a = run_side("a", args.a, args, ROOT)
    b_dir = checkout_rev(args.b_rev) if args.b_rev else ROOT
    try:
        losses_b = run_side("b", args.b, args, b_dir)
    finally:
        if args.b_rev:
            subprocess.run(["git", "worktree", "remove", "--force", str(b_dir)], cwd=ROOT,
                           capture_output=True)
    rows, ok = compare(losses_a, losses_b, args.rtol, args.atol)
    if args.json:
        print(json.dumps({"steps": [r[0] for r in rows], "a": [r[1] for r in rows],
                          "b": [r[2] for r in rows], "equal": ok}))
    else:
        print(f"{'step':>5} {'loss A':>12} {'loss B':>12} {'|diff|':>10}")
        for step, la, lb, diff, within in rows:
            print(f"{step:5d} {la:12.6f} {lb:12.6f} {diff:10.2e}{'' if within else '  <-- differs'}")
        max_diff = max(r[3] for r in rows)
        verdict = "EQUAL" if ok else "DIFFERENT"
        print(f"verdict: {verdict} (max |diff| {max_diff:.3e}, rtol {args.rtol}, atol {args.atol})")
    return 1 if (args.assert_equal and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
