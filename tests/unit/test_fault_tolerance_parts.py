"""Fault tolerance, in-process: config rules, data layout, pre-flight, live state, launcher."""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
import time

import pytest
import torch
from torch import nn

from tests.conftest import REPO_ROOT
from torchtitan.components.fault_tolerance import FaultTolerance, _buckets
from torchtitan.components.fault_tolerance.layout import (
    FaultToleranceError,
    check_lighthouse,
    data_layout,
    lighthouse_address,
    probe_lighthouse,
    split_group_outputs,
)
from torchtitan.components.fault_tolerance.live_state import (
    LiveState,
    OptimizerLiveState,
    like_template,
)
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig, Optimizer
from torchtitan.config.manager import ConfigManager, main
from torchtitan.config.validation import validate

DEBUG = str(REPO_ROOT / "train_configs" / "debug_model.toml")
FT = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]


def cfg_of(*flags: str) -> JobConfig:
    return ConfigManager().parse_args(["--job.config_file", DEBUG, *flags])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fault_tolerance.enable"],
         "fault_tolerance.group_size must be the number of replica groups (>= 1) with "
         "fault_tolerance.enable, got 0"),
        ([*FT, "--fault_tolerance.replica_id", "2"],
         "fault_tolerance.replica_id=2 must be < fault_tolerance.group_size=2 (ids are 0 .. "
         "group_size-1)"),
        ([*FT, "--fault_tolerance.min_replica_size", "3"],
         "fault_tolerance.min_replica_size=3 must be <= fault_tolerance.group_size=2 (no step "
         "could ever commit)"),
        ([*FT, "--fault_tolerance.semi_sync_method", "hogwild"],
         "fault_tolerance.semi_sync_method must be one of local_sgd, diloco (or unset), got "
         "'hogwild'"),
        ([*FT, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps",
          "3", "--fault_tolerance.fragment_sync_delay", "3"],
         "fault_tolerance.fragment_sync_delay=3 must be < fault_tolerance.sync_steps=3"),
        ([*FT, "--fault_tolerance.process_group", "mpi"],
         "fault_tolerance.process_group must be gloo or nccl, got 'mpi'"),
        ([*FT, "--fault_tolerance.outer_momentum", "1.0"],
         "fault_tolerance.outer_momentum must be in [0, 1), got 1.0"),
    ],
)
def test_bad_settings_are_one_line(flags, message):
    with pytest.raises(ConfigError) as info:
        validate(cfg_of(*flags))
    assert str(info.value) == message


def test_settings_are_ignored_without_enable():
    validate(cfg_of("--fault_tolerance.replica_id", "5"))  # group_size 0, but FT is off


def test_should_quantize_without_triton_is_one_line(monkeypatch):
    """torchft would quietly send full precision without triton: the trainer says so instead."""
    pytest.importorskip("torchft")
    import torchft.manager

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torchft.manager, "IS_TRITON_AVAILABLE", False)
    cfg = cfg_of(*FT, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.process_group",
                 "nccl", "--fault_tolerance.should_quantize", "--fault_tolerance.lighthouse",
                 "http://localhost:1")
    validate(cfg)
    with pytest.raises(FaultToleranceError) as info:
        FaultTolerance(cfg.fault_tolerance, 0, 1)
    assert str(info.value) == (
        "fault_tolerance.should_quantize needs triton (torchft's quantized all-reduce is a triton "
        "kernel) and triton is not installed: pip install triton, or drop should_quantize"
    )


def test_a_lost_lighthouse_is_one_readable_line():
    """torchft's Rust status text is cut to its message; the line says what likely happened."""
    from types import SimpleNamespace

    class Manager:
        def start_quorum(self):
            raise RuntimeError('status: Cancelled, message: "Timeout expired", details: [], '
                               "metadata: MetadataMap { headers: {} }")

    ft = FaultTolerance.__new__(FaultTolerance)
    ft.manager, ft.address = Manager(), "http://node7:29510"
    ft.cfg = SimpleNamespace(quorum_timeout_seconds=10)
    ft._quorum_seen = True  # mid-run: the lighthouse answered before
    with pytest.raises(RuntimeError) as info:
        ft._start_quorum()
    assert str(info.value) == (
        "fault tolerance: no quorum from the torchft lighthouse at http://node7:29510 within 10s "
        "(Timeout expired; is the lighthouse still running?)"
    )


