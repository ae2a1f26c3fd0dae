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
- a run the runner's session deadline cut short (:func:`dflash_lab.runner.is_deadline_cut`) measured
  nothing: it is neither a crash nor a completed run, and is counted apart (``cut_by_deadline``), never
  in ``runs``;
- warm-up runs count by their outcome, not by their metrics. A warm-up is a line the runner flagged
  (``"warmup": true``: the bench matrices begin every engine start, restarts and continuing calls
  included, with a short run at each concurrency, so that vLLM compiles its Triton kernels there rather
  than in a measured run; a line with ``"warmup": false`` is measured wherever it stands) or, in older data
  without the flag, the first run of an engine start (their matrices started each engine with one short
  warm-up run; in a continuing call that first run was a measured one, left out all the same);
- the step-time model is fitted on some cells and checked on a cell it did not see.
"""

from __future__ import annotations

import functools
import glob
import math
import os

from .errors import LabError
from .runner import is_deadline_cut

MODES = ("DFlash FULL (fixed)", "DFlash FULL (stock)", "DFlash PIECEWISE", "DFlash eager", "no speculation")
METRICS = ("output_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
           "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
           "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms")

LOAD = ("peak_running", "peak_waiting", "peak_kv_cache_pct")   # engine_load_in_runs, per run and (max) per cell


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
        from .analysis import diff_of

        if diff_of(r):
            return "DFlash FULL (upstream diff)"   # the fix as the diff, the plugin's off (analysis.as_fix)
        if not r.get("fix"):
            return "DFlash FULL (stock)"
        parts = set(r.get("fix_parts") or ())
        if {"fa3_schedule_refresh", "dflash_kernel_edits"} <= parts:
            return "DFlash FULL (fixed)"
        return "DFlash FULL (fix parts: " + " + ".join(sorted(parts)) + ")" if parts else "DFlash FULL (fix without part 1)"
    return f"DFlash {cg}"


def engine_mode(e: dict) -> str:
    """The mode (:func:`mode_of`) of the lines a matrix engine (``runner.load_matrix``'s ``engine``) will write,
    its fields set as the runner writes them (``runner.Runner.line``: no graph mode under eager, the fix with no
    parts named is every part)."""
    from .runner import FIX_PARTS

    return mode_of({"spec_method": e["spec_method"], "num_speculative_tokens": e["num_speculative_tokens"],
                    "enforce_eager": e["enforce_eager"], "fix": e["fix"], "vllm_diff": e.get("vllm_diff"),
                    "cudagraph_mode": None if e["enforce_eager"] else e["cudagraph_mode"],
                    "fix_parts": [p for p in FIX_PARTS if p in (e["fix_parts"] or FIX_PARTS)] if e["fix"] else None})


def load_bench(pattern: str = "data/bench/*.jsonl"):
    """All bench lines as a DataFrame: one row per run, metrics flattened, mode and session set."""
    import pandas as pd

    from . import analysis

    rows = []
    for f, i, r in analysis.recorded_lines(pattern, "bench"):
        if r.get("mode") != "server":
            raise LabError(f"{f}:{i}: not a server-mode run (bench lines come from the streamed server workload)")
        sm = r.get("serve_metrics") or {}
        sd = r.get("spec_decode_metrics") or {}
        row = {"file": os.path.basename(f), "run_id": r["run_id"], "gpu_session": r["gpu_session"],
               "mode": mode_of(r), "concurrency": r["concurrency"], "acceptance": r.get("acceptance"),
               "outcome": r["outcome"], "crashed": r["outcome"] == "crash",
               "cut_by_deadline": is_deadline_cut(r),
               "acceptance_length": sd.get("acceptance_length"), "num_drafts": sd.get("num_drafts"),
               "num_speculative_tokens": r.get("num_speculative_tokens") if r.get("spec_method") not in (None, "none") else 0,
               "engine_id": r.get("engine_id"), "attempt": r.get("attempt"), "round": r.get("round"),
               "target": (r.get("target") or {}).get("name") if isinstance(r.get("target"), dict) else r.get("target"),
               "weights": r.get("weights"), "started_at": r.get("started_at"), "max_tokens": r.get("max_tokens"),
               # the run's window (gpuclocks)
               "finished_at": r.get("finished_at"), "wall_s": r.get("wall_s"),
               "run_start_t": r.get("run_start_t"), "run_end_t": r.get("run_end_t"),
               "startup_s": r.get("startup_s"),
               "tensor_parallel_size": r.get("tensor_parallel_size"), "warmup": r.get("warmup"),
               # core dumps on the engine (from s27 the s2 matrices take them on stock FULL) and what one named
               "coredump": r.get("coredump"), "fault": r.get("fault"),
               "prompt_tokens": (sm["total_input_tokens"] / sm["completed"]) if sm.get("total_input_tokens") and sm.get("completed") else None}
        for m in METRICS:
            row[m] = sm.get(m)
        files = _engine_files(f, r)
        row["engine_log"] = files[0] if files else None
        row["jit_compiles"] = ", ".join(jit_compiles_in_runs(files).get(r["run_id"], [])) if files else ""
        row.update((engine_load_in_runs(files).get(r["run_id"]) if files else None) or dict.fromkeys(LOAD))
        rows.append(row)
    df = pd.DataFrame(rows)
    # warm-ups (lazy compilation, allocator growth) count by their outcome, not their metrics: a line the runner
    # wrote with the flag says itself (a restart whose warm-ups all failed begins with a measured run, which stays
    # one); for older data without the flag, the first run of every engine start
    flagged = df["warmup"].notna()
    df["warmup"] = df["warmup"].where(flagged, analysis.engine_positions(df) == 0).astype(bool)
    if df["gpu_session"].isna().any():
        bad = sorted(set(df.loc[df["gpu_session"].isna(), "file"]))
        raise LabError(f"bench lines without a GPU session label in {bad}: ingest them with --gpu-session")
    return df


def _engine_files(bench_file: str, r) -> tuple[str, str] | None:
    """The stored engine log of a bench line (:func:`analysis.engine_log`, from the line's ``log``) and the runner's
    events file beside it, or None where the log was not kept."""
    import re

    from . import analysis

    data_dir = os.path.dirname(os.path.dirname(os.path.abspath(bench_file)))
    log = analysis.engine_log(dict(r, file=bench_file), data_dir)
    return (log, re.sub(r"\.log(\.gz|\.xz)?$", ".events.jsonl", log)) if log else None


@functools.lru_cache(maxsize=64)
def _run_spans_and_text(files: tuple[str, str]) -> tuple[list, str]:
    """The runs' (start, end, run id) from the runner's events file and the engine log's text, read once per
    engine for every scan of :func:`_stamped_in_runs`; nothing when a file is missing or unreadable."""
    import json

    from . import analysis
    from .runner import read_recorded, recorded_path

    log, events = files
    try:   # as stored: ingest keeps a JSONL file above 1 MiB xz-compressed (events.jsonl.xz)
        ev = [json.loads(x) for x in read_recorded(recorded_path(events) or events).splitlines() if x.strip()]
        text = analysis.read_text(log)
    except (OSError, ValueError):
        return [], ""
    starts = {e["run"]: e["t"] for e in ev if e.get("event") == "run_start" and "t" in e}
    return [(starts[e["run"]], e["t"], e["run"]) for e in ev
            if e.get("event") == "run_end" and e.get("run") in starts and "t" in e], text


@functools.lru_cache(maxsize=512)
def _stamped_in_runs(files: tuple[str, str], pattern: str) -> dict:
    """{run id: [groups of each match of ``pattern``]}: engine-log lines that follow vLLM's time stamp ("MM-DD
    HH:MM:SS ", UTC, to the second), each attributed to the run whose start/end (the runner's events file)
    contains that second; lines outside every run (start-up, between runs) go nowhere, and so does everything
    when a file is missing."""
    import datetime as dt
    import re

    out: dict = {}
    spans, text = _run_spans_and_text(files)
    if spans:
        year = dt.datetime.fromtimestamp(spans[0][0], dt.timezone.utc).year
        for m in re.finditer(r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) " + pattern, text):
            mo, d, h, mi, sec = (int(x) for x in m.groups()[:5])
            t = dt.datetime(year, mo, d, h, mi, sec, tzinfo=dt.timezone.utc).timestamp()
            for a, b, run in spans:
                if int(a) <= t <= b:
                    out.setdefault(run, []).append(m.groups()[5:])
    return out


def jit_compiles_in_runs(files: tuple[str, str]) -> dict:
    """{run id: [kernel, ...]}: Triton kernels vLLM's JIT monitor reported compiling while a run was in flight
    ("Triton kernel JIT compilation during inference: NAME" in the engine log), by :func:`_stamped_in_runs`. A
    compile inside a measured run is a latency spike of the engine, not of the mode; runs without files get
    nothing."""
    found = _stamped_in_runs(files, r"\[jit_monitor\.py:\d+\] Triton kernel JIT compilation during inference: (\S+?)\.? ")
    return {run: [g[0] for g in gs] for run, gs in found.items()}


def engine_load_in_runs(files: tuple[str, str]) -> dict:
    """{run id: {"peak_running", "peak_waiting", "peak_kv_cache_pct"}}: the most requests running and waiting, and
    the highest KV-cache usage, in vLLM's periodic stats lines ("Running: N reqs, Waiting: M reqs, GPU KV cache
    usage: X%", every 10 s by default) stamped inside the run (:func:`_stamped_in_runs`). A run shorter than the
    stats interval may have none. Waiting requests while the client sent them all at once mean the engine did
    not run the run's concurrency (s24/s25: the DFlash engines ran 49 of 64, their KV cache 98.8% full)."""
    found = _stamped_in_runs(files, r"\[loggers\.py:\d+\] [^\n]*?Running: (\d+) reqs, Waiting: (\d+) reqs, "
                                    r"GPU KV cache usage: ([\d.]+)%")
    return {run: {"peak_running": max(int(g[0]) for g in gs), "peak_waiting": max(int(g[1]) for g in gs),
                  "peak_kv_cache_pct": max(float(g[2]) for g in gs)} for run, gs in found.items()}


def jit_runs(runs_df):
    """The measured runs (completed, not an engine's warm-up) during which vLLM compiled a Triton kernel
    (:func:`jit_compiles_in_runs`): their latency includes the compile."""
    m = runs_df[(runs_df["outcome"] == "ok") & ~runs_df["warmup"] & (runs_df["jit_compiles"].fillna("") != "")]
    return m[["file", "run_id", "mode", "acceptance", "concurrency", "jit_compiles", "mean_ttft_ms", "output_throughput"]]


def without_jit_runs(runs_df):
    """``runs_df`` without :func:`jit_runs` (to check whether a ratio depends on them)."""
    return runs_df.drop(index=jit_runs(runs_df).index)


def same_cells(cells_df, like):
    """The rows of ``cells_df`` whose (session, acceptance, mode, concurrency) are among ``like``'s."""
    keys = ["gpu_session", "acceptance", "mode", "concurrency"]
    return cells_df.merge(like[keys].drop_duplicates(), on=keys, how="inner")


def cells(df):
    """One row per (session, acceptance, mode, concurrency): runs, crashes and the spread of each metric
    over the completed runs (mean, std, min, max; ``ok`` is their number). A warm-up run that completed is left
    out of all of them (a warm-up sweep shares its concurrency with the measured runs after it: ``runs`` stays
    the measured repeats); one that crashed or timed out counts in ``runs`` and ``crashed`` (its outcome counts).
    Runs the runner's deadline cut short are left out of all of them and counted in ``cut_by_deadline``; runs
    whose engine never started (``startup_error``) likewise, in ``startup_errors`` (as :func:`analysis.crash_table`
    counts them); both count measured runs only (a warm-up cut or never started lost no measurement)."""
    import pandas as pd

    out = []
    for key, g in df.groupby(["gpu_session", "acceptance", "mode", "concurrency"], dropna=False):
        cut = g["cut_by_deadline"].astype(bool) if "cut_by_deadline" in g else pd.Series(False, index=g.index)
        warm_all = g["warmup"].astype(bool) if "warmup" in g else pd.Series(False, index=g.index)
        # a warm-up cut by the deadline, or never run because its engine did not start, lost no measurement
        n_cut = int((cut & ~warm_all).sum())
        n_start = int(((g["outcome"] == "startup_error") & ~warm_all).sum())
        g = g[~cut & (g["outcome"] != "startup_error")]
        warm = g["warmup"] if "warmup" in g else pd.Series(False, index=g.index)
        if not n_cut and not n_start and (warm & (g["outcome"] == "ok")).all():
            continue  # only warm-up runs that completed: nothing measured, nothing crashed
        ok = g[(g["outcome"] == "ok") & ~warm]
        g = g[~(warm & (g["outcome"] == "ok"))]
        row = dict(zip(("gpu_session", "acceptance", "mode", "concurrency"), key))
        row.update({"runs": len(g), "ok": len(ok), "crashed": int(g["crashed"].sum()),
                    "crashed / runs": f"{int(g['crashed'].sum())}/{len(g)}", "cut_by_deadline": n_cut,
                    "startup_errors": n_start,
                    "acceptance_length": ok["acceptance_length"].mean() if len(ok) else None})
        for m in LOAD:   # the engine's own view of the load (vLLM's stats lines), highest over the measured runs
            x = ok[m].dropna() if m in ok else ()
            row[m] = x.max() if len(x) else None
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


def session_drift(cells_df, metric: str = "output_throughput"):
    """The same mode, acceptance and concurrency measured in more than one GPU session: each later session's mean
    ``metric`` over the earliest one's (``low``/``high`` from the extreme repeats, as in :func:`speedup`;
    ``overlap``: whether the two sessions' repeats overlap). This is why ratios never pair sessions: the drift
    between sessions is of the size of the effects measured (s24 -> s25, fixed FULL at 1.86: 0.81-0.93x)."""
    import pandas as pd

    from .analysis import session_key

    done = cells_df[(cells_df["ok"] > 0) & (cells_df["crashed"] == 0)]
    rows = []
    for (acc, mode, conc), g in done.groupby(["acceptance", "mode", "concurrency"]):
        if g["gpu_session"].nunique() < 2:
            continue
        g = g.sort_values("gpu_session", key=lambda s: s.map(session_key))
        first = g.iloc[0]
        for _, x in g.iloc[1:].iterrows():
            rows.append({"acceptance": acc, "mode": mode, "concurrency": conc, "sessions": f"{x['gpu_session']} / {first['gpu_session']}",
                         "n": f"{x['ok']}/{first['ok']}", "ratio": x[metric] / first[metric],
                         "low": x[metric + "_min"] / first[metric + "_max"], "high": x[metric + "_max"] / first[metric + "_min"],
                         "overlap": bool(x[metric + "_min"] <= first[metric + "_max"] and first[metric + "_min"] <= x[metric + "_max"])})
    cols = ["acceptance", "mode", "concurrency", "sessions", "n", "ratio", "low", "high", "overlap"]
    return pd.DataFrame(rows, columns=cols).sort_values(["acceptance", "mode", "concurrency"], kind="stable", ignore_index=True)


def recommend(cells_df, acceptance, session=None, metric: str = "output_throughput", allow_crash_prone: bool = False,
              crashed_elsewhere=None, grid=None):
    """Per concurrency: the mode with the highest mean ``metric``; consecutive concurrencies with the
    same choice are merged into one range. With ``grid`` (the concurrencies measured at this acceptance in any
    session), only neighbours in the grid merge: a session that measured 1, 32 and 64 gets "1" and "32-64", never
    a "1-64" that claims 4-16 (s32 completed three cells of 1.86 only).

    A mode that crashed in *any* cell of the slice is crash-prone and left out (unless
    ``allow_crash_prone``): a user picks one setting for all loads. So is a mode in ``crashed_elsewhere``
    ({mode: where it crashed}, :func:`crashed_where`): the synthetic acceptance is no setting a user picks either (stock
    FULL completed at 3.6 and 6.0, whose schedule never rejects every draft, and crashed at 1.86; a trained drafter's
    steps do reject every draft). A concurrency where no mode is left gets a "no mode (...)" row. When the best mode's slowest repeat
    is not faster than the runner-up's fastest, the two are a tie within the spread and both are named.
    Returns rows: concurrency range, mode, margin over the runner-up (ratio of means), runner-up,
    and the crash-prone modes that were left out."""
    c = cells_df[cells_df["acceptance"] == acceptance]
    if session is not None:
        c = c[c["gpu_session"] == session]
    if c["gpu_session"].nunique() > 1:
        raise LabError(f"acceptance {acceptance}: cells from several GPU sessions {sorted(c['gpu_session'].unique())}: "
                       "choose one (ratios are never taken across sessions)")
    prone = sorted(set(c.loc[c["crashed"] > 0, "mode"])) if not allow_crash_prone else []
    here_modes = set(c["mode"])
    elsewhere = ({m: w for m, w in (crashed_elsewhere or {}).items() if m not in prone and m in here_modes}
                 if not allow_crash_prone else {})
    left_out = prone + [f"{m} (crashed {w})" for m, w in sorted(elsewhere.items())]
    prone = prone + sorted(elsewhere)
    picks = []
    for conc, g in c.groupby("concurrency"):
        g = g[(g["crashed"] == 0) & (g["ok"] > 0) & ~g["mode"].isin(prone)].sort_values(metric, ascending=False)
        if g.empty:
            picks.append((conc, None, None, None, []))
            continue
        best = g.iloc[0]
        second = g.iloc[1] if len(g) > 1 else None
        label, chosen = best["mode"], [best["mode"]]
        if second is not None and best[metric + "_min"] <= second[metric + "_max"]:
            chosen = sorted((best["mode"], second["mode"]))
            label = " or ".join(chosen) + " (tie within the spread)"
        picks.append((conc, label, best[metric] / second[metric] if second is not None else None,
                      second["mode"] if second is not None else None, chosen))
    order = {k: i for i, k in enumerate(sorted(grid))} if grid is not None else None
    rows = []
    for conc, mode, margin, second, chosen in picks:
        if rows and rows[-1]["mode"] == mode and (order is None or order.get(rows[-1]["to"], -2) + 1 == order.get(conc)):
            rows[-1]["to"] = conc
            rows[-1]["margins"].append(margin)
            rows[-1]["seconds"].append(second)
            continue
        # "modes": the mode chosen, or the two a tie names
        rows.append({"from": conc, "to": conc, "mode": mode, "modes": chosen, "margins": [margin], "seconds": [second]})
    for r in rows:
        # a merged range names every runner-up it had, in order of concurrency
        r["runner-up"] = " / ".join(dict.fromkeys(x for x in r.pop("seconds") if x is not None)) or None
        m = [x for x in r.pop("margins") if x is not None]
        lo, hi = (f"{min(m):.2f}", f"{max(m):.2f}") if m else ("", "")
        r["margin over runner-up"] = "-" if not m else f"{lo}x" if lo == hi else f"{lo}-{hi}x"
        r["concurrency"] = f"{r['from']}" if r["from"] == r["to"] else f"{r['from']}-{r['to']}"
        r["left out (crashed)"] = ", ".join(left_out) or "-"
        if r["mode"] is None:
            r["mode"] = "no mode (none completed a run here without crashing, here or at another acceptance)"
    return rows


def crashed_where(cells_df) -> dict:
    """{mode: "at <acceptances> in <sessions>"} for every mode with a crashed run in ``cells_df``."""
    from .analysis import session_key, short_session

    out = {}
    for mode, g in cells_df[cells_df["crashed"] > 0].groupby("mode"):
        accs = ", ".join(f"{a:g}" for a in sorted(set(g["acceptance"])))
        sess = ", ".join(short_session(x) for x in sorted(set(g["gpu_session"]), key=session_key))
        out[mode] = f"at {accs} in {sess}"
    return out


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
    return {"kind": "line", "a_ms": float(a), "b_ms_per_token": float(b), "n": len(points),
            "r2": 1.0 - float(((y - pred) ** 2).sum()) / ss if ss else 1.0}


def fit_step_steps(points: list[tuple[float, float]]) -> dict:
    """The measured step times as a model: the mean step time at each measured token count, joined by straight
    segments; above the largest count the last segment extended (flat if it falls), below the smallest the smallest
    count's time (a step is not assumed cheaper than any measured one). It assumes only that a step's time depends
    on the tokens it processes, not on the acceptance; unlike :func:`fit_step_model`'s single line it follows the
    bends that CUDA-graph ceilings and queueing put in the curve (s25: the line missed its own cells by up to 41%).
    At a measured token count it is the measured mean itself: a check there tests the acceptance-independence
    (and the drift between the sessions involved), not the joining."""
    xs = sorted({float(p[0]) for p in points})
    if len(xs) < 2:
        raise LabError(f"the step-time model needs cells at two or more token counts, got {len(points)} point(s)")
    ms = [sum(p[1] for p in points if p[0] == x) / sum(1 for p in points if p[0] == x) for x in xs]
    return {"kind": "measured steps", "tokens": xs, "ms": ms, "n": len(points)}


STEP_MODELS = {"line": fit_step_model, "measured steps": fit_step_steps}
STEP_MODEL_NAMES = {"line": "straight line", "measured steps": "joined measured step times"}


def step_ms(model: dict, tokens: float) -> float:
    """A step-time model's step time (ms) at ``tokens`` target tokens per step."""
    if model.get("kind", "line") == "line":
        return model["a_ms"] + model["b_ms_per_token"] * tokens
    xs, ys = model["tokens"], model["ms"]
    if tokens <= xs[0]:
        return ys[0]
    if tokens >= xs[-1]:
        return ys[-1] + max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])) * (tokens - xs[-1])
    i = next(j for j in range(1, len(xs)) if tokens <= xs[j])
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


