"""The SDPA kernel choice (``model.attention_backend``, tools/attention_kernels.py): forced
kernels run (and only them), give the default's numbers, survive torch.compile; ``auto``'s
selection with an injected timer; the plan's one-line refusals."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import REPO_ROOT
from torchtitan.config.manager import ConfigManager
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import get_model_spec
from torchtitan.models.common.attention_sinks import causal_mask
from torchtitan.models.common.document_mask import attend
from torchtitan.plan import plan_run
from torchtitan.tools import attention_kernels as ak
from torchtitan.tools.attention_kernels import (
    AttentionShape,
    check_kernel,
    resolve_attention_backend,
    run_attention_shape,
    sdpa_kernel_fn,
    select_kernel,
    set_attention_backend,
)

pytestmark = pytest.mark.usefixtures("one_thread")
DEBUG = str(REPO_ROOT / "train_configs" / "debug_model.toml")
FLASH_CPU = "aten._scaled_dot_product_flash_attention_for_cpu"
# float32 on CPU: the flash and math kernels differ by rounding only (~1e-7 here).
ATOL = RTOL = 1e-5
NO_KERNEL = "No available kernel|No viable backend"  # SDPA's refusal, never a fallback


def cfg_of(*flags: str):
    return ConfigManager().parse_args(["--job.config_file", DEBUG, *flags])


class _Ops(TorchDispatchMode):
    """Names of the aten ops that run (below autograd: the kernel SDPA picked)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _qkv(b=2, h=4, kvh=2, s=48, d=16, sinks=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(b, h, s, d, generator=g), torch.randn(b, kvh, s, d, generator=g),
              torch.randn(b, kvh, s, d, generator=g)]
    if sinks:
        leaves.append(torch.randn(h, generator=g))
    return [t.requires_grad_(True) for t in leaves]


CASES = {
    "causal": dict(mask=False, sinks=False),
    "masked": dict(mask=True, sinks=False),
    "sinks": dict(mask=True, sinks=True),
}


def _run(case: str, backend):
    leaves = _qkv(sinks=CASES[case]["sinks"])
    mask = causal_mask(48, 48, torch.device("cpu")) if CASES[case]["mask"] else None
    if mask is not None:  # documents: a second one starts at position 20
        mask = mask & ~((torch.arange(48) >= 20)[:, None] & (torch.arange(48) < 20)[None, :])
    sinks = leaves[3] if CASES[case]["sinks"] else None
    out = attend(*leaves[:3], mask, n_rep=2, sinks=sinks, backend=backend)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    return [out, *grads]


# --- forced kernels: same numbers, and really that kernel ---------------------------------------
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", ["flash", "math"])
def test_forced_cpu_kernel_matches_default_forward_and_grads(name, case):
    if name == "flash" and case == "sinks":
        pytest.skip("the plan refuses flash with sinks (test_plan_refuses_in_one_line)")
    ours, default = _run(case, ak.BACKENDS[name]), _run(case, None)
    for x, ref in zip(ours, default):
        torch.testing.assert_close(x, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("name", "flash_runs"), [(None, True), ("flash", True), ("math", False)])
def test_forced_kernel_is_the_one_that_runs(name, flash_runs):
    with _Ops() as ops:
        _run("causal", ak.BACKENDS[name] if name else None)
    assert (FLASH_CPU in ops.names) is flash_runs


def test_forced_kernel_the_device_lacks_raises_instead_of_falling_back():
    with pytest.raises(RuntimeError, match=NO_KERNEL):
        _run("causal", SDPBackend.EFFICIENT_ATTENTION)


