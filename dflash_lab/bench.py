"""The serving benchmark (issue 11), read from ``data/bench/``: cells, side-by-side ratios,
recommendations, and a step-time model of the speedup.

A bench line is a runner result line from a server-mode run (``mode: server`` in the matrix,
streamed chat completions on loopback); its ``serve_metrics`` hold what ``vllm bench serve``
reports, under the same names (``output_throughput``, ``mean_tpot_ms``, ``p99_itl_ms``, ...), see
:mod:`dflash_lab.servebench`. Every line knows its GPU session (``gpu_session``, or the label
``ingest --gpu-session`` wrote into the runs file's ``.meta.json``).

Rules the functions here enforce, because the findings quote their output:

- a ratio is only taken between cells of the **same GPU session** (and the same acceptance and
  concurrency); cells from different sessions are never paired;
- crashed runs are kept: a cell reports ``crashed/runs``; a mode that crashed in a cell is never
  recommended for it;
- the step-time model is fitted on some cells and checked on a cell it did not see.
"""

from __future__ import annotations

import glob
import math
import os

from .errors import LabError

MODES = ("DFlash FULL (fixed)", "DFlash FULL (stock)", "DFlash PIECEWISE", "DFlash eager", "no speculation")
METRICS = ("output_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
           "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
           "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms")


def mode_of(r) -> str:
    """The benchmark mode a run line measured (one of MODES), or a descriptive label otherwise."""
    spec = r.get("spec_method")
    if spec in (None, "none"):
        return "no speculation" if not r.get("enforce_eager") else "no speculation, eager"
    if spec != "dflash":
        return f"{spec} k={r.get('num_speculative_tokens')}"
    if r.get("enforce_eager"):
        return "DFlash eager"
    cg = r.get("cudagraph_mode")
    if cg == "PIECEWISE":
        return "DFlash PIECEWISE"
    if cg == "FULL_AND_PIECEWISE":
        parts = r.get("fix_parts") or ()
        if r.get("fix") and "fa3_schedule_refresh" in parts:
            return "DFlash FULL (fixed)"
        return "DFlash FULL (stock)" if not r.get("fix") else "DFlash FULL (fix without part 1)"
    return f"DFlash {cg}"


def load_bench(pattern: str = "data/bench/*.jsonl"):
    """All bench lines as a DataFrame: one row per run, metrics flattened, mode and session set."""
    import pandas as pd

    from .analysis import _meta_session
    from .runner import read_lines

    files = sorted(glob.glob(pattern))
    if not files:
        raise LabError(f"no bench files match {pattern}")
    rows = []
    for f in files:
        session = _meta_session(f)
        for i, r in enumerate(read_lines(f), 1):
            if r.get("mode") != "server":
                raise LabError(f"{f}:{i}: not a server-mode run (bench lines come from the streamed server workload)")
            sm = r.get("serve_metrics") or {}
            sd = r.get("spec_decode_metrics") or {}
            row = {"file": os.path.basename(f), "run_id": r["run_id"], "gpu_session": r.get("gpu_session") or session,
                   "mode": mode_of(r), "concurrency": r["concurrency"], "acceptance": r.get("acceptance"),
                   "outcome": r["outcome"], "crashed": r["outcome"] == "crash",
                   "acceptance_length": sd.get("acceptance_length"),
                   "num_speculative_tokens": r.get("num_speculative_tokens") if r.get("spec_method") not in (None, "none") else 0,
                   "engine_id": r.get("engine_id"), "attempt": r.get("attempt"), "round": r.get("round"),
                   "target": (r.get("target") or {}).get("name") if isinstance(r.get("target"), dict) else r.get("target"),
                   "weights": r.get("weights"), "started_at": r.get("started_at")}
            for m in METRICS:
                row[m] = sm.get(m)
            rows.append(row)
    df = pd.DataFrame(rows)
    if df["gpu_session"].isna().any():
        bad = sorted(set(df.loc[df["gpu_session"].isna(), "file"]))
        raise LabError(f"bench lines without a GPU session label in {bad}: ingest them with --gpu-session")
    return df


