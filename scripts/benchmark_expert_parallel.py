#!/usr/bin/env python3
"""Expert parallel degrees side by side on the MoE debug flavor: tokens/s and all-to-all volume.

  python scripts/benchmark_expert_parallel.py [--nproc 4] [--steps 5] [--warmup 2] [trainer flags]
  python scripts/benchmark_expert_parallel.py --tp 2 --degrees 1,2   # expert TP 1 vs 2 as well
  python scripts/benchmark_expert_parallel.py --tp 4 --degrees 1,2   # expert TP 1, 2 and 4

Runs ``scripts/benchmark.py`` under torchrun on ``nproc`` ranks (FSDP over all of them) with
``expert_parallel_degree`` 1 (experts FSDP-sharded like dense weights: all-gathered whole on
every rank), 2 and 4, one after another, and prints one JSON line per degree (tokens/s per
rank, step time, peak memory, tokens sent to other ranks' experts per step and the
all-to-all volume that implies) plus a summary with the ratios to the first layout. With
``--tp N`` the ranks are TP N x FSDP (nproc / N) and every EP degree runs once per divisor of N
as ``expert_tensor_parallel_degree``: 1 (each TP rank routes its own tokens; ep then takes the
TP ranks first), N (every expert split over tp) and those between (groups of etp TP ranks share
their tokens and split each expert); a layout the degrees do not allow is skipped with its
reason.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_context_parallel import ROOT, run_layout  # noqa: E402

from torchtitan.distributed.parallel_dims import ParallelDims, ParallelismError  # noqa: E402
from torchtitan.tools.cli_args import non_negative_int, positive_int  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=positive_int, default=4)
    p.add_argument("--steps", type=positive_int, default=5)
    p.add_argument("--warmup", type=non_negative_int, default=2)
    p.add_argument("--degrees", default="1,2,4",
                   type=lambda text: [positive_int(d) for d in text.split(",")])
    p.add_argument("--tp", type=positive_int, default=1)
    args, extra = p.parse_known_args(argv)
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} leaves none of --steps {args.steps} to time")
    if args.nproc % args.tp:
        p.error(f"--tp {args.tp} must divide --nproc {args.nproc}")
    base = [
        "--job.config_file", str(ROOT / "train_configs/qwen3_debugmodel_moe.toml"),
        "--training.local_batch_size", "4", "--training.seq_len", "512",
        "--activation_checkpoint.mode", "none", "--metrics.log_freq", "1000",
        "--parallelism.data_parallel_shard_degree", str(args.nproc // args.tp),
        "--parallelism.tensor_parallel_degree", str(args.tp),
        *extra,
    ]
    layouts = [(d, etp) for d in args.degrees
               for etp in range(1, args.tp + 1) if args.tp % etp == 0]
    rows = {}
    for ep, etp in layouts:
        name = f"ep{ep}" + (f"_etp{etp}" if args.tp > 1 else "")
        try:  # e.g. ep 4 with expert TP on 4 ranks: ep must divide dp_shard there
            ParallelDims(dp_replicate=1, dp_shard=args.nproc // args.tp, cp=1, tp=args.tp, pp=1,
                         ep=ep, etp=etp, world_size=args.nproc)
        except ParallelismError as err:
            print(json.dumps({"layout": name, "skipped": str(err)}), flush=True)
            continue
        per_rank = run_layout(args.nproc, [*base, "--parallelism.expert_parallel_degree", str(ep),
                                           "--parallelism.expert_tensor_parallel_degree", str(etp)],
                              args)
        rows[name] = {
            "layout": name,
            "tokens_per_s_per_rank": round(sum(r["tokens_per_s"] for r in per_rank) / len(per_rank), 1),
            "step_s": max(r["step_s"] for r in per_rank),
            "peak_memory_gib_per_rank": max(r["peak_memory_gib"] for r in per_rank),
            "ep_tokens_sent_per_step_per_rank": round(
                sum(r.get("ep_tokens_sent_per_step", 0.0) for r in per_rank) / len(per_rank), 1),
            "ep_all_to_all_mib_per_step_per_rank": round(
                sum(r.get("ep_all_to_all_mib_per_step", 0.0) for r in per_rank) / len(per_rank), 2),
        }
        print(json.dumps(rows[name]), flush=True)
    if not rows:
        print(f"error: none of --degrees {','.join(map(str, args.degrees))} fits {args.nproc} "
              f"ranks with --tp {args.tp} (see the skipped lines above)", file=sys.stderr)
        return 2
    first_name = next(iter(rows))
    first = rows[first_name]
    summary = {
        f"{name}_tokens_per_s_over_{first_name}": round(
            row["tokens_per_s_per_rank"] / first["tokens_per_s_per_rank"], 3)
        for name, row in rows.items()
    }
    print(json.dumps({"summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
