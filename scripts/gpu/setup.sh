#!/bin/bash
# GPU host: assemble vLLM 0.22.1 from the staged parts (once per host) and install dflash-lab.
# The parts must already be in /tmp/parts (one device call each: cp .gpu-parts-fit/pN /tmp/parts/).
set -euo pipefail
if [ ! -f /tmp/vllm-site/.dflash-lab-ready ]; then
  ls /tmp/parts/p[0-9]* >/dev/null   # p0..p9, or p00..pNN from fit-parts.sh above 10 parts
  # the first that exists (ls exits 1 when any is missing: under pipefail that must not end the script silently)
  ASM=$(ls /tmp/parts/assemble.sh .gpu-parts-fit/assemble.sh .gpu-parts/assemble.sh 2>/dev/null | head -1 || true)
  [ -n "$ASM" ] || { echo "setup: carry .gpu-parts-fit/assemble.sh and SHA256 (or .gpu-parts/...) with the last part" >&2; exit 2; }
  bash "$ASM" /tmp/parts /tmp/vllm-site
  touch /tmp/vllm-site/.dflash-lab-ready
fi
export PYTHONPATH=/tmp/vllm-site
# compile caches carried from an earlier session (scripts/gpu/cache.sh put): once per host, before any engine
if [ ! -f /tmp/.dflash-lab-cache-tried ]; then
  bash scripts/gpu/cache.sh restore || true
  touch /tmp/.dflash-lab-cache-tried
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index --force-reinstall . 2>&1 | grep -v WARNING || true
python3 -c "import vllm, dflash_lab, importlib.metadata as m; print('vllm', vllm.__version__, 'dflash_lab', dflash_lab.__version__, [e.name for e in m.entry_points(group='vllm.general_plugins')])"
# the host CPU: PIECEWISE at concurrency 1 ran 56-91 tok/s at 1.86, between sessions and inside one (s24-s33)
echo "host cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(nproc) cores"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
