"""Fault-tolerant training across replica groups with torchft.

A fault-tolerant job is ``fault_tolerance.group_size`` replica groups, each its own torchrun job
with its own mesh (FSDP / TP / PP / CP / EP inside the group). Groups are the data-parallel
replicas of one another: torchft's ``Manager`` (one per rank, coordinated by the lighthouse)
forms a quorum of the live groups before every step, and after backward every rank all-reduces
its local gradient shards with the same rank of every other group through torchft's
reconfigurable process group. A group that dies drops out of the next quorum; the others go on.
When it comes back it joins a quorum and receives the live state (model, optimizer, LR
schedule, data position, step) from a healthy peer over torchft's checkpoint transport.

* :func:`data_layout`: the data-parallel degree and rank of the whole job (groups x dp).
* :class:`FaultTolerance`: the manager and the hooks the Trainer calls.
* ``semi_sync``: LocalSGD / DiLoCo instead of per-step gradient averaging.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from torchtitan.components.fault_tolerance.layout import (
    FaultToleranceError,
    check_lighthouse,
    data_layout,
    lighthouse_address,
    split_group_outputs,
)
from torchtitan.components.fault_tolerance.live_state import LiveState, to_local
from torchtitan.config.job_config import FaultTolerance as FTConfig
from torchtitan.tools.logging import logger

__all__ = [
    "FaultTolerance",
    "FaultToleranceError",
    "data_layout",
    "lighthouse_address",
    "split_group_outputs",
]

_BUCKET_ELEMENTS = 16 * 1024 * 1024  # gradients all-reduced per torchft call


def _import_torchft() -> Any:
    # torchft's Rust side logs every quorum and commit at INFO; RUST_LOG=info brings them back.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError as err:
        raise FaultToleranceError(
            f"fault_tolerance.enable needs torchft ({err}); pip install 'torchft>=0.2'"
        ) from None
    return torchft


def _status_message(err: Exception) -> str:
    """One short line from a torchft error; its Rust (tonic) status prints as ``status:
    Cancelled, message: "Timeout expired", details: [], metadata: ...``: keep the message."""
    text = " ".join(str(err).split())
    found = re.search(r'message: "([^"]*)"', text)
    return (found.group(1) if found else text)[:200]


def _has_quantized_all_reduce() -> bool:
    """Whether torchft's quantized all-reduce is usable (torchft silently sends full precision
    when triton is missing)."""
    from torchft import manager

    return bool(getattr(manager, "IS_TRITON_AVAILABLE", False))


class FaultTolerance:
    """torchft's Manager for this rank, and the Trainer's hooks into it.

    Synchronous mode (no ``semi_sync_method``): :meth:`begin_step` forms the quorum (and heals
    this group first if it is behind), :meth:`sync_gradients_hook` averages the gradients over
    the groups in it (weighted by their token counts), :meth:`average_loss` the logged loss,
    and :meth:`should_commit` is the vote that decides whether the optimizer steps.
    Semi-synchronous mode: see :meth:`wrap_optimizer_step`.
    """

    token_weight: float = 1.0
    """This group's share of the step's tokens relative to the quorum's mean group (set by the
    gradient hook; 1.0 when every group has as many valid labels)."""

    def __init__(self, cfg: FTConfig, group_rank: int, group_world_size: int) -> None:
        torchft = _import_torchft()
        from torchft.manager import Manager

        self.cfg = cfg
        address = lighthouse_address(cfg)
        timeout = timedelta(milliseconds=cfg.process_group_timeout_ms)
        if cfg.process_group == "nccl":
            if not torch.cuda.is_available():
                raise FaultToleranceError(
                    "fault_tolerance.process_group=nccl needs CUDA; use gloo on CPU"
                )
            if cfg.should_quantize and not _has_quantized_all_reduce():
                raise FaultToleranceError(
                    "fault_tolerance.should_quantize needs triton (torchft's quantized all-reduce "
                    "is a triton kernel) and triton is not installed: pip install triton, or "
                    "drop should_quantize"
                )
            pg = torchft.ProcessGroupNCCL(timeout=timeout)
        else:
            pg = torchft.ProcessGroupGloo(timeout=timeout)
        self.semi_sync = cfg.semi_sync_method
        self.live_state: LiveState | None = None
        self._own_store = None
        if "MASTER_ADDR" not in os.environ:
            # Not started by torchrun (python -m torchtitan.train): the launcher's pre-flight
            # did not probe the lighthouse, and torchft's Manager joins the store torchrun
            # hosts at MASTER_ADDR:MASTER_PORT, which a group of one process can host itself.
            check_lighthouse(cfg)
            if group_world_size == 1:
                from torch.distributed import TCPStore

                self._own_store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
                os.environ["MASTER_ADDR"] = "localhost"
                os.environ["MASTER_PORT"] = str(self._own_store.port)
        try:
            self.manager = Manager(
                pg=pg,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=cfg.min_replica_size,
                # A quorum before the forward: a rejoining group is healed before it computes.
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=timedelta(seconds=cfg.quorum_timeout_seconds),
                connect_timeout=timedelta(seconds=min(cfg.quorum_timeout_seconds, 30)),
                rank=group_rank,
                world_size=group_world_size,
                lighthouse_addr=address,
                replica_id=f"torchtitan_ft_{cfg.replica_id}",
            )
        except Exception as err:
            reason = " ".join(str(err).split()).split(";")[0][:200]
            raise FaultToleranceError(
                f"cannot start torchft's manager with the lighthouse at {address} ({reason}); is "
                "`torchft_lighthouse` running there?"
            ) from None
        self.address = address
        self._quorum_seen = False
        logger.info(
            f"Fault tolerance: replica group {cfg.replica_id} of {cfg.group_size}, lighthouse "
            f"{address}, min_replica_size {cfg.min_replica_size}, "
            f"{self.semi_sync or 'synchronous'} training"
        )

    # --- live state -----------------------------------------------------------------------
    def register_live_state(self, live_state: LiveState) -> None:
        """What a rejoining group receives from a healthy one (and how it loads it)."""
        self.live_state = live_state
        self.manager.register_state_dict_fn("trainer", live_state.load, live_state.save)

    # --- synchronous steps ----------------------------------------------------------------
    def begin_step(self) -> bool:
        """Form this step's quorum (healing this group if it is behind); True if healed.

        The first time, a group that healed joined running peers; one that did not waits (up
        to ``startup_wait_seconds``) until every group is in its quorum, so that groups
        starting a few seconds apart do not take their first steps alone.
        """
        before = self.live_state.loads if self.live_state is not None else 0
        first = not self._quorum_seen
        self._start_quorum()
        healed = self.live_state is not None and self.live_state.loads > before
        if first and not healed:
            self._wait_for_all_groups()
            healed = self.live_state is not None and self.live_state.loads > before
        step = self.manager.current_step()
        if healed and step == 0:  # torchft's start-up sync: every group starts from one state
            logger.info(
                f"Fault tolerance: replica group {self.cfg.replica_id} took its initial state "
                "from a peer (torchft syncs the groups before the first step)"
            )
        elif healed:
            logger.warning(
                f"Fault tolerance: replica group {self.cfg.replica_id} recovered the live "
                f"state of step {step} from a peer"
            )
        return healed

    def _start_quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except Exception as err:
            raise self._quorum_error(err) from None
        self._quorum_seen = True

    def _wait_for_all_groups(self) -> None:
        want, wait = self.cfg.group_size, self.cfg.startup_wait_seconds
        if self.participants >= want or wait <= 0:
            return
        logger.info(f"Fault tolerance: waiting up to {wait}s for all {want} replica groups")
        deadline = time.monotonic() + wait
        while self.participants < want and time.monotonic() < deadline:
            time.sleep(0.5)
            self._start_quorum()
        logger.info(
            f"Fault tolerance: starting with {self.participants} of {want} replica groups"
        )

    def _quorum_error(self, err: Exception) -> Exception:
        line = _status_message(err)
        if not self._quorum_seen:
            return FaultToleranceError(
                f"no quorum from the torchft lighthouse at {self.address} within "
                f"{self.cfg.quorum_timeout_seconds}s ({line}); is `torchft_lighthouse` running "
                "there and its --min_replicas <= the groups started?"
            )
        return RuntimeError(  # the trainer adds the step and how to resume
            f"fault tolerance: no quorum from the torchft lighthouse at {self.address} within "
            f"{self.cfg.quorum_timeout_seconds}s ({line}; is the lighthouse still running?)"
        )

    @property
    def participants(self) -> int:
        """Replica groups in the current quorum."""
        return self.manager.num_participants()

    def sync_gradients_hook(
        self,
        model_parts: list[nn.Module],
        moe_layers: list[nn.Module] = (),
        step_tokens: Callable[[], float] | None = None,
    ) -> Callable[[], None]:
        """``hook()`` run after backward: average every local gradient shard over the groups
        in the quorum (bucketed, through torchft's fault-tolerant process group), and sum the
        MoE layers' routed-token counts over them, so that every group moves its
        load-balancing biases by the whole quorum's routing (as one HSDP job does). Both
        happen before the commit vote: a group lost here fails the vote, not the update.

        ``step_tokens()`` is this group's count of valid labels in the step (its gradients are
        per-token means over them). Groups with different counts (ignored labels) are weighted
        by them, so the result is the per-token mean over the whole quorum's tokens, as one HSDP
        job computes it; with equal counts the weights are exactly 1 and nothing is scaled."""
        from torch.distributed import ReduceOp

        params = [p for part in model_parts for p in part.parameters() if p.requires_grad]

        @torch.no_grad()
        def hook() -> None:
            if moe_layers:
                counts = torch.stack([layer.tokens_per_expert for layer in moe_layers])
                self.manager.allreduce(counts, reduce_op=ReduceOp.SUM).wait()
                for layer, summed in zip(moe_layers, counts):
                    layer.tokens_per_expert.copy_(summed)
            self.token_weight = 1.0 if step_tokens is None else self._token_weight(step_tokens())
            grads = [to_local(p.grad) for p in params if p.grad is not None]
            for bucket in _buckets(grads):
                flat = torch.cat([g.reshape(-1) for g in bucket])
                if self.token_weight != 1.0:
                    flat.mul_(self.token_weight)
                self.manager.allreduce(flat).wait()
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()

        return hook

    def _token_weight(self, tokens: float) -> float:
        mean = torch.tensor([tokens], dtype=torch.float64)
        self.manager.allreduce(mean).wait()  # over the groups in the quorum
        return 1.0 if mean[0] <= 0 or tokens == mean[0] else tokens / float(mean[0])

    def average(self, value: float) -> float:
        """Mean of a per-group scalar over the groups in the quorum."""
        t = torch.tensor([value], dtype=torch.float64)
        self.manager.allreduce(t).wait()
        return float(t[0])

    def average_loss(self, loss: float) -> float:
        """The quorum's per-token mean loss from this group's: weighted by the groups' token
        counts, as the gradients are (a plain mean when the counts are equal)."""
        return self.average(loss * self.token_weight)

    def figures(self, model_parts: list[nn.Module]) -> dict[str, float]:
        """Logged with each step: the groups in the quorum, and a checksum of the weights and
        MoE routing biases (float64 sum of every rank's local shards over this group) that must
        be equal across
        groups: replicas that drifted apart show it at once. With DiLoCo fragments, one
        checksum per fragment too (a fragment is equal across groups right after its sync)."""
        import torch.distributed as dist

        from torchtitan.components.fault_tolerance.fragments import routing_biases

        groups = [[
            *(p for part in model_parts for p in part.parameters()),
            *(b for part in model_parts for _, b in routing_biases(part)),
        ]]
        fragments = self._semi.fragments if self.semi_sync else []
        if len(fragments) > 1:
            groups += [list(fragment.parameters()) for fragment in fragments]
        sums = torch.zeros(len(groups), dtype=torch.float64)
        with torch.no_grad():
            for i, params in enumerate(groups):
                for p in params:
                    sums[i] += to_local(p).detach().double().sum().cpu()
        if dist.is_initialized():
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            t = sums.to(device)
            dist.all_reduce(t)
            sums = t.cpu()
        figures = {"ft/param_checksum": float(sums[0])}
        for f in range(1, len(groups)):
            figures[f"ft/fragment_{f - 1}_checksum"] = float(sums[f])
        if not self.semi_sync:
            figures["ft/replica_groups"] = float(self.participants)
        return figures

    def should_commit(self) -> bool:
        """Every group's vote: False when a peer failed during the step (or too few groups
        took part); the optimizer must then not step."""
        return self.manager.should_commit()

    # --- checkpoints ----------------------------------------------------------------------
    def writes_checkpoints(self) -> bool:
        """The one group that writes the shared checkpoint: rank 0 of the current quorum
        (before any quorum, replica group 0)."""
        rank = self.manager.participating_rank()  # None before any quorum
        if rank is None:
            return self.cfg.replica_id == 0 and not self._quorum_seen
        return rank == 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: torch.tensor(v) for k, v in self.manager.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict({k: int(v) for k, v in state.items()})

    # --- semi-synchronous -----------------------------------------------------------------
    def wrap_optimizer_step(
        self, model_parts: list[nn.Module], step_fn: Callable[[], Any], all_units: list[str],
        n_layers: int, after_sync: Callable[[], None] | None = None,
        tied_units: tuple[str, ...] = (),
    ) -> Callable[[], Any]:
        """LocalSGD / DiLoCo: ``step_fn`` (the optimizer step) wrapped so that every
        ``sync_steps`` steps the groups synchronise through torchft. ``all_units``: the whole
        model's units in order (``fragments.model_units``), from which DiLoCo's fragments are
        cut; ``tied_units`` must land in one fragment. ``after_sync`` runs after a step whose
        sync changed the weights."""
        from torchtitan.components.fault_tolerance.fragments import fragment_units
        from torchtitan.components.fault_tolerance.semi_sync import SemiSync

        units = fragment_units(
            self.cfg.num_fragments, self.cfg.module_fqns_per_model_fragment, all_units, n_layers,
            tied_units,
        )
        self._semi = SemiSync(self.manager, self.cfg, model_parts, step_fn, units, after_sync)
        return self._semi.step

    def semi_sync_state_dict(self) -> dict[str, Any]:
        """LocalSGD / DiLoCo state for checkpoints (see ``semi_sync``)."""
        return self._semi.state_dict()

    def load_semi_sync_state_dict(self, state: dict[str, Any]) -> None:
        self._semi.load_state_dict(state)

    def after_checkpoint_load(self) -> None:
        """Called once the checkpoint (if any) is loaded, before the first step."""
        if self.semi_sync:
            self._semi.after_checkpoint_load()

    def shutdown(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        except Exception as err:  # shutting down after a failure: say it, do not mask it
            logger.warning(f"fault tolerance: manager shutdown: {err}")


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive groups of same-dtype tensors of at most ``_BUCKET_ELEMENTS`` elements."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        if out and out[-1][0].dtype == t.dtype and size + t.numel() <= _BUCKET_ELEMENTS:
            out[-1].append(t)
            size += t.numel()
        else:
            out.append([t])
            size = t.numel()
    return out