def predict_speedup(spec_model: dict, base_model: dict, acceptance_length: float, concurrency: int, k: int,
                    running: int | None = None) -> float:
    """Speedup of speculative decoding over plain decoding at one concurrency: per request, L tokens
    per spec step against 1 per plain step, over their step times. ``running``: the requests the speculative
    engine ran at once where fewer than ``concurrency`` fit (s24/s25: 49 at 64), so its step is theirs."""
    t_spec = step_ms(spec_model, tokens_per_step(running or concurrency, k))
    t_base = step_ms(base_model, concurrency)
    return acceptance_length * t_base / t_spec


def break_even_acceptance(spec_model: dict, base_model: dict, concurrency: int, k: int,
                          running: int | None = None) -> float:
    """The acceptance length at which the predicted speedup is 1."""
    return 1.0 / predict_speedup(spec_model, base_model, 1.0, concurrency, k, running)


def running_by_concurrency(cells_df, mode: str, k: int = 15) -> dict:
    """{concurrency: requests ``mode`` ran at once} from :func:`step_points` (fewer than the concurrency only where
    requests waited); the largest over the cells of a concurrency."""
    out: dict = {}
    for tokens, _, _, conc in step_points(cells_df, mode):
        out[conc] = max(out.get(conc, 0), int(tokens // (k + 1)))
    return out


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


def distinct_experts(tokens: float, num_experts: int, top_k: int) -> float:
    """Expected number of distinct experts one MoE layer reads for ``tokens`` tokens when each token picks ``top_k``
    of ``num_experts`` uniformly and independently: E (1 - (1 - k/E)^T). An assumption about the router (dummy
    weights' random router; a trained router is skewed and tokens of one sequence share experts, which touches
    fewer), not a measurement."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def draft_params(text: dict, draft: dict) -> int:
    """Weights a DFlash drafter pass reads (vLLM 0.22.1 ``qwen3_dflash.py``): ``fc`` (the target layers' hidden
    states, concatenated, to the hidden size), per layer q/k/v/o and the gated MLP, and its LM head over the
    target's vocabulary; the draft's hidden size is the target's (as ``dflash_lab.models`` writes its config)."""
    h = text["hidden_size"]
    qkv = h * (draft["heads"] + 2 * draft["kv_heads"]) * draft["head_dim"]
    o = draft["heads"] * draft["head_dim"] * h
    return (len(draft["target_layer_ids"]) * h * h + draft["layers"] * (qkv + o + 3 * h * draft["inter"])
            + text["vocab_size"] * h)


def weight_floor(text: dict, tokens: int, draft: dict | None = None, bytes_per_param: float = 2.0,
                 bandwidth_bytes_s: float = 4.8e12) -> dict:
    """The weight-traffic floor of one engine step in which the target processes ``tokens`` tokens: every weight
    read once from HBM, of the routed experts as many per MoE layer as :func:`distinct_experts` expects, plus one
    drafter pass (:func:`draft_params`) when ``draft`` is given. KV-cache and Gated-DeltaNet state traffic, which
    grow with the requests, are not counted: a floor, not a prediction."""
    ap = active_params(text)
    n, k = text["num_hidden_layers"], text["num_experts_per_tok"]
    expert = 3 * text["hidden_size"] * text["moe_intermediate_size"]
    e = distinct_experts(tokens, text["num_experts"], k)
    target = ap["total"] - n * k * expert + n * e * expert
    dp = draft_params(text, draft) if draft else 0
    return {"tokens": tokens, "experts per MoE layer": e, "target params": target, "draft params": dp,
            "ms": bandwidth_floor_ms(target + dp, bytes_per_param, bandwidth_bytes_s)}


def floor_table(cells_df, mode: str, text: dict, draft: dict, bandwidth_tb_s: float = 4.8, base: str = "no speculation"):
    """Every completed cell of ``mode`` (with the drafter) and ``base`` (without) beside its weight-traffic floor
    (:func:`weight_floor`) at its tokens per step."""
    import pandas as pd

    rows = []
    for name, d in ((mode, draft), (base, None)):
        for tokens, ms, acc, conc in step_points(cells_df, name):
            f = weight_floor(text, int(tokens), d, bandwidth_bytes_s=bandwidth_tb_s * 1e12)
            rows.append({"mode": name, "acceptance": acc, "concurrency": conc, "tokens per step": int(tokens),
                         "experts per MoE layer": f["experts per MoE layer"], "floor ms": f["ms"],
                         "step ms (measured)": ms, "x floor": ms / f["ms"]})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- views for notebooks 05/06

def session_for(cells_df, acceptance, session=None, modes=()) -> str:
    """The GPU session whose cells a view of one acceptance uses: ``session`` if given (it must have
    cells at that acceptance), else, among the labels that have a completed cell (at any concurrency) of every mode in
    ``modes`` (a view comparing two modes needs both in one session: s26 measured PIECEWISE and stock FULL but not fixed
    FULL), or all labels where none has, the one with the most completed cells (mode and concurrency), then of the
    most modes, the latest of those: a session that ran one mode only, like s30's stock repeats at 3.6, or a few cells
    of every mode, like s34's completion runs at 1.86 (five modes at 1-4 concurrencies each), does not replace its
    acceptance's slice (every concurrency of three or four modes)."""
    from .analysis import session_key

    here = cells_df[cells_df["acceptance"] == acceptance]
    have = sorted(set(here["gpu_session"]), key=session_key)
    if not have:
        raise LabError(f"no bench cells at acceptance {acceptance}")
    if session is not None:
        if session not in have:
            raise LabError(f"GPU session {session!r} has no cells at acceptance {acceptance} (sessions: {have})")
        return session
    done = here[here["ok"] > 0]
    cols = ["mode", "concurrency"] if "concurrency" in done else ["mode"]
    n_cells = lambda s: len(done.loc[done["gpu_session"] == s, cols].drop_duplicates())
    n_modes = lambda s: len(set(done.loc[done["gpu_session"] == s, "mode"]))
    full = [s for s in have if set(modes) <= set(done.loc[done["gpu_session"] == s, "mode"])]
    return max(full or have, key=lambda s: (n_cells(s), n_modes(s), session_key(s)))


def one_session(cells_df, session=None, modes=()):
    """Per acceptance, the cells of one session (see :func:`session_for`). With ``session`` given, only the
    acceptances that session measured (s30 ran 1.86, 3.6 and 6.0, s24 1.86 only), and a :class:`LabError` naming the
    recorded sessions when it measured none; a caller that asked for given acceptances checks that each is still there
    (notebook 05 does)."""
    import pandas as pd

    accs = sorted(cells_df["acceptance"].unique())
    if session is not None:
        from .analysis import session_key

        have = sorted(set(cells_df["gpu_session"]), key=session_key)
        if session not in have:
            raise LabError(f"GPU session {session!r} has no bench cells here (sessions: {have})")
        accs = sorted(cells_df.loc[cells_df["gpu_session"] == session, "acceptance"].unique())
    parts = [cells_df[(cells_df["acceptance"] == a) & (cells_df["gpu_session"] == session_for(cells_df, a, session, modes))]
             for a in accs]
    return pd.concat(parts, ignore_index=True)


def plot_vs_concurrency(cells_df, metric: str, modes=None, ylabel: str | None = None):
    """One panel per acceptance: ``metric`` vs concurrency, a line per mode, bars from the smallest to
    the largest repeat; cells with a crash are marked with an x and their crashed/runs count. A mode keeps its colour
    in every panel, and the one legend names every mode drawn in any panel (panels of different sessions hold
    different modes: s25's 1.86 has eager, s31's 3.6 PIECEWISE and stock FULL)."""
    import matplotlib.pyplot as plt

    from .nbutil import legend_all

    accs = sorted(cells_df["acceptance"].unique())
    modes = [m for m in (modes or MODES) if m in set(cells_df["mode"])]
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {m: cycle[i % len(cycle)] for i, m in enumerate(modes)}
    fig, axes = plt.subplots(1, len(accs), figsize=(5.2 * len(accs), 4), squeeze=False, sharey=True)
    for ax, acc in zip(axes[0], accs):
        c = cells_df[cells_df["acceptance"] == acc]
        for m in modes:
            g = c[c["mode"] == m].sort_values("concurrency")
            ok = g[g[metric].notna()]
            if len(ok):
                lo = ok[metric] - ok[metric + "_min"]
                hi = ok[metric + "_max"] - ok[metric]
                ax.errorbar(ok["concurrency"], ok[metric], yerr=[lo, hi], marker="o", ms=4, capsize=3, label=m,
                            color=colour[m])
            for _, r in g[g["crashed"] > 0].iterrows():
                # at the foot of the panel (x in data, y in axes fraction): a crash has no value to plot
                ax.plot([r["concurrency"]], [0.04], "x", color="crimson", ms=9, mew=2, transform=ax.get_xaxis_transform())
                ax.annotate(f"{m}: crash {r['crashed / runs']}", (r["concurrency"], 0.04), fontsize=7, color="crimson",
                            xycoords=ax.get_xaxis_transform(), xytext=(-4, 6), textcoords="offset points", ha="right")
        sess = ", ".join(sorted(set(c["gpu_session"])))
        ax.set(xscale="log", xlabel="concurrency", title=f"acceptance {acc} (session {sess})")
        ax.set_xticks(sorted(c["concurrency"].unique()), labels=[str(x) for x in sorted(c["concurrency"].unique())])
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel or metric)
    legend_all(axes[0], modes, fontsize=8)
    fig.tight_layout()
    return fig


def speedup_grid(cells_df, mode: str = "DFlash FULL (fixed)", base: str = "no speculation"):
    """acceptance x concurrency table of mode/base output throughput, each acceptance's ratios inside
    one session (None where either side crashed or was not measured)."""
    s = speedup(cells_df, mode, base)
    if s.empty:
        raise LabError(f"no cells where both {mode!r} and {base!r} were measured in the same session")
    return s.pivot_table(index="acceptance", columns="concurrency", values="ratio", aggfunc="first", dropna=False)


GLANCE_MODES = ("DFlash FULL (fixed)", "DFlash PIECEWISE")


def glance_table(cells_df, modes=GLANCE_MODES, base: str = "no speculation"):
    """What a user can expect, one row per (mode, acceptance, GPU session) measured beside ``base`` in one session:
    per concurrency the ratio of mean output throughputs with the slowest-over-fastest repeat range, ``*`` where the
    DFlash engine queued requests (the cell includes the wait), ``[a/b runs]`` where either side has fewer than 3
    measured repeats (a: the mode's, b: ``base``'s), ``crashed k/n`` where a side crashed. Columns: mode,
    acceptance, session, one per concurrency. Empty when no such pair is recorded."""
    import pandas as pd

    queued = {(r["gpu_session"], r["acceptance"], r["mode"], r["concurrency"]) for _, r in queued_cells(cells_df).iterrows()}
    rows = []
    for mode in modes:
        s = speedup(cells_df, mode, base)
        if s.empty:
            continue
        for (sess, acc), g in s.groupby(["gpu_session", "acceptance"], sort=True):
            row = {"mode": mode, "acceptance": acc, "session": sess}
            for _, r in g.iterrows():
                c = int(r["concurrency"])
                if r["ratio"] is None or r["ratio"] != r["ratio"]:
                    row[c] = r["note"]
                else:
                    few = min(int(k) for k in str(r["n"]).split("/")) < 3   # a side with fewer than 3 repeats
                    row[c] = (f"{r['ratio']:.2f}x ({r['low']:.2f}-{r['high']:.2f})"
                              + ("*" if (sess, acc, mode, r["concurrency"]) in queued else "")
                              + (f" [{r['n']} runs]" if few else ""))
            rows.append(row)
    concs = sorted({c for r in rows for c in r if isinstance(c, int)})   # the concurrencies a ratio exists for
    out = pd.DataFrame(rows, columns=["mode", "acceptance", "session"] + concs)
    out[concs] = out[concs].astype(object).where(out[concs].notna(), "-")
    return out.sort_values(["acceptance", "mode"], kind="stable").reset_index(drop=True)


def queued_cells(cells_df):
    """The cells whose engine queued requests: vLLM's stats lines inside their measured runs showed requests waiting
    (``peak_waiting``), so their throughput and TTFT include the queueing."""
    return cells_df[cells_df["peak_waiting"].fillna(0) > 0] if "peak_waiting" in cells_df else cells_df.iloc[0:0]


def ran_at_once(r) -> int:
    """Requests a cell's engine ran at once: the concurrency, or, where vLLM's stats showed requests waiting, the
    most it ran (``peak_running``; a stats line at a run's very end shows 0 running: only requests seen waiting
    say fewer ran than were sent)."""
    ran, waiting = r.get("peak_running"), r.get("peak_waiting")
    queued = waiting is not None and waiting == waiting and waiting > 0 and ran is not None and ran == ran and ran > 0
    return int(min(r["concurrency"], ran)) if queued else int(r["concurrency"])


def step_points(cells_df, mode: str) -> list[tuple[float, float, float, int]]:
    """(tokens per step, step ms, acceptance, concurrency) of every completed cell of ``mode``. The tokens per step
    are those of the requests the engine ran at once: the concurrency, or, where vLLM's stats showed requests
    waiting, the most it ran (``peak_running``: the DFlash engines ran 49 at 64)."""
    out = []
    for _, r in cells_df[(cells_df["mode"] == mode) & (cells_df["ok"] > 0)].iterrows():
        k = 15 if mode.startswith("DFlash") else 0
        t = step_time_ms({"mean_tpot_ms": r["mean_tpot_ms"], "num_speculative_tokens": k,
                          "acceptance_length": r["acceptance_length"]})
        if t is not None:
            out.append((tokens_per_step(ran_at_once(r), k), t, r["acceptance"], int(r["concurrency"])))
    return out


def break_even_measured(cells_df, mode: str = "DFlash FULL (fixed)", base: str = "no speculation"):
    """Per (session, acceptance, concurrency) where both modes completed side by side: the acceptance length at
    which ``mode`` would match ``base``, from the measured cells alone: the measured acceptance length over the
    measured speedup. It assumes the step time of ``mode`` does not depend on the acceptance (the draft and the
    verify pass have fixed sizes); the held-out check of notebook 06 tests that once two acceptances exist."""
    import pandas as pd

    s = speedup(cells_df, mode, base)
    rows = []
    for _, r in s.iterrows():
        cell = cells_df[(cells_df["gpu_session"] == r["gpu_session"]) & (cells_df["acceptance"] == r["acceptance"])
                        & (cells_df["concurrency"] == r["concurrency"]) & (cells_df["mode"] == mode)]
        L = cell["acceptance_length"].iloc[0] if len(cell) else None
        ok = r["ratio"] is not None and r["ratio"] == r["ratio"] and L is not None and L == L
        rows.append({"gpu_session": r["gpu_session"], "acceptance": r["acceptance"], "concurrency": int(r["concurrency"]),
                     "acceptance length (measured)": L, "speedup (measured)": r["ratio"],
                     "break-even acceptance length": L / r["ratio"] if ok else None,
                     "range": (L / r["high"], L / r["low"]) if ok else None})
    return pd.DataFrame(rows, columns=["gpu_session", "acceptance", "concurrency", "acceptance length (measured)",
                                       "speedup (measured)", "break-even acceptance length", "range"])


def holdout_check(cells_df, held_acceptance, mode: str = "DFlash FULL (fixed)", base: str = "no speculation",
                  k: int = 15):
    """Fit each step-time model (:data:`STEP_MODELS`) without the ``mode`` cells at ``held_acceptance`` (the
    baseline keeps all its cells: it has no draft, its acceptance is a label), predict the speedup there with the
    acceptance length measured in those cells, and put it beside the measured ratio: per model a
    ``predicted (<model>)`` and an ``error (<model>)`` column (predicted / measured - 1). ``queued``: the
    ``mode`` engine ran fewer requests at once than the concurrency (requests waited; the measured throughput
    includes the wait, the step times do not)."""
    import pandas as pd

    held_sessions = sorted(set(cells_df.loc[cells_df["acceptance"] == held_acceptance, "gpu_session"]))
    if len(held_sessions) > 1:
        raise LabError(f"the held-out acceptance {held_acceptance} has cells of several GPU sessions {held_sessions}: "
                       "check one session's (bench.one_session)")
    train = cells_df[cells_df["acceptance"] != held_acceptance]
    spec_pts = [(p[0], p[1]) for p in step_points(train, mode)]
    base_pts = [(p[0], p[1]) for p in step_points(cells_df, base)]
    models = {name: (fit(spec_pts), fit(base_pts)) for name, fit in STEP_MODELS.items()}
    meas = speedup(cells_df[cells_df["acceptance"] == held_acceptance], mode, base)
    held = cells_df[(cells_df["acceptance"] == held_acceptance) & (cells_df["mode"] == mode)].set_index("concurrency")
    ran = running_by_concurrency(cells_df[cells_df["acceptance"] == held_acceptance], mode, k)
    rows = []
    for _, r in meas.iterrows():
        c = int(r["concurrency"])
        L = held.loc[c, "acceptance_length"] if c in held.index else None
        row = {"concurrency": c, "queued": ran.get(c, c) < c, "acceptance length (measured)": L,
               "speedup measured": r["ratio"], "measured range": (r["low"], r["high"])}
        for name, (sm, bm) in models.items():
            pred = predict_speedup(sm, bm, L, c, k, ran.get(c)) if L is not None and L == L else None
            ok = pred is not None and r["ratio"] is not None and r["ratio"] == r["ratio"] and r["ratio"]
            row[f"predicted ({name})"] = pred
            row[f"error ({name})"] = pred / r["ratio"] - 1 if ok else None
        rows.append(row)
    return {"spec_model": models["line"][0], "base_model": models["line"][1], "models": models,
            "table": pd.DataFrame(rows)}


def holdout_misses(table) -> dict:
    """Per step-time model, its largest miss in a :func:`holdout_check` table: ``{model: {"all": (|error|,
    concurrency), "not queued": (|error|, concurrency) or None}}``; a model with no error in the table is left out."""
    out = {}
    for name in STEP_MODELS:
        col = f"error ({name})"
        if col not in table or table[col].dropna().empty:
            continue
        t = table.dropna(subset=[col])

        def worst(d):
            if d.empty:
                return None
            i = d[col].abs().idxmax()
            return float(abs(d.loc[i, col])), int(d.loc[i, "concurrency"])

        out[name] = {"all": worst(t), "not queued": worst(t[~t["queued"].astype(bool)])}
    return out


def better_model(misses: dict) -> str | None:
    """The step-time model with the smaller largest held-out miss (:func:`holdout_misses`) where no request waited
    (a queued cell's throughput includes the wait, which no step time holds; all cells where every one queued),
    None without a check. The choice is made on the one held-out slice, so the miss it is chosen by is no
    independent test of it."""
    have = {m: (v.get("not queued") or v["all"])[0] for m, v in misses.items() if v.get("all")}
    return min(have, key=lambda m: (have[m], list(STEP_MODELS).index(m))) if have else None


def holdout_sentence(misses: dict, held_acceptance) -> str:
    """One line: how far each step-time model missed the measured speedup at the held-out acceptance."""
    if not misses:
        return f"The held-out check at acceptance {held_acceptance:g} has no measured speedup to compare with."
    return f"Fitted without acceptance {held_acceptance:g} and checked against its measured speedups, {holdout_parts(misses)}."


def holdout_parts(misses: dict) -> str:
    """:func:`holdout_sentence`'s body: each model's largest miss, and where no request waited."""
    parts = []
    for name, v in misses.items():
        e, c = v["all"]
        part = f"the {STEP_MODEL_NAMES[name]} {'misses' if name == 'line' else 'miss'} by up to {e:.0%} (at concurrency {c}"
        nq = v["not queued"]
        if nq and nq != v["all"]:
            part += f"; {nq[0]:.0%} at most where no request waited, at {nq[1]}"
        parts.append(part + ")")
    return "; ".join(parts)


def holdout_replicates(all_cells, view_cells, held_acceptance, mode: str = "DFlash FULL (fixed)",
                       base: str = "no speculation", runs_df=None) -> list[dict]:
    """The held-out check (:func:`holdout_check`) once per GPU session that measured ``mode`` and ``base`` at the
    held-out acceptance: the DFlash fit always uses ``view_cells``' other acceptances (one session each, as the notebook
    shows them), the held-out cells come from each session in turn, so a second session at that acceptance is a
    replicate of the check (s29 and s30 at 6.0). The baseline's fit takes every cell it is given, so it includes each
    session's own no-speculation cells at the held-out acceptance (as :func:`holdout_check` does). Returns ``[{"session", "check", "misses", "jit_runs"}]`` in session order;
    ``jit_runs``: how many measured runs of those held-out cells compiled a Triton kernel (:func:`jit_runs` of
    ``runs_df``, the lines the cells came from; 0 without it)."""
    import pandas as pd

    from .analysis import session_key

    train = view_cells[view_cells["acceptance"] != held_acceptance]
    here = all_cells[(all_cells["acceptance"] == held_acceptance) & all_cells["mode"].isin([mode, base])]
    done = here[here["ok"] > 0]
    jit = None
    if runs_df is not None:
        jit = jit_runs(runs_df)
        jit = jit.assign(gpu_session=runs_df.loc[jit.index, "gpu_session"])
        jit = jit[(jit["acceptance"] == held_acceptance) & jit["mode"].isin([mode, base])]
    out = []
    for s in sorted(set(done["gpu_session"]), key=session_key):
        if {mode, base} - set(done.loc[done["gpu_session"] == s, "mode"]):
            continue
        held = here[here["gpu_session"] == s]
        chk = holdout_check(pd.concat([train, held], ignore_index=True), held_acceptance, mode, base)
        out.append({"session": s, "check": chk, "misses": holdout_misses(chk["table"]),
                    "jit_runs": 0 if jit is None else int((jit["gpu_session"] == s).sum())})
    return out


# ----------------------------------------------------------------------------- what the data holds yet

def tradeoffs_gaps(cells_df, mode: str = "DFlash FULL (fixed)", held_out=None, base: str = "no speculation") -> list[str]:
    """What notebook 06 needs of one session's cells (:func:`one_session`) to render and they lack, one phrase each
    (empty: it can render): a step-time line per mode (``base`` and ``mode`` completed at two or more token counts)
    and a ratio ``mode``/``base`` somewhere (which makes :func:`speedup_grid` non-empty); an explicit ``held_out``
    must be a recorded acceptance. The held-out check itself has its own needs (:func:`holdout_gaps`): without them
    the notebook renders and says what the check waits for."""
    accs = sorted(cells_df["acceptance"].unique()) if len(cells_df) else []
    if not accs:
        return ["measured bench cells (none recorded)"]
    if held_out is not None and held_out not in accs:
        return [f"cells at the held-out acceptance {held_out} (recorded: {', '.join(map(str, accs))})"]
    gaps = []
    base_concs = sorted({p[3] for p in step_points(cells_df, base)})
    if len(base_concs) < 2:
        gaps.append(f"completed {base!r} cells at 2 or more concurrencies "
                    f"(has {', '.join(map(str, base_concs)) if base_concs else 'none'})")
    if len({p[0] for p in step_points(cells_df, mode)}) < 2:
        gaps.append(f"completed {mode!r} cells at 2 or more concurrencies")
    if not _has_ratio(cells_df, mode, base):
        gaps.append(f"a concurrency where {mode!r} and {base!r} both completed without a crash in one session")
    return gaps


def _has_ratio(cells_df, mode: str, base: str) -> bool:
    """Whether some cell pair of one session gives a ratio ``mode``/``base`` (both completed, neither crashed)."""
    s = speedup(cells_df, mode, base)
    return not (s.empty or s["ratio"].isna().all())


def holdout_gaps(cells_df, mode: str = "DFlash FULL (fixed)", held_out=None, base: str = "no speculation") -> list[str]:
    """What the held-out check of notebook 06 (:func:`holdout_check`: fit without one acceptance, predict it) needs
    and the cells lack: a second acceptance, ``mode`` cells outside the held-out one (default: the largest) at two
    or more token counts, and a ratio at the held-out acceptance."""
    accs = sorted(cells_df["acceptance"].unique()) if len(cells_df) else []
    if len(accs) < 2:
        return [f"a second synthetic acceptance (recorded: {', '.join(map(str, accs)) or 'none'})"]
    held_out = accs[-1] if held_out is None else held_out
    gaps = []
    train = cells_df[cells_df["acceptance"] != held_out]
    if len({p[0] for p in step_points(train, mode)}) < 2:
        gaps.append(f"completed {mode!r} cells outside the held-out acceptance {held_out}, at 2 or more concurrencies "
                    f"(acceptances recorded: {', '.join(map(str, accs))})")
    if not _has_ratio(cells_df[cells_df["acceptance"] == held_out], mode, base):
        gaps.append(f"a concurrency at the held-out acceptance {held_out} where {mode!r} and {base!r} "
                    "both completed without a crash in one session")
    return gaps


def tradeoffs_missing(bench_glob: str = "data/bench/*.jsonl", mode: str = "DFlash FULL (fixed)", held_out=None,
                      session=None) -> str | None:
    """None when notebook 06 has what it needs in ``bench_glob`` (with the same parameters), else a one-line
    reason: the report's readiness check for it (notebook metadata ``dflash_lab.ready``)."""
    if not glob.glob(bench_glob):
        return f"needs bench lines ({bench_glob}), none recorded yet"
    c = cells(load_bench(bench_glob))
    gaps = tradeoffs_gaps(one_session(c, session, modes=(mode, "no speculation")) if len(c) else c, mode, held_out)
    return "needs " + "; ".join(gaps) if gaps else None


SPEEDUP_PAIRS = (("DFlash FULL (fixed)", "DFlash PIECEWISE"), ("DFlash FULL (fixed)", "DFlash eager")) + tuple(
    (m, "no speculation") for m in MODES if m.startswith("DFlash"))


def _mode_order(m) -> tuple:
    return (MODES.index(m), "") if m in MODES else (len(MODES), str(m))


def planned_cells(pattern: str = "matrices/bench-*.yaml"):
    """The cells the bench matrices plan: one row per (acceptance, mode, concurrency) a server-mode engine
    of a matrix matching ``pattern`` measures, as :func:`mode_of` names the lines that engine will write. Warm-up
    runs are left out: the flagged ones (``warmup: true``), or an engine's first run where it flags none (a matrix
    from before the warm-up sweep)."""
    import pandas as pd

    from .runner import load_matrix

    files = sorted(glob.glob(pattern))
    if not files:
        raise LabError(f"no bench matrices match {pattern}")
    rows = set()
    for f in files:
        for eng in load_matrix(f)["engines"]:
            e = eng["engine"]
            if e["mode"] != "server":
                continue
            runs = eng["runs"] if any(r.warmup for r in eng["runs"]) else eng["runs"][1:]
            for run in (r for r in runs if not r.warmup):
                rows.add((float(run.acceptance), engine_mode(e), int(run.concurrency)))
    return pd.DataFrame(sorted(rows, key=lambda r: (r[0], _mode_order(r[1]), r[2])),
                        columns=["acceptance", "mode", "concurrency"])


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() and not isinstance(x, float) else str(float(x))


def _nums(xs) -> str:
    return ", ".join(map(_num, xs)) or "none"


def coverage(cells_df, planned) -> dict:
    """Which planned cells (:func:`planned_cells`) the recorded cells measure (a cell is measured once a run in
    it completed, warm-ups aside, or crashed: a run the deadline cut measured nothing), and which
    modes, acceptances and concurrencies have no measured cell yet. ``slices``: per (acceptance, mode) planned
    or measured, the concurrencies measured and those planned but not yet measured."""
    import pandas as pd

    have = cells_df[(cells_df["ok"] > 0) | (cells_df["crashed"] > 0)] if len(cells_df) else cells_df
    meas = {(float(a), m, int(c)) for a, m, c in zip(have.get("acceptance", []), have.get("mode", []),
                                                       have.get("concurrency", []))}
    plan = {(float(a), m, int(c)) for a, m, c in zip(planned["acceptance"], planned["mode"], planned["concurrency"])}

    def split(i, order=None):
        m, p = {t[i] for t in meas}, {t[i] for t in plan}
        return {"measured": sorted(m, key=order), "not_measured": sorted(p - m, key=order)}

    slices = []
    for acc, mode in sorted({(t[0], t[1]) for t in meas | plan}, key=lambda k: (k[0], _mode_order(k[1]))):
        got = sorted(c for a, m, c in meas if (a, m) == (acc, mode))
        todo = sorted(c for a, m, c in plan - meas if (a, m) == (acc, mode))
        slices.append({"acceptance": acc, "mode": mode, "concurrencies measured": _nums(got),
                       "planned, not measured yet": _nums(todo)})
    cut = int(cells_df["cut_by_deadline"].sum()) if "cut_by_deadline" in cells_df else 0
    return {"cells": {"planned": len(plan), "measured": len(plan & meas), "unplanned": len(meas - plan)},
            "modes": split(1, _mode_order), "acceptances": split(0), "concurrencies": split(2),
            "cut_by_deadline": cut, "slices": pd.DataFrame(slices)}


def coverage_markdown(cov, plan_source: str = "matrices/bench-*.yaml") -> str:
    """The notebook's sentences on what is measured yet, from :func:`coverage`."""
    c = cov["cells"]
    lines = [f"**Measured so far: {c['measured']} of the {c['planned']} planned cells** (mode x acceptance x "
             f"concurrency, as planned in `{plan_source}`; a cell is measured once one of its runs completed, warm-ups "
             "aside, or crashed)" + (f", and {c['unplanned']} cells outside the plan." if c["unplanned"] else ".")]
    for key, name, fmt in (("modes", "Modes", lambda xs: ", ".join(xs) or "none"),
                           ("acceptances", "Synthetic acceptances", _nums), ("concurrencies", "Concurrencies", _nums)):
        lines.append(f"- {name} measured: {fmt(cov[key]['measured'])}; not measured yet: {fmt(cov[key]['not_measured'])}.")
    if cov["cut_by_deadline"]:
        n = cov["cut_by_deadline"]
        lines.append(f"- {n} run{'s' if n > 1 else ''} cut short by the runner's session deadline "
                     f"{'are' if n > 1 else 'is'} counted apart (`cut_by_deadline`): {'they' if n > 1 else 'it'} "
                     "measured nothing, neither a crash nor a completed run.")
    return "\n".join(lines)


def speedup_tables(cells_df, pairs=SPEEDUP_PAIRS) -> tuple[dict, list]:
    """:func:`speedup` of every pair that has cells of both modes in one session, by 'num / den', and the
    pairs that have none (not measured yet side by side)."""
    tables, missing = {}, []
    for num, den in pairs:
        s = speedup(cells_df, num, den)
        if s.empty:
            missing.append(f"{num} / {den}")
        else:
            tables[f"{num} / {den}"] = s
    return tables, missing


def ratio_repeats(cells_df, pairs=SPEEDUP_PAIRS, need: int = 3):
    """For every ratio of ``pairs`` at an acceptance and concurrency where both modes completed runs (cells with a
    crash give no ratio and are left out: they count as crashes, not as repeats): the session with the most
    completed repeats of the scarcer mode of the two, ``most repeats of both``, and ``short`` when that is below
    ``need``. Sessions are never added up (two sessions of 2 and 2 are short: ratios never pair sessions).
    ``side by side``: how many sessions measured both; 0 means the two modes never met in one session."""
    import pandas as pd

    from .analysis import session_key, short_session

    done = cells_df[(cells_df["ok"] > 0) & (cells_df["crashed"] == 0)]
    rows = []
    for num, den in pairs:
        a, b = done[done["mode"] == num], done[done["mode"] == den]
        where = sorted(set(zip(a["acceptance"], a["concurrency"])) & set(zip(b["acceptance"], b["concurrency"])))
        for acc, conc in where:
            x = a[(a["acceptance"] == acc) & (a["concurrency"] == conc)].set_index("gpu_session")["ok"]
            y = b[(b["acceptance"] == acc) & (b["concurrency"] == conc)].set_index("gpu_session")["ok"]
            both = {s: (int(x[s]), int(y[s])) for s in sorted(set(x.index) & set(y.index), key=session_key)}
            best = max((min(v) for v in both.values()), default=0)
            rows.append({"ratio": f"{num} / {den}", "acceptance": float(acc), "concurrency": int(conc),
                         "side by side": len(both), "most repeats of both": best,
                         "repeats per session": "; ".join(f"{short_session(s)} {n}/{d}" for s, (n, d) in both.items())
                         or "-", "short": best < need})
    cols = ["ratio", "acceptance", "concurrency", "side by side", "most repeats of both", "repeats per session", "short"]
    return pd.DataFrame(rows, columns=cols)


def ratio_repeats_sentence(table, need: int = 3, what: str = "") -> str:
    """One sentence from :func:`ratio_repeats`: how many ratios have a session with ``need`` repeats of both modes,
    and which do not (each with its sessions' repeats, numerator/denominator)."""
    short = table[table["short"]]
    head = (f"{len(table) - len(short)} of {len(table)} ratios{what} have a GPU session with at least {need} completed "
            f"repeats of both modes")
    if short.empty:
        return head + "."
    return head + "; short: " + "; ".join(
        f"{r['ratio']} at {r['acceptance']:g}, concurrency {r['concurrency']} ({r['repeats per session']})"
        for _, r in short.iterrows()) + "."


def recommendation_scope(cells_df, acceptance, planned=None, elsewhere=()) -> str:
    """The modes a recommendation at ``acceptance`` chose among, and the planned ones it could not: those measured
    in another session at that acceptance (``elsewhere``: their modes) apart from those not measured yet."""
    c = cells_df[(cells_df["acceptance"] == acceptance) & ((cells_df["ok"] > 0) | (cells_df["crashed"] > 0))]
    have = sorted(set(c["mode"]), key=_mode_order)
    s = f"acceptance {_num(acceptance)}: chosen among {', '.join(have) or 'no mode'}"
    if planned is not None:
        todo = set(planned.loc[planned["acceptance"] == float(acceptance), "mode"]) - set(have)
        other = sorted(todo & set(elsewhere), key=_mode_order)
        never = sorted(todo - set(elsewhere), key=_mode_order)
        if other:
            s += f"; measured in another session: {', '.join(other)}"
        s += f"; not measured yet: {', '.join(never)}" if never else "" if other else "; every planned mode measured"
    return s


def recommend_by_session(cells_df, acceptance, planned=None, sessions=None, metric: str = "output_throughput",
                         crash_history=None) -> list[dict]:
    """:func:`recommend` for every GPU session with cells at ``acceptance`` (or those in ``sessions``), in session
    order: a slice's modes are spread over two sessions and ratios never pair sessions, so each session's choice is
    made among its own modes. ``scope`` (:func:`recommendation_scope`) names the planned modes measured in another
    session, from every session in ``cells_df``. A choice that another session overturned is said so in each row's
    ``beaten in another session``: there the chosen mode ran beside a mode that never crashed in that session and
    whose slowest repeat beat its fastest, at a concurrency of the row's range (s24 chose fixed FULL over PIECEWISE
    where s25 measured no speculation faster than fixed FULL). A mode that crashed anywhere in ``crash_history`` (all
    recorded cells; default ``cells_df``, which a view may have narrowed to some acceptances) is left out
    (:func:`recommend`'s ``crashed_elsewhere``), here and as the faster mode of ``beaten in another session``; a
    session with fewer than two modes left has nothing to choose between and is skipped (s30's stock-only runs; s31's
    1.86 runs: stock FULL, and eager at 64 only)."""
    from .analysis import session_key

    at = cells_df[(cells_df["acceptance"] == acceptance) & ((cells_df["ok"] > 0) | (cells_df["crashed"] > 0))]
    history = crashed_where(cells_df if crash_history is None else crash_history)
    grid = set(at["concurrency"]) | (set(planned.loc[planned["acceptance"] == float(acceptance), "concurrency"])
                                     if planned is not None else set())
    out = []
    for s in sorted(set(at["gpu_session"]), key=session_key):
        if sessions is not None and s not in sessions:
            continue
        here = cells_df[(cells_df["acceptance"] == acceptance) & (cells_df["gpu_session"] == s)]
        if len(set(here.loc[here["ok"] > 0, "mode"]) - set(history) - set(here.loc[here["crashed"] > 0, "mode"])) < 2:
            continue
        rows = recommend(here, acceptance, crashed_elsewhere=history, grid=grid)
        for r in rows:
            r["beaten in another session"] = _beaten_elsewhere(at, s, r, metric, never=set(history))
        out.append({"session": s, "rows": rows,
                    "scope": recommendation_scope(here, acceptance, planned, set(at.loc[at["gpu_session"] != s, "mode"]))})
    return out


def _beaten_elsewhere(at, session, row, metric: str, never=frozenset()) -> str:
    """Where another session measured ``row``'s mode slower than one of its own never-crashed modes, beyond the
    spread, at a concurrency of the row's range: "X in S at 1, 4" per (session, mode); "-" where none did. Modes in
    ``never`` (crashed somewhere: stock FULL, left out of every recommendation) are not counted as beating it."""
    chosen = row["modes"]   # a tie's two modes are each checked
    found = {}
    for s2, g in at[at["gpu_session"] != session].groupby("gpu_session", sort=True):
        prone = set(g.loc[g["crashed"] > 0, "mode"])
        for k, gk in g[(g["concurrency"] >= row["from"]) & (g["concurrency"] <= row["to"])].groupby("concurrency"):
            for mode in chosen:
                mine = gk[(gk["mode"] == mode) & (gk["ok"] > 0) & (gk["crashed"] == 0)]
                if mine.empty:
                    continue
                others = gk[(gk["mode"] != mode) & ~gk["mode"].isin(prone | set(never)) & (gk["ok"] > 0)]
                for _, o in others.iterrows():
                    if o[metric + "_min"] > mine[metric + "_max"].iloc[0]:
                        found.setdefault((s2, o["mode"], mode), []).append(int(k))
    return "; ".join(f"{m} over {mine_} in {s2} at {', '.join(map(str, ks))}" if len(chosen) > 1
                     else f"{m} in {s2} at {', '.join(map(str, ks))}"
                     for (s2, m, mine_), ks in sorted(found.items())) or "-"


def capture_ceiling(log_path: str) -> int | None:
    """The largest CUDA-graph capture size in tokens an engine printed in its configuration (vLLM logs its
    compilation config at start-up: ``max_cudagraph_capture_size``; 0 for ``--enforce-eager``), or None."""
    import re

    from . import analysis

    try:
        m = re.search(r"'max_cudagraph_capture_size': (\d+)", analysis.read_text(log_path))
    except OSError:
        return None
    return int(m.group(1)) if m else None


def capture_ceilings(pattern: str = "data/gpu/*bench*/*.log") -> dict:
    """{engine log: :func:`capture_ceiling`} for the logs matching ``pattern`` that printed one (keyed by the log's
    name as written; ingest stores large logs ``.xz``, read through)."""
    from .runner import recorded_glob

    out = {name: capture_ceiling(stored) for name, stored in recorded_glob(pattern)}
    return {f: v for f, v in out.items() if v is not None}


def mode_ceilings(runs_df) -> dict:
    """{mode: sorted largest capture sizes of the engines its lines ran on} (:func:`capture_ceiling` of each
    line's stored engine log, ``engine_log`` from :func:`load_bench`); a mode none of whose logs was kept or
    printed one is absent."""
    out: dict = {}
    if "engine_log" not in runs_df:
        return out
    for mode, log in runs_df[["mode", "engine_log"]].dropna().drop_duplicates().itertuples(index=False):
        size = capture_ceiling(log)
        if size is not None:
            out.setdefault(mode, set()).add(size)
    return {m: sorted(v) for m, v in out.items()}


def graph_ceiling_note(cells_df, ceilings: dict, k: int = 15) -> str:
    """Per mode of ``cells_df``, the largest CUDA graph its engines captured (``ceilings``: :func:`mode_ceilings`)
    and the measured concurrencies whose decode step is larger: a step of c requests holds c * (k + 1) tokens
    with DFlash (k drafts plus the bonus token verified together), c without speculation. Above the largest
    capture size vLLM runs the step without a graph, in FULL_AND_PIECEWISE and PIECEWISE alike (vLLM 0.22.1
    ``CudagraphDispatcher.dispatch``, vllm/v1/cudagraph_dispatcher.py:276-284: ``num_tokens >
    max_cudagraph_capture_size`` gives CUDAGraphMode.NONE). A prediction from the configuration, not a separate
    measurement. Markdown, one bullet per mode."""
    lines = []
    for mode in sorted(set(cells_df["mode"]), key=_mode_order):
        sizes = ceilings.get(mode)
        per = 1 if mode == "no speculation" else k + 1
        if not sizes:
            lines.append(f"- {mode}: largest capture size not recorded (no engine log kept with these cells).")
        elif len(sizes) > 1:
            lines.append(f"- {mode}: its engines ran with different largest capture sizes ({', '.join(map(str, sizes))} "
                         "tokens): not summarised.")
        elif sizes[0] == 0:
            lines.append(f"- {mode}: no CUDA graphs (`max_cudagraph_capture_size` 0 in its engine logs).")
        else:
            top = sizes[0]
            mine = cells_df[cells_df["mode"] == mode]
            steps = []   # (concurrency, requests the engine ran at once, tokens per decode step)
            for c, g in mine.groupby("concurrency"):
                q = [ran_at_once(r) for _, r in queued_cells(g).iterrows()]
                n = max(q) if q else int(c)
                steps.append((int(c), n, n * per))
            above = [(c, n, t) for c, n, t in steps if t > top]
            s = (f"- {mode}: the largest CUDA graph holds {top} tokens, i.e. {top // per} requests x {per} "
                 f"token{'s' if per > 1 else ''} per decode step.")
            s += (" At concurrency " + ", ".join(f"{c} ({t} tokens" + (f": {n} requests running" if n < c else "") + ")"
                                                 for c, n, t in above)
                  + " a full decode step is larger, so vLLM runs it without a CUDA graph (a prediction from the "
                  "configuration, not measured separately)." if above else " Every measured concurrency's decode step fits in it.")
            lines.append(s)
    return "\n".join(lines) if lines else "No cells."


def queueing_note(cells_df) -> str:
    """The cells whose engine did not run all of a run's requests at once (vLLM's stats lines inside the measured
    runs showed requests waiting, :func:`engine_load_in_runs`): their throughput and TTFT include queueing, so they
    measure the engine's capacity at that load, not the mode at that concurrency. Markdown."""
    if "peak_waiting" not in cells_df:
        return "No engine stats lines with these cells."
    q = queued_cells(cells_df).sort_values(["acceptance", "mode", "concurrency"],
                                                                     key=lambda s: s.map(_mode_order) if s.name == "mode" else s)
    seen = cells_df["peak_running"].notna().sum()
    if not len(q):
        return (f"In every cell with engine stats inside its runs ({seen} of {len(cells_df)}), all requests of a run "
                "ran at once (no request waiting).")
    rows = [f"- {r['mode']} at concurrency {int(r['concurrency'])} (acceptance {r['acceptance']:g}, {r['gpu_session']}): "
            f"at most {int(r['peak_running'])} requests running, {int(r['peak_waiting'])} waiting, KV cache "
            f"{r['peak_kv_cache_pct']:.1f}% full" for _, r in q.iterrows()]
    return ("Cells whose engine queued requests (vLLM's stats lines inside the measured runs): their throughput and "
            "TTFT include the queueing, so they show the engine's capacity at that load rather than the mode at that "
            "concurrency.\n" + "\n".join(rows))
