#!/bin/bash
# Stage a later vLLM release for the GPU host, beside 0.22.1 (the runner's engine key vllm_release; dflash_lab/release.py).
#   usage: bash scripts/gpu/stage-release.sh VERSION [OUTDIR=.gpu-release-VERSION]      (on this machine, in the checkout)
# Writes OUTDIR/bundle.tar's parts as ../shared/gpu/stage.sh does for 0.22.1 (the same slimming of the wheel), then
# splits them to fit one device transfer beside the checkout (scripts/gpu/fit-parts.sh), into OUTDIR-fit/. The
# packages that travel: 0.22.1's staging list with each pin the release's own requirements exclude replaced
# (release.release_wheels, which also stops here when the host's torch, triton or transformers is outside the
# release's range). On the host, one call per part: `mkdir -p /tmp/rparts && cp OUTDIR-fit/pN /tmp/rparts/`, the last
# also carrying OUTDIR-fit/assemble.sh, SHA256 and VERSION; then `bash scripts/gpu/setup-release.sh VERSION` (session.sh and
# detached.sh run it for every release their matrix's engines name in vllm_release).
set -euo pipefail
VER=${1:?usage: stage-release.sh VERSION [OUTDIR]}
OUT=${2:-.gpu-release-$VER}
SHARED=${DFLASH_LAB_SHARED_GPU:-../shared/gpu}
[ -f "$SHARED/gpu-extra-wheels.txt" ] && [ -f "$SHARED/assemble.sh" ] || {
  echo "stage-release: $SHARED has no gpu-extra-wheels.txt / assemble.sh (set DFLASH_LAB_SHARED_GPU)" >&2; exit 2; }
PY=${PYTHON:-python3}
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
PLAT="--python-version 3.12 --implementation cp --only-binary=:all: --no-deps"
for n in 28 27 17 34 35 31 24 26 5 12; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64"
PLAT="$PLAT --platform manylinux_2_17_x86_64 --platform linux_x86_64 --platform any"
$PY -m pip download -q $PLAT -d "$WORK/dl" "vllm==$VER" 2>&1 | grep -v "^WARNING: Location" || true
WHL=$(ls "$WORK"/dl/vllm-"$VER"-*.whl 2>/dev/null | head -1)
[ -n "$WHL" ] || { echo "stage-release: no x86-64 wheel of vllm $VER could be downloaded" >&2; exit 2; }
$PY -m zipfile -e "$WHL" "$WORK/slim"
# the release's list: 0.22.1's, each pin the release's requirements exclude replaced (or the reason it cannot run)
PYTHONPATH=. $PY - "$SHARED/gpu-extra-wheels.txt" "$WORK/slim/vllm-$VER.dist-info/METADATA" "$WORK/wheels.txt" <<'EOF'
import sys
from dflash_lab.errors import LabError
from dflash_lab.release import release_wheels
try:
    pins, changed = release_wheels(open(sys.argv[1]).read().splitlines(), open(sys.argv[2]).read())
except LabError as e:
    sys.exit(f"stage-release: {e}")
open(sys.argv[3], "w").write("\n".join(pins) + "\n")
print("stage-release: %d packages, %d pins changed from 0.22.1's list%s" % (
    len(pins), len(changed), "".join("\n  " + c for c in changed)))
EOF
$PY -m pip download -q $PLAT -d "$WORK/bundle/whl" -r "$WORK/wheels.txt" 2>&1 | grep -v "^WARNING: Location" || true
[ "$(ls "$WORK/bundle/whl" | wc -l)" -ge "$(grep -c . "$WORK/wheels.txt")" ] || {
  echo "stage-release: fewer wheels downloaded than listed in $WORK/wheels.txt" >&2; exit 2; }
cp "$WORK/wheels.txt" "$WORK/bundle/wheels.txt"
rm -rf "$WORK/slim/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$WORK/slim/vllm/vllm-rs" \
       "$WORK/slim/vllm/third_party/deep_gemm" "$WORK/slim/vllm/entrypoints/serve/instrumentator/static"
tar cf - -C "$WORK/slim" vllm "vllm-$VER.dist-info" | xz -6 -T2 > "$WORK/bundle/vllm-slim.tar.xz"
tar cf "$WORK/bundle.tar" -C "$WORK/bundle" .
rm -rf "$OUT"; mkdir -p "$OUT"
split -b 56m -d -a 1 "$WORK/bundle.tar" "$OUT/p"
sha256sum "$WORK/bundle.tar" | cut -d' ' -f1 > "$OUT/SHA256"
echo "$VER" > "$OUT/VERSION"
cp "$SHARED/assemble.sh" "$OUT/"
bash scripts/gpu/fit-parts.sh "$OUT" "$OUT-fit"
cp "$OUT/VERSION" "$OUT-fit/"
