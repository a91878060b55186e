#!/usr/bin/env bash
# The speed issue's GPU measurements as prepared runs for one H100 (each phase under 10 minutes):
#
#   scripts/gpu_speed_check.sh WHEELS OUT next      # <= 9.5 min: choices, optstep, memsnap, each
#                                                   # only when its time fits (BUDGET_S=570)
#   scripts/gpu_speed_check.sh WHEELS OUT harness   # ~7 min: ours vs upstream, bf16 + float8,
#                                                   # plus ours with the levers off, same run
#                                                   # (HARNESS_SETTINGS=bf16, then =float8: two
#                                                   # calls of ~4 min where 10 is the limit)
#   scripts/gpu_speed_check.sh WHEELS OUT choices   # ~7 min: float8 with the gradient views
#                                                   # off and loss chunks of 4096 as variants,
#                                                   # then bf16 (ours, upstream)
#   scripts/gpu_speed_check.sh WHEELS OUT levers    # ~5 min: the compiled optimizer steps' CUDA
#                                                   # tests; the optimizer step alone (fused,
#                                                   # static / dynamic compiled, copies) and the
#                                                   # loss path alone at Llama 3 8B's shapes; the
#                                                   # memory estimate vs the GPU
#   scripts/gpu_speed_check.sh WHEELS OUT optim     # ~4 min: bf16 (only) with the opt-in bf16
#                                                   # optimizer state as a variant
#   scripts/gpu_speed_check.sh WHEELS OUT profile   # ~3 min: bf16, ours / levers off / upstream
#                                                   # traced (torch.profiler, 2 steps each): GPU
#                                                   # time per step by kernel category
#   scripts/gpu_speed_check.sh WHEELS OUT memsnap   # ~3.5 min: float8, ours (also with the
#                                                   # float8 weight copies) and upstream with
#                                                   # the allocator history recorded (10 steps):
#                                                   # what is live at each one's peak
#   scripts/gpu_speed_check.sh WHEELS OUT optstep   # ~1 min: the optimizer step alone (fused,
#                                                   # compiled static / dynamic, copies)
#
# WHEELS: the folder `python scripts/compare_upstream.py --fetch-wheels WHEELS` filled on a
# machine with network (upstream torchtitan 0.2.2 and what a bare GPU image lacks); they are
# installed into $WORK/site once and put on PYTHONPATH. OUT gets one log per step and
# summary.txt (the tables). $WORK defaults to /tmp/compare_upstream. See docs/performance.md.
# SMOKE=1 runs the same plumbing on the CPU at toy sizes (no figure is a measurement).
set -u
usage="usage: scripts/gpu_speed_check.sh WHEELS OUT next|harness|choices|levers|optim|profile|memsnap|optstep"
wheels=${1:?$usage}
out=${2:?$usage}
phase=${3:?$usage}
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
mkdir -p "$out"
work=${WORK:-/tmp/compare_upstream}
py=$(command -v python3 || command -v python)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
# The levers at their defaults against the same build with them off: the plain logits loss,
# PyTorch's usual SDPA kernel on Hopper (flash), clipping by rescaling every gradient,
# autocast casting every weight and gradient.
LEVERS_OFF="--training.loss_implementation logits --model.attention_backend flash --optimizer.no_clip_in_step --training.weight_copies off"
if [[ ${SMOKE:-0} == 1 ]]; then
    SETTINGS=(--device cpu --settings bf16) OPTIM_SETTINGS=(--device cpu --settings bf16)
    FLOAT8_SETTINGS=(--device cpu --settings bf16)  # (float8 needs the GPU)
    PROFILE_RUN=(--device cpu --settings bf16 --steps 4 --log-freq 1 --warmup 1)
    PROFILE_STEPS=4
    MEMSNAP_RUN=(--device cpu --settings bf16 --steps 4 --log-freq 2 --warmup 1)
    MEMSNAP_STEPS=4 MEMSNAP_SETTINGS_LIST=bf16
    OPTIM_SHAPE=(--device cpu --layers 1 --iters 3)
    LOSS_SHAPE=(--device cpu --tokens 512 --dim 64 --vocab 4000 --chunk 128 --iters 2)
    MEMORY_CONFIG=(train_configs/debug_model.toml --training.seq_len 64
                   --training.local_batch_size 2)
    LEVERS_OFF="--training.loss_implementation logits --model.attention_backend math --optimizer.no_clip_in_step --training.weight_copies off"
