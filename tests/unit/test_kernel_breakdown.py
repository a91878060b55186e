"""scripts/kernel_breakdown.py: GPU time per step by category from torch.profiler traces."""

from __future__ import annotations

import gzip
import json
import sys

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def kb():
    yield load_script("kernel_breakdown")
    sys.modules.pop("kernel_breakdown", None)


# Kernel names as an H100 trace (torch 2.11) spells them, and where each belongs.
NAMES = {
    "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_"
    "execute_segment_k_off_kernel__5x_cublas": "matmul",
    "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_cublas": "matmul (float8)",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, "
    "false, cutlass::bfloat16_t>>": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128": "attention",
    "fmha_cutlassB_bf16_aligned_64x64_k128_sm80": "attention",
    "triton_tem_fused_flex_attention_backward_3": "attention",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
    "namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::"
    "FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>>": "optimizer step",
    "void at::native::lpnorm_cleanup<float, (at::native::NormType)1, float, float>": "grad norm",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
    "TensorListMetadata<1>, at::native::LpNormFunctor<float, (at::native::NormType)1>>":
        "grad norm",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
    "TensorListMetadata<1>, at::native::BinaryOpScalarTensorFunctor<float, 1, 1, 0>>":
        "foreach (clip, scale)",
    "triton_red_fused__log_softmax_backward_data_nll_loss_backward_0": "loss",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "compiled fusion",
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native"
    "::direct_copy_kernel_cuda(at::TensorIteratorBase&)>>": "cast / copy",
    "void at::native::(anonymous namespace)::indexing_backward_kernel<float, 4>": "embedding",
    "void at::native::vectorized_gather_kernel<16, long>": "embedding",
    "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL": "communication",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>":
        "other elementwise / reduce",
    "some_custom_kernel": "other",
}


@pytest.mark.parametrize("name", NAMES)
def test_kernel_names_fall_in_their_category(kb, name):
    assert kb.categorize(name) == NAMES[name]


def test_copies_between_host_and_device_stand_apart(kb):
    assert kb.categorize("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy") == "host <-> device copy"
    assert kb.categorize("Memcpy DtoD (Device -> Device)", "gpu_memcpy") == "cast / copy"
    assert kb.categorize("Memset (Device)", "gpu_memset") == "cast / copy"


def _trace(gap_us: float = 0.0) -> dict:
    """Two profiled steps of 1000 us of GPU work each (600 matmul, 300 Adam, 100 memcpy),
    ``gap_us`` of GPU idle time before the second step's kernels."""
    events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "ts": t,
               "dur": 2000} for n, t in ((9, 0), (10, 2000))]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 9000})
    t = 100.0
    for step in range(2):
        if step == 1:
            t += gap_us
        for cat, name, dur in (("kernel", "nvjet_tst_256x128", 600),
                               ("kernel", "multi_tensor_apply_kernel<FusedAdamMathFunctor>", 300),
                               ("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 100)):
            events.append({"ph": "X", "cat": cat, "name": name, "ts": t, "dur": dur})
            t += dur
    return {"traceEvents": events}


def test_a_trace_sums_gpu_time_per_step_and_how_busy_the_gpu_was(kb):
    b = kb.breakdown(_trace(gap_us=1000.0), "t.json")
    assert b.steps == 2
    assert b.per_step_ms(b.by_category["matmul"]) == pytest.approx(0.6)
    assert b.per_step_ms(b.by_category["optimizer step"]) == pytest.approx(0.3)
    assert b.per_step_ms(b.by_category["host <-> device copy"]) == pytest.approx(0.1)
    assert b.per_step_ms(b.gpu_us) == pytest.approx(1.0)  # CPU ops do not count
    assert b.span_us == pytest.approx(3000.0) and b.busy_us == pytest.approx(2000.0)
    text = kb.tables({"ours": b, "upstream": kb.breakdown(_trace(), "u.json")})
    assert "| matmul | 0.60 | 0.60 |" in text
    assert "| GPU busy over the span | 66.7 % | 100.0 % |" in text
    assert "| profiled steps | 2 | 2 |" in text


def test_kernels_launched_inside_an_optimizer_step_are_the_optimizers(kb):
    """A compiled AdamW step's kernels carry their fused ops' names: the profiler range of
    ``Optimizer.step`` and the launch's correlation id attribute them."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#AdamBF16State.step",
         "ts": 1000, "dur": 500},
        {"ph": "X", "cat": "cuda_runtime", "name": "cuLaunchKernel", "ts": 1100, "dur": 5,
         "args": {"correlation": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cuLaunchKernel", "ts": 200, "dur": 5,
         "args": {"correlation": 8}},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_lerp_mul_sqrt_0",
         "ts": 1200, "dur": 300, "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_lerp_mul_sqrt_0",
         "ts": 300, "dur": 100, "args": {"correlation": 8}},
    ]
    b = kb.breakdown({"traceEvents": events})
    assert b.by_category == {"optimizer step": 300, "compiled fusion": 100}


def test_overlapping_kernels_count_once_in_the_busy_time(kb):
    events = [{"ph": "X", "cat": "kernel", "name": "a_gemm", "ts": 0, "dur": 100},
              {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather", "ts": 50,
               "dur": 100},
              {"ph": "X", "cat": "kernel", "name": "b_gemm", "ts": 300, "dur": 100}]
    b = kb.breakdown({"traceEvents": events})
    assert b.span_us == 400 and b.busy_us == 250 and b.gpu_us == 300


def test_the_command_finds_the_newest_trace_in_a_dump_folder(kb, tmp_path, capsys):
    for label, gap in (("ours", 0.0), ("upstream", 500.0)):
        folder = tmp_path / label / "profile_traces" / "iteration_10"
        folder.mkdir(parents=True)
        with gzip.open(folder / "rank0_trace.json.gz", "wt") as f:
            json.dump(_trace(gap), f)
    out_json = tmp_path / "figures.json"
    assert kb.main([f"ours={tmp_path / 'ours'}", f"upstream={tmp_path / 'upstream'}",
                    "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "| all GPU work | 1.00 | 1.00 |" in text.replace("**", "")
    assert "| GPU busy over the span | 100.0 % | 80.0 % |" in text
    assert json.loads(out_json.read_text())["upstream"]["steps"] == 2


def test_a_trace_without_gpu_kernels_is_one_error_line(kb, tmp_path, capsys):
    path = tmp_path / "rank0_trace.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10}]}))
    assert kb.main([f"cpu={path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cpu: ") and "holds no GPU kernels" in err and "\n" not in err
    assert kb.main([f"none={tmp_path / 'missing'}"]) == 2
    assert "no rank0_trace.json under" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["not json", "[1, 2]"])
def test_a_file_that_is_no_trace_is_one_error_line(kb, tmp_path, capsys, text):
    path = tmp_path / "notes.txt"
    path.write_text(text)
    assert kb.main([f"ours={path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: ours: {path} is not a torch.profiler chrome trace") and "\n" not in err
