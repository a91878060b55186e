#!/usr/bin/env python3
"""kill -9 a training run at random moments, resume it, and check nothing was lost or damaged.

    python scripts/chaos_kill_resume.py                 # 20 trials, about 4 minutes on 2 cores
    python scripts/chaos_kill_resume.py --trials 5 --seed 1 --keep /tmp/chaos
    python scripts/chaos_kill_resume.py --layout moe_ep   # 4 ranks, about 8 minutes

Slow, not part of CI. Each trial runs the trainer in a fresh folder (``--layout tiny``:
debugmodel_tiny, CPU, one process; ``moe_ep``: the Qwen3 MoE debug model on 4 gloo ranks under
torchrun, expert parallel 2 x FSDP 2; both deterministic), SIGKILLs it once (every process of
the job), then reruns the same command to the end:

* the kill moment is random: at a random time during the run, or inside a save (sync or async,
  alternating) at a random step and phase (``write``: data files written, ``.metadata`` not
  yet; ``commit``: ``.metadata`` written, not committed) via the fault-injection save hook;
* after the kill, every committed ``step-N`` must verify (sizes and CRC32 checksums);
* the rerun must succeed and say where it resumed from (or that there was no checkpoint yet);
* its final weights must equal, bit for bit, those of a run that was never killed.

Reports per trial and the totals: resumed / corrupt / bit-exact.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchtitan.tools.cli_args import OneLineParser, positive_int  # noqa: E402

STEPS = 12
FLAGS = [
    "--job.config_file", "./train_configs/debug_model.toml",
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--training.steps", str(STEPS),
    "--activation_checkpoint.mode", "none",
    "--metrics.log_freq", "1",
    "--debug.seed", "3",
    "--debug.deterministic",
    "--checkpoint.enable",
    "--checkpoint.interval", "2",
    "--checkpoint.keep_latest_k", "2",
    "--checkpoint.no_last_save_model_only",
]


LAYOUTS = {
    "tiny": ([sys.executable, "-m", "torchtitan.train"], FLAGS),
    "moe_ep": (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
         "--tee", "3", "-m", "torchtitan.train"],
        ["--job.config_file", "./train_configs/qwen3_debugmodel_moe.toml",
         "--parallelism.expert_parallel_degree", "2", *FLAGS[4:]],
    ),
}


def _cmd(layout: str, dump: Path, async_mode: str) -> list[str]:
    launcher, flags = LAYOUTS[layout]
    return [*launcher, *flags, "--job.dump_folder", str(dump), "--checkpoint.async_mode", async_mode]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHTITAN_")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def _final_weights(dump: Path) -> dict:
    from torchtitan.components.checkpoint.load import load_dcp_model_tensors

    return load_dcp_model_tensors(str(dump / "checkpoint" / f"step-{STEPS}"))


def _committed_ok(dump: Path) -> tuple[bool, str]:
    """Every committed step-N verifies (sizes and checksums)."""
    from torchtitan.components.checkpoint import fs
    from torchtitan.components.checkpoint.integrity import content_problem

    for entry in fs.scan_checkpoints(str(dump / "checkpoint")):
        if entry.path.endswith(fs.TMP_SUFFIX):
            continue
        if not entry.complete:
            return False, f"{entry.path}: {entry.reason}"
        problem = content_problem(entry.path)
        if problem:
            return False, f"{entry.path}: {problem}"
    return True, ""


def _run(cmd: list[str], env: dict[str, str], kill_after: float | None = None) -> tuple[int, str, float]:
    """Run to the end, or SIGKILL ``kill_after`` s after training started. Returns the exit
    code, the output and the seconds from "Training starts" to "Training completed"."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []
    started = threading.Event()
    t0: list[float] = []
    t1: list[float] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "Training starts at step" in line and not started.is_set():
                t0.append(time.monotonic())
                started.set()
            if "Training completed" in line and t0:
                t1.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if kill_after is not None:
        while not started.wait(0.05) and proc.poll() is None:
            pass
        if started.is_set() and proc.poll() is None:
            try:
                proc.wait(timeout=max(0.0, t0[0] + kill_after - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank
    proc.wait(timeout=600)
    reader.join(timeout=10)
    took = (t1[0] if t1 else time.monotonic()) - t0[0] if t0 else 0.0
    return proc.returncode, "".join(lines), took



def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="tiny")
    parser.add_argument("--trials", type=positive_int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", help="keep the trial folders here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.keep and Path(args.keep).exists() and not Path(args.keep).is_dir():
        parser.error(f"--keep {args.keep} is an existing file, not a folder")
    rng = random.Random(args.seed)
    root = Path(args.keep or tempfile.mkdtemp(prefix="chaos_"))
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"--keep {root}: cannot make the folder ({err.strerror})")

    import torch

    refs, durations = {}, {}
    for mode in ("disabled", "async"):
        dump = root / f"reference_{mode}"
        shutil.rmtree(dump, ignore_errors=True)
        code, out, took = _run(_cmd(args.layout, dump, mode), _env())
        if code != 0:
            print(out[-3000:])
            raise SystemExit(f"the reference run ({mode}) failed")
        refs[mode], durations[mode] = _final_weights(dump), took
        print(f"reference run, async_mode={mode}: training took {took:.1f} s")

    totals = {"resumed": 0, "fresh": 0, "corrupt": 0, "bit_exact": 0, "killed": 0}
    for trial in range(args.trials):
        mode = ("disabled", "async")[trial % 2]
        dump = root / f"trial_{trial:02d}"
        shutil.rmtree(dump, ignore_errors=True)
        if rng.random() < 0.5:
            step = rng.choice(range(2, STEPS, 2))
            phase = rng.choice(("write", "commit"))
            where = f"inside the {'async' if mode == 'async' else 'sync'} save of step {step} ({phase})"
            extra = {"TORCHTITAN_CHECKPOINT_HOOKS": "tests.checkpoint_kill_hook:KillDuringSave",
                     "TORCHTITAN_TEST_KILL_AT": f"{step}:{phase}"}
            code, out, _ = _run(_cmd(args.layout, dump, mode), _env(extra))
        else:
            delay = rng.uniform(0.0, durations[mode])
            where = f"{delay:.2f} s into training ({mode} saves)"
            code, out, _ = _run(_cmd(args.layout, dump, mode), _env(), kill_after=delay)
        killed = code != 0  # SIGKILLed, or (torchrun) a rank was
        totals["killed"] += killed
        ok, why = _committed_ok(dump)
        code2, out2, _ = _run(_cmd(args.layout, dump, mode), _env())
        loaded = re.search(r"Checkpoint: loaded .* from (\S+)", out2)
        fresh = "starting from scratch" in out2 or "nothing is loaded" in out2
        corrupt = not ok or code2 != 0 or not (loaded or fresh)
        exact = False
        if code2 == 0:
            final = _final_weights(dump)
            exact = final.keys() == refs[mode].keys() and all(
                torch.equal(final[k], refs[mode][k]) for k in final
            )
        totals["resumed"] += bool(loaded)
        totals["fresh"] += bool(fresh and not loaded)
        totals["corrupt"] += corrupt
        totals["bit_exact"] += exact
        source = os.path.basename(loaded.group(1)) if loaded else "scratch (nothing committed yet)"
        status = "CORRUPT " + (why or f"rerun exit {code2}: {out2.strip().splitlines()[-1:]}") if corrupt else "ok"
        print(f"trial {trial:2d}: killed {where}{'' if killed else ' (finished before the kill)'}; "
              f"resumed from {source}; bit-exact: {exact}; {status}", flush=True)
        if not args.keep:
            shutil.rmtree(dump, ignore_errors=True)
    n = args.trials
    print(f"\n{n} trials: {totals['killed']} killed, {totals['resumed']} resumed from a checkpoint, "
          f"{totals['fresh']} restarted from scratch (killed before the first commit), "
          f"{totals['corrupt']} corrupt, {totals['bit_exact']} bit-exact")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if totals["corrupt"] == 0 and totals["bit_exact"] == n else 1


if __name__ == "__main__":
    sys.exit(main())
