#!/usr/bin/env python3
"""Run two training configurations (or two git revisions) and compare their per-step losses.

Examples (run from the repository root; each finishes in a few minutes on a 2-core CPU):
  # FSDP vs DDP on 2 ranks (the same dp degree, so the same data), both from one seed checkpoint
  python scripts/loss_compare.py --steps 5 --seed-checkpoint --assert-equal \\
      --flags "--model.flavor debugmodel_tiny --training.seq_len 64" \\
      --a "NGPU=2 --parallelism.data_parallel_shard_degree 2" \\
      --b "NGPU=2 --parallelism.data_parallel_shard_degree 1 --parallelism.data_parallel_replicate_degree 2"
  # FSDP 2 x TP 2 (4 ranks) vs FSDP 2, each simulated in one process (COMM_MODE=local_tensor)
  python scripts/loss_compare.py --steps 3 --seed-checkpoint --assert-equal \\
      --flags "--model.flavor debugmodel_tiny --training.seq_len 64" \\
      --a "COMM_MODE=local_tensor NGPU=4 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2" \\
      --b "COMM_MODE=local_tensor NGPU=2 --parallelism.data_parallel_shard_degree 2"
  # this checkout (uncommitted changes included) vs its last commit, same flags
  python scripts/loss_compare.py --steps 5 --b-rev HEAD --assert-equal \\
      --flags "--model.flavor debugmodel_tiny --training.seq_len 64"

Each side is a string of ``ENV=value`` words followed by trainer flags, run with ./run_train.sh
after the shared ``--config``, ``--steps`` and ``--flags``; both sides get ``--debug.seed`` and
``--debug.deterministic`` unless ``--no-deterministic``. ``--seed-checkpoint`` first writes one
seed checkpoint (one process, every parallel degree 1, ``--flags`` applied) and starts both sides
from it (``--checkpoint.initial_load_path``), so layouts that initialise their shards
differently start from the same weights. Losses are read at full precision from each run's
``metrics.jsonl`` (written by rank 0 of the trainer), never from the 4-decimal console line.
Prints a table and a verdict line; ``--assert-equal`` exits 1 when any step differs by more than
the tolerance. Each side's dump folder (``--dump-folder``/a, /b, /seed) is re-created.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METRICS_FILE = "metrics.jsonl"  # torchtitan.components.metrics.METRICS_JSONL
SINGLE_PROCESS = [
    "--parallelism.data_parallel_replicate_degree", "1",
    "--parallelism.data_parallel_shard_degree", "1",
    "--parallelism.tensor_parallel_degree", "1",
    "--parallelism.pipeline_parallel_degree", "1",
    "--parallelism.context_parallel_degree", "1",
    "--parallelism.expert_parallel_degree", "1",
]


def read_metrics(path: Path, metric: str = "loss") -> dict[int, float]:
    """``step -> metric`` from a trainer's ``metrics.jsonl`` (the last record of a step wins,
    e.g. after a resume); records without ``metric`` (validation lines) are skipped."""
    values: dict[int, float] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ValueError(f"{path}:{lineno} is not a JSON object: {err}") from err
            if metric in record:
                values[int(record["step"])] = float(record[metric])
    return values


def split_side(spec: str) -> tuple[dict[str, str], list[str]]:
    env, flags = {}, []
    for word in shlex.split(spec):
        if not flags and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word):
            key, value = word.split("=", 1)
            env[key] = value
        else:
            flags.append(word)
    return env, flags


def dump_folder_of(flags: list[str], default: Path) -> Path:
    """The run's ``--job.dump_folder`` (the last one given wins, as in the trainer)."""
    folder = default
    for i, flag in enumerate(flags):
        if flag == "--job.dump_folder" and i + 1 < len(flags):
            folder = Path(flags[i + 1])
        elif flag.startswith("--job.dump_folder="):
            folder = Path(flag.split("=", 1)[1])
    return folder


def _run(name: str, env_over: dict[str, str], cmd: list[str], workdir: Path) -> None:
    env = {**os.environ, **env_over, "LOG_RANK": env_over.get("LOG_RANK", "0")}
    print(f"[{name}] {' '.join(f'{k}={v}' for k, v in env_over.items())} {shlex.join(cmd)}",
          file=sys.stderr)
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        print(f"error: run {name} failed with exit code {proc.returncode}", file=sys.stderr)
        # 2 is the trainer's "bad input" (a flag or file of this comparison): pass it on
        raise SystemExit(2 if proc.returncode == 2 else 1)


def _base_cmd(args: argparse.Namespace, workdir: Path, dump: Path) -> list[str]:
    return [
        "bash", str(workdir / "run_train.sh"),
        "--job.dump_folder", str(dump),
        *shlex.split(args.flags),
    ]


def make_seed_checkpoint(args: argparse.Namespace) -> Path:
    """Write ``{dump_folder}/seed/checkpoint/step-0`` with one process; returns its path."""
    dump = Path(args.dump_folder).resolve() / "seed"
    shutil.rmtree(dump, ignore_errors=True)
    cmd = _base_cmd(args, ROOT, dump) + [
        "--checkpoint.create_seed_checkpoint", *SINGLE_PROCESS, "--debug.seed", str(args.seed),
    ]
    _run("seed", {"NGPU": "1", "CONFIG_FILE": args.config, "COMM_MODE": ""}, cmd, ROOT)
    path = dump / "checkpoint" / "step-0"
    if not path.is_dir():
        raise SystemExit(f"error: the seed checkpoint run wrote no {path}")
    return path


