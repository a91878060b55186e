"""Expert parallelism: each rank of the ``ep`` mesh holds ``num_experts / ep`` experts.

The ``ep`` ranks are borrowed from the ranks that hold different MoE tokens within one replica:
``dp_shard x cp``, and the ``tp / etp`` token groups of the TP ranks
(:func:`apply_moe_tp_boundary`; every TP rank at ``expert_tensor_parallel_degree`` 1). Those
dims are flattened and
unflattened into ``(dp_shard_mod_ep, ep)``, ep innermost (``ParallelDims.build_mesh``). Dense
parameters stay FSDP-sharded over ``dp_shard_cp`` (HSDP with ``dp_replicate``); expert weights
are ``Shard(0)`` (the expert dim) over ``ep`` and FSDP-sharded over the remaining
``dp_shard_mod_ep`` ranks (HSDP over ``(dp_replicate, dp_shard_mod_ep)``).

Token dispatch (:class:`ExpertDispatch`, forward hooks on each MoE layer's ``experts``): the
router runs on every rank for its own tokens; tokens sorted by expert are sent with an
all-to-all to the ranks that own their experts (the per-expert counts are exchanged first, so
splits may be uneven or zero), regrouped by local expert, run through the local experts with
grouped GEMM, and sent back with the reverse all-to-all. Both all-to-alls carry autograd.

Gradients (:func:`moe_grad_hooks`, after backward): an expert's gradient already sums the
tokens of the whole ``ep`` group (through the all-to-all's backward); FSDP/HSDP over
``(dp_replicate,) dp_shard_mod_ep`` averages over the rest of the ranks with other tokens, and
dividing by ``ep / (tp / etp)`` makes it the global mean, as for dense parameters. Parameters
the token groups hold alike while routing their own tokens (router, shared experts, experts
without EP) get their gradients summed over ``tp_tokens``. (FSDP's
own ``gradient_divide_factor`` is not used for this: in torch 2.13 a one-rank FSDP mesh
applies it twice.)

Expert tensor parallel (``expert_tensor_parallel_degree`` etp > 1, :class:`ExpertTensorParallel`):
the TP ranks form ``tp / etp`` groups of ``etp`` consecutive ranks (``tp_tokens`` x ``etp``);
MoE layers see the group's gathered sequence shards, the experts' hidden dims are split over
``etp`` (weights are DTensors on the ``(ep, etp)`` mesh ``ep_etp``), the shared experts' too,
and the partial expert outputs are summed over ``etp`` inside the dispatch / combine pair. The
groups split the tokens like the TP ranks at etp 1 (etp = tp: one group).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import all_reduce_sum, sum_gradient_over_tp
from torchtitan.tools.logging import logger


def _exclusive_cumsum(t: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(t, dim=0) - t


class ExpertDispatch:
    """All-to-all token dispatch around one ``GroupedExperts`` module (forward hooks)."""

    def __init__(self, ep_mesh: DeviceMesh):
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.rank = ep_mesh.get_local_rank()
        self._state: tuple[torch.Tensor, list[int], list[int]] | None = None
        self.tokens_sent = 0
        """Tokens this rank sent to other ranks' experts (forward dispatch), for benchmarks."""

    def dispatch(self, module: nn.Module, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward pre-hook: ``(tokens sorted by global expert, counts [E])`` -> ``(tokens of
        this rank's experts sorted by local expert, counts [E / ep])``."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        tokens, counts = args
        n_local = counts.numel() // self.ep
        with torch.no_grad():
            received_counts = torch.empty_like(counts)
            dist.all_to_all_single(received_counts, counts.contiguous(), group=self.group)
        received = received_counts.view(self.ep, n_local)  # [source rank, local expert]
        # one device-to-host copy (a GPU sync) for both split lists
        splits = torch.cat([counts.view(self.ep, n_local).sum(dim=1), received.sum(dim=1)])
        splits = splits.tolist()
        send_splits, recv_splits = splits[: self.ep], splits[self.ep :]
        if isinstance(self.rank, int):  # a per-rank value under COMM_MODE=local_tensor
            self.tokens_sent += sum(send_splits) - send_splits[self.rank]
        routed = all_to_all_single_autograd(tokens, recv_splits, send_splits, self.group)
        # Arrived grouped by source rank, each sorted by local expert: regroup by local expert.
        starts = _exclusive_cumsum(received.flatten()).view(self.ep, n_local)
        sizes_by_expert = received.t().flatten()
        starts_by_expert = starts.t().flatten()
        total = sum(recv_splits)
        base = torch.repeat_interleave(starts_by_expert, sizes_by_expert, output_size=total)
        within = torch.arange(total, device=counts.device) - torch.repeat_interleave(
            _exclusive_cumsum(sizes_by_expert), sizes_by_expert, output_size=total
        )
        order = base + within
        self._state = (order, send_splits, recv_splits)
        return routed[order], received.sum(dim=0)

    def combine(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        """Forward hook: undo the regrouping and send each output back to its token's rank."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        order, send_splits, recv_splits = self._state
        self._state = None
        restored = torch.empty_like(output).index_copy(0, order, output)
        return all_to_all_single_autograd(restored, send_splits, recv_splits, self.group)


class BalancedExpertDispatch(ExpertDispatch):
    """Token dispatch that assumes balanced routing: each rank sends ``1/ep`` of its routed
    tokens to every ep peer and each local expert gets an equal share of what arrives.

    For process groups whose collectives carry no data (``COMM_MODE=fake_backend``, the memory
    estimator): the all-to-all sizes come from tensor shapes, not from the per-expert counts,
    so nothing needs real values. Shapes, communication volume and memory are those of a
    perfectly balanced router; outputs are meaningless (as everything else in such a run).
    """

    def dispatch(self, module: nn.Module, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        tokens, counts = args
        n_local = counts.numel() // self.ep
        n = tokens.shape[0]
        send_splits = [n // self.ep + (i < n % self.ep) for i in range(self.ep)]
        recv_splits = [send_splits[self.rank]] * self.ep  # every peer routes like this rank
        self.tokens_sent += n - send_splits[self.rank]
        routed = all_to_all_single_autograd(tokens, recv_splits, send_splits, self.group)
        total = sum(recv_splits)
        local_counts = counts.new_full((n_local,), total // n_local)
        local_counts[: total % n_local] += 1
        self._state = (None, send_splits, recv_splits)
        return routed, local_counts

    def combine(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        _, send_splits, recv_splits = self._state
        self._state = None
        return all_to_all_single_autograd(output, send_splits, recv_splits, self.group)


_dispatch_cls: type[ExpertDispatch] = ExpertDispatch


@contextlib.contextmanager
def expert_dispatch_policy(cls: type[ExpertDispatch]) -> Iterator[None]:
    """Within this context :func:`apply_expert_parallel` installs ``cls`` as the token
    dispatch (a comm mode whose collectives are fake supplies :class:`BalancedExpertDispatch`)."""
    global _dispatch_cls
    previous, _dispatch_cls = _dispatch_cls, cls
    try:
        yield
    finally:
        _dispatch_cls = previous


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Forward sums the partial outputs of the TP ranks; backward passes the (equal on every
    rank) gradient through."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        return all_reduce_sum(x.contiguous(), group_name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ExpertTensorParallel:
    """Experts' hidden dimension split over the ``etp`` ranks of a TP group (forward hooks on
    ``experts``).

    MoE layers see the group's gathered sequence shards and route them alike on its ranks;
    each rank runs its ``w1``/``w3`` columns and ``w2`` rows on the routed tokens and the
    partial outputs are summed over the group (Megatron's copy / reduce pair around an MLP)."""

    def __init__(self, etp_mesh: DeviceMesh):
        self.etp_mesh = etp_mesh
        self.group_name = etp_mesh.get_group().group_name

    def enter(self, module: nn.Module, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, counts = args
        return sum_gradient_over_tp(tokens, self.etp_mesh), counts

    def exit(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        # the down-projection bias (if any) is added once, to the sum (GroupedExperts leaves
        # it out while output_is_partial)
        return module.add_down_bias(_ReduceFromTensorParallel.apply(output, self.group_name),
                                    args[1])


def apply_expert_parallel(model: nn.Module, parallel_dims: ParallelDims) -> int:
    """Parallelize every MoE layer's experts: the expert dim over ``ep`` (all-to-all token
    dispatch) and, with expert tensor parallel, the hidden dim over ``tp`` (shared experts
    too, column / row-wise). Under TP, :func:`apply_moe_tp_boundary` comes first.

    Works on a meta-device model; returns the number of MoE layers.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from torchtitan.models.common.moe import moe_layers

    layers = moe_layers([model])
    if not layers:
        return 0
    ep_mesh = parallel_dims.get_mesh("ep")
    etp_mesh = parallel_dims.get_mesh("etp")  # None unless experts are split (etp > 1)
    mesh = parallel_dims.get_mesh("ep_etp") if etp_mesh is not None else ep_mesh
    sharded_layers = layers if mesh is not None else []  # TP alone leaves the experts whole
    for layer in sharded_layers:
        check_expert_shapes(layer, ep_mesh.size() if ep_mesh else 1,
                            etp_mesh.size() if etp_mesh else 1)
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            # expert TP splits the hidden dim (w1/w3 column-, w2 row-parallel per expert; the
            # biases of w1/w3 with them, w2's bias whole); ep the experts (biases included)
            hidden = experts.hidden_dims[name]
            placements = [Shard(0)] if ep_mesh is not None else []
            if etp_mesh is not None:
                placements.append(Replicate() if hidden is None else Shard(hidden))
            sharded = distribute_tensor(param.data, mesh, placements)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        # pre-hooks run in registration order (dispatch, then TP), forward hooks too (TP
        # sum, then combine): the TP region sits inside the dispatch / combine pair
        if ep_mesh is not None:
            dispatch = _dispatch_cls(ep_mesh)
            experts.ep_dispatch = dispatch
            experts.register_forward_pre_hook(dispatch.dispatch)
        if etp_mesh is not None:
            experts.output_is_partial = True
            expert_tp = ExpertTensorParallel(etp_mesh)
            experts.register_forward_pre_hook(expert_tp.enter)
            experts.register_forward_hook(expert_tp.exit)
            if layer.shared_experts is not None:
                _shard_shared_experts(layer.shared_experts, etp_mesh)
        if ep_mesh is not None:
            experts.register_forward_hook(dispatch.combine)
    per_rank = layers[0].args.num_experts // (ep_mesh.size() if ep_mesh else 1)
    what = []
    if parallel_dims.tp_splits_moe_tokens:
        groups = parallel_dims.moe_token_groups
        what.append(f"tp={parallel_dims.tp}: " + ("each TP rank routes its own tokens"
                    if groups == parallel_dims.tp else f"{groups} TP groups route their own tokens"))
    if ep_mesh is not None:
        what.append(
            f"ep={ep_mesh.size()}: {per_rank} experts per rank, all-to-all dispatch"
            f"{', balanced routing assumed' if _dispatch_cls is not ExpertDispatch else ''}"
        )
    if etp_mesh is not None:
        what.append(f"etp={etp_mesh.size()}: expert hidden dims split over "
                    + ("tp" if etp_mesh.size() == parallel_dims.tp else "each TP group"))
    if what:
        verb = "Applied expert parallel to" if mesh is not None else "Tensor parallel in"
        logger.info(f"{verb} {len(layers)} MoE layer(s) ({'; '.join(what)})")
    return len(layers)


def apply_moe_tp_boundary(model: nn.Module, parallel_dims: ParallelDims) -> None:
    """Under TP, how every MoE layer meets the sequence-parallel residual stream (``Shard(1)``
    over tp between blocks): the layer takes this rank's sequence shard as a plain tensor.
    Each TP rank routes and computes its own shard (``expert_tensor_parallel_degree`` 1: no
    communication at the boundary, the TP ranks act as data-parallel ranks for the layer and
    :func:`moe_grad_hooks` sums their router / expert gradients); with expert TP the ``etp``
    ranks that split each expert first gather their shards (consecutive ones: etp is the inner
    part of tp), route them alike, run their slices of every expert and keep their own shards
    of the summed output."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleInputOutput,
        parallelize_module,
    )

    from torchtitan.models.common.moe import moe_layers

    local_shard = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
    )
    gathered = PrepareModuleInputOutput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(Shard(1),),
        use_local_output=True,  # the residual stream between blocks is local shards
    )
    etp_mesh = parallel_dims.get_mesh("etp")
    for layer in moe_layers([model]):
        parallelize_module(layer, parallel_dims.get_mesh("tp"), local_shard)
        if etp_mesh is not None:  # pre-hooks run in registration order
            parallelize_module(layer, etp_mesh, gathered)


def check_expert_shapes(layer: nn.Module, ep: int, etp: int) -> None:
    """ValueError (one line) when ``ep`` does not divide the experts or ``etp`` their hidden
    dims (routed and shared)."""
    n_experts = layer.args.num_experts
    if n_experts % ep:
        raise ValueError(
            f"parallelism.expert_parallel_degree={ep} must divide the model's "
            f"num_experts={n_experts}"
        )
    hidden = {"expert": layer.experts.w1.shape[1]}
    if layer.shared_experts is not None:
        hidden["shared expert"] = layer.shared_experts.w1.weight.shape[0]
    for what, size in hidden.items():
        if size % etp:
            raise ValueError(
                f"parallelism.expert_tensor_parallel_degree={etp} must divide the model's "
                f"{what} hidden dim {size}"
            )


def _shard_shared_experts(shared: nn.Module, etp_mesh: DeviceMesh) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    # the MoE input is the plain, TP-gathered sequence: column-wise w1/w3 take it as
    # Replicate, row-wise w2 sums back to a plain replicated output
    parallelize_module(shared, etp_mesh, {
        "w1": ColwiseParallel(),
        "w3": ColwiseParallel(),
        "w2": RowwiseParallel(output_layouts=Replicate()),
    })


def expert_fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The ``experts`` modules of every MoE layer (their own FSDP units under EP)."""
    from torchtitan.models.common.moe import moe_layers

    return [layer.experts for layer in moe_layers([model])]


class _SumOverSequenceShards(torch.autograd.Function):
    """Forward: sum a per-sequence statistic over the ranks that hold the sequences' other
    positions. Backward: those ranks computed the same loss term from the sum, so each passes
    the (equal) gradient to its own part, times ``grad_scale``: the router gradients are later
    averaged over the cp ranks (FSDP) and summed over the tp ranks (:func:`moe_grad_hooks`), so
    the scale is cp and the result is the one-device gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_names: tuple[str, ...], grad_scale: float):
        ctx.grad_scale = grad_scale
        for name in group_names:
            x = all_reduce_sum(x.contiguous(), name)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.grad_scale, None, None


def apply_moe_sequence_sum(model: nn.Module, parallel_dims: ParallelDims) -> None:
    """Give every MoE layer the ``sequence_sum`` its sequence-level auxiliary loss needs when a
    rank holds only some positions of each sequence: context parallel, and TP ranks that split
    the MoE tokens (``expert_tensor_parallel_degree`` 1)."""
    from torchtitan.models.common.moe import moe_layers

    meshes = []
    if parallel_dims.cp_enabled:
        meshes.append(parallel_dims.get_mesh("cp"))
    if parallel_dims.tp_splits_moe_tokens:
        meshes.append(parallel_dims.get_mesh("tp_tokens"))
    if not meshes:
        return
    names = tuple(mesh.get_group().group_name for mesh in meshes)

    def sequence_sum(x: torch.Tensor) -> torch.Tensor:
        return _SumOverSequenceShards.apply(x, names, float(parallel_dims.cp))

    for layer in moe_layers([model]):
        layer.sequence_sum = sequence_sum


def moe_grad_hooks(model_parts: list[nn.Module], parallel_dims: ParallelDims):
    """Hooks to run after backward (before clipping) that finish the MoE layers' gradients
    where FSDP / DDP do not:

    * TP ranks that split the MoE tokens (``expert_tensor_parallel_degree`` < tp) each hold
      the gradient of their token group for the parameters that are not spread over the
      groups (router, shared experts, and the experts unless ep shards them): summed over
      ``tp_tokens``;
    * expert-parallel experts: the all-to-all summed the ep group's tokens and FSDP averaged
      over ``dp_shard_mod_ep``; dividing by ``ep / (tp / etp)`` (the ep ranks that are not
      TP token groups) makes it the global mean, as for dense parameters.
    """
    from torchtitan.models.common.moe import moe_layers

    hooks = []
    layers = moe_layers(model_parts)
    if not layers:
        return hooks
    experts = [p for layer in layers for p in layer.experts.parameters()]
    split = parallel_dims.tp_splits_moe_tokens
    if split:
        whole = [p for layer in layers for m in (layer.router, layer.shared_experts)
                 if m is not None for p in m.parameters()]
        whole += [] if parallel_dims.ep_enabled else experts
        hooks.append(_grad_sum_hook(whole, parallel_dims.get_mesh("tp_tokens")))
    if parallel_dims.ep_enabled:
        hooks.append(_grad_div_hook(experts, parallel_dims.ep // parallel_dims.moe_token_groups))
    return hooks


def _local_grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]


def _grad_sum_hook(params: list[nn.Parameter], mesh: DeviceMesh):
    @torch.no_grad()
    def hook() -> None:
        grads = _local_grads(params)
        if grads:  # one all-reduce for all of them
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat, group=mesh.get_group())
            chunks = flat.split([g.numel() for g in grads])
            torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(chunks, grads)])
    return hook


def _grad_div_hook(params: list[nn.Parameter], factor: int):
    @torch.no_grad()
    def hook() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads and factor != 1:
            torch._foreach_div_(grads, float(factor))
    return hook
