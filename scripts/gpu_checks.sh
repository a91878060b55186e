#!/usr/bin/env bash
# The checks CI's CPU machine cannot run, on CUDA GPUs (and their torch); about 8 minutes on one:
#
#   scripts/gpu_checks.sh OUT_DIR [CHECK ...]     # default: every check below but slow_tests
#
# Needs the project's dependencies next to the machine's CUDA torch (pip install -e ".[dev]",
# or their wheels on PYTHONPATH); runs from any directory.
#
# Checks (each with its own time limit):
#   debug           run_train.sh on the debug config: MFU line, CUDA memory snapshots
#   f8_bf16, f8_float8, f8_rowwise
#                   scripts/benchmark.py on 8B-shaped layers (benchmark_flavors), compiled:
#                   bf16 vs float8 tensorwise and rowwise
#   moe_f8          Qwen3 MoE compiled: float8 Linear layers + float8 grouped GEMM experts
#   cuda_tests      the tests that need CUDA
#   dsv3_flex       DeepSeek-V3 debug, FlexAttention with document masks, compiled
#   launcher_tests  run_train.sh's failure paths on this machine's torchrun (CPU ranks)
#   fast_tests      the fast test loop on this machine's torch (CPU; torch 2.11 on GPU machines)
#   nccl            with 2+ GPUs: FSDP x TP, async TP, PP, CP, EP and FSDP's float8 all-gather
#                   over every GPU, 10 steps each (skipped on one GPU); with torchft installed
#                   also 2 fault-tolerant groups of 1 GPU over NCCL: synchronous, and DiLoCo
#                   with the quantized (float8) pseudo-gradient all-reduce
#   slow_tests      (not by default, ~5 min) tests/distributed's gloo ranks on this torch
# OUT_DIR gets summary.txt (one line per check: exit code, seconds), checks.log (the tail of
# each check's log) and logs.tgz (the whole logs); dump folders stay in
# ${GPU_CHECKS_TMP:-/tmp/gpu_checks}.
set -u
out=${1:?usage: scripts/gpu_checks.sh OUT_DIR [CHECK ...]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
tmp=${GPU_CHECKS_TMP:-/tmp/gpu_checks}
mkdir -p "$tmp"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
export PYTHONPATH="$PWD/scripts:$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=$(command -v python3 || command -v python)

ft_groups() {  # ft_groups NAME EXTRA_FLAGS...: 2 torchft groups of 1 GPU each over NCCL
    local name=$1
    shift
    if (( $(nvidia-smi -L 2>/dev/null | grep -c '^GPU') < 2 )) || ! "$py" -c "import torchft" 2>/dev/null; then
        echo "$name: skipped (needs 2+ GPUs and torchft)" | tee -a "$out/summary.txt"
        return
    fi
    check "$name" "${RUN_LIMIT:-180}" "$py" scripts/run_fault_tolerant.py --groups 2 \
        --max-restarts 0 --log-dir "$tmp/$name" -- \
        --job.config_file ./train_configs/debug_model.toml --job.dump_folder "$tmp/$name" \
        --training.steps 10 --fault_tolerance.process_group nccl "$@"
    local f
    for f in "$tmp/$name"/replica_*.log; do  # into logs.tgz with the others
        [[ -f $f ]] && cp "$f" "$tmp/${name}_$(basename "$f")"
    done
}

. scripts/timed_run.sh
check() {  # check NAME SECONDS COMMAND...: the log in $tmp, its tail in checks.log
    local rc
    timed_run "$tmp" "$@"
    rc=$?
    { echo "===== $1 (exit $rc)"; grep -v -E "Warning|warnings.warn" "$tmp/$1.log" | tail -25; } >>"$out/checks.log"
}

bench() {  # bench NAME EXTRA_FLAGS...: 8B-shaped layers, seq 4096, compiled, no AC
    local name=$1
    shift
    check "$name" 150 "$py" scripts/benchmark.py --steps 12 --warmup 5 \
        --experimental.custom_import benchmark_flavors --model.flavor 8B_4layers \
        --training.seq_len 4096 --training.local_batch_size 2 --compile.enable \
        --activation_checkpoint.mode none --training.mixed_precision_param bfloat16 \
        --job.dump_folder "$tmp/$name" "$@"
}

run() {  # run NAME CONFIG EXTRA_FLAGS...: ./run_train.sh on one GPU
    local name=$1 config=$2
    shift 2
    check "$name" "${RUN_LIMIT:-120}" env NGPU=1 CONFIG_FILE="$config" ./run_train.sh \
        --job.dump_folder "$tmp/$name" --metrics.disable_color_printing \
        --training.mixed_precision_param bfloat16 "$@"
}

multi() {  # multi NAME CONFIG EXTRA_FLAGS...: ./run_train.sh on every GPU (NCCL); 2+ GPUs
    local name=$1 config=$2 n
    shift 2
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    if (( n < 2 )); then
        echo "$name: skipped (needs 2+ GPUs, $n here)" | tee -a "$out/summary.txt"
        return
    fi
    check "$name" "${RUN_LIMIT:-180}" env NGPU="$n" CONFIG_FILE="$config" ./run_train.sh \
        --job.dump_folder "$tmp/$name" --metrics.disable_color_printing \
        --training.mixed_precision_param bfloat16 --training.steps 10 "$@"
}

checks=("$@")
[[ ${#checks[@]} -gt 0 ]] || checks=(debug f8_bf16 f8_float8 f8_rowwise moe_f8 cuda_tests dsv3_flex launcher_tests fast_tests nccl)
nvidia-smi -L >>"$out/summary.txt" 2>&1
"$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" \
    >>"$out/summary.txt" 2>&1
for c in "${checks[@]}"; do
    case $c in
        cuda_tests) check cuda_tests 90 "$py" -m pytest -q -p no:cacheprovider \
            tests/unit/test_profiling.py tests/unit/test_converters.py ;;
        debug) run debug ./train_configs/debug_model.toml --training.steps 20 \
            --profiling.enable_memory_snapshot && ls -R "$tmp/debug" >>"$out/checks.log" ;;
        f8_bf16) bench f8_bf16 ;;
        f8_float8) bench f8_float8 --model.converters float8 ;;
        f8_rowwise) bench f8_rowwise --model.converters float8 --float8.recipe_name rowwise ;;
        moe_f8) run moe_f8 ./train_configs/qwen3_debugmodel_moe.toml --training.steps 10 \
            --compile.enable --model.converters float8 --float8.recipe_name rowwise \
            --float8.moe_fqns_prototype experts ;;
        dsv3_flex) run dsv3_flex ./train_configs/deepseek_v3_debugmodel.toml --training.steps 10 \
            --compile.enable --model.use_flex_attn --model.attn_mask_type block_causal ;;
        launcher_tests) check launcher_tests 150 "$py" -m pytest -q -p no:cacheprovider \
            tests/integration/test_launcher_errors.py tests/integration/test_launcher.py ;;
        fast_tests) check fast_tests 240 env CUDA_VISIBLE_DEVICES= "$py" -m pytest -q -rf \
            -m "not slow" -p no:cacheprovider $("$py" -c "import xdist" 2>/dev/null && printf -- '-n 8') \
            tests/unit tests/distributed ;;
        slow_tests) check slow_tests 480 env CUDA_VISIBLE_DEVICES= "$py" -m pytest -q -rf \
            -p no:cacheprovider tests/distributed ;;  # not in the default list: ~5 min
        nccl)  # every parallelism over NCCL: FSDP x TP, async TP, PP, CP, EP
            multi nccl_fsdp_tp ./train_configs/debug_model.toml --parallelism.tensor_parallel_degree 2
            multi nccl_async_tp ./train_configs/debug_model.toml --parallelism.tensor_parallel_degree 2 \
                --parallelism.enable_async_tensor_parallel --compile.enable
            multi nccl_pp ./train_configs/debug_model.toml --parallelism.pipeline_parallel_degree 2 \
                --parallelism.pipeline_parallel_schedule 1F1B
            multi nccl_cp ./train_configs/debug_model.toml --parallelism.context_parallel_degree 2
            multi nccl_ep ./train_configs/qwen3_debugmodel_moe.toml \
                --parallelism.expert_parallel_degree 2
            multi nccl_f8_fsdp ./train_configs/debug_model.toml --model.converters float8 \
                --float8.enable_fsdp_float8_all_gather \
                --float8.precompute_float8_dynamic_scale_for_fsdp --compile.enable
            ft_groups nccl_ft_sync
            ft_groups nccl_ft_diloco_f8 --fault_tolerance.semi_sync_method diloco \
                --fault_tolerance.sync_steps 2 --fault_tolerance.should_quantize ;;
        *) echo "unknown check $c" >>"$out/summary.txt" ;;
    esac
done
tar czf "$out/logs.tgz" -C "$tmp" $(cd "$tmp" && ls ./*.log)
