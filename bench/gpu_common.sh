# Shared by bench/gpu_run.sh and bench/gpu_colossalai.sh (sourced; FLOW_TIMEOUT_DEFAULT set first).
# Every log and result goes to a work folder, bundled into $OUT/logs.tgz after each step (call
# `bundle`) and every 30 s: the device returns a few files a call (eight, seen 2026-12-03), and a
# step killed by the limit keeps its log so far.
DEST=${OUT:-/tmp/out}; OUT=${GPU_LOGS:-/tmp/gpu-logs}; mkdir -p "$OUT" "$DEST"
bundle() { tar -C "$OUT" -czf "$DEST/logs.tgz.part" . 2>/dev/null && mv -f "$DEST/logs.tgz.part" "$DEST/logs.tgz"; }
( while sleep 30; do bundle; done ) & BUNDLER=$!
trap 'kill $BUNDLER 2>/dev/null; bundle' EXIT
[ -d /tmp/site/prefect ] || { mkdir -p /tmp/site && tar -C /tmp/site -xJf .devcarry/flow-lean.tar.xz; }
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 PREFECT_SERVER_ANALYTICS_ENABLED=false
gpumon() { nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 250 > "$1" & echo $!; }
flow() {  # flow NAME ARGS...: `rlhf run` timed, the GPU sampled every 250 ms; returns its exit status
  local name=$1; shift
  local mon; mon=$(gpumon "$OUT/gpu_$name.csv")
  local t0; t0=$(date +%s.%N)
  timeout "${FLOW_TIMEOUT:-$FLOW_TIMEOUT_DEFAULT}" python3 -m flows.cli run "$@" > "$OUT/run_$name.log" 2>&1; local rc=$?
  echo "rc=$rc wall_s=$(python3 -c "import time; print(round(time.time() - $t0, 1))")" >> "$OUT/run_$name.log"
  kill "$mon"
  [ $rc = 0 ] || { grep -n -B2 -A25 "Traceback" "$OUT/run_$name.log" | head -80; tail -30 ~/.prefect/rlhf-server.log >> "$OUT/run_$name.log" 2>/dev/null; }
  grep -E "^rlhf: |placement|peak memory|rc=|Error|error:" "$OUT/run_$name.log" | tail -25
  return $rc
}
