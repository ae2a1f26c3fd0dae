"""Is our crash the reporter's? The report's two crash states beside ours, and the crash rate per path.

The report (``../shared/seed-report.md``, "State at crash time") quotes vLLM's fatal-error dump of two
crashes; :data:`REPORT_STATES` transcribes those numbers (nothing else is taken from the report).
Ours come from the same dump in the engine logs of ``data/gpu/`` (:func:`analysis.scheduler_dumps`),
matched to their run lines for the configuration.

The crash rate per path (offline/server x TP=1/TP=2) counts stock DFlash runs with the target's
FULL_AND_PIECEWISE graphs (:func:`analysis.stock_full`: no fix, no probe, no raising canaries; the launch
hook, core dumps or extra environment attached to a run are listed); a path without runs says so.
"""

from __future__ import annotations

import math
import numbers
import os
import re

from . import analysis
from .errors import LabError
from .runner import recorded_glob, recorded_path

# The report's numbers, as printed in seed-report.md ("State at crash time (from dump_input.py)").
REPORT_STATES = {
    "report crash A": {
        "cell": "dflash (k=15), CUDA graphs on (vLLM default)", "concurrency": 32, "tensor_parallel_size": 4,
        "path": "server", "weights": "real", "acceptance (mean length)": 8.80, "acceptance is": "as the report printed it", "num_running_reqs": 32,
        "num_waiting_reqs": 0, "kv_cache_usage": 0.199, "total_num_scheduled_tokens": 512,
        "num_computed_tokens": "117..144", "num_output_tokens": None, "finished since the previous step": None,
        "requests with empty steps": None, "empty steps per request (at least)": None,
        "phase": "early (still prefilling, generation just started)"},
    "report crash B": {
        "cell": "dflash (k=15), CUDA graphs on (vLLM default)", "concurrency": 16, "tensor_parallel_size": 4,
        "path": "server", "weights": "real", "acceptance (mean length)": 1.86, "acceptance is": "as the report printed it", "num_running_reqs": 7,
        "num_waiting_reqs": 0, "kv_cache_usage": 0.0437, "total_num_scheduled_tokens": 112,
        "num_computed_tokens": "365..574", "num_output_tokens": "317..526", "finished since the previous step": None,
        # its largest num_output_tokens, 526, is within max_tokens 512 + one step's 16 placeholders: none shown
        "requests with empty steps": 0, "empty steps per request (at least)": "0..0",
        "phase": "tail (9 of 16 requests finished)"},
}
FIELDS = ("cell", "path", "tensor_parallel_size", "weights", "concurrency", "acceptance (mean length)", "acceptance is",
          "num_running_reqs",
          "num_waiting_reqs", "kv_cache_usage", "total_num_scheduled_tokens", "num_computed_tokens",
          "num_output_tokens", "finished since the previous step", "requests with empty steps", "empty steps per request (at least)",
          "phase")


# Steps whose output row came back empty, bounded from below by vLLM's own dump. In vLLM 0.22.1 the dump's
# num_output_tokens is a request's output tokens plus its output placeholders (scheduler.py:1083), taken when the
# step was scheduled (scheduler.py:869), before that step's own placeholders are added (scheduler.py:921). Output
# stops at max_tokens (check_stop, core/sched/utils.py:114, tokens past it trimmed). Each scheduled step adds 1 + its
# spec tokens to the placeholders (async_scheduler.py:32); they are removed when the step's output comes back
# (scheduler.py:1385 the rejected ones, async_scheduler.py:53 the accepted ones), but only if the request's row holds
# at least one token: an empty row skips both (scheduler.py:1371, 1407) and leaves its 1 + k for good. A row comes
# back empty when parse_output drops every token (-1 or >= vocab_size, rejection_sampler.py:267) or when the request is
# discarded for the step (rejection_sampler.py:277; gpu_model_runner.py discard_request_mask, for requests still
# prefilling); the dump does not say which. When a step is scheduled at most one earlier step is still in flight
# (the batch queue holds fewer than max_concurrent_batches = 2 entries, core.py:492; uniproc_executor.py:77), so a
# request past max_tokens + IN_FLIGHT * (1 + k) lost at least ceil(excess / (1 + k)) steps to empty rows. Fewer spec
# tokens than k in a step only lower what that step leaks, so the bound stays a lower bound.
IN_FLIGHT = 1