@pytest.mark.parametrize("family", ["llama3", "qwen3", "deepseek_v3", "gpt_oss"])
def test_every_family_hands_the_kernel_to_its_attention(family):
    spec = get_model_spec(family)
    args = copy.deepcopy(spec.get_model_args("debugmodel"))
    args.max_seq_len = 32
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    tokens = torch.randint(0, 100, (1, 32))
    assert set_attention_backend([model], SDPBackend.EFFICIENT_ATTENTION) == args.n_layers
    with pytest.raises(RuntimeError, match=NO_KERNEL):  # the forced kernel is used
        model(tokens)
    set_attention_backend([model], SDPBackend.MATH)
    with _Ops() as ops:
        out = model(tokens)
    assert FLASH_CPU not in ops.names
    set_attention_backend([model], None)
    torch.testing.assert_close(out, model(tokens), atol=1e-4, rtol=1e-4)


def test_a_forced_kernel_no_module_takes_is_refused():
    with pytest.raises(ValueError, match="no attention module"):
        set_attention_backend([torch.nn.Linear(2, 2)], SDPBackend.MATH)


# --- torch.compile --------------------------------------------------------------------------------
def _attention_module():
    from torchtitan.models.common.attention import GroupedQueryAttention
    from torchtitan.models.common.rope import precompute_freqs_cis

    torch.manual_seed(0)
    attn = GroupedQueryAttention(dim=64, n_heads=4, n_kv_heads=2, head_dim=16)
    attn.init_weights(0.02)
    freqs = precompute_freqs_cis(16, 32, 10000.0, None)
    x = torch.randn(2, 32, 64, requires_grad=True)
    return attn, freqs, x


