"""Tensor parallelism (+ sequence parallel, loss parallel, async TP) for decoder models.

Layout between blocks is sequence-sharded (``Shard(1)`` of ``[B, S, D]``): norms run
sequence-parallel, attention/FFN inputs are all-gathered to ``Replicate`` and their column-wise
projections shard heads / hidden units, and the row-wise output projections reduce-scatter back
to ``Shard(1)``. With loss parallel the logits stay vocab-sharded (``Shard(-1)`` DTensor) and the
loss must be computed inside ``torch.distributed.tensor.parallel.loss_parallel()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from torchtitan.distributed.parallel_dims import ParallelismError
from torchtitan.distributed.utils import embeddings_tied
from torchtitan.tools.logging import logger


def all_reduce_sum(t: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of ``t`` over the process group ``group_name`` (functional collective: no DTensor,
    so the size of ``t`` may differ between groups of other mesh coordinates)."""
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_reduce(t, "sum", group_name))


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (a functional all-reduce,
    not DTensor: under ``COMM_MODE=local_tensor`` a tensor whose size differs between ranks,
    such as expert-parallel routed tokens, cannot sit in a DTensor spec)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_sum(grad.contiguous(), ctx.group_name), None


def sum_gradient_over_tp(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; backward all-reduces ``x``'s gradient over the TP ranks (Megatron's
    "copy to the tensor-parallel region"), for a plain tensor every TP rank feeds into its own
    shard of the work, so each rank's gradient is only that shard's share."""
    return _CopyToTensorParallel.apply(x, tp_mesh.get_group().group_name)


def non_block_tp_plan(loss_parallel: bool = True, fused_loss: bool = False
                      ) -> dict[str, ParallelStyle]:
    """Plan for ``tok_embeddings`` (vocab-parallel), ``norm`` (SP) and ``output``.
    ``fused_loss``: the output head computes the loss itself (``chunked_loss``), so only its
    weight is sharded over the vocabulary and it takes the norm's sequence shards as they are."""
    output: ParallelStyle = ColwiseParallel(
        input_layouts=Shard(1),
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    if fused_loss:
        output = WithShardedParameters(None, ("weight",), dim=0)
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": output,
    }


class _Styles:
    """The TP styles for the linears of ``block``: torchao's float8 styles for its
    ``Float8Linear`` layers when ``float8_tensorwise`` (inputs cast to float8 before the
    all-gather), the plain ones otherwise."""

    def __init__(self, block: nn.Module | None, float8_tensorwise: bool):
        self.float8 = _float8_linears(block) if float8_tensorwise and block is not None else set()

    def _f8(self):
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

    def col(self, name: str) -> ParallelStyle:
        return (self._f8()[0] if name in self.float8 else ColwiseParallel)()

    def row(self, name: str) -> ParallelStyle:
        """Row-wise, the output reduce-scattered back to sequence shards."""
        return (self._f8()[1] if name in self.float8 else RowwiseParallel)(output_layouts=Shard(1))

    def gather_input(self, *cols: str, **kwargs) -> ParallelStyle:
        """All-gather a sublayer's sequence-sharded input; in float8 only when all of its
        column-wise linears ``cols`` are float8."""
        float8 = bool(self.float8) and all(c in self.float8 for c in cols)
        return (self._f8()[2] if float8 else PrepareModuleInput)(**kwargs)


def feed_forward_tp_plan(
    block: nn.Module | None = None, float8_tensorwise: bool = False
) -> dict[str, ParallelStyle]:
    """Plan for a block's dense SwiGLU ``feed_forward`` (``w1/w3`` column-wise, ``w2``
    row-wise); empty for an MoE block (expert parallel's TP step handles ``moe``)."""
    if block is not None and getattr(block, "feed_forward", None) is None:
        return {}
    s = _Styles(block, float8_tensorwise)
    return {
        "feed_forward": s.gather_input(
            "feed_forward.w1", "feed_forward.w3",
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
        ),
        "feed_forward.w1": s.col("feed_forward.w1"),
        "feed_forward.w2": s.row("feed_forward.w2"),
        "feed_forward.w3": s.col("feed_forward.w3"),
    }


