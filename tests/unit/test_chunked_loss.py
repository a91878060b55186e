"""The chunked loss (output projection fused with cross-entropy) against the plain logits path:
values, gradients, ignored labels, autocast, the decoder's ``labels`` path, the largest tensor
it allocates, and when the trainer chooses it."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.components.chunked_loss import (
    check_loss_settings,
    choose_loss_path,
    linear_cross_entropy_sum,
)
from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_loss_sum
from torchtitan.config.job_config import Training

B, S, D, V = 2, 37, 16, 101


def _inputs(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, S, D, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(V, D, generator=g, dtype=dtype).requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :5] = IGNORE_INDEX
    labels[1, -3:] = IGNORE_INDEX
    return h, w, labels


def _loss_and_grads(fn, h, w, scale=0.37):
    h.grad = w.grad = None
    loss = fn()
    (loss * scale).backward()
    return loss.detach(), h.grad.clone(), w.grad.clone()


def _plain(h, w, labels):
    return lambda: cross_entropy_loss_sum(h @ w.t(), labels)


@pytest.mark.parametrize("chunk", [1, 7, S, B * S, 1000])
def test_equals_plain_path_in_float32(chunk):
    h, w, labels = _inputs()
    ref = _loss_and_grads(_plain(h, w, labels), h, w)
    got = _loss_and_grads(lambda: linear_cross_entropy_sum(h, w, labels, chunk), h, w)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-4)  # a sum of ~60 terms
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6)


def test_ignored_labels_add_nothing():
    h, w, labels = _inputs()
    all_ignored = torch.full_like(labels, IGNORE_INDEX)
    loss, gh, gw = _loss_and_grads(lambda: linear_cross_entropy_sum(h, w, all_ignored, 8), h, w)
    assert loss.item() == 0.0 and gh.abs().max() == 0 and gw.abs().max() == 0


def test_compiled_chunk_math_equals_eager():
    h, w, labels = _inputs(1)
    eager = _loss_and_grads(lambda: linear_cross_entropy_sum(h, w, labels, 16), h, w)
    compiled = _loss_and_grads(
        lambda: linear_cross_entropy_sum(h, w, labels, 16, compiled="aot_eager"), h, w
    )
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_compiled_chunk_writes_its_gradient_over_the_logits():
    """Inductor's code for a chunk allocates nothing of the chunk's [tokens, vocab] size (the
    eager math holds a float32 copy of it, gigabytes at a 128k vocabulary) and gives the eager
    math's loss and gradient."""
    import re

    from torch._inductor.utils import run_and_get_code

    from torchtitan.components import chunked_loss

    n, v = 24, 301
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[:3] = IGNORE_INDEX
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(n, v, generator=g).mul_(4).to(dtype)
        want_loss, want_grad = chunked_loss._chunk_loss_and_grad(logits.clone(), labels, dtype)
        torch._dynamo.reset()
        fn = torch.compile(chunked_loss._chunk_loss_grad_into_logits, backend="inductor")
        got = logits.clone()
        loss, code = run_and_get_code(fn, got, labels)
        buffers = re.findall(r"empty_strided\w*\(\(([^)]*)\)", "\n".join(code))
        assert buffers and all(f"{n}, {v}" not in shape for shape in buffers), buffers
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(got, want_grad, rtol=0, atol=1e-6)


def test_backward_scales_in_place_once():
    """The backward scales the gradients computed in the forward in place: a second backward
    through the same graph is torch's error, never gradients scaled twice."""
    h, w, labels = _inputs()
    loss = linear_cross_entropy_sum(h, w, labels, 16)
    (loss * 0.5).backward(retain_graph=True)
    first = w.grad.clone()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss * 0.5).backward()
    torch.testing.assert_close(w.grad, first)


def test_no_grad_gives_the_loss_only():
    h, w, labels = _inputs(2)
    with torch.no_grad():
        loss = linear_cross_entropy_sum(h, w, labels, 5)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, cross_entropy_loss_sum(h @ w.t(), labels).detach(),
                               rtol=1e-6, atol=1e-4)


