#!/bin/bash
# Keep each call's runs.jsonl on the GPU host, so that the next call of the same matrix on the same host can continue
# it without a round trip through this checkout (s59: the host was released in the seconds between one call's reply and
# the next call, and the next call started a fresh host; calls sent together in one batch run back to back instead,
# but the second cannot carry the first's runs.jsonl).
#   host-runs.sh keep NAME FILE   after a call: copy FILE (the call's runs.jsonl) to $HOST_RUNS/NAME-<ns>.jsonl;
#                                 an empty or missing FILE is not kept (that call measured nothing)
#   host-runs.sh list NAME        the kept files of matrix NAME on this host, one per line, oldest first (none: nothing)
# session.sh keeps every call's file, and lists them only with SKIP_HOST=1 (the first call of a batch has none to
# continue). A fresh host has no kept file: its /tmp is new, so nothing is skipped there. A call that the outer
# timeout kills before its end keeps nothing.
# The runner's --skip-done never leaves out a deadline cut, so a kept cut skips nothing.
set -euo pipefail
DIR=${HOST_RUNS:-/tmp/host-runs}
die() { echo "host-runs.sh: $*" >&2; exit 2; }
case "${1:-}" in
  keep)
    name=${2:?usage: host-runs.sh keep NAME FILE}; file=${3:?usage: host-runs.sh keep NAME FILE}
    [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || die "bad matrix name: $name"
    if [ ! -s "$file" ]; then echo "host-runs.sh: $file is empty or missing: nothing kept"; exit 0; fi
    mkdir -p "$DIR"
    dest="$DIR/$name-$(date +%s%N).jsonl"
    cp "$file" "$dest.part" && mv "$dest.part" "$dest"   # never a half-written file under the name list reads
    echo "host-runs.sh: kept $dest"
    ;;
  list)
    name=${2:?usage: host-runs.sh list NAME}
    [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || die "bad matrix name: $name"
    [ -d "$DIR" ] || exit 0
    # exactly NAME-<digits>.jsonl: matrix a's list must not take matrix a-tp1's files
    for f in $(find "$DIR" -maxdepth 1 -name "$name-*.jsonl" -printf '%f\n' | sort); do
      rest=${f#"$name-"}
      [[ "$rest" =~ ^[0-9]+\.jsonl$ ]] && echo "$DIR/$f"
    done
    exit 0
    ;;
  *) die "usage: host-runs.sh keep NAME FILE | list NAME" ;;
esac
