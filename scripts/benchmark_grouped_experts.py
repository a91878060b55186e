#!/usr/bin/env python3
"""Grouped-GEMM experts vs the per-expert loop, forward + backward, side by side.

  python scripts/benchmark_grouped_experts.py [--tokens 4096] [--dim 256] [--hidden 512]
      [--experts 8] [--top-k 2] [--dtype float32] [--repeats 20]

Times ``GroupedExperts`` (``torch._grouped_mm``) and the same module with ``use_grouped_mm =
False`` (one matmul chain per expert) on identical routed tokens, alternating the two each
repeat so both see the same machine load, and prints one JSON line with the median times and
their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # a checkout run without installing it

import torch  # noqa: E402

from torchtitan.models.common.moe import GroupedExperts  # noqa: E402
from torchtitan.tools.cli_args import positive_int  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=positive_int, default=4096)
    p.add_argument("--dim", type=positive_int, default=256)
    p.add_argument("--hidden", type=positive_int, default=512)
    p.add_argument("--experts", type=positive_int, default=8)
    p.add_argument("--top-k", type=positive_int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=positive_int, default=20)
    args = p.parse_args(argv)
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} routes each token to more experts than --experts {args.experts}")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    experts = GroupedExperts(args.dim, args.hidden, args.experts).to(dtype)
    experts.init_weights(0.02)
    routed = args.tokens * args.top_k
    choice = torch.randint(0, args.experts, (routed,))
    counts = torch.bincount(choice, minlength=args.experts)
    x = torch.randn(routed, args.dim, dtype=dtype, requires_grad=True)

    def step(grouped: bool) -> float:
        experts.use_grouped_mm = grouped
        start = time.perf_counter()
        experts(x, counts).pow(2).sum().backward()
        return time.perf_counter() - start

    times = {True: [], False: []}
    for i in range(args.repeats + 2):
        for grouped in (True, False):
            t = step(grouped)
            if i >= 2:  # warm-up
                times[grouped].append(t)
    grouped_s, loop_s = statistics.median(times[True]), statistics.median(times[False])
    print(json.dumps({
        "tokens": args.tokens, "top_k": args.top_k, "experts": args.experts, "dim": args.dim,
        "hidden": args.hidden, "dtype": args.dtype, "grouped_mm_s": round(grouped_s, 5),
        "loop_s": round(loop_s, 5), "loop_over_grouped": round(loop_s / grouped_s, 3),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
