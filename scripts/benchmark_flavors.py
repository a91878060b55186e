"""Extra Llama 3 flavors for benchmarks: the 8B model's layer shapes with fewer layers.

Load with ``--experimental.custom_import benchmark_flavors`` (``scripts/`` on ``PYTHONPATH``):
``8B_2layers``, ``8B_4layers`` and ``8B_8layers`` have 8B's dim 4096, 32 heads, 8 KV heads,
14336-wide FFN and 128256-token vocabulary, so matmul shapes (what float8 speeds up) are
8B's while one GPU holds the model, its gradients and AdamW state.
"""

import dataclasses

from torchtitan.models.llama3 import llama3_args

for _n in (2, 4, 8):
    llama3_args[f"8B_{_n}layers"] = dataclasses.replace(llama3_args["8B"], n_layers=_n)
