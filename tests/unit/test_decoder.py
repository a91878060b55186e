"""Families declare, they do not copy: every family is the shared Decoder with its own block,
args and TP plan; the config update, the pipeline split and the parallelization are shared."""

from __future__ import annotations

import ast
import copy
import pkgutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import torchtitan.models as models_pkg
from tests.conftest import REPO_ROOT
from torchtitan.config.job_config import JobConfig
from torchtitan.models import get_model_spec
from torchtitan.models.common.decoder import Decoder, DecoderArgs

MODELS = REPO_ROOT / "torchtitan" / "models"
FAMILIES = sorted(
    info.name for info in pkgutil.iter_modules(models_pkg.__path__)
    if info.ispkg and info.name != "common"
)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_every_family_is_the_shared_decoder():
    assert {"llama3", "llama2", "qwen3", "deepseek_v3"} <= set(FAMILIES)
    for family in FAMILIES:
        spec = get_model_spec(family)
        assert issubclass(spec.model_cls, Decoder), family
        assert all(isinstance(a, DecoderArgs) for a in spec.model_args.values()), family
        assert spec.pipelining_fn.target == "torchtitan.distributed.parallelize:pipeline_decoder"


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_families_do_not_import_llama3(family):
    for path in (MODELS / family).glob("*.py"):
        bad = {m for m in _imports(path) if m.startswith("torchtitan.models.llama3")}
        assert not bad, f"{path.name} imports {bad}"


def test_model_code_has_no_parallelism():
    paths = list((MODELS / "common").glob("*.py"))
    for family in FAMILIES:
        paths += [p for p in (MODELS / family).glob("*.py") if p.name in ("model.py", "args.py")]
    for path in paths:
        bad = {m for m in _imports(path) if m.startswith("torchtitan.distributed")}
        assert not bad, f"{path.relative_to(REPO_ROOT)} imports {bad}"


def _first_debug_flavor(family: str, moe: bool) -> str | None:
    spec = get_model_spec(family)
    for flavor, args in spec.model_args.items():
        if flavor.startswith("debugmodel") and (getattr(args, "moe_args", None) is not None) == moe:
            return flavor
    return None


@pytest.mark.parametrize("family", FAMILIES)
def test_update_from_config_is_shared(family, monkeypatch):
    """Debug flavors take the tokenizer's vocabulary; real ones keep theirs and warn once when
    the tokenizer's is larger; MoE flavors get debug.moe_force_load_balance."""
    from torchtitan.models.common import decoder

    spec = get_model_spec(family)
    job = JobConfig()
    job.training.seq_len = 64
    job.debug.moe_force_load_balance = True
    flavor = _first_debug_flavor(family, moe=False) or _first_debug_flavor(family, moe=True)
    debug = spec.get_model_args(flavor)
    debug.update_from_config(job, tokenizer=SimpleNamespace(vocab_size=300))
    assert (debug.max_seq_len, debug.vocab_size) == (64, 300)
    if getattr(debug, "moe_args", None) is not None:
        assert debug.moe_args.force_load_balance

    warnings: list[str] = []
    monkeypatch.setattr(decoder.logger, "warning", warnings.append)
    real = copy.deepcopy(next(a for a in spec.model_args.values() if not a.use_tokenizer_vocab))
    vocab = real.vocab_size
    real.update_from_config(job, tokenizer=SimpleNamespace(get_vocab_size=lambda: vocab + 1))
    assert real.vocab_size == vocab
    assert len(warnings) == 1 and f"larger than the model's vocab_size {vocab}" in warnings[0]


# --- the parallelization: the float8 TP choice follows the plan's declaration -----------------
@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("declared", [True, False])
def test_float8_tp_follows_the_plans_capability(declared, fake_world):
    from torchtitan.components.float8 import float8_tensorwise_tp
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.parallelize import parallelize_decoder
    from torchtitan.distributed.tensor_parallel import TensorParallelPlan, block_tp_plan

    seen: list[bool] = []

    def recording_plan(block, float8_tensorwise):
        seen.append(float8_tensorwise)
        return block_tp_plan(block, float8_tensorwise)

    cfg = JobConfig()
    cfg.model.converters = ["float8"]
    cfg.parallelism.tensor_parallel_degree = 2
    cfg.parallelism.data_parallel_shard_degree = 1
    cfg.activation_checkpoint.mode = "none"
    assert float8_tensorwise_tp(cfg)
    dims = ParallelDims.from_config(cfg.parallelism, 2)
    dims.build_mesh("cpu")
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(spec.get_model_args("debugmodel_tiny"))
    plan = TensorParallelPlan(block_plan=recording_plan, float8_tensorwise=declared)
    parallelize_decoder(model, dims, cfg, plan)
    assert seen == [declared] * len(model.layers)
