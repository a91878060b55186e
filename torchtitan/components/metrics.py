"""Training metrics: the console line, a JSONL file, TensorBoard and Weights & Biases.

Rank 0 always writes ``{dump_folder}/metrics.jsonl``: one JSON object per logged step with
``step``, ``loss``, ``grad_norm``, ``lr``, ``tokens`` (global tokens seen so far) and the other
metrics, at full precision (``scripts/loss_compare.py`` reads it; the console shows 4 decimals).
A run that starts at step 1 moves an earlier run's file to ``metrics.jsonl.1`` (older ones to
``.2``, ``.3``, ...); a resumed run appends.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict
from datetime import datetime
from typing import Any

from torchtitan.config.job_config import JobConfig
from torchtitan.tools.device import MemoryMonitor, get_peak_flops
from torchtitan.tools.logging import console_wants_color, logger


class _Color:
    def __init__(self, enabled: bool) -> None:
        codes = {"red": 31, "green": 32, "yellow": 33, "blue": 34, "magenta": 35, "cyan": 36}
        for name, code in codes.items():
            setattr(self, name, f"\033[{code}m" if enabled else "")
        self.reset = "\033[39m" if enabled else ""


class BaseLogger:
    """Sink for scalar metrics."""

    label = "a metrics sink"
    """What the sink writes, for people (warnings)."""

    def log(self, metrics: dict[str, float], step: int) -> None:  # pragma: no cover - interface
        pass

    def close(self) -> None:
        pass


class TensorBoardLogger(BaseLogger):
    def __init__(self, log_dir: str) -> None:
        import errno
        import shutil

        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(log_dir, exist_ok=True)
        if shutil.disk_usage(log_dir).free < 1 << 20:  # its writer thread would die noisily
            raise OSError(errno.ENOSPC, "No space left on device", log_dir)
        self.writer = SummaryWriter(log_dir, max_queue=1000)
        self.label = f"TensorBoard ({log_dir})"
        logger.info(f"TensorBoard logs in {log_dir}")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


METRICS_JSONL = "metrics.jsonl"
"""File name of the JSONL metrics sink, in ``job.dump_folder``."""


def _json_number(value: float) -> float | int | str:
    """JSON has no NaN/inf: those become the strings "nan" / "inf" / "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def rotate(path: str) -> str | None:
    """Move a non-empty ``path`` to ``path.1``, shifting ``path.1`` to ``path.2`` and so on
    (nothing is overwritten); returns where it went (None: nothing to move)."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return None
    n = 1
    while os.path.exists(f"{path}.{n}"):
        n += 1
    for k in range(n, 1, -1):
        os.replace(f"{path}.{k - 1}", f"{path}.{k}")
    os.replace(path, f"{path}.1")
    return f"{path}.1"


class JSONLLogger(BaseLogger):
    """Appends one JSON object per logged step to ``path``. A run that starts at step 1
    first moves an earlier run's file aside (:func:`rotate`); a resumed run appends, so its
    earlier steps stay."""

    def __init__(self, path: str) -> None:
        self.path = self.label = path
        self.file = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.file is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            if step <= 1 and (moved := rotate(self.path)):
                logger.info(f"Metrics: this run starts at step 1; the earlier {self.path} is now {moved}")
            self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        record = {"step": step}
        for key, value in metrics.items():
            record[key] = _json_number(value if isinstance(value, int) else float(value))
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        file, self.file = self.file, None
        if file is not None:
            file.close()


def _wandb_server_unreachable(timeout: float = 5.0) -> str | None:
    """Why an online W&B run with a key cannot reach its server (``WANDB_BASE_URL``, else
    api.wandb.ai), or None. Without this, ``wandb.init`` waits its own ~90 s timeout and then
    prints its lines. Offline and disabled modes, no key at all (wandb says so at once) and a
    server behind a proxy are left to wandb."""
    import socket
    from urllib.parse import urlsplit

    if os.environ.get("WANDB_MODE", "online") != "online" or os.environ.get("WANDB_DISABLED"):
        return None
    proxies = ("https_proxy", "http_proxy", "all_proxy")
    if any(os.environ.get(n) or os.environ.get(n.upper()) for n in proxies):
        return None  # reached through a proxy, which a direct connection does not test
    url = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    host = url.hostname or "api.wandb.ai"
    netrc = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        with open(netrc, encoding="utf-8") as f:
            logged_in = host in f.read()
    except OSError:
        logged_in = False
    if not (os.environ.get("WANDB_API_KEY") or logged_in):
        return None
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return f"{host}:{port}: {err.strerror or type(err).__name__}"
    return None


class WandBLogger(BaseLogger):
    def __init__(self, log_dir: str, config: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        self.label = f"W&B ({log_dir})"
        os.makedirs(log_dir, exist_ok=True)
        unreachable = _wandb_server_unreachable()
        if unreachable:
            raise ValueError(
                f"metrics.enable_wandb: the W&B server is unreachable ({unreachable}); set "
                f"WANDB_MODE=offline to write the run under {log_dir} and `wandb sync` it later"
            )
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "torchtitan"),
                dir=log_dir,
                config=config,
            )
        except wandb.errors.Error as err:  # no API key, a bad one, W&B unreachable
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            login = ("log in with `wandb login` or set WANDB_API_KEY, or "
                     if "key" in first.lower() else "")
            raise ValueError(
                f"metrics.enable_wandb: W&B did not start ({first}); {login}set "
                f"WANDB_MODE=offline to write the run under {log_dir} and `wandb sync` it later"
            ) from None
        logger.info(f"W&B logging to {log_dir} (mode: {os.environ.get('WANDB_MODE', 'online')})")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsProcessor:
    """Accumulates per-step counters and emits the metrics of each logged step."""

    def __init__(self, job_config: JobConfig, *, rank: int, compute_dtype: str) -> None:
        """``compute_dtype`` is the dtype the model's matmuls run in
        (``distributed.mixed_precision.compute_dtype``): MFU is measured against the device's
        peak for that dtype."""
        from torchtitan.preflight import check_output_folders

        check_output_folders(job_config)  # not after the first step's work
        self.cfg = job_config.metrics
        self.last_step = job_config.training.steps
        self.color = _Color(not self.cfg.disable_color_printing and console_wants_color())
        self.memory_monitor = MemoryMonitor()
        self.peak_flops = get_peak_flops(compute_dtype)
        self.num_flops_per_token = 0.0
        # Ranks that split one batch's work (tp x cp x pp): tokens/s is reported per device.
        self.tokens_divisor = 1
        self.ntokens_since_last_log = 0
        self.data_loading_times: list[float] = []
        self.time_last_log = time.perf_counter()
        self.sinks: list[BaseLogger] = []
        write = rank == 0 or self.cfg.save_for_all_ranks
        base = os.path.join(job_config.job.dump_folder, self.cfg.save_tb_folder)
        stamp = datetime.now().strftime("%Y%m%d-%H%M")
        suffix = f"rank_{rank}" if self.cfg.save_for_all_ranks else ""
        if rank == 0:
            self.sinks.append(JSONLLogger(os.path.join(job_config.job.dump_folder, METRICS_JSONL)))
        if write and self.cfg.enable_tensorboard:
            try:
                self.sinks.append(TensorBoardLogger(os.path.join(base, stamp, suffix)))
            except OSError as err:
                logger.warning(f"Metrics: TensorBoard cannot write ({err}); it is off for this run")
        if write and self.cfg.enable_wandb:
            self.sinks.append(
                WandBLogger(os.path.join(job_config.job.dump_folder, "wandb", suffix), asdict(job_config))
            )

    def should_log(self, step: int) -> bool:
        """Step 1, every ``metrics.log_freq``-th step, and the last step (its loss is the run's
        result, whatever the frequency)."""
        return step == 1 or step % self.cfg.log_freq == 0 or step == self.last_step

    def log(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        extra: dict[str, float] | None = None,
    ) -> dict[str, float]:
        """Print the console line and write the sinks; returns the metrics dict."""
        elapsed = time.perf_counter() - self.time_last_log
        tps = self.ntokens_since_last_log / (elapsed * self.tokens_divisor)
        tflops = self.num_flops_per_token * tps / 1e12
        mfu = None if self.peak_flops is None else 100 * tflops * 1e12 / self.peak_flops
        mem = self.memory_monitor.get_peak_stats()
        data_time = sum(self.data_loading_times)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tps": tps,
            "tflops": tflops,
            "memory/peak_gib": mem.peak_gib,
            "memory/peak_pct": mem.peak_pct,
            "time/step_s": elapsed / max(1, len(self.data_loading_times)),
            "time/data_loading_pct": 100 * data_time / elapsed,
        }
        if mfu is not None:
            metrics["mfu"] = mfu
        if extra:
            metrics.update(extra)
        self._write(metrics, step)
        c = self.color
        mfu_text = "n/a (unknown device)" if mfu is None else f"{mfu:.2f}%"
        logger.info(
            f"{c.red}step: {step:2}  {c.green}loss: {loss:7.4f}  "
            f"{c.cyan}grad_norm: {grad_norm:7.4f}  "
            f"{c.yellow}memory: {mem.peak_gib:5.2f}GiB({mem.peak_pct:.2f}%)  "
            f"{c.blue}tps: {round(tps):,}  {c.cyan}tflops: {tflops:,.2f}  "
            f"{c.magenta}mfu: {mfu_text}{c.reset}"
        )
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.memory_monitor.reset_peak_stats()
        return metrics

    def _write(self, metrics: dict[str, float], step: int) -> None:
        """Each sink gets the metrics; one that cannot write (a full disk, a folder gone) is
        dropped with a warning and the run goes on: a log file is not worth the run."""
        for sink in list(self.sinks):
            try:
                sink.log(metrics, step)
            except OSError as err:
                self._drop(sink, err)

    def _drop(self, sink: BaseLogger, err: OSError) -> None:
        self.sinks.remove(sink)
        logger.warning(
            f"Metrics: writing {sink.label} failed ({err}); it is off for the rest of the "
            "run (the console line goes on)"
        )
        with contextlib.suppress(OSError):  # closing flushes, which may fail the same way
            sink.close()

    def log_validation(self, step: int, loss: float) -> None:
        self._write({"validation/loss": loss}, step)
        c = self.color
        logger.info(f"{c.yellow}validate step: {step:2}  {c.green}loss: {loss:7.4f}{c.reset}")

    def close(self) -> None:
        for sink in list(self.sinks):
            try:
                sink.close()
            except OSError as err:
                self._drop(sink, err)
