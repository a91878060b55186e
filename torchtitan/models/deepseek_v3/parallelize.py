"""Apply TP -> AC -> compile -> FSDP/HSDP (or DDP) to a DeepSeek-V3 model.

Tensor parallel (sequence parallel between blocks, as for Llama): MLA shards heads (``wq`` or
``wq_b`` and ``wkv_b`` column-wise, ``wo`` row-wise); the latent projections ``wq_a``/``wkv_a``
and their norms run replicated on every TP rank: their gradients come out whole and equal on
each rank, since the column-wise layers all-reduce their input gradients and so does
:class:`SumGradientOverTP` for the rope key ``k_pe`` that all heads share; dense FFNs shard as
Llama's. MoE layers run replicated on the gathered sequence (no expert parallelism or expert TP
yet: the experts are sharded by FSDP like any parameter).

Everything here works on a ``meta``-device model; the trainer then calls
``model.to_empty(device=...)`` and ``model.init_weights(buffer_device=...)``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import model_compile_enabled
from torchtitan.distributed.fsdp import apply_data_parallel, to_torch_dtype
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp, non_block_tp_plan
from torchtitan.tools import device as device_tools
from torchtitan.tools.logging import logger


class SumGradientOverTP(ParallelStyle):
    """Identity forward; backward all-reduces the input's gradient over the TP ranks (Megatron's
    "copy to the tensor-parallel region"), for a plain tensor that every rank feeds into its own
    heads: each rank's gradient is then only its heads' share."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre_hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]):
            x = DTensor.from_local(inputs[0], device_mesh, [Replicate()], run_check=False)
            return (x.to_local(grad_placements=[Partial()]), *inputs[1:])

        module.register_forward_pre_hook(pre_hook)
        return module


def block_tp_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """TP plan of one DeepSeek-V3 block (MLA + dense FFN or MoE)."""
    attention = block.attention
    plan: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        # Local (plain) input: wkv_a / wq_a and their norms stay plain, replicated modules.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Replicate(), None),
            use_local_output=True,
        ),
        "attention.wkv_b": ColwiseParallel(),
        "attention.k_pe_shared": SumGradientOverTP(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    plan["attention.wq" if attention.q_lora_rank == 0 else "attention.wq_b"] = ColwiseParallel()
    if block.moe_enabled:
        plan["moe"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        )
    else:
        plan.update({
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return plan


def apply_tp_deepseekv3(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool = True) -> None:
    """Apply the TP/SP plans (parts that are None in a pipeline stage are skipped)."""
    plan = {
        name: style
        for name, style in non_block_tp_plan(loss_parallel).items()
        if getattr(model, name, None) is not None
    }
    if plan:
        parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():
        if block is not None:
            parallelize_module(block, tp_mesh, block_tp_plan(block))
    logger.info(
        f"Applied tensor parallel to DeepSeek-V3 (degree {tp_mesh.size()}, MLA heads and dense "
        "FFNs sharded, MoE layers replicated)"
    )


def apply_compile_blocks(model: nn.Module, backend: str) -> None:
    """Compile every block; MoE blocks without ``fullgraph`` (token counts per expert are
    data-dependent), dense ones with it."""
    for layer_id, block in list(model.layers.items()):
        if block is None:
            continue
        fullgraph = not getattr(block, "moe_enabled", False)
        model.layers[layer_id] = torch.compile(block, backend=backend, fullgraph=fullgraph)
    logger.info(f"Compiled {len(model.layers)} DeepSeek-V3 blocks with torch.compile ({backend})")


def parallelize_deepseekv3(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Parallelize ``model`` in place per ``parallel_dims`` and ``job_config``; returns it.

    Order: tensor parallel, activation checkpointing, per-block compile, then FSDP/HSDP when
    dp_shard or cp > 1, else DDP when dp_replicate > 1.
    """
    par = job_config.parallelism
    compile_model = model_compile_enabled(job_config.compile)
    mesh = parallel_dims.world_mesh
    device_type = mesh.device_type if mesh is not None else device_tools.device_type

    tp_mesh = parallel_dims.get_mesh("tp")
    maybe_enable_async_tp(par.enable_async_tensor_parallel, compile_model, tp_mesh, device_type)
    if parallel_dims.tp_enabled:
        apply_tp_deepseekv3(model, tp_mesh, loss_parallel=not par.disable_loss_parallel)

    apply_ac(model, job_config.activation_checkpoint)

    if compile_model:
        apply_compile_blocks(model, job_config.compile.backend)

    training = job_config.training
    if training.enable_cpu_offload and not parallel_dims.fsdp_enabled:
        logger.warning(
            "training.enable_cpu_offload only works with FSDP (parallelism.data_parallel_shard_degree "
            "> 1); ignoring it"
        )
    apply_data_parallel(
        model,
        parallel_dims,
        param_dtype=to_torch_dtype(
            training.mixed_precision_param, "training.mixed_precision_param"
        ),
        reduce_dtype=to_torch_dtype(
            training.mixed_precision_reduce, "training.mixed_precision_reduce"
        ),
        cpu_offload=training.enable_cpu_offload and parallel_dims.fsdp_enabled,
        reshard_after_forward_policy=par.fsdp_reshard_after_forward,
        enable_compile=compile_model,
        enable_compiled_autograd=par.enable_compiled_autograd,
    )
    return model
