import pytest

from torchtitan.config.job_config import Parallelism
from torchtitan.distributed.parallel_dims import ParallelDims, ParallelismError


def _dims(world: int, **kw) -> ParallelDims:
    return ParallelDims.from_config(Parallelism(**kw), world)


def test_dp_shard_takes_remaining_ranks():
    d = _dims(8, tensor_parallel_degree=2, data_parallel_replicate_degree=2)
    assert d.dp_shard == 2
    assert d.dp_degree == 4
    assert d.fsdp_enabled and d.tp_enabled and not d.pp_enabled


def test_single_device_has_no_parallelism():
    d = _dims(1)
    assert d.dp_shard == 1 and not d.dp_enabled and not d.fsdp_enabled
    assert d.build_mesh("cpu") is None


@pytest.mark.parametrize(
    "world,kw,needle",
    [
        (4, dict(data_parallel_shard_degree=2, tensor_parallel_degree=4), "world size is 4"),
        (6, dict(tensor_parallel_degree=4), "not divisible"),
        (4, dict(tensor_parallel_degree=0), "tensor_parallel_degree=0 must be >= 1"),
        (4, dict(data_parallel_shard_degree=-2), "must be -1"),
        (4, dict(expert_parallel_degree=3), r"expert_parallel_degree=3 must divide "
                                            r"data_parallel_shard_degree=4 \(expert-parallel ranks "
                                            r"are borrowed from the ranks with different tokens\): "
                                            r"2, 4 fit here$"),
        # the TP ranks split the MoE tokens (etp 1): ep takes all of them, and more; expert TP
        # would not fit either (8 does not divide dp_shard 2), so it is not suggested; sharding
        # the replicas' ranks too would
        (8, dict(expert_parallel_degree=8, tensor_parallel_degree=2, data_parallel_shard_degree=2,
                 data_parallel_replicate_degree=2),
         r"^parallelism.expert_parallel_degree=8 must be a multiple of tensor_parallel_degree=2 "
         r"that divides 2 x data_parallel_shard_degree=2 \(with expert_tensor_parallel_degree=1 "
         r"the TP ranks split the MoE tokens and join one ep group\): 2, 4 fit here; or shard "
         r"instead of replicate \(expert-parallel ranks never span replicas\): "
         r"data_parallel_replicate_degree=1, data_parallel_shard_degree=4$"),
        # nothing to borrow from: 2 replicas of one rank
        (2, dict(expert_parallel_degree=2, data_parallel_replicate_degree=2),
         r"^parallelism.expert_parallel_degree=2 must divide data_parallel_shard_degree=1 .*: no "
         r"degree fits here; or shard instead of replicate \(expert-parallel ranks never span "
         r"replicas\): data_parallel_replicate_degree=1, data_parallel_shard_degree=2$"),
        (3, dict(expert_parallel_degree=2, data_parallel_shard_degree=3),
         r"data_parallel_shard_degree=3 .*: only 3 fits here$"),
        (1, dict(expert_parallel_degree=2),
         r"must divide data_parallel_shard_degree=1 .*: no degree fits here; or set it to 1 \(no "
         r"expert parallelism\)$"),
        # expert TP on: etp 1 would fit, and the line says so
        (2, dict(expert_parallel_degree=2, tensor_parallel_degree=2,
                 expert_tensor_parallel_degree=2),
         r"must divide data_parallel_shard_degree=1 .*; with expert_tensor_parallel_degree=2 the "
         r"TP ranks share their tokens and split each expert instead\): no degree fits here; or set "
         r"expert_tensor_parallel_degree=1 \(the TP ranks split the MoE tokens\)$"),
        # 2 of the 4 TP ranks split each expert: two token groups, and ep takes both
        (4, dict(expert_parallel_degree=4, tensor_parallel_degree=4,
                 expert_tensor_parallel_degree=2),
         r"^parallelism.expert_parallel_degree=4 must be a multiple of tensor_parallel_degree/"
         r"expert_tensor_parallel_degree = 4/2 = 2 that divides 2 x data_parallel_shard_degree=1 "
         r"\(with expert_tensor_parallel_degree=2 the TP ranks split the MoE tokens 2 ways and the "
         r"2 groups join one ep group\): only 2 fits here; or set expert_tensor_parallel_degree=1 \(the "
         r"TP ranks split the MoE tokens\)$"),
        (4, dict(tensor_parallel_degree=4, expert_tensor_parallel_degree=3),
         r"^parallelism.expert_tensor_parallel_degree=3 must divide "
         r"parallelism.tensor_parallel_degree=4 .*: 1, 2, 4 fit here$"),
    ],
)
def test_invalid_layouts(world, kw, needle):
    with pytest.raises(ParallelismError, match=needle):
        _dims(world, **kw)