else
    SETTINGS=(--settings "${HARNESS_SETTINGS:-bf16,float8}") OPTIM_SETTINGS=(--settings bf16)
    FLOAT8_SETTINGS=(--settings float8)
    PROFILE_RUN=(--settings "${PROFILE_SETTINGS:-bf16}" --steps 20 --log-freq 5 --warmup 10)
    PROFILE_SETTINGS_LIST=${PROFILE_SETTINGS:-bf16}
    PROFILE_SETTINGS_LIST=${PROFILE_SETTINGS_LIST//,/ }
    PROFILE_STEPS=20
    MEMSNAP_RUN=(--settings "${MEMSNAP_SETTINGS:-float8}" --steps 10 --log-freq 5 --warmup 5)
    MEMSNAP_STEPS=10 MEMSNAP_SETTINGS_LIST=${MEMSNAP_SETTINGS:-float8}
    MEMSNAP_SETTINGS_LIST=${MEMSNAP_SETTINGS_LIST//,/ }
    OPTIM_SHAPE=(--device cuda --layers 4)  # 8B_4layers' parameters
    LOSS_SHAPE=(--device cuda --tokens 8192 --dim 4096 --vocab 128256 --dtype bfloat16 --compile
                --chunk 8192)
    MEMORY_CONFIG=(train_configs/llama3_8b.toml --training.local_batch_size 1
                   --training.seq_len 8192 --activation_checkpoint.mode selective
                   --activation_checkpoint.selective_ac_option op)
fi

. scripts/timed_run.sh
step() {  # step NAME SECONDS COMMAND...: the log in $out
    timed_run "$out" "$@"
}

case $phase in
harness)
    step harness 560 "$py" scripts/compare_upstream.py --wheels "$wheels" --work-dir "$work" \
        "${SETTINGS[@]}" --ours-variant "levers_off=$LEVERS_OFF" --out "$out/table.md"
    cat "$out/table.md" >>"$out/summary.txt" 2>/dev/null
    grep -h "attention kernel\|Loss: " "$work"/logs/ours_*.log | sed 's/.* - INFO - //' \
        | sort -u >>"$out/summary.txt"
    ;;
choices)
    # float8 first (the row the issue still lacks) at the defaults with two variants, then the
    # table's bf16 row
    step choices_float8 400 "$py" scripts/compare_upstream.py --wheels "$wheels" --work-dir "$work" \
        "${FLOAT8_SETTINGS[@]}" --ours-variant "no_views=--float8.no_weight_grad_views" \
        --ours-variant "chunk4k=--training.loss_chunk_size 4096" --out "$out/table_float8.md"
    cat "$out/table_float8.md" >>"$out/summary.txt" 2>/dev/null
    step choices_bf16 300 "$py" scripts/compare_upstream.py --wheels "$wheels" --work-dir "$work" \
        "${OPTIM_SETTINGS[@]}" --out "$out/table_bf16.md"
    cat "$out/table_bf16.md" >>"$out/summary.txt" 2>/dev/null
    ;;
levers)
    # the extra wheels (never upstream's torchtitan) into the harness's shared folder
    "$py" -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; import \
compare_upstream_setup as s; s.install_wheels(Path('$wheels'), Path('$work/site'))" \
        >"$out/install.log" 2>&1 || { echo "error: installing $wheels failed; see $out/install.log" >&2; exit 2; }
    export PYTHONPATH="$PWD:$work/site:$PWD/scripts"
    # the weight copies' and bf16 state's compiled steps on this GPU (CPU runs skip these)
    if [[ ${SMOKE:-0} != 1 ]]; then  # (on the CPU they skip)
        step cuda_steps 210 "$py" -m pytest -q -p no:cacheprovider -rs \
            tests/unit/test_weight_copies.py tests/unit/test_optimizer_state_dtype.py -k cuda
        tail -3 "$out/cuda_steps.log" >>"$out/summary.txt"
    fi
    step optimizer_step 180 "$py" scripts/benchmark_optimizer.py "${OPTIM_SHAPE[@]}"
    tail -7 "$out/optimizer_step.log" | head -6 >>"$out/summary.txt"
    step loss_path 240 "$py" scripts/benchmark_loss.py "${LOSS_SHAPE[@]}"
    tail -6 "$out/loss_path.log" | head -5 >>"$out/summary.txt"
    step memory 300 "$py" scripts/estimate_memory.py --job.config_file "${MEMORY_CONFIG[@]}" \
        --world-size 8 --compare-real
    grep -v "^\[" "$out/memory.log" | tail -12 >>"$out/summary.txt"
    ;;
