"""Qwen3 / Qwen3-MoE: published sizes, FLOPs, HF logits parity both ways, errors, training.

HF models are built offline from a config (no downloads) with random weights scaled up so
attention and routing are far from uniform (the negative controls then move the logits by
O(1)). Parity is fp32, max abs diff < 1e-4 on logits of magnitude ~9; measured, in both
directions: dense 8.6e-6, MoE 1.1e-5.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.conftest import load_script  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager, fs, hf, load, save  # noqa: E402
from torchtitan.config.job_config import Checkpoint  # noqa: E402
from torchtitan.models import get_model_spec  # noqa: E402
from torchtitan.models.common.moe import MoEArgs  # noqa: E402
from torchtitan.models.qwen3.args import Qwen3ModelArgs  # noqa: E402
from torchtitan.models.qwen3.model import Qwen3Model  # noqa: E402
from torchtitan.models.qwen3.state_dict_adapter import (  # noqa: E402
    Qwen3StateDictAdapter,
    model_args_from_hf_config,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # 2 shared cores: OpenMP spin otherwise

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4
VOCAB = 256




# --------------------------------------------------------------------- published sizes

# The Hub config.json values of each release (written out here, not derived from our flavors):
# hidden, layers, heads, kv heads, intermediate, tied, (moe_intermediate, experts, top_k).
PUBLISHED = {
    "0.6B": (1024, 28, 16, 8, 3072, True, None),
    "1.7B": (2048, 28, 16, 8, 6144, True, None),
    "4B": (2560, 36, 32, 8, 9728, True, None),
    "8B": (4096, 36, 32, 8, 12288, False, None),
    "14B": (5120, 40, 40, 8, 17408, False, None),
    "32B": (5120, 64, 64, 8, 25600, False, None),
    "30B-A3B": (2048, 48, 32, 4, 6144, False, (768, 128, 8)),
    "235B-A22B": (4096, 94, 64, 4, 12288, False, (1536, 128, 8)),
}
EXPECTED_PARAMS = {
    "0.6B": 596_049_920,
    "1.7B": 1_720_574_976,
    "4B": 4_022_468_096,
    "8B": 8_190_735_360,
    "14B": 14_768_307_200,
    "32B": 32_762_123_264,
    "30B-A3B": 30_532_122_624,
    "235B-A22B": 235_093_634_560,
}


def _hf_count(flavor: str, n_layers: int) -> int:
    hidden, _, heads, kv, inter, tied, moe = PUBLISHED[flavor]
    common = dict(vocab_size=151936, hidden_size=hidden, num_hidden_layers=n_layers,
                  num_attention_heads=heads, num_key_value_heads=kv, head_dim=128,
                  intermediate_size=inter, tie_word_embeddings=tied)
    if moe is None:
        cfg, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=moe[0],
                                          num_experts=moe[1], num_experts_per_tok=moe[2])
        cls = transformers.Qwen3MoeForCausalLM
    with torch.device("meta"):
        model = cls(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_flavor_matches_hub_config_and_transformers_count(flavor):
    hidden, layers, heads, kv, inter, tied, moe = PUBLISHED[flavor]
    args = get_model_spec("qwen3").get_model_args(flavor)
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.hidden_dim,
            args.tie_word_embeddings, args.head_dim, args.vocab_size) == (
        hidden, layers, heads, kv, inter, tied, 128, 151936)
    assert args.rope_theta == 1e6 and args.norm_eps == 1e-6
    if moe is not None:
        m = args.moe_args
        assert (args.moe_hidden_dim, m.num_experts, m.top_k) == moe
        assert m.score_func == "softmax" and m.route_norm and m.num_shared_experts == 0
    with torch.device("meta"):
        ours = sum(p.numel() for p in Qwen3Model(args).parameters())
    # transformers' count (linear in the layers: built with 1 and 2 layers to stay fast)
    one, two = _hf_count(flavor, 1), _hf_count(flavor, 2)
    assert ours == one + (layers - 1) * (two - one) == EXPECTED_PARAMS[flavor]


def test_flops_count_top_k_experts_and_attention():
    args = get_model_spec("qwen3").get_model_args("30B-A3B")
    with torch.device("meta"):
        model = Qwen3Model(args)
    seq = 4096
    nparams, flops = args.get_nparams_and_flops(model, seq)
    d, n_layers, e, k, h = 2048, 48, 128, 8, 768
    attention_params = d * (32 * 128) * 2 + d * (4 * 128) * 2 + 2 * 128 + 2 * d
    active_layer = attention_params + d * e + k * 3 * d * h  # router + top-k experts
    active = n_layers * active_layer + d + 151936 * d  # final norm, output (embedding: lookup)
    # Qwen's "3.3B activated" counts the embedding too
    assert active + 151936 * d == pytest.approx(3.3e9, rel=0.02)
    assert flops == 6 * active + 12 * n_layers * 32 * 128 * seq
    assert nparams == EXPECTED_PARAMS["30B-A3B"]
    # dense: every parameter but the (untied) embedding
    args8 = get_model_spec("qwen3").get_model_args("8B")
    with torch.device("meta"):
        n8, f8 = args8.get_nparams_and_flops(Qwen3Model(args8), seq)
    assert f8 == 6 * (n8 - 151936 * 4096) + 12 * 36 * 32 * 128 * seq


# --------------------------------------------------------------------- HF parity

def _hf_model(tmp_path: Path, moe: bool) -> tuple[object, Path]:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=64, rope_theta=1e6, rms_norm_eps=1e-6)
    if moe:  # layer 1 dense (mlp_only_layers): both FFN kinds in one model
        cfg = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=48, num_experts=8,
                                          num_experts_per_tok=2, norm_topk_prob=True,
                                          mlp_only_layers=[1])
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.Qwen3Config(**common, tie_word_embeddings=True)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.25)
    folder = tmp_path / ("hf_moe" if moe else "hf_dense")
    model.save_pretrained(folder)
    return model, folder


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


def _ours(args: Qwen3ModelArgs, sd: dict[str, torch.Tensor]) -> Qwen3Model:
    model = Qwen3Model(args)
    model.init_weights()
    model.load_state_dict(sd, strict=True)
    return model.eval()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_hf_to_ours_logits_match(tmp_path, capsys, moe):
    ref_model, folder = _hf_model(tmp_path, moe)
    config = json.loads((folder / "config.json").read_text())
    args = model_args_from_hf_config(config)
    assert args.is_moe == moe and args.head_dim == 32 and args.tie_word_embeddings == (not moe)
    if moe:
        assert [args.is_moe_layer(i) for i in range(3)] == [True, False, True]
        assert args.moe_args.route_norm and args.moe_hidden_dim == 48
    # convert_hf_to_dcp picks qwen3 from config.json's model_type
    out = tmp_path / "dcp"
    assert load_script("convert_hf_to_dcp").main([str(folder), str(out)]) == 0
    capsys.readouterr()
    assert fs.verify_checkpoint(str(out))[0] == ""
    ours = _ours(args, load.load_dcp_model_tensors(str(out)))
    tokens = _tokens()
    ref = _logits(ref_model, tokens)
    diff = (_logits(ours, tokens) - ref).abs().max().item()
    assert diff < TOL and ref.abs().max() > 3
    # transformers' in-memory layout (fused gate_up_proj experts) converts the same way
    fused = Qwen3StateDictAdapter(args).from_hf(ref_model.state_dict())
    assert (_logits(_ours(args, fused), tokens) - ref).abs().max().item() < TOL
    # negative control: gate and up projections swapped (dense and expert) -> clearly wrong
    raw = load.load_dcp_model_tensors(str(out))
    for key in list(raw):
        if key.endswith(("feed_forward.w1.weight", "moe.experts.w1")):
            other = key.replace("w1", "w3")
            raw[key], raw[other] = raw[other], raw[key]
    assert (_logits(_ours(args, raw), tokens) - ref).abs().max().item() > 0.1


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_ours_to_hf_export_matches(tmp_path, capsys, moe):
    args = Qwen3ModelArgs(
        dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=VOCAB,
        hidden_dim=96, max_seq_len=64, tie_word_embeddings=not moe, moe_hidden_dim=48,
        moe_args=MoEArgs(num_experts=8, top_k=2, route_norm=True) if moe else None,
        mlp_only_layers=[1] if moe else [],
    )
    torch.manual_seed(3)
    ours = Qwen3Model(args)
    ours.init_weights()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.25)
    adapter = Qwen3StateDictAdapter(args)
    ckpt = tmp_path / "step-7"
    weights = {k: v.detach() for k, v in ours.state_dict().items()}
    save.save_dcp_single_process(weights, str(ckpt), {"step": 7, **hf.model_info(adapter)})
    out = tmp_path / "export"
    # no --flavor: the architecture recorded in the checkpoint (moe_args included) is used
    assert load_script("convert_dcp_to_hf").main([str(ckpt), str(out), "--model", "qwen3"]) == 0
    capsys.readouterr()
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors"} <= files
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ("qwen3_moe" if moe else "qwen3")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    if moe:  # the Hub layout: one tensor per expert and projection
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys
        assert "model.layers.0.mlp.gate.weight" in keys
        assert "model.layers.1.mlp.up_proj.weight" in keys
    else:
        assert "lm_head.weight" not in keys  # tied
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == ("Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM")
    tokens = _tokens()
    ref = _logits(ours.eval(), tokens)
    assert (_logits(back, tokens) - ref).abs().max().item() < TOL and ref.abs().max() > 3


def test_checkpoint_manager_hf_initial_load_and_last_save_moe(tmp_path):
    hf_model, folder = _hf_model(tmp_path, moe=True)
    args = model_args_from_hf_config(json.loads((folder / "config.json").read_text()))
    model = Qwen3Model(args)
    model.init_weights()

    def manager(**kw) -> CheckpointManager:
        cfg = Checkpoint(enable=True, interval=100, **kw)
        return CheckpointManager(None, [model], None, None, {}, cfg, str(tmp_path / "run"),
                                 Qwen3StateDictAdapter(args))

    assert manager(initial_load_path=str(folder), initial_load_in_hf=True).load()
    assert model.layers["0"].moe.expert_bias.abs().max() == 0  # HF has no routing bias
    tokens = _tokens()
    ref = _logits(hf_model, tokens)
    assert (_logits(model.eval(), tokens) - ref).abs().max().item() < TOL
    manager(last_save_in_hf=True, last_save_model_only=True).save(5, last_step=True)
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(
        tmp_path / "run" / "checkpoint" / "step-5" / "hf"
    ).eval()
    assert (_logits(back, tokens) - ref).abs().max().item() < TOL


def test_adapter_errors_are_one_line():
    args = Qwen3ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=32,
                          vocab_size=VOCAB, hidden_dim=96, moe_hidden_dim=48,
                          moe_args=MoEArgs(num_experts=4, top_k=2))
    adapter = Qwen3StateDictAdapter(args)
    partial = {f"model.layers.0.mlp.experts.{j}.gate_proj.weight": torch.zeros(48, 64)
               for j in range(3)}
    with pytest.raises(ValueError, match=r"HF layer 0 has experts .* but the model has 4 \(missing \[3\]\)"):
        adapter.from_hf(partial)
    with pytest.raises(ValueError, match="cannot map 1 HF key"):
        adapter.from_hf({"model.layers.0.mlp.shared_expert.weight": torch.zeros(1)})
    shared = Qwen3ModelArgs(moe_args=MoEArgs(num_experts=4, top_k=2, num_shared_experts=1))
    with pytest.raises(ValueError, match="num_shared_experts=1 cannot be expressed in HF Qwen3-MoE"):
        Qwen3StateDictAdapter(shared).hf_config()
    with pytest.raises(ValueError, match="use_sliding_window=true is not supported"):
        model_args_from_hf_config({"model_type": "qwen3", "use_sliding_window": True})


# --------------------------------------------------------------------- errors and training

def test_bad_settings_give_one_clear_line():
    from torchtitan.config.manager import ConfigManager
    from torchtitan.preflight import check_run

    spec = get_model_spec("qwen3")
    with pytest.raises(ValueError, match=r"^model.flavor '0.6b' is not a flavor of model 'qwen3'; "
                       r"known flavors: .*Did you mean '0.6B'\?$"):
        spec.get_model_args("0.6b")
    bad = spec.get_model_args("debugmodel_moe")
    bad.moe_args.top_k = 9
    with pytest.raises(ValueError, match=r"^moe top_k=9 must be between 1 and num_experts=8$"):
        Qwen3Model(bad)
    cfg = ConfigManager().parse_args([
        "--job.config_file", str(REPO / "train_configs" / "qwen3_debugmodel.toml"),
        "--parallelism.tensor_parallel_degree", "3",
    ])
    with pytest.raises(Exception, match=r"tensor_parallel_degree=3 must divide the model's n_heads=8"):
        check_run(cfg, 3, device_type="cpu")


def test_dense_tp_must_divide_the_ffn_width():
    from torchtitan.distributed.parallel_dims import ParallelismError
    from torchtitan.models.qwen3.parallelize import check_qwen3_tp

    args = Qwen3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                          vocab_size=VOCAB, hidden_dim=90)
    with torch.device("meta"):
        model = Qwen3Model(args)
    with pytest.raises(ParallelismError, match=r"^parallelism.tensor_parallel_degree=4 must "
                       r"divide the model's feed-forward hidden_dim=90"):
        check_qwen3_tp(model, 4)
    check_qwen3_tp(model, 2)
    moe = Qwen3ModelArgs(**{**args.__dict__, "moe_args": MoEArgs(num_experts=4, top_k=1)})
    with torch.device("meta"):
        check_qwen3_tp(Qwen3Model(moe), 4)  # MoE layers are not TP-sharded: any width


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_trainer_loss_falls_on_cpu(tmp_path, flavor):
    from tests.integration.trainer_utils import RecordingTrainer
    from torchtitan.config.manager import ConfigManager

    cfg = ConfigManager().parse_args([
        "--job.config_file", str(REPO / "train_configs" / f"qwen3_{flavor}.toml"),
        "--job.dump_folder", str(tmp_path), "--training.seq_len", "128",
        "--training.local_batch_size", "4", "--training.steps", "8", "--optimizer.lr", "3e-3",
        "--lr_scheduler.warmup_steps", "1", "--activation_checkpoint.mode", "none",
        "--debug.seed", "0", "--metrics.disable_color_printing",
    ])
    trainer = RecordingTrainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    losses = [loss for loss, _ in trainer.history]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 1.0, losses
    if flavor == "debugmodel_moe":
        layers = trainer.run.moe_layers
        assert len(layers) == 4
        assert all(layer.expert_bias.abs().sum() > 0 for layer in layers)  # bias was updated