def test_model_checks():
    d = _dims(4, tensor_parallel_degree=4)
    d.validate_for_model(n_heads=16, n_kv_heads=4, n_layers=8, seq_len=512)
    with pytest.raises(ParallelismError, match="n_kv_heads=2"):
        d.validate_for_model(n_heads=16, n_kv_heads=2, n_layers=8, seq_len=512)
    with pytest.raises(ParallelismError, match="n_heads=6"):
        d.validate_for_model(n_heads=6, n_kv_heads=6, n_layers=8, seq_len=512)
    with pytest.raises(ParallelismError, match="seq_len=510"):
        d.validate_for_model(n_heads=16, n_kv_heads=4, n_layers=8, seq_len=510)
    pp = _dims(4, pipeline_parallel_degree=4)
    with pytest.raises(ParallelismError, match="n_layers=2"):
        pp.validate_for_model(n_heads=4, n_kv_heads=4, n_layers=2, seq_len=64)


def test_context_parallel_seq_len_rule_follows_the_load_balancer():
    balanced = _dims(2, context_parallel_degree=2)
    with pytest.raises(ParallelismError, match=r"seq_len=66 must be divisible by 4 \(tp=1 for "
                                               r"sequence parallel, 2\*cp=4 for context parallel load balancing\)"):
        balanced.validate_for_model(n_heads=4, n_kv_heads=4, n_layers=2, seq_len=66)
    contiguous = _dims(2, context_parallel_degree=2, context_parallel_load_balancer="none")
    assert not contiguous.cp_load_balance
    contiguous.validate_for_model(n_heads=4, n_kv_heads=4, n_layers=2, seq_len=66)
    with pytest.raises(ParallelismError, match=r"seq_len=65 must be divisible by 2 \(tp=1 for "
                                               r"sequence parallel, cp=2 for context parallel\)"):
        contiguous.validate_for_model(n_heads=4, n_kv_heads=4, n_layers=2, seq_len=65)


def test_repr_is_the_layout_string_checkpoints_key_rng_states_by():
    # checkpoints written before cp_load_balance existed must keep matching
    assert repr(_dims(8, context_parallel_degree=2, tensor_parallel_degree=2)) == (
        "ParallelDims(dp_replicate=1, dp_shard=2, cp=2, tp=2, pp=1, ep=1, etp=1, world_size=8)"
    )


def test_expert_checks_name_the_dim_the_degree_must_divide():
    import torch

    from torchtitan.config.manager import ConfigManager
    from torchtitan.models.common.moe import MoE, MoEArgs
    from torchtitan.plan import check_expert_parallel

    cfg = ConfigManager().parse_args(["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"])
    with torch.device("meta"):
        model = torch.nn.Module()
        model.moe = MoE(MoEArgs(num_experts=6, num_shared_experts=1), dim=16, hidden_dim=20)
    etp8 = _dims(8, tensor_parallel_degree=8, expert_tensor_parallel_degree=8)
    with pytest.raises(ParallelismError, match=r"^parallelism.expert_tensor_parallel_degree=8 must "
                                               r"divide the model's expert hidden dim 20$"):
        check_expert_parallel(cfg, etp8, model)
    model.moe.experts.w1 = torch.nn.Parameter(torch.empty(6, 24, 16, device="meta"))
    with pytest.raises(ParallelismError, match="divide the model's shared expert hidden dim 20$"):
        check_expert_parallel(cfg, etp8, model)
    check_expert_parallel(cfg, _dims(4, tensor_parallel_degree=2, expert_tensor_parallel_degree=2),
                          model)
    with pytest.raises(ParallelismError, match=r"expert_parallel_degree=4 must divide the model's "
                                               r"num_experts=6$"):
        check_expert_parallel(cfg, _dims(4, expert_parallel_degree=4), model)