def run_side(
    name: str, spec: str, args: argparse.Namespace, workdir: Path, seed_ckpt: Path | None
) -> dict[int, float]:
    env_over, flags = split_side(spec)
    env_over.setdefault("CONFIG_FILE", args.config)
    dump = Path(args.dump_folder).resolve() / name
    shutil.rmtree(dump, ignore_errors=True)
    cmd = _base_cmd(args, workdir, dump) + [
        "--training.steps", str(args.steps), "--metrics.log_freq", "1",
        "--metrics.disable_color_printing",
    ]
    if args.deterministic:
        cmd += ["--debug.seed", str(args.seed), "--debug.deterministic"]
    if seed_ckpt is not None:
        cmd += ["--checkpoint.initial_load_path", str(seed_ckpt)]
    cmd += flags
    _run(name, env_over, cmd, workdir)
    metrics = dump_folder_of(cmd, dump) / METRICS_FILE
    if not metrics.is_file():
        raise SystemExit(
            f"error: run {name} wrote no {metrics} (a trainer revision without the JSONL "
            "metrics sink?); loss_compare does not fall back to the 4-decimal console losses"
        )
    values = read_metrics(metrics, args.metric)
    if not values:
        print(f"error: --metric {args.metric}: {metrics} of run {name} has no such records; "
              f"its fields: {', '.join(metric_fields(metrics)) or 'none'}", file=sys.stderr)
        raise SystemExit(2)
    return values


def metric_fields(path: Path) -> list[str]:
    """The numeric fields of a ``metrics.jsonl`` (what ``--metric`` can name)."""
    fields: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            fields.update(k for k, v in record.items() if k != "step" and isinstance(v, (int, float)))
    return sorted(fields)


def compare(a: dict[int, float], b: dict[int, float], rtol: float, atol: float) -> tuple[list, bool]:
    """Rows ``(step, a, b, |diff|, within)`` over the steps of either side; a step missing on
    one side is NaN there and never within tolerance."""
    rows, ok = [], True
    for step in sorted(set(a) | set(b)):
        la, lb = a.get(step, math.nan), b.get(step, math.nan)
        diff = abs(la - lb)
        within = diff <= atol + rtol * abs(lb)
        ok &= within
        rows.append((step, la, lb, diff, within))
    return rows, ok


def argument_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the script's own arguments (None when nothing), checked before any run."""
    if args.steps < 1:
        return f"--steps must be at least 1, got {args.steps}"
    for name in ("rtol", "atol"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0:
            return f"--{name} must be a finite number >= 0, got {value}"
    for name in ("flags", "a", "b"):
        try:
            words = shlex.split(getattr(args, name))
        except ValueError as err:  # e.g. an unbalanced quote
            return f"--{name} {getattr(args, name)!r} cannot be split into flags: {err}"
        if any(w.split("=", 1)[0] == "--training.steps" for w in words):
            # the script sets the steps after these flags: the trainer would take its value
            return f"--{name} sets --training.steps, which this script sets itself: use --steps"
    if not (ROOT / args.config).is_file():  # the runs start in the repository root
        return f"--config {args.config} does not exist (relative paths start at {ROOT})"
    if args.b_rev is not None:
        found = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"{args.b_rev}^{{commit}}"],
            cwd=ROOT, capture_output=True, text=True,
        )
        if found.returncode != 0:
            return f"--b-rev {args.b_rev} is not a commit of the repository at {ROOT}"
    return None


def checkout_rev(rev: str) -> Path:
    target = Path(tempfile.mkdtemp(prefix="loss_compare_"))
    subprocess.run(["git", "worktree", "add", "--detach", str(target), rev], cwd=ROOT, check=True,
                   capture_output=True)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="./train_configs/debug_model.toml", help="TOML for both sides")
    p.add_argument("--flags", default="", help="trainer flags for both sides (and the seed checkpoint)")
    p.add_argument("--a", default="", help="side A: 'ENV=v ... --flags' (default: plain run)")
    p.add_argument("--b", default="", help="side B: 'ENV=v ... --flags' (default: plain run)")
    p.add_argument("--b-rev", default=None, help="run side B from this git revision")
    p.add_argument("--seed-checkpoint", action="store_true",
                   help="start both sides from one seed checkpoint written first")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--metric", default="loss", help="metrics.jsonl field to compare (e.g. grad_norm)")
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--assert-equal", action="store_true", help="exit 1 unless every step matches")
    p.add_argument("--dump-folder", default="./outputs/loss_compare")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    args = p.parse_args(argv)
    problem = argument_error(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    seed_ckpt = make_seed_checkpoint(args) if args.seed_checkpoint else None
    losses_a = run_side("a", args.a, args, ROOT, seed_ckpt)
    b_dir = checkout_rev(args.b_rev) if args.b_rev else ROOT
    try:
        losses_b = run_side("b", args.b, args, b_dir, seed_ckpt)
    finally:
        if args.b_rev:
            subprocess.run(["git", "worktree", "remove", "--force", str(b_dir)], cwd=ROOT,
                           capture_output=True)
    rows, ok = compare(losses_a, losses_b, args.rtol, args.atol)
    if args.json:
        print(json.dumps({"metric": args.metric, "steps": [r[0] for r in rows],
                          "a": [r[1] for r in rows], "b": [r[2] for r in rows], "equal": ok}))
    else:
        print(f"{'step':>5} {args.metric + ' A':>14} {args.metric + ' B':>14} {'|diff|':>10}")
        for step, la, lb, diff, within in rows:
            print(f"{step:5d} {la:14.8f} {lb:14.8f} {diff:10.2e}{'' if within else '  <-- differs'}")
        max_diff = max(r[3] for r in rows)
        verdict = "EQUAL" if ok else "DIFFERENT"
        print(f"verdict: {verdict} (max |diff| {max_diff:.3e}, rtol {args.rtol}, atol {args.atol})")
    return 1 if (args.assert_equal and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
