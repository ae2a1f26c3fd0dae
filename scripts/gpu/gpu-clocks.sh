#!/bin/bash
# GPU host: sample every GPU's SM and memory clocks, power, temperature and clock-event reasons into FILE, every
# PERIOD_S seconds, while process WATCH_PID lives (session.sh passes its own pid, so the sampler ends with the call
# however the call ends). Why: the same mode at the same cell ran at 0.73-1.11x of itself between GPU sessions
# (notebook 05's drift table), as large as the effects the benchmark measures; clocks, power capping and thermal
# slowdown are what a session records nothing else about. Read by dflash_lab.gpuclocks.
#   usage: gpu-clocks.sh FILE WATCH_PID [PERIOD_S]
# Each line: UTC epoch seconds, then nvidia-smi's index, clocks.sm, clocks.mem (MHz), power.draw (W),
# temperature.gpu (C), and the active clock-event reasons (a hex bitmask); one line per GPU per sample.
set -u
OUT=${1:?usage: gpu-clocks.sh FILE WATCH_PID [PERIOD_S]}; WATCH=${2:?usage: gpu-clocks.sh FILE WATCH_PID [PERIOD_S]}
PERIOD=${3:-1}
# newer drivers name the reasons clocks_event_reasons, older ones clocks_throttle_reasons
R=clocks_throttle_reasons.active
nvidia-smi --query-gpu=clocks_event_reasons.active --format=csv,noheader >/dev/null 2>&1 && R=clocks_event_reasons.active
echo "# epoch_s,index,sm_mhz,mem_mhz,power_w,temp_c,reasons ($R)" > "$OUT"
while kill -0 "$WATCH" 2>/dev/null; do
  t=$(date -u +%s.%N)
  nvidia-smi --query-gpu=index,clocks.sm,clocks.mem,power.draw,temperature.gpu,$R --format=csv,noheader,nounits \
    2>/dev/null | sed "s/^/$t, /" >> "$OUT"
  sleep "$PERIOD"
done
