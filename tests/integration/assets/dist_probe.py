"""A stand-in trainer for launcher tests: records what the launcher gave it.

Run as ``python -m tests.integration.assets.dist_probe [args...]`` (or via torchrun ``-m``).
It writes ``$PROBE_OUT_DIR/rank_<RANK>.json`` with its argv and launch environment.
With ``PROBE_INIT_PG=1`` it also joins a gloo process group (60 s timeout), all-reduces
``rank + 1`` and records the world size and the sum. ``PROBE_EXIT_CODE`` sets its exit code.
"""

from __future__ import annotations

import json
import os
import sys

ENV_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NGPU",
    "COMM_MODE",
    "OMP_NUM_THREADS",
    "SLURM_NODEID",
    "SLURM_PROCID",
    "TORCHELASTIC_RUN_ID",
    "LOGLEVEL",
    "PYTHONFAULTHANDLER",
    "NCCL_DEBUG",
    "TORCHTITAN_COLOR",
)


def main() -> None:
    """Record argv/env (and optionally one all_reduce), then exit."""
    record: dict = {"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in ENV_KEYS}}
    rank = os.environ.get("RANK", "0")
    if os.environ.get("PROBE_INIT_PG") == "1":
        import datetime

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        record.update(pg_rank=dist.get_rank(), world_size=dist.get_world_size(), sum=t.item())
        dist.barrier()
        dist.destroy_process_group()

    out_dir = os.environ["PROBE_OUT_DIR"]
    tmp = os.path.join(out_dir, f".rank_{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(out_dir, f"rank_{rank}.json"))
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit avoids gloo's occasional abort during interpreter shutdown (see the notes).
    os._exit(int(os.environ.get("PROBE_EXIT_CODE", "0")))


if __name__ == "__main__":
    main()