def test_groups_split_the_data_after_each_other():
    ft = cfg_of(*FT, "--fault_tolerance.group_size", "3", "--fault_tolerance.replica_id", "1")
    ft = ft.fault_tolerance
    assert [data_layout(ft, 2, r) for r in (0, 1)] == [(6, 2), (6, 3)]
    assert data_layout(cfg_of().fault_tolerance, 2, 1) == (2, 1)


def test_lighthouse_address_from_flag_or_environment(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(FaultToleranceError, match="needs the torchft lighthouse's address"):
        lighthouse_address(cfg_of(*FT).fault_tolerance)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lh:1")
    assert lighthouse_address(cfg_of(*FT).fault_tolerance) == "http://lh:1"
    flag = cfg_of(*FT, "--fault_tolerance.lighthouse", "node7:29510").fault_tolerance
    assert lighthouse_address(flag) == "http://node7:29510"


def test_preflight_reaches_the_lighthouse(monkeypatch):
    """A real lighthouse (torchft's own server, in this process) passes; a port where nothing
    listens is one line naming the address."""
    _torchft = pytest.importorskip("torchft._torchft")
    server = _torchft.LighthouseServer(bind="[::]:0", min_replicas=1)
    port = int(server.address().rsplit(":", 1)[1])
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://localhost:{port}")
    try:
        check_lighthouse(cfg_of(*FT).fault_tolerance)
    finally:
        server.shutdown()  # asynchronous: the port may answer a moment longer
    with socket.socket() as closed:
        closed.bind(("localhost", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://localhost:{port}")
    with pytest.raises(FaultToleranceError) as info:
        check_lighthouse(cfg_of(*FT).fault_tolerance)
    assert str(info.value) == (
        f"cannot reach the torchft lighthouse at http://localhost:{port} (Connection refused); "
        "start it there with `torchft_lighthouse --min_replicas 1` or fix "
        "--fault_tolerance.lighthouse / TORCHFT_LIGHTHOUSE"
    )


def test_a_group_of_one_process_starts_without_torchrun(monkeypatch):
    """``python -m torchtitan.train`` with fault tolerance: torchft's Manager joins the store
    torchrun hosts (MASTER_ADDR) and failed with KeyError 'MASTER_ADDR', named as a lighthouse
    problem; the rank now probes the lighthouse itself and hosts the store of a 1-rank group."""
    _torchft = pytest.importorskip("torchft._torchft")
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # restored (unset or not) after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    with socket.socket() as closed:
        closed.bind(("localhost", 0))
        port = closed.getsockname()[1]
    cfg = cfg_of(*FT, "--fault_tolerance.lighthouse", f"http://localhost:{port}").fault_tolerance
    with pytest.raises(FaultToleranceError, match=r"^cannot reach the torchft lighthouse at "
                       rf"http://localhost:{port} \(Connection refused\)"):
        FaultTolerance(cfg, group_rank=0, group_world_size=1)
    server = _torchft.LighthouseServer(bind="[::]:0", min_replicas=1)
    cfg.lighthouse = f"http://localhost:{int(server.address().rsplit(':', 1)[1])}"
    try:
        ft = FaultTolerance(cfg, group_rank=0, group_world_size=1)
        ft.shutdown()
    finally:
        server.shutdown()


@contextlib.contextmanager
def _impostor(kind: str):
    """A port that accepts connections but is no lighthouse: a plain HTTP server, or a socket
    that never answers; yields its address."""
    if kind == "http":
        server = http.server.HTTPServer(("localhost", 0), http.server.BaseHTTPRequestHandler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://localhost:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()
    else:
        with socket.socket() as silent:
            silent.bind(("localhost", 0))
            silent.listen()
            yield f"http://localhost:{silent.getsockname()[1]}"


@pytest.mark.parametrize(("kind", "verdict"), [
    ("http", ("not a lighthouse", "it answered HTTP 501 to /torchft.LighthouseService/Heartbeat")),
    ("silent", ("silent", "no answer within 0.5s")),
])
def test_preflight_refuses_a_port_that_is_not_a_lighthouse(kind, verdict):
    """Accepting a connection is not enough: the job would wait the whole quorum timeout."""
    with _impostor(kind) as address:
        start = time.monotonic()
        assert probe_lighthouse(address, timeout_s=0.5) == verdict
        assert time.monotonic() - start < 3


def test_a_lighthouse_that_does_not_answer_yet_is_a_warning_not_a_refusal(monkeypatch, caplog):
    """A held or busy lighthouse (a connection, no answer) must not stop a group's rejoin."""
    pytest.importorskip("torchft")
    with _impostor("silent") as address:
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", address)
        with caplog.at_level("WARNING", logger="torchtitan"):
            check_lighthouse(cfg_of(*FT).fault_tolerance, timeout_s=0.5)
    assert caplog.messages == [
        f"the torchft lighthouse at {address} accepted a connection but did not answer (no "
        "answer within 0.5s); going on (fault_tolerance.quorum_timeout_seconds bounds the wait)"
    ]


def test_preflight_names_an_address_that_is_not_a_lighthouse(monkeypatch):
    pytest.importorskip("torchft")
    with _impostor("http") as address:
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", address)
        with pytest.raises(FaultToleranceError) as info:
            check_lighthouse(cfg_of(*FT).fault_tolerance)
    assert str(info.value) == (
        f"{address} is not a torchft lighthouse (it answered HTTP 501 to "
        "/torchft.LighthouseService/Heartbeat); point --fault_tolerance.lighthouse / "
        "TORCHFT_LIGHTHOUSE at one, started with `torchft_lighthouse --min_replicas 1`"
    )


def test_config_tool_refuses_a_job_without_lighthouse(capsys, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    code = main(["--job.config_file", DEBUG, "--check", *FT])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(
        "error: fault_tolerance.enable needs the torchft lighthouse's address"
    )


def test_each_group_writes_its_own_outputs_and_one_checkpoint_folder(tmp_path):
    cfg = cfg_of(*FT, "--fault_tolerance.replica_id", "1", "--job.dump_folder", str(tmp_path))
    split_group_outputs(cfg)
    assert cfg.job.dump_folder == str(tmp_path / "replica_1")
    assert cfg.checkpoint.folder == str(tmp_path / "checkpoint")


def _trained(seed: int) -> tuple[nn.Module, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opts = build_optimizers([model], Optimizer(implementation="for-loop"))
    model(torch.randn(3, 4)).sum().backward()
    opts.step()
    return model, opts


def test_live_state_carries_weights_and_optimizer_exactly():
    src_model, src_opts = _trained(0)
    dst_model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    dst_opts = build_optimizers([dst_model], Optimizer(implementation="for-loop"))
    sent = LiveState({"model": src_model, "optimizer": OptimizerLiveState(src_opts)}).save()
    receiver = LiveState({"model": dst_model, "optimizer": OptimizerLiveState(dst_opts)})
    receiver.load(sent)
    assert receiver.loads == 1
    for a, b in zip(src_model.parameters(), dst_model.parameters()):
        assert torch.equal(a, b)
    src_state = src_opts.optimizers[0].state_dict()["state"]
    dst_state = dst_opts.optimizers[0].state_dict()["state"]
    assert src_state.keys() == dst_state.keys()
    for key in src_state:
        assert torch.equal(src_state[key]["exp_avg_sq"], dst_state[key]["exp_avg_sq"])
        assert float(src_state[key]["step"]) == float(dst_state[key]["step"]) == 1.0


def test_an_optimizer_that_never_stepped_sends_nothing_and_stays_fresh():
    """torch's optimizer state_dict would take a zero-lr step (Adam's step count 1)."""
    model = nn.Linear(4, 2)
    opts = build_optimizers([model], Optimizer(implementation="for-loop"))
    live = OptimizerLiveState(opts)
    assert live.state_dict() == {}
    assert not opts.optimizers[0].state  # asking did not initialise it
    _, stepped = _trained(1)
    OptimizerLiveState(stepped).load_state_dict({})
    assert not stepped.optimizers[0].state


def test_like_template_keeps_plain_values_and_moves_tensors():
    received = {"a": torch.ones(2), "b": [torch.zeros(1), 3], "c": "x"}
    out = like_template(received, {"a": torch.empty(2), "b": [torch.empty(1), 0]})
    assert torch.equal(out["a"], torch.ones(2)) and out["b"][1] == 3 and out["c"] == "x"


def test_gradient_buckets_keep_order_and_split_by_dtype():
    ts = [torch.zeros(3), torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(1)]
    assert [[t.numel() for t in b] for b in _buckets(ts)] == [[3, 2], [2], [1]]


class _PairedManager:
    """torchft's Manager.allreduce between two in-process replica groups (one thread each)."""

    def __init__(self, slots: list, barrier, index: int) -> None:
        self.slots, self.barrier, self.index = slots, barrier, index

    def allreduce(self, tensor: torch.Tensor, reduce_op=None):
        from torch.distributed import ReduceOp

        self.slots[self.index] = tensor.clone()
        self.barrier.wait()
        total = self.slots[0] + self.slots[1]
        self.barrier.wait()
        tensor.copy_(total if reduce_op == ReduceOp.SUM else total / 2)  # torchft: AVG
        done = torch.futures.Future()
        done.set_result(tensor)
        return done


def _two_groups_step(valid: tuple[int, int], weighted: bool = True):
    """One step of two replica groups on the rows of one batch, rows past each group's valid
    count ignored (as labels of -100 are); returns their gradients and logged losses and the
    gradients of one job over both groups' valid rows."""
    import threading

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(2, 8, 4), torch.randn(2, 8, 3)
    slots, barrier = [None, None], threading.Barrier(2)
    results: list = [None, None]

    def group(index: int) -> None:
        replica = nn.Linear(4, 3)
        replica.load_state_dict(model.state_dict())
        n = valid[index]
        loss = ((replica(x[index, :n]) - y[index, :n]) ** 2).sum() / n  # per-token mean
        loss.backward()
        ft = object.__new__(FaultTolerance)
        ft.manager = _PairedManager(slots, barrier, index)
        tokens = (lambda: float(n)) if weighted else None
        ft.sync_gradients_hook([replica], step_tokens=tokens)()
        results[index] = ([p.grad.clone() for p in replica.parameters()],
                          ft.average_loss(loss.item()), ft.token_weight)

    threads = [threading.Thread(target=group, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = torch.cat([x[0, : valid[0]], x[1, : valid[1]]]), torch.cat([y[0, : valid[0]], y[1, : valid[1]]])
    loss = ((model(rows[0]) - rows[1]) ** 2).sum() / sum(valid)
    loss.backward()
    return results, [p.grad for p in model.parameters()], loss.item()


def test_groups_with_different_token_counts_average_per_token_like_one_job():
    """7 and 3 valid tokens: each group's gradient is a mean over its own tokens; weighted by
    the counts, the average over the groups is the mean over all 10 (a plain mean of the two
    group means is off by more than 10% here)."""
    (a, b), one_job, job_loss = _two_groups_step((7, 3))
    assert a[2] == pytest.approx(1.4) and b[2] == pytest.approx(0.6)
    for ga, gb, g in zip(a[0], b[0], one_job):
        torch.testing.assert_close(ga, gb, rtol=0, atol=0)
        torch.testing.assert_close(ga, g, rtol=1e-6, atol=1e-7)
    assert a[1] == b[1] == pytest.approx(job_loss, rel=1e-6)
    (plain, _), _, _ = _two_groups_step((7, 3), weighted=False)  # the plain mean of the means
    assert plain[2] == 1.0
    assert not any(torch.allclose(p, g, rtol=0.1) for p, g in zip(plain[0], one_job))


def test_groups_with_equal_token_counts_are_not_rescaled():
    (a, b), one_job, _ = _two_groups_step((5, 5))
    assert a[2] == b[2] == 1.0  # exactly: the gradients are averaged untouched
    for ga, g in zip(a[0], one_job):
        torch.testing.assert_close(ga, g, rtol=1e-6, atol=1e-7)


def test_launcher_prints_the_lighthouse_and_one_command_per_group(capsys, monkeypatch):
    import importlib.util

    """The printed commands carry what the launcher sets, not what it inherits (here an empty
    CUDA_VISIBLE_DEVICES, as on a GPU machine's CPU test run)."""
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: CPU groups
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    spec = importlib.util.spec_from_file_location(
        "run_fault_tolerant", REPO_ROOT / "scripts" / "run_fault_tolerant.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--groups", "2", "--ranks-per-group", "4", "--print", "--",
                        "--training.steps", "9"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "torchft_lighthouse --min_replicas 1 --bind '[::]:29510' --join_timeout_ms 10000"
    )
    assert lines[2] == (
        f"NGPU=4 TORCHFT_LIGHTHOUSE=http://localhost:29510 {REPO_ROOT}/run_train.sh "
        "--training.steps 9 --fault_tolerance.enable --fault_tolerance.group_size 2 "
        "--fault_tolerance.replica_id 1"
    )
