# Sourced by the GPU check scripts: one timed run with its own log and a summary line.
#
#   timed_run LOG_DIR NAME SECONDS COMMAND...
#
# Runs COMMAND under `timeout SECONDS`, its output in LOG_DIR/NAME.log, appends
# "NAME: exit RC, S s" to $out/summary.txt (and prints it); returns COMMAND's exit code.
timed_run() {
    local log_dir=$1 name=$2 limit=$3 start rc
    shift 3
    start=$(date +%s)
    timeout "$limit" "$@" >"$log_dir/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc, $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
    return $rc
}
