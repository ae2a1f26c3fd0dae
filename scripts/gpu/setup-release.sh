#!/bin/bash
# GPU host: assemble a later vLLM release from its staged parts (scripts/gpu/stage-release.sh), once per host, into
# $DFLASH_LAB_RELEASES/VERSION (default /tmp/vllm-releases/VERSION), apart from 0.22.1's /tmp/vllm-site, and check
# that the modules the crash configuration runs import there with the host's torch.
#   usage: bash scripts/gpu/setup-release.sh VERSION     (parts in /tmp/rparts: one device call each, the last also
#          carrying .gpu-release-VERSION-fit/assemble.sh, SHA256 and VERSION)
#          bash scripts/gpu/setup-release.sh MATRIX.yaml  (each release the matrix's engines name, if any: session.sh
#          and detached.sh call this after setup.sh)
set -euo pipefail
ARG=${1:?usage: setup-release.sh VERSION|MATRIX.yaml}
if [[ "$ARG" == *.yaml ]]; then
  VERS=$(python3 -c "import sys; from dflash_lab.runner import load_matrix
print(' '.join(sorted({e['engine']['vllm_release'] for e in load_matrix(sys.argv[1])['engines'] if e['engine']['vllm_release']})))" "$ARG")
  for v in $VERS; do bash "$0" "$v"; done
  exit 0
fi
VER=$ARG
SITE=${DFLASH_LAB_RELEASES:-/tmp/vllm-releases}/$VER
if [ ! -f "$SITE/.dflash-lab-ready" ]; then
  ls /tmp/rparts/p[0-9]* >/dev/null
  ASM=$(ls /tmp/rparts/assemble.sh ".gpu-release-$VER-fit/assemble.sh" 2>/dev/null | head -1 || true)
  [ -n "$ASM" ] || { echo "setup-release: carry .gpu-release-$VER-fit/assemble.sh and SHA256 with the last part" >&2; exit 2; }
  STAGED=$(cat "$(dirname "$ASM")/VERSION" 2>/dev/null || true)
  [ "$STAGED" = "$VER" ] || { echo "setup-release: the parts are of vllm '$STAGED', not $VER" >&2; exit 2; }
  rm -rf "$SITE"
  bash "$ASM" /tmp/rparts "$SITE"
  touch "$SITE/.dflash-lab-ready"
fi
# the modules the offline crash configuration runs, imported as the engine will import them (PYTHONPATH alone)
PYTHONPATH="$SITE" python3 -c "
import vllm, torch
import vllm.v1.engine.core, vllm.v1.worker.gpu_model_runner, vllm.v1.spec_decode.dflash
import vllm.model_executor.models.qwen3_5
assert vllm.__version__ == '$VER', vllm.__version__
print('release', vllm.__version__, 'from', vllm.__file__, 'torch', torch.__version__)"
