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
#   detached.sh busy                             exit 1 (naming it) while any runner runs on the host (session.sh
#                                                asks before it starts engines: one GPU, one runner)
# Each returns once the runner has ended or WAIT_S seconds after the call began (setup included; give the device call a
# timeout_s ~20 s above it, for the snapshot), with everything so far under $OUT: runs.jsonl (complete lines only),
# logs.tgz, gpu_clocks.csv, setup.log, runner.log (the runner's own output) and status. While it waits it refreshes
# them every DETACHED_SNAPSHOT_S (60) seconds, each file written whole, so a call cut at its limit still returns them.
# Each call's files hold all that the earlier calls' did: ingest the last that came back (a host lost later keeps
# them). A start refuses while any runner is running on the host. SKIP_DONE and SKIP_HOST=1 work as in session.sh
# (scripts/gpu/skip-done.sh); the runner keeps its runs.jsonl on the host at its end (host-runs.sh).
# DFLASH_LAB_GPU_SESSION labels every line with the GPU session, as in session.sh. The runner may end up to ~2 minutes
# after its deadline (a crash's core dump, its reading: coredump.collect): set DEADLINE_S to the device time left
# after staging less ~120 s, so that a wait call is still in flight when it ends.
set -uo pipefail
T0=$(date +%s)
ROOT=${DETACHED_ROOT:-/tmp/detached}            # the runners' folders on the host
SETUP=${DFLASH_LAB_HOST_SETUP-scripts/gpu/setup.sh}    # blank: no setup (tests)
EVERY=${DETACHED_SNAPSHOT_S:-60}                # a wait call's snapshot period: a call cut at its limit keeps the last
OUT=${OUT:-/tmp/out}
die() { echo "detached.sh: $*" >&2; exit 2; }
usage="usage: detached.sh start MATRIX DEADLINE_S WAIT_S | wait MATRIX WAIT_S | busy"
isnum() { [[ "${1:-}" =~ ^[0-9]+$ ]] || die "not a whole number of seconds: '${1:-}' ($usage)"; }

