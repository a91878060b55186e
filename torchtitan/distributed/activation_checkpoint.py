"""Activation checkpointing of transformer blocks: full, every-Nth-block, or op-level (SAC).

Wrapped blocks are ``CheckpointWrapper`` modules. Their ``state_dict`` keys, and the FQNs that
``torch.distributed.checkpoint.state_dict`` reports, have no ``_checkpoint_wrapped_module.``
prefix, so checkpoints are interchangeable with and without AC. (Plain ``named_parameters()``
from an ancestor module does show the prefix.)
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.tools.logging import logger

aten = torch.ops.aten


def default_op_sac_save_list() -> set:
    """Ops whose outputs op-level SAC keeps (every other ``mm``, attention, reductions)."""
    ops = {
        aten.mm.default,
        # attention: CPU flash, CUDA flash / memory-efficient / cuDNN
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        # the absolute max feeds float8 scales: cheap to keep, costly to recompute
        aten.max.default,
    }
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None and hasattr(c10d, "reduce_scatter_tensor"):
        ops.add(c10d.reduce_scatter_tensor.default)
    # Expert parallel's token all-to-alls are recomputed (communicated again), not kept:
    # keeping both per MoE layer holds 2 x tokens x top_k x dim, which for DeepSeek-V3 671B
    # (seq 4096 x 4, top 8, dim 7168, bf16) is 3.8 GB per layer: 91 -> 294 GiB of estimated
    # activations per rank at EP 32 x 256 ranks.
    return ops


def sac_ignore_profiler_ranges() -> None:
    """Let op-level SAC ignore profiler range markers (``record_function``), as torch's SAC
    already ignores ``detach``.

    An FSDP unit nested inside a checkpointed block (expert parallel's ``experts``, on their own
    mesh) runs its forward hooks again in the recompute, and there, outside FSDP's forward, it
    opens a ``FSDP::root_pre_forward`` range that the forward did not; SAC counts every op and
    stops at that extra marker ("invocation index 3 encountered during backward but not found
    in storage"). The markers carry no tensors, so caching or replaying them changes nothing.
    """
    from torch.utils import checkpoint

    profiler = torch.ops.profiler
    ignored = getattr(checkpoint, "SAC_IGNORED_OPS", None)
    if ignored is None:  # older torch names the set _ignored_ops
        ignored = checkpoint._ignored_ops
    ignored.update(
        {profiler._record_function_enter_new.default, profiler._record_function_exit._RecordFunction}
    )


def recompute_with_forward_graphs() -> None:
    """Make dynamo try a frame's compiled graphs in the order they were compiled, not most
    recently used first, so a checkpointed block's recompute runs the graphs its forward ran.

    A compiled block with a graph break (an MoE layer's data-dependent token counts) gets a
    static graph for the code after the break on its first call and a dynamic one when a later
    block brings other sizes (automatic dynamic shapes). Both accept the first block's inputs;
    by default dynamo tries the latest-used first, so the first block's recompute ran the
    dynamic graph, which saves other tensors than the static one its forward ran, and backward
    stopped with torch's CheckpointError "trying to save more tensors during recomputation"
    (DeepSeek-V3 with expert TP, inductor and full AC; pytorch/pytorch#166926). The switch is
    process-wide; the order costs a few guard checks per call on blocks with several graphs.
    """
    set_lru = getattr(torch._C._dynamo.eval_frame, "_set_lru_cache", None)
    if set_lru is not None:
        set_lru(False)


def _validate(cfg: ActivationCheckpoint) -> None:
    if cfg.mode not in ("none", "full", "selective", "memory_budget"):
        raise ValueError(
            f"activation_checkpoint.mode={cfg.mode!r} is invalid; use 'none', 'full', "
            "'selective' or 'memory_budget'"
        )
    if cfg.determinism_check not in ("default", "none"):
        raise ValueError(
            f"activation_checkpoint.determinism_check={cfg.determinism_check!r} is invalid; "
            "use 'default' or 'none'"
        )
    if cfg.mode == "selective":
        selective_every_n(cfg.selective_ac_option)


def uses_op_sac(cfg: ActivationCheckpoint) -> bool:
    """True for op-level selective checkpointing (``selective`` with option ``"op"``)."""
    return cfg.mode == "selective" and selective_every_n(cfg.selective_ac_option) is None


def selective_every_n(option: str) -> int | None:
    """``"op"`` -> None; ``"N"`` -> N (a positive int); anything else raises ValueError."""
    option = str(option).strip()
    if option == "op":
        return None
    if option.isdigit() and int(option) > 0:
        return int(option)
    raise ValueError(
        f"activation_checkpoint.selective_ac_option={option!r} is invalid; use a positive "
        "integer N (checkpoint every Nth block) or 'op' (op-level selective checkpointing)"
    )


def _op_sac_policy(
    save_list: set,
    recompute_mm_shapes: set[tuple[int, int]],
    counts: defaultdict,
    ctx,
    func,
    *args,
    **kwargs,
) -> CheckpointPolicy:
    # `counts` is fresh for every block forward (context_fn). torch >= 2.13 calls the policy
    # only in forward and replays its decisions in the recompute; older torch (2.11) calls it
    # again in the recompute with ctx.is_recompute, which must count from 0 again to repeat
    # the forward's choices (a shared counter would flip them).
    if func == aten.mm.default:
        if len(args) > 1 and tuple(args[1].shape) in recompute_mm_shapes:
            return CheckpointPolicy.PREFER_RECOMPUTE
        key = "recompute mm" if getattr(ctx, "is_recompute", False) else "mm"
        counts[key] += 1
        # keep the 1st, 3rd, ... matmul of the block, recompute the others
        save = counts[key] % 2 == 1
    else:
        save = func in save_list
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def _force_recompute_mm_shapes(
    block: nn.Module, base_fqn: str, fqn_filters: list[str], matched: set[str] | None = None
) -> set[tuple[int, int]]:
    """``(in, out)`` shapes of the ``mm`` weight operands of Linears matching ``fqn_filters``
    (the filters that matched are added to ``matched``)."""
    shapes: set[tuple[int, int]] = set()
    if not fqn_filters:
        return shapes
    for name, sub in block.named_modules():
        fqn = f"{base_fqn}.{name}" if name else base_fqn
        hits = [f for f in fqn_filters if f in fqn]
        if not hits:
            continue
        if matched is not None:
            matched.update(hits)
        if not isinstance(sub, nn.Linear):
            raise ValueError(
                "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns must name "
                f"nn.Linear modules, but {fqn} is a {type(sub).__name__}"
            )
        out_f, in_f = sub.weight.shape
        shapes.add((in_f, out_f))
    return shapes


# Ops that only reshape or alias: left out of the summary of what a block computes.
_SHAPE_OPS = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "reshape", "slice",
              "select", "split", "unsqueeze", "squeeze", "alias", "clone", "_to_copy", "unbind",
              "split_with_sizes", "view_as_real", "view_as_complex", "contiguous"}


class _OpRecorder(TorchDispatchMode):
    """Records the name of every aten op that runs under it (``aten.mm.default``); the
    recompute's own ``detach`` of each tensor it saves again is left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not aten.detach.default:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class OpCapture:
    """``activation_checkpoint.debug``: the aten ops one block ran in its forward and in its
    recompute during backward, compared and logged once per block (the first backward).

    torch's own ``debug=True`` prints its op lists only inside the error it raises when the
    recompute differs, so a run that is fine shows nothing; this shows what was captured.
    """

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn
        self.forward: list[str] | None = None
        self.reported = False

    @contextlib.contextmanager
    def capture(self, phase: str) -> Iterator[None]:
        if self.reported:
            yield
            return
        with _OpRecorder() as recorder:
            yield
        if phase == "forward":
            self.forward = recorder.ops
        else:
            self.report(recorder.ops)

    def report(self, recompute: list[str]) -> None:
        self.reported = True
        forward = self.forward or []
        counts = Counter(n for n in forward if n.split(".")[1] not in _SHAPE_OPS).most_common(4)
        top = ", ".join(f"{name.removesuffix('.default')} x{n}" for name, n in counts)
        if forward == recompute:
            logger.info(
                f"activation_checkpoint.debug: {self.fqn} recomputed the same {len(forward)} ops "
                f"as its forward ({top}, ...)"
            )
            return
        if recompute and forward[: len(recompute)] == recompute:
            logger.info(
                f"activation_checkpoint.debug: {self.fqn} recomputed the first {len(recompute)} "
                f"of the {len(forward)} ops its forward ran, identically (early stop; {top}, ...)"
            )
            return
        i = next((k for k, (a, b) in enumerate(zip(forward, recompute)) if a != b),
                 min(len(forward), len(recompute)))
        first = forward[i] if i < len(forward) else "(end)"
        again = recompute[i] if i < len(recompute) else "(end)"
        logger.warning(
            f"activation_checkpoint.debug: {self.fqn} recomputed {len(recompute)} ops but its "
            f"forward ran {len(forward)}; first difference at op {i + 1}: {first} vs {again}"
        )


def _wrap(block: nn.Module, cfg: ActivationCheckpoint, context_fn: Callable | None = None,
          fqn: str = "block"):
    kwargs = dict(
        preserve_rng_state=cfg.preserve_rng_state,
        determinism_check=cfg.determinism_check,
        early_stop=cfg.early_stop,
    )
    if cfg.debug:  # our capture replaces torch's debug=True (both are a context_fn)
        capture, inner = OpCapture(fqn), context_fn

        def context_fn():
            fwd, rec = inner() if inner is not None else (None, None)
            return _both(fwd, capture.capture("forward")), _both(rec, capture.capture("recompute"))

    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    wrapper = checkpoint_wrapper(block, **kwargs)
    # whole-block recompute needs no view of single ops: torch.compile goes inside it
    wrapper.recomputes_whole_block = context_fn is None
    return wrapper


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    """Enter ``first`` (may be None) then ``second`` when this context is entered."""
    with contextlib.ExitStack() as stack:
        for ctx in (first, second):
            if ctx is not None:
                stack.enter_context(ctx)
        yield


def apply_ac(
    model: nn.Module,
    ac_cfg: ActivationCheckpoint,
    op_sac_save_list: set | None = None,
) -> nn.Module:
    """Wrap the blocks of ``model.layers`` for activation checkpointing per ``ac_cfg``.

    ``full``: every block; ``selective`` ``"N"``: the blocks whose layer id + 1 is a multiple of
    N; ``selective`` ``"op"``: every block, saving the outputs of ``op_sac_save_list`` ops (default
    :func:`default_op_sac_save_list`) and recomputing the rest. Entries of ``model.layers``
    are replaced in place (keys unchanged). Apply after TP and before compile / FSDP.
    """
    _validate(ac_cfg)
    defaults = ActivationCheckpoint()
    if ac_cfg.mode != "memory_budget" and (
        ac_cfg.memory_budget != defaults.memory_budget or ac_cfg.visualize_memory_budget_pareto
    ):
        logger.warning(
            "activation_checkpoint.memory_budget / visualize_memory_budget_pareto only act with "
            f"activation_checkpoint.mode='memory_budget'; mode is {ac_cfg.mode!r}"
        )
    if ac_cfg.mode in ("none", "memory_budget"):  # memory_budget: see apply_memory_budget
        return model
    layers: nn.ModuleDict = model.layers
    every_n = selective_every_n(ac_cfg.selective_ac_option) if ac_cfg.mode == "selective" else 1
    save_list = default_op_sac_save_list() if op_sac_save_list is None else op_sac_save_list
    if every_n is None:
        sac_ignore_profiler_ranges()
    wrapped = 0
    matched: set[str] = set()
    for index, (layer_id, block) in enumerate(list(layers.items())):
        if block is None:
            continue
        if every_n is None:  # op-level SAC
            shapes = _force_recompute_mm_shapes(
                block,
                f"layers.{layer_id}",
                ac_cfg.per_op_sac_force_recompute_mm_shapes_by_fqns,
                matched,
            )

            def context_fn(shapes=shapes):
                policy = partial(_op_sac_policy, save_list, shapes, defaultdict(int))
                return create_selective_checkpoint_contexts(policy)

            new_block = _wrap(block, ac_cfg, context_fn, fqn=f"layers.{layer_id}")
        else:
            # global layer ids keep the choice the same when pipeline stages hold a subset
            position = int(layer_id) if str(layer_id).isdigit() else index
            if (position + 1) % every_n:
                continue
            new_block = _wrap(block, ac_cfg, fqn=f"layers.{layer_id}")
        layers[layer_id] = new_block
        wrapped += 1
    # The default names MoE's router gate, which dense models lack: only other entries count
    unmatched = [f for f in ac_cfg.per_op_sac_force_recompute_mm_shapes_by_fqns
                 if f not in matched and f not in defaults.per_op_sac_force_recompute_mm_shapes_by_fqns]
    if every_n is None and unmatched and len(layers):
        logger.warning(
            "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns: "
            f"{', '.join(map(repr, unmatched))} matches no module of the blocks here, so no "
            "matmul is recomputed for it; an entry is a part of a module's name, e.g. "
            "feed_forward.w1"
        )
    if wrapped:
        recompute_with_forward_graphs()
    elif every_n is not None and len(layers):
        ids = list(layers.keys())
        logger.warning(
            f"activation_checkpoint.selective_ac_option={every_n} checkpoints the blocks whose "
            f"layer id + 1 is a multiple of {every_n}, and none of the {len(ids)} blocks here "
            f"(layers {ids[0]}..{ids[-1]}) is one: no activation checkpointing; choose a smaller "
            "number, 'op', or --activation_checkpoint.mode none"
        )
    detail = ac_cfg.mode if ac_cfg.mode == "full" else f"selective {ac_cfg.selective_ac_option}"
    logger.info(f"Applied {detail} activation checkpointing to {wrapped} of {len(layers)} blocks")
    return model


def check_memory_budget_plots(cfg: ActivationCheckpoint) -> None:
    """``visualize_memory_budget_pareto`` draws with matplotlib: ValueError when it is missing."""
    import importlib.util

    if (
        cfg.mode == "memory_budget"
        and cfg.visualize_memory_budget_pareto
        and importlib.util.find_spec("matplotlib") is None
    ):
        raise ValueError(
            "activation_checkpoint.visualize_memory_budget_pareto draws with matplotlib, which "
            "is not installed: pip install matplotlib, or drop the flag"
        )


def apply_memory_budget(cfg: ActivationCheckpoint, dump_folder: str) -> None:
    """``memory_budget`` mode: torch.compile's min-cut partitioner keeps activations between
    the least it can (``memory_budget`` 0, full recompute) and its default, fastest choice (1),
    recomputing the ops that are cheapest for the memory they free. Compiled blocks (compile.enable,
    checked by the config) are partitioned when they first run, under this process-wide
    setting. With ``visualize_memory_budget_pareto`` each graph's runtime-vs-memory curve is
    written as SVG under ``{dump_folder}/memory_budget_pareto``."""
    if cfg.mode != "memory_budget":
        return
    check_memory_budget_plots(cfg)
    import os

    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = cfg.memory_budget
    if cfg.visualize_memory_budget_pareto:
        functorch_config.visualize_memory_budget_pareto = True
        functorch_config.memory_budget_pareto_dir = os.path.join(dump_folder, "memory_budget_pareto")
    logger.info(
        f"Activation memory budget {cfg.memory_budget}: torch.compile's partitioner chooses "
        "what the compiled blocks recompute"
    )
