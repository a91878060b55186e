"""Where a replica group sits in a fault-tolerant job: its data, its outputs, its lighthouse.

Torch-free on purpose: the pre-flight checks and the build use it before anything is started.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from torchtitan.config.job_config import FaultTolerance as FTConfig
from torchtitan.config.job_config import JobConfig

__all__ = [
    "LIGHTHOUSE_ENV",
    "FaultToleranceError",
    "check_lighthouse",
    "data_layout",
    "lighthouse_address",
    "probe_lighthouse",
    "split_group_outputs",
]

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


class FaultToleranceError(ValueError):
    """A fault-tolerant job cannot start (no lighthouse, torchft missing): one line, exit 2."""


def data_layout(ft: FTConfig, dp_degree: int, dp_rank: int) -> tuple[int, int]:
    """``(data-parallel degree, data-parallel rank)`` of a rank in the whole job: group
    ``replica_id`` reads the ``dp_degree`` shards after those of the groups before it."""
    if not ft.enable:
        return dp_degree, dp_rank
    return dp_degree * ft.group_size, ft.replica_id * dp_degree + dp_rank


def lighthouse_address(ft: FTConfig) -> str:
    """``fault_tolerance.lighthouse``, else ``$TORCHFT_LIGHTHOUSE``; FaultToleranceError when
    neither is set."""
    address = ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise FaultToleranceError(
            "fault_tolerance.enable needs the torchft lighthouse's address: set "
            f"--fault_tolerance.lighthouse http://HOST:29510 or {LIGHTHOUSE_ENV} (start one with "
            "`torchft_lighthouse --min_replicas 1`)"
        )
    if "://" not in address:
        address = f"http://{address}"
    return address


def split_group_outputs(cfg: JobConfig) -> None:
    """Give each replica group its own output folder, ``{dump_folder}/replica_{id}`` (logs,
    metrics, profiles, traces), and keep one checkpoint folder, ``{dump_folder}/{folder}``,
    shared by all groups: the group that writes checkpoints can change, and a full restart of
    every group resumes from the same place. Changes ``cfg`` in place; no-op without FT."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return
    shared = os.path.abspath(os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder))
    cfg.checkpoint.folder = shared
    cfg.job.dump_folder = os.path.join(cfg.job.dump_folder, f"replica_{ft.replica_id}")


# A gRPC call with no request message: a torchft lighthouse (0.2 serves gRPC and its dashboard
# over HTTP/1.1 and HTTP/2 on one port) answers it with a gRPC status and records nothing, not
# even a heartbeat, so probing it cannot delay a quorum.
_PROBE_PATH = "/torchft.LighthouseService/Heartbeat"
_GRPC_UNIMPLEMENTED = "12"


def probe_lighthouse(address: str, timeout_s: float = 10.0) -> tuple[str, str]:
    """Ask ``address`` a torchft lighthouse question. ``("", "")`` when a lighthouse answers;
    else ``(kind, detail)``: kind ``"unreachable"`` (no connection, e.g. "Connection refused"),
    ``"not a lighthouse"`` (something else answers there) or ``"silent"`` (a connection, but no
    answer within ``timeout_s``: something that never answers, or a lighthouse too busy or
    stopped to answer now)."""
    import http.client

    parts = urlsplit(address if "://" in address else f"http://{address}")
    host, port = parts.hostname or "localhost", parts.port or 29510
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(host, port, timeout=timeout_s)
    try:
        try:
            conn.connect()
        except OSError as err:
            return "unreachable", str(err.strerror or err)
        try:
            conn.request("POST", _PROBE_PATH, body=b"",
                         headers={"content-type": "application/grpc", "te": "trailers"})
            response = conn.getresponse()
            response.read(4096)
        except TimeoutError:
            return "silent", f"no answer within {timeout_s:g}s"
        except (OSError, http.client.HTTPException) as err:
            return "not a lighthouse", f"no HTTP answer: {type(err).__name__}"
        grpc = (response.getheader("content-type") or "").startswith("application/grpc")
        status = response.getheader("grpc-status")
        if not grpc or status is None or status == _GRPC_UNIMPLEMENTED:
            what = f"gRPC status {status}" if grpc else f"HTTP {response.status}"
            return "not a lighthouse", f"it answered {what} to {_PROBE_PATH}"
        return "", ""
    finally:
        conn.close()


def check_lighthouse(ft: FTConfig, timeout_s: float = 10.0) -> None:
    """Pre-flight: torchft is installed and a torchft lighthouse answers at the address (one
    line, FaultToleranceError, within about ``2 * timeout_s``). No-op without fault tolerance.
    A connection that gets no answer is one warning, not a refusal: a lighthouse that is busy
    or held can be slow to answer, and refusing would stop a group's rejoin; the groups' quorum
    timeout bounds the wait if it is no lighthouse."""
    if not ft.enable:
        return
    address = lighthouse_address(ft)
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        raise FaultToleranceError(
            "fault_tolerance.enable needs torchft; pip install 'torchft>=0.2'"
        )
    kind, detail = probe_lighthouse(address, timeout_s)
    if kind == "unreachable":
        raise FaultToleranceError(
            f"cannot reach the torchft lighthouse at {address} ({detail}); start "
            "it there with `torchft_lighthouse --min_replicas 1` or fix "
            f"--fault_tolerance.lighthouse / {LIGHTHOUSE_ENV}"
        )
    if kind == "silent":
        from torchtitan.tools.logging import logger

        logger.warning(
            f"the torchft lighthouse at {address} accepted a connection but did not answer "
            f"({detail}); going on (fault_tolerance.quorum_timeout_seconds bounds the wait)"
        )
    elif kind:
        raise FaultToleranceError(
            f"{address} is not a torchft lighthouse ({detail}); point "
            f"--fault_tolerance.lighthouse / {LIGHTHOUSE_ENV} at one, started with "
            "`torchft_lighthouse --min_replicas 1`"
        )
