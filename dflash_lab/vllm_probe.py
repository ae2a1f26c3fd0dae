"""(GPU host) Record the CUDA-graph capture sizes that vLLM 0.22.1's own code derives.

For a set of configurations, builds the engine configuration with vLLM's ``EngineArgs``
(``VllmConfig._set_cudagraph_sizes`` runs there) and then applies vLLM's own
``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode`` exactly as the GPU model
runner does for attention backends with UNIFORM_BATCH graph support (FlashAttention 3,
Gated-DeltaNet). No engine is started; the result is compared with
:mod:`dflash_lab.capture` by ``tests/test_capture.py``. Sizes from a started engine (the
hook's ``engine-<pid>.json``) are recorded separately by the runner.
"""

from __future__ import annotations

import json
import os
import tempfile

from . import provenance

CONFIGS = [
    # (max_num_seqs, k, max_num_batched_tokens, cudagraph_mode)
    (64, 15, 32768, "FULL_AND_PIECEWISE"),
    (32, 15, 32768, "FULL_AND_PIECEWISE"),
    (16, 15, 32768, "FULL_AND_PIECEWISE"),
    (8, 15, 32768, "FULL_AND_PIECEWISE"),
    (64, 15, 32768, "PIECEWISE"),
    (64, 15, 256, "FULL_AND_PIECEWISE"),  # vLLM refuses: no room for the draft slots
    (16, 15, 512, "FULL_AND_PIECEWISE"),
    (64, 7, 32768, "FULL_AND_PIECEWISE"),
    (64, 3, 32768, "FULL_AND_PIECEWISE"),
    (33, 3, 32768, "FULL_AND_PIECEWISE"),
    (33, 3, 32768, "PIECEWISE"),
    (128, 15, 32768, "FULL_AND_PIECEWISE"),
    (5, 4, 8192, "FULL_AND_PIECEWISE"),
]


def record_capture_sizes(out: str) -> None:
    from vllm.config import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from .models import build

    root = tempfile.mkdtemp(prefix="dflash-lab-cfg-")
    paths = build("tiny-dense", root)
    rows = []
    for seqs, k, mnbt, mode in CONFIGS:
        args = EngineArgs(model=paths["target"], tokenizer=paths["target"], load_format="dummy",
                          max_model_len=65536, max_num_seqs=seqs, max_num_batched_tokens=mnbt,
                          speculative_config={"method": "dflash", "model": paths["draft"],
                                              "num_speculative_tokens": k},
                          compilation_config={"cudagraph_mode": mode})
        try:
            vc = args.create_engine_config()
        except Exception as e:  # noqa: BLE001 - vLLM refusing a config is a result too
            rows.append({"max_num_seqs": seqs, "num_speculative_tokens": k, "max_num_batched_tokens": mnbt,
                         "cudagraph_mode": mode, "refused": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
            print(f"{seqs=} {k=} {mnbt=} {mode}: refused by vLLM", flush=True)
            continue
        cc = vc.compilation_config
        config_sizes = list(cc.cudagraph_capture_sizes)
        config_max = cc.max_cudagraph_capture_size
        resolved = cc.cudagraph_mode
        if resolved.decode_mode() == CUDAGraphMode.FULL and k + 1 > 1:
            cc.adjust_cudagraph_sizes_for_spec_decode(k + 1, 1)
        rows.append({"max_num_seqs": seqs, "num_speculative_tokens": k, "max_num_batched_tokens": mnbt,
                     "cudagraph_mode": mode, "resolved_mode": str(resolved),
                     "config_capture_sizes": config_sizes, "config_max_capture_size": config_max,
                     "engine_capture_sizes": list(cc.cudagraph_capture_sizes),
                     "engine_max_capture_size": cc.max_cudagraph_capture_size})
        print(f"{seqs=} {k=} {mnbt=} {mode}: {len(cc.cudagraph_capture_sizes)} sizes, "
              f"largest {cc.max_cudagraph_capture_size}", flush=True)
    doc = {"provenance": provenance.collect(),
           "method": "vllm.engine.arg_utils.EngineArgs.create_engine_config() then "
                     "CompilationConfig.adjust_cudagraph_sizes_for_spec_decode(k+1, tp=1) "
                     "as GPUModelRunner does for UNIFORM_BATCH backends",
           "configs": rows}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, out)