def cells(df):
    """One row per (session, acceptance, mode, concurrency): runs, crashes and the spread of each metric
    over the completed runs (mean, std, min, max; n)."""
    import pandas as pd

    out = []
    for key, g in df.groupby(["gpu_session", "acceptance", "mode", "concurrency"], dropna=False):
        ok = g[g["outcome"] == "ok"]
        row = dict(zip(("gpu_session", "acceptance", "mode", "concurrency"), key))
        row.update({"runs": len(g), "ok": len(ok), "crashed": int(g["crashed"].sum()),
                    "crashed / runs": f"{int(g['crashed'].sum())}/{len(g)}",
                    "acceptance_length": ok["acceptance_length"].mean() if len(ok) else None})
        for m in METRICS:
            x = ok[m].dropna()
            row[m] = x.mean() if len(x) else None
            row[m + "_std"] = x.std(ddof=1) if len(x) > 1 else None
            row[m + "_min"] = x.min() if len(x) else None
            row[m + "_max"] = x.max() if len(x) else None
        out.append(row)
    return pd.DataFrame(out)


def speedup(cells_df, num: str, den: str, metric: str = "output_throughput"):
    """Ratio num/den of ``metric`` per (session, acceptance, concurrency), same session only.

    ``ratio`` is the ratio of the means; ``low``/``high`` bound it by the extreme repeats
    (min of num over max of den, and the reverse). A cell where either side crashed or has no
    completed run gives no ratio and says why."""
    import pandas as pd

    rows = []
    a = cells_df[cells_df["mode"] == num].set_index(["gpu_session", "acceptance", "concurrency"])
    b = cells_df[cells_df["mode"] == den].set_index(["gpu_session", "acceptance", "concurrency"])
    for key in sorted(set(a.index) & set(b.index), key=lambda k: (str(k[0]), k[1], k[2])):
        x, y = a.loc[key], b.loc[key]
        row = dict(zip(("gpu_session", "acceptance", "concurrency"), key))
        row.update({"num": num, "den": den, "n": f"{x['ok']}/{y['ok']}"})
        if x["crashed"] or y["crashed"] or not x["ok"] or not y["ok"] or not y[metric]:
            row.update({"ratio": None, "low": None, "high": None,
                        "note": "; ".join(f"{m} crashed {c['crashed / runs']}" for m, c in ((num, x), (den, y)) if c["crashed"])
                        or "no completed run"})
        else:
            row.update({"ratio": x[metric] / y[metric], "low": x[metric + "_min"] / y[metric + "_max"],
                        "high": x[metric + "_max"] / y[metric + "_min"], "note": ""})
        rows.append(row)
    return pd.DataFrame(rows)


def recommend(cells_df, acceptance, session=None, metric: str = "output_throughput"):
    """Per concurrency: the mode with the highest mean ``metric`` among modes that never crashed in
    that cell; consecutive concurrencies with the same choice are merged into one range.
    Returns rows: concurrency range, mode, margin over the runner-up (ratio of means), runner-up."""
    c = cells_df[cells_df["acceptance"] == acceptance]
    if session is not None:
        c = c[c["gpu_session"] == session]
    if c["gpu_session"].nunique() > 1:
        raise LabError(f"acceptance {acceptance}: cells from several GPU sessions {sorted(c['gpu_session'].unique())}: "
                       "choose one (ratios are never taken across sessions)")
    picks = []
    for conc, g in c.groupby("concurrency"):
        g = g[(g["crashed"] == 0) & (g["ok"] > 0)].sort_values(metric, ascending=False)
        if g.empty:
            picks.append((conc, None, None, None))
            continue
        best = g.iloc[0]
        second = g.iloc[1] if len(g) > 1 else None
        picks.append((conc, best["mode"], best[metric] / second[metric] if second is not None else None,
                      second["mode"] if second is not None else None))
    rows = []
    for conc, mode, margin, second in picks:
        if rows and rows[-1]["mode"] == mode:
            rows[-1]["to"] = conc
            rows[-1]["margins"].append(margin)
            continue
        rows.append({"from": conc, "to": conc, "mode": mode, "margins": [margin], "runner-up": second})
    for r in rows:
        m = [x for x in r.pop("margins") if x is not None]
        r["margin over runner-up"] = f"{min(m):.2f}-{max(m):.2f}x" if m else "-"
        r["concurrency"] = f"{r['from']}" if r["from"] == r["to"] else f"{r['from']}-{r['to']}"
    return rows


