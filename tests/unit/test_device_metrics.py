import os
import re

import pytest

from torchtitan.config.job_config import JobConfig
from torchtitan.tools.device import lookup_peak_tflops


def test_peak_flops_table():
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.5
    assert lookup_peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert lookup_peak_tflops("NVIDIA H200", "bfloat16") == 989.5
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB", "bfloat16") == 312.0
    assert lookup_peak_tflops("cpu", "bfloat16") is None
    assert lookup_peak_tflops("Some Future GPU", "float32") is None


def test_float32_peak_follows_torchs_matmul_precision(monkeypatch):
    """An H200's float32 MFU is against 67 TFLOP/s unless TF32 is allowed (494.7): one H200 run
    at 51 TFLOP/s in float32 would otherwise have read 10% MFU instead of 77%."""
    import torch

    from torchtitan.tools import device

    monkeypatch.setattr(device, "device_name", lambda: "NVIDIA H200")
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert device.get_peak_flops("float32") == 67.0e12
        assert device.get_peak_flops("bfloat16") == 989.5e12
        torch.set_float32_matmul_precision("high")
        assert device.get_peak_flops("float32") == 494.7e12
    finally:
        torch.set_float32_matmul_precision(previous)
    assert lookup_peak_tflops("NVIDIA B200", "float32") is None  # not guessed


def test_console_line_shape(caplog, dump_folder):
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    cfg = JobConfig()
    cfg.job.dump_folder = str(dump_folder)
    cfg.metrics.disable_color_printing = True
    mp = MetricsProcessor(cfg, rank=0, compute_dtype="float32")
    mp.num_flops_per_token = 1e6
    mp.ntokens_since_last_log = 4096
    mp.data_loading_times.append(0.001)
    logger.propagate = True
    try:
        with caplog.at_level("INFO", logger="torchtitan"):
            metrics = mp.log(12, 7.84123, 1.5, 1e-4)
    finally:
        logger.propagate = False
    line = caplog.records[-1].getMessage()
    assert re.search(
        r"step: 12  loss:  7\.8412  grad_norm:  1\.5000  memory: +[\d.]+GiB\([\d.]+%\)  "
        r"tps: [\d,]+  tflops: [\d.,]+  mfu: n/a \(unknown device\)",
        line,
    ), line
    assert metrics["tps"] > 0 and "mfu" not in metrics


