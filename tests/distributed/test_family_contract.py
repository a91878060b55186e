"""Every registered family parallelizes with FSDP2 on two gloo ranks (the distributed part of
tests/unit/test_family_contract.py; a new family is covered without editing this file).

Each debug flavor (one per distinct shape: dense / MoE / tied) is built on meta, parallelized
by its spec's ``parallelize_fn`` with ``data_parallel_shard_degree = 2``, materialized and
loaded with the weights of a one-device model; every parameter must then be sharded over the
two ranks, and one forward/backward on half the batch per rank must give the one-device loss
and gradients (fp32 parameters and compute; FSDP averages the gradients, each rank's loss is
its half's mean): measured, losses within 1e-7 and gradients within 7.5e-7 of each tensor's
largest.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import launch
from torchtitan.models import get_model_spec, list_model_specs

pytestmark = pytest.mark.slow  # launches gloo ranks

SEQ_LEN, BATCH, VOCAB = 32, 4, 512
GRAD_TOL = 1e-5  # measured: at most 7.5e-7 (llama2), losses within 1e-7


def debug_flavors(family: str) -> list[str]:
    """The family's ``debugmodel*`` flavors, one per (MoE, tied) shape."""
    spec, seen, out = get_model_spec(family), set(), []
    for flavor, args in spec.model_args.items():
        shape = (getattr(args, "moe_args", None) is not None, args.tie_word_embeddings)
        if flavor.startswith("debugmodel") and shape not in seen:
            seen.add(shape)
            out.append(flavor)
    return out


CASES = [(f, flavor) for f in list_model_specs() for flavor in debug_flavors(f)]


def _args(family: str, flavor: str):
    args = get_model_spec(family).get_model_args(flavor)
    args.max_seq_len = SEQ_LEN
    if args.use_tokenizer_vocab:
        args.vocab_size = VOCAB
    return args


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def fsdp_matches_one_device(cases: list[tuple[str, str]]) -> dict[str, dict]:
    """On each rank, per case: the mean loss and the one-device loss, the largest gradient
    difference to one device (relative to the tensor's largest gradient) and the parameters
    not sharded over the ranks."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    from torchtitan.config.job_config import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = JobConfig()
    cfg.parallelism.data_parallel_shard_degree = world
    cfg.training.seq_len = SEQ_LEN
    cfg.activation_checkpoint.mode = "none"
    cfg.training.mixed_precision_param = "float32"  # compare in fp32
    dims = ParallelDims.from_config(cfg.parallelism, world)
    dims.build_mesh("cpu")
    out = {}
    for family, flavor in cases:
        spec, args = get_model_spec(family), _args(family, flavor)
        torch.manual_seed(0)
        with torch.device("meta"):
            ref = spec.model_cls(args)
        ref.to_empty(device="cpu")
        ref.init_weights()
        tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ_LEN + 1),
                               generator=torch.Generator().manual_seed(1))
        ref_loss = _loss(ref, tokens)
        ref_loss.backward()
        with torch.device("meta"):
            model = spec.model_cls(args)
        model = spec.parallelize_fn(model, dims, cfg)
        model.to_empty(device="cpu")
        model.init_weights()
        set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
        half = BATCH // world
        loss = _loss(model, tokens[rank * half : (rank + 1) * half])
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        grads = dict(ref.named_parameters())
        grad_diff = 0.0
        unsharded = []
        for name, p in model.named_parameters():
            if not isinstance(p, DTensor) or p.device_mesh.size() != world:
                unsharded.append(name)
                continue
            want = grads[name].grad
            diff = float((p.grad.full_tensor() - want).abs().max() / want.abs().max().clamp_min(1e-12))
            grad_diff = max(grad_diff, diff)
        out[f"{family}/{flavor}"] = {
            "loss": (float(mean) / world, float(ref_loss)), "grad_diff": grad_diff, "unsharded": unsharded,
        }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict]]:
    return launch(fsdp_matches_one_device, 2, CASES, timeout_s=300)


@pytest.mark.parametrize(("family", "flavor"), CASES)
def test_fsdp2_on_two_ranks_equals_one_device(family, flavor, results):
    for rank, per_case in enumerate(results):
        r = per_case[f"{family}/{flavor}"]
        assert r["unsharded"] == [], f"rank {rank}: not sharded over dp_shard: {r['unsharded'][:3]}"
        loss, ref = r["loss"]
        assert loss == pytest.approx(ref, rel=1e-6), f"rank {rank}"
        assert r["grad_diff"] < GRAD_TOL, f"rank {rank}: {r['grad_diff']}"
