#!/usr/bin/env python3
"""This project and upstream torchtitan side by side on one device, with the same flags.

  python scripts/compare_upstream.py --wheels .whl --out /tmp/table.md   # one GPU, ~8 min
  python scripts/compare_upstream.py --device cpu                        # smoke test, ~30 s
  python scripts/compare_upstream.py --fetch-wheels .whl                 # wheels a GPU machine lacks

Installs upstream torchtitan (pinned, 0.2.2) with ``pip install --no-deps --target`` into a
private folder (both are the package ``torchtitan``) and runs the two trainers alternately,
one GPU each, for every setting (bf16 AC none, bf16 op SAC, flex + block_causal, float8
tensorwise). Prints a table (tokens/s, ratio ours/upstream, MFU, peak memory, the last logged
loss: variants of this project should agree there) from the logged steps after warm-up,
then one JSON line with the device, versions and exact commands.
Exit 0; 2 when something cannot be set up; 1 when a run failed (its log's tail is printed).
See docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_upstream_report as report  # noqa: E402
import compare_upstream_setup as setup  # noqa: E402

sys.path.insert(0, str(setup.REPO_ROOT))  # a checkout run without installing it
from torchtitan.tools.cli_args import (  # noqa: E402
    OneLineParser,
    non_negative_float,
    non_negative_int,
    positive_int,
)

REPO_ROOT = setup.REPO_ROOT
AC_NONE = ("--activation_checkpoint.mode", "none")


@dataclass(frozen=True)
class Setting:
    """One row: flags added to the common ones (``upstream_flavor_suffix``: upstream names
    the same model a different flavor)."""

    label: str
    ours: tuple[str, ...]
    upstream: tuple[str, ...]
    upstream_flavor_suffix: str = ""


FLOAT8 = ("--model.converters", "quantize.linear.float8",
          "--quantize.linear.float8.filter_fqns", "output")
SAC = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
       "op")
SETTINGS = {
    "bf16": Setting("bf16, AC none", AC_NONE, AC_NONE),
    "sac": Setting("bf16, op SAC", SAC, SAC),
    "flex": Setting("flex + block_causal",
                    (*AC_NONE, "--model.use_flex_attn", "--model.attn_mask_type", "block_causal"),
                    AC_NONE, upstream_flavor_suffix="_flex"),
    "float8": Setting("float8 tensorwise", (*AC_NONE, *FLOAT8), (*AC_NONE, *FLOAT8)),
}
# Per device: flavor, seq_len, local batch, steps, log_freq, warm-up, compile, settings.
DEFAULTS = {
    "cuda": dict(flavor="8B_4layers", seq_len=4096, batch=2, steps=40, log_freq=10, warmup=10,
                 compile=True, settings="bf16,sac,flex,float8"),
    "cpu": dict(flavor="debugmodel", seq_len=128, batch=2, steps=4, log_freq=1, warmup=1,
                compile=False, settings="bf16"),
}
_LAUNCHER_VARS = ("CONFIG_FILE", "CONFIG", "MODULE", "NGPU", "COMM_MODE", "TRAIN_FILE",
                  "LOG_RANK", "PYTHONPATH")



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: smoke test (tiny flavor, no compile; upstream via a CPU shim)")
    p.add_argument("--wheels", type=Path, help="wheels to install into --target first (and "
                   "upstream's torchtitan-<version>-*.whl, used from here when present)")
    p.add_argument("--target", type=Path, help="folder for --wheels (default WORK/site)")
    p.add_argument("--upstream-wheel", type=Path, help="upstream's wheel (default: from "
                   "--wheels, else pip download)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/compare_upstream"),
                   help="installs, scratch folder, logs and dump folders (default %(default)s)")
    p.add_argument("--flavor")
    p.add_argument("--seq-len", type=positive_int)
    p.add_argument("--batch", type=positive_int, help="training.local_batch_size")
    p.add_argument("--steps", type=positive_int)
    p.add_argument("--log-freq", type=positive_int)
    p.add_argument("--warmup", type=non_negative_int,
                   help="average the logged steps after this step")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--settings", help=f"comma separated, of {','.join(SETTINGS)}")
    p.add_argument("--repeats", type=positive_int, default=1, help="runs per side and setting")
    p.add_argument("--ours-variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="also run this project with FLAGS added (e.g. 'logits=--training."
                   "loss_implementation logits', to measure one lever); a row per variant")
    p.add_argument("--both-flags", default="", metavar="FLAGS",
                   help="flags both trainers get on every run (e.g. '--profiling."
                        "enable_profiling --profiling.profile_freq 20': both spell them alike)")
    p.add_argument("--run-timeout", type=positive_float, default=300,
                   help="seconds per trainer run")
    p.add_argument("--out", type=Path, help="write the markdown table (for docs/performance.md)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--fetch-wheels", type=Path, metavar="DIR",
                   help="only pip download upstream's and the extra wheels (Python 3.12, Linux)")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown or not args.settings:
        p.error(f"--settings: unknown {unknown}; choose from {','.join(SETTINGS)}")
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} leaves no logged step of --steps {args.steps}")
    _check_paths(p, args)
    if args.fetch_wheels is None:
        _check_flavor(p, args.flavor)
    args.target = args.target or args.work_dir / "site"
    args.variants = {}
    for spec in args.ours_variant:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip().isidentifier() or not flags.strip():
            p.error(f"--ours-variant {spec!r}: expected NAME=FLAGS, e.g. "
                    "'logits=--training.loss_implementation logits'")
        args.variants[name.strip()] = _split_flags(p, "--ours-variant", flags)
    args.both_flags = _split_flags(p, "--both-flags", args.both_flags)
    return args


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0, got 0")
    return value


def _check_paths(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The folders and files the run would use, checked before anything runs (--dry-run too)."""
    if args.wheels is not None and not args.wheels.is_dir():
        p.error(f"--wheels {args.wheels} is not a folder (fill one with --fetch-wheels DIR)")
    if args.upstream_wheel is not None and not args.upstream_wheel.is_file():
        p.error(f"--upstream-wheel {args.upstream_wheel} is not a file")
    for option, folder in (("--work-dir", args.work_dir), ("--target", args.target),
                           ("--fetch-wheels", args.fetch_wheels)):
        if folder is not None and folder.exists() and not folder.is_dir():
            p.error(f"{option} {folder} is a file, not a folder")
    if args.out is not None:
        if args.out.is_dir():
            p.error(f"--out {args.out} is a folder; give the table's file name")
        if not args.out.parent.is_dir():
            p.error(f"--out {args.out}: its folder {args.out.parent} does not exist")


