#!/usr/bin/env python3
"""Random parallel layouts x features on the debug models: every run must train or stop with
one line and exit 2; a resume at another random layout must load the checkpoint and train on.

    python scripts/layout_sweep.py --trials 14 --seed 5      # about 6 minutes on 2 CPU cores

Slow, not part of CI. Each trial draws a model (the debug Llama 3 tiny, Llama 2, Qwen3, Qwen3
MoE, DeepSeek-V3, gpt-oss), NGPU in {1, 2, 4}, degrees for TP (up to 4) / PP (and a schedule)
/ CP / replicate, expert parallel and expert TP (any divisor of tp) for MoE models, compile
(aot_eager or inductor), AC, document masking (SDPA or FlexAttention), float8 (emulated), the
chunked loss, bfloat16 optimizer state, async checkpoints, bf16 mixed precision (with weight
copies on one rank) and gradient accumulation, and runs 2 steps through ``./run_train.sh``
with a checkpoint every step. When that trains, a second layout of the same model resumes it
to step 3 (redrawn while it is refused as a user error). Verdicts:

* ``ok``: exit 0, steps logged (and, for a resume, "Checkpoint: loaded");
* ``user-error``: exit 2 with an ``error:`` line at the start of a line and no traceback;
* ``BUG``: anything else (a traceback, another exit code, a hang past ``--timeout``); the
  run's whole output is kept next to its dump folder as ``<dump>.log``.

Exits 1 when any trial is a BUG, or when no run trained (every layout refused: nothing was
tested); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # a checkout run without installing it

from torchtitan.tools.cli_args import positive_int  # noqa: E402

MODELS = [  # (config, extra flags, has experts)
    ("train_configs/debug_model.toml", ["--model.flavor", "debugmodel_tiny"], False),
    ("train_configs/qwen3_debugmodel.toml", [], False),
    ("train_configs/qwen3_debugmodel_moe.toml", [], True),
    ("train_configs/deepseek_v3_debugmodel.toml", [], True),
    ("train_configs/gpt_oss_debugmodel.toml", [], True),
    ("train_configs/debug_model.toml", ["--model.name", "llama2", "--model.flavor", "debugmodel"],
     False),
]
SCHEDULES = ["1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble", "InterleavedZeroBubble"]


NGPU_POOL = (1, 2, 2, 4, 4)


def draw_layout(rng: random.Random, extra: list[str], moe: bool, steps: int,
                ngpus: tuple[int, ...] = NGPU_POOL) -> tuple[int, list[str]]:
    """(NGPU, trainer flags) of one random run; NGPU drawn from ``ngpus``."""
    ngpu = rng.choice(ngpus)
    local_batch = rng.choice([2, 4])
    flags = [*extra, "--training.steps", str(steps), "--training.seq_len", rng.choice(["64", "128"]),
             "--training.local_batch_size", str(local_batch), "--metrics.log_freq", "1",
             "--checkpoint.enable", "--checkpoint.interval", "1", "--debug.seed", "7"]
    left = ngpu
    degrees = {}
    for name in ("tensor", "pipeline", "context", "data_parallel_replicate"):
        pool = (1, 1, 2, 4) if name == "tensor" else (1, 1, 2)
        degree = rng.choice([d for d in pool if left % d == 0])
        left //= degree
        degrees[name] = degree
        if degree > 1:
            key = name if name.startswith("data") else f"{name}_parallel"
            flags += [f"--parallelism.{key}_degree", str(degree)]
    if moe and rng.random() < 0.6:
        tp, etp = degrees["tensor"], 1
        if tp > 1 and rng.random() < 0.5:  # any divisor of tp: all TP ranks, or groups of them
            etp = rng.choice([d for d in range(2, tp + 1) if tp % d == 0])
        # the TP ranks split the MoE tokens tp/etp ways; an ep group is a multiple of those
        # token groups within them times the data-parallel shard ranks
        groups = tp // etp
        eps = [d for d in (2, 2, 4, 8) if d % groups == 0 and (groups * left) % d == 0]
        if eps:
            flags += ["--parallelism.expert_parallel_degree", str(rng.choice(eps))]
            if etp > 1:
                flags += ["--parallelism.expert_tensor_parallel_degree", str(etp)]
    if degrees["pipeline"] > 1:
        flags += ["--parallelism.pipeline_parallel_schedule", rng.choice(SCHEDULES)]
    if rng.random() < 0.35:
        flags += ["--compile.enable", "--compile.backend", rng.choice(["aot_eager", "inductor"])]
    flags += ["--activation_checkpoint.mode", rng.choice(["none", "full", "selective"]),
              "--activation_checkpoint.selective_ac_option", rng.choice(["op", "2"])]
    if rng.random() < 0.25:
        flags += ["--model.attn_mask_type", "block_causal"]
        if rng.random() < 0.5:
            flags += ["--model.use_flex_attn"]
    if rng.random() < 0.2:
        flags += ["--model.converters", "float8", "--float8.emulate"]
    if rng.random() < 0.25:  # the loss fused with the output projection, 48 tokens at a time
        flags += ["--training.loss_implementation", "chunked", "--training.loss_chunk_size", "48"]
    if rng.random() < 0.15:
        flags += ["--optimizer.state_dtype", "bfloat16"]
    if rng.random() < 0.15:
        flags += ["--checkpoint.async_mode", "async"]
    bf16 = rng.random() < 0.25
    if bf16:  # FSDP's bf16 policy, or autocast on layouts without FSDP
        flags += ["--training.mixed_precision_param", "bfloat16"]
    accumulate = rng.random() < 0.2
    if accumulate:  # two microbatches per step
        dp = left * degrees["data_parallel_replicate"]
        flags += ["--training.global_batch_size", str(2 * local_batch * dp)]
    if ngpu == 1 and bf16 and not accumulate and rng.random() < 0.5:  # bf16 weight copies
        flags += ["--training.weight_copies", "on"]
    return ngpu, flags


def _ngpus(text: str) -> tuple[int, ...]:
    return tuple(positive_int(n) for n in text.split(","))


def add_ngpus_argument(parser: argparse.ArgumentParser) -> None:
    """``--ngpus 1,2,4,8``: the NGPU values drawn from (repeats weight them)."""
    parser.add_argument(
        "--ngpus", default=",".join(map(str, NGPU_POOL)),
        type=_ngpus,
        help="comma-separated NGPU values to draw from, repeats weight them "
             "(default %(default)s; 8 reaches 3-4 parallel dimensions at once, slower)",
    )


def add_models_argument(parser: argparse.ArgumentParser) -> None:
    """``--models gpt_oss,llama2``: draw only the models whose names hold one of these."""

    def models(text: str) -> list[tuple[str, list[str], bool]]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        chosen = [m for m, name in zip(MODELS, _model_names()) if any(n in name for n in names)]
        if not chosen:
            raise argparse.ArgumentTypeError(
                f"no model matches {text!r}; the models: {', '.join(_model_names())}")
        return chosen

    parser.add_argument("--models", type=models, default=MODELS,
                        help=f"comma-separated names to draw from (default all: "
                             f"{', '.join(_model_names())})")


def _model_names() -> list[str]:
    names = []
    for config, extra, _ in MODELS:
        name = Path(config).stem.replace("_debugmodel", "")
        if "--model.name" in extra:
            name = extra[extra.index("--model.name") + 1]
        elif "--model.flavor" in extra:
            name = "llama3_" + extra[extra.index("--model.flavor") + 1].replace("debugmodel_", "")
        names.append(name)
    return names


def run(config: str, ngpu: int, flags: list[str], dump: Path, resume: bool, timeout: int) -> str:
    """Run one layout; print and return its verdict."""
    env = dict(os.environ, NGPU=str(ngpu), CONFIG_FILE=config, PYTHONWARNINGS="ignore")
    cmd = ["./run_train.sh", "--job.dump_folder", str(dump), *flags]
    begin = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = "timeout"
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    trained = re.search(r"step:\s+\d", out) is not None
    if code == 0 and trained and (not resume or "Checkpoint: loaded" in out):
        verdict = "ok"
    elif code == 2 and errors and "Traceback" not in out:
        verdict = "user-error"
    else:
        verdict = "BUG"
        dump.parent.mkdir(parents=True, exist_ok=True)  # a run refused early made none
        Path(f"{dump}.log").write_text(out)
    took = time.monotonic() - begin
    print(f"{'  resume' if resume else 'run'} {verdict} (exit {code}, {took:.0f} s) NGPU={ngpu} "
          f"{Path(config).name} {' '.join(flags)}", flush=True)
    if verdict == "user-error":
        print(f"    {errors[0]}", flush=True)
    if verdict == "BUG":
        print(f"    see {dump}.log", flush=True)
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--trials", type=positive_int, default=14)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=positive_int, default=400, help="seconds per run")
    add_ngpus_argument(parser)
    parser.add_argument("--folder", default="/tmp/layout_sweep", help="dump folders go here")
    add_models_argument(parser)
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    if folder.exists() and not folder.is_dir():
        print(f"error: --folder {folder} is a file; the dump folders go in a folder",
              file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    verdicts: list[str] = []
    for trial in range(args.trials):
        config, extra, moe = rng.choice(args.models)
        dump = Path(args.folder) / f"seed{args.seed}_trial{trial:02d}"
        shutil.rmtree(dump, ignore_errors=True)
        print(f"trial {trial}:", flush=True)
        ngpu, flags = draw_layout(rng, extra, moe, steps=2, ngpus=args.ngpus)
        verdicts.append(run(config, ngpu, flags, dump, False, args.timeout))
        if verdicts[-1] != "ok":
            continue
        for _ in range(5):
            ngpu, flags = draw_layout(rng, extra, moe, steps=3, ngpus=args.ngpus)
            verdicts.append(run(config, ngpu, flags, dump, True, args.timeout))
            if verdicts[-1] != "user-error":
                break
    counts = {v: verdicts.count(v) for v in ("ok", "user-error", "BUG")}
    print(f"\n{len(verdicts)} runs: {counts['ok']} ok, {counts['user-error']} user errors, "
          f"{counts['BUG']} BUG")
    if counts["BUG"]:
        return 1
    if not counts["ok"]:  # every run refused: nothing trained, nothing resumed
        print("error: no run trained: every layout drawn was refused as a user error, so the "
              "sweep tested nothing (the refusals are above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