# a runner folder whose runner is running: a pid, no exit status yet, its process neither gone nor a zombie (an
# orphan's new parent may never reap it)
running() {
  [ -f "$1/pid" ] && [ ! -f "$1/rc" ] || return 1
  local pid; pid=$(cat "$1/pid")
  kill -0 "$pid" 2>/dev/null && ! grep -q '^[0-9]* (.*) Z' "/proc/$pid/stat" 2>/dev/null
}
# every running runner on this host, one per line (one GPU: two engines at once would record each other's failures)
busy() {
  local d
  for d in "$ROOT"/*/; do d=${d%/}; if running "$d"; then echo "$d (pid $(cat "$d/pid"))"; fi; done
}

CMD=${1:-}
if [ "$CMD" = busy ]; then   # session.sh asks this before it starts an engine
  b=$(busy)
  [ -z "$b" ] && exit 0
  echo "detached.sh: a runner is running on this host: $b" >&2
  exit 1
fi
MATRIX=${2:-}
[ -n "$MATRIX" ] || die "$usage"
NAME=$(basename "$MATRIX" .yaml)
[[ "$NAME" =~ ^[A-Za-z0-9._-]+$ ]] || die "bad matrix name: $NAME"
D=$ROOT/$NAME

# FILE in $OUT from what a command writes to stdout, whole or not at all (a call cut at its limit returns $OUT as it is)
put() { local name=$1; shift; "$@" > "$OUT/$name.part" && mv "$OUT/$name.part" "$OUT/$name"; }

snapshot() {   # $1 = say: also print the status and the runner's last lines
  mkdir -p "$OUT"
  if [ -f "$D/runs.jsonl" ]; then   # up to the last newline: a copy never ends in half a line
    put runs.jsonl python3 -c 'import sys; d = open(sys.argv[1], "rb").read(); sys.stdout.buffer.write(d[:d.rfind(b"\n") + 1])' \
      "$D/runs.jsonl"
  fi
  if [ -d "$D/logs" ]; then bash scripts/gpu/pack-logs.sh "$D/logs" "$OUT/logs.tgz"; fi
  for f in gpu_clocks.csv setup.log; do if [ -f "$D/$f" ]; then put "$f" cat "$D/$f"; fi; done
  if [ -f "$D/runner.log" ]; then put runner.log tail -c 2000000 "$D/runner.log"; fi
  if [ -f "$D/rc" ]; then
    status="ended rc=$(cat "$D/rc")"
  elif running "$D"; then
    status="running (pid $(cat "$D/pid"), $(( $(date +%s) - $(cat "$D/t0") )) s since its start)"
  else
    status="ended without an exit status (killed?)"
  fi
  put status echo "$status"
  if [ "${1:-}" = say ]; then
    echo "detached.sh: $NAME: runner $status; $(cat "$OUT/runs.jsonl" 2>/dev/null | grep -c .) line(s) in runs.jsonl"
    if [ -f "$OUT/runner.log" ]; then tail -20 "$OUT/runner.log"; fi
  fi
  return 0
}

# WAIT_S counts from this call's start (T0), setup included: the call returns by then (plus the snapshot's seconds);
# meanwhile a snapshot every EVERY seconds
wait_for() {
  local end=$(( T0 + $1 )) next=$(( $(date +%s) + EVERY ))
  while running "$D" && [ "$(date +%s)" -lt "$end" ]; do
    sleep 2
    if [ "$(date +%s)" -ge "$next" ]; then snapshot; next=$(( $(date +%s) + EVERY )); fi
  done
  snapshot say
}

case "$CMD" in
  start)
    DEADLINE=${3:-}; WAIT=${4:-}
    isnum "$DEADLINE"; isnum "$WAIT"
    [ -f "$MATRIX" ] || die "no such matrix: $MATRIX"
    b=$(busy)
    [ -z "$b" ] || die "a runner is already running on this host: $b (one GPU, one runner; to follow it: wait)"
    if [ -d "$D" ]; then mv "$D" "$D.$(date +%s%N)"; fi   # an ended runner's folder: kept beside, never reused
    mkdir -p "$D/logs" "$OUT"
    if [ -n "$SETUP" ]; then
      bash "$SETUP" > "$D/setup.log" 2>&1 || { cat "$D/setup.log"; cp "$D/setup.log" "$OUT/"; exit 1; }
      # later vLLM releases the matrix's engines run on (vllm_release; scripts/gpu/stage-release.sh)
      bash scripts/gpu/setup-release.sh "$MATRIX" >> "$D/setup.log" 2>&1 || { cat "$D/setup.log"; cp "$D/setup.log" "$OUT/"; exit 1; }
      tail -3 "$D/setup.log"
      grep -h "^cache.sh:" "$D/setup.log" || true   # whether carried compile caches were used
    fi
    source scripts/gpu/env.sh
    source scripts/gpu/skip-done.sh
    LEFT=$(( DEADLINE - ($(date +%s) - T0) - 25 ))
    [ "$LEFT" -gt 0 ] || die "no time left for the runner (deadline $DEADLINE s, setup took $(( $(date +%s) - T0 )) s)"
    echo "runner deadline: $LEFT s"
    date +%s > "$D/t0"
    # Twice detached: its parent, the subshell, exits at once, so the runner is never in this call's process tree (a
    # call cut at its time limit may take its tree with it), and in its own session (setsid) it outlives the call.
    # The GPU clock sampler runs inside it and stops with the runner; rc is written whole once the runner has ended.
    ( setsid nohup bash -c '
        bash scripts/gpu/gpu-clocks.sh "$2/gpu_clocks.csv" $$ 1 > /dev/null 2>&1 &
        CLOCKS=$!
        python3 -m dflash_lab run "$1" --out "$2/runs.jsonl" --logs "$2/logs" --deadline-s "$3" ${4:+--skip-done $4}
        echo $? > "$2/rc.part"
        kill $CLOCKS 2>/dev/null
        bash scripts/gpu/host-runs.sh keep "$5" "$2/runs.jsonl"
        mv "$2/rc.part" "$2/rc"
      ' _ "$MATRIX" "$D" "$LEFT" "$SKIP_DONE" "$NAME" > "$D/runner.log" 2>&1 < /dev/null &
      echo $! > "$D/pid" )
    echo "detached.sh: runner of $NAME started (pid $(cat "$D/pid")); returning by $WAIT s after this call began"
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
