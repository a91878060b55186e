#!/usr/bin/env python3
"""Expert parallel degrees side by side on the MoE debug flavor: tokens/s and all-to-all volume.

  python scripts/benchmark_expert_parallel.py [--nproc 4] [--steps 5] [--warmup 2] [trainer flags]

Runs ``scripts/benchmark.py`` under torchrun on ``nproc`` ranks (FSDP over all of them) with
``expert_parallel_degree`` 1 (experts FSDP-sharded like dense weights: all-gathered whole on
every rank), 2 and 4, one after another, and prints one JSON line per degree (tokens/s per
rank, step time, peak memory, tokens sent to other ranks' experts per step and the
all-to-all volume that implies) plus a summary with the ratios to EP 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_context_parallel import ROOT, run_layout  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--degrees", default="1,2,4")
    args, extra = p.parse_known_args(argv)
    base = [
        "--job.config_file", str(ROOT / "train_configs/qwen3_debugmodel_moe.toml"),
        "--training.local_batch_size", "4", "--training.seq_len", "512",
        "--activation_checkpoint.mode", "none", "--metrics.log_freq", "1000",
        "--parallelism.data_parallel_shard_degree", str(args.nproc),
        *extra,
    ]
    rows = {}
    for ep in (int(d) for d in args.degrees.split(",")):
        per_rank = run_layout(args.nproc, [*base, "--parallelism.expert_parallel_degree", str(ep)], args)
        rows[ep] = {
            "ep": ep,
            "tokens_per_s_per_rank": round(sum(r["tokens_per_s"] for r in per_rank) / len(per_rank), 1),
            "step_s": max(r["step_s"] for r in per_rank),
            "peak_memory_gib_per_rank": max(r["peak_memory_gib"] for r in per_rank),
            "ep_tokens_sent_per_step_per_rank": round(
                sum(r.get("ep_tokens_sent_per_step", 0.0) for r in per_rank) / len(per_rank), 1),
            "ep_all_to_all_mib_per_step_per_rank": round(
                sum(r.get("ep_all_to_all_mib_per_step", 0.0) for r in per_rank) / len(per_rank), 2),
        }
        print(json.dumps(rows[ep]), flush=True)
    first = rows[min(rows)]
    summary = {
        f"ep{ep}_tokens_per_s_over_ep{min(rows)}": round(
            row["tokens_per_s_per_rank"] / first["tokens_per_s_per_rank"], 3)
        for ep, row in rows.items()
    }
    print(json.dumps({"summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
