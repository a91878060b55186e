"""A ``--experimental.custom_import`` module that fails on global rank 1 only.

Rank 1 stops with a user error while rank 0 goes on: what a node whose data or files differ
looks like. torchrun sets ``RANK`` for each rank; outside torchrun (e.g. the launcher's
pre-flight) the import succeeds.
"""

import os

if os.environ.get("RANK") == "1":
    raise FileNotFoundError("rank 1 cannot read /data/shard-1 (injected by fail_on_rank1.py)")
