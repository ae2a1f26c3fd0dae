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
bash scripts/gpu/setup.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
tail -3 "$OUT/setup.log"
grep -h "^cache.sh:" "$OUT/setup.log" || true   # whether carried compile caches were used
export PYTHONPATH=/tmp/vllm-site VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export DFLASH_LAB_COMMIT=$(cat .commit 2>/dev/null || echo unknown)
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
# SKIP_DONE: runs.jsonl files of earlier calls of this matrix (carried into the checkout): continue where they stopped
# SKIP_HOST=1: also the runs.jsonl of earlier calls of this matrix on this host (scripts/gpu/host-runs.sh), so a call
# sent in one batch right after another continues it (a fresh host has none: nothing is left out there)
NAME=$(basename "$MATRIX" .yaml)
if [ "${SKIP_HOST:-}" = 1 ]; then
  KEPT=$(bash scripts/gpu/host-runs.sh list "$NAME" | tr '\n' ' ')
  echo "SKIP_HOST: earlier calls of $NAME on this host: ${KEPT:-none}"
  SKIP_DONE="${SKIP_DONE:-} $KEPT"
fi
SKIP_DONE=$(echo ${SKIP_DONE:-})   # globs expand here, on the host; blank: no --skip-done
python3 -m dflash_lab run "$MATRIX" --out "$OUT/runs.jsonl" --logs "$LOGS" --deadline-s $LEFT ${SKIP_DONE:+--skip-done $SKIP_DONE}
bash scripts/gpu/host-runs.sh keep "$NAME" "$OUT/runs.jsonl" || true
find "$LOGS" -name '*.log' -size +3M -exec sh -c 'tail -c 3000000 "$1" > "$1.t" && mv "$1.t" "$1"' _ {} \;
kill $CLOCKS 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$LOGS" .
ls -la "$OUT"
