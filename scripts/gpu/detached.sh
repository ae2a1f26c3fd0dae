#!/bin/bash
# GPU host: run a whole matrix in one runner that outlives the device calls, so that no engine is cut at the edge of
# one call. Why: a device call lasts at most 10 minutes, and a cold host's first engine takes 407-476 s to start
# (s57-s59); in s59 the runner's deadline cut the only run of the first call 59 s in, and what a call's deadline left
# unused was lost to every call. The device tool lets a process that started a new session (setsid) run on between
# calls until the host goes back, which it does after ~30 s with no call in flight: so send the start and every wait
# call in ONE batch of tool calls, each right after the other.
#   detached.sh start MATRIX DEADLINE_S WAIT_S   set the host up (setup.sh), start the runner in its own session with
#                                                a deadline of DEADLINE_S counted from this script's start (the device
#                                                time left, less what the last wait needs to come back), then wait
#   detached.sh wait MATRIX WAIT_S               wait again (each further call of the batch)
# Each returns once the runner has ended or WAIT_S has passed, with everything so far under $OUT: runs.jsonl
# (complete lines only), logs.tgz, gpu_clocks.csv, setup.log, runner.log (the runner's own output) and status. Each
# call's files hold all that the earlier calls' did: ingest the last that came back (a host lost later keeps them).
# A start refuses while a runner of the same matrix is running on the host. SKIP_DONE and SKIP_HOST=1 work as in
# session.sh (scripts/gpu/skip-done.sh); the runner keeps its runs.jsonl on the host at its end (host-runs.sh).
# DFLASH_LAB_GPU_SESSION labels every line with the GPU session, as in session.sh.
set -uo pipefail
T0=$(date +%s)
ROOT=${DETACHED_ROOT:-/tmp/detached}            # the runners' folders on the host
SETUP=${DFLASH_LAB_HOST_SETUP-scripts/gpu/setup.sh}    # blank: no setup (tests)
OUT=${OUT:-/tmp/out}
die() { echo "detached.sh: $*" >&2; exit 2; }
usage="usage: detached.sh start MATRIX DEADLINE_S WAIT_S | wait MATRIX WAIT_S"
isnum() { [[ "${1:-}" =~ ^[0-9]+$ ]] || die "not a whole number of seconds: '${1:-}' ($usage)"; }

CMD=${1:-}; MATRIX=${2:-}
[ -n "$MATRIX" ] || die "$usage"
NAME=$(basename "$MATRIX" .yaml)
[[ "$NAME" =~ ^[A-Za-z0-9._-]+$ ]] || die "bad matrix name: $NAME"
D=$ROOT/$NAME

# running: started, no exit status yet, and its process neither gone nor a zombie (an orphan's parent may never reap it)
alive() {
  [ -f "$D/pid" ] && [ ! -f "$D/rc" ] || return 1
  local pid; pid=$(cat "$D/pid")
  kill -0 "$pid" 2>/dev/null && ! grep -q '^[0-9]* (.*) Z' "/proc/$pid/stat" 2>/dev/null
}

snapshot() {
  mkdir -p "$OUT"
  if [ -f "$D/runs.jsonl" ]; then   # up to the last newline: a copy never ends in half a line
    python3 -c 'import sys; d = open(sys.argv[1], "rb").read(); open(sys.argv[2], "wb").write(d[:d.rfind(b"\n") + 1])' \
      "$D/runs.jsonl" "$OUT/runs.jsonl"
  fi
  if [ -d "$D/logs" ]; then bash scripts/gpu/pack-logs.sh "$D/logs" "$OUT/logs.tgz"; fi
  for f in gpu_clocks.csv setup.log; do if [ -f "$D/$f" ]; then cp "$D/$f" "$OUT/$f"; fi; done
  if [ -f "$D/runner.log" ]; then tail -c 2000000 "$D/runner.log" > "$OUT/runner.log"; fi
  if [ -f "$D/rc" ]; then
    status="ended rc=$(cat "$D/rc")"
  elif alive; then
    status="running (pid $(cat "$D/pid"), $(( $(date +%s) - $(cat "$D/t0") )) s since its start)"
  else
    status="ended without an exit status (killed?)"
  fi
  echo "$status" > "$OUT/status"
  echo "detached.sh: $NAME: runner $status; $(cat "$OUT/runs.jsonl" 2>/dev/null | grep -c .) line(s) in runs.jsonl"
  if [ -f "$OUT/runner.log" ]; then tail -20 "$OUT/runner.log"; fi
}

wait_for() {
  local end=$(( $(date +%s) + $1 ))
  while alive && [ "$(date +%s)" -lt "$end" ]; do sleep 2; done
  snapshot
}

case "$CMD" in
  start)
    DEADLINE=${3:-}; WAIT=${4:-}
    isnum "$DEADLINE"; isnum "$WAIT"
    [ -f "$MATRIX" ] || die "no such matrix: $MATRIX"
    if alive; then die "a runner of $NAME is already running here (pid $(cat "$D/pid")): use 'wait'"; fi
    if [ -d "$D" ]; then mv "$D" "$D.$(date +%s%N)"; fi   # an ended runner's folder: kept beside, never reused
    mkdir -p "$D/logs" "$OUT"
    if [ -n "$SETUP" ]; then
      bash "$SETUP" > "$D/setup.log" 2>&1 || { cat "$D/setup.log"; cp "$D/setup.log" "$OUT/"; exit 1; }
      tail -3 "$D/setup.log"
      grep -h "^cache.sh:" "$D/setup.log" || true   # whether carried compile caches were used
    fi
    source scripts/gpu/env.sh
    source scripts/gpu/skip-done.sh
    LEFT=$(( DEADLINE - ($(date +%s) - T0) - 25 ))
    [ "$LEFT" -gt 0 ] || die "no time left for the runner (deadline $DEADLINE s, setup took $(( $(date +%s) - T0 )) s)"
    echo "runner deadline: $LEFT s"
    date +%s > "$D/t0"
    # its own session (setsid), stdin closed: it outlives this call. rc is written whole when the runner has ended.
    setsid nohup bash -c '
      python3 -m dflash_lab run "$1" --out "$2/runs.jsonl" --logs "$2/logs" --deadline-s "$3" ${4:+--skip-done $4}
      echo $? > "$2/rc.part"
      bash scripts/gpu/host-runs.sh keep "$5" "$2/runs.jsonl"
      mv "$2/rc.part" "$2/rc"
    ' _ "$MATRIX" "$D" "$LEFT" "$SKIP_DONE" "$NAME" > "$D/runner.log" 2>&1 < /dev/null &
    echo $! > "$D/pid"
    # the GPUs' clocks while the runner lives (dflash_lab.gpuclocks reads the file)
    setsid nohup bash scripts/gpu/gpu-clocks.sh "$D/gpu_clocks.csv" "$(cat "$D/pid")" 1 > /dev/null 2>&1 < /dev/null &
    echo "detached.sh: runner of $NAME started (pid $(cat "$D/pid")); waiting up to $WAIT s"
    wait_for "$WAIT"
    ;;
  wait)
    WAIT=${3:-}
    isnum "$WAIT"
    [ -f "$D/pid" ] || die "no runner of $NAME was started on this host (a fresh host? then start again)"
    wait_for "$WAIT"
    ;;
  *) die "$usage" ;;
esac
