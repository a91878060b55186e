"""Document masking: block-causal attention equals running each document on its own.

The reference splits every packed row at its document boundaries and runs the plain causal
model on each piece separately (RoPE is relative, so a document's attention does not depend on
where it sits in the row); logits and parameter gradients of the block-causal model (SDPA with
a boolean mask, the CPU training path) must equal it within fp32 tolerance. FlexAttention has
no backward on CPU, so its kernel is checked forward-only against the same reference.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.common import document_mask
from torchtitan.models.common.document_mask import (
    attend,
    boolean_mask,
    build_attention_mask,
    document_ids,
)
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model import Transformer

BOS, EOS, VOCAB, SEQ = 1, 2, 300, 48
TOL = dict(rtol=1e-5, atol=1e-5)
pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.usefixtures("one_thread"),  # small matmuls: OpenMP spin on 2 shared cores costs more
]


def tiny_args(**kw):
    args = copy.deepcopy(llama3_args["debugmodel_tiny"])  # dim 64, 2 layers, 4 heads, 2 kv
    args.vocab_size, args.max_seq_len = VOCAB, SEQ
    for key, value in kw.items():
        setattr(args, key, value)
    return args


def packed_batch(seed: int = 0) -> torch.Tensor:
    """Two rows of ``[BOS] doc [EOS]`` documents of uneven lengths (one cut at the start)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lengths in ([7, 12, 1, 20], [30, 10]):
        row = torch.randint(3, VOCAB, (3,), generator=g).tolist()  # the tail of a cut document
        row.append(EOS)
        for n in lengths:
            row += [BOS, *torch.randint(3, VOCAB, (n,), generator=g).tolist(), EOS]
        rows.append((row + [BOS] + [5] * SEQ)[:SEQ])
    return torch.tensor(rows)


def models(**kw):
    torch.manual_seed(0)
    causal = Transformer(tiny_args())
    causal.init_weights()
    block = Transformer(tiny_args(attn_mask_type="block_causal", **kw))
    block.load_state_dict(causal.state_dict())
    return causal, block


def per_document_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Each document of each row through ``model`` on its own, logits put back in place."""
    docs = document_ids(tokens, BOS, EOS)
    out = []
    for row, ids in zip(tokens, docs):
        pieces = [model(row[ids == d][None])[0] for d in ids.unique(sorted=True)]
        out.append(torch.cat(pieces))
    return torch.stack(out)


def loss_of(logits, tokens):
    labels = torch.roll(tokens, -1, dims=1)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_document_ids_from_bos_and_eos():
    t = torch.tensor([[7, 2, 1, 8, 9, 2, 1, 5], [1, 3, 4, 5, 6, 7, 8, 9]])
    assert document_ids(t, 1, 2).tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [0] * 8]
    # only EOS (a new document right after it), only BOS
    assert document_ids(t, -1, 2).tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [0] * 8]
    assert document_ids(t, 1, -1).tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [0] * 8]
    assert document_ids(torch.tensor([[3, 2, 4, 2]]), -1, 2).tolist() == [[0, 0, 1, 1]]


def assert_block_causal_equals_each_document_alone(causal, block) -> None:
    """Logits and gradients of ``block`` (block-causal) on a packed batch equal ``causal`` run on
    every document alone; and differ from ``causal`` on the whole rows (the test can fail)."""
    tokens = packed_batch()
    logits = block(tokens, document_ids=document_ids(tokens, BOS, EOS))
    loss_of(logits, tokens).backward()
    reference = per_document_logits(causal, tokens)
    loss_of(reference, tokens).backward()
    torch.testing.assert_close(logits, reference, **TOL)
    for name, grad in grads(block).items():
        torch.testing.assert_close(grad, grads(causal)[name], **TOL, msg=name)
    assert (causal(tokens) - logits).abs().max() > 1e-2


def test_block_causal_equals_each_document_alone():
    assert_block_causal_equals_each_document_alone(*models())


def test_block_causal_needs_document_ids():
    _, block = models()
    with pytest.raises(ValueError, match="block_causal' needs document_ids"):
        block(packed_batch())


@pytest.mark.parametrize("mask_type", ["causal", "block_causal"])
def test_flex_forward_equals_the_reference(mask_type, monkeypatch):
    """The flex kernel (eager flex_attention, forward only on CPU) with the model's masks."""
    monkeypatch.setattr(document_mask, "flex_supported", lambda device: True)
    monkeypatch.setattr(document_mask, "_compiled_flex_attention", _eager_flex)
    tokens = packed_batch(1)
    causal, block = models(use_flex_attn=True)
    block.model_args.attn_mask_type = mask_type
    with torch.no_grad():
        got = block(tokens, document_ids=document_ids(tokens, BOS, EOS))
        want = per_document_logits(causal, tokens) if mask_type == "block_causal" else causal(tokens)
    torch.testing.assert_close(got, want, **TOL)


