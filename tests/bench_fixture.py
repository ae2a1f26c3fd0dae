"""Hand-made bench lines for testing notebooks 05/06 and dflash_lab.bench (NOT measurements).

A made-up step-time model with seeded noise: plain decoding steps cost 8 + 0.05 c ms, a DFlash
verify step 12 + 0.004 * 16 c ms (PIECEWISE 8% slower, eager 2.5x), TPOT = step / L. Stock FULL
crashes from concurrency 32 on. Sessions are labelled 'fixture-*' so they can never pass for GPU data.
"""

import json
import random

CONCS = (1, 4, 8, 16, 32, 64)
ACCS = {1.86: "fixture-a", 3.6: "fixture-b", 6.0: "fixture-c"}


def _line(i, mode, conc, acc, session, rng):
    spec = mode != "nospec"
    L = acc * rng.uniform(0.98, 1.02) if spec else 1.0
    step = (12 + 0.004 * 16 * conc) if spec else (8 + 0.05 * conc)
    step *= {"piecewise": 1.08, "eager": 2.5}.get(mode, 1.0) * rng.uniform(0.97, 1.03)
    crash = mode == "stock" and conc >= 32
    tpot = step / L
    sm = None if crash else {
        "output_throughput": conc * 1000.0 / tpot, "request_throughput": conc * 1000.0 / (tpot * 512),
        "mean_tpot_ms": tpot, "median_tpot_ms": tpot, "p99_tpot_ms": tpot * 1.1,
        "mean_ttft_ms": 30 + conc, "median_ttft_ms": 30 + conc, "p99_ttft_ms": 40 + conc,
        "mean_itl_ms": step, "median_itl_ms": step, "p99_itl_ms": step * 1.3,
        "mean_e2el_ms": tpot * 511 + 30, "median_e2el_ms": tpot * 511 + 30, "p99_e2el_ms": tpot * 520}
    cfg = {"fixed": ("dflash", "FULL_AND_PIECEWISE", True, False), "stock": ("dflash", "FULL_AND_PIECEWISE", False, False),
           "piecewise": ("dflash", "PIECEWISE", False, False), "eager": ("dflash", None, False, True),
           "nospec": ("none", "FULL_AND_PIECEWISE", False, False)}[mode]
    return {"run_id": f"{mode}/c{conc}/r{i}", "mode": "server", "spec_method": cfg[0], "num_speculative_tokens": 15,
            "cudagraph_mode": cfg[1], "enforce_eager": cfg[3], "fix": cfg[2],
            "fix_parts": ["fa3_schedule_refresh", "dflash_kernel_edits", "dflash_lookahead_k_plus_1"] if cfg[2] else None,
            "concurrency": conc, "acceptance": acc, "outcome": "crash" if crash else "ok", "gpu_session": session,
            "engine_id": mode, "attempt": 1, "round": i, "target": {"name": "qwen36-35b-a3b"}, "weights": "dummy",
            "serve_metrics": sm,
            "spec_decode_metrics": {"acceptance_length": L} if spec and not crash else None}


MODES = ("fixed", "piecewise", "nospec", "eager", "stock")


def write_fixture(folder, seed=0, accs=ACCS, modes=MODES):
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for acc, session in accs.items():
        lines = []
        for m in modes:
            lines.append(dict(_line(0, m, 2, acc, session, rng), run_id=f"{m}/c2/warm-up"))  # each engine's first run
            lines += [_line(i, m, c, acc, session, rng) for c in CONCS for i in range(3 if not (m == "stock" and c >= 32) else 1)]
        (folder / f"{session}.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    return str(folder / "*.jsonl")