def _check_flavor(p: argparse.ArgumentParser, flavor: str) -> None:
    """A Llama 3 flavor both sides know (the project's, plus scripts/benchmark_flavors.py's)."""
    import benchmark_flavors  # noqa: F401  (adds the 8B_<n>layers flavors)

    from torchtitan.models.llama3 import llama3_args

    if flavor not in llama3_args:
        p.error(f"--flavor {flavor!r} is no Llama 3 flavor; choose from "
                f"{', '.join(sorted(llama3_args))}")


def _split_flags(parser: argparse.ArgumentParser, option: str, text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as err:  # e.g. an unbalanced quote: one line, not a traceback
        parser.error(f"{option} {text!r} cannot be split into flags: {err}")


def sides(args, repeat: int) -> list[str]:
    """The runs of one setting and repeat in order: ours, each ``ours:VARIANT``, upstream
    (reversed on odd repeats)."""
    order = ["ours", *(f"ours:{v}" for v in args.variants), "upstream"]
    return order if repeat % 2 == 0 else order[::-1]


def common_flags(args, flavor: str, dump: Path) -> list[str]:
    """The flags both trainers get."""
    flags = ["--experimental.custom_import", "benchmark_flavors", "--model.flavor", flavor,
             "--training.seq_len", str(args.seq_len), "--training.local_batch_size",
             str(args.batch), "--training.steps", str(args.steps),
             "--training.mixed_precision_param", "bfloat16", "--metrics.log_freq",
             str(args.log_freq), "--metrics.disable_color_printing", "--job.dump_folder", str(dump),
             "--debug.seed", "0"]  # the same initial weights in every run of a side
    return flags + (["--compile.enable"] if args.compile else []) + args.both_flags


def _pythonpath(*paths: Path) -> str:
    """``paths`` and then the caller's PYTHONPATH, less entries that hold a torchtitan."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                 if p and not (Path(p) / "torchtitan" / "__init__.py").exists()]
    return os.pathsep.join([*map(str, paths), *inherited])


def build_run(args, side: str, name: str, repeat: int) -> tuple[list[str], dict, Path]:
    """(command, environment, working folder) of one trainer run."""
    s = SETTINGS[name]
    dump = args.work_dir / "dumps" / f"{side.replace(':', '-')}_{name}_{repeat}"
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
               PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if side.startswith("ours"):
        env.update(NGPU="1", PYTHON=sys.executable,
                   PYTHONPATH=_pythonpath(args.target, REPO_ROOT / "scripts", REPO_ROOT))
        variant = args.variants[side.split(":", 1)[1]] if ":" in side else []
        cmd = ["./run_train.sh", *common_flags(args, args.flavor, dump), *s.ours, *variant]
        return cmd, env, REPO_ROOT
    scratch = args.work_dir / "scratch"
    env["PYTHONPATH"] = _pythonpath(args.work_dir / "upstream", args.target, scratch)
    entry = ["upstream_cpu_shim.py"] if args.device == "cpu" else ["-m", "torchtitan.train"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           *entry, *common_flags(args, args.flavor + s.upstream_flavor_suffix, dump),
           *s.upstream]
    return cmd, env, scratch


def _shown(cmd: list[str], env: dict, cwd: Path) -> str:
    keys = ("NGPU", "CUDA_VISIBLE_DEVICES", "PYTHONPATH")
    pre = " ".join(f"{k}={env[k]}" for k in keys if k in env)
    return f"cd {cwd} && {pre} {' '.join(cmd)}"


def _reason(log: str) -> str:
    """The line that says why a run failed: the trainer's ``error:`` line, else the last
    exception line, else the last line."""
    lines = [ln.split("]:", 1)[-1].strip() if ln.startswith("[rank") else ln.strip()
             for ln in log.splitlines() if ln.strip()]
    for pick in (lambda ln: ln.startswith("error:"),
                 lambda ln: ln.split(":", 1)[0].endswith(("Error", "Exception"))):
        found = [ln for ln in lines if pick(ln)]
        if found:
            return found[-1][:300]
    return lines[-1][:300] if lines else "no output"


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher (torchrun then stops its workers), then SIGKILL what is left:
    torchrun starts each worker in a session of its own, and one left behind would hold the
    GPU through the next runs."""
    family = _descendants(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *family]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run_one(args, side: str, name: str, repeat: int):
    """Run one trainer; its summary, or the one-line reason it failed."""
    cmd, env, cwd = build_run(args, side, name, repeat)
    log_path = args.work_dir / "logs" / f"{side.replace(':', '-')}_{name}_{repeat}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=args.run_timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
            _stop(proc)
            if isinstance(e, KeyboardInterrupt):
                raise
            rc = None
    seconds = time.perf_counter() - start
    text = log_path.read_text(errors="replace")
    why = None
    if rc is None:
        why = f"timed out after {args.run_timeout:.0f} s"
    elif rc != 0:
        why = f"exit {rc}: {_reason(text)}"
    else:
        try:
            summary = report.summarize(text, args.warmup)
        except report.ReportError as e:
            why = str(e)
    if why is not None:
        tail = "\n".join("    " + ln for ln in text.splitlines()[-20:])
        print(f"---- {side} {name} #{repeat + 1} failed; the end of {log_path}:\n{tail}",
              file=sys.stderr, flush=True)
        return None, f"{side} run {name!r} failed ({why}); log: {log_path}", seconds
    print(f"{side:8} {name:7} #{repeat + 1}: {summary.tps:,.0f} tok/s "
          f"(steps {summary.steps[0]}-{summary.steps[-1]}, {seconds:.0f} s)",
          file=sys.stderr, flush=True)
    return summary, None, seconds


def device_info(args) -> dict:
    """torch version and device name, asked in a child so this process holds no CUDA
    context while the trainers run."""
    code = ("import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': "
            "torch.__version__, 'cuda': c, 'name': torch.cuda.get_device_name(0) if c else "
            "'cpu'}))")
    env = {**os.environ, "PYTHONPATH": _pythonpath(args.target)}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise setup.SetupError(f"cannot import torch: {_reason(out.stderr)}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ours_version() -> str:
    version = "unknown"
    for line in (REPO_ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith("version"):
            version = line.split("=", 1)[1].strip().strip('"')
            break
    git = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    if git.returncode != 0:
        return version
    # a tree that differs from its commit (edited, or copied onto another checkout) says so
    status = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain",
                             "--untracked-files=no"], capture_output=True, text=True)
    dirty = ".dirty" if status.returncode != 0 or status.stdout.strip() else ""
    return f"{version}+g{git.stdout.strip()}{dirty}"


def prepare(args) -> dict:
    """Install what the runs need and write the scratch folder; the device info."""
    if args.wheels is not None:
        if not args.wheels.is_dir():
            raise setup.SetupError(f"--wheels {args.wheels} is not a folder")
        setup.install_wheels(args.wheels, args.target)
    info = device_info(args)
    if args.device == "cuda" and not info["cuda"]:
        raise setup.SetupError("no CUDA device here; --device cpu runs the smoke test")
    try:
        wheel = args.upstream_wheel or setup.find_upstream_wheel(args.wheels, args.work_dir)
        setup.install_upstream(wheel, args.work_dir / "upstream")
    except setup.SetupError as e:
        raise setup.SetupError(f"cannot install upstream torchtitan {setup.UPSTREAM_VERSION}: "
                               f"{e}") from None
    setup.make_scratch(args.work_dir / "scratch")
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fetch_wheels is not None:
        try:
            setup.fetch_wheels(args.fetch_wheels)
        except setup.SetupError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wheels in {args.fetch_wheels}: " + " ".join(
            sorted(p.name for p in args.fetch_wheels.glob("*.whl"))))
        return 0
    runs = [(side, name, r) for name in args.settings for r in range(args.repeats)
            for side in sides(args, r)]
    commands = {f"{side} {name}": _shown(*build_run(args, side, name, 0))
                for side, name, r in runs if r == 0}
    if args.dry_run:
        print("\n".join(commands.values()))
        return 0
    start = time.perf_counter()
    try:
        info = prepare(args)
    except (setup.SetupError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results: dict[tuple[str, str], list] = {}
    failures, failed, seconds = [], set(), {}
    for side, name, r in runs:
        if (side, name) in failed:  # a failure repeats; spend no more device time on it
            continue
        summary, why, secs = run_one(args, side, name, r)
        seconds[f"{side} {name} #{r + 1}"] = round(secs, 1)
        if why is None:
            results.setdefault((side, name), []).append(summary)
        else:
            failures.append(why)
            failed.add((side, name))
    rows = [(SETTINGS[n].label + (f" [{side.split(':', 1)[1]}]" if ":" in side else ""),
             report.combine(results.get((side, n), [])),
             report.combine(results.get(("upstream", n), [])))
            for n in args.settings for side in sides(args, 0)[:-1]]
    table = report.markdown_table(rows, setup.UPSTREAM_VERSION)
    meta = dict(device=info["name"], torch=info["torch"], ours=ours_version(),
                upstream=f"torchtitan {setup.UPSTREAM_VERSION}", warmup=args.warmup,
                repeats=args.repeats, commands=commands, run_seconds=seconds,
                total_seconds=round(time.perf_counter() - start, 1))
    print(table, end="")
    print(report.json_line(rows, **meta), flush=True)
    if args.out is not None:
        args.out.write_text(
            f"{info['name']}, torch {info['torch']}, this project {meta['ours']} vs upstream "
            f"torchtitan {setup.UPSTREAM_VERSION}; tokens/s = mean of the logged steps after "
            f"step {args.warmup}, {args.repeats} run(s) each, alternating.\n\n{table}\n```\n"
            + "\n".join(commands.values()) + "\n```\n")
    if failures:
        more = f" (and {len(failures) - 1} more above)" if len(failures) > 1 else ""
        print(f"error: {failures[0]}{more}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
