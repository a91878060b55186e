"""Host (CPU) memory: what is left of it, whether a CPU run's training state fits, and whether
the kernel's out-of-memory killer stopped a rank.

A CPU run that does not fit is not told so by torch: the kernel kills the rank with SIGKILL,
and the shell shows "Killed" (or torchrun "exit code -9"). Two checks turn that into a line
for people:

* before the weights are materialised, :func:`check_training_state_fits` adds up what the
  weights, their gradients and AdamW's two states will hold on the ranks of this machine, and
  refuses (exit 2) when that alone exceeds the memory the machine has left;
* a run that saves asynchronously (``checkpoint.async_mode``) also stages a copy of each
  rank's weights and optimizer state in host memory at every save: on the CPU that copy joins
  the refusal above; on a GPU :func:`warn_if_staging_short` warns at start-up when the ranks of
  this machine cannot stage theirs (the first save would be killed);
* after a rank died of SIGKILL, :func:`killed_by_oom_killer` tells from the kernel's OOM-kill
  counter whether memory was the reason (``torchtitan.launch`` then says so).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from typing import Any

from torchtitan.tools.logging import byte_size, logger

GiB = 1024**3
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63

__all__ = [
    "available_host_bytes", "check_training_state_fits", "killed_by_oom_killer",
    "oom_kill_count", "staged_checkpoint_bytes", "training_state_bytes", "warn_if_staging_short",
]


def _meminfo(path: str) -> dict[str, int]:
    """/proc/meminfo's fields in bytes (empty when it cannot be read)."""
    fields = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return fields


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 says "max" for no limit


def _cgroup_room(proc_cgroup: str, cgroup_root: str) -> int | None:
    """Bytes this process's memory cgroup (v2 or v1) still admits; None without a limit."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        path = path.lstrip("/")
        if controllers == "":  # v2
            base = os.path.join(cgroup_root, path)
            limit, used = _read_int(f"{base}/memory.max"), _read_int(f"{base}/memory.current")
        elif "memory" in controllers.split(","):  # v1
            base = os.path.join(cgroup_root, "memory", path)
            if not os.path.isdir(base):  # the namespace's root is mounted, not the path
                base = os.path.join(cgroup_root, "memory")
            limit = _read_int(f"{base}/memory.limit_in_bytes")
            used = _read_int(f"{base}/memory.usage_in_bytes")
        else:
            continue
        if limit is not None and limit < _NO_LIMIT:
            return max(0, limit - (used or 0))
    return None


def available_host_bytes(
    meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
    cgroup_root: str = "/sys/fs/cgroup",
) -> int | None:
    """Memory a process can still take: the kernel's MemAvailable plus free swap, capped by
    the memory cgroup's room; None when the kernel does not say (not Linux)."""
    info = _meminfo(meminfo)
    if "MemAvailable" not in info:
        return None
    room = info["MemAvailable"] + info.get("SwapFree", 0)
    cgroup = _cgroup_room(proc_cgroup, cgroup_root)
    return room if cgroup is None else min(room, cgroup)


def training_state_bytes(parameters: Iterable[Any], state_dtype: str, param_itemsize: int | None = None,
                         gradients: bool = True) -> int:
    """Bytes this rank's weights, gradients and AdamW states (exp_avg, exp_avg_sq) will hold:
    the local shard of each parameter (meta tensors are fine). ``param_itemsize`` overrides
    the parameters' element size (a model cast to bf16 after it is initialised)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in parameters:
        local = p.to_local() if isinstance(p, DTensor) else p
        size = param_itemsize or local.element_size()
        state = 2 if state_dtype == "bfloat16" else size
        total += local.numel() * ((2 if gradients else 1) * size + 2 * state)
    return total


def staged_checkpoint_bytes(parameters: Iterable[Any], state_dtype: str,
                            param_itemsize: int | None = None) -> int:
    """Bytes an asynchronous save stages in host memory for this rank: its weights and AdamW
    states (no gradients)."""
    return training_state_bytes(parameters, state_dtype, param_itemsize, gradients=False)


def _this_machine(need: int) -> tuple[int, int, int | None]:
    """(``need`` summed over the ranks of this machine, how many, the memory it has left).
    A collective over the default group when a torchrun job has several local ranks."""
    import torch.distributed as dist

    available = available_host_bytes()
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1 and dist.is_initialized():
        mine = (socket.gethostname(), need, available)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        here = [e for e in everyone if e[0] == mine[0]]
        known = [e[2] for e in here if e[2] is not None]
        return sum(e[1] for e in here), len(here), (min(known) if known else None)
    return need, 1, available


def check_training_state_fits(need: int, optimizer_name: str, staged: int = 0) -> None:
    """Raise ParallelismError when ``need`` bytes (this rank's training state, of which
    ``staged`` for an asynchronous save's copy) summed over the ranks of this machine exceed
    what the machine has left. Ranks of a torchrun job compare one sum, so they all agree."""
    from torchtitan.distributed.parallel_dims import ParallelismError

    host_need, ranks, available = _this_machine(need)
    if available is None or host_need <= available:
        return
    whose = f" of the {ranks} ranks on this machine" if ranks > 1 else ""
    what = f"the weights, gradients and {optimizer_name} states{whose} alone need"
    fix = ""
    if staged:
        what = (f"the weights, gradients and {optimizer_name} states{whose}, with the copy "
                f"checkpoint.async_mode stages at each save ({byte_size(staged * ranks)}), need")
        fix = "use --checkpoint.async_mode disabled, or "
    raise ParallelismError(
        f"out of host memory before the first step: {what} {byte_size(host_need)}, and this "
        f"machine has {byte_size(available)} available (free memory and swap); {fix}pick a "
        "smaller model.flavor, or shard the model over more machines or GPUs"
    )


def warn_if_staging_short(staged: int, async_mode: str) -> None:
    """Warn (from each machine's local rank 0) when the host copies an asynchronous save stages
    for the GPU ranks of this machine (``staged`` bytes for this rank) exceed its free memory."""
    host_need, ranks, available = _this_machine(staged)
    if available is None or host_need <= available or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    whose = f"the {ranks} ranks on this machine" if ranks > 1 else "this rank"
    logger.warning(
        f"Checkpoint: checkpoint.async_mode={async_mode} stages a host copy of the weights and "
        f"optimizer state at each save, {byte_size(host_need)} for {whose}, but this machine "
        f"has {byte_size(available)} available: the first save is likely to be killed for "
        "memory; use --checkpoint.async_mode disabled (or shard over more machines)"
    )


def oom_kill_count(vmstat: str = "/proc/vmstat") -> int | None:
    """How many processes the kernel's OOM killer has killed since boot (Linux >= 4.13)."""
    try:
        with open(vmstat) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def killed_by_oom_killer(count_before: int | None, vmstat: str = "/proc/vmstat") -> bool:
    """Whether the OOM killer killed something since ``count_before`` was read."""
    now = oom_kill_count(vmstat)
    return count_before is not None and now is not None and now > count_before
