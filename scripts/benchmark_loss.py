"""Time and peak memory of the loss path alone: the logits path (output projection, then
float32 cross-entropy, compiled as the trainer compiles it) against the chunked loss
(``torchtitan/components/chunked_loss.py``), forward + backward, at one shape.

    python scripts/benchmark_loss.py                       # CPU: a small shape
    python scripts/benchmark_loss.py --device cuda --tokens 8192 --dim 4096 --vocab 128256 \\
        --dtype bfloat16 --compile                         # Llama 3 8B's output layer, seq 4096 x 2

Peak memory is what the path adds above its inputs: on CUDA the allocator's peak, on the CPU
the allocator's peak as torch.profiler's memory reporting sees it (compiled code's buffers too). One
JSON line at the end holds every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # a checkout run without installing it

import torch  # noqa: E402

from torchtitan.components.chunked_loss import linear_cross_entropy_sum  # noqa: E402
from torchtitan.components.loss import build_cross_entropy_loss  # noqa: E402
from torchtitan.tools.cli_args import (  # noqa: E402
    available_device,
    non_negative_int,
    positive_int,
)
from torchtitan.tools.memory_compare import cpu_peak_added_bytes  # noqa: E402


def _paths(args, h, w, labels):
    plain_loss = build_cross_entropy_loss(args.compile, "inductor")
    backend = "inductor" if args.compile else None
    return {
        "logits": lambda: plain_loss(torch.nn.functional.linear(h, w)[None], labels[None]),
        "chunked": lambda: linear_cross_entropy_sum(h, w, labels, args.chunk, backend),
    }


def measure(args) -> dict:
    """Median seconds and peak added bytes per path."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(args.tokens, args.dim, device=device, dtype=dtype, generator=g)
    h.requires_grad_()
    w = (torch.randn(args.vocab, args.dim, device=device, dtype=dtype, generator=g)
         * args.dim**-0.5).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=g)
    results = {}
    for name, fn in _paths(args, h, w, labels).items():
        def step(fn=fn):
            h.grad = w.grad = None
            (fn() / args.tokens).backward()

        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.iters):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        h.grad = w.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak = cpu_peak_added_bytes(step)
        loss = float(fn().detach())
        results[name] = {"seconds": sorted(times)[len(times) // 2], "peak_bytes": peak,
                         "loss": loss}
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", type=available_device,
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=positive_int, default=2048)
    p.add_argument("--dim", type=positive_int, default=256)
    p.add_argument("--vocab", type=positive_int, default=32000)
    p.add_argument("--chunk", type=positive_int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--compile", action="store_true", help="compile both paths' loss math")
    p.add_argument("--warmup", type=non_negative_int, default=2)
    p.add_argument("--iters", type=positive_int, default=5)
    args = p.parse_args(argv)
    results = measure(args)
    logits = results["logits"]
    print(f"{args.tokens} tokens x vocab {args.vocab}, dim {args.dim}, {args.dtype}, "
          f"{args.device}, chunk {args.chunk}{', compiled' if args.compile else ''}")
    print("| path | fwd+bwd ms | peak added MiB | loss |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['seconds'] * 1e3:.2f} | {r['peak_bytes'] / 2**20:,.1f} | "
              f"{r['loss']:.4f} |")
    chunked = results["chunked"]
    print(f"chunked / logits: time {chunked['seconds'] / logits['seconds']:.3f}, "
          f"memory {chunked['peak_bytes'] / max(logits['peak_bytes'], 1):.3f}")
    print(json.dumps({"args": vars(args), "results": results,
                      "torch": torch.__version__}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
