#!/bin/bash
# Re-split the staged vLLM parts so that each fits one device transfer beside this checkout.
#   usage: bash scripts/gpu/fit-parts.sh [SRC=.gpu-parts] [DST=.gpu-parts-fit]
# A transfer carries the checkout (tracked + untracked-not-ignored files) plus the carried paths, at most
# 64 MiB. ../shared/gpu/stage.sh writes 56 MiB parts; once the checkout passes ~8 MiB they no longer fit.
# This writes DST/p0..pN (single digits, as ../shared/gpu/assemble.sh joins p[0-9]; above 10 parts p00..pNN, with
# DST's copy of assemble.sh joining p[0-9][0-9] instead) sized to 64 MiB minus the checkout
# (as a tar archive) minus a margin (FIT_MARGIN_MIB, default 5), plus assemble.sh and SHA256. Measured: 2026-11-30,
# a 56 MiB part beside a 4.5 MiB checkout was refused as over 64 MiB and 46.7 MiB parts went through; 2026-12-01
# (s32), a 30.6 MiB part beside the 33.4 MiB checkout was refused, 25.4 MiB parts went through. The old 12 MiB
# margin would now need 14 parts, more than assemble.sh joins.
# Add /DST/ to .git/info/exclude. On the GPU host, one call per part, carrying it:
# `mkdir -p /tmp/parts && cp DST/pN /tmp/parts/`; the last call also carries DST/assemble.sh and DST/SHA256,
# and scripts/gpu/setup.sh (run by session.sh) assembles.
set -euo pipefail
SRC=${1:-.gpu-parts}; DST=${2:-.gpu-parts-fit}
[ -f "$SRC/assemble.sh" ] && [ -f "$SRC/SHA256" ] || { echo "fit-parts: $SRC has no staged parts (run ../shared/gpu/stage.sh $SRC)" >&2; exit 2; }
# the checkout as an archive (headers and 512-byte padding included: many small files cost more than their bytes)
# (tracked files missing from the tree are skipped: a session may move data/gpu/ aside, which the host never reads)
tree_kib=$(( $( (git ls-files -z; git ls-files -z --others --exclude-standard) | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | wc -c) / 1024 ))
part=$(( (64 * 1024 - tree_kib - ${FIT_MARGIN_MIB:-5} * 1024) * 1024 ))
[ "$part" -gt $(( 8 * 1024 * 1024 )) ] || { echo "fit-parts: the checkout ($tree_kib KiB) leaves no room for a part" >&2; exit 2; }
total=$(cat "$SRC"/p[0-9] | wc -c)
n=$(( (total + part - 1) / part ))
[ "$n" -le 100 ] || { echo "fit-parts: $n parts needed; at most 100 (p00..p99)" >&2; exit 2; }
digits=1; [ "$n" -le 10 ] || digits=2
rm -rf "$DST"; mkdir -p "$DST"
cat "$SRC"/p[0-9] | split -b "$part" -d -a "$digits" - "$DST/p"
cp "$SRC/SHA256" "$DST/"
if [ "$digits" = 1 ]; then cp "$SRC/assemble.sh" "$DST/"
else
  grep -q 'p\[0-9\]' "$SRC/assemble.sh" || { echo "fit-parts: $SRC/assemble.sh does not join p[0-9]: cannot adapt it" >&2; exit 2; }
  sed 's/p\[0-9\]/p[0-9][0-9]/g' "$SRC/assemble.sh" > "$DST/assemble.sh"; chmod +x "$DST/assemble.sh"
fi
echo "checkout $tree_kib KiB; $n parts of <= $((part / 1048576)) MiB in $DST:"; ls -la "$DST"