def test_autocast_projects_in_bf16_like_linear():
    h, w, labels = _inputs(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _loss_and_grads(lambda: cross_entropy_loss_sum(
            torch.nn.functional.linear(h, w), labels), h, w)
        got = _loss_and_grads(lambda: linear_cross_entropy_sum(h, w, labels, 20), h, w)
    assert got[1].dtype == h.dtype and got[2].dtype == w.dtype
    # same bf16 logits; the logits' gradient is rounded to bf16 before the loss scale, not after
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(got[1], ref[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[2], ref[2], rtol=2e-2, atol=2e-2)


def test_mismatched_labels_are_one_line():
    h, w, labels = _inputs()
    with pytest.raises(ValueError, match="74 hidden states but 37 labels"):
        linear_cross_entropy_sum(h, w, labels[0], 8)


class _LargestAllocation(TorchDispatchMode):
    """Records the largest tensor (in elements) any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_materialises_the_logits():
    h, w, labels = _inputs()
    tokens = B * S
    with _LargestAllocation() as plain:
        _loss_and_grads(_plain(h, w, labels), h, w)
    with _LargestAllocation() as chunked:
        _loss_and_grads(lambda: linear_cross_entropy_sum(h, w, labels, 8), h, w)
    assert plain.largest >= tokens * V
    assert chunked.largest == max(8 * V, V * D, tokens * D)


def test_chunks_sum_the_weight_gradient_in_the_compute_dtype():
    """With several bf16 chunks no float32 tensor of the weight's size is made (that buffer is
    gigabytes at a 128k vocabulary), and the gradient stays within bf16 rounding of the
    one-chunk path's."""
    h, w, labels = _inputs(5, torch.bfloat16)
    one = _loss_and_grads(lambda: linear_cross_entropy_sum(h, w, labels, B * S), h, w)

    class _Float32Sizes(TorchDispatchMode):
        sizes: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.sizes.append(t.numel())
            return out

    with _Float32Sizes() as seen:
        chunked = _loss_and_grads(lambda: linear_cross_entropy_sum(h, w, labels, 8), h, w)
    assert max(seen.sizes) < V * D
    torch.testing.assert_close(chunked[2], one[2], rtol=2e-2, atol=2e-2)


def _tiny_decoder():
    from torchtitan.models import get_model_spec

    spec = get_model_spec("llama3")
    args = spec.get_model_args("debugmodel_tiny")
    args.vocab_size = 300
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    return model, args


def test_decoder_labels_path_equals_logits_path():
    model, args = _tiny_decoder()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=g)
    labels = torch.randint(0, args.vocab_size, (2, 24), generator=g)
    labels[:, :4] = IGNORE_INDEX

    def grads(loss):
        model.zero_grad()
        (loss / 10).backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_loss, ref = grads(cross_entropy_loss_sum(model(tokens), labels))
    model.output.loss_chunk_size = 7
    loss, got = grads(model(tokens, labels=labels))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-4)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


class _Head(torch.nn.Linear):
    pass


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_auto_chooses_chunked_on_cuda_only(device):
    model, _ = _tiny_decoder()
    assert choose_loss_path("auto", 64, device, model, False, False) is (device == "cuda")
    assert choose_loss_path("chunked", 64, device, model, False, False) is True
    assert choose_loss_path("logits", 64, device, model, False, False) is False


@pytest.mark.parametrize(
    "change, expected",
    [
        ("converted", "the output projection is a _Head (a converter replaced it"),
        ("family_loss", "this model family declares its own loss"),
        ("replicated", "parallelism.disable_loss_parallel gathers the logits"),
    ],
)
def test_chunked_where_it_cannot_apply(change, expected):
    model, args = _tiny_decoder()
    if change == "converted":
        model.output = _Head(args.dim, args.vocab_size, bias=False)
    family_loss, replicated = change == "family_loss", change == "replicated"
    with pytest.raises(ValueError) as err:
        choose_loss_path("chunked", 64, "cuda", model, family_loss, replicated)
    assert str(err.value).startswith("training.loss_implementation=chunked cannot apply: ")
    assert expected in str(err.value) and "\n" not in str(err.value)
    # auto falls back to the logits
    assert choose_loss_path("auto", 64, "cuda", model, family_loss, replicated) is False


def test_a_chunk_size_the_logits_path_ignores_warns(caplog):
    model, _ = _tiny_decoder()
    with caplog.at_level("WARNING", logger="torchtitan"):
        assert choose_loss_path("auto", 100, "cpu", model, False, False) is False
        assert choose_loss_path("logits", 100, "cuda", model, False, False) is False
        assert choose_loss_path("chunked", 100, "cpu", model, False, False) is True
        assert choose_loss_path("auto", 8192, "cpu", model, False, False) is False  # the default
    assert caplog.messages == [
        "training.loss_chunk_size=100 has no effect: the loss takes the full logits "
        "(training.loss_implementation=auto, which is chunked on CUDA only)",
        "training.loss_chunk_size=100 has no effect: the loss takes the full logits "
        "(training.loss_implementation=logits)",
    ]


def test_chunk_size_below_one_is_refused():
    with pytest.raises(ValueError, match=r"training.loss_chunk_size=0 must be >= 1"):
        check_loss_settings(Training(loss_chunk_size=0))
    check_loss_settings(Training())


def test_memory_estimate_plans_the_gpu_loss_path(caplog):
    """The estimator (fake tensors on the CPU) stands for a GPU run: ``auto`` counts the
    chunked loss there (Llama 3 8B on FSDP8: 32.4 instead of 40.2 GiB, docs/debugging.md)."""
    import logging

    from torchtitan.config.manager import ConfigManager
    from torchtitan.tools.memory_estimation import estimate_memory

    cfg = ConfigManager().parse_args([
        "--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "64",
        "--training.local_batch_size", "2"])
    with caplog.at_level(logging.INFO):
        estimate_memory(cfg, 2, steps=1)
    assert "Loss: output projection fused with cross-entropy" in caplog.text


