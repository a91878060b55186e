"""Time of one AdamW step over a decoder's parameters, per implementation, at one shape.

    python scripts/benchmark_optimizer.py                  # CPU: small shapes, a smoke test
    python scripts/benchmark_optimizer.py --device cuda --layers 4   # Llama 3 8B's shapes, 4 layers

Implementations (``--impl``, comma separated):
  fused    torch.optim.AdamW(fused=True): torch's multi-tensor kernel (upstream torchtitan's)
  static   this project's compiled step (AdamBF16State with float32 state, the step the trainer
           uses with weight copies), one graph per parameter shape
  dynamic  the same function under torch's automatic dynamic shapes (a graph for any
           ``[s0, s1]`` after the third shape): how the step was compiled before
  copies   static, with bf16 gradients and bf16 weight copies of the linear weights, as
           ``training.weight_copies`` runs it

Per implementation: the median milliseconds of a step (after warm-up steps, which compile),
the memory traffic it implies (28 bytes per parameter: weight, both moments read and written,
the gradient read; the copies' 2-byte gradient and 2-byte copy write add up the same), the
graphs compiled and how many had dynamic shapes. One JSON line at the end holds every figure.
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

import torchtitan.components.adamw_bf16_state as adam_module  # noqa: E402
from torchtitan.tools.cli_args import (  # noqa: E402
    OneLineParser,
    available_device,
    positive_int,
)

IMPLS = ("fused", "static", "dynamic", "copies")
BYTES_PER_PARAM = 28


def decoder_shapes(args) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, is a linear weight) of a Llama-style decoder's parameters, in model order."""
    d, f, kv, v = args.dim, args.ffn, args.kv_dim, args.vocab
    layer = [((d, d), True), ((kv, d), True), ((kv, d), True), ((d, d), True),
             ((f, d), True), ((d, f), True), ((f, d), True), ((d,), False), ((d,), False)]
    return [((v, d), False), *layer * args.layers, ((d,), False), ((v, d), True)]


class _Copies:
    """The part of WeightCopies the step reads: a bf16 copy and bf16 gradient per linear."""

    def __init__(self, params, linear):
        self.copies = {p: p.detach().bfloat16() for p, is_lin in zip(params, linear) if is_lin}
        self.grads = {p: torch.randn_like(c) for p, c in self.copies.items()}

    def copy_of(self, p):
        return self.copies.get(p)

    def grad_of(self, p):
        return self.grads.get(p, p.grad)

    def written(self, p):
        pass


class _GraphCounter:
    """A torch.compile backend that counts the graphs (and the dynamic ones) it compiles."""

    def __init__(self, backend: str):
        self.backend, self.graphs, self.dynamic = backend, 0, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        if any(isinstance(d, torch.SymInt) for t in values if isinstance(t, torch.Tensor)
               for d in t.shape):
            self.dynamic += 1
        if self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        return gm


def _optimizer(impl, params, linear):
    kwargs = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if impl == "fused":
        return torch.optim.AdamW(params, **kwargs, fused=True)
    opt = adam_module.AdamBF16State(params, **kwargs, state_dtype=torch.float32)
    if impl == "copies":
        opt.weight_copies = _Copies(params, linear)
        for p, is_linear in zip(params, linear):
            if is_linear:
                p.grad = None  # the copy's bf16 gradient stands for it
    return opt


def measure(args) -> dict:
    """Median seconds per step, traffic and graph counts per implementation."""
    device = torch.device(args.device)
    shapes = decoder_shapes(args)
    n_params = sum(torch.Size(s).numel() for s, _ in shapes)
    results = {}
    try:
        for impl in args.impl:
            results[impl] = _measure_one(args, impl, device, shapes, n_params)
    finally:
        adam_module._step_fn = _ORIGINAL_STEP_FN
    return {"device": str(device), "torch": torch.__version__, "parameters": n_params,
            "results": results}


def _measure_one(args, impl: str, device: torch.device, shapes, n_params: int) -> dict:
    """One implementation's median step time, traffic and graphs (patches the step function:
    the caller restores it)."""
    torch._dynamo.reset()
    counter = _GraphCounter(args.backend)
    compiled = torch.compile(adam_module.adam_bf16_state_step, fullgraph=True,
                             dynamic=False if impl != "dynamic" else None, backend=counter)
    adam_module._step_fn = lambda p, fn=compiled: fn  # every device, this compile
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=g) * 0.02)
              for s, _ in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=g)
    opt = _optimizer(impl, params, [lin for _, lin in shapes])
    times = []
    for i in range(args.warmup + args.iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    result = {"ms": seconds * 1e3, "gb_per_s": n_params * BYTES_PER_PARAM / seconds / 1e9,
              "graphs": counter.graphs, "dynamic_graphs": counter.dynamic}
    del opt, params
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


_ORIGINAL_STEP_FN = adam_module._step_fn


def _impls(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in IMPLS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown implementation(s) {', '.join(unknown) or repr(text)}; choose from {', '.join(IMPLS)}"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=available_device, default="cpu")
    parser.add_argument("--impl", type=_impls, default=list(IMPLS), help=", ".join(IMPLS))
    parser.add_argument("--dim", type=positive_int, default=None, help="(4096 on CUDA, 64 on CPU)")
    parser.add_argument("--ffn", type=positive_int, default=None, help="(14336 / 224)")
    parser.add_argument("--kv-dim", type=positive_int, default=None, help="(1024 / 16)")
    parser.add_argument("--vocab", type=positive_int, default=None, help="(128256 / 2000)")
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--warmup", type=positive_int, default=3, help="steps before timing (compiles)")
    parser.add_argument("--iters", type=positive_int, default=10)
    parser.add_argument("--backend", choices=("inductor", "eager"), default="inductor",
                        help="eager: dynamo only (checks the graphs, times nothing real)")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    for name, big, small in (("dim", 4096, 64), ("ffn", 14336, 224), ("kv_dim", 1024, 16),
                             ("vocab", 128256, 2000)):
        if getattr(args, name) is None:
            setattr(args, name, big if cuda else small)
    out = measure(args)
    print(f"AdamW step over {out['parameters'] / 1e6:,.1f} M parameters on {out['device']} "
          f"(torch {out['torch']}), median of {args.iters} steps:")
    print("| implementation | ms / step | GB/s | graphs (dynamic) |")
    print("|---|---|---|---|")
    for impl, r in out["results"].items():
        graphs = f"{r['graphs']} ({r['dynamic_graphs']})" if impl != "fused" else "-"
        print(f"| {impl} | {r['ms']:.2f} | {r['gb_per_s']:,.0f} | {graphs} |")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
