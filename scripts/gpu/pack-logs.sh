#!/bin/bash
# GPU host: pack a runner's log folder into a tar.gz for $OUT, from a copy (the runner may still be writing to it).
# An engine log above 3 MB keeps its last 3 MB (a crash repeats device asserts by the thousand).
#   usage: pack-logs.sh LOGS_DIR OUT_TGZ
set -euo pipefail
SRC=${1:?usage: pack-logs.sh LOGS_DIR OUT_TGZ}; DST=${2:?usage: pack-logs.sh LOGS_DIR OUT_TGZ}
COPY=$(mktemp -d)
trap 'rm -rf "$COPY"' EXIT
# -a: a FIFO is copied as one, never read; a file the runner removes meanwhile is simply missing from the copy
cp -a "$SRC/." "$COPY/" 2>/dev/null || true
find "$COPY" -name '*.log' -size +3M -exec sh -c 'tail -c 3000000 "$1" > "$1.t" && mv "$1.t" "$1"' _ {} \;
tar czf "$DST.part" -C "$COPY" . && mv "$DST.part" "$DST"
