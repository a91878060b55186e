"""Block-causal attention under FSDP2, TP2 and PP2 (2 gloo ranks) equals running each
document on its own in one process.

One packed batch (4 rows of ``[BOS] doc [EOS]`` documents, BOS=1, EOS=2) goes through a
4-layer tiny Llama and the Qwen3 MoE debug flavor (QK-norm, rotate-half RoPE, experts) with
``attn_mask_type="block_causal"`` under each layout, one forward and backward with the
trainer's loss (summed token CE / global tokens). The reference splits each row at its
document boundaries and runs the plain causal model on every piece separately.
Logits (FSDP2, TP2), loss (PP2, also its forward-only validation pass) and every parameter's
gradient must agree within fp32 tolerance (rtol/atol 1e-5; reduction-order noise only).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launcher import launch
from tests.unit.test_document_mask import BOS, EOS, per_document_logits
from torchtitan.components.loss import cross_entropy_loss_sum
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common.document_mask import document_ids

pytestmark = [
    pytest.mark.slow,  # a 2-rank gloo launch
    pytest.mark.usefixtures("one_thread"),  # the reference, as the workers (OMP_NUM_THREADS=1)
]

ROWS, SEQ, VOCAB = 4, 32, 300
TOL = dict(rtol=1e-5, atol=1e-5)
FAMILIES = ("llama3", "qwen3_moe")


def family_parts(family: str):
    """(model class, flavor args, parallelize fn) of a tested family."""
    if family == "llama3":
        from torchtitan.models.llama3 import llama3_args
        from torchtitan.models.llama3.model import Transformer
        from torchtitan.models.llama3.parallelize import parallelize_llama

        return Transformer, replace(llama3_args["debugmodel_tiny"], n_layers=4), parallelize_llama
    from torchtitan.models.qwen3 import qwen3_args
    from torchtitan.models.qwen3.model import Qwen3Model
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    return Qwen3Model, qwen3_args["debugmodel_moe"], parallelize_qwen3


def args(family: str, mask: str = "block_causal"):
    return replace(family_parts(family)[1], vocab_size=VOCAB, max_seq_len=SEQ, attn_mask_type=mask)


def build(family: str, mask: str = "block_causal"):
    return family_parts(family)[0](args(family, mask))


def initial_state(family: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    model = build(family, "causal")
    model.init_weights()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    rows = []
    for r in range(ROWS):
        row: list[int] = torch.randint(3, VOCAB, (2 + r,), generator=g).tolist() + [EOS]
        while len(row) <= SEQ:
            n = int(torch.randint(1, 12, (1,), generator=g))
            row += [BOS, *torch.randint(3, VOCAB, (n,), generator=g).tolist(), EOS]
        rows.append(row[: SEQ + 1])
    t = torch.tensor(rows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _cfg(dp_shard=1, tp=1, pp=1) -> JobConfig:
    cfg = JobConfig()
    cfg.training.seq_len, cfg.training.local_batch_size = SEQ, ROWS // dp_shard
    cfg.training.mixed_precision_param = cfg.training.mixed_precision_reduce = "float32"
    cfg.activation_checkpoint.mode = "none"
    par = cfg.parallelism
    par.data_parallel_shard_degree, par.tensor_parallel_degree = dp_shard, tp
    par.pipeline_parallel_degree, par.disable_loss_parallel = pp, True
    par.pipeline_parallel_microbatch_size = 1
    return cfg


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def run_layouts() -> dict[str, dict]:
    """Worker: each family and layout on this 2-rank group; logits / loss and full gradients."""
    from torchtitan.components.checkpoint import ModelWrapper
    from torchtitan.distributed.expert_parallel import moe_grad_hooks
    from torchtitan.models.llama3.pipeline import pipeline_llama

    inputs, labels = batch()
    scale = 1.0 / labels.numel()
    out = {}
    for family in FAMILIES:
        parallelize = family_parts(family)[2]
        for name, degrees in {"fsdp2": dict(dp_shard=2), "tp2": dict(tp=2),
                              "pp2": dict(pp=2)}.items():
            cfg = _cfg(**degrees)
            dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
            dims.build_mesh("cpu")
            with torch.device("meta"):
                model = build(family)
            pipeline = None
            if dims.pp_enabled:
                pipeline = pipeline_llama(model, dims, cfg, torch.device("cpu"), args(family),
                                          parallelize, cross_entropy_loss_sum)
                parts = pipeline.model_parts
            else:
                parts = [parallelize(model, dims, cfg)]
            for part in parts:
                part.to_empty(device="cpu")
                with torch.no_grad():
                    part.init_weights()
            ModelWrapper(parts).load_full_state_dict(initial_state(family))
            result: dict = {}
            if pipeline is not None:
                docs = document_ids(inputs, BOS, EOS)
                result["loss"] = pipeline.train_step(inputs, labels, scale, document_ids=docs)
                result["eval_loss"] = pipeline.eval_loss(inputs, labels, document_ids=docs) * scale
                result["last"] = pipeline.has_last_stage
            else:
                rows = slice(None)
                if dims.dp_enabled:
                    per = ROWS // dims.dp_degree
                    dp_rank = dims.mesh_local_rank("dp")
                    rows = slice(dp_rank * per, (dp_rank + 1) * per)
                x, y = inputs[rows], labels[rows]
                logits = parts[0](x, document_ids=document_ids(x, BOS, EOS))
                (cross_entropy_loss_sum(logits, y) * scale * dims.dp_degree).backward()
                for hook in moe_grad_hooks(parts, dims):  # MoE router / experts over tp
                    hook()
                result["logits"] = _full(logits).detach()
            result["grads"] = {
                n: _full(p.grad).detach().clone()
                for part in parts for n, p in part.named_parameters()
            }
            out[f"{family}/{name}"] = result
    return out


@functools.cache
def reference(family: str):
    inputs, labels = batch()
    model = build(family, "causal")
    model.load_state_dict(initial_state(family))
    logits = per_document_logits(model, inputs)
    loss = cross_entropy_loss_sum(logits, labels) / labels.numel()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    with torch.no_grad():
        causal_logits = model(inputs)
    return logits.detach(), loss.detach(), grads, causal_logits


@pytest.fixture(scope="module")
def runs():
    return launch(run_layouts, 2, timeout_s=300)


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_and_tp2_equal_each_document_alone(runs, family):
    logits, _, grads, causal_logits = reference(family)
    fsdp = torch.cat([runs[0][f"{family}/fsdp2"]["logits"], runs[1][f"{family}/fsdp2"]["logits"]])
    assert (causal_logits - logits).abs().max() > 1e-2  # the documents do matter
    for name, got in (("fsdp2", fsdp), ("tp2 rank 0", runs[0][f"{family}/tp2"]["logits"]),
                      ("tp2 rank 1", runs[1][f"{family}/tp2"]["logits"])):
        torch.testing.assert_close(got, logits, **TOL, msg=name)
    for layout in ("fsdp2", "tp2"):
        for rank in (0, 1):
            got = runs[rank][f"{family}/{layout}"]["grads"]
            assert set(got) == set(grads)
            for n, g in got.items():
                torch.testing.assert_close(g, grads[n], **TOL, msg=f"{layout} rank {rank} {n}")


@pytest.mark.parametrize("family", FAMILIES)
def test_pp2_equals_each_document_alone(runs, family):
    _, loss, grads, _ = reference(family)
    pp = [r[f"{family}/pp2"] for r in runs]
    last = [r for r in pp if r["last"]]
    assert len(last) == 1
    torch.testing.assert_close(last[0]["loss"], loss, **TOL)
    for r in pp:
        torch.testing.assert_close(r["eval_loss"], loss, **TOL)
    stage_grads = {**pp[0]["grads"], **pp[1]["grads"]}
    assert set(stage_grads) == set(grads)
    for n, g in stage_grads.items():
        torch.testing.assert_close(g, grads[n], **TOL, msg=f"pp2 {n}")
