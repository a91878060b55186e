#!/usr/bin/env python3
"""Random parallel layouts x features must train to the same losses as plain data parallelism.

    python scripts/parity_sweep.py --trials 8 --seed 3       # about 10 minutes on 2 CPU cores

Slow, not part of CI; the numerical companion of ``scripts/layout_sweep.py`` (which checks
that random layouts start, train and resume). Each trial draws a model and a layout the same
way (TP, PP with a schedule, CP, replicate, EP and expert TP for MoE models, compile, AC,
document masking, emulated float8, the chunked loss, bfloat16 optimizer state, gradient
accumulation), then runs it and its reference
through ``scripts/loss_compare.py`` from one seed checkpoint with ``--debug.deterministic``:
the reference keeps every feature and the data-parallel degree (so both see the same
batches) and drops TP / PP / CP / EP. A layout refused as a user error is redrawn. Verdicts:

* ``equal``: every step's loss within ``--rtol``/``--atol`` (default 1e-4: fp32, only the
  order of sums differs between layouts);
* ``DIFFERENT``: a step's loss moved more (a composition that changes the math);
* ``BUG``: the layout or its reference failed other than as a user error.

Exits 1 when any trial is DIFFERENT or a BUG.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import random
import re
import shutil
import sys
from argparse import Namespace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # a checkout run without installing it

from torchtitan.tools.cli_args import OneLineParser, non_negative_float, positive_int  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


layout_sweep = _load("layout_sweep")
loss_compare = _load("loss_compare")

# Parity is checked in fp32 (the debug configs' mixed_precision_param): in bf16, layouts with
# FSDP (its mixed-precision policy) and without (autocast) round differently by design.
DROPPED = ("--training.steps", "--metrics.log_freq", "--checkpoint.enable",
           "--checkpoint.interval", "--checkpoint.async_mode", "--debug.seed",
           "--training.mixed_precision_param")


def split_flags(flags: list[str]) -> tuple[list[str], list[str], int]:
    """(shared feature flags, layout flags, dp_replicate degree) of a drawn flag list."""
    shared, layout, replicate = [], [], 1
    i = 0
    while i < len(flags):
        name = flags[i]
        has_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        item = flags[i : i + 2] if has_value else [name]
        i += len(item)
        if name.startswith("--parallelism."):
            layout += item
            if name == "--parallelism.data_parallel_replicate_degree":
                replicate = int(item[1])
        elif name not in DROPPED:
            shared += item
    return shared, layout, replicate


def without_float8_under_cp_or_pp(shared: list[str], layout: list[str]) -> list[str]:
    """``shared`` without the float8 flags when the layout has CP or PP: a CP rank's or a
    pipeline microbatch's activation scales come from its part of the batch, so float8 losses
    differ from the reference's by design (docs/float8.md)."""
    if not any(f"--parallelism.{k}_parallel_degree" in layout for k in ("context", "pipeline")):
        return shared
    out, i = [], 0
    while i < len(shared):
        if shared[i] == "--model.converters" and shared[i + 1:i + 2] == ["float8"]:
            i += 2
        elif shared[i].startswith("--float8."):
            has_value = i + 1 < len(shared) and not shared[i + 1].startswith("--")
            i += 2 if has_value else 1
        else:
            out.append(shared[i])
            i += 1
    return out


def data_parallel_degree(ngpu: int, layout: list[str]) -> int:
    """NGPU over the degrees that are not data parallel (tp, pp, cp)."""
    degree = ngpu
    for key in ("tensor", "pipeline", "context"):
        flag = f"--parallelism.{key}_parallel_degree"
        if flag in layout:
            degree //= int(layout[layout.index(flag) + 1])
    return degree


def compare(config: str, shared: list[str], side_a: str, side_b: str, folder: Path,
            args: argparse.Namespace) -> tuple[str, str]:
    """(verdict, detail) of one loss comparison."""
    ns = Namespace(config=config, flags=" ".join(shared), a=side_a, b=side_b, b_rev=None,
                   seed_checkpoint=True, steps=args.steps, seed=42, metric="loss",
                   deterministic=True, rtol=args.rtol, atol=args.atol,
                   dump_folder=str(folder), json=False)
    folder.mkdir(parents=True, exist_ok=True)
    log = io.StringIO()
    try:  # the layout first: a refused one costs no reference run
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            seed = loss_compare.make_seed_checkpoint(ns)
            losses_b = loss_compare.run_side("b", ns.b, ns, loss_compare.ROOT, seed)
            losses_a = loss_compare.run_side("a", ns.a, ns, loss_compare.ROOT, seed)
    except SystemExit as exc:
        message = str(exc)
        if re.search(r"run b failed with exit code 2\b", message):
            errors = [line for line in log.getvalue().splitlines() if line.startswith("error:")]
            return "user-error", errors[0] if errors else message
        (folder / "failure.log").write_text(log.getvalue())
        return "BUG", f"{message} (output: {folder / 'failure.log'})"
    rows, ok = loss_compare.compare(losses_a, losses_b, args.rtol, args.atol)
    worst = max(r[3] for r in rows)
    return ("equal" if ok else "DIFFERENT"), f"max |diff| {worst:.2e} over {len(rows)} steps"



def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--trials", type=positive_int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=positive_int, default=3)
    parser.add_argument("--rtol", type=non_negative_float, default=1e-4)
    parser.add_argument("--atol", type=non_negative_float, default=1e-4)
    parser.add_argument("--folder", default="/tmp/parity_sweep", help="dump folders go here")
    layout_sweep.add_ngpus_argument(parser)
    layout_sweep.add_models_argument(parser)
    args = parser.parse_args(argv)
    if Path(args.folder).exists() and not Path(args.folder).is_dir():
        parser.error(f"--folder {args.folder} is an existing file, not a folder")
    rng = random.Random(args.seed)
    verdicts: list[str] = []
    for trial in range(args.trials):
        config, extra, moe = rng.choice(args.models)
        folder = Path(args.folder) / f"seed{args.seed}_trial{trial:02d}"
        for _ in range(6):  # redraw layouts refused as user errors
            ngpu, flags = layout_sweep.draw_layout(
                rng, extra, moe, steps=args.steps, ngpus=args.ngpus)
            shared, layout, replicate = split_flags(flags)
            shared = without_float8_under_cp_or_pp(shared, layout)
            if not layout or layout == ["--parallelism.data_parallel_replicate_degree", "2"]:
                continue  # nothing but data parallelism: no composition to check
            dp = data_parallel_degree(ngpu, layout)
            reference = f"NGPU={dp} --parallelism.data_parallel_replicate_degree {replicate}"
            shutil.rmtree(folder, ignore_errors=True)
            verdict, detail = compare(config, shared, reference, f"NGPU={ngpu} {' '.join(layout)}",
                                      folder, args)
            print(f"trial {trial} {verdict}: {Path(config).name} NGPU={ngpu} {' '.join(layout)} "
                  f"| {' '.join(shared)} | vs {reference}: {detail.splitlines()[-1][:300]}",
                  flush=True)
            if verdict != "user-error":
                verdicts.append(verdict)
                break
    counts = {v: verdicts.count(v) for v in ("equal", "DIFFERENT", "BUG")}
    print(f"\n{len(verdicts)} comparisons: {counts['equal']} equal, {counts['DIFFERENT']} "
          f"DIFFERENT, {counts['BUG']} BUG")
    return 1 if counts["DIFFERENT"] or counts["BUG"] else 0


if __name__ == "__main__":
    sys.exit(main())
