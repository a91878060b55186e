"""Pipeline splitting, stage placement and up-front config errors (single process, no PG)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchtitan.config.job_config import JobConfig, Parallelism
from torchtitan.distributed.pipeline import (
    SCHEDULES,
    check_microbatches,
    generate_fqns_per_stage,
    get_schedule_class,
    n_microbatches_for,
    read_csv_stage_placement,
    resolve_pipeline_layout,
    split_model_part,
    stage_ids_this_rank,
    validate_fqns_per_stage,
)
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.pipeline import pipeline_llama


def _args(n_layers: int = 4, tied: bool = False):
    args = copy.deepcopy(llama3_args["debugmodel_tiny"])
    args.n_layers, args.vocab_size, args.max_seq_len = n_layers, 128, 16
    args.tie_word_embeddings = tied
    return args


def _meta_model(n_layers: int = 4) -> Transformer:
    with torch.device("meta"):
        return Transformer(_args(n_layers))


def _pp_cfg(pp: int = 2, schedule: str = "1F1B", **kw) -> Parallelism:
    cfg = Parallelism(pipeline_parallel_degree=pp, pipeline_parallel_schedule=schedule)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


# --- balanced splits -------------------------------------------------------------------------
def test_generate_two_stages_balances_embedding_and_output():
    assert generate_fqns_per_stage(2, 8) == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"],
        ["layers.4", "layers.5", "layers.6", "layers.7", "norm", "output"],
    ]


def test_generate_four_stages_spreads_remainder_to_early_stages():
    # 8 layers + 1 + 1 = 10 units over 4 stages -> 3, 3, 2, 2
    assert generate_fqns_per_stage(4, 8, 1, 1) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "layers.4"],
        ["layers.5", "layers.6"],
        ["layers.7", "norm", "output"],
    ]


def test_generate_zero_weights_gives_equal_layer_counts():
    fqns = generate_fqns_per_stage(4, 4, 0, 0)
    assert [len([n for n in s if n.startswith("layers.")]) for s in fqns] == [1, 1, 1, 1]
    assert fqns[0][0] == "tok_embeddings" and fqns[-1][-2:] == ["norm", "output"]


def test_generate_rejects_more_stages_than_units():
    with pytest.raises(ValueError, match=r"cannot split n_layers=2 .* into 5 pipeline stages"):
        generate_fqns_per_stage(5, 2, 1, 1)


def test_generate_rejects_embedding_weight_larger_than_a_stage():
    with pytest.raises(ValueError, match="fewer than the embedding/output weight"):
        generate_fqns_per_stage(2, 2, 4, 0)


# --- splitting a model keeps FQNs and numerics ---------------------------------------------------
def test_split_parts_keep_fqns_and_chain_to_the_full_forward():
    torch.manual_seed(0)
    full = Transformer(_args(4))
    full.init_weights()
    fqns = generate_fqns_per_stage(3, 4, 1, 1)
    parts = [split_model_part(full, names) for names in fqns]
    full_keys = set(full.state_dict())
    seen: set[str] = set()
    for part in parts:
        keys = set(part.state_dict())
        assert keys <= full_keys and not keys & seen
        seen |= keys
    assert seen == full_keys
    assert parts[0].norm is None and parts[0].output is None and parts[1].tok_embeddings is None
    assert list(parts[1].layers.keys()) == ["1", "2"]  # 6 units over 3 stages: 2, 2, 2
    tokens = torch.randint(0, 128, (2, 16))
    h = tokens
    for part in parts:
        h = part(h)
    torch.testing.assert_close(h, full(tokens), rtol=0, atol=0)


def test_split_works_on_meta_and_leaves_the_source_intact():
    model = _meta_model(4)
    part = split_model_part(model, ["layers.3", "norm", "output"])
    assert part.tok_embeddings is None and list(part.layers.keys()) == ["3"]
    assert model.tok_embeddings is not None and len(model.layers) == 4


def test_split_rejects_module_list():
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="needs an nn.ModuleDict"):
        split_model_part(model, ["layers.0"])


@pytest.mark.parametrize(
    "fqns, message",
    [
        (
            [["tok_embeddings", "layers.0", "layers.1"], ["layers.3", "norm", "output"]],
            r"'layers.2' is in no model part",
        ),
        (
            [
                ["tok_embeddings", "layers.0", "layers.1", "layers.2"],
                ["layers.2", "layers.3", "norm", "output"],
            ],
            r"'layers.2' is in both model part 0 and model part 1",
        ),
        (
            [
                ["tok_embeddings", "layers.0", "layers.1"],
                ["layers.2", "layers.3", "layers.9", "norm", "output"],
            ],
            r"names 'layers.9', which is not a module",
        ),
        (
            [
                ["layers.2", "layers.3", "norm", "output"],
                ["tok_embeddings", "layers.0", "layers.1"],
            ],
            r"list the parts in model order",
        ),
        ([["tok_embeddings", "layers", "norm", "output"], []], r"model part 1 is empty"),
    ],
)
def test_explicit_fqns_are_validated(fqns, message):
    with pytest.raises(ValueError, match=r"parallelism.module_fqns_per_model_part: .*" + message):
        validate_fqns_per_stage(_meta_model(4), fqns)


def test_explicit_fqns_accept_a_whole_module_dict():
    validate_fqns_per_stage(_meta_model(2), [["tok_embeddings", "layers"], ["norm", "output"]])


# --- stage placement and schedules -----------------------------------------------------------
def test_stage_ids_looped_and_v_shaped():
    assert [stage_ids_this_rank(r, 4, 8) for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [stage_ids_this_rank(r, 4, 8, "v") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        stage_ids_this_rank(0, 2, 6, "v")


def test_unknown_schedule_lists_the_valid_names():
    with pytest.raises(
        ValueError,
        match="'Bogus' is not a known schedule; use one of GPipe, 1F1B, "
        "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
        "ZBVZeroBubble, DualPipeV",
    ):
        get_schedule_class("Bogus")
    assert get_schedule_class("interleaved1f1b") is SCHEDULES["Interleaved1F1B"]


@pytest.mark.parametrize(
    "schedule, expected_stages, ids_rank1",
    [
        ("GPipe", 2, (1,)),
        ("1F1B", 2, (1,)),
        ("Interleaved1F1B", 4, (1, 3)),
        ("LoopedBFS", 4, (1, 3)),
        ("InterleavedZeroBubble", 4, (1, 3)),
        ("ZBVZeroBubble", 4, (1, 2)),
        ("DualPipeV", 4, (1, 2)),
    ],
)
def test_default_layout_per_schedule(schedule, expected_stages, ids_rank1):
    layout = resolve_pipeline_layout(_pp_cfg(2, schedule), _meta_model(4), 4, pp_rank=1)
    assert layout.num_stages == expected_stages and layout.stage_ids == ids_rank1
    assert len(layout.fqns_per_stage) == expected_stages
    # every stage's rank (the tied-embedding copies find each other by it), from either rank
    assert [layout.stage_ranks[s] for s in ids_rank1] == [1] * len(ids_rank1)
    assert layout.stage_ranks == resolve_pipeline_layout(
        _pp_cfg(2, schedule), _meta_model(4), 4, pp_rank=0).stage_ranks


def test_layers_per_stage_sets_the_stage_count():
    # 6 layers + 1 + 1 = 8 units / 2 per stage = 4 stages -> 2 per rank
    cfg = _pp_cfg(2, "Interleaved1F1B", pipeline_parallel_layers_per_stage=2)
    layout = resolve_pipeline_layout(cfg, _meta_model(6), 6, pp_rank=0)
    assert layout.num_stages == 4 and layout.stage_ids == (0, 2)
    assert layout.fqns_per_stage[0] == ["tok_embeddings", "layers.0"]


def test_layers_not_splittable_over_pp_is_rejected():
    # 4 + 1 + 1 = 6 units / 2 = 3 stages: not a multiple of pp=2
    cfg = _pp_cfg(2, "Interleaved1F1B", pipeline_parallel_layers_per_stage=2)
    with pytest.raises(
        ValueError, match=r"-> 3 stages\) cannot be spread evenly over pipeline_parallel_degree=2"
    ):
        resolve_pipeline_layout(cfg, _meta_model(4), 4, pp_rank=0)


def test_single_stage_schedule_rejects_two_stages_per_rank():
    cfg = _pp_cfg(
        2,
        "1F1B",
        pipeline_parallel_layers_per_stage=1,
        pipeline_parallel_first_stage_less_layers=0,
        pipeline_parallel_last_stage_less_layers=0,
    )
    with pytest.raises(
        ValueError, match="schedule 1F1B runs one stage per rank, .* gives 2 per rank"
    ):
        resolve_pipeline_layout(cfg, _meta_model(4), 4, pp_rank=0)


def test_too_many_stages_for_the_layers_is_rejected():
    cfg = _pp_cfg(4, "Interleaved1F1B")  # 8 stages for 2 layers + 2 = 4 units
    with pytest.raises(ValueError, match="cannot split n_layers=2 .* into 8 pipeline stages"):
        resolve_pipeline_layout(cfg, _meta_model(2), 2, pp_rank=0)


def test_v_schedule_needs_exactly_two_stages_per_rank():
    cfg = _pp_cfg(2, "ZBVZeroBubble", pipeline_parallel_layers_per_stage=1)  # 6 units -> 3/rank
    with pytest.raises(ValueError, match="needs exactly 2 stages per rank"):
        resolve_pipeline_layout(cfg, _meta_model(4), 4, pp_rank=0)


def test_explicit_fqns_set_stages():
    fqns = [
        ["tok_embeddings", "layers.0"],
        ["layers.1"],
        ["layers.2"],
        ["layers.3", "norm", "output"],
    ]
    layout = resolve_pipeline_layout(
        _pp_cfg(2, "LoopedBFS", module_fqns_per_model_part=fqns), _meta_model(4), 4, pp_rank=1
    )
    assert layout.num_stages == 4 and layout.stage_ids == (1, 3) and layout.fqns_per_stage == fqns


# --- CSV schedules -------------------------------------------------------------------------------
def test_csv_placement_is_read_from_the_action_table(tmp_path):
    path = tmp_path / "sched.csv"
    path.write_text("0F0,0F1,3F0,3B0,3F1,3B1,0B0,0B1\n1F0,1F1,2F0,2B0,2F1,2B1,1B0,1B1\n")
    assert read_csv_stage_placement(str(path)) == {0: [0, 3], 1: [1, 2]}
    layout = resolve_pipeline_layout(
        _pp_cfg(2, pipeline_parallel_schedule_csv=str(path)), _meta_model(4), 4, pp_rank=1
    )
    assert layout.num_stages == 4 and layout.stage_ids == (1, 2) and layout.csv_path == str(path)
    assert layout.stage_ranks == (0, 1, 1, 0)


def test_csv_errors(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="pipeline_parallel_schedule_csv='/nope.csv' does not exist"
    ):
        read_csv_stage_placement("/nope.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0X1\n")
    with pytest.raises(ValueError, match="invalid action '0X1'"):
        read_csv_stage_placement(str(bad))
    one_row = tmp_path / "one.csv"
    one_row.write_text("0F0,1F0,1B0,0B0\n")
    with pytest.raises(ValueError, match="has 1 rows but pipeline_parallel_degree=2"):
        resolve_pipeline_layout(
            _pp_cfg(2, pipeline_parallel_schedule_csv=str(one_row)), _meta_model(4), 4, pp_rank=0
        )


# --- microbatches ------------------------------------------------------------------------------
def test_microbatch_size_must_divide_local_batch():
    assert n_microbatches_for(_pp_cfg(pipeline_parallel_microbatch_size=2), 8) == 4
    with pytest.raises(
        ValueError,
        match="pipeline_parallel_microbatch_size=3 must be >= 1 and divide "
        "training.local_batch_size=8",
    ):
        n_microbatches_for(_pp_cfg(pipeline_parallel_microbatch_size=3), 8)


def test_older_microbatch_count_sets_it_directly():
    assert n_microbatches_for(_pp_cfg(pipeline_parallel_microbatches=2), 8) == 2
    with pytest.raises(ValueError, match="pipeline_parallel_microbatches=3 must be >= 1 and divide "
                                         "training.local_batch_size=8"):
        n_microbatches_for(_pp_cfg(pipeline_parallel_microbatches=3), 8)
    both = _pp_cfg(pipeline_parallel_microbatches=4, pipeline_parallel_microbatch_size=2)
    with pytest.raises(ValueError, match="both set the microbatching; set one"):
        n_microbatches_for(both, 8)


@pytest.mark.parametrize(
    "schedule, n_mb, message",
    [
        ("1F1B", 1, "1F1B needs at least as many microbatches as stages: got 1 microbatches for 2"),
        (
            "DualPipeV",
            3,
            "DualPipeV needs at least as many microbatches as stages: got 3 microbatches for 4",
        ),
        ("Interleaved1F1B", 5, r"multiple of the rounds max\(1, n_microbatches // pp\) = 2"),
        ("InterleavedZeroBubble", 5, "InterleavedZeroBubble needs the number of microbatches"),
    ],
)
def test_too_few_or_uneven_microbatches_are_rejected(schedule, n_mb, message):
    layout = resolve_pipeline_layout(_pp_cfg(2, schedule), _meta_model(4), 4, pp_rank=0)
    with pytest.raises(ValueError, match=message):
        check_microbatches(layout, n_mb, 2)


@pytest.mark.parametrize(
    "schedule, n_mb",
    [("GPipe", 1), ("1F1B", 2), ("Interleaved1F1B", 1), ("ZBVZeroBubble", 1), ("DualPipeV", 4)],
)
def test_supported_microbatch_counts_pass(schedule, n_mb):
    layout = resolve_pipeline_layout(_pp_cfg(2, schedule), _meta_model(4), 4, pp_rank=0)
    check_microbatches(layout, n_mb, 2)


# --- pipeline_llama's up-front errors (no process group needed) ---------------------------------
def _stub_dims():
    mesh = SimpleNamespace(get_local_rank=lambda: 0, get_group=lambda: None)
    return SimpleNamespace(get_mesh=lambda name: mesh if name == "pp" else None)


def _job(schedule: str = "1F1B", local_bs: int = 4, mbs: int = 1) -> JobConfig:
    cfg = JobConfig()
    cfg.parallelism.pipeline_parallel_degree = 2
    cfg.parallelism.pipeline_parallel_schedule = schedule
    cfg.parallelism.pipeline_parallel_microbatch_size = mbs
    cfg.training.local_batch_size = local_bs
    return cfg


def test_pipeline_llama_rejects_too_few_microbatches_before_building_stages():
    args = _args(4)
    with pytest.raises(ValueError, match="1F1B needs at least as many microbatches as stages"):
        pipeline_llama(
            _meta_model(4),
            _stub_dims(),
            _job(local_bs=1),
            torch.device("cpu"),
            args,
            None,
            None,
        )



def test_split_points_cut_stages_like_upstreams_older_setting():
    cfg = _pp_cfg(2, "LoopedBFS", pipeline_parallel_split_points=["layers.1", "layers.2", "layers.4"])
    layout = resolve_pipeline_layout(cfg, _meta_model(6), 6, pp_rank=0)
    assert layout.num_stages == 4 and layout.stage_ids == (0, 2)
    assert layout.fqns_per_stage == [
        ["tok_embeddings", "layers.0"],
        ["layers.1"],
        ["layers.2", "layers.3"],
        ["layers.4", "layers.5", "norm", "output"],
    ]
    # the same cut as the equivalent module_fqns_per_model_part
    explicit = _pp_cfg(2, "LoopedBFS", module_fqns_per_model_part=layout.fqns_per_stage)
    assert resolve_pipeline_layout(explicit, _meta_model(6), 6, pp_rank=0) == layout


@pytest.mark.parametrize(
    ("points", "message"),
    [
        (["layers.0"], r"'layers.0' is not a layer that can start a stage \(4 layers\); use "
                       r"layers.1 ... layers.3"),
        (["layers.4"], "'layers.4' is not a layer"),
        (["norm"], "'norm' is not a layer"),
        (["layers.2", "layers.1"], "'layers.1' does not come after the split point before it"),
        (["layers.2", "layers.2"], "'layers.2' does not come after"),
    ],
)
def test_bad_split_points_name_the_point(points, message):
    cfg = _pp_cfg(2, "1F1B", pipeline_parallel_split_points=points)
    with pytest.raises(ValueError, match=r"parallelism.pipeline_parallel_split_points: " + message):
        resolve_pipeline_layout(cfg, _meta_model(4), 4, pp_rank=0)


@pytest.mark.parametrize(
    ("kw", "names"),
    [
        (dict(pipeline_parallel_split_points=["layers.2"],
              module_fqns_per_model_part=[["tok_embeddings"], ["norm"]]),
         "module_fqns_per_model_part and pipeline_parallel_split_points"),
        (dict(pipeline_parallel_layers_per_stage=2,
              module_fqns_per_model_part=[["tok_embeddings"], ["norm"]]),
         "module_fqns_per_model_part and pipeline_parallel_layers_per_stage"),
        (dict(pipeline_parallel_layers_per_stage=2, pipeline_parallel_split_points=["layers.2"]),
         "pipeline_parallel_split_points and pipeline_parallel_layers_per_stage"),
    ],
)
def test_only_one_way_to_cut_stages(kw, names):
    # (one of them used to win silently)
    with pytest.raises(ValueError, match=f"parallelism.{names} both cut the pipeline stages; "
                                         "set one of them"):
        resolve_pipeline_layout(_pp_cfg(2, "1F1B", **kw), _meta_model(4), 4, pp_rank=0)


def test_split_points_stage_count_must_suit_the_schedule():
    cfg = _pp_cfg(2, "1F1B", pipeline_parallel_split_points=["layers.1", "layers.2", "layers.3"])
    with pytest.raises(ValueError, match=r"split_points \(4 stages\).*1F1B runs one stage per rank|"
                                         r"1F1B runs one stage per rank, but parallelism.pipeline_parallel_split_points"):
        resolve_pipeline_layout(cfg, _meta_model(4), 4, pp_rank=0)