def test_tensorboard_writes_events(dump_folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torchtitan.components.metrics import MetricsProcessor

    cfg = JobConfig()
    cfg.job.dump_folder = str(dump_folder)
    cfg.metrics.enable_tensorboard = True
    mp = MetricsProcessor(cfg, rank=0, compute_dtype="float32")
    for step in (1, 2):
        mp.ntokens_since_last_log = 100
        mp.log(step, 5.0 - step, 1.0, 1e-3)
    mp.close()
    event_dirs = {p.parent for p in dump_folder.rglob("events.out.tfevents.*")}
    assert len(event_dirs) == 1
    acc = EventAccumulator(str(event_dirs.pop()))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tps"} <= tags
    assert [e.value for e in acc.Scalars("loss")] == [4.0, 3.0]


@pytest.mark.slow  # wandb starts its wandb-core service process (about 2 s)
def test_wandb_offline(dump_folder, monkeypatch):
    pytest.importorskip("wandb")
    from torchtitan.components.metrics import MetricsProcessor

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = JobConfig()
    cfg.job.dump_folder = str(dump_folder)
    cfg.metrics.enable_wandb = True
    mp = MetricsProcessor(cfg, rank=0, compute_dtype="float32")
    mp.ntokens_since_last_log = 10
    mp.log(1, 3.0, 1.0, 1e-3)
    mp.close()
    runs = list((dump_folder / "wandb").rglob("offline-run-*"))
    assert runs, "W&B offline run folder was not written"
    assert list(runs[0].glob("*.wandb")), "no W&B event log in the offline run"


def _wandb_start_error(dump_folder) -> str:
    """The one-line error of a metrics setup with W&B on that cannot start."""
    from torchtitan.components.metrics import MetricsProcessor

    cfg = JobConfig()
    cfg.job.dump_folder = str(dump_folder)
    cfg.metrics.enable_wandb = True
    with pytest.raises(ValueError) as err:
        MetricsProcessor(cfg, rank=0, compute_dtype="float32")
    return str(err.value)


@pytest.mark.slow  # wandb starts its wandb-core service process
def test_wandb_without_an_api_key_is_one_line(dump_folder, monkeypatch, tmp_path):
    """Online W&B with no key configured (no login, no WANDB_API_KEY) was a wandb traceback
    from the metrics setup; now one line that says how to log in or go offline."""
    wandb = pytest.importorskip("wandb")
    wandb.teardown()  # an earlier test's session (offline mode) stays in wandb's singleton
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_SILENT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no saved login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert _wandb_start_error(dump_folder) == (
        "metrics.enable_wandb: W&B did not start (No API key configured. Use `wandb login` to "
        "log in.); log in with `wandb login` or set WANDB_API_KEY, or set WANDB_MODE=offline "
        f"to write the run under {dump_folder / 'wandb'}/ and `wandb sync` it later"
    )


@pytest.mark.parametrize(
    "degrees, dtype, mp, expected",
    [
        # without FSDP, mixed_precision_param is applied by autocast (float32 parameters)
        (dict(world_size=1), "float32", "bfloat16", "bfloat16"),
        (dict(world_size=1), "float32", "float32", "float32"),
        (dict(world_size=1), "bfloat16", "float32", "bfloat16"),  # pure bf16 parameters
        (dict(world_size=2, data_parallel_replicate_degree=2, data_parallel_shard_degree=1),
         "float32", "bfloat16", "bfloat16"),
        (dict(world_size=2, tensor_parallel_degree=2, data_parallel_shard_degree=1),
         "float32", "bfloat16", "bfloat16"),
        (dict(world_size=2, tensor_parallel_degree=2, data_parallel_shard_degree=1),
         "float32", "float32", "float32"),
        # FSDP/HSDP cast parameters to mixed_precision_param for compute
        (dict(world_size=2), "float32", "bfloat16", "bfloat16"),
        (dict(world_size=2), "bfloat16", "float32", "float32"),
        (dict(world_size=4, data_parallel_replicate_degree=2), "float32", "bfloat16", "bfloat16"),
    ],
)
def test_mfu_peak_follows_the_dtype_the_model_computes_in(degrees, dtype, mp, expected,
                                                          monkeypatch):
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.config.job_config import JobConfig, Parallelism
    from torchtitan.distributed.mixed_precision import compute_dtype
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.tools import device as device_tools

    world_size = degrees.pop("world_size")
    cfg = JobConfig()
    cfg.training.dtype, cfg.training.mixed_precision_param = dtype, mp
    dims = ParallelDims.from_config(Parallelism(**degrees), world_size)
    assert compute_dtype(cfg.training, dims) == expected
    monkeypatch.setattr(device_tools, "device_name", lambda: "NVIDIA H100 80GB HBM3")
    metrics = MetricsProcessor(cfg, rank=0, compute_dtype=compute_dtype(cfg.training, dims))
    # float32: torch's default matmul precision ("highest") runs no TF32
    assert metrics.peak_flops == {"float32": 67.0e12, "bfloat16": 989.5e12}[expected]


@pytest.mark.parametrize("user_env", [None, "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_cuda_allocator_default_leaves_a_users_setting(monkeypatch, user_env):
    """Expandable segments unless the user configured the allocator (to anything)."""
    import torch

    from torchtitan.tools import device

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append,
                        raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    if user_env:
        monkeypatch.setenv(user_env, "expandable_segments:False")
    set_it = device.default_cuda_allocator()
    assert set_it == (user_env is None)
    if user_env is None:
        assert calls == ["expandable_segments:True"]
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    else:
        assert calls == [] and os.environ[user_env] == "expandable_segments:False"


def test_wandb_with_a_key_but_no_server_is_one_line_at_once(dump_folder, monkeypatch):
    """With a key set but the W&B server out of reach, wandb.init waited its own ~90 s and
    printed its lines after the error; now the server is probed first (5 s at most)."""
    wandb = pytest.importorskip("wandb")
    import socket

    def unreachable(address, timeout=None):
        raise OSError(101, "Network is unreachable")

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(wandb, "init", lambda **kw: pytest.fail("wandb.init was called"))
    assert _wandb_start_error(dump_folder) == (
        "metrics.enable_wandb: the W&B server is unreachable (api.wandb.ai:443: Network is "
        "unreachable); set WANDB_MODE=offline to write the run under "
        f"{dump_folder / 'wandb'}/ and `wandb sync` it later"
    )
    from torchtitan.components.metrics import _wandb_server_unreachable

    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")  # wandb goes through it: no probe
    assert _wandb_server_unreachable() is None