def block_tp_plan(
    block: nn.Module | None = None, float8_tensorwise: bool = False
) -> dict[str, ParallelStyle]:
    """Plan for one decoder block with grouped-query attention (``wq/wk/wv`` column-wise,
    ``wo`` row-wise), sequence-parallel norms and a dense SwiGLU FFN (none for an MoE block).

    ``freqs_cis`` (the attention's second input) is given as ``None``: it stays a plain tensor,
    identical on every rank. With ``float8_tensorwise`` the ``Float8Linear`` layers of ``block``
    get torchao's float8 styles (inputs cast to float8 before the all-gather); a module's
    input is prepared in float8 only when all of its column-wise linears are float8.
    """
    s = _Styles(block, float8_tensorwise)
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": s.gather_input(
            "attention.wq", "attention.wk", "attention.wv",
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
        ),
        "attention.wq": s.col("attention.wq"),
        "attention.wk": s.col("attention.wk"),
        "attention.wv": s.col("attention.wv"),
        "attention.wo": s.row("attention.wo"),
        "ffn_norm": SequenceParallel(),
    }
    return plan | feed_forward_tp_plan(block, float8_tensorwise)


def _float8_linears(module: nn.Module) -> set[str]:
    """FQNs (within ``module``) of its torchao ``Float8Linear`` layers."""
    names = {n for n, m in module.named_modules() if type(m).__name__ == "Float8Linear"}
    if names:
        from torchao.float8.float8_linear import Float8Linear

        names = {n for n in names if isinstance(module.get_submodule(n), Float8Linear)}
    return names


@dataclass(frozen=True)
class TensorParallelPlan:
    """What a decoder family declares for tensor parallelism; ``apply_tp_plan`` applies it."""

    block_plan: Callable[[nn.Module, bool], dict[str, ParallelStyle]] = block_tp_plan
    """``(block, float8_tensorwise) -> {fqn: style}`` for one block."""
    float8_tensorwise: bool = False
    """``block_plan`` gives float8 layers torchao's float8 styles (all-gathers in float8 with
    the float8 converter's tensorwise scaling); otherwise they all-gather in high precision."""
    check: Callable[[nn.Module, int], None] | None = None
    """``check(model, tp)``: ParallelismError (one line) for shapes the plan cannot split."""
    name: str = ""
    """Shown in the log line (``Applied tensor parallel to NAME``)."""


DECODER_TP = TensorParallelPlan(float8_tensorwise=True)
"""The plan of Llama-style blocks (grouped-query attention, dense SwiGLU or MoE)."""


def apply_tp_plan(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: TensorParallelPlan = DECODER_TP,
    loss_parallel: bool = True,
    float8_tensorwise: bool = False,
) -> nn.Module:
    """Apply the TP/SP plans to ``model`` (works on a meta-device model).

    Parts that are missing or None (pipeline stages) are skipped. Tied input/output
    embeddings stay tied: both plans shard the shared weight ``Shard(0)`` over the vocabulary.
    ``float8_tensorwise`` (only where ``plan.float8_tensorwise``) all-gathers the blocks'
    activations in float8. MoE layers are left to expert parallel's TP step.
    """
    float8_tensorwise = float8_tensorwise and plan.float8_tensorwise
    if float8_tensorwise and _backend(tp_mesh) == "gloo":
        logger.info(
            "float8 TP: gloo has no float8 dtypes, so activations are all-gathered in high "
            "precision and cast by each Float8Linear (the same scales and float8 values)"
        )
        float8_tensorwise = False
    apply_non_block_tp(model, tp_mesh, loss_parallel)
    layers = getattr(model, "layers", None)
    n_moe = 0
    for block in layers.values() if isinstance(layers, nn.ModuleDict) else layers or []:
        if block is not None:
            parallelize_module(block, tp_mesh, plan.block_plan(block, float8_tensorwise))
            n_moe += getattr(block, "moe", None) is not None
    logger.info(
        f"Applied tensor parallel{' to ' + plan.name if plan.name else ''} "
        f"(degree {tp_mesh.size()}, sequence parallel, "
        f"loss parallel {'on' if loss_parallel else 'off'}"
        f"{', float8 all-gather' if float8_tensorwise else ''}"
        + (f"; {n_moe} MoE layer(s): see expert parallel)" if n_moe else ")")
    )
    return model


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    loss_parallel: bool = True,
    enable_float8_tensorwise_tp: bool = False,
) -> nn.Module:
    """:func:`apply_tp_plan` with the Llama-style plan (:data:`DECODER_TP`)."""
    return apply_tp_plan(model, tp_mesh, DECODER_TP, loss_parallel, enable_float8_tensorwise_tp)


def check_feed_forward_tp(tp: int, width: int, described: str, has_dense: bool = True) -> None:
    """ParallelismError (one line) when the model has dense FFN blocks (``has_dense``, read
    from its args, so every pipeline stage agrees) and ``tp`` does not divide their ``width``
    (``w1/w3`` are split column-wise); ``described`` names the width (e.g. ``"dense FFN
    inter_dim"``)."""
    if has_dense and width % tp:
        raise ParallelismError(
            f"parallelism.tensor_parallel_degree={tp} must divide the model's {described}="
            f"{width} (w1/w3 are split column-wise)"
        )


