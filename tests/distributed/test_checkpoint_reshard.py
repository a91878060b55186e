"""Resharding through DCP with real gloo processes: FSDP4 -> FSDP2xTP2 / FSDP2 -> one device.

A tiny Llama trains from a common starting point (tests/distributed/harness.py data and
weights) with AdamW and a warm-up LR schedule. Checkpoints saved under one layout are loaded
under another and the *next* steps' losses must equal those of the run that never stopped
(fp32 reduction-order noise only: |diff| < 2e-5 on losses of ~6). Also covered here, in the
same launches: an async save (own gloo group) while training continues, the dataloader state
(one global stream position) loading under a changed dp degree on every rank, and HF
safetensors loaded into an FSDP2 x TP2 model (``initial_load_in_hf``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from tests.distributed.harness import (
    GLOBAL_BATCH,
    LR,
    MAX_NORM,
    global_batch,
    initial_state_dict,
    tiny_args,
)
from tests.distributed.launcher import launch
from torchtitan.components.checkpoint import CheckpointError, CheckpointManager
from torchtitan.components.checkpoint.hf import save_safetensors_folder
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.job_config import Checkpoint, JobConfig, LRScheduler, Optimizer
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import maybe_loss_parallel
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

TOL = 2e-5
TOTAL_STEPS = 10


class _Numbers(IterableDataset):
    """A stream position that every rank shares (the protocol of HuggingFaceTextDataset)."""

    def __init__(self):
        self.position = 0

    def __iter__(self):
        while True:
            self.position += 1
            yield torch.tensor([self.position])

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class Run:
    """Model + optimizer + LR schedule (+ a dp-aware dataloader) under one layout."""

    def __init__(self, dp_shard: int = 1, tp: int = 1, initial: bool = False):
        self.dims = None
        if dist.is_initialized():
            cfg = JobConfig()
            cfg.training.seq_len = 32
            cfg.training.mixed_precision_param = "float32"
            cfg.activation_checkpoint.mode = "none"
            cfg.parallelism.data_parallel_shard_degree = dp_shard
            cfg.parallelism.tensor_parallel_degree = tp
            self.dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
            self.dims.build_mesh("cpu")
            from torchtitan.models.llama3.parallelize import parallelize_llama

            with torch.device("meta"):
                model = Transformer(tiny_args())
            model = parallelize_llama(model, self.dims, cfg)
            model.to_empty(device="cpu")
        else:
            model = Transformer(tiny_args())
        torch.manual_seed(dist.get_rank() + 77 if dist.is_initialized() else 77)
        with torch.no_grad():
            model.init_weights()  # random, different per layout: a load must overwrite it
        if initial:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )

            set_model_state_dict(model, initial_state_dict(), options=StateDictOptions(full_state_dict=True))
        self.model = model
        self.opt = OptimizersContainer([model], Optimizer(lr=LR, implementation="for-loop"))
        self.sched = LRSchedulersContainer(self.opt, LRScheduler(warmup_steps=3), TOTAL_STEPS)
        dp = self.dims.dp_degree if self.dims else 1
        dp_rank = self.dims.mesh_local_rank("dp") if self.dims else 0
        self.dp, self.dp_rank = dp, dp_rank
        self.loader = ParallelAwareDataloader(_Numbers(), dp_rank, dp, batch_size=1)

    def manager(self, folder: Path, adapter=None, **kw) -> CheckpointManager:
        cfg = Checkpoint(**{"enable": True, "interval": 1000, "keep_latest_k": 0, **kw})
        return CheckpointManager(
            self.loader, [self.model], self.opt, self.sched, {}, cfg, str(folder), adapter
        )

    def step(self, step: int) -> float:
        inputs, labels = global_batch(step)
        per = GLOBAL_BATCH // self.dp
        rows = slice(self.dp_rank * per, (self.dp_rank + 1) * per)
        self.opt.zero_grad()
        lp = self.dims is not None and self.dims.tp_enabled
        with maybe_loss_parallel(lp):
            loss = cross_entropy_loss(self.model(inputs[rows]), labels[rows])
            loss.backward()
        dist_utils.clip_grad_norm_(self.model.parameters(), MAX_NORM)
        self.opt.step()
        self.sched.step()
        mesh = self.dims.get_mesh("dp") if self.dims else None
        return dist_utils.dist_reduce(loss.detach(), "mean", mesh)


def _expect_error(fn, *needles: str) -> str:
    try:
        fn()
    except CheckpointError as err:
        msg = str(err)
        assert all(n in msg for n in needles), msg
        return msg
    raise AssertionError(f"no CheckpointError (wanted {needles})")


def four_ranks(root: str) -> dict:
    """FSDP4 trains and saves (sync, then async); FSDP2xTP2 resumes from the sync one."""
    root_p = Path(root)
    out: dict = {}
    a = Run(dp_shard=4, initial=True)
    ck = a.manager(root_p / "fsdp4", async_mode="async", interval=2)
    losses = [a.step(s) for s in range(2)]
    ck.save(2, force=True)  # synchronous (force), committed on return
    losses += [a.step(s) for s in range(2, 4)]
    ck.save(4)  # async: training continues while it is written
    assert ck.in_flight is not None  # really in the background
    losses.append(a.step(4))  # modifies the weights the async save staged
    ck.close()
    out["fsdp4"] = losses

    b = Run(dp_shard=2, tp=2)
    # dp 4 -> 2: the data stream's position loads on every rank (one value, stored once)
    assert b.manager(root_p / "fsdp4").load(step=2)
    assert b.loader.dataset.position == 0
    out["fsdp2_tp2"] = [b.step(s) for s in range(2, 4)]
    b.manager(root_p / "dp2").save(4, force=True)

    # dp 2 -> 4: ranks 2 and 3 read the same stored position as ranks 0 and 1
    c = Run(dp_shard=4)
    c.loader.dataset.position = 99
    assert c.manager(root_p / "dp2").load()
    out["grown_position"] = c.loader.dataset.position

    # HF safetensors of the initial weights, loaded straight into FSDP2 x TP2 shards
    d = Run(dp_shard=2, tp=2)
    adapter = Llama3StateDictAdapter(tiny_args())
    hf = d.manager(root_p / "from_hf", adapter, initial_load_path=str(root_p / "hf"), initial_load_in_hf=True)
    assert hf.load()
    out["hf_first_loss"] = d.step(0)
    return out


def two_ranks(root: str) -> dict:
    """FSDP2 resumes from FSDP4's async step-4, trains one step, saves step-5 for one device."""
    root_p = Path(root)
    run = Run(dp_shard=2)
    assert run.manager(root_p / "fsdp4", exclude_from_loading=["dataloader"]).load()  # newest: step-4
    out = {"fsdp2": [run.step(4)]}
    run.manager(root_p / "fsdp2").save(5, force=True)
    out["fsdp2"].append(run.step(5))
    return out


