#!/bin/bash
# Carry the GPU host's compile caches from one GPU session to the next (every session starts on a bare host).
# Measured 2026-11-30 (s15, real-size hybrid, FULL_AND_PIECEWISE): a cold engine start took 6.0 min, of which
# torch.compile 66 s and the first profiling run (Triton JIT) 84 s; the same configuration on warm caches 1.7 min.
#
#   on the host, after engines ran:   bash scripts/gpu/cache.sh save            pack the caches into pieces
#                                     bash scripts/gpu/cache.sh get FIRST LAST  copy pieces FIRST..LAST to $OUT
#   here, after each get:             cp /work/.device/N/c* /work/.device/N/SHA256 .gpu-cache/   (ignored folder)
#   next session, on the host:        bash scripts/gpu/cache.sh put   (one call per carried batch of <= 3 pieces)
#                                     scripts/gpu/setup.sh then runs `cache.sh restore` before any engine starts
#
# Pieces are 15 MiB (a call returns at most 8 files of 16 MiB, 64 MiB in all: 4 pieces per get; a call carries
# 64 MiB with the checkout: 3 pieces per put). restore unpacks only a complete set whose SHA256 matches; a partial
# or corrupt set is reported and left alone (the engines then compile as on a bare host: slower, never wrong).
set -euo pipefail
CMD=${1:-}
PIECES=${CACHE_PIECES:-/tmp/cache-pieces}     # host: what save wrote
PARTS=${CACHE_PARTS:-/tmp/cache-parts}        # host: what put collected
CARRIED=${CACHE_CARRIED:-.gpu-cache}          # the checkout's carried folder
ROOT=${CACHE_ROOT:-/}                         # where the cached paths live (tests point it elsewhere)
PIECE_BYTES=${CACHE_PIECE_BYTES:-15728640}
DIRS=(${CACHE_DIRS:-$HOME/.cache/vllm $HOME/.triton/cache $HOME/.cache/flashinfer})

die() { echo "cache.sh: $*" >&2; exit 2; }

case "$CMD" in
  save)
    present=()
    for d in "${DIRS[@]}"; do [ -d "$ROOT/${d#/}" ] && present+=("${d#/}"); done
    [ ${#present[@]} -gt 0 ] || die "no cache folder exists (looked for ${DIRS[*]})"
    rm -rf "$PIECES"; mkdir -p "$PIECES"
    tar czf - -C "$ROOT" "${present[@]}" | split -b "$PIECE_BYTES" -d -a 2 - "$PIECES/c"
    cat "$PIECES"/c[0-9][0-9] | sha256sum | cut -d' ' -f1 > "$PIECES/SHA256"
    n=$(ls "$PIECES"/c[0-9][0-9] | wc -l)
    echo "cache.sh: ${present[*]} -> $n piece(s), $(du -sh "$PIECES" | cut -f1) in $PIECES (get 0 $((n - 1)), 4 per call)"
    ;;
  get)
    first=${2:?usage: cache.sh get FIRST LAST}; last=${3:?usage: cache.sh get FIRST LAST}
    [ $((last - first)) -lt 4 ] || die "at most 4 pieces per call (8 files, 64 MiB come back)"
    out=${OUT:?OUT is not set}; mkdir -p "$out"
    [ "$first" -eq 0 ] && cp "$PIECES/SHA256" "$out/"
    for i in $(seq "$first" "$last"); do
      p=$(printf '%s/c%02d' "$PIECES" "$i"); [ -f "$p" ] || die "no piece $p (save first)"
      cp "$p" "$out/"
    done
    echo "cache.sh: pieces $first..$last in $out"
    ;;
  put)
    ls "$CARRIED"/c[0-9][0-9] >/dev/null 2>&1 || die "no pieces in $CARRIED (carry them: .gpu-cache/cNN)"
    mkdir -p "$PARTS"; cp "$CARRIED"/c[0-9][0-9] "$PARTS/"
    [ -f "$CARRIED/SHA256" ] && cp "$CARRIED/SHA256" "$PARTS/"
    echo "cache.sh: $(ls "$PARTS"/c[0-9][0-9] | wc -l) piece(s) collected in $PARTS"
    ;;
  restore)
    ls "$PARTS"/c[0-9][0-9] >/dev/null 2>&1 || { echo "cache.sh: no carried compile cache (engines compile from scratch)"; exit 0; }
    [ -f "$PARTS/SHA256" ] || { echo "cache.sh: carried cache has no SHA256: not used" >&2; exit 0; }
    got=$(cat "$PARTS"/c[0-9][0-9] | sha256sum | cut -d' ' -f1)
    if [ "$got" != "$(cat "$PARTS/SHA256")" ]; then
      echo "cache.sh: carried cache incomplete or corrupt ($(ls "$PARTS"/c[0-9][0-9] | wc -l) piece(s), checksum differs): not used" >&2
      exit 0
    fi
    mkdir -p "$ROOT"; cat "$PARTS"/c[0-9][0-9] | tar xzf - -C "$ROOT"
    echo "cache.sh: compile cache restored ($(cat "$PARTS"/c[0-9][0-9] | wc -c) bytes packed)"
    ;;
  *) die "usage: cache.sh save | get FIRST LAST | put | restore" ;;
esac