def empty_steps(num_output_tokens, max_tokens: int, k: int, in_flight: int = IN_FLIGHT) -> list[int]:
    """Per request of a crash-step dump: the least number of earlier steps whose output row came back empty."""
    bound = max_tokens + in_flight * (1 + k)
    return [-(-(n - bound) // (1 + k)) if n > bound else 0 for n in num_output_tokens]


def _span(xs):
    return f"{min(xs)}..{max(xs)}" if xs else None


def our_states(df, data_dir: str = "data/gpu") -> list[dict]:
    """One state per crashed run whose engine log holds vLLM's dump: the dump's fields plus the run's
    configuration. Instrumented runs (probe, raising canaries) and the fix are left out."""
    out = []
    for logical, log in recorded_glob(os.path.join(data_dir, "*", "*.log")):   # large logs are stored .xz
        session, name = os.path.basename(os.path.dirname(logical)), os.path.basename(logical)[: -len(".log")]
        if "." not in name:
            continue
        engine, att = name.rsplit(".", 1)
        if not att.startswith("a") or not att[1:].isdigit():
            continue
        runs = df[(df["file"] == f"{session}.jsonl") & (df["engine_id"] == engine)
                  & (df["attempt"] == int(att[1:])) & df["crashed"]]
        runs = runs[(runs["fix"] != True) & (runs["probe"] != True) & (runs["canary"] != True)]
        dumps = analysis.scheduler_dumps(log)
        if runs.empty or not dumps:
            continue
        r, d = runs.iloc[0], dumps[-1]
        sd = r.get("spec_decode_metrics") if isinstance(r.get("spec_decode_metrics"), dict) else {}
        k = int(r["num_speculative_tokens"]) if r.get("spec_method") not in (None, "none") else 0
        out.append({
            "name": f"{session.replace('2026-11-30_h200_', '')}/{name}", "run": r["run_id"], "file": r["file"],
            "cell": r["cell"],
            "path": r.get("mode"), "tensor_parallel_size": r.get("tensor_parallel_size"), "weights": r.get("weights"),
            **_acceptance(sd.get("acceptance_length"), r.get("acceptance")),
            **_dump_fields(d, r["concurrency"], r.get("max_tokens"), k),
            "s into the run": r.get("wall_s"), "instruments": r.get("instruments"),
        })
    return out


def _acceptance(measured, setting) -> dict:
    """The acceptance a crash state shows: the run's measured mean acceptance length where it recorded one, else the
    synthetic sampler's setting, and which of the two it is (a crashed run usually recorded no measurement)."""
    ok = isinstance(measured, numbers.Real) and not math.isnan(measured)
    return {"acceptance (mean length)": round(float(measured), 2) if ok else setting,
            "acceptance is": "measured in the run" if ok else "the synthetic setting (the run recorded no measurement)"}


def _dump_fields(d: dict, n_req, max_tokens, k: int) -> dict:
    """The crash-state fields read from one vLLM dump (:func:`analysis.scheduler_dumps`) of a run that sent ``n_req``
    requests of at most ``max_tokens`` tokens with ``k`` spec tokens a step."""
    running = d.get("num_running_reqs")
    has_max = isinstance(max_tokens, numbers.Real) and not math.isnan(max_tokens)   # numpy ints too
    empty = empty_steps(d["num_output_tokens"], int(max_tokens), k) if d.get("num_output_tokens") and has_max else []
    return {
        "concurrency": n_req,
        "num_running_reqs": running, "num_waiting_reqs": d.get("num_waiting_reqs"),
        "kv_cache_usage": round(d["kv_cache_usage"], 4) if d.get("kv_cache_usage") is not None else None,
        "total_num_scheduled_tokens": d.get("total_num_scheduled_tokens"),
        "scheduled requests": sched.group(1).count(":") if (sched := re.search(r"num_scheduled_tokens=\{([^}]*)\}",
                                                                                d.get("raw") or "")) else None,
        "num_computed_tokens": _span(d.get("num_computed_tokens", [])),
        "num_output_tokens": _span(d.get("num_output_tokens", [])),
        "finished since the previous step": len(d.get("finished_req_ids", [])),
        "requests with empty steps": sum(1 for e in empty if e) if empty else None,
        # lower bounds, over the requests of the dump
        "empty steps per request (at least)": _span(empty) if empty else None,
        "phase": (f"tail ({n_req - running} of {n_req} requests finished)" if running is not None and running < n_req
                  else "all requests running"),
    }


BENCH_STOCK = "DFlash FULL (stock)"   # dflash_lab.bench.mode_of


def bench_stock(bench_runs, concurrencies) -> tuple[dict, list[dict]]:
    """Stock DFlash FULL_AND_PIECEWISE in the benchmark (issue 11's server runs, :func:`bench.load_bench`): a crash-rate
    row like :func:`path_rates`' (per concurrency crashed / runs that finished or crashed, warm-ups among them said,
    deadline cuts and failed starts left out; the kernels core dumps named, where the stock engine took them: the
    s2 bench matrices turn them on from s27, s26's runs recorded none) and the crash state of every crash whose
    engine log kept vLLM's dump, with the CUDA error the log printed."""
    import pandas as pd

    stock = bench_runs[(bench_runs["mode"] == BENCH_STOCK) & ~bench_runs["cut_by_deadline"].fillna(False).astype(bool)]
    d = stock[stock["outcome"].isin(["ok", "crash"])]
    hung = stock[stock["outcome"] == "timeout"]   # neither finished nor crashed: said beside the count
    tps = sorted({int(t) for t in d["tensor_parallel_size"].dropna()}) or [1]
    row = {"path": "server, TP=" + "/".join(map(str, tps)) + ", benchmark", "acceptance": ", ".join(
        sorted({f"{a:g}" for a in d["acceptance"].dropna()})) or "-"}
    for c in concurrencies:
        g, t = d[d["concurrency"] == c], int((hung["concurrency"] == c).sum())
        w = int(g["warmup"].sum())
        notes = ([f"{w} a warm-up"] if w else []) + ([f"{t} timed out"] if t else [])
        row[c] = (f"{int(g['crashed'].sum())}/{len(g)}" + (f" ({', '.join(notes)})" if notes else "")) if len(g) or t else "not run"
    crashed = d[d["crashed"]]
    fault = lambda r: r.get("fault") if isinstance(r.get("fault"), dict) else None
    kernels = pd.Series([(fault(r) or {}).get("kernel") for _, r in crashed.iterrows()], dtype=object).dropna()
    if not len(d) or not len(crashed):
        named = "-" if not len(d) else "no crash"
    elif not len(kernels):
        named = "no core dump"
    else:
        named = ", ".join(f"{k} ({n})" for k, n in sorted(kernels.value_counts().items()))
        unread = sum(1 for _, r in crashed.iterrows() if fault(r) and not fault(r).get("kernel"))
        if unread:
            named += f", unread ({unread})"
        if len(kernels) + unread < len(crashed):
            named += f", no core dump ({len(crashed) - len(kernels) - unread})"
    row["faulting kernel (core dump)"] = named
    dumping = d["coredump"].fillna(False).astype(bool) if "coredump" in d else pd.Series(False, index=d.index)
    row["instruments attached"] = "; ".join(x for x in (f"{int(dumping.sum())} with core dump on" if dumping.any() else "",
                                                        f"{int((~dumping).sum())} plain" if (~dumping).any() else "") if x) or "-"
    states = []
    shared = crashed["engine_log"].dropna()
    if shared.duplicated().any():   # a crash ends its engine: one crash per engine log, whose dump and error are its own
        raise LabError(f"bench lines name one engine log for several crashes: {sorted(set(shared[shared.duplicated()]))}")
    for _, r in crashed.iterrows():
        log = r.get("engine_log")
        dumps = analysis.scheduler_dumps(log) if isinstance(log, str) else []
        if not dumps:
            continue
        m = CUDA_ERROR_RE.search(analysis.read_text(log))
        states.append({
            "name": f"{r['gpu_session']}/{r['engine_id']}.a{r['attempt']}", "run": r["run_id"], "file": r["file"],
            "cell": f"{BENCH_STOCK}, k={r['num_speculative_tokens']}, benchmark" + (
                f" ({int(r['max_tokens'])}-token warm-up)" if r["warmup"] else f" ({int(r['max_tokens'])} tokens)"),
            "path": "server", "tensor_parallel_size": r["tensor_parallel_size"], "weights": r["weights"],
            **_acceptance(r.get("acceptance_length"), r["acceptance"]),
            **_dump_fields(dumps[-1], r["concurrency"], r["max_tokens"], int(r["num_speculative_tokens"])),
            "s into the run": None, "instruments": ("core dump on (keep running)" if r.get("coredump") == "keep-running"
                                                     else "core dump on" if r.get("coredump") else "none"),
            "CUDA error": m.group(1).strip() if m else "not in the log"})
    return row, states


def bench_stock_by_acceptance(bench_runs, concurrencies) -> tuple[list[dict], list[dict]]:
    """:func:`bench_stock` once per synthetic acceptance (a crash rate is only a rate at one acceptance: the schedule
    decides whether a step can reject every draft), each row's path naming its acceptance, and every crash state."""
    stock = bench_runs[bench_runs["mode"] == BENCH_STOCK]
    rows, states = [], []
    for acc, g in stock.groupby("acceptance", sort=True):
        row, st = bench_stock(g, concurrencies)
        row["path"] += f", acceptance {acc:g}"
        rows.append(row)
        states += st
    return rows, states


# the error vLLM's engine core printed for the crash (a device-side assert, a cuBLAS failure, an illegal address)
CUDA_ERROR_RE = re.compile(r"(?:AcceleratorError|RuntimeError): CUDA error: ([^\n`]*?)(?: when calling|\n|$)")


def side_by_side(df, data_dir: str = "data/gpu", extra=()):
    """Fields as rows; the report's crash A and B, then each of ours (identical dumps merged), then ``extra`` states
    (:func:`bench_stock`'s)."""
    import pandas as pd

    cols, seen = dict(REPORT_STATES), {}
    for s in list(our_states(df, data_dir)) + list(extra):
        key = tuple(s[f] for f in FIELDS if f != "cell")
        if key in seen:
            seen[key]["runs"].append(s["run"])
            seen[key]["states"].append(s)
            continue
        seen[key] = {"state": s, "runs": [s["run"]], "states": [s]}
    for i, v in enumerate(seen.values(), 1):
        s = v["state"]
        label = f"ours {i}: {s['name']}" + (f" (+{len(v['runs']) - 1} identical)" if len(v["runs"]) > 1 else "")
        cols[label] = {f: s[f] for f in FIELDS}
        cols[label]["cell"] = "; ".join(sorted({x["cell"] for x in v["states"]}))
    return pd.DataFrame({k: [c.get(f) for f in FIELDS] for k, c in cols.items()}, index=list(FIELDS))


PATHS = (("offline", 1), ("server", 1), ("offline", 2), ("server", 2))


ISSUE_CONCURRENCIES = (1, 8, 16, 20, 24, 28, 32, 64)   # issue 12's threshold list and the report's 16-32


def path_rates(df, concurrencies=None):
    """Crash rate of stock DFlash FULL_AND_PIECEWISE per path and concurrency, with the faulting kernels
    the core dumps named on that path. The columns are ``concurrencies``, by default :data:`ISSUE_CONCURRENCIES` and
    every concurrency a stock run recorded, so that no run drops out of the table (s22 added 6 and 10). Each path has a row at the crash configuration's synthetic acceptance
    (:data:`analysis.CRASH_ACCEPTANCE`), ``path`` "offline, TP=1"; a path that also ran at another acceptance gets a
    row of its own for each, ``path`` "offline, TP=1, acceptance 8.8": another workload, never pooled."""
    import pandas as pd

    d = analysis.stock_full(df, acceptance=None)
    d = d[(d["outcome"] != "startup_error") & ~d.apply(analysis.is_deadline_cut, axis=1)]
    if concurrencies is None:
        concurrencies = sorted(set(ISSUE_CONCURRENCIES) | {int(c) for c in d["concurrency"].dropna()})
    ft = analysis.fault_table(d) if d["crashed"].any() else pd.DataFrame(columns=["run", "file", "faulting kernel"])
    # every acceptance a stock run recorded gets rows: numbers, "natural", per-position lists, and "unknown" for a
    # line without a usable value, so that no run drops out of the table
    crash_key = analysis.acceptance_key(analysis.CRASH_ACCEPTANCE)
    keys = pd.Series([analysis.acceptance_key(a) for a in d["acceptance"]], index=d.index, dtype=object)
    others = sorted({k for k in keys if k != crash_key}, key=lambda k: (not isinstance(k, float), str(k)))
    rows = []
    for mode, tp in PATHS:
        here_path = (d["mode"].fillna("offline") == mode) & (d["tensor_parallel_size"] == tp)
        for key in [crash_key] + others:
            p = d[here_path & (keys == key)]
            if key != crash_key and not len(p):
                continue
            row = {"path": f"{mode}, TP={tp}" + ("" if key == crash_key else f", acceptance {analysis.acceptance_label(key)}"),
                   "acceptance": analysis.acceptance_label(key)}
            for c in concurrencies:
                g = p[p["concurrency"] == c]
                row[c] = f"{int(g['crashed'].sum())}/{len(g)}{_only_with(g)}" if len(g) else "not run"
            # a run is its file and run id together: run ids repeat across matrices and sessions
            runs_here = set(zip(p["file"], p["run_id"]))
            here = pd.Series([(f, r) in runs_here for f, r in zip(ft["file"], ft["run"])], index=ft.index, dtype=bool)
            k = ft[here & (ft["faulting kernel"] != "no core dump")]
            row["faulting kernel (core dump)"] = (", ".join(f"{n} ({c})" for n, c in sorted(k["faulting kernel"].value_counts().items()))
                                                  or ("-" if not len(p) else "no crash" if not p["crashed"].any() else "no core dump"))
            row["instruments attached"] = "; ".join(f"{n} {'plain' if i == 'none' else 'with ' + i}"
                                                     for i, n in p["instruments"].value_counts().sort_index().items()) or "-"
            rows.append(row)
    return pd.DataFrame(rows)


def not_monotonic(runs) -> tuple[list, list]:
    """Where a crash rate over concurrency breaks monotonicity: (the concurrencies where every run crashed below one
    where every run completed, those completed concurrencies above a crashed one). ([], []) when it is monotonic. Only
    outcomes "crash" and "ok" decide a concurrency: one with a timeout or a failed start among its runs decides nothing."""
    if not len(runs):
        return [], []
    rate = {}
    for c, g in runs.groupby("concurrency"):
        out = set(g["outcome"]) if "outcome" in g else {"crash" if x else "ok" for x in g["crashed"]}
        rate[int(c)] = "crashed" if out == {"crash"} and g["crashed"].all() else "completed" if out == {"ok"} else None
    crashed = [c for c, v in rate.items() if v == "crashed"]
    mid_ok = sorted(c for c, v in rate.items() if v == "completed" and any(c2 < c for c2 in crashed))
    low_crash = sorted(c for c in crashed if any(c < c2 for c2 in mid_ok))
    return low_crash, mid_ok


# instruments that do nothing until a fault: a cell whose every run carries another instrument (the launch hook, a
# changed environment) is marked, since it did not run as a user's engine does
PASSIVE = ("core dump on", "core dump on (keep running)")


def _only_with(g) -> str:
    """' (launch hook)' when every run of the cell carries that active instrument (one shared by all), ' (greedy)' when
    every run sampled at temperature 0 (the report's workload samples at 0.7), else ''."""
    shared = None
    for ins in g["instruments"]:
        active = {i.strip() for i in str(ins).split(",") if i.strip() and i.strip() != "none" and i.strip() not in PASSIVE}
        shared = active if shared is None else shared & active
        if not shared:
            break
    marks = sorted(shared or ()) + (["greedy"] if all_greedy(g) else [])
    return f" ({', '.join(marks)})" if marks else ""


def all_greedy(g) -> bool:
    """Every run of a set sampled at temperature 0 (the report's workload samples at 0.7)."""
    return "temperature" in g and len(g) > 0 and bool((g["temperature"] == 0).all())


def parse_rate(cell: str) -> tuple[int, int] | None:
    """'3/3' or '0/3 (launch hook)' -> (crashed, runs); 'not run' -> None."""
    import re

    m = re.match(r"(\d+)/(\d+)", str(cell))
    return (int(m.group(1)), int(m.group(2))) if m else None


def threshold_states(df, path=("offline", 1), data_dir: str = "data/gpu"):
    """The crash step of each stock crash on one path that left vLLM's dump, one row per run: how many requests
    were running, how many had finished before that step (and since the step before it), the scheduled, computed and
    output tokens, the empty steps (:func:`empty_steps`) and the run's time to the crash. Whether the crash needs
    requests to finish is read from these rows."""
    import pandas as pd

    mode, tp = path
    stock = analysis.stock_full(df)
    keys = set(zip(stock["file"], stock["run_id"]))
    rows = []
    for s in our_states(df, data_dir):
        run_mode = s["path"] if isinstance(s["path"], str) else "offline"
        if (s["file"], s["run"]) not in keys or run_mode != mode or int(s["tensor_parallel_size"] or 1) != tp:
            continue
        n, running = int(s["concurrency"]), s["num_running_reqs"]
        rows.append({"concurrency": n, "run": s["run"], "file": s["file"], "running": running,
                     "finished before the step": None if running is None else n - running,
                     "finished since the previous step": s["finished since the previous step"],
                     "scheduled tokens": s["total_num_scheduled_tokens"], "computed tokens": s["num_computed_tokens"],
                     "output tokens + placeholders": s["num_output_tokens"],
                     "requests with empty steps": s["requests with empty steps"],
                     "empty steps per request (at least)": s["empty steps per request (at least)"],
                     "s into the run": s["s into the run"], "instruments": s["instruments"]})
    return pd.DataFrame(rows).sort_values(["concurrency", "file", "run"]).reset_index(drop=True) if rows else pd.DataFrame(
        columns=["concurrency", "run", "file", "running", "finished before the step", "finished since the previous step",
                 "scheduled tokens", "computed tokens", "output tokens + placeholders", "requests with empty steps",
                 "empty steps per request (at least)", "s into the run", "instruments"])


def plot_threshold(rates, states, path="offline, TP=1"):
    """Left: crashed / runs over concurrency on one path (hollow: every run of the cell carried an active instrument,
    e.g. the launch hook). Right: at each crash step, the requests that had finished before it and since the step
    before it (a crash with none finished shows that finishing is not necessary). Concurrencies are evenly spaced
    categories."""
    import matplotlib.pyplot as plt
    import numpy as np

    row = rates.set_index("path").loc[path]
    concs = [c for c in rates.columns if isinstance(c, (int, np.integer)) and parse_rate(row[c])]
    pos = {c: i for i, c in enumerate(concs)}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6), sharex=True)
    for c in concs:
        k, n = parse_rate(row[c])
        marked = "(" in str(row[c])
        a1.plot(pos[c], k / n, "o", ms=9, color="firebrick", mfc="white" if marked else "firebrick")
        a1.annotate(str(row[c]).replace(" (", "\n("), (pos[c], k / n), textcoords="offset points", xytext=(0, 8),
                    ha="center", fontsize=7)
    a1.set(xlabel="concurrency", ylabel="crashed / runs", ylim=(-0.15, 1.35), title=f"stock FULL_AND_PIECEWISE, {path}")
    rng = np.random.default_rng(0)   # horizontal jitter only, so identical crash steps stay visible
    first = True
    for _, s in states.iterrows():
        if s["concurrency"] not in pos:
            continue
        x = pos[s["concurrency"]] + rng.uniform(-0.15, 0.15)
        a2.plot(x, s["finished before the step"], "o", color="tab:blue", alpha=0.7, label="finished before the crash step" if first else None)
        a2.plot(x, s["finished since the previous step"], "x", color="tab:orange",
                label="finished since the step before (vLLM's finished_req_ids)" if first else None)
        first = False
    a2.plot(range(len(concs)), concs, "_", ms=14, color="0.5", label="all requests (= concurrency)")
    a2.set(xlabel="concurrency", ylabel="requests", title=f"at the crash step (vLLM's dump, {len(states)} crashes)")
    a2.legend(fontsize=7)
    a1.set_xticks(range(len(concs)), [str(c) for c in concs])
    fig.tight_layout()
    return fig


