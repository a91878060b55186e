"""Train a tiny Llama for a few steps, single-device or under a parallel layout.

Both paths start from the same full state dict (seeded CPU build), see the same global batch
per step and use the same loss definition (mean token CE over the global batch), AdamW and
``clip_grad_norm_`` (max_norm 0.5, below the ~0.7-0.8 norms, so clipping acts), so their
per-step losses and grad norms must agree up to fp32 reduction-order noise.

Under data parallelism each dp rank takes its contiguous slice of the global batch and computes
the mean CE of its slice. All slices have the same token count, and FSDP/DDP *average* the
gradients over dp, so the result is the gradient of the global-batch mean; the logged loss is
the dp-mean of the per-rank means. TP ranks of one dp rank see the same slice.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.components.loss import cross_entropy_loss
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.fsdp import set_gradient_divide_factor
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import maybe_loss_parallel
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import parallelize_llama

GLOBAL_BATCH = 4
SEQ_LEN = 32
VOCAB = 512
STEPS = 6
LR = 1e-2
MAX_NORM = 0.5  # below the ~0.7-0.8 grad norms, so clipping acts on every step
INIT_SEED = 1234


def tiny_args(tied: bool = False) -> TransformerModelArgs:
    """The ``debugmodel_tiny`` flavor (dim 64, 2 layers, 4 heads, 2 kv heads), smaller vocab."""
    args = copy.deepcopy(llama3_args["debugmodel_tiny"])
    args.vocab_size = VOCAB
    args.max_seq_len = SEQ_LEN
    args.tie_word_embeddings = tied
    return args


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ``(inputs, labels)`` of shape ``[GLOBAL_BATCH, SEQ_LEN]`` for ``step``.

    Rows follow ``x[t+1] = (5 x[t] + 7) mod VOCAB`` from a random start with 10 % random
    tokens, so the loss falls quickly and gradients stay large enough for clipping to act.
    """
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    cols = [start]
    for _ in range(SEQ_LEN):
        cols.append((cols[-1] * 5 + 7) % VOCAB)
    tokens = torch.cat(cols, dim=1)
    noise = torch.rand(tokens.shape, generator=g) < 0.1
    tokens = torch.where(noise, torch.randint(0, VOCAB, tokens.shape, generator=g), tokens)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def initial_state_dict(tied: bool = False) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a seeded CPU build (the common starting point of every run)."""
    torch.manual_seed(INIT_SEED)
    model = Transformer(tiny_args(tied))
    model.init_weights()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    final_state: dict[str, torch.Tensor] | None = None
    seconds: float = 0.0


def train_reference(tied: bool = False, steps: int = STEPS, prepare: Any = None) -> RunResult:
    """Single-process run on the full global batch; ``prepare(model)`` may wrap it (AC, compile)."""
    model = Transformer(tiny_args(tied))
    model.load_state_dict(initial_state_dict(tied))
    if prepare is not None:
        model = prepare(model) or model
    opt = _optimizer(model)
    result = RunResult()
    for step in range(steps):
        inputs, labels = global_batch(step)
        opt.zero_grad()
        loss = cross_entropy_loss(model(inputs), labels)
        loss.backward()
        norm = dist_utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        result.losses.append(loss.item())
        result.grad_norms.append(float(norm))
    result.final_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result


@dataclass
class Layout:
    """One parallel layout plus config tweaks (``overrides``: ``"section.field" -> value``)."""

    name: str
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    tied: bool = False
    sum_grads: bool = False
    """FSDP sums gradients (divide factor 1); the loss is then pre-divided by the dp degree."""
    overrides: dict[str, Any] = field(default_factory=dict)


def _job_config(layout: Layout) -> JobConfig:
    cfg = JobConfig()
    cfg.training.seq_len = SEQ_LEN
    cfg.training.mixed_precision_param = "float32"
    cfg.training.mixed_precision_reduce = "float32"
    cfg.activation_checkpoint.mode = "none"
    cfg.parallelism.data_parallel_replicate_degree = layout.dp_replicate
    cfg.parallelism.data_parallel_shard_degree = layout.dp_shard
    cfg.parallelism.tensor_parallel_degree = layout.tp
    for key, value in layout.overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def train_parallel(layout: Layout, steps: int = STEPS) -> RunResult:
    """Run ``layout`` on the current process group (call on every rank)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    cfg = _job_config(layout)
    world = dist.get_world_size()
    dims = ParallelDims.from_config(cfg.parallelism, world)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(tiny_args(layout.tied))
    model = parallelize_llama(model, dims, cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    set_model_state_dict(
        model, initial_state_dict(layout.tied), options=StateDictOptions(full_state_dict=True)
    )
    if layout.sum_grads:
        set_gradient_divide_factor(model, 1.0)
    opt = _optimizer(model)
    dp_mesh = dims.get_mesh("dp")
    dp_rank, dp = dims.mesh_local_rank("dp"), dims.dp_degree
    per_rank = GLOBAL_BATCH // dp
    use_loss_parallel = dims.tp_enabled and not cfg.parallelism.disable_loss_parallel
    result = RunResult()
    for step in range(steps):
        inputs, labels = global_batch(step)
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        opt.zero_grad()
        with maybe_loss_parallel(use_loss_parallel):
            loss = cross_entropy_loss(model(inputs[rows]), labels[rows])
            (loss / dp if layout.sum_grads else loss).backward()
        norm = dist_utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        result.losses.append(dist_utils.dist_reduce(loss.detach(), "mean", dp_mesh))
        result.grad_norms.append(float(norm))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        result.final_state = {k: v.detach().clone() for k, v in full.items()}
    return result


def parallelized_model(
    spec: Any, args: Any, world_size: int, **parallelism: Any
) -> tuple[nn.Module, Any]:
    """``(model, parallel_dims)``: ``spec.model_cls(args)`` built on meta, parallelized by
    ``spec.parallelize_fn`` for the ``[parallelism]`` settings given (no AC), then materialized
    on CPU and initialized, in this launched rank."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    cfg = JobConfig()
    for key, value in parallelism.items():
        setattr(cfg.parallelism, key, value)
    cfg.activation_checkpoint.mode = "none"
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = spec.model_cls(args)
    model = spec.parallelize_fn(model, dims, cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    return model, dims


def tp2_gradient_errors(spec: Any, args: Any, ref: nn.Module) -> list[tuple[float, str]]:
    """Worker (2 ranks): ``ref`` (one device, weights as the test set them) and the same
    weights under TP2 take one batch's summed cross-entropy; per parameter, max |grad
    difference| / max |grad|, worst first (MoE gradients reduced over tp as the trainer does)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    from torchtitan.distributed.expert_parallel import moe_grad_hooks

    state = {k: v.clone() for k, v in ref.state_dict().items()}
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                 reduction="sum")

    loss_of(ref(tokens)).backward()
    model, dims = parallelized_model(
        spec, args, 2, tensor_parallel_degree=2, data_parallel_shard_degree=1,
        disable_loss_parallel=True,
    )
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    loss_of(model(tokens)).backward()
    for hook in moe_grad_hooks([model], dims):  # the router / expert gradients over tp
        hook()
    ref_grads = dict(ref.named_parameters())
    worst = []
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        expected = ref_grads[name].grad
        worst.append(((grad - expected).abs().max().item() / expected.abs().max().item(), name))
    return sorted(worst, reverse=True)


def run_layouts(layouts: list[Layout], steps: int = STEPS) -> dict[str, RunResult]:
    """Worker entry: every layout in turn on this process group."""
    results = {}
    for layout in layouts:
        start = time.perf_counter()
        results[layout.name] = train_parallel(layout, steps)
        results[layout.name].seconds = time.perf_counter() - start
    return results