# ----------------------------------------------------------------------------- step-time model

def step_time_ms(row) -> float | None:
    """Engine step time from a cell: each step gives each request ``L`` tokens (acceptance length;
    1 without speculation), so TPOT = step time / L."""
    tpot = row.get("mean_tpot_ms")
    if tpot is None or (isinstance(tpot, float) and math.isnan(tpot)):
        return None
    spec = row.get("num_speculative_tokens") or 0
    L = row.get("acceptance_length") if spec else 1.0
    if L is None or (isinstance(L, float) and math.isnan(L)):
        return None
    return tpot * L


def tokens_per_step(concurrency: int, k: int) -> int:
    """Target tokens per engine step: the verify pass scores k+1 positions per request."""
    return concurrency * (k + 1)


def fit_step_model(points: list[tuple[float, float]]) -> dict:
    """Least-squares line step_ms = a + b * tokens over (tokens, step_ms) points; r^2 included."""
    import numpy as np

    if len(points) < 2 or len({p[0] for p in points}) < 2:
        raise LabError(f"the step-time model needs cells at two or more token counts, got {len(points)} point(s)")
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    b, a = np.polyfit(x, y, 1)
    pred = a + b * x
    ss = float(((y - y.mean()) ** 2).sum())
    return {"a_ms": float(a), "b_ms_per_token": float(b), "n": len(points),
            "r2": 1.0 - float(((y - pred) ** 2).sum()) / ss if ss else 1.0}


def predict_speedup(spec_model: dict, base_model: dict, acceptance_length: float, concurrency: int, k: int) -> float:
    """Speedup of speculative decoding over plain decoding at one concurrency: per request, L tokens
    per spec step against 1 per plain step, over their step times."""
    t_spec = spec_model["a_ms"] + spec_model["b_ms_per_token"] * tokens_per_step(concurrency, k)
    t_base = base_model["a_ms"] + base_model["b_ms_per_token"] * concurrency
    return acceptance_length * t_base / t_spec


def break_even_acceptance(spec_model: dict, base_model: dict, concurrency: int, k: int) -> float:
    """The acceptance length at which the predicted speedup is 1."""
    return 1.0 / predict_speedup(spec_model, base_model, 1.0, concurrency, k)


# ----------------------------------------------------------------------------- bandwidth floor

def active_params(text: dict) -> dict:
    """Parameters one decode step of a Qwen3.5/3.6-MoE hybrid reads per token at batch 1, by part
    (bf16 weights; norms and biases left out: < 0.1%). The embedding is a row lookup; the LM head
    is read whole."""
    h = text["hidden_size"]
    n = text["num_hidden_layers"]
    n_attn = n // text["full_attention_interval"]
    n_gdn = n - n_attn
    q_out = text["num_attention_heads"] * text["head_dim"] * (2 if text.get("attn_output_gate") else 1)
    kv_out = text["num_key_value_heads"] * text["head_dim"]
    attn = h * q_out + 2 * h * kv_out + text["num_attention_heads"] * text["head_dim"] * h
    kd = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    vd = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    gdn = (h * (2 * kd + 2 * vd)                       # q, k, v, z projections
           + h * 2 * text["linear_num_value_heads"]    # b, a
           + (2 * kd + vd) * text["linear_conv_kernel_dim"]  # causal conv
           + vd * h)                                   # out projection
    expert = 3 * h * text["moe_intermediate_size"]
    moe = (h * text["num_experts"] + text["num_experts_per_tok"] * expert
           + 3 * h * text["shared_expert_intermediate_size"] + h)
    lm_head = text["vocab_size"] * h
    parts = {"full attention (x%d)" % n_attn: n_attn * attn, "Gated DeltaNet (x%d)" % n_gdn: n_gdn * gdn,
             "MoE, top-%d + shared (x%d)" % (text["num_experts_per_tok"], n): n * moe, "LM head": lm_head}
    return {"parts": parts, "total": sum(parts.values())}


def bandwidth_floor_ms(params: float, bytes_per_param: float = 2.0, bandwidth_bytes_s: float = 4.8e12) -> float:
    """Time to stream the weights once from HBM: the floor of a batch-1 decode step."""
    return params * bytes_per_param / bandwidth_bytes_s * 1e3
