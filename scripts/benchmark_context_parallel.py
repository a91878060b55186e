#!/usr/bin/env python3
"""Context parallel vs not, side by side: per-rank memory and tokens/s at a long sequence.

  python scripts/benchmark_context_parallel.py [--seq-len 4096] [--nproc 2] [--steps 6]
      [--warmup 2] [trainer flags ...]

Runs ``scripts/benchmark.py`` under torchrun twice on the same ranks, once as FSDP over
``nproc`` ranks (cp = 1) and once with ``context_parallel_degree = nproc`` (each rank holds
1/nproc of every sequence), alternating nothing else, and prints one JSON line per layout plus
a summary line with the ratios. It also runs the memory estimator (fake tensors, same layouts)
and reports the activation-memory ratio, whose ideal is ``1 / nproc``: every activation is
per token except the ring-attention buffers. Host peak RSS on CPU includes the process's fixed
cost (the torch runtime, ~0.4 GiB), so its ratio stays above the activation ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # a checkout run without installing it

from torchtitan.tools.cli_args import int_at_least, non_negative_int, positive_int  # noqa: E402


def run_layout(nproc: int, flags: list[str], args: argparse.Namespace) -> list[dict]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        str(ROOT / "scripts/benchmark.py"), "--steps", str(args.steps), "--warmup",
        str(args.warmup), *flags,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // nproc)))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        errors = [ln[ln.find("error: "):] for ln in (proc.stdout + proc.stderr).splitlines()
                  if "error: " in ln]
        if errors:  # the trainer refused the flags: its own line(s), not torchrun's traceback
            print("\n".join(dict.fromkeys(errors)), file=sys.stderr)
            raise SystemExit(2)
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"benchmark failed for {' '.join(flags)}")
    decoder, rows = json.JSONDecoder(), []
    for line in proc.stdout.splitlines():
        pos = line.find("{")
        while pos != -1:  # several ranks' objects may share a line
            obj, end = decoder.raw_decode(line, pos)
            rows.append(obj)
            pos = line.find("{", end)
    return sorted(rows, key=lambda r: r.get("rank", 0))


def activation_bytes(nproc: int, flags: list[str]) -> int:
    from torchtitan.config.manager import ConfigManager
    from torchtitan.tools.memory_estimation import estimate_memory

    estimate = estimate_memory(ConfigManager().parse_args(flags), nproc)
    return estimate.breakdown.get("Activation", 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=positive_int, default=4096)
    p.add_argument("--nproc", type=int_at_least(2), default=2,
                   help="ranks; the CP run uses cp = nproc")
    p.add_argument("--steps", type=positive_int, default=6)
    p.add_argument("--warmup", type=non_negative_int, default=2)
    args, extra = p.parse_known_args(argv)
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} leaves none of --steps {args.steps} to time")
    base = [
        "--job.config_file", str(ROOT / "train_configs/debug_model.toml"),
        "--training.seq_len", str(args.seq_len), "--training.local_batch_size", "1",
        "--activation_checkpoint.mode", "none", "--metrics.log_freq", "1000", *extra,
    ]
    layouts = {
        "fsdp": [*base, "--parallelism.data_parallel_shard_degree", str(args.nproc)],
        "cp": [*base, "--parallelism.data_parallel_shard_degree", "1",
               "--parallelism.context_parallel_degree", str(args.nproc)],
    }
    summary: dict[str, object] = {"seq_len": args.seq_len, "nproc": args.nproc}
    results = {}
    for name, flags in layouts.items():
        rows = run_layout(args.nproc, flags, args)
        results[name] = {
            "tokens_per_s_per_rank": round(sum(r["tokens_per_s"] for r in rows) / len(rows), 1),
            "step_s": max(r["step_s"] for r in rows),
            "peak_memory_gib_per_rank": max(r["peak_memory_gib"] for r in rows),
            "memory_kind": rows[0]["memory_kind"],
            "estimated_activation_gib": round(activation_bytes(args.nproc, flags) / 2**30, 4),
        }
        print(json.dumps({"layout": name, **results[name]}), flush=True)
    fsdp, cp = results["fsdp"], results["cp"]
    summary["peak_memory_ratio_cp_over_fsdp"] = round(
        cp["peak_memory_gib_per_rank"] / fsdp["peak_memory_gib_per_rank"], 3
    )
    summary["activation_ratio_cp_over_fsdp"] = round(
        cp["estimated_activation_gib"] / max(fsdp["estimated_activation_gib"], 1e-9), 3
    )
    summary["ideal_activation_ratio"] = round(1 / args.nproc, 3)
    summary["tokens_per_s_ratio_cp_over_fsdp"] = round(
        cp["tokens_per_s_per_rank"] / fsdp["tokens_per_s_per_rank"], 3
    )
    print(json.dumps({"summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