def _aten_graph_ops(attn, freqs, x) -> set[str]:
    """The aten ops of the compiled forward graph (dynamo + AOTAutograd)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen: set[str] = set()

    def record(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(attn, backend=aot_autograd(fw_compiler=record), fullgraph=True)
    compiled(x, freqs).sum().backward()
    return seen


@pytest.mark.parametrize(("name", "flash_in_graph"), [("flash", True), ("math", False)])
def test_compiled_graph_holds_the_forced_kernel(name, flash_in_graph):
    attn, freqs, x = _attention_module()
    attn.sdpa_backend = ak.BACKENDS[name]
    ops = _aten_graph_ops(attn, freqs, x)
    assert any("flash_attention" in op for op in ops) is flash_in_graph


@pytest.mark.parametrize("backend", [
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.slow),  # g++ subprocesses, ~10 s on 2 cores
])
def test_compiled_block_with_forced_kernel_gives_eager_numbers(backend):
    attn, freqs, x = _attention_module()
    attn.sdpa_backend = SDPBackend.MATH
    eager = attn(x, freqs)
    eager_grads = torch.autograd.grad(eager.sum(), [x, attn.wq.weight])
    torch._dynamo.reset()
    compiled = torch.compile(attn, backend=backend, fullgraph=True)  # no graph break
    out = compiled(x, freqs)
    grads = torch.autograd.grad(out.sum(), [x, attn.wq.weight])
    torch.testing.assert_close(out, eager, atol=ATOL, rtol=RTOL)
    for g, ref in zip(grads, eager_grads):
        torch.testing.assert_close(g, ref, atol=ATOL, rtol=RTOL)


# --- auto's selection (fake timer, injected candidates) -------------------------------------------
SHAPE = AttentionShape(batch=2, heads=4, kv_heads=2, q_len=64, kv_len=64, head_dim=16,
                       dtype=torch.float32)
CPU = torch.device("cpu")


def _raises(*args, **kwargs):
    raise RuntimeError("No available kernel. Aborting execution.")


def _off_by(factor: float):
    """A kernel whose output is ``factor`` times the right one."""

    def kernel(q, k, v, mask, **kwargs):
        return attend(q, k, v, mask, backend=SDPBackend.FLASH_ATTENTION, **kwargs) * factor

    return kernel


def _candidates():
    return {"raises": _raises, "broken": _off_by(1.1),
            "flash": sdpa_kernel_fn(SDPBackend.FLASH_ATTENTION),
            "math": sdpa_kernel_fn(SDPBackend.MATH)}


def _fake_timer(times: dict[str, float], timed: list[str]):
    def timer(name, fn):
        fn()  # runs: a kernel that fails on the full shape is out too
        timed.append(name)
        return times[name]

    return timer


@pytest.mark.parametrize(("flash_ms", "math_ms", "chosen"), [(2.0, 3.0, "flash"), (3.0, 2.0, "math")])
def test_selection_keeps_the_fastest_correct_kernel(flash_ms, math_ms, chosen):
    timed: list[str] = []
    times = {"raises": 0.1, "broken": 0.2, "flash": flash_ms, "math": math_ms}
    sel = select_kernel(SHAPE, CPU, _candidates(), _fake_timer(times, timed), reduce=lambda t: t)
    assert sel.chosen == chosen
    assert sorted(timed) == ["flash", "math"]  # the failing and the wrong one are never timed
    by_name = {o.name: o for o in sel.outcomes}
    assert "RuntimeError: No available kernel" in by_name["raises"].failed
    assert by_name["broken"].wrong.startswith("output error ")
    assert by_name["flash"].ok and by_name["math"].ok


def test_selection_agrees_over_ranks():
    """A kernel another rank could not run (inf after the max-reduction) is out everywhere."""
    times = {"flash": 1.0, "math": 2.0}
    cands = {k: v for k, v in _candidates().items() if k in times}
    sel = select_kernel(SHAPE, CPU, cands, _fake_timer(times, []),
                        reduce=lambda t: [float("inf"), t[1] * 2])
    assert sel.chosen == "math"
    assert [o.describe() for o in sel.outcomes] == ["flash failed (failed on another rank)",
                                                    "math 4.00 ms"]


def test_check_rejects_a_slightly_wrong_kernel_and_passes_the_real_ones():
    assert check_kernel(_off_by(1.01), SHAPE, CPU).startswith("output error ")  # fp32: 1e-3
    masked = AttentionShape(batch=2, heads=4, kv_heads=1, q_len=32, kv_len=96, head_dim=16,
                            dtype=torch.bfloat16, masked=True, mask_rows=2, sinks=True)
    assert check_kernel(sdpa_kernel_fn(SDPBackend.MATH), masked, CPU) is None
    assert check_kernel(sdpa_kernel_fn(SDPBackend.FLASH_ATTENTION), SHAPE, CPU) is None


def test_log_line():
    times = {"raises": 0.1, "broken": 0.2, "flash": 1.83, "math": 1.21}
    sel = select_kernel(replace_dtype(SHAPE, torch.bfloat16), CPU, _candidates(),
                        _fake_timer(times, []), reduce=lambda t: t)
    line = sel.log_line()
    assert line.startswith(
        "attention kernel: SDPA math for causal [2, 4, 64, 16] bf16 (fwd+bwd 1.21 ms; "
        "raises failed (RuntimeError: No available kernel. Aborting execution.), broken wrong "
        "(output error ")
    assert line.endswith("flash 1.83 ms); override with --model.attention_backend")
    assert "\n" not in line
    none = select_kernel(SHAPE, CPU, {"raises": _raises}, _fake_timer(times, []),
                         reduce=lambda t: t)
    assert none.chosen is None
    assert none.log_line() == (
        "attention kernel: PyTorch's choice for causal [2, 4, 64, 16] fp32 (no SDPA kernel "
        "passed: raises failed (RuntimeError: No available kernel. Aborting execution.)); "
        "override with --model.attention_backend")


def replace_dtype(shape: AttentionShape, dtype: torch.dtype) -> AttentionShape:
    from dataclasses import replace

    return replace(shape, dtype=dtype)


# --- the run: shape, resolution, plan -------------------------------------------------------------
def _resolve(*flags: str, world_size: int = 1, timer=None):
    cfg = cfg_of(*flags)
    plan = plan_run(cfg, world_size, device_type="cpu")
    return resolve_attention_backend(cfg, plan.parallel_dims, plan.model_args, CPU, timer=timer)


def test_auto_on_cpu_is_pytorchs_choice_untouched(monkeypatch, caplog):
    def never(*args, **kwargs):
        raise AssertionError("auto must not check or time anything on the CPU")

    monkeypatch.setattr(ak, "evaluate", never)
    monkeypatch.setattr(ak, "select_kernel", never)
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        assert _resolve() is None
    assert "attention kernel" not in caplog.text


def test_forced_kernel_on_cpu_is_checked_and_logged(caplog):
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        assert _resolve("--model.attention_backend", "flash") is SDPBackend.FLASH_ATTENTION
    assert "attention kernel: SDPA flash for causal [8, 16, 512, 16] fp32 " \
           "(model.attention_backend)" in caplog.text  # debug_model.toml: batch 8, seq 512


def test_forced_kernel_that_fails_on_the_run_shape_is_one_line():
    cfg = cfg_of("--model.attention_backend", "cudnn")
    plan = plan_run(cfg, 1)  # no device rules: the build's own run of the kernel refuses it
    with pytest.raises(ValueError) as err:
        resolve_attention_backend(cfg, plan.parallel_dims, plan.model_args, CPU)
    msg = str(err.value)
    assert msg.startswith("model.attention_backend=cudnn cannot run this run's attention "
                          "(causal [8, 16, 512, 16] fp32) on cpu: RuntimeError: ")
    assert msg.endswith("; use auto or another kernel") and "\n" not in msg


def test_run_attention_shape_is_per_rank():
    flags = ["--training.local_batch_size", "8", "--training.seq_len", "256",
             "--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree",
             "2", "--parallelism.pipeline_parallel_degree", "2",
             "--parallelism.pipeline_parallel_microbatch_size", "2",
             "--parallelism.data_parallel_shard_degree", "2",
             "--training.mixed_precision_param", "bfloat16"]
    cfg = cfg_of(*flags)
    dims = ParallelDims.from_config(cfg.parallelism, 16)
    args = plan_run(cfg, 16).model_args
    args.n_heads, args.n_kv_heads = 16, 4
    shape = run_attention_shape(cfg, dims, args)
    assert shape == AttentionShape(batch=2, heads=8, kv_heads=2, q_len=128, kv_len=128,
                                   head_dim=args.head_dim, dtype=torch.bfloat16)
    args.attn_mask_type = "block_causal"  # masked: CP gathers the whole sequence's keys
    shape = run_attention_shape(cfg, dims, args)
    assert (shape.q_len, shape.kv_len, shape.masked, shape.mask_rows) == (128, 256, True, 2)


def test_run_attention_shape_takes_the_padded_head_dim():
    cfg = cfg_of("--model.name", "deepseek_v3", "--model.flavor", "debugmodel")
    plan = plan_run(cfg, 1)
    shape = run_attention_shape(cfg, plan.parallel_dims, plan.model_args)
    assert shape.head_dim == max(plan.model_args.attention_head_dims)
    assert shape.kv_heads == shape.heads == plan.model_args.n_heads


@pytest.mark.parametrize(("flags", "device", "needle"), [
    (["--model.attention_backend", "cudnn"], "cpu",
     "model.attention_backend=cudnn needs a CUDA GPU, and this run's device is cpu: use auto, "
     "flash or math"),
    (["--model.attention_backend", "efficient"], "cpu", "efficient needs a CUDA GPU"),
    (["--model.attention_backend", "flash", "--model.use_flex_attn"], None,
     "model.attention_backend=flash picks the SDPA kernel, and model.use_flex_attn runs "
     "FlexAttention instead: unset one of them"),
    (["--model.attention_backend", "math", "--parallelism.context_parallel_degree", "2"], None,
     "context parallel's ring attention merges the outputs of the flash, efficient or cudnn "
     "kernels, not math's: use auto or flash"),
    (["--model.attention_backend", "flash", "--model.name", "gpt_oss"], None,
     "model.attention_backend=flash cannot run attention sinks"),
    (["--model.attention_backend", "flash"], "cuda",
     "runs in bfloat16 or float16 only, and this run computes in float32"),
    (["--model.attention_backend", "flash", "--training.mixed_precision_param", "bfloat16",
      "--model.attn_mask_type", "block_causal"], "cuda",
     "model.attention_backend=flash takes no attention mask"),
])
def test_plan_refuses_in_one_line(flags, device, needle):
    cfg = cfg_of(*flags)
    world = 2 if "--parallelism.context_parallel_degree" in flags else 1
    with pytest.raises(ValueError) as err:
        plan_run(cfg, world, device_type=device)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("flags", "device"), [
    (["--model.attention_backend", "cudnn"], None),  # checked for another machine
    (["--model.attention_backend", "cudnn", "--training.mixed_precision_param", "bfloat16"],
     "cuda"),
    (["--model.attention_backend", "math", "--parallelism.context_parallel_degree", "2",
      "--model.attn_mask_type", "block_causal"], "cpu"),  # masked CP gathers: any kernel
    (["--model.attention_backend", "efficient", "--model.attn_mask_type", "block_causal"], "cuda"),
])
def test_plan_accepts(flags, device):
    world = 2 if "--parallelism.context_parallel_degree" in flags else 1
    plan_run(cfg_of(*flags), world, device_type=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_launcher_preflight_refuses_with_exit_2(capsys):
    from torchtitan.launch import preflight

    assert preflight(["--job.config_file", DEBUG, "--model.attention_backend", "cudnn"], 1) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: model.attention_backend=cudnn needs a CUDA GPU, and this run's "
                   "device is cpu: use auto, flash or math"]


# --- on a CUDA GPU (skipped elsewhere): the real kernels, the real timer --------------------------
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = torch.device("cuda")
H100_SHAPE = AttentionShape(batch=2, heads=32, kv_heads=8, q_len=4096, kv_len=4096,
                            head_dim=128, dtype=torch.bfloat16)


@requires_cuda
@pytest.mark.parametrize("name", ["flash", "cudnn", "efficient"])
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_kernels_pass_the_check_or_fail_loudly(name, masked):
    from dataclasses import replace

    shape = replace(H100_SHAPE, masked=masked, mask_rows=2 if masked else 1)
    outcome = ak.evaluate(name, sdpa_kernel_fn(ak.BACKENDS[name]), shape, GPU, ak._default_timer)
    if name == "flash" and masked:
        assert outcome.failed is not None  # flash takes no mask: refused, not wrong
        return
    assert outcome.wrong is None, outcome.describe()
    if outcome.ok:
        assert 0 < outcome.ms < 1000


@requires_cuda
def test_cuda_auto_picks_the_fastest_correct_kernel_in_one_line(caplog):
    cfg = cfg_of("--training.mixed_precision_param", "bfloat16", "--training.seq_len", "2048",
                 "--training.local_batch_size", "2")
    plan = plan_run(cfg, 1, device_type="cuda")
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        backend = resolve_attention_backend(cfg, plan.parallel_dims, plan.model_args, GPU)
    lines = [r.getMessage() for r in caplog.records if "attention kernel" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith("override with --model.attention_backend")
    if backend is None:  # compiled FlexAttention was fastest: the model is switched to it
        assert plan.model_args.use_flex_attn is True
        assert lines[0].startswith("attention kernel: FlexAttention (compiled) for causal "
                                   "[2, 16, 2048, 16] bf16")
        return
    assert backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                       SDPBackend.EFFICIENT_ATTENTION)
    name = next(k for k, v in ak.BACKENDS.items() if v == backend)
    assert lines[0].startswith(f"attention kernel: SDPA {name} for causal [2, 16, 2048, 16] bf16")
    assert "flex" in lines[0]  # timed too


@requires_cuda
@pytest.mark.slow  # inductor compile
@pytest.mark.parametrize("name", ["flash", "cudnn", "efficient"])
def test_cuda_compiled_block_with_forced_kernel_gives_eager_numbers(name):
    attn, freqs, x = _attention_module()
    attn = attn.to(GPU, torch.bfloat16)
    freqs, x = freqs.to(GPU), x.detach().to(GPU, torch.bfloat16).requires_grad_(True)
    attn.sdpa_backend = ak.BACKENDS[name]
    try:
        eager = attn(x, freqs)
    except RuntimeError as err:
        pytest.skip(f"{name} does not run here: {str(err).splitlines()[0]}")
    torch._dynamo.reset()
    out = torch.compile(attn, backend="inductor", fullgraph=True)(x, freqs)
    torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2)


def test_dry_runs_switch_a_forced_kernel_to_auto(caplog):
    """A COMM_MODE dry run checks shapes, not kernels: a GPU-only kernel must not stop it on
    the CPU (the plan would refuse cudnn there)."""
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed.comm_mode.base import prepare_dry_run as comm_dry_run
    from torchtitan.plan import plan_run

    job = ConfigManager().parse_args(["--model.attention_backend", "cudnn"])
    with caplog.at_level(logging.INFO):
        comm_dry_run(job, "COMM_MODE=fake_backend", "shapes only")
    assert job.model.attention_backend == "auto"
    assert "model.attention_backend cudnn -> auto" in caplog.text
    plan_run(job, 8, device_type="cpu")  # now plannable here


# --- auto also times compiled FlexAttention ---------------------------------------------------------
def _auto_on_cuda(monkeypatch, chosen: str, *flags: str):
    """resolve_attention_backend as on a GPU, with select_kernel replaced by a recorder that
    returns ``chosen``; (the return value, the model args, the candidate names)."""
    seen = {}

    def fake_select(shape, device, candidates=None, timer=None, reduce=None):
        seen["names"] = list(candidates)
        outcomes = [ak.Outcome(name, ms=1.0 if name == chosen else 2.0) for name in candidates]
        return ak.Selection(shape, outcomes, chosen)

    monkeypatch.setattr(ak, "select_kernel", fake_select)
    monkeypatch.setattr(ak, "flex_supported", lambda device: True)
    cfg = cfg_of(*flags)
    plan = plan_run(cfg, 1, device_type="cpu")
    got = resolve_attention_backend(cfg, plan.parallel_dims, plan.model_args, GPU)
    return got, plan.model_args, seen["names"]


def test_auto_switches_the_model_to_flex_when_flex_is_fastest(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        got, args, names = _auto_on_cuda(monkeypatch, ak.FLEX)
    assert names == [*ak.AUTO_CANDIDATES, ak.FLEX]
    assert got is None and args.use_flex_attn is True
    assert "attention kernel: FlexAttention (compiled) for causal" in caplog.text


def test_auto_keeps_sdpa_when_an_sdpa_kernel_is_fastest(monkeypatch):
    got, args, _ = _auto_on_cuda(monkeypatch, "cudnn")
    assert got is SDPBackend.CUDNN_ATTENTION and not args.use_flex_attn


def test_flex_is_no_candidate_when_the_config_says_no(monkeypatch):
    _, args, names = _auto_on_cuda(monkeypatch, "cudnn", "--model.no_use_flex_attn")
    assert ak.FLEX not in names and args.use_flex_attn is False


def test_flex_candidate_is_causal_attention():
    """The timed FlexAttention kernel computes the model's causal attention (forward: the CPU
    has no FlexAttention backward), grouped-query heads included."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, 16, generator=g)
    k, v = (torch.randn(2, 2, 40, 16, generator=g) for _ in range(2))
    with torch.no_grad():
        got = ak.flex_kernel_fn(CPU)(q, k, v, None, n_rep=2)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_flex_is_no_candidate_under_context_parallel():
    cfg = cfg_of()
    dims = type("Dims", (), {"cp": 2})()
    assert not ak.flex_is_candidate(cfg, dims, GPU)
    assert not ak.flex_is_candidate(cfg, type("Dims", (), {"cp": 1})(), CPU)
