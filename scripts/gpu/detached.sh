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
# THEN="M2.yaml [M3.yaml ...]" on a start: one runner process runs MATRIX, then each of these in turn, every one in its
# own runner folder and with what is left of the same DEADLINE_S (counted from the start call, as for MATRIX): a
# session that must run several matrices on one host (stock FULL, PIECEWISE and the fix's part 1 of a release) needs
# no deadline worked out on the host between them (s68 computed the second one from a guess, and it started nothing).
# A wait names the matrix it follows and returns once that one has ended: `wait MATRIX`, then `wait M2`, each call's
# files that matrix's alone (ingest each from the last call that named it). A matrix of the chain still waiting for its
# turn says "queued"; one whose turn comes after the deadline is not started and says "not started". With THEN, each
# file of SKIP_DONE goes to the chain's matrix its lines name (the runner refuses another matrix's lines); SKIP_HOST=1
# adds each matrix's own kept files.
set -uo pipefail
T0=$(date +%s)
ROOT=${DETACHED_ROOT:-/tmp/detached}            # the runners' folders on the host
SETUP=${DFLASH_LAB_HOST_SETUP-scripts/gpu/setup.sh}    # blank: no setup (tests)
EVERY=${DETACHED_SNAPSHOT_S:-60}                # a wait call's snapshot period: a call cut at its limit keeps the last
OUT=${OUT:-/tmp/out}
die() { echo "detached.sh: $*" >&2; exit 2; }
usage="usage: [THEN='M2.yaml ...'] detached.sh start MATRIX DEADLINE_S WAIT_S | wait MATRIX WAIT_S | busy"
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
  if [ -f "$D/late" ]; then
    status="not started (its turn in the chain came after the deadline)"
  elif [ -f "$D/rc" ]; then
    status="ended rc=$(cat "$D/rc")"
  elif running "$D" && [ ! -f "$D/t0" ]; then   # a chain's later matrix: its turn has not come
    status="queued (pid $(cat "$D/pid")) behind $(cat "$D/after" 2>/dev/null || echo '?')"
  elif running "$D"; then
    status="running (pid $(cat "$D/pid"), $(( $(date +%s) - $(cat "$D/t0") )) s since its start)"
  else
    status="ended without an exit status (killed?)"
  fi
  put status echo "$status"
  if [ "${1:-}" = say ]; then
    echo "detached.sh: $NAME: runner $status; $(cat "$OUT/runs.jsonl" 2>/dev/null | grep -c .) line(s) in runs.jsonl"
    if [ -f "$OUT/runner.log" ]; then tail -20 "$OUT/runner.log"; fi
    if [ -s "$ROOT/$(cat "$D/first" 2>/dev/null)/chain.log" ]; then   # the chain process's own errors, if any
      echo "detached.sh: the chain's own output:"; tail -20 "$ROOT/$(cat "$D/first")/chain.log"
    fi
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
    CHAIN=("$MATRIX")
    for m in ${THEN:-}; do CHAIN+=("$m"); done
    NAMES=()
    for m in "${CHAIN[@]}"; do
      [ -f "$m" ] || die "no such matrix: $m"
      n=$(basename "$m" .yaml)
      [[ "$n" =~ ^[A-Za-z0-9._-]+$ ]] || die "bad matrix name: $n"
      for seen in "${NAMES[@]}"; do [ "$seen" != "$n" ] || die "matrix $n twice in one chain (THEN)"; done
      NAMES+=("$n")
    done
    # SKIP_DONE's files; with THEN each goes to the chain's matrix its lines name, checked before anything is set up
    GIVEN=$(echo ${SKIP_DONE:-})   # globs expand here, on the host
    ROUTED=""                      # with THEN: a line "NAME FILE" per file
    if [ ${#CHAIN[@]} -gt 1 ] && [ -n "$GIVEN" ]; then
      ROUTED=$(python3 - "${NAMES[*]}" $GIVEN <<'PY'
import json, sys
names = set(sys.argv[1].split())
for f in sys.argv[2:]:
    try:
        with open(f) as fh:
            found = {json.loads(line).get("matrix") for line in fh if line.strip()}
    except (OSError, ValueError, AttributeError) as e:
        sys.exit(f"detached.sh: SKIP_DONE file {f}: not a runs file ({type(e).__name__}: {e})")
    if len(found) != 1 or not found <= names:
        sys.exit(f"detached.sh: SKIP_DONE file {f} names matrices {sorted(map(str, found))}, no matrix of the chain "
                 f"{sorted(names)} (THEN)")
    print(found.pop(), f)
PY
) || exit 2
    fi
    b=$(busy)
    [ -z "$b" ] || die "a runner is already running on this host: $b (one GPU, one runner; to follow it: wait)"
    for n in "${NAMES[@]}"; do
      if [ -d "$ROOT/$n" ]; then mv "$ROOT/$n" "$ROOT/$n.$(date +%s%N)"; fi   # an ended runner's folder: kept beside, never reused
      mkdir -p "$ROOT/$n/logs"
    done
    mkdir -p "$OUT"
    if [ -n "$SETUP" ]; then
      bash "$SETUP" > "$D/setup.log" 2>&1 || { cat "$D/setup.log"; cp "$D/setup.log" "$OUT/"; exit 1; }
      # later vLLM releases the chain's engines run on (vllm_release; scripts/gpu/stage-release.sh)
      for m in "${CHAIN[@]}"; do
        bash scripts/gpu/setup-release.sh "$m" >> "$D/setup.log" 2>&1 || { cat "$D/setup.log"; cp "$D/setup.log" "$OUT/"; exit 1; }
      done
      tail -3 "$D/setup.log"
      grep -h "^cache.sh:" "$D/setup.log" || true   # whether carried compile caches were used
    fi
    source scripts/gpu/env.sh
    ARGS=()
    for i in "${!CHAIN[@]}"; do
      NAME=${NAMES[$i]}
      # this matrix's skip list: its SKIP_DONE files, and with SKIP_HOST=1 its kept files on this host
      if [ ${#CHAIN[@]} -gt 1 ]; then SKIP_DONE=$(echo "$ROUTED" | awk -v n="$NAME" '$1 == n {print $2}'); else SKIP_DONE=$GIVEN; fi
      source scripts/gpu/skip-done.sh
      ARGS+=("${CHAIN[$i]}" "$ROOT/$NAME" "$SKIP_DONE" "$NAME")
      [ "$i" -eq 0 ] || echo "${NAMES[$(( i - 1 ))]}" > "$ROOT/$NAME/after"
      echo "${NAMES[0]}" > "$ROOT/$NAME/first"
    done
    NAME=${NAMES[0]}   # this call reports on MATRIX, the chain's first
    END=$(( T0 + DEADLINE - 25 ))   # every matrix's runner deadline: what is left of DEADLINE_S when its turn comes
    [ "$END" -gt "$(date +%s)" ] || die "no time left for the runner (deadline $DEADLINE s, setup took $(( $(date +%s) - T0 )) s)"
    echo "runner deadline: $(( END - $(date +%s) )) s"
    date +%s > "$D/t0"
    # Twice detached: its parent, the subshell, exits at once, so the runner is never in this call's process tree (a
    # call cut at its time limit may take its tree with it), and in its own session (setsid) it outlives the call.
    # The GPU clock sampler runs inside it and stops with each matrix; rc is written whole once that matrix has ended.
    # One process runs the chain's matrices in turn: each folder's pid is that process, t0 is written when its turn
    # comes (a folder with a pid and no t0 is queued), and a matrix whose turn comes after the deadline writes no line.
    ( setsid nohup bash -c '
        END=$1; shift
        while [ $# -ge 4 ]; do
          M=$1; DIR=$2; SKIP=$3; N=$4; shift 4
          LEFT=$(( END - $(date +%s) ))
          [ -f "$DIR/t0" ] || { date +%s > "$DIR/t0.part" && mv "$DIR/t0.part" "$DIR/t0"; }   # its turn, whole
          if [ "$LEFT" -lt 1 ]; then   # never --deadline-s 0, which the runner reads as no deadline
            echo "detached.sh: $N not started: its turn came after the deadline" > "$DIR/runner.log"
            touch "$DIR/late"
            echo 0 > "$DIR/rc"
            continue
          fi
          bash scripts/gpu/gpu-clocks.sh "$DIR/gpu_clocks.csv" $$ 1 > /dev/null 2>&1 &
          CLOCKS=$!
          python3 -m dflash_lab run "$M" --out "$DIR/runs.jsonl" --logs "$DIR/logs" --deadline-s "$LEFT" \
            ${SKIP:+--skip-done $SKIP} > "$DIR/runner.log" 2>&1 < /dev/null
          echo $? > "$DIR/rc.part"
          kill $CLOCKS 2>/dev/null
          bash scripts/gpu/host-runs.sh keep "$N" "$DIR/runs.jsonl" >> "$DIR/runner.log" 2>&1
          mv "$DIR/rc.part" "$DIR/rc"
        done
      ' _ "$END" "${ARGS[@]}" > "$D/chain.log" 2>&1 < /dev/null &
      for n in "${NAMES[@]}"; do echo $! > "$ROOT/$n/pid"; done )   # every folder of the chain, before this call waits
    echo "detached.sh: runner of ${NAMES[*]} started (pid $(cat "$D/pid")); returning by $WAIT s after this call began"
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
