#!/bin/bash
# Carry the GPU host's compile caches from one GPU session to the next (every session starts on a bare host).
# Measured 2026-11-30 (s15, real-size hybrid, FULL_AND_PIECEWISE): a cold engine start took 6.0 min, of which
# torch.compile 66 s and the first profiling run (Triton JIT) 84 s; the same configuration on warm caches 1.7 min.
#
#   on the host, after engines ran, in ONE command (a host idle for 30 s is gone, and /tmp with it):
#                                     bash scripts/gpu/cache.sh save && bash scripts/gpu/cache.sh get 0 4
#                                     then at once: bash scripts/gpu/cache.sh get 5 9, ... (5 pieces per call)
#   here, before the first get's files: rm -rf .gpu-cache && mkdir .gpu-cache   (a new set replaces the old)
#                                     cp /work/.device/N/c* /work/.device/N/SHA256 .gpu-cache/   (after each get)
#   next session, on the host:        bash scripts/gpu/cache.sh put   (one call per carried batch of pieces: 2 beside
#                                     the ~34 MiB checkout of s32, once 3 beside a 6 MiB one)
#                                     scripts/gpu/setup.sh then runs `cache.sh restore` before any engine starts
#
# Pieces are 12 MiB (a call returns at most 8 files of 16 MiB, 64 MiB in all: 5 pieces per get; a call carries
# 64 MiB with the checkout, ~34 MiB since data/ grew (s32): 2 pieces per put, 7 calls for s30's 14 pieces; ~45 MB after
# s37: 1 piece per put, 14 calls; ~27 MB after s38, engine logs stored .xz: 2 per put again, 7 calls). SHA256 holds the checksum and the piece count; restore
# joins exactly that many pieces and unpacks only a complete set whose checksum matches; anything else is
# reported and left alone (the engines then compile as on a bare host: slower, never wrong).
set -euo pipefail
CMD=${1:-}
PIECES=${CACHE_PIECES:-/tmp/cache-pieces}     # host: what save wrote
PARTS=${CACHE_PARTS:-/tmp/cache-parts}        # host: what put collected
CARRIED=${CACHE_CARRIED:-.gpu-cache}          # the checkout's carried folder
ROOT=${CACHE_ROOT:-/}                         # where the cached paths live (tests point it elsewhere)
PIECE_BYTES=${CACHE_PIECE_BYTES:-12582912}
PER_GET=5
# vLLM's compile cache (inductor and Triton output of its compiled graphs), Triton's own cache (JIT kernels,
# autotuning results), FlashInfer's JIT, and inductor's default folder (vLLM's smaller torch.compile helpers)
DIRS=(${CACHE_DIRS:-${VLLM_CACHE_ROOT:-$HOME/.cache/vllm} ${TRITON_CACHE_DIR:-$HOME/.triton/cache} $HOME/.cache/flashinfer /tmp/torchinductor_${USER:-root}})

die() { echo "cache.sh: $*" >&2; exit 2; }

case "$CMD" in
  save)
    present=()
    for d in "${DIRS[@]}"; do [ -d "$ROOT/${d#/}" ] && present+=("${d#/}"); done
    [ ${#present[@]} -gt 0 ] || die "no cache folder exists (looked for ${DIRS[*]})"
    rm -rf "$PIECES"; mkdir -p "$PIECES"
    tar czf - -C "$ROOT" "${present[@]}" | split -b "$PIECE_BYTES" -d -a 2 - "$PIECES/c"
    n=$(ls "$PIECES"/c[0-9][0-9] | wc -l)
    echo "$(cat "$PIECES"/c[0-9][0-9] | sha256sum | cut -d' ' -f1) $n" > "$PIECES/SHA256"
    echo "cache.sh: ${present[*]} -> $n piece(s), $(du -sh "$PIECES" | cut -f1) in $PIECES (get 0 $((n - 1)), $PER_GET per call)"
    ;;
  get)
    first=${2:?usage: cache.sh get FIRST LAST}; last=${3:?usage: cache.sh get FIRST LAST}
    [ $((last - first)) -lt $PER_GET ] || die "at most $PER_GET pieces per call (8 files, 64 MiB come back)"
    out=${OUT:?OUT is not set}; mkdir -p "$out"
    [ "$first" -eq 0 ] && cp "$PIECES/SHA256" "$out/"
    for i in $(seq "$first" "$last"); do
      p=$(printf '%s/c%02d' "$PIECES" "$i")
      if [ ! -f "$p" ]; then [ "$i" -gt "$first" ] && break; die "no piece $p (save first)"; fi
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
    [ -f "$PARTS/SHA256" ] || { echo "cache.sh: carried cache has no SHA256: not used"; exit 0; }
    read -r want count < "$PARTS/SHA256" || true
    [ -n "${count:-}" ] || { echo "cache.sh: SHA256 names no piece count (an older save): not used"; exit 0; }
    set=()
    for i in $(seq 0 $((count - 1))); do
      p=$(printf '%s/c%02d' "$PARTS" "$i")
      [ -f "$p" ] || { echo "cache.sh: carried cache incomplete (no $(basename "$p") of $count pieces): not used"; exit 0; }
      set+=("$p")
    done
    if [ "$(cat "${set[@]}" | sha256sum | cut -d' ' -f1)" != "$want" ]; then
      echo "cache.sh: carried cache corrupt ($count pieces, checksum differs): not used"
      exit 0
    fi
    mkdir -p "$ROOT"
    cat "${set[@]}" | tar xzf - -C "$ROOT" || { echo "cache.sh: unpacking failed: engines compile from scratch"; exit 0; }
    echo "cache.sh: compile cache restored ($count pieces, $(cat "${set[@]}" | wc -c) bytes packed)"
    ;;
  *) die "usage: cache.sh save | get FIRST LAST | put | restore" ;;
esac