def rank_faults(df):
    """Per crashed stock run with tensor parallelism > 1: the core of each rank (the vLLM process that wrote it and the
    kernel it names), whether every rank's core names the same kernel, and which dump finished first (the runner
    leads the fault with it). Finishing first is when a dump completed, not proof of which rank faulted first: each
    rank's dump starts at its own exception. A run whose fault lists fewer cores than its tensor parallelism says so
    ("ranks with a core")."""
    import pandas as pd

    d = analysis.stock_full(df, acceptance=None)
    d = d[d["crashed"] & (d["tensor_parallel_size"].fillna(1) > 1)]
    rows = []
    for _, r in d.iterrows():
        f = r.get("fault") if isinstance(r.get("fault"), dict) else {}
        cores = f.get("cores") or ([{k: f.get(k) for k in ("process", "pid", "kernel")}] if f.get("kernel") else [])
        kernels = {c.get("kernel") for c in cores}
        rows.append({"run": r["run_id"], "file": r["file"], "path": f"{r.get('mode') or 'offline'}, TP={int(r['tensor_parallel_size'])}",
                     "concurrency": r["concurrency"],
                     "ranks with a core": f"{len(cores)} of {int(r['tensor_parallel_size'])}",
                     "kernel per rank": "; ".join(f"{c.get('process') or c.get('pid')}: {c.get('kernel')}"
                                                  for c in sorted(cores, key=lambda c: str(c.get("process")))),
                     # unread cores (kernel None) name nothing: they cannot agree
                     "same kernel on every rank": len(cores) == int(r["tensor_parallel_size"]) and len(kernels) == 1
                     and None not in kernels,
                     "kernels": "; ".join(sorted(k for k in kernels if k)) or ("unread" if cores else "no core dump"),
                     "dump finished first": f.get("process") if cores else "no core dump"})
    return pd.DataFrame(rows, columns=["run", "file", "path", "concurrency", "ranks with a core", "kernel per rank",
                                       "same kernel on every rank", "kernels", "dump finished first"])


