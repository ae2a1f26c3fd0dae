#!/bin/bash
# GPU host: one full session step. usage: [DFLASH_LAB_GPU_SESSION=LABEL] session.sh MATRIX DEADLINE_S [quick]
#   DFLASH_LAB_GPU_SESSION labels every line with the GPU session (one lease): ratios pair lines of one session.
#   quick: also record vLLM's capture sizes and replay the synthetic launch records compiled on the GPU.
# DEADLINE_S counts from the start of this script (setup included).
# Everything that matters is written under $OUT as it is produced.
set -uo pipefail
T0=$(date +%s)
MATRIX=$1; DEADLINE=$2; QUICK=${3:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/gpu/detached.sh busy || exit 2   # a detached runner holds the GPU (scripts/gpu/detached.sh)
SETUP=${DFLASH_LAB_HOST_SETUP-scripts/gpu/setup.sh}   # blank: no setup (tests)
if [ -n "$SETUP" ]; then
  bash "$SETUP" > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
  # later vLLM releases the matrix's engines run on (vllm_release; scripts/gpu/stage-release.sh)
  bash scripts/gpu/setup-release.sh "$MATRIX" >> "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
  tail -3 "$OUT/setup.log"
  grep -h "^cache.sh:" "$OUT/setup.log" || true   # whether carried compile caches were used
fi
source scripts/gpu/env.sh
if [ "$QUICK" = quick ]; then
  timeout 120 python3 -m dflash_lab record-capture-sizes --out "$OUT/capture_sizes.json" 2>&1 | tail -14
  for k in stock patched; do
    python3 -m dflash_lab replay data/records/*.npz --kernel $k --device cuda --json
  done > "$OUT/gpu_replay.jsonl" 2> "$OUT/gpu_replay.err"
  echo "gpu replay: $(grep -c '"ok": true' "$OUT/gpu_replay.jsonl") ok lines"
fi
LEFT=$(( DEADLINE - ($(date +%s) - T0) - 25 ))
echo "runner deadline: $LEFT s"
# this call's engine logs only: a later call of the same matrix on the same host gets its own folder (one shared
# folder made s16's second and third calls return the earlier calls' logs again, and reuse their names)
LOGS=/tmp/runlogs/$(basename "$MATRIX" .yaml)-$T0
mkdir -p "$LOGS"
# the GPUs' clocks, power and temperature through the call (sessions drift; dflash_lab.gpuclocks reads the file)
bash scripts/gpu/gpu-clocks.sh "$OUT/gpu_clocks.csv" $$ 1 >/dev/null 2>&1 &
CLOCKS=$!
# SKIP_DONE: runs.jsonl files of earlier calls of this matrix (carried into the checkout): continue where they stopped;
# SKIP_HOST=1 adds the earlier calls' on this host (scripts/gpu/skip-done.sh)
NAME=$(basename "$MATRIX" .yaml)
source scripts/gpu/skip-done.sh
python3 -m dflash_lab run "$MATRIX" --out "$OUT/runs.jsonl" --logs "$LOGS" --deadline-s $LEFT ${SKIP_DONE:+--skip-done $SKIP_DONE}
bash scripts/gpu/host-runs.sh keep "$NAME" "$OUT/runs.jsonl" || true
kill $CLOCKS 2>/dev/null
bash scripts/gpu/pack-logs.sh "$LOGS" "$OUT/logs.tgz"
ls -la "$OUT"