optim)
    step optim 560 "$py" scripts/compare_upstream.py --wheels "$wheels" --work-dir "$work" \
        "${OPTIM_SETTINGS[@]}" --ours-variant "bf16_state=--optimizer.state_dtype bfloat16" \
        --out "$out/table_optim.md"
    cat "$out/table_optim.md" >>"$out/summary.txt" 2>/dev/null
    ;;
profile)
    # both trainers trace their last 2 steps with the same torch.profiler options; the table
    # is no measurement (the traced steps are slower), the breakdowns say where time goes
    trace="--profiling.enable_profiling --profiling.save_traces_folder profile_traces \
--profiling.profile_freq $PROFILE_STEPS --profiling.profiler_warmup 1 --profiling.profiler_active 2"
    rm -rf "$work"/dumps/*/profile_traces  # an earlier profile run's
    step profile 560 "$py" scripts/compare_upstream.py --wheels "$wheels" --work-dir "$work" \
        "${PROFILE_RUN[@]}" --ours-variant "levers_off=$LEVERS_OFF" --both-flags "$trace" \
        --out "$out/table_profile.md"
    for setting in ${PROFILE_SETTINGS_LIST:-bf16}; do
        step "breakdown_$setting" 120 "$py" scripts/kernel_breakdown.py \
            "ours=$work/dumps/ours_${setting}_0" \
            "levers_off=$work/dumps/ours-levers_off_${setting}_0" \
            "upstream=$work/dumps/upstream_${setting}_0" --json "$out/breakdown_$setting.json"
        { echo "### $setting"; cat "$out/breakdown_$setting.log"; } >>"$out/summary.txt"
    done
    ;;
optstep)
    # the optimizer step alone: torch's fused AdamW, the compiled step static / dynamic, copies
    step optimizer_step 180 "$py" scripts/benchmark_optimizer.py "${OPTIM_SHAPE[@]}"
    tail -7 "$out/optimizer_step.log" | head -6 >>"$out/summary.txt"
    ;;
next)
    # the next GPU call in one command: the phases in order of what the speed issue lacks,
    # each started only when its usual time fits in what is left of BUDGET_S (default 570 s,
    # under the device tool's 600 s limit), so none is killed half-way
    deadline=$(( SECONDS + ${BUDGET_S:-570} ))
    for pair in ${NEXT_PHASES:-choices:450 optstep:90 memsnap:220}; do
        name=${pair%%:*} need=${pair##*:}
        left=$(( deadline - SECONDS ))
        if (( need > left )); then
            echo "$name: skipped, needs ~$need s, $left s left of BUDGET_S" | tee -a "$out/summary.txt"
            continue
        fi
        bash "$self" "$wheels" "$out" "$name" >/dev/null
    done
    ;;
memsnap)
    # both trainers record the allocator's history and dump it at the last step (the table is
    # no measurement: recording stacks slows the steps); what each one holds at its peak
    snap="--profiling.enable_memory_snapshot --profiling.save_memory_snapshot_folder memory_snapshot \
--profiling.profile_freq $MEMSNAP_STEPS"
    rm -rf "$work"/dumps/*/memory_snapshot  # an earlier run's
    # (and ours with the float8 linears' weight copies: the run that was 2.3 GiB over upstream)
    step memsnap 420 "$py" scripts/compare_upstream.py --wheels "$wheels" --work-dir "$work" \
        "${MEMSNAP_RUN[@]}" --both-flags "$snap" --out "$out/table_memsnap.md" \
        --ours-variant "f8_copies=--training.weight_copies on"
    for setting in $MEMSNAP_SETTINGS_LIST; do
        # the peak of the window's second half (the steady state); its slices show the whole
        # window (a first step's one-off peak included)
        step "peak_$setting" 120 "$py" scripts/memory_peak.py --top 25 --after 50% \
            "ours=$work/dumps/ours_${setting}_0/memory_snapshot" \
            "f8_copies=$work/dumps/ours-f8_copies_${setting}_0/memory_snapshot" \
            "upstream=$work/dumps/upstream_${setting}_0/memory_snapshot" \
            --json "$out/peak_$setting.json"
        { echo "### $setting"; cat "$out/peak_$setting.log"; } >>"$out/summary.txt"
    done
    ;;
*)
    echo "error: unknown phase '$phase' (next, harness, choices, levers, optim, profile, memsnap or optstep)" >&2
    exit 2
    ;;
esac
cat "$out/summary.txt"
