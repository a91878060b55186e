#!/usr/bin/env python3
"""Predict per-rank peak training memory of a config at one or more world sizes, on any machine.

  python scripts/estimate_memory.py --job.config_file train_configs/llama3_8b.toml --world-size 8
  python scripts/estimate_memory.py --job.config_file train_configs/llama3_8b.toml --world-size 8 128
  python scripts/estimate_memory.py --job.config_file train_configs/llama3_70b.toml --world-size 64 \
      --parallelism.tensor_parallel_degree 8 --activation_checkpoint.mode full

Every flag other than the ones below is a trainer flag (same as ./run_train.sh). The model is
built and parallelized for real on a fake process group and stepped twice on fake tensors
(no GPU, no real allocation); see torchtitan/tools/memory_estimation.py for what is counted.

  --world-size N [N ...]   ranks to estimate for (default: WORLD_SIZE or NGPU from the env, else 8)
  --rank R                 which rank plays (default 0; ranks differ only with uneven shards)
  --real                   real tensors instead of fake ones (= memory_estimation.disable_fake_mode)
  --json                   also print one JSON object per estimate (machine-readable)
  --compare-real           also run the same rank for real on this machine's device (real
                           tensors, fake process group, the same steps) and print the
                           estimate against its measured peak: one table line per figure
                           (estimate; real allocated peak; real reserved peak; error in GiB
                           and %) and what each figure includes, then one JSON line. On CUDA
                           the figures are torch.cuda.max_memory_allocated / _reserved over the
                           steps; on the CPU a stand-in (the CPU allocator's live bytes, from
                           torch.profiler), for small flavors only. See
                           torchtitan/tools/memory_compare.py and docs/performance.md ("Memory
                           estimate against a real GPU peak"). On one H100 (compile off; well under 5 minutes):
                             python scripts/estimate_memory.py --job.config_file \\
                                 train_configs/llama3_8b.toml --world-size 8 --compare-real \\
                                 --training.local_batch_size 1 --training.seq_len 8192 \\
                                 --activation_checkpoint.mode selective
  --steps N                training steps estimated and measured (default 2: the second one
                           holds optimizer state)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.config.manager import parse_args_or_exit  # noqa: E402
from torchtitan.tools import known_warnings  # noqa: E402
from torchtitan.tools.cli_args import OneLineParser  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402
from torchtitan.tools.memory_estimation import estimate_memory  # noqa: E402


def _world_size_from_env() -> int:
    """--world-size's default: WORLD_SIZE or NGPU from the environment, else 8."""
    for name in ("WORLD_SIZE", "NGPU"):
        text = os.environ.get(name)
        if text:
            try:
                value = int(text)
            except ValueError:
                value = 0
            if value < 1:
                raise ValueError(f"{name}={text!r} in the environment is not a number of ranks "
                                 "(an integer >= 1): fix it or give --world-size")
            return value
    return 8


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(add_help=False)
    parser.add_argument("--world-size", "--world_size", type=int, nargs="+")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--real", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--compare-real", "--compare_real", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("-h", "--help", action="store_true")
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if ours.help:
        print(__doc__)
        return 0
    if ours.world_size is None:
        try:
            ours.world_size = [_world_size_from_env()]
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    init_logger()
    known_warnings.install()  # torch's harmless warnings: one line each, as in training
    job_config = parse_args_or_exit(rest)
    if ours.steps < 1:
        print(f"error: --steps must be at least 1 (got {ours.steps})", file=sys.stderr)
        return 2
    bad = [n for n in ours.world_size if n < 1]
    if bad:
        print(f"error: --world-size must be at least 1 (got {bad[0]})", file=sys.stderr)
        return 2
    code = 0
    for world_size in ours.world_size:
        try:
            if ours.compare_real:
                _compare(job_config, world_size, ours)
                continue
            if ours.real:
                _check_host_memory(job_config, world_size, ours)
            est = estimate_memory(
                job_config, world_size, rank=ours.rank, fake=False if ours.real else None,
                steps=ours.steps,
            )
        except (ValueError, RuntimeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            print(f"error: world size {world_size}: {first}", file=sys.stderr)
            code = 2
            continue
        print(est.format() + f"\n  (estimated in {est.seconds:.1f} s)", flush=True)
        if ours.json:
            print(json.dumps({
                "config": job_config.job.config_file,
                "flavor": job_config.model.flavor,
                "world_size": est.world_size,
                "rank": est.rank,
                "parallelism": est.parallelism,
                "peak_gib": round(est.peak_gib, 3),
                "breakdown_gib": {k: round(v / 1024**3, 3) for k, v in est.breakdown.items()},
                "fake": est.fake,
                "seconds": round(est.seconds, 1),
            }), flush=True)
    return code


def _check_host_memory(job_config, world_size: int, ours: argparse.Namespace) -> None:
    """--real on the CPU holds the rank's real tensors in host memory: estimate on fake tensors
    first (seconds) and refuse (ValueError) what this machine cannot hold, instead of being
    killed by the kernel's out-of-memory killer half way."""
    from torchtitan.tools.device import device_type
    from torchtitan.tools.host_memory import available_host_bytes
    from torchtitan.tools.logging import byte_size

    if device_type != "cpu":
        return
    available = available_host_bytes()
    if available is None:
        return
    need = estimate_memory(job_config, world_size, rank=ours.rank, fake=True, steps=ours.steps)
    if need.peak_gib * 2**30 > available:
        raise ValueError(
            f"--real holds rank {ours.rank}'s tensors in this machine's memory: about "
            f"{need.peak_gib:.1f} GiB (the estimate on fake tensors), and it has "
            f"{byte_size(available)} available; leave out --real for the estimate"
        )


def _compare(job_config, world_size: int, ours: argparse.Namespace) -> None:
    """The estimate against the real peak of the same rank on this machine (--compare-real)."""
    from torchtitan.tools.memory_compare import compare_memory

    result = compare_memory(
        job_config, world_size, rank=ours.rank, steps=ours.steps,
        fake_estimate=False if ours.real else None,
    )
    print(result.format(), flush=True)
    print(json.dumps({
        "config": job_config.job.config_file,
        "flavor": job_config.model.flavor,
        "local_batch_size": job_config.training.local_batch_size,
        "seq_len": job_config.training.seq_len,
        "activation_checkpoint": job_config.activation_checkpoint.mode,
        **result.as_json(),
    }), flush=True)


if __name__ == "__main__":
    sys.exit(main())
