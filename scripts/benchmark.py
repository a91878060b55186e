#!/usr/bin/env python3
"""Time the trainer's steady-state step on a config and print one JSON line.

  python scripts/benchmark.py --steps 12 --warmup 3 [--baseline] [trainer flags ...]

Reports tokens/s (per device), TFLOP/s, MFU (null on devices missing from the peak table) and
peak memory. ``--baseline`` also times a bare PyTorch loop on the same model, batch and
optimizer (no framework: no dataloader, no metrics, no parallelism wrappers), alternating
framework and bare steps so both see the same machine load, and reports
framework_step_s / baseline_step_s. Compare like with like: the bare loop has no activation
checkpointing or compile, so benchmark with ``--activation_checkpoint.mode none``.
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

from torchtitan.tools.cli_args import non_negative_int, positive_int  # noqa: E402


def _time_steps(step_fn, steps: int, warmup: int, sync) -> list[float]:
    times = []
    for i in range(steps):
        sync()
        t0 = time.perf_counter()
        step_fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def bare_loop_step_fn(trainer, batches):
    """A step of a plain PyTorch loop on a fresh copy of the trainer's model (no framework)."""
    cfg = trainer.job_config
    model = trainer.run.model_spec.model_cls(trainer.run.model_args).to(trainer.device)
    with torch.no_grad():
        model.init_weights()
    if cfg.training.dtype == "bfloat16":
        model.to(torch.bfloat16)
    from torchtitan.components.optimizer import optimizer_kwargs

    opt_cls = torch.optim.AdamW if cfg.optimizer.name == "AdamW" else torch.optim.Adam
    opt = opt_cls(model.parameters(), **optimizer_kwargs(cfg.optimizer))
    it = iter(range(10**9))

    def step():
        inputs, labels = batches[next(it) % len(batches)]
        opt.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
        opt.step()
        loss.item()

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive_int, default=12, help="timed steps including warm-up")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="steps excluded from timing")
    p.add_argument("--baseline", action="store_true", help="also time a bare PyTorch loop")
    args, trainer_flags = p.parse_known_args(argv)
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} leaves none of --steps {args.steps} to time")
    if not any(f.startswith("--job.config_file") or f == "--module" for f in trainer_flags):
        trainer_flags = ["--job.config_file", "./train_configs/debug_model.toml", *trainer_flags]
    trainer_flags += ["--training.steps", str(args.steps + 1)]

    from torchtitan.config.manager import parse_args_or_exit
    from torchtitan.preflight import USER_ERRORS
    from torchtitan.tools.device import device_type
    from torchtitan.tools.error_file import report_error
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    init_logger()
    cfg = parse_args_or_exit(trainer_flags)
    try:
        trainer = Trainer(cfg)
    except USER_ERRORS as err:  # a layout or file the trainer refuses: its one line, exit 2
        return _finish(report_error(err, 2))  # every rank refuses alike
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    data_iterator = iter(trainer.dataloader)
    trainer.metrics.memory_monitor.reset_peak_stats()

    def framework_step():
        trainer.step += 1
        trainer.train_step(data_iterator)

    bare_step = None
    if args.baseline:
        batches = [tuple(t.to(trainer.device) for t in next(data_iterator)) for _ in range(4)]
        bare_step = bare_loop_step_fn(trainer, batches)
    # Alternate framework and bare steps so both see the same machine conditions.
    times, bare_times = [], []
    for i in range(args.steps):
        times += _time_steps(framework_step, 1, 0 if i >= args.warmup else 1, sync)
        if bare_step is not None:
            bare_times += _time_steps(bare_step, 1, 0 if i >= args.warmup else 1, sync)
    step_s = statistics.median(times)
    # Tokens of one data-parallel rank's batch, split over the ranks that share it (cp x tp x pp).
    tokens = cfg.training.local_batch_size * cfg.training.seq_len * trainer.gradient_accumulation_steps
    tps = tokens / step_s / trainer.parallel_dims.non_data_parallel_size
    tflops = trainer.run.flops_per_token * tps / 1e12
    peak = trainer.metrics.peak_flops
    mem = trainer.metrics.memory_monitor.get_peak_stats()
    result = {
        "model": f"{cfg.model.name}/{cfg.model.flavor}",
        "device": device_type,
        "world_size": trainer.parallel_dims.world_size,
        "rank": trainer.rank,
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tps, 1),
        "tflops": round(tflops, 4),
        "mfu_pct": None if peak is None else round(100 * tflops * 1e12 / peak, 2),
        "peak_memory_gib": round(mem.peak_gib, 3),
        "memory_kind": mem.kind,
        "timed_steps": len(times),
    }
    dispatchers = [m.ep_dispatch for part in trainer.model_parts for m in part.modules()
                   if hasattr(m, "ep_dispatch")]
    if dispatchers:  # expert parallel: tokens sent to other ranks' experts, per step
        sent = sum(d.tokens_sent for d in dispatchers) / max(trainer.step, 1)
        dim = trainer.run.model_args.dim
        result["ep_tokens_sent_per_step"] = round(sent, 1)
        # dispatch + combine, forward + backward, fp32 activations of width dim
        result["ep_all_to_all_mib_per_step"] = round(sent * dim * 4 * 2 * 2 / 2**20, 2)
    if bare_step is not None:
        base = statistics.median(bare_times)
        result["baseline_step_s"] = round(base, 4)
        result["framework_over_baseline"] = round(step_s / base, 4)
    trainer.close()
    sys.stdout.write(json.dumps(result) + "\n")  # one write: ranks share the launcher's stdout
    sys.stdout.flush()
    return _finish(0)


def _finish(code: int) -> int:
    """Exit with ``code``; under torchrun through hard_exit (gloo can abort in interpreter
    finalisation otherwise), after shutting the process group down when all went well."""
    import torch.distributed as dist

    if dist.is_initialized():
        from torchtitan.distributed.utils import hard_exit, shutdown_distributed

        if code == 0:
            shutdown_distributed()
        hard_exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