def _eager_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def test_flex_on_cpu_trains_through_sdpa_with_one_info_line(caplog, monkeypatch):
    monkeypatch.setattr(document_mask, "_cpu_fallback_logged", False)
    tokens = packed_batch(2)
    causal, block = models(use_flex_attn=True)
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            block.zero_grad()
            logits = block(tokens, document_ids=document_ids(tokens, BOS, EOS))
            loss_of(logits, tokens).backward()
    lines = [r for r in caplog.records if "FlexAttention has no backward on CPU" in r.message]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    torch.testing.assert_close(logits, per_document_logits(causal, tokens), **TOL)
    # causal through the flex switch is today's causal SDPA
    causal_flex = Transformer(tiny_args(use_flex_attn=True))
    causal_flex.load_state_dict(causal.state_dict())
    torch.testing.assert_close(causal_flex(tokens), causal(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("window", [1, 5])
def test_sliding_window_masks_agree(window):
    """SDPA boolean mask == flex BlockMask == a hand-written reference, with documents."""
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, SEQ, 16, generator=g) for _ in range(3))
    tokens = packed_batch()
    docs = document_ids(tokens, BOS, EOS)
    keep = boolean_mask(docs, SEQ, window, "cpu")
    i, j = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None]
    hand = (j <= i) & (i - j < window) & (docs[:, :, None] == docs[:, None, :])
    assert torch.equal(keep[:, 0], hand)
    scores = (q @ k.transpose(-1, -2)) / 4.0
    reference = scores.masked_fill(~hand[:, None], float("-inf")).softmax(-1) @ v
    sdpa = attend(q, k, v, keep)
    block_mask = build_attention_mask(
        mask_type="block_causal", doc_ids=docs, seq_len=SEQ, batch_size=2,
        device=torch.device("cpu"), sliding_window=window, use_flex=False,
    )
    assert torch.equal(block_mask, keep)
    from torch.nn.attention.flex_attention import create_block_mask

    flex_mask = create_block_mask(document_mask.mask_mod(docs, window), 2, None, SEQ, SEQ, "cpu")
    with torch.no_grad():
        flex = flex_attention(q, k, v, block_mask=flex_mask)
    torch.testing.assert_close(sdpa, reference, **TOL)
    torch.testing.assert_close(flex, reference, **TOL)


def test_attention_config_keys(tmp_path):
    from types import SimpleNamespace

    from torchtitan.models.common.document_mask import apply_attention_config
    from torchtitan.models.qwen3 import qwen3_args

    cfg = SimpleNamespace(name="llama3", attn_mask_type="block_causal", use_flex_attn=True,
                          sliding_window_size=None)
    args = tiny_args()
    apply_attention_config(cfg, args)
    assert (args.attn_mask_type, args.use_flex_attn, args.sliding_window_size) == (
        "block_causal", True, None)
    unset = SimpleNamespace(name="llama3", attn_mask_type=None, use_flex_attn=None,
                            sliding_window_size=None)
    flavor = llama3_args["debugmodel_flex_attn"]
    apply_attention_config(unset, flavor)  # the flavor's own settings stay
    assert (flavor.attn_mask_type, flavor.use_flex_attn) == ("block_causal", True)
    qwen = copy.deepcopy(next(iter(qwen3_args.values())))
    apply_attention_config(cfg, qwen)  # Qwen3 (and DeepSeek-V3) have the settings too
    assert (qwen.attn_mask_type, qwen.use_flex_attn) == ("block_causal", True)
    # a family without the field (e.g. one registered by experimental.custom_import)
    custom = SimpleNamespace(attn_mask_type="causal", use_flex_attn=False)
    cfg.attn_mask_type, cfg.use_flex_attn, cfg.sliding_window_size = None, None, 8
    cfg.name = "custom"
    with pytest.raises(ValueError, match="model.sliding_window_size=8 is not supported by model "
                                         "custom: its flavors have no such setting"):
        apply_attention_config(cfg, custom)


MASKS = [("block_causal", None), ("causal", 5), ("block_causal", 4), ("causal", None)]


