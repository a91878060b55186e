"""Every MoE family keeps its load-balancing buffers (``expert_bias``, ``tokens_per_expert``)
in float32 whatever dtype the model is cast to: in bf16 token counts above 256 are inexact and
the bias would be updated from wrong counts. Checked on ``.to(torch.bfloat16)`` and on the real
build path without FSDP (one device; TP-only and DDP on two simulated ranks), where
``training.dtype = "bfloat16"`` casts the whole model."""

from __future__ import annotations

import pkgutil

import pytest
import torch

import torchtitan.models as models_pkg
from tests.conftest import REPO_ROOT
from torchtitan.models import get_model_spec
from torchtitan.models.common.moe import MoE, moe_layers

DEBUG = str(REPO_ROOT / "train_configs" / "debug_model.toml")


def _moe_families() -> list[tuple[str, str]]:
    """(family, its first debug flavor with MoE layers) for every family in the registry."""
    found = []
    for info in pkgutil.iter_modules(models_pkg.__path__):
        if not info.ispkg or info.name == "common":
            continue
        spec = get_model_spec(info.name)
        for flavor in spec.flavors:
            if not flavor.startswith("debugmodel"):
                continue
            with torch.device("meta"):
                model = spec.model_cls(spec.get_model_args(flavor))
            if any(isinstance(m, MoE) for m in model.modules()):
                found.append((info.name, flavor))
                break
    return found


MOE_FAMILIES = _moe_families()


def test_the_registry_has_moe_families():
    assert {family for family, _ in MOE_FAMILIES} >= {"qwen3", "deepseek_v3"}


@pytest.mark.parametrize(("family", "flavor"), MOE_FAMILIES)
def test_to_bfloat16_keeps_moe_buffers_float32(family, flavor):
    spec = get_model_spec(family)
    args = spec.get_model_args(flavor)
    args.max_seq_len = 32
    model = spec.model_cls(args)
    model.init_weights()
    layers = moe_layers([model])
    for layer in layers:
        layer.tokens_per_expert.fill_(257.0)  # not a bf16 number
        layer.expert_bias.fill_(1e-3 + 1e-7)
    model.to(torch.bfloat16)
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    assert layers
    for layer in layers:
        assert layer.tokens_per_expert.dtype == torch.float32
        assert layer.expert_bias.dtype == torch.float32
        assert layer.tokens_per_expert[0].item() == 257.0
        assert layer.expert_bias[0].item() == torch.tensor(1e-3 + 1e-7).item()


def _build(family: str, flavor: str, tmp_path, mode: str | None, world: int, *flags: str):
    from torchtitan.build import build_run
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed.comm_mode import COMM_MODES, CommMode

    cfg = ConfigManager().parse_args([
        "--job.config_file", DEBUG, "--model.name", family, "--model.flavor", flavor,
        "--job.dump_folder", str(tmp_path), "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--training.dtype", "bfloat16",
        "--activation_checkpoint.mode", "none", *flags,
    ])
    comm_mode = CommMode(world) if mode is None else COMM_MODES[mode](world)
    return comm_mode, build_run(cfg, comm_mode, device=torch.device("cpu"))


LAYOUTS = {
    "one_device": (None, 1, ()),
    "tp2": ("local_tensor", 2, ("--parallelism.tensor_parallel_degree", "2",
                                "--parallelism.data_parallel_shard_degree", "1")),
    "ddp2": ("local_tensor", 2, ("--parallelism.data_parallel_replicate_degree", "2",
                                 "--parallelism.data_parallel_shard_degree", "1")),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("family", "flavor"), MOE_FAMILIES)
def test_bfloat16_build_keeps_moe_buffers_float32(family, flavor, layout, tmp_path):
    mode, world, flags = LAYOUTS[layout]
    comm_mode, run = _build(family, flavor, tmp_path, mode, world, *flags)
    try:
        assert run.moe_layers
        weights = [p for p in run.model_parts[0].parameters()]
        assert weights[0].dtype == torch.bfloat16  # the cast happened
        for layer in run.moe_layers:
            assert layer.tokens_per_expert.dtype == torch.float32, layout
            assert layer.expert_bias.dtype == torch.float32, layout
    finally:
        comm_mode.close()
        if torch.distributed.is_initialized():  # the simulated ranks' fake process group
            torch.distributed.destroy_process_group()
