#!/usr/bin/env bash
# Launch a torchtitan training job on this machine.
#
#   ./run_train.sh [trainer flags...]
#   NGPU=4 CONFIG_FILE=./train_configs/llama3_8b.toml ./run_train.sh --training.steps 50
#   MODULE=llama3 CONFIG=llama3_debugmodel ./run_train.sh
#   NGPU=32 COMM_MODE=fake_backend ./run_train.sh      # one process simulating 32 ranks
#
# Run `./run_train.sh --help` for the environment variables and every trainer flag.
# See docs/launching.md.

set -euo pipefail

usage() {
    cat <<'EOF'
Usage: [ENV=VALUE ...] ./run_train.sh [trainer flags...]

Environment variables:
  NGPU         ranks (processes) on this machine. Default: the number of CUDA GPUs
               (nvidia-smi, respecting CUDA_VISIBLE_DEVICES), or 1 CPU rank without GPUs.
  LOG_RANK     local ranks whose output reaches the console, e.g. 0 or 0,1 (default 0).
               Every rank's output is also kept in torchrun's log folder (--tee 3).
  CONFIG_FILE  TOML job config (default ./train_configs/debug_model.toml), passed as
               --job.config_file.
  MODULE, CONFIG
               newer upstream style, instead of CONFIG_FILE (setting both is refused): both
               together pick a bundled config by name and are passed as --module MODULE
               --config CONFIG, e.g. MODULE=llama3 CONFIG=llama3_debugmodel.
  TRAIN_FILE   trainer entry point: a module run with -m (default torchtitan.train) or a
               path to a .py file.
  COMM_MODE    "" (default): real torchrun job.
               fake_backend: one process with fake collectives (dry run of config, model
               setup and rank-0 logic at NGPU ranks).
               local_tensor: one process that simulates all NGPU ranks' numerics.
               Both run one training step unless you pass --training.steps.
  RANK         with COMM_MODE: the global rank the single process plays (default 0).
  OMP_NUM_THREADS
               CPU threads per rank. Default on CPU with NGPU>1: max(1, nproc/NGPU).
  TORCHTITAN_COLOR
               1 or 0: colour the step line or not (default: 1 when this console is a
               terminal; a log file or a pipe gets plain text). NO_COLOR turns colours off.
  PYTHON       Python interpreter (default: python, else python3).

Trainer flags override the config file, e.g. --training.steps 50 --profiling.enable_memory_snapshot
(booleans are actions; turn one off with --profiling.no_enable_memory_snapshot).
EOF
}

die() {
    echo "run_train.sh: $*" >&2
    exit 2
}

PYTHON=${PYTHON:-$(command -v python || command -v python3 || true)}
[[ -n "$PYTHON" ]] || die "no python on PATH; set PYTHON=/path/to/python"
command -v "$PYTHON" >/dev/null 2>&1 \
    || die "PYTHON='$PYTHON' is not an executable: set PYTHON=/path/to/python, or unset it to use python from PATH"

for arg in "$@"; do
    if [[ "$arg" == "--help" || "$arg" == "-h" ]]; then
        usage
        echo
        # The trainer's flags, grouped by section, with types, defaults and help text.
        tool=torchtitan.config_manager
        if ! "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$tool') is None)" 2>/dev/null; then
            tool=torchtitan.config.manager
        fi
        echo "Trainer flags (python -m $tool --help):"
        if ! "$PYTHON" -m "$tool" --help; then
            echo "(could not print the trainer flags: 'python -m $tool --help' failed; see the error above)"
        fi
        exit 0
    fi
done