@pytest.mark.slow  # compiles create_block_mask (inductor, ~20 s on 2 cores)
def test_compiled_block_masks_equal_eager_ones(monkeypatch):
    """GPUs build FlexAttention masks with a compiled create_block_mask (no dense mask first);
    the result equals the eager one, for a whole sequence and for a context-parallel shard
    (where inductor's CPU code generation fails today: the fallback builds it eagerly)."""
    from torchtitan.distributed.context_parallel import sequence_order

    monkeypatch.setattr(document_mask, "_compile_block_masks", True)
    seq = 256
    tokens = torch.randint(3, 50, (2, seq), generator=torch.Generator().manual_seed(0))
    tokens[0, 100], tokens[1, 37], tokens[1, 200] = BOS, EOS, EOS
    rule = document_mask.mask_mod(document_mask.document_ids(tokens, BOS, EOS), 64)
    order = sequence_order(seq, 2, True)
    shard = document_mask.SequenceShard(order.view(2, -1)[1], order, lambda k, v: (k, v))
    cpu = torch.device("cpu")
    for mask_rule, q_len in ((rule, seq),
                             (document_mask._sharded_mask_mod(rule, shard, cpu), seq // 2)):
        eager = document_mask.block_mask(mask_rule, 2, q_len, seq, cpu, compiled=False)
        built = document_mask.block_mask(mask_rule, 2, q_len, seq, cpu, compiled=True)
        assert torch.equal(built.to_dense(), eager.to_dense())
        assert torch.equal(built.kv_num_blocks, eager.kv_num_blocks)


def test_masked_context_parallel_holds_the_same_positions_as_ring_attention():
    """Head-tail: rank r holds chunks r and 2cp-1-r (equal causal work per rank), as torch's
    ring attention does (tests/distributed/test_context_parallel.py); else contiguous."""
    from torchtitan.distributed.context_parallel import sequence_order

    assert sequence_order(8, 2, True).view(2, -1).tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert sequence_order(8, 2, False).view(2, -1).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sequence_order(12, 3, True).view(3, -1).tolist() == [
        [0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]


@pytest.mark.parametrize("flex", [False, True], ids=["sdpa", "flex"])
@pytest.mark.parametrize("load_balance", [True, False], ids=["head_tail", "contiguous"])
def test_a_sequence_shard_attends_like_its_rows_of_the_whole_sequence(
    flex, load_balance, monkeypatch
):
    """Context parallel with a mask: each of 2 ranks holds some positions of every row and
    attends to the gathered keys/values under its rows of the mask; that equals those rows of
    attention over the whole sequence, for documents, windows and both (FlexAttention forward
    runs on CPU; its backward does not, so the trainer uses the boolean mask there)."""
    from torchtitan.distributed.context_parallel import sequence_order

    monkeypatch.setattr(document_mask, "flex_supported", lambda device: True)
    torch.manual_seed(0)
    rows, heads, seq, dim = 2, 4, 16, 8
    q = torch.randn(rows, heads, seq, dim)
    k, v = (torch.randn(rows, heads // 2, seq, dim) for _ in range(2))  # grouped-query: 2 per kv
    tokens = torch.randint(3, 50, (rows, seq))
    tokens[0, 5], tokens[0, 11], tokens[1, 7] = BOS, EOS, BOS
    docs = document_mask.document_ids(tokens, BOS, EOS)
    cpu = torch.device("cpu")
    order = sequence_order(seq, 2, load_balance)
    assert sorted(order.tolist()) == list(range(seq))
    for mask_type, window in MASKS:
        kw = dict(mask_type=mask_type, doc_ids=docs, seq_len=seq, batch_size=rows,
                  device=cpu, sliding_window=window, use_flex=flex)
        whole = document_mask.attend(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                     build_attention_mask(**kw), compiled_flex=False)
        for rank in range(2):
            mine = order.view(2, -1)[rank]
            shard = document_mask.SequenceShard(
                mine, order, lambda _k, _v: (k[:, :, order], v[:, :, order]))
            mask = build_attention_mask(**kw, shard=shard)
            assert isinstance(mask, document_mask.ShardedMask)
            out = document_mask.attend(q[:, :, mine], k[:, :, mine], v[:, :, mine], mask,
                                       compiled_flex=False, n_rep=2)
            where = f"{mask_type} window {window} rank {rank}"
            torch.testing.assert_close(out, whole[:, :, mine], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, where=where: f"{where}: {m}")


def _family_models(family: str, flavor: str):
    from torchtitan.models import get_model_spec

    spec = get_model_spec(family)

    def build(**kw):
        args = copy.deepcopy(spec.get_model_args(flavor))
        args.vocab_size, args.max_seq_len = VOCAB, SEQ
        for key, value in kw.items():
            setattr(args, key, value)
        return spec.model_cls(args)

    torch.manual_seed(0)
    causal = build()
    causal.init_weights()
    block = build(attn_mask_type="block_causal")
    block.load_state_dict(causal.state_dict())
    return causal, block


@pytest.mark.parametrize("family, flavor", [("qwen3", "debugmodel"), ("qwen3", "debugmodel_moe"),
                                            ("deepseek_v3", "debugmodel")])
def test_block_causal_equals_each_document_alone_in_other_families(family, flavor):
    """Qwen3 (QK-norm, rotate-half RoPE, MoE) and DeepSeek-V3 (MLA with a softmax scale and a
    value head dim unlike the query's, MoE with shared experts) mask the same way."""
    assert_block_causal_equals_each_document_alone(*_family_models(family, flavor))