class SumGradientOverTP(ParallelStyle):
    """Identity forward; backward all-reduces the input's gradient over the TP ranks (Megatron's
    "copy to the tensor-parallel region"), for a plain tensor that every rank feeds into its own
    heads: each rank's gradient is then only its heads' share."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre_hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]):
            return (sum_gradient_over_tp(inputs[0], device_mesh), *inputs[1:])

        module.register_forward_pre_hook(pre_hook)
        return module


class WithShardedParameters(ParallelStyle):
    """``style`` on a module plus its own parameters ``names`` sharded ``Shard(dim)`` over the
    TP ranks: per-head parameters (attention sinks) follow the heads that the column-wise
    projections give each rank (the module uses their local parts)."""

    def __init__(self, style: ParallelStyle | None, names: tuple[str, ...], dim: int = 0):
        super().__init__()
        self.style, self.names, self.dim = style, names, dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import distribute_tensor

        if self.style is not None:
            module = self.style._apply(module, device_mesh)
        for name in self.names:
            param = getattr(module, name, None)
            if param is None:
                continue
            sharded = distribute_tensor(param.data, device_mesh, [Shard(self.dim)])
            setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        return module


def apply_non_block_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """:func:`non_block_tp_plan` on the parts ``model`` has (a pipeline stage may lack some);
    tied input/output embeddings stay tied, and the embedding's output is waited for."""
    tied = embeddings_tied(model)
    fused_loss = getattr(getattr(model, "output", None), "fuse_loss", False)
    plan = {
        name: style
        for name, style in non_block_tp_plan(loss_parallel, fused_loss).items()
        if getattr(model, name, None) is not None
    }
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if tied:
        # Each style wraps the weight in a new Parameter; point output back at the embedding's.
        model.output.weight = model.tok_embeddings.weight
    if getattr(model, "tok_embeddings", None) is not None:
        model.tok_embeddings.register_forward_hook(_wait_for_async_output)


def _wait_for_async_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """The embedding's sequence-parallel output is its reduce-scatter, still in flight (an
    ``AsyncCollectiveTensor``); the first block waits for it anyway. Waiting here, in eager
    mode, keeps it out of compiled blocks: a compiled block fed one fails in backward (a plain
    gradient where DTensor's redistribute expects a DTensor; torch 2.13), and waiting inside
    the compiled graph would drop the embedding's gradient."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(output, AsyncCollectiveTensor):
        return torch.ops._c10d_functional.wait_tensor(output)
    return output


def _backend(mesh: DeviceMesh) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(mesh.get_group()))
    except (RuntimeError, ValueError):
        return ""


def check_async_tp(compile_model: bool, device_type: str) -> None:
    """Refuse async TP where it cannot run: it needs CUDA symmetric memory and compiled blocks.

    A real run refuses rather than silently training without it (compile itself runs on CPU,
    so only async TP is device-bound); the COMM_MODE dry runs switch both off instead, since
    they check layouts and shapes, not kernels (``CommMode.prepare``).
    """
    if device_type != "cuda":
        raise ValueError(
            "parallelism.enable_async_tensor_parallel needs CUDA GPUs (symmetric memory); "
            f"this run is on {device_type}: turn it off (--parallelism.no_enable_async_tensor_"
            "parallel), or dry-run the config with COMM_MODE=fake_backend"
        )
    if not compile_model:
        raise ValueError(
            "parallelism.enable_async_tensor_parallel needs torch.compile: set compile.enable "
            "and include 'model' in compile.components"
        )


def maybe_enable_async_tp(
    enabled: bool, compile_model: bool, tp_mesh: DeviceMesh | None, device_type: str
) -> bool:
    """Turn on async TP (inductor micro-pipelining + symmetric memory) when asked.

    Raises ValueError unless on CUDA with a compiled model; without TP (``tp_mesh`` None) it
    only warns. Returns whether async TP was enabled.
    """
    if not enabled:
        return False
    check_async_tp(compile_model, device_type)
    if tp_mesh is None or tp_mesh.size() < 2:
        logger.warning(
            "parallelism.enable_async_tensor_parallel has no effect without tensor parallelism "
            "(parallelism.tensor_parallel_degree=1)"
        )
        return False
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    logger.info("Async tensor parallel is on (micro-pipelined TP in compiled blocks)")
    return True


@contextlib.contextmanager
def maybe_loss_parallel(enabled: bool) -> Iterator[None]:
    """``loss_parallel()`` when ``enabled`` (TP with vocab-sharded logits), else a no-op."""
    if enabled:
        with loss_parallel():
            yield
    else:
        yield