class _LargestFloat32(TorchDispatchMode):
    """The most elements of a float32 tensor made inside, ``own``'s storage aside."""

    def __init__(self, own: torch.Tensor):
        super().__init__()
        self.own, self.largest = own.untyped_storage().data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and \
                out.untyped_storage().data_ptr() != self.own:
            self.largest = max(self.largest, out.numel())
        return out


def _whole_chunk_loss_and_grad(logits, labels, grad_dtype):
    """The eager chunk math over the whole chunk at once (one float32 copy of it)."""
    x = logits.float()
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, 0)
    lse = torch.logsumexp(x, dim=-1)
    loss = torch.where(valid, lse - x.gather(1, safe[:, None]).squeeze(1), 0.0).sum()
    grad = x.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, safe[:, None], -valid[:, None].to(grad.dtype))
    return loss, grad.mul_(valid[:, None]).to(grad_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_chunk_math_works_on_blocks_of_rows_with_the_whole_chunks_numbers(
        monkeypatch, dtype):
    """Blocks of 5 rows (the last one short): bit for bit the whole chunk's loss and gradient,
    the gradient written over the logits, and no float32 tensor of more than a block's rows
    (the whole chunk's float32 copy is 3.9 GiB for 8192 tokens of Llama 3's vocabulary)."""
    from torchtitan.components import chunked_loss

    n, v = 23, 301
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[0, 7, 22]] = IGNORE_INDEX
    logits = torch.randn(n, v, generator=g).mul_(4).to(dtype)
    want_loss, want_grad = _whole_chunk_loss_and_grad(logits.clone(), labels, dtype)
    monkeypatch.setattr(chunked_loss, "EAGER_BLOCK_BYTES", 4 * v * 5, raising=False)
    got = logits.clone()
    with _LargestFloat32(got) as tracked:
        loss, grad = chunked_loss._chunk_loss_and_grad(got, labels, dtype)
    assert torch.equal(loss, want_loss) and torch.equal(grad, want_grad)
    assert grad.data_ptr() == got.data_ptr()  # in the logits' own storage
    # float32 logits: the blocks are their own rows (only the per-row losses are new)
    assert tracked.largest == (5 * v if dtype == torch.bfloat16 else n)


def _whole_vocab_parallel_chunk(logits, labels, grad_dtype, vocab_start):
    """The vocabulary-parallel chunk math over the whole chunk at once, for a group of one."""
    x = logits.float()
    valid = labels != IGNORE_INDEX
    local = labels - vocab_start
    mine = valid & (local >= 0) & (local < x.shape[-1])
    safe = torch.where(mine, local, 0)
    row_max = x.max(dim=-1).values
    target = torch.where(mine, x.gather(1, safe[:, None]).squeeze(1) - row_max, 0.0)
    exp = x.sub_(row_max[:, None]).exp_()
    sum_exp = exp.sum(dim=-1)
    loss = torch.where(valid, torch.log(sum_exp) - target, 0.0).sum()
    grad = exp.div_(sum_exp[:, None])
    grad.scatter_add_(1, safe[:, None], -mine[:, None].to(grad.dtype))
    return loss, grad.mul_(valid[:, None]).to(grad_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_vocab_parallel_chunk_math_works_on_blocks_of_rows_with_the_whole_chunks_numbers(
        monkeypatch, dtype):
    """The TP path (its all-reduces over a group of one: identities), blocks of 5 rows, a
    vocabulary slice that holds some labels and not others: bit for bit the whole chunk's
    loss and gradient, the gradient over the logits, no float32 tensor over a block's rows."""
    from torchtitan.components import chunked_loss

    n, v, vocab_start = 23, 301, 150
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 2 * v, (n,), generator=g)
    labels[[0, 7, 22]] = IGNORE_INDEX
    logits = torch.randn(n, v, generator=g).mul_(4).to(dtype)
    want_loss, want_grad = _whole_vocab_parallel_chunk(logits.clone(), labels, dtype, vocab_start)
    monkeypatch.setattr(chunked_loss, "EAGER_BLOCK_BYTES", 4 * v * 5, raising=False)
    monkeypatch.setattr(chunked_loss.dist, "all_reduce", lambda *a, **k: None)
    got = logits.clone()
    with _LargestFloat32(got) as tracked:
        loss, grad = chunked_loss._vocab_parallel_chunk(got, labels, dtype, None, vocab_start)
    assert torch.equal(loss, want_loss) and torch.equal(grad, want_grad)
    assert grad.data_ptr() == got.data_ptr()
    assert tracked.largest <= max(5 * v, 2 * n)