ROPE_KERNELS = ("triton_poi_fused_2", "triton_poi_fused_3")   # the drafter's q/k norm + RoPE at TP=1 / one TP=2 rank
XBLOCKS = (128, 256, 512, 1024, 2048, 4096)


def rope_focus(grid: int, focus_block: int, q_heads: int, kv_heads: int, tokens_per_request: int,
               tokens: int | None = None, half: int = 64) -> list[dict]:
    """Which tokens the block cuda-gdb focused in a core of the drafter's RoPE kernel covers.

    The recorded kernel (``data/gpu/*compile-cache*/triton_poi_fused_{2,3}.py``) is a combo of two index spaces run
    one after the other over the grid: ``T x kv_heads x 64`` elements (k) then ``T x q_heads x 64`` (q), ``XBLOCK``
    elements per block, so ``grid = cdiv(T*kv*64, XBLOCK) + cdiv(T*q*64, XBLOCK)``. Neither ``T`` (the drafter's
    token count, padded to a graph size) nor ``XBLOCK`` (autotuned) is in the core: every (XBLOCK, T) that fits the
    grid is returned (only ``T == tokens`` when given), each with the branch, the token range and the batch rows
    (``tokens_per_request`` query tokens per request: 1 + k for DFlash) of the focused block. cuda-gdb focuses one
    failing block: other blocks may have failed too."""
    out = []
    for xb in XBLOCKS:
        for t in ([tokens] if tokens else range(1, 8193)):
            nk, nq = -(-t * kv_heads * half // xb), -(-t * q_heads * half // xb)
            if nk + nq != grid or not 0 <= focus_block < grid:
                continue
            branch, heads, b = ("k", kv_heads, focus_block) if focus_block < nk else ("q", q_heads, focus_block - nk)
            first, last = b * xb // (heads * half), min(t * heads * half, (b + 1) * xb) - 1
            last //= heads * half
            out.append({"xblock": xb, "tokens": t, "branch": branch, "token range": (first, last),
                        "rows": (first // tokens_per_request, last // tokens_per_request)})
    return out


def _rows_text(fits) -> str:
    return " | ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in (x["rows"] for x in fits)) or "-"


def rope_focus_table(df, data_dir: str = "data/gpu", draft: dict | None = None):
    """Every core (every rank's) of a stock crash that names the drafter's RoPE kernel: the focused block's tokens and
    batch rows (:func:`rope_focus`). Each core is read from the cuda-gdb text recorded beside its engine log (the run
    line keeps the fields of one core only). ``T``, the drafter's query tokens, is the crash step's scheduled requests
    x (1 + k) (``vllm/v1/spec_decode/dflash.py``: batch size x (1 + k)) where vLLM's dump of the step was kept; there the
    fit is checked, not assumed. Without a dump every (XBLOCK, T) that fits the grid is listed, and the last columns
    apply the XBLOCK that cores of the same block shape had wherever T was known (an inference, said as one). Heads
    per rank follow the draft's (``models.TARGETS[...]["draft"]``) and the run's tensor parallelism."""
    import pandas as pd

    from .amend import gdb_sections
    from .coredump import parse_cuda_gdb
    from .models import TARGETS

    draft = draft or TARGETS["qwen36-35b-a3b"]["draft"]
    states = {(s["file"], s["run"]): s for s in our_states(df, data_dir)}
    rows = []
    for _, r in analysis.stock_full(df, acceptance=None).iterrows():
        f = r.get("fault") if isinstance(r.get("fault"), dict) else {}
        if not r["crashed"] or f.get("kernel") not in ROPE_KERNELS:
            continue
        tp = int(r.get("tensor_parallel_size") or 1)
        per_req = int(r["num_speculative_tokens"]) + 1
        st = states.get((r["file"], r["run_id"])) or {}
        tokens = st["scheduled requests"] * per_req if st.get("scheduled requests") else None
        names = {f"core.{c.get('pid')}": c.get("process") for c in f.get("cores") or []}
        # the cuda-gdb text ingest stored beside the engine log (analysis.gpu_folder: data/gpu/<runs file stem>/)
        log = recorded_path(os.path.join(analysis.gpu_folder(dict(r), os.path.dirname(data_dir.rstrip("/")) or "."),
                                         re.sub(r"\.log$", ".coredump.log", os.path.basename(str(r.get("log"))))))
        sections = gdb_sections(analysis.read_text(log)) if log else {}
        cores = [(names.get(os.path.basename(core), f.get("process")), parse_cuda_gdb(text)) for core, text in sections.items()]
        if not cores:   # no recorded cuda-gdb text: the line's own fields
            cores = [(f.get("process"), f)]
        for process, c in cores:
            if c.get("kernel") not in ROPE_KERNELS or not c.get("grid") or not c.get("focus_block"):
                continue
            fits = rope_focus(c["grid"][0], c["focus_block"][0], draft["heads"] // tp, max(1, draft["kv_heads"] // tp),
                              per_req, tokens=tokens)
            rows.append({"run": r["run_id"], "file": r["file"], "TP": tp, "core": process or "-", "kernel": c["kernel"],
                         "grid": c["grid"][0], "block dim": (c.get("block_dim") or [None])[0],
                         "focused block": c["focus_block"][0], "T (dumped step)": tokens,
                         "fits (XBLOCK, T)": ", ".join(f"({x['xblock']}, {x['tokens']})" for x in fits) or "none",
                         "branch": " | ".join(x["branch"] for x in fits) or "-", "batch rows": _rows_text(fits), "_fits": fits})
    t = pd.DataFrame(rows, columns=["run", "file", "TP", "core", "kernel", "grid", "block dim", "focused block",
                                    "T (dumped step)", "fits (XBLOCK, T)", "branch", "batch rows", "_fits"])
    # the XBLOCK each block shape had where T was known, if it had one only
    seen: dict = {}
    for _, x in t[t["T (dumped step)"].notna()].iterrows():
        if len(x["_fits"]) == 1:
            seen.setdefault(x["block dim"], set()).add(x["_fits"][0]["xblock"])
    shape_xb = {b: next(iter(v)) for b, v in seen.items() if len(v) == 1}
    t["T (dumped step)"] = pd.array(t["T (dumped step)"], dtype="Int64")
    t["XBLOCK of that block shape where T was known"] = pd.array(
        [shape_xb.get(b) if pd.isna(T) else None for b, T in zip(t["block dim"], t["T (dumped step)"])], dtype="Int64")
    t["batch rows at that XBLOCK"] = [_rows_text([f for f in fits if f["xblock"] == xb]) if not pd.isna(xb) else "-"
                                      for fits, xb in zip(t["_fits"], t["XBLOCK of that block shape where T was known"])]
    return t.drop(columns=["_fits"])


def client_view(df):
    """What a server's clients saw in each stock server run that crashed: requests completed and failed, the HTTP
    statuses, how the failures arrived (``error_kind``: a non-200 status, or an error event inside a 200 stream) and
    the first error body, as the worker recorded them (``request_errors``, dflash_lab.servebench)."""
    import pandas as pd

    d = analysis.stock_full(df)
    d = d[(d["mode"] == "server") & d["crashed"]]
    rows = []
    for _, r in d.iterrows():
        errs = r.get("request_errors") if isinstance(r.get("request_errors"), dict) else None
        statuses = r.get("http_statuses") if isinstance(r.get("http_statuses"), list) else []
        first = next(iter((errs or {}).get("first_error", {}).values()), {}) if errs else {}
        rows.append({"run": r["run_id"], "file": r["file"], "TP": r["tensor_parallel_size"], "concurrency": r["concurrency"],
                     "completed": r["requests_completed"] if errs else None,
                     "failed": errs.get("failed") if errs else None,
                     "HTTP statuses": ", ".join(f"{s} x{n}" for s, n in sorted(pd.Series(statuses).value_counts().items()))
                     if statuses else "not recorded",
                     "how it failed": ", ".join(f"{k} x{n}" for k, n in sorted(errs["by_kind"].items())) if errs else "not recorded",
                     "first error body": first.get("error"), "after s": first.get("elapsed_s"),
                     "server log": r["error"]})
    return pd.DataFrame(rows)


def plot_path_rates(rates):
    """The crash-rate table as a figure: a row per path, a column per concurrency, crashed/runs in each
    cell (red: all crashed, green: none, grey: not run)."""
    import matplotlib.pyplot as plt
    import numpy as np

    concs = [c for c in rates.columns if isinstance(c, (int, np.integer))]
    frac = np.full((len(rates), len(concs)), np.nan)
    for i, (_, r) in enumerate(rates.iterrows()):
        for j, c in enumerate(concs):
            kn = parse_rate(r[c])
            if kn:
                frac[i, j] = kn[0] / kn[1]
    fig, ax = plt.subplots(figsize=(1.0 * len(concs) + 3.5, 0.6 * len(rates) + 1.4))
    ax.imshow(np.where(np.isnan(frac), -1, frac), cmap=plt.matplotlib.colors.ListedColormap(
        ["#dddddd"] + [plt.cm.RdYlGn_r(x) for x in np.linspace(0, 1, 10)]), vmin=-0.1, vmax=1, aspect="auto")
    for i, (_, r) in enumerate(rates.iterrows()):
        for j, c in enumerate(concs):
            dark = not np.isnan(frac[i, j]) and (frac[i, j] >= 0.8 or frac[i, j] <= 0.2)   # the colormap's dark ends
            ax.text(j, i, r[c], ha="center", va="center", fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(concs)), [str(c) for c in concs])
    ax.set_yticks(range(len(rates)), list(rates["path"]))
    ax.set(xlabel="concurrency", title="stock DFlash k=15 + FULL_AND_PIECEWISE: crashed runs / runs")
    fig.tight_layout()
    return fig