# Number of CUDA GPUs visible to this job: 0 when there is no working nvidia-smi.
count_gpus() {
    local n=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
        n=${n:-0}
    fi
    if ((n > 0)) && [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        if [[ -z "$CUDA_VISIBLE_DEVICES" || "$CUDA_VISIBLE_DEVICES" == -* ]]; then
            n=0
        else
            local devices
            IFS=',' read -r -a devices <<<"$CUDA_VISIBLE_DEVICES"
            ((${#devices[@]} < n)) && n=${#devices[@]}
        fi
    fi
    echo "$n"
}

NUM_CUDA_GPUS=$(count_gpus)
if [[ -z "${NGPU:-}" ]]; then
    NGPU=$((NUM_CUDA_GPUS > 0 ? NUM_CUDA_GPUS : 1))
fi
[[ "$NGPU" =~ ^[1-9][0-9]*$ ]] || die "NGPU must be a positive integer, got '$NGPU'"
LOG_RANK=${LOG_RANK:-0}
TRAIN_FILE=${TRAIN_FILE:-torchtitan.train}
COMM_MODE=${COMM_MODE:-}
export NGPU LOG_RANK

# Which config: CONFIG_FILE, or MODULE+CONFIG (never both: one would be ignored), or the
# debug model.
if [[ -n "${CONFIG_FILE:-}" && ( -n "${MODULE:-}" || -n "${CONFIG:-}" ) ]]; then
    die "set CONFIG_FILE or MODULE+CONFIG, not both (one would be ignored); got CONFIG_FILE='$CONFIG_FILE' MODULE='${MODULE:-}' CONFIG='${CONFIG:-}'"
elif [[ -n "${CONFIG_FILE:-}" ]]; then
    if [[ -d "$CONFIG_FILE" ]]; then
        example=$(find "$CONFIG_FILE" -maxdepth 1 -name '*.toml' -print 2>/dev/null | sort | head -n 1)
        die "CONFIG_FILE '$CONFIG_FILE' is a folder, not a TOML file${example:+; give one of its .toml files, e.g. CONFIG_FILE=$example}"
    fi
    [[ -f "$CONFIG_FILE" ]] || die "CONFIG_FILE '$CONFIG_FILE' does not exist (run from the repository root, or give an absolute path)"
    config_args=(--job.config_file "$CONFIG_FILE")
elif [[ -n "${MODULE:-}" && -n "${CONFIG:-}" ]]; then
    config_args=(--module "$MODULE" --config "$CONFIG")
elif [[ -n "${MODULE:-}" || -n "${CONFIG:-}" ]]; then
    die "set both MODULE and CONFIG (e.g. MODULE=llama3 CONFIG=llama3_debugmodel), or use CONFIG_FILE=path.toml; got MODULE='${MODULE:-}' CONFIG='${CONFIG:-}'"
else
    CONFIG_FILE=./train_configs/debug_model.toml
    [[ -f "$CONFIG_FILE" ]] || die "default CONFIG_FILE '$CONFIG_FILE' not found: run from the repository root or set CONFIG_FILE"
    config_args=(--job.config_file "$CONFIG_FILE")
fi

# A module name runs with -m; a path to a .py file runs as a script.
if [[ "$TRAIN_FILE" == *.py ]]; then
    [[ -f "$TRAIN_FILE" ]] || die "TRAIN_FILE '$TRAIN_FILE' does not exist"
    entry=("$TRAIN_FILE")
else
    # A module that is not there would only fail inside torchrun ("rank 0 failed").
    "$PYTHON" - "$TRAIN_FILE" >/dev/null 2>&1 <<'EOF' \
        || die "TRAIN_FILE '$TRAIN_FILE' is neither a .py file nor a module Python can import (run from the repository root, or give the path of a .py file)"
import importlib.util, sys
try:
    sys.exit(importlib.util.find_spec(sys.argv[1]) is None)
except (ImportError, ValueError):
    sys.exit(1)
EOF
    entry=(-m "$TRAIN_FILE")
fi
[[ -z "${OMP_NUM_THREADS:-}" || "$OMP_NUM_THREADS" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] \
    || die "OMP_NUM_THREADS must be a positive integer (CPU threads per rank), got '$OMP_NUM_THREADS'"

case "$COMM_MODE" in
"") ;;
fake_backend | local_tensor)
    # One plain process that simulates NGPU ranks; the trainer reads COMM_MODE.
    steps_args=(--training.steps 1)
    for arg in "$@"; do
        if [[ "$arg" == --training.steps || "$arg" == --training.steps=* ]]; then
            steps_args=()
        fi
    done
    export COMM_MODE
    export WORLD_SIZE="$NGPU" RANK="${RANK:-0}" LOCAL_RANK=0
    echo "run_train.sh: COMM_MODE=$COMM_MODE simulating $NGPU ranks in one process (rank $RANK)" >&2
    set -x
    exec "$PYTHON" "${entry[@]}" "${config_args[@]}" ${steps_args[@]+"${steps_args[@]}"} "$@"
    ;;
*)
    die "COMM_MODE must be empty, fake_backend or local_tensor; got '$COMM_MODE'"
    ;;
esac

# LOG_RANK names local ranks whose output reaches the console: one that does not exist would
# leave the console silent.
IFS=',' read -r -a log_ranks <<<"$LOG_RANK"
for r in "${log_ranks[@]}"; do
    [[ "$r" =~ ^[0-9]+$ ]] && ((r < NGPU)) \
        || die "LOG_RANK='$LOG_RANK' must name local ranks among 0..$((NGPU - 1)) (NGPU=$NGPU), comma separated, e.g. 0"
done

# On CPU, split the cores between the ranks instead of oversubscribing them.
if ((NUM_CUDA_GPUS == 0 && NGPU > 1)) && [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    ncpu=$(nproc 2>/dev/null || echo 1)
    threads=$((ncpu / NGPU))
    export OMP_NUM_THREADS=$((threads > 0 ? threads : 1))
fi

# torchrun, run by torchtitan.launch: it first checks the trainer's config for NGPU ranks in
# this one process (a bad config: one "error:" line, exit 2, no torchrun), and after a failure
# prints the failing rank's one-line reason whatever LOG_RANK shows, exiting with its code.
set -x
exec "$PYTHON" -m torchtitan.launch --nproc_per_node="$NGPU" --rdzv_backend c10d \
    --rdzv_endpoint="localhost:0" --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -- "${entry[@]}" "${config_args[@]}" "$@"