@pytest.mark.slow
def test_reshard_fsdp4_tp_fsdp2_single(tmp_path):
    hf = Llama3StateDictAdapter(tiny_args()).to_hf(initial_state_dict())
    save_safetensors_folder(hf, str(tmp_path / "hf"))
    four = launch(four_ranks, 4, str(tmp_path), timeout_s=240)
    ref = four[0]["fsdp4"]
    assert all(r["fsdp4"] == ref for r in four)  # every rank reports the same global loss
    assert len(ref) == 5 and ref[0] > ref[-1]
    # FSDP2 x TP2 from FSDP4's step-2: the next two steps (optimizer state resharded too)
    for got, want in zip(four[0]["fsdp2_tp2"], ref[2:4]):
        assert abs(got - want) < TOL, (four[0]["fsdp2_tp2"], ref)
    assert [r["grown_position"] for r in four] == [0] * 4
    assert abs(four[0]["hf_first_loss"] - ref[0]) < TOL  # HF weights -> sharded model, exactly
    assert (tmp_path / "fsdp4" / "checkpoint" / "step-4" / ".committed").exists()

    two = launch(two_ranks, 2, str(tmp_path), timeout_s=180)
    assert abs(two[0]["fsdp2"][0] - ref[4]) < TOL, (two[0]["fsdp2"], ref)

    # one device, no process group, from FSDP2's step-5
    single = Run()
    assert single.manager(tmp_path / "fsdp2", exclude_from_loading=["dataloader"]).load()
    assert abs(single.step(5) - two[0]["fsdp2"][1]) < TOL
    assert copy.deepcopy(single.sched.schedulers[0].last_epoch) == 6
