"""The fix's GPU verification, read from ``data/``: the tables notebook 04 and the findings page show.

A fix claim (the project's standard) needs, in one GPU session: a stock control that crashes; the
fix at concurrency 32 (>= 10 runs) and 16 and 64 (>= 3 each), all completing; the step probe with
the fix showing FULL-graph outputs equal to the no-graph reference; throughput not below PIECEWISE.
Each function here answers one of those from the recorded lines and probe logs, per GPU session
(the label ``ingest --gpu-session`` wrote; lines of unlabelled sessions are never paired).
"""

from __future__ import annotations

import os
import re

from . import analysis, divergence
from .errors import LabError

FULL = "FULL_AND_PIECEWISE"


def is_fix2(r) -> bool:
    return (analysis.fix_label(dict(r)) or "").startswith("fix 2")


def _natural(df):
    """Runs that measure the engine, not an instrument: no step probe, no raising canaries."""
    return df[(df["probe"] != True) & (df["canary"] != True)]


session_key = analysis.session_key


def sessions_with_fix2(df) -> list[str]:
    s = analysis.rows_where(df, is_fix2)["gpu_session"].dropna()
    return sorted(set(s), key=session_key)


def counts_session(df) -> str | None:
    """The GPU session the fix's counts are read from: the latest whose runs meet the counts (a later,
    smaller session, e.g. one that compares outputs, does not replace it); else the latest with fix-2 runs."""
    sessions = sessions_with_fix2(df)
    meeting = [x for x in sessions if verdict(session_table(df, x))["meets_counts"]]
    return meeting[-1] if meeting else sessions[-1] if sessions else None


def output_sessions(df) -> list[str]:
    """GPU sessions with greedy FULL-graph and PIECEWISE runs recorded side by side (token ids)."""
    return [x for x in sorted(set(df["gpu_session"].dropna()), key=session_key) if len(output_agreement(df, x))]


def session_table(df, session: str, acceptance=analysis.CRASH_ACCEPTANCE):
    """One row per (what, concurrency) in a session, at one synthetic acceptance (stock control and fix compared on
    the same workload): runs, ok, crashed, other outcomes, files."""
    import pandas as pd

    d = df[df["gpu_session"] == session]
    if "acceptance" in d:
        d = d[analysis.at_acceptance(d, acceptance)]
    rows = []

    def add(what, sel):
        for c, g in sel.groupby("concurrency"):
            rows.append({"session": session, "what": what, "concurrency": int(c), "runs": len(g),
                         "ok": int((g["outcome"] == "ok").sum()), "crashed": int(g["crashed"].sum()),
                         "other": ", ".join(f"{o} {n}" for o, n in g["outcome"].value_counts().items()
                                            if o not in ("ok", "crash")) or "-",
                         "files": ", ".join(sorted(set(g["file"])))})

    add("stock control (FULL_AND_PIECEWISE)", analysis.stock_full(d, acceptance=None))
    nat = _natural(d)
    add("fix 2 (FULL_AND_PIECEWISE)", analysis.rows_where(nat, is_fix2))
    pw = nat[(nat["cudagraph_mode"] == "PIECEWISE") & (nat["fix"] != True) & (nat["spec_method"] == "dflash")]
    add("stock PIECEWISE (workaround)", pw)
    # a session whose runs were all instrumented (probes, taps: s36) has no row, and still a table
    return pd.DataFrame(rows, columns=["session", "what", "concurrency", "runs", "ok", "crashed", "other", "files"])


def _stock_and_fix(df, acceptance, mode="offline"):
    """TP=1 runs of one path (``mode``: "offline" or "server") that measured the engine (no probe or raising canary,
    no deadline cut or failed start) at one acceptance: (stock FULL_AND_PIECEWISE runs, fixed runs, the GPU sessions
    whose stock runs crashed)."""
    if mode not in ("offline", "server"):
        raise LabError(f"mode must be offline or server, not {mode!r}")
    d = df[(df["mode"].fillna("offline") == mode) & (df["tensor_parallel_size"] == 1)]
    d = _natural(d[~d.apply(analysis.is_deadline_cut, axis=1) & (d["outcome"] != "startup_error")])
    if "acceptance" in d:
        d = d[analysis.at_acceptance(d, acceptance)]
    stock = analysis.stock_full(d, acceptance=None)
    return stock, d[d["fix"] == True], set(stock.loc[stock["crashed"], "gpu_session"].dropna())


def fix_where_stock_crashes(df, acceptance=analysis.CRASH_ACCEPTANCE, mode="offline"):
    """Every concurrency the fix (all three parts, part 1 alone, or the upstream diff applied as a diff) ran at, TP=1
    on one path (``mode``: "offline", the default, or "server": the run lines of data/runs, not the benchmark's),
    beside stock FULL_AND_PIECEWISE at the same concurrency and path over all sessions: a fix run is evidence about
    the crash only where stock crashed every run (``stock there``: "crashes", "completes", "partly", "not run"), and a
    same-session stock control that crashed names the sessions that count (``sessions with a crashed stock control``)."""
    import pandas as pd

    stock, fixed, crashed_ctrl = _stock_and_fix(df, acceptance, mode)
    rows = []
    for label, keep in (("fix 2 (all parts)", is_fix2),
                        ("part 1 alone", lambda r: analysis.fix_label(dict(r)) == "part 1 only: FA3 schedule refresh"),
                        ("the upstream diff, as a diff", lambda r: r.get("fix_via") == "upstream diff")):
        f = analysis.rows_where(fixed, keep)
        for c, g in f.groupby("concurrency"):
            st = stock[stock["concurrency"] == c]
            k, n = int(st["crashed"].sum()), len(st)
            sess = sorted(set(g["gpu_session"].dropna()), key=analysis.session_key)
            rows.append({"fix": label, "concurrency": int(c), "fix completed / runs": f"{int((g['outcome'] == 'ok').sum())}/{len(g)}",
                         "fix sessions": ", ".join(sess),
                         "sessions with a crashed stock control": ", ".join(x for x in sess if x in crashed_ctrl) or "-",
                         "stock crashed / runs (all sessions)": f"{k}/{n}" if n else "not run",
                         "stock there": "not run" if not n else "crashes" if k == n else "completes" if k == 0 else "partly"})
    cols = ["fix", "concurrency", "fix completed / runs", "fix sessions", "sessions with a crashed stock control",
            "stock crashed / runs (all sessions)", "stock there"]
    return pd.DataFrame(rows, columns=cols).sort_values(["fix", "concurrency"]).reset_index(drop=True)


def standard_where_stock_crashes(df, acceptance=analysis.CRASH_ACCEPTANCE):
    """The fix's count standard restated on the concurrencies where offline stock (TP=1) crashed in every run over all
    sessions, since 16, which the issue named, is not one (s21): at each, the fix (all three parts) must complete every
    run, at least 10 at concurrency 32 and 3 elsewhere, counting only runs of GPU sessions whose own stock control
    crashed, pooled over such sessions (the issue's one-session counts are :func:`verdict`'s). One row per such concurrency: ``needed``, ``fix runs`` (in those sessions), ``completed``, ``met``."""
    import pandas as pd

    stock, fixed, controlled = _stock_and_fix(df, acceptance)
    fix2 = analysis.rows_where(fixed, is_fix2)
    fix2 = fix2[fix2["gpu_session"].isin(controlled)]
    rows = []
    for c, g in stock.groupby("concurrency"):
        if not g["crashed"].all():
            continue
        f = fix2[fix2["concurrency"] == c]
        need = 10 if int(c) == 32 else 3
        ok = int((f["outcome"] == "ok").sum())
        rows.append({"concurrency": int(c), "stock crashed / runs": f"{int(g['crashed'].sum())}/{len(g)}", "needed": need,
                     "fix runs": len(f), "completed": ok, "met": len(f) >= need and ok == len(f),
                     "sessions": ", ".join(sorted(set(f["gpu_session"]), key=analysis.session_key)) or "-"})
    return pd.DataFrame(rows, columns=["concurrency", "stock crashed / runs", "needed", "fix runs", "completed", "met",
                                       "sessions"])


def verdict(table) -> dict:
    """Whether a session's counts meet the fix standard, and the counts behind each condition."""
    def pick(what, c=None):
        t = table[table["what"].str.startswith(what)]
        return t if c is None else t[t["concurrency"] == c]

    stock = pick("stock control", 32)  # the crash configuration (a stock run at 2 records outputs, not a control)
    fx = {c: pick("fix 2", c) for c in (16, 32, 64)}
    n = {c: int(fx[c]["runs"].sum()) for c in fx}
    bad = {c: int(fx[c]["runs"].sum() - fx[c]["ok"].sum()) for c in fx}
    return {"stock_crashed": int(stock["crashed"].sum()), "stock_runs": int(stock["runs"].sum()),
            "fix_runs": n, "fix_not_ok": bad,
            "meets_counts": int(stock["crashed"].sum()) > 0 and n[32] >= 10 and n[16] >= 3 and n[64] >= 3
            and sum(bad.values()) == 0}


# the stock engine's configuration under the step probe (dflash_lab.discriminate.configuration): what "stock" means
# where a probe is compared with the fix (a probe of another variant, e.g. FA3 splits 1, has no fix either)
STOCK_PROBE = "dflash k=15, FULL_AND_PIECEWISE (step probe)"


def _tapped(probes):
    return probes["configuration"].fillna("").str.contains("attention taps", regex=False)


def untapped(probes):
    """Probe-table rows without attention-output taps: the probe's own instrument only. The tap probes (s36) are
    counted in their own section (notebook 03; a sentinel run changes what FA3's unwritten rows hold)."""
    return probes[~_tapped(probes)]


def tapped(probes):
    """Probe-table rows with attention-output taps (their logs are the only ones holding ``taps``)."""
    return probes[_tapped(probes)]

PROBE_COLUMNS = ["session", "engine", "path", "fix", "configuration", "build ledger", "gpu_session", "concurrencies", "reached",
                 "runs ok / runs", "steps", "last step", "FULL steps", "max requests in a FULL step", "FULL steps diverging",
                 "FULL steps ended by an error", "first FULL step",
                 "max |output diff|", "first diverging step", "layers written identically before it",
                 "last layer written identically", "first layer written differently", "first NaN step",
                 "NaN rows graph / reference", "violations"]


def probe_runs(df, session: str, engine: str):
    """The run lines of one probed engine: its session is its run file's stem, its engine ``<engine_id>.a<attempt>``."""
    if not len(df):
        return df
    return df[(df["file"] == f"{session}.jsonl") & ((df["engine_id"] + ".a" + df["attempt"].astype(str)) == engine)]


def _oor_parts(runs) -> set:
    """Which rows a probed engine's run lines had the probe's out-of-vocabulary replacement cover (``probe_oor``,
    :func:`analysis.oor_rows`: "all", "row0", "others"); empty when it was off."""
    return ({analysis.oor_rows(v) for v in runs["probe_oor"]} - {None}) if "probe_oor" in runs else set()


def _oor(runs) -> bool:
    """Whether a probed engine's run lines had the probe's out-of-vocabulary replacement on (``probe_oor``)."""
    return bool(_oor_parts(runs))


def _probe_paths(pattern: str, sessions=None) -> list[str]:
    """The step-probe logs ``pattern`` finds; with ``sessions``, only those of these run files (their stems, the probe
    folders' names), the others not read."""
    paths = divergence.probe_files(pattern)
    if sessions is None:
        return paths
    keep = {str(x) for x in sessions}
    return [x for x in paths if os.path.basename(os.path.dirname(os.path.dirname(x))) in keep]


def _apart_probe(path: str, engine: str) -> bool:
    """Whether a step-probe log (``data/gpu/<runs file stem>/<engine>.probe/...``) belongs to an engine whose run lines
    name one of :data:`analysis.APART_TARGETS` (the published draft's shape), read from its runs file beside
    ``data/gpu``: such logs are read only with those lines (``analysis.load_runs(published_draft=True)``)."""
    folder = os.path.dirname(os.path.dirname(path))
    runs_file = os.path.join(os.path.dirname(os.path.dirname(folder)), "runs", os.path.basename(folder) + ".jsonl")
    if not os.path.isfile(runs_file):
        return False
    for _, _, r in analysis.recorded_lines(runs_file):
        target = r["target"]["name"] if isinstance(r.get("target"), dict) else r.get("target")
        if f"{r.get('engine_id')}.a{r.get('attempt')}" == engine and target in analysis.APART_TARGETS:
            return True
    return False


def probe_table(df, pattern: str = divergence.PROBE_GLOB, sessions=None):
    """Every step-probe log, matched to its run lines: fix or stock, configuration, FULL steps, diverging steps,
    largest output difference, first divergence and first NaN (None when there is none). ``concurrencies``: what
    the engine's runs asked for; ``reached``: those of them some FULL step actually ran with (a run cut by a
    deadline before its first FULL step reached nothing). ``sessions``: only the logs of these run files. Empty data
    gives an empty table with these columns."""
    import pandas as pd

    from .discriminate import configuration

    rows = []
    for path in _probe_paths(pattern, sessions):
        p = divergence.load_probe(path)
        runs = probe_runs(df, p["session"], p["engine"])
        if not len(runs) and _apart_probe(path, p["engine"]):
            continue   # a published-draft engine's log, its lines left out of df (analysis.load_runs): read apart
        full = [s for s in p["steps"] if s["mode"] == "FULL"]
        diffs = [s.get("diverge", {}).get("outputs", {}).get("hidden", {}).get("max_abs") for s in full]
        diffs = [x for x in diffs if x is not None]
        fd, nan = divergence.first_divergence(p), divergence.nan_onset(p)
        asked = sorted({int(c) for c in runs["concurrency"]}) if len(runs) else []
        sizes = {s.get("num_reqs") for s in full}
        rows.append({
            "session": p["session"], "engine": p["engine"], "path": path,
            # an intervention's runs (probe_oor: sampled ids changed) are not stock's, whatever else they share
            "fix": ((analysis.fix_label(dict(runs.iloc[0])) or ("stock, ids replaced" if _oor(runs) else "stock"))
                    if len(runs) else "unmatched"),
            "configuration": configuration(dict(runs.iloc[0])) if len(runs) else None,
            # the taps' build ledger (probe.py BuildLedger; the runner records the effective value, an amendment the
            # older lines'): what a 1-request schedule's padding held followed it (s39)
            "build ledger": _ledger(runs),
            "gpu_session": runs["gpu_session"].iloc[0] if len(runs) else None,
            "concurrencies": ", ".join(str(c) for c in asked),
            "reached": ", ".join(str(c) for c in asked if c in sizes),
            "runs ok / runs": f"{int((runs['outcome'] == 'ok').sum())}/{len(runs)}",
            "steps": len(p["steps"]), "last step": p["steps"][-1]["step"] if p["steps"] else None,
            "FULL steps": len(full),
            "max requests in a FULL step": max((s.get("num_reqs") or 0 for s in full), default=0),
            "FULL steps diverging": sum(bool(s.get("diverge", {}).get("diverged")) for s in full),
            # a step whose graph or reference pass raised (the crash step) has no comparison
            "FULL steps ended by an error": sum(bool(s.get("error")) for s in full),
            "first FULL step": full[0]["step"] if full else None,
            "max |output diff|": max(diffs) if diffs else None,
            "first diverging step": fd["step"] if fd else None,
            "layers written identically before it": fd["layers_written_identically_before"] if fd else None,
            "last layer written identically": divergence.short(fd["last_layer_before"]) if fd and fd["last_layer_before"] else None,
            "first layer written differently": divergence.short(fd["first_layer_written_differently"]) if fd else None,
            "first NaN step": nan["step"] if nan else None,
            "NaN rows graph / reference": f"{nan['rows_nonfinite_graph']} / {nan['rows_nonfinite_reference']} "
                                          f"({nan['num_reqs']} req, {nan['num_tokens']} tokens)" if nan else None,
            "violations": sum(s.get("n_violations", 0) for s in p["steps"]),
        })
    return pd.DataFrame(rows, columns=PROBE_COLUMNS)


def _ledger(runs) -> bool | None:
    """Whether the probed engine's taps ran with the build ledger: its run lines' ``probe_ledger`` when every line
    holds the same boolean (None without taps, when a line lacks it, or when they disagree)."""
    if not len(runs) or "probe_ledger" not in runs:
        return None
    vals = {bool(v) if type(v).__name__ in ("bool", "bool_") else None for v in runs["probe_ledger"]}
    return vals.pop() if len(vals) == 1 else None


def reached(rows) -> set:
    """The concurrencies the probe rows' FULL steps actually ran with."""
    return {int(c) for x in rows["reached"] for c in str(x).split(", ") if c}


CANARY_RE = re.compile(r"canary: step (\d+), ([\w.]+), row (\S+), value (\S+?)(?:,|\s|$)")


def canary_table(df):
    """Runs with the canaries raising: the first violation they named (step, field, row, value)."""
    import pandas as pd

    rows = []
    for _, r in df[df["canary"] == True].iterrows():
        m = CANARY_RE.search(r["error"] or "")
        grp = re.search(r"KV-cache group (\d+)", r["error"] or "")
        rows.append({"run": r["run_id"], "fix": analysis.fix_label(dict(r)) or "stock", "concurrency": r["concurrency"],
                     "outcome": r["outcome"], "step": int(m.group(1)) if m else None,
                     "field": m.group(2) if m else None, "row": m.group(3) if m else None,
                     "value": m.group(4) if m else None, "group": int(grp.group(1)) if grp else None,
                     "error": r["error"], "gpu_session": r["gpu_session"], "file": r["file"]})
    return pd.DataFrame(rows)


def warm_runs(df):
    """Natural runs that completed, minus the first run of each engine start (``position`` 0: it pays
    for warm-up, lazy compilation, allocator growth). Throughput ratios use these only."""
    d = _natural(df)
    return d[(d["outcome"] == "ok") & (d["position"] > 0)]


def throughput_table(df, session: str, concurrency: int = 32):
    """Output tokens/s per mode in one session at one concurrency (warm runs): median, min, max, n."""
    import pandas as pd

    w = warm_runs(df[(df["gpu_session"] == session) & (df["concurrency"] == concurrency)])
    rows = []
    for label, sel in (("fix 2, FULL_AND_PIECEWISE", analysis.rows_where(w, is_fix2)),
                       ("stock, PIECEWISE", w[(w["fix"] != True) & (w["cudagraph_mode"] == "PIECEWISE")])):
        x = sel["output_tok_s"].dropna()
        rows.append({"mode": label, "concurrency": concurrency, "warm runs": len(x),
                     "median tok/s": float(x.median()) if len(x) else None,
                     "min": float(x.min()) if len(x) else None, "max": float(x.max()) if len(x) else None})
    return pd.DataFrame(rows)


def position_matched(df, session: str, concurrency: int = 32):
    """Fix 2 FULL against stock PIECEWISE run by run at the same position after their engine's start
    (position 0 is the warm-up run): throughput grows over an engine's first runs, so a ratio of runs
    at different positions measures warm-up, not the mode."""
    import pandas as pd

    d = _natural(df[(df["gpu_session"] == session) & (df["concurrency"] == concurrency) & (df["outcome"] == "ok")])
    fx = analysis.rows_where(d, is_fix2).set_index("position")["output_tok_s"]
    pw = d[(d["fix"] != True) & (d["cudagraph_mode"] == "PIECEWISE")].set_index("position")["output_tok_s"]
    rows = [{"position after engine start": int(p), "fix 2 FULL tok/s": float(fx[p]), "PIECEWISE tok/s": float(pw[p]),
             "ratio": float(fx[p] / pw[p])} for p in sorted(set(fx.index) & set(pw.index))]
    return pd.DataFrame(rows)


def _paired_runs(df, session: str, reference: str):
    """(FULL-graph run, the ``reference``-mode stock runs of the same concurrency, round and temperature)
    for every FULL run of ``session`` that recorded its outputs and has such a reference."""
    d = df[(df["gpu_session"] == session) & (df["outcome"] == "ok")]
    if "output_digests" not in d or d.empty:   # (s44: a session whose runs all crashed) an empty mask would select columns
        return
    d = d[d["output_digests"].map(lambda x: isinstance(x, list)).astype(bool)]
    ref = d[(d["cudagraph_mode"] == reference) & (d["fix"] != True)]
    for _, r in d[d["cudagraph_mode"] == FULL].iterrows():
        m = ref[(ref["concurrency"] == r["concurrency"]) & (ref["round"] == r["round"])
                & (ref["temperature"] == r["temperature"])]
        if not m.empty:
            yield r, m


def output_agreement(df, session: str, reference: str = "PIECEWISE"):
    """Greedy outputs of FULL-graph runs against ``reference``-mode runs of the same session, run by run
    (same concurrency, same round): how many requests produced identical token ids (digests written by
    runs with ``record_outputs``). An engine of another graph mode is an independent reference path."""
    import pandas as pd

    rows = []
    for r, m in _paired_runs(df, session, reference):
        a, b = r["output_digests"], m.iloc[0]["output_digests"]
        same = sum(x == y for x, y in zip(a, b))
        n = max(len(a), len(b))  # a request missing on one side counts as differing
        rows.append({"run": r["run_id"], "fix": analysis.fix_label(dict(r)) or "stock", "reference run": m.iloc[0]["run_id"],
                     "reference runs matching": len(m),
                     "concurrency": int(r["concurrency"]), "temperature": r["temperature"],
                     "identical requests": f"{same}/{n}", "all identical": same == n,
                     # every request of a run has the same prompt: more than one distinct output inside one run
                     # comes from each slot's own synthetic-acceptance draws (s72, logprobs_at) and any batch noise
                     "distinct outputs in the run": len(set(a)), "distinct outputs in the reference run": len(set(b))})
    return pd.DataFrame(rows)


def _drafts(r) -> int | None:
    """vLLM's draft count of one run line (``spec_decode_metrics.num_drafts``), None where not recorded."""
    m = r.get("spec_decode_metrics") if hasattr(r, "get") else None
    v = m.get("num_drafts") if isinstance(m, dict) else None
    return int(v) if isinstance(v, (int, float)) and v == v else None


def _chance_identical(a, b) -> float | None:
    """How many requests of two runs would be token-identical if each batch slot's output were drawn independently
    from its own run's outputs (every request of a runner run has the same prompt): the sum over the distinct outputs
    of their shares in the two runs, times the requests. None without both runs' token ids."""
    if not a or not b:
        return None
    from collections import Counter

    ca, cb = Counter(map(tuple, a)), Counter(map(tuple, b))
    return round(sum(ca[k] / len(a) * cb[k] / len(b) for k in ca) * max(len(a), len(b)), 2)


def pair_evidence(df, session: str, reference: str = "PIECEWISE", data_dir: str = "data"):
    """One row per greedy pair of :func:`output_agreement` (a FULL-graph run and the ``reference``-mode run of the
    same concurrency, round and temperature) with what says whether its differing requests come from the synthetic
    acceptance's draws, batch slots or a wrong number: identical requests, and how many would be if each slot drew its
    output independently from its run's outputs (:func:`_chance_identical`); how many runs each engine start ran
    before it (``position``, :func:`analysis.engine_positions`: the synthetic acceptance draws from one generator seeded
    at engine start, so two engines draw alike only after the same runs); the draft count each run made (vLLM's
    counter: equal draws give both engines the same batches step by step; s15's pairs were at most 1 apart); where the
    differing requests part (:func:`token_divergence`: output positions and token pairs); and the sampled tokens'
    largest log-probability difference along common prefixes beside each engine's own within-run floor
    (:func:`logprob_agreement`; None where log-probabilities were not recorded)."""
    import pandas as pd

    cols = ["run", "reference run", "identical requests", "identical if slots drew independently",
            "runs before it on its engine (FULL, reference)", "drafts (FULL)", "drafts (reference)",
            "differing requests part at", "tokens there (FULL/reference)", "max |dlogprob| vs reference",
            "floor within the FULL run", "floor within the reference run"]
    ag = output_agreement(df, session, reference)
    if not len(ag):
        return pd.DataFrame(columns=cols)
    drafts, chance, before = {}, {}, {}
    place = lambda x: int(x["position"]) if "position" in x and x["position"] == x["position"] else None   # noqa: E731
    for r, m in _paired_runs(df, session, reference):
        key = (r["run_id"], m.iloc[0]["run_id"])
        drafts[key] = (_drafts(r), _drafts(m.iloc[0]))
        before[key] = (place(r), place(m.iloc[0]))
        chance[key] = _chance_identical(output_tokens(r, data_dir), output_tokens(m.iloc[0], data_dir))
    div = token_divergence(df, session, reference, data_dir)
    lp = logprob_agreement(df, session, reference, data_dir)
    lp = {x["run"]: x for _, x in lp.iterrows()} if len(lp) else {}
    rows = []
    for _, a in ag.iterrows():
        d = div[div["run"] == a["run"]] if len(div) else div
        pos = sorted({int(x) for x in d["first differing output position"]}) if len(d) else []
        toks = sorted({f"{x}/{y}" for x, y in zip(d["token (FULL)"], d["token (reference)"])}) if len(d) else []
        fx, ref = drafts.get((a["run"], a["reference run"]), (None, None))
        bf, br = before.get((a["run"], a["reference run"]), (None, None))
        l = lp.get(a["run"])
        rows.append({"run": a["run"], "reference run": a["reference run"], "identical requests": a["identical requests"],
                     "identical if slots drew independently": chance.get((a["run"], a["reference run"])),
                     "runs before it on its engine (FULL, reference)": f"{bf}, {br}",
                     "drafts (FULL)": fx, "drafts (reference)": ref,
                     "differing requests part at": ", ".join(map(str, pos)) or "-",
                     "tokens there (FULL/reference)": ", ".join(toks) or "-",
                     "max |dlogprob| vs reference": None if l is None else l["max |dlogprob| vs reference"],
                     "floor within the FULL run": None if l is None else l["max |dlogprob| within the FULL run"],
                     "floor within the reference run": None if l is None else l["max |dlogprob| within the reference run"]})
    return pd.DataFrame(rows, columns=cols)


def output_forms(df, session: str, data_dir: str = "data"):
    """Every run of ``session`` that recorded its token ids: its distinct outputs, each as runs of one token
    ("201x2 130155x510") with the batch slots that gave it. Every request of a runner run has the same prompt, so more
    than one form in a run comes from each slot's own synthetic-acceptance draws (s72, :func:`logprobs_at`) and any
    batch noise; a form's tokens are all the run produced (an out-of-vocabulary or NaN-born id would show as a token of
    its own)."""
    import itertools

    import pandas as pd

    cols = ["run", "mode", "forms", "output", "slots", "requests"]
    d = df[(df["gpu_session"] == session) & (df["outcome"] == "ok")] if len(df) else df
    rows = []
    for _, r in d.sort_values(["engine_id", "round"]).iterrows() if len(d) else []:
        toks = output_tokens(r, data_dir)
        if toks is None:
            continue
        forms: dict[str, list[int]] = {}
        for i, t in enumerate(toks):
            forms.setdefault(" ".join(f"{k}x{len(list(g))}" for k, g in itertools.groupby(t)), []).append(i)
        for form, slots in sorted(forms.items(), key=lambda kv: -len(kv[1])):
            rows.append({"run": r["run_id"], "mode": f"{analysis.fix_label(dict(r)) or 'stock'}, {r['cudagraph_mode']}",
                         "forms": len(forms), "output": form, "slots": ", ".join(map(str, slots)),
                         "requests": len(slots)})
    return pd.DataFrame(rows, columns=cols)


def logprobs_at(df, session: str, position: int = 1, data_dir: str = "data"):
    """Every distinct (token, log-probability) the greedy runs of ``session`` emitted at output ``position``, with how
    many requests of which runs did. Every request has the same prompt, so where the tokens before ``position`` agree the
    target saw the same context: a token with a lower log-probability than another emitted there is not the target's
    greedy choice (with speculative decoding, a draft token the acceptance rule took). Log-probabilities are rounded to
    5 decimals (the engines' own noise floor is ~0.002)."""
    import pandas as pd

    cols = ["output position", "tokens before it", "token", "log-probability", "requests", "runs"]
    d = df[(df["gpu_session"] == session) & (df["outcome"] == "ok")] if len(df) else df
    seen: dict[tuple, list] = {}
    for _, r in d.sort_values(["engine_id", "round"]).iterrows() if len(d) else []:
        if float(r.get("temperature") or 0) != 0:
            continue
        rec = output_record(r, data_dir)
        if not rec or "logprobs" not in rec:
            continue
        for toks, lps in zip(rec["token_ids"], rec["logprobs"]):
            if len(toks) > position and len(lps) > position and lps[position] is not None:
                key = (" ".join(map(str, toks[:position])), toks[position], round(float(lps[position]), 5))
                seen.setdefault(key, []).append(r["run_id"])
    rows = [{"output position": position, "tokens before it": k[0], "token": k[1], "log-probability": k[2],
             "requests": len(v), "runs": len(set(v))} for k, v in sorted(seen.items(), key=lambda kv: -len(kv[1]))]
    return pd.DataFrame(rows, columns=cols)


def round_agreement(df, session: str):
    """The repeatability floor under :func:`output_agreement`: for each engine start of ``session`` with greedy
    runs that recorded their outputs (temperature 0; sampled runs are left out), every pair of its rounds at one
    concurrency, and how many requests gave identical token ids slot by slot. Every request of a runner run has the
    same prompt, so a request differs between two rounds of one engine only through its batch slot and that round's
    synthetic-acceptance draws (one generator, seeded once per engine start, advancing from round to round)."""
    import itertools

    import pandas as pd

    cols = ["engine", "mode", "concurrency", "runs", "identical requests"]
    d = df[(df["gpu_session"] == session) & (df["outcome"] == "ok")] if len(df) else df
    if "output_digests" not in d or d.empty:
        return pd.DataFrame(columns=cols)
    d = d[d["output_digests"].map(lambda x: isinstance(x, list)).astype(bool)
          & (pd.to_numeric(d["temperature"], errors="coerce") == 0)]
    rows = []
    for (_, eng, att, c), g in d.groupby(["file", "engine_id", "attempt", "concurrency"], sort=True, dropna=False):
        g = g.sort_values("round")
        for (_, a), (_, b) in itertools.combinations(g.iterrows(), 2):
            x, y = a["output_digests"], b["output_digests"]
            mode = f"{analysis.fix_label(dict(a)) or 'stock'}, {a['cudagraph_mode']}"
            rows.append({"engine": f"{eng}.a{int(att)}" if att == att else str(eng), "mode": mode,
                         "concurrency": int(c), "runs": f"{a['run_id']} vs {b['run_id']}",
                         "identical requests": f"{sum(p == q for p, q in zip(x, y))}/{max(len(x), len(y))}"})
    return pd.DataFrame(rows, columns=cols)


def output_record(r, data_dir: str = "data") -> dict | None:
    """What a ``record_outputs`` run wrote (token ids, and log-probabilities where recorded), from its
    ingested folder (``data/gpu/<runs file stem>/<engine>.a*.outputs/``)."""
    import glob
    import json
    import os

    name = str(r["run_id"]).replace("/", "_") + ".json"
    hits = sorted(glob.glob(os.path.join(analysis.gpu_folder(r, data_dir), f"{r['engine_id']}.a*.outputs", name)))
    if not hits:
        return None
    with open(hits[-1]) as f:
        return json.load(f)


def identical_totals(agreement) -> tuple[int, int]:
    """(identical requests, requests) over the fix-2 rows of an :func:`output_agreement` table."""
    fx = agreement[agreement["fix"].str.startswith("fix 2")] if len(agreement) else agreement
    pairs = [tuple(int(v) for v in x.split("/")) for x in (fx["identical requests"] if len(fx) else [])]
    return sum(a for a, _ in pairs), sum(b for _, b in pairs)


def output_tokens(r, data_dir: str = "data") -> list[list[int]] | None:
    """The token ids a ``record_outputs`` run wrote."""
    rec = output_record(r, data_dir)
    return rec["token_ids"] if rec else None


def _prefix_logprob_diff(ta, la, tb, lb) -> tuple[int, float]:
    """(positions compared, max |difference|) of two requests' sampled-token log-probabilities along
    the prefix where their tokens agree (after the first different token the inputs differ). A NaN on
    either side makes the difference NaN (never hidden by max: a stale schedule's NaN must show)."""
    import math

    n, worst = 0, 0.0
    for x, y, p, q in zip(ta, tb, la, lb):
        if x != y:
            break
        if p is not None and q is not None:
            n += 1
            d = abs(p - q)
            if math.isnan(d) or math.isnan(worst):
                worst = math.nan
            else:
                worst = max(worst, d)
    return n, worst


def _within_run(tokens, logprobs) -> tuple[int, float | None]:
    """(positions compared, largest difference) of the sampled tokens' log-probabilities between every
    pair of requests of one run (every request of a runner run has the same prompt), along each pair's
    common token prefix: what the engine's batch slot alone changes. None when nothing was comparable."""
    n, worst = 0, 0.0
    for i in range(len(tokens)):
        for j in range(i + 1, len(tokens)):
            k, w = _prefix_logprob_diff(tokens[i], logprobs[i], tokens[j], logprobs[j])
            n, worst = n + k, _nanmax(worst, w)
    return n, (worst if n else None)


def _max_all(values) -> float:
    out = 0.0
    for v in values:
        out = _nanmax(out, v)
    return out


def _nanmax(a: float, b: float) -> float:
    import math

    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def logprob_agreement(df, session: str, reference: str = "PIECEWISE", data_dir: str = "data"):
    """FULL-graph runs against the ``reference``-mode run of the same concurrency and round: the largest
    difference of the sampled tokens' log-probabilities along each request's common token prefix, next
    to each engine's own noise floor (the same difference between identical prompts inside one run).
    Runs recorded without log-probabilities (before 2026-11-30 s16) are left out."""
    import pandas as pd

    rows = []
    for r, m in _paired_runs(df, session, reference):
        a, b = output_record(r, data_dir), output_record(m.iloc[0], data_dir)
        if not a or not b or "logprobs" not in a or "logprobs" not in b:
            continue
        cmp = [_prefix_logprob_diff(ta, la, tb, lb)
               for ta, la, tb, lb in zip(a["token_ids"], a["logprobs"], b["token_ids"], b["logprobs"])]
        n = sum(k for k, _ in cmp)
        nf, wf = _within_run(a["token_ids"], a["logprobs"])
        nr, wr = _within_run(b["token_ids"], b["logprobs"])
        rows.append({"run": r["run_id"], "fix": analysis.fix_label(dict(r)) or "stock", "reference run": m.iloc[0]["run_id"],
                     "concurrency": int(r["concurrency"]), "positions compared": n,
                     "max |dlogprob| vs reference": _max_all(w for k, w in cmp if k) if n else None,
                     "positions within the FULL run": nf, "max |dlogprob| within the FULL run": wf,
                     "positions within the reference run": nr, "max |dlogprob| within the reference run": wr})
    return pd.DataFrame(rows)


def token_divergence(df, session: str, reference: str = "PIECEWISE", data_dir: str = "data"):
    """Where the outputs of :func:`output_agreement`'s differing requests part: request, the first output
    position whose token differs, the tokens there, and how many distinct token ids the request produced
    (dummy weights give near-flat logits: greedy decoding repeats one or two tokens, and a synthetic acceptance that
    takes a draft token where the target's argmax would differ changes the output: :func:`logprobs_at`)."""
    import pandas as pd

    rows = []
    for r, m in _paired_runs(df, session, reference):
        a, b = output_tokens(r, data_dir), output_tokens(m.iloc[0], data_dir)
        if a is None or b is None:
            continue
        for i, (x, y) in enumerate(zip(a, b)):
            if x == y:
                continue
            k = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            rows.append({"run": r["run_id"], "request": i, "first differing output position": k,
                         "token (FULL)": x[k] if k < len(x) else None, "token (reference)": y[k] if k < len(y) else None,
                         "output length": len(x), "distinct token ids (both outputs)": len(set(x) | set(y)),
                         # every request has the same prompt: does the reference engine produce FULL's whole
                         # output too, at another batch slot of the same run?
                         "FULL's output occurs in the reference run": x in b,
                         "reference requests with FULL's output": sum(q == x for q in b)})
    return pd.DataFrame(rows)


def of_matrix(probes, df, matrix: str):
    """Probe-table rows whose run lines come from ``matrix`` (a probe's session is its run file's name)."""
    files = set(df[df["matrix"] == matrix]["file"]) if len(df) and "matrix" in df else set()
    return probes[(probes["session"] + ".jsonl").isin(files)]


def matrix_run_lines(df, matrices):
    """The run lines of ``matrices`` (names), in the order they were recorded, start-up errors included: which run,
    its outcome, the engine's start-up and the run's wall seconds, the probe's build-ledger setting and the error."""
    import pandas as pd

    r = df[df["matrix"].isin(list(matrices))] if len(df) and "matrix" in df else df.iloc[0:0]
    col = lambda c: r[c] if c in r else pd.Series([None] * len(r), index=r.index, dtype=object)  # noqa: E731
    return pd.DataFrame({"run": r["file"].str.replace(".jsonl", "", regex=False) + "/" + r["run_id"],
                         "outcome": r["outcome"], "engine start s": col("startup_s"), "run wall s": col("runner_wall_s"),
                         "build ledger": col("probe_ledger"), "error": col("error").fillna("")})


def untapped_runs(df, concurrency: int):
    """Untapped stock FULL_AND_PIECEWISE run lines, offline at TP=1 and ``concurrency`` (synthetic acceptance 1.86),
    that measured the engine (no deadline cut or failed start)."""
    s, _, _ = _stock_and_fix(df, analysis.CRASH_ACCEPTANCE)
    return s[s["concurrency"] == concurrency]


def untapped_outcome(df, concurrency: int) -> str | None:
    """What untapped stock FULL_AND_PIECEWISE did offline at TP=1 and ``concurrency`` (synthetic acceptance 1.86):
    ``"ok"`` or ``"crash"`` when every run recorded there did that, else None (none recorded, or mixed)."""
    s = untapped_runs(df, concurrency)
    if not len(s):
        return None
    return "crash" if s["crashed"].all() else "ok" if not s["crashed"].any() else None


FILL_COLUMNS = ["probe", "gpu_session", "engine", "fix", "pre-fill", "fill layers", "concurrency", "predicted", "outcome",
                "error", "acceptance", "FULL steps with taps", "steps differing", "steps with new NaN",
                "steps with unwritten rows", "unwritten as predicted", "unwritten measured", "not modelled", "first FULL step",
                "first NaN step", "first NaN layer", "NaN requests", "NaN only in unwritten requests", "earlier writes finite", "last step",
                "last step ended in"]


def fill_table(df, probes: list[dict]):
    """One row per probed engine of a pre-fill matrix (``probe-fill-tp1``): its run line's outcome beside the outcome
    :func:`fa3sched.predicted_outcome` gives it (unfilled stock: what untapped stock did at that concurrency), and
    what its taps measured (:func:`fa3sched.fill_summary`). A probe with no run line is an error: its outcome would
    be unknown."""
    import pandas as pd

    from . import fa3sched
    from .errors import LabError

    rows, untapped = [], {}
    for p in probes:
        r = probe_runs(df, p["session"], p["engine"])
        if len(r) != 1:
            raise LabError(f"{p['session']}/{p['engine']}: {len(r)} run lines match this probe log (expected 1)")
        r = r.iloc[0]
        fill = r["probe_taps"] if r["probe_taps"] in fa3sched.FILLS else None
        fix = bool(r["fix"] == True)  # noqa: E712 (None, NaN and numpy booleans alike)
        layers = r.get("probe_fill_layers")
        m = r["spec_decode_metrics"]
        s = fa3sched.fill_summary(p)
        c = int(r["concurrency"])
        if c not in untapped:   # once per concurrency: it filters every run line
            untapped[c] = untapped_outcome(df, c)
        rows.append({"probe": f"{p['session']}/{p['engine']}", "gpu_session": r["gpu_session"], "engine": r["engine_id"],
                     "fix": fix, "pre-fill": fill or "none",
                     "fill layers": ", ".join(map(str, layers)) if isinstance(layers, (list, tuple)) and fill else
                     ("all" if fill else ""),
                     "concurrency": c,
                     "predicted": fa3sched.predicted_outcome(fix, fill, untapped[c]),
                     "outcome": "crash" if r["crashed"] else r["outcome"],
                     "error": r["error"] if isinstance(r["error"], str) else "",
                     "acceptance": round(m["acceptance_length"], 2) if isinstance(m, dict) and m.get("acceptance_length") else None,
                     **{k: s[k] for k in FILL_COLUMNS if k in s}})
    t = pd.DataFrame(rows, columns=FILL_COLUMNS)
    for c in ("unwritten as predicted", "first NaN step"):
        t[c] = t[c].astype("Int64")
    return t


def fill_strata(t, by_session: bool = False) -> list[tuple]:
    """The exact test's strata of a :func:`fill_table`: per concurrency (where stock's outcome without a pre-fill
    differs), stock runs only (the fix completes whatever the fill), the condition a NaN pre-fill and the event a
    crash: ``(concurrency, crashes with NaN, NaN runs, crashes, runs)``. ``by_session``: per GPU session and
    concurrency instead, the first item then ``(gpu_session, concurrency)``: runs of different sessions may differ in
    more than the fill (s38's stale schedules held other padding than s37's), so they are not pooled."""
    out = []
    stock = t[~t["fix"].astype(bool)]
    for c, g in stock.groupby(["gpu_session", "concurrency"] if by_session else "concurrency"):
        nan, crashed = g["pre-fill"] == "nan", g["outcome"] == "crash"
        key = (str(c[0]), int(c[1])) if by_session else int(c[0] if isinstance(c, tuple) else c)
        out.append((key, int((nan & crashed).sum()), int(nan.sum()), int(crashed.sum()), len(g)))
    return out


def fill_pooled(t) -> dict | None:
    """The pooled reading of a :func:`fill_table`: the exact test per GPU session and concurrency over stock's runs
    (strata with a crash; a run without a pre-fill counts as not NaN-filled), and what it rests on. None without a
    stratum that has a crash. Keys: ``strata`` (:func:`fill_strata` rows), ``p`` (:func:`fa3sched.exact_stratified`),
    ``all_crashes_nan`` (within each stratum every crash a NaN-filled run and every NaN-filled run a crash),
    ``filled_as_ruled`` (over all stock runs, not only the strata: every NaN-filled run crashed and every 0- or
    sentinel-filled one completed, each set non-empty), ``other`` (stock crashes not NaN-filled) and ``own_nan``
    (they are runs without a pre-fill, each with NaN of its own first: a first NaN step, within the unwritten
    requests, every earlier write of its step finite)."""
    from . import fa3sched

    strata = [x for x in fill_strata(t, by_session=True) if x[3]]
    if not strata:
        return None
    stock = t[~t["fix"].astype(bool)]
    other = stock[(stock["pre-fill"] != "nan") & (stock["outcome"] == "crash")]
    finite = stock[stock["pre-fill"].isin(["zero", "sentinel"])]
    nan = stock[stock["pre-fill"] == "nan"]
    return {"strata": strata, "p": fa3sched.exact_stratified([x[1:] for x in strata]),
            "all_crashes_nan": all(ci == e == n_in for _, ci, n_in, e, _ in strata),
            "filled_as_ruled": (len(finite) > 0 and bool((finite["outcome"] == "ok").all())
                                and len(nan) > 0 and bool((nan["outcome"] == "crash").all())),
            "other": other,
            "own_nan": bool(len(other) and (other["pre-fill"] == "none").all() and nan_of_their_own(other))}


def nan_of_their_own(rows) -> bool:
    """Whether every :func:`fill_table` row had NaN of its own first: a first NaN step, within the requests the stale
    schedule leaves unwritten, every earlier write of that step finite."""
    return bool(rows["first NaN step"].notna().all() and rows["NaN only in unwritten requests"].eq(True).all()
                and rows["earlier writes finite"].eq(True).all())


PLAIN_SITE_COLUMNS = ["concurrency", "runs", "crashed", "GPU sessions", "first FULL step", "sites", "first NaN step",
                      "first NaN layer", "NaN requests", "own NaN", "last steps"]


def plain_sites(t):
    """Where the stock runs without a pre-fill of a :func:`fill_table` turned NaN first, per concurrency: how many ran
    and crashed, in which GPU sessions, how many distinct first sites (first NaN step, layer and requests) they show,
    that site when there is one (else None), whether every run had NaN of its own first (a first NaN step, within the
    requests the stale schedule leaves unwritten, every earlier write of that step finite) and the last steps their
    probes recorded. A run with no NaN at all is a site of its own (step None)."""
    import pandas as pd

    plain = t[~t["fix"].astype(bool) & (t["pre-fill"] == "none")]
    rows = []
    for c, g in plain.groupby("concurrency"):
        site = lambda r: (None if pd.isna(r["first NaN step"]) else int(r["first NaN step"]),  # noqa: E731
                          r["first NaN layer"] if isinstance(r["first NaN layer"], str) else None,
                          tuple(r["NaN requests"]) if isinstance(r["NaN requests"], (list, tuple)) else None)
        sites = {site(r) for _, r in g.iterrows()}
        one = next(iter(sites)) if len(sites) == 1 else (None, None, None)
        rows.append({"concurrency": int(c), "runs": len(g), "crashed": int((g["outcome"] == "crash").sum()),
                     "GPU sessions": ", ".join(sorted({str(s) for s in g["gpu_session"]})),
                     "first FULL step": ", ".join(str(int(x)) for x in sorted(set(g["first FULL step"].dropna()))),
                     "sites": len(sites), "first NaN step": one[0], "first NaN layer": one[1],
                     "NaN requests": list(one[2]) if one[2] is not None else None,
                     "own NaN": nan_of_their_own(g),
                     "last steps": sorted({int(x) for x in g["last step"].dropna()})})
    out = pd.DataFrame(rows, columns=PLAIN_SITE_COLUMNS)
    out["first NaN step"] = out["first NaN step"].astype("Int64")   # stays an integer beside a concurrency without one
    return out


FIRST_SITE_COLUMNS = ["probe", "gpu_session", "concurrency", "build ledger", "ids replaced in", "first step set",
                      "first step requests",
                      "outcome", "first NaN step", "first NaN layer", "NaN requests", "earlier writes finite",
                      "last step", "site"]


def first_site_runs(df, probes, probe_of, concurrencies=(20, 28)):
    """Every probed stock engine with plain taps and no pre-fill at ``concurrencies``, whatever matrix ran it: its
    first NaN site (:func:`fill_table`: step, layer as :func:`divergence.short`, requests) and last step, its build
    ledger, where the probe replaced out-of-vocabulary ids ("none", "all", "row0", "others") and how many requests
    its first step admitted. The replacement acts
    only on ids NaN logits produced, so never before the first NaN step; it is labelled all the same, since its
    per-step work may change what device memory holds. ``probes``: a :func:`probe_table`; ``probe_of``: path -> probe
    log."""
    import pandas as pd

    t = tapped(probes)
    if not len(t):
        return pd.DataFrame(columns=FIRST_SITE_COLUMNS)
    t = t[t["fix"].isin(["stock", "stock, ids replaced"])
          & t["concurrencies"].map(lambda v: any(str(c) in str(v).split(", ") for c in concurrencies)).astype(bool)]
    if not len(t):
        return pd.DataFrame(columns=FIRST_SITE_COLUMNS)
    ft = fill_table(df, [probe_of(x) for x in t["path"]])
    ft = ft[(ft["pre-fill"] == "none") & ~ft["fix"].astype(bool)].copy()
    ft["first NaN layer"] = ft["first NaN layer"].map(lambda x: divergence.short(x) if isinstance(x, str) else x)
    led = {f"{a}/{b}": ledger_label(x) for a, b, x in zip(t["session"], t["engine"], t["build ledger"])}
    ft["build ledger"] = ft["probe"].map(led)
    # how many requests the engine's first step admitted (a prefill step; the offline runner's requests arrive while
    # the engine runs, so this varies between runs of the one seeded workload)
    first = {}
    for a, b, path in zip(t["session"], t["engine"], t["path"]):
        steps = probe_of(path)["steps"]
        first[f"{a}/{b}"] = int(steps[0]["num_reqs"]) if steps and steps[0].get("num_reqs") is not None else None
    ft["first step requests"] = ft["probe"].map(first).astype("Int64")
    runs_of = {k: probe_runs(df, *k.split("/", 1)) for k in ft["probe"]}
    # the admission gate's setting (admit.py, s46 on): "arrival" where the first step took what had arrived
    ft["first step set"] = [_first_step_set(runs_of[k]) for k in ft["probe"]]
    ft["ids replaced in"] = [", ".join(sorted(_oor_parts(runs_of[k]))) or "none" for k in ft["probe"]]
    ft["site"] = [None if pd.isna(st) else f"step {int(st)}, {lay}, requests {q}"
                  for st, lay, q in zip(ft["first NaN step"], ft["first NaN layer"], ft["NaN requests"])]
    return ft[FIRST_SITE_COLUMNS].sort_values(["concurrency", "gpu_session", "probe"]).reset_index(drop=True)


def _first_step_set(runs) -> str:
    """A probed engine's admission gate, from its run lines: "K of N" (``first_step_requests``), or "arrival"."""
    import pandas as pd

    if "first_step_requests" not in runs:
        return "arrival"
    ks = sorted({int(v) for v in runs["first_step_requests"] if not pd.isna(v)})
    return ", ".join(f"{k} of {c}" for k in ks for c in sorted({int(x) for x in runs["concurrency"]})) or "arrival"


def first_sites(runs) -> dict:
    """:func:`first_site_runs` per concurrency and first site: runs, GPU sessions (short), build ledgers, replaced
    rows, the first step's request counts and how many of the runs had them set by the admission gate."""
    import pandas as pd

    out = {}
    for c, g in runs.groupby("concurrency"):
        out[int(c)] = [{"site": None if pd.isna(site) else site, "runs": len(h),
                        "sessions": ", ".join(sorted({analysis.short_session(x) for x in h["gpu_session"]})),
                        "ledger": ", ".join(sorted({str(x) for x in h["build ledger"]})),
                        "replaced": ", ".join(sorted(set(h["ids replaced in"]))),
                        "first steps": ", ".join(str(int(x)) for x in sorted(set(h["first step requests"].dropna()))),
                        "gated": int((h["first step set"] != "arrival").sum()) if "first step set" in h else 0}
                       for site, h in g.groupby("site", dropna=False)]
    return out


OOR_TABLE_COLUMNS = ["session", "engine", "path", "matrix", "gpu_session", "concurrency", "outcome", "ids replaced",
                     "replaced in",
                     "first NaN-logits step", "NaN-logits steps", "first out-of-vocabulary step",
                     "out-of-vocabulary first ids", "ids replaced (count)", "accepted-0 rows", "linked steps",
                     "unlinked steps", "row-0 step", "row-0 how", "earlier steps without a token above row 0",
                     "accepted-0 rows above 0 before it", "row-0 changes", "row-0 changes with a count of 0",
                     "row-0 changes with a count unknown", "row-0 requests that came back", "first row-0 change",
                     "row-0 ids replaced", "first row-0 id replaced", "last step", "core kernel", "core row",
                     "core rows"]


def _target_text(runs, what: str) -> dict:
    """The text config of the one target a probed engine's run lines name (``models.TARGETS``)."""
    from . import models

    targets = ({t.get("name") if isinstance(t, dict) else t for t in runs["target"]}
               if len(runs) and "target" in runs else set())
    if len(targets) != 1 or next(iter(targets)) not in models.TARGETS:
        raise LabError(f"cannot tell the {what} of a probe whose run lines name the targets {sorted(targets)}")
    return models.TARGETS[next(iter(targets))]["text"]


def _vocab_size(runs) -> int:
    return int(_target_text(runs, "vocabulary size")["vocab_size"])


def _core(runs) -> dict:
    """A probed engine's core dump, from its run lines' ``fault``: the faulting kernel ("unread" when the dump named
    none; None without a dump, also when the runner's fault says no core file appeared) and, for the kernels :func:`analysis.core_batch_row` reads, the batch row of the
    focused block and the launch's rows (GDN value heads per rank: the target's, divided by the tensor-parallel
    size)."""
    faults = [f for f in runs["fault"] if isinstance(f, dict)] if "fault" in runs else []
    if not faults:
        return {"kernel": None, "row": None, "rows": None}
    if len(faults) > 1:
        # one log cannot say which step each dump ended: named as such rather than failing the whole table, and
        # never counted as cut by row0_rule (its kernel is not a target-forward kernel)
        return {"kernel": f"{len(faults)} core dumps", "row": None, "rows": None}
    f = faults[0]
    if not f.get("core_file"):
        # the runner waited and found no file (s52's probed r1 at 24: the driver logged that it began a dump, and the
        # processes were gone before the file appeared): no dump, not an unread one
        return {"kernel": None, "row": None, "rows": None}
    tp = {int(x) for x in runs["tensor_parallel_size"].fillna(1)} if "tensor_parallel_size" in runs else {1}
    heads = None
    if f.get("kernel") == analysis.GDN_KERNEL:
        heads = int(_target_text(runs, "GDN value heads")["linear_num_value_heads"]) // max(tp)
    at = analysis.core_batch_row(f, heads) or {}
    return {"kernel": f.get("kernel") or "unread", "row": at.get("row"), "rows": at.get("rows")}


def oor_table(df, pattern: str = divergence.PROBE_GLOB, sessions=None):
    """Every step-probe log, matched to its run lines: its first step with non-finite verify logits and how many
    steps had them, its first step whose first sampled id was out of vocabulary (>= the target's vocabulary size) and
    how many such ids it recorded, how many ids the probe's replacement changed (``probe_oor``; None when it was
    off), its accepted-0 rows and whether they were, step by step, the requests that got an out-of-vocabulary id the
    step before (:func:`divergence.oor_links`). A probe without run lines is left out (nothing says its target).
    ``sessions``: only the logs of these run files (their stems, the probe folders' names), not read otherwise."""
    import pandas as pd

    rows = []
    for path in _probe_paths(pattern, sessions):
        p = divergence.load_probe(path)
        runs = probe_runs(df, p["session"], p["engine"])
        if not len(runs):
            continue
        vocab = _vocab_size(runs)
        smp = [p["samples"][k] for k in sorted(p["samples"])]
        nan_steps = [x["step"] for x in smp if x.get("logits_nonfinite")]
        oor = divergence.out_of_vocab_ids(p, vocab)
        parts = _oor_parts(runs)
        replaced = bool(parts)
        r0 = divergence.row0_without_token(p, vocab) or {"step": None, "how": None}
        zero = divergence.zero_accepted(p)
        links = divergence.oor_links(p, vocab, oor=oor, zero=zero)
        changes = divergence.row0_changes(p)
        r0rep = divergence.row0_replaced_steps(p) if parts == {"row0"} else None
        end = r0["step"] if r0["step"] is not None else (p["steps"][-1]["step"] + 1 if p["steps"] else 0)
        # steps before row 0's (or, without one, any step) in which a row above 0 held a request with no valid token:
        # its own out-of-vocabulary id, or an accepted count of 0 at the step's start
        zero_above = zero[(zero["row"] > 0) & (zero["step"] < end)]
        above = set(oor.loc[(oor["row"] > 0) & (oor["step"] < end), "step"]) | set(zero_above["step"])
        rows.append({"session": p["session"], "engine": p["engine"], "path": path,
                     "matrix": ", ".join(sorted({str(x) for x in runs["matrix"]})) if "matrix" in runs else None,
                     "gpu_session": ", ".join(sorted({str(x) for x in runs["gpu_session"]})),
                     "concurrency": ", ".join(str(int(c)) for c in sorted(set(runs["concurrency"]))),
                     "outcome": ", ".join(sorted(set(runs["outcome"]))), "ids replaced": replaced,
                     "replaced in": (", ".join(sorted("all rows" if w == "all" else f"{w} only" for w in parts))
                                     if replaced else None),
                     "first NaN-logits step": nan_steps[0] if nan_steps else None, "NaN-logits steps": len(nan_steps),
                     "first out-of-vocabulary step": int(oor["step"].min()) if len(oor) else None,
                     "out-of-vocabulary first ids": len(oor),
                     "ids replaced (count)": sum(int(x.get("oor_replaced") or 0) for x in smp) if replaced else None,
                     "accepted-0 rows": len(zero), "linked steps": links["linked"],
                     "unlinked steps": links["unlinked"], "row-0 step": r0["step"], "row-0 how": r0["how"],
                     "earlier steps without a token above row 0": len(above),
                     # request-steps of rows above 0 without a valid token, before row 0's (or, without one, any)
                     "accepted-0 rows above 0 before it": len(zero_above),
                     # row 0's request replaced by another (a finished request's slot), and how often the newcomer
                     # had an accepted count of 0 (divergence.row0_changes)
                     "row-0 changes": len(changes),
                     "row-0 changes with a count of 0": sum(c["accepted"] == 0 for c in changes),
                     "row-0 changes with a count unknown": sum(c["accepted"] is None for c in changes),
                     "row-0 requests that came back": sum(c["returned"] for c in changes),
                     "first row-0 change": changes[0]["step"] if changes else None,
                     # a replacement in row 0 alone: the steps it gave row 0 its only token (None for other runs)
                     "row-0 ids replaced": len(r0rep) if r0rep is not None else None,
                     "first row-0 id replaced": r0rep[0] if r0rep else None,
                     "last step": p["steps"][-1]["step"] if p["steps"] else None,
                     # its core dump, if it took one: the faulting kernel, the focused block's batch row, the rows
                     **{f"core {k}": v for k, v in _core(runs).items()}})
    out = pd.DataFrame(rows, columns=OOR_TABLE_COLUMNS)
    for c in ("first NaN-logits step", "first out-of-vocabulary step", "ids replaced (count)", "row-0 step",
              "first row-0 change", "row-0 ids replaced", "first row-0 id replaced", "last step", "core row",
              "core rows"):
        out[c] = out[c].astype("Int64")
    return out


OOR_MATRIX = "probe-oor-tp1"


def oor_predictions(t):
    """The runs of ``probe-oor-tp1`` (s43) in an :func:`oor_table`, each against the prediction its matrix header wrote
    before the run: the stock control (ids not replaced) crashes; with the ids replaced the run completes, its logits
    still non-finite on later steps and no row's accepted count 0. ``held``: all of that, measured."""
    x = t[t["matrix"] == OOR_MATRIX].copy()
    x["predicted"] = x["ids replaced"].map(lambda r: "ok" if r else "crash")
    x["held"] = [(o == pr) and (not r or (int(n) > 1 and int(z) == 0 and int(c or 0) > 0))
                 for o, pr, r, n, z, c in zip(x["outcome"], x["predicted"], x["ids replaced"], x["NaN-logits steps"],
                                              x["accepted-0 rows"], x["ids replaced (count)"].fillna(0))]
    return x[["engine", "gpu_session", "concurrency", "ids replaced", "predicted", "outcome", "held",
              "first NaN-logits step", "NaN-logits steps", "ids replaced (count)", "out-of-vocabulary first ids",
              "accepted-0 rows", "last step"]]


def session_no(label) -> int | None:
    """The number of a GPU session label ("2026-12-02-s44" -> 44); None for a label without one."""
    m = re.fullmatch(r"s(\d+)", analysis.short_session(label))
    return int(m.group(1)) if m else None


ROW0_FOUND_IN = 43   # the row-0 rule was read from the logs of GPU sessions up to s43, then tested in s44
ROW0_HELD_UNTIL = 50   # every log up to s50 agreed with it; s51's probe at 24 went past its first row-0 step without a fault


#: Kernels of the target's forward. The probe writes a step's line after that step's target forward (probe.py), and a
#: core dump on exception stops the process at the faulting kernel before Python sees an error: a core naming one of
#: these ends the probe log one step before the faulting step. (The drafter's kernels run after the step's line.)
TARGET_FORWARD_KERNELS = frozenset({analysis.GDN_KERNEL})


def row0_rule(t, up_to_session: int | None = None, confirmed=()) -> dict:
    """Over an :func:`oor_table`: the crashing runs whose last recorded step is their first row-0 step
    (:func:`divergence.row0_without_token`), those a core dump cut one step short (``cut``: its core names a kernel of
    the target's forward, :data:`TARGET_FORWARD_KERNELS`, and no recorded step is a row-0 step, so the faulting step has
    no line), those where it is not (``not``), and the completed runs that had a row-0 step all the same.

    A cut log neither shows nor contradicts the rule by itself: its faulting step has no line. It counts for the rule
    only when ``confirmed`` names it, (gpu_session, engine) pairs whose faulting step a replica showed to be a row-0
    step (:func:`confirmed_cuts` over :func:`oor_core_predictions`); the others are ``undecided``. ``holds``: every
    crash at its first row-0 step or a confirmed cut, at least one crash, no completed run with a row-0 step, and no
    ``passed`` log (a run that neither crashed nor completed, e.g. a timeout, whose log records steps after its first
    row-0 step: that step did not fault; s51's probe at 24 is one); an undecided log keeps it False.
    ``up_to_session``: only logs whose GPU sessions are all numbered at most this (``ROW0_FOUND_IN``: the logs the
    rule was found in, before any run tested it)."""
    if up_to_session is not None:
        t = t[t["gpu_session"].map(lambda v: all((session_no(x.strip()) or 0) <= up_to_session
                                                 for x in str(v).split(",")))]
    # a log shared by several runs of one engine has their outcomes joined ("ok, crash"): a crash ended it
    ended = t["outcome"].astype(str).str.split(", ")
    crash, ok = t[ended.map(lambda o: "crash" in o)], t[t["outcome"] == "ok"]
    other = t[~t.index.isin(crash.index) & ~t.index.isin(ok.index)]
    passed = other[other["row-0 step"].notna() & (other["row-0 step"] < other["last step"])]
    at = crash[crash["row-0 step"].notna() & (crash["row-0 step"] == crash["last step"])]
    # logs a core dump ended inside the target's forward of the step after their last line (TARGET_FORWARD_KERNELS):
    # the faulting step has no line, so such a log neither shows nor contradicts a row-0 step there
    rest = crash[~crash.index.isin(at.index)]
    cut = rest[rest["core kernel"].isin(TARGET_FORWARD_KERNELS) & rest["row-0 step"].isna()]
    known = {(str(s), str(e)) for s, e in confirmed}
    is_confirmed = [(str(s), str(e)) in known for s, e in zip(cut["gpu_session"], cut["engine"])]
    confirmed_cut, undecided = cut[is_confirmed], cut[[not c for c in is_confirmed]]
    # completed logs that could have shown a counter-example: ids not replaced (a replaced id is recorded as 0) and
    # some request without a valid token at some step
    testable = ok[~ok["ids replaced"].astype(bool) & (ok["out-of-vocabulary first ids"] > 0)]
    return {"crashes": len(crash), "at row-0 step": len(at), "not": rest[~rest.index.isin(cut.index)], "cut": cut,
            "confirmed cut": confirmed_cut, "undecided": undecided,
            "completed": len(ok), "completed with one": ok[ok["row-0 step"].notna()], "passed": passed,
            "completed testable": len(testable),
            # what the crashing logs show before their row-0 step: rows above 0 without a token, and no fault
            "earlier steps above row 0": int(at["earlier steps without a token above row 0"].sum()),
            # distinct (concurrency, first NaN-logits step, row-0 step, last step): repeats are close replicas
            "distinct": len({(str(c), str(a), str(b), str(d)) for c, a, b, d in zip(
                at["concurrency"], at["first NaN-logits step"], at["row-0 step"], at["last step"])}),
            # crashes whose row-0 step is their first out-of-vocabulary step: there row 0 and "the first such id"
            # cannot be told apart
            "at the first id": int((at["row-0 step"] == at["first out-of-vocabulary step"]).sum()),
            "by how": at.groupby("row-0 how")["concurrency"].agg(lambda c: sorted(set(c), key=int)).to_dict(),
            "holds": (len(at) + len(confirmed_cut) == len(crash) > 0 and not ok["row-0 step"].notna().any()
                      and not len(passed))}


def confirmed_cuts(core) -> set:
    """(gpu_session, engine) of the :func:`oor_core_predictions` runs whose faulting step, the one after a cut log's
    last line, was read from the replica as the move of a count of 0 into row 0, every check held: what
    :func:`row0_rule` may count as a row-0 step."""
    if core is None or not len(core):
        return set()
    x = core[core["held"] & (core["rows replaced"] == "row0")]
    return {(str(s), str(e)) for s, e in zip(x["gpu_session"], x["engine"])}


def _count(v) -> int:
    """A count column's value, 0 when missing (None, NaN or pandas' NA; ``NA or 0`` raises)."""
    import pandas as pd

    return 0 if v is None or pd.isna(v) else int(v)


def _part_runs(t, matrix: str):
    """The runs of ``matrix`` in an :func:`oor_table` whose replacement covered one part of the batch, with that part
    (``rows replaced``: "others" or "row0"); any other replacement is an error."""
    x = t[t["matrix"] == matrix].copy()
    part = {"others only": "others", "row0 only": "row0"}
    x["rows replaced"] = x["replaced in"].map(lambda v: part.get(v))
    if x["rows replaced"].isna().any():
        bad = ", ".join(x.loc[x["rows replaced"].isna(), "engine"])
        raise LabError(f"{matrix}: runs whose replacement was not one part of the batch: {bad}")
    return x


ROW0_MATRIX = "probe-oor-row0-tp1"
ROW0_PREDICTED = {"others": "crash at row 0's own out-of-vocabulary id",
                  "row0": "crash at a count of 0 moved into row 0, if one is; else complete"}


def row0_predictions(t, stock_last: dict | None = None):
    """The runs of ``probe-oor-row0-tp1`` (s44) in an :func:`oor_table`, each against what its matrix header
    predicted before the run from the row-0 rule. ``others`` (the ids replaced in rows above 0 only): the run crashes
    and its last recorded step is its first row-0 step, row 0's own out-of-vocabulary id (``sampled``). ``row0`` (row
    0's ids replaced only): rows above 0 get accepted counts of 0 as in stock (counted before row 0's step), the
    replacement gives row 0 its only token on some step (else row 0 never lost one), and the run crashes exactly at
    the step a count of 0 is moved into row 0 (``moved``; none before row 0's request first changes), and completes
    if that never happens. Every run: NaN logits. ``held``: all of that, measured. ``stock_last``: concurrency -> the last
    recorded steps of stock plain-tap runs there, for the header's less confident prediction that ``others`` crashes
    at the same step (``as stock``; None without them, and for ``row0``, where it was not predicted)."""
    import pandas as pd

    x = _part_runs(t, ROW0_MATRIX)
    x["predicted"] = x["rows replaced"].map(ROW0_PREDICTED)
    held = []
    for _, r in x.iterrows():
        at = (not pd.isna(r["row-0 step"])) and r["row-0 step"] == r["last step"]
        ok = int(r["NaN-logits steps"]) > 0
        if r["rows replaced"] == "others":
            ok = ok and r["outcome"] == "crash" and at and r["row-0 how"] == "sampled"
        else:
            # the test needs both parts to have happened: rows above 0 without a token before row 0's step, and the
            # replacement giving row 0 its only token on some step (else row 0 never lost one and nothing is tested)
            ok = (ok and int(r["accepted-0 rows above 0 before it"]) > 0 and _count(r["row-0 ids replaced"]) > 0
                  and ((r["outcome"] == "crash" and at and r["row-0 how"] == "moved"
                        and not pd.isna(r["first row-0 change"]) and r["last step"] >= r["first row-0 change"])
                       or (r["outcome"] == "ok" and pd.isna(r["row-0 step"]))))
        held.append(bool(ok))
    x["held"] = held
    conc = x["concurrency"].map(lambda c: int(str(c).split(", ")[0]))
    x["stock plain-tap last steps"] = [", ".join(map(str, sorted(set((stock_last or {}).get(c, []))))) or None
                                       for c in conc]
    x["as stock"] = [None if w != "others" or not (stock_last or {}).get(c) else int(s) in set(stock_last[c])
                     for c, s, w in zip(conc, x["last step"], x["rows replaced"])]
    return x[["engine", "gpu_session", "concurrency", "rows replaced", "predicted", "outcome", "held", "row-0 step",
              "row-0 how", "last step", "first row-0 change", "row-0 changes", "row-0 changes with a count of 0",
              "row-0 changes with a count unknown", "row-0 requests that came back", "accepted-0 rows",
              "accepted-0 rows above 0 before it", "row-0 ids replaced", "first row-0 id replaced",
              "first NaN-logits step", "NaN-logits steps", "ids replaced (count)", "stock plain-tap last steps",
              "as stock"]]


def step_ranges(steps) -> str:
    """Steps as compact ranges: [1, 2, 3, 7, 9, 10] -> "1-3, 7, 9-10"; "" for none."""
    out, run = [], []
    for k in sorted(set(int(x) for x in steps)):
        if run and k == run[-1] + 1:
            run.append(k)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}")
        run = [k]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}")
    return ", ".join(out)


CORE_MATRIX = "probe-oor-core-tp1"
#: the kernels probe-oor-core-tp1's header predicted (s44, before the run) for each part of the batch replaced
CORE_PREDICTED = {"others": (analysis.DFLASH_INPUT_KERNEL, "triton_poi_fused_2", "triton_poi_fused_3"),
                  "row0": (analysis.GDN_KERNEL,)}


def oor_core_predictions(t, probe_of):
    """The runs of ``probe-oor-core-tp1`` (s45) in an :func:`oor_table`, each against what its matrix header predicted
    before the run (s44), with its replica: the ``probe-oor-row0-tp1`` run (s44, no core dump) of the same
    concurrency and replaced rows. ``probe_of``: path -> probe log.

    - ``others`` (row 0's own id kept): the run crashes at its first row-0 step, row 0's own out-of-vocabulary id
      (its last recorded step), and the core names the DFlash input kernel or the drafter's RoPE kernel. The header's
      step ("16 as in s44", if the replica's schedule repeats) is reported apart (``step as replica``).
    - ``row0`` (a count of 0 moved into row 0): the run crashes and the core names the GDN kernel. The GDN kernel runs
      in the target's forward, before the probe writes the step's line (:data:`TARGET_FORWARD_KERNELS`), so the
      faulting step is the one after the last line and has no line of its own; that step is read from the replica:
      both logs record the same requests and accepted counts on every step from ``agree from`` to this run's last
      (``agree from`` at most the replica's first change of row 0), the replica's next step moved a count of 0 into
      row 0 (its row-0 step, ``moved``) with as many requests as the core's launch had rows, and this run recorded no
      row-0 step. The replacement must have given row 0 its only token on some step, as in the replica.
      ``rows at its last step`` (this run's last line) is reported beside ``core rows``: where they differ, the
      faulting launch is not the last line's step (a supporting reading, not part of ``held``). ``replica error``:
      the error the replica's last line recorded ("reference pass: ..." when it reached Python in the probe's no-graph
      reference pass).

    Every run: NaN logits, and where the kernel's grid maps to requests (:func:`analysis.core_batch_row`) the focused
    block in batch row 0 (``core row``). ``held``: all of that, measured."""
    import pandas as pd

    x = _part_runs(t, CORE_MATRIX)
    reps = t[t["matrix"] == ROW0_MATRIX]
    cols = {k: [] for k in ("predicted kernels", "kernel as predicted", "replica", "replica last step",
                            "replica rows at its last step", "steps differing", "agree from", "steps compared",
                            "step as replica", "rows at its last step", "replica error",
                            "faulting step", "held")}
    for _, r in x.iterrows():
        w = r["rows replaced"]
        rep = reps[(reps["concurrency"] == r["concurrency"]) & (reps["replaced in"] == r["replaced in"])]
        if len(rep) != 1:
            raise LabError(f"{CORE_MATRIX}, {r['engine']}: {len(rep)} {ROW0_MATRIX} runs at {r['concurrency']} with "
                           f"{r['replaced in']} replaced; the check needs exactly one replica")
        rep = rep.iloc[0]
        a, b = probe_of(r["path"]), probe_of(rep["path"])
        agree = divergence.schedule_agreement(a, b)
        differ = set(agree["reqs differ"]) | set(agree["counts differ"])
        last = int(r["last step"])
        upto = [k for k in agree["common"] if k <= last]
        start = max(differ) + 1 if differ else (upto[0] if upto else None)
        rep_last = next((s for s in b["steps"] if s["step"] == int(rep["last step"])), None)
        own_last = next((s for s in a["steps"] if s["step"] == last), None)
        kernel_ok = r["core kernel"] in CORE_PREDICTED[w]
        row_ok = pd.isna(r["core row"]) or int(r["core row"]) == 0
        ok = r["outcome"] == "crash" and kernel_ok and row_ok and int(r["NaN-logits steps"]) > 0
        if w == "others":
            faulting = r["row-0 step"] if not pd.isna(r["row-0 step"]) else None
            ok = ok and faulting is not None and int(faulting) == last and r["row-0 how"] == "sampled"
        else:
            # the faulting step: the one after the last line, read from the replica
            faulting = last + 1
            ok = (ok and r["core kernel"] in TARGET_FORWARD_KERNELS and pd.isna(r["row-0 step"])
                  and _count(r["row-0 ids replaced"]) > 0 and start is not None
                  and not pd.isna(rep["first row-0 change"]) and start <= int(rep["first row-0 change"])
                  and bool(upto) and upto[-1] == last
                  and not pd.isna(rep["row-0 step"]) and int(rep["row-0 step"]) == faulting
                  and rep["row-0 how"] == "moved" and rep_last is not None
                  and not pd.isna(r["core rows"]) and int(r["core rows"]) == int(rep_last.get("num_reqs") or -1))
        cols["predicted kernels"].append(", ".join(CORE_PREDICTED[w]))
        cols["kernel as predicted"].append(bool(kernel_ok))
        cols["replica"].append(f"{rep['gpu_session']}: {rep['engine']}")
        cols["replica last step"].append(int(rep["last step"]))
        cols["replica rows at its last step"].append(int(rep_last.get("num_reqs")) if rep_last else None)
        # where the replica's CUDA error reached Python: the probe's no-graph reference pass or the production pass
        cols["replica error"].append(str(rep_last.get("error"))[:80] if rep_last and rep_last.get("error") else None)
        cols["rows at its last step"].append(int(own_last["num_reqs"]) if own_last and own_last.get("num_reqs")
                                             is not None else None)
        cols["steps differing"].append(step_ranges(k for k in differ if k <= last))
        cols["agree from"].append(start)
        cols["steps compared"].append(len([k for k in upto if start is not None and k >= start]))
        cols["step as replica"].append(None if faulting is None else int(faulting) == int(rep["last step"]))
        cols["faulting step"].append(None if faulting is None else int(faulting))
        cols["held"].append(bool(ok))
    for k, v in cols.items():
        x[k] = v
    for c in ("agree from", "faulting step", "replica rows at its last step", "rows at its last step"):
        x[c] = x[c].astype("Int64")
    return x[["engine", "gpu_session", "concurrency", "rows replaced", "outcome", "held", "predicted kernels",
              "core kernel", "kernel as predicted", "core row", "core rows", "row-0 step", "row-0 how", "last step",
              "rows at its last step", "faulting step", "replica", "replica last step", "replica rows at its last step", "replica error", "step as replica",
              "steps differing", "agree from", "steps compared", "row-0 ids replaced", "first NaN-logits step", "NaN-logits steps"]]


def plot_row0_changes(ax, probe: dict, title: str):
    """One probe log: per step, how many batch rows above 0 began it with an accepted count of 0 (no valid token the
    step before), and every step at which row 0's request changed (:func:`divergence.row0_changes`), marked by the
    newcomer's count; the last recorded step marked."""
    z = divergence.zero_accepted(probe)
    steps = [s["step"] for s in probe["steps"]]
    if not steps:
        raise LabError(f"{title}: the probe log records no step")
    above = z[z["row"] > 0].groupby("step").size()
    ax.plot(steps, [int(above.get(s, 0)) for s in steps], color="0.5", lw=1, label="rows above 0 with a count of 0")
    for c in divergence.row0_changes(probe):
        zero = c["accepted"] == 0
        ax.axvline(c["step"], color="tab:red" if zero else "tab:green", lw=1.5 if zero else 1, ls="-" if zero else "--")
    ax.plot([], [], color="tab:green", ls="--", label="row 0's request changed, newcomer's count > 0")
    ax.plot([], [], color="tab:red", label="row 0's request changed, newcomer's count 0")
    ax.plot([steps[-1]], [0], marker="|", color="k", ms=14, ls="none", label="last recorded step")
    ax.set_xlabel("engine step")
    ax.set_ylabel("batch rows")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=6, loc="upper left")
    return ax


def plot_row0(ax, t):
    """One line per crashing run of an :func:`oor_table`: from its first step with non-finite logits to its last
    recorded step, its first row-0 step marked; runs sorted by concurrency."""
    import pandas as pd

    x = t[t["outcome"] == "crash"].copy()
    if not len(x):
        raise LabError("no crashing run to plot")
    x["c"] = x["concurrency"].map(lambda c: int(str(c).split(", ")[0]))
    x = x.sort_values(["c", "last step"]).reset_index(drop=True)
    for i, r in x.iterrows():
        if not pd.isna(r["first NaN-logits step"]):
            ax.plot([int(r["first NaN-logits step"]), int(r["last step"])], [i, i], color="0.6", lw=1.5)
            ax.plot([int(r["first NaN-logits step"])], [i], "o", color="tab:orange", ms=4)
        if not pd.isna(r["row-0 step"]):
            ax.plot([int(r["row-0 step"])], [i], "x" if r["row-0 how"] == "sampled" else "s", color="tab:red", ms=7,
                    mfc="none")
        ax.plot([int(r["last step"])], [i], "|", color="k", ms=10)
    ax.set_yticks(range(len(x)), [f"c{r['c']} {r['engine'].removesuffix('.a1')}" for _, r in x.iterrows()], fontsize=6)
    ax.set_xscale("symlog", linthresh=30)
    ax.set_xlabel("engine step")
    for style, lab in ((dict(marker="o", color="tab:orange", ms=4), "first non-finite logits"),
                       (dict(marker="|", color="k", ms=10), "last recorded step"),
                       (dict(marker="x", color="tab:red", ms=7), "row 0 sampled an out-of-vocabulary id"),
                       (dict(marker="s", color="tab:red", ms=7, mfc="none"), "accepted count 0 moved into row 0")):
        ax.plot([], [], ls="none", label=lab, **style)
    ax.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2)
    return ax


def ledger_label(ledger) -> str:
    """A probe's build-ledger setting for tables and prose."""
    if type(ledger).__name__ not in ("bool", "bool_"):    # None, NaN (a column with unknowns), anything else
        return "ledger unknown"
    return "ledger on" if ledger else "ledger off"


def stale_padding_table(probes, probe_of):
    """Per stock tap probe (probe-table rows, :func:`tapped`) and padding: its GPU session, build ledger, how many of its
    FULL steps read group 7's stale schedule with that padding (:func:`fa3sched.stale_paddings`; None where the stale
    schedule is not a 1-request one). ``probe_of``: path -> probe log."""
    import pandas as pd

    from . import fa3sched

    t = tapped(probes)
    t = t[t["fix"] == "stock"]
    rows = [{"gpu_session": sess, "build ledger": led, "probe": path, "padding": pad, "stale reads": n}
            for path, sess, led in zip(t["path"], t["gpu_session"], t["build ledger"])
            for pad, n in fa3sched.stale_paddings(probe_of(path)).items()]
    return pd.DataFrame(rows, columns=["gpu_session", "build ledger", "probe", "padding", "stale reads"])


PADDING_MATRIX = "probe-padding-tp1"
PADDING_COLUMNS = ["run", "gpu_session", "concurrency", "instruments", "prediction", "predicted", "measured", "held"]


def fmt_value(x) -> str:
    """One schedule entry for a table or prose: large values (uninitialised memory) in hex."""
    return hex(int(x)) if abs(int(x)) > 0xFFFF else str(int(x))


def fmt_schedule(v) -> str:
    """A schedule or padding for a table: its entries as :func:`fmt_value` writes them."""
    return "[" + ", ".join(fmt_value(x) for x in v) + "]"


def ledger_order(df, matrix: str = PADDING_MATRIX) -> dict:
    """Per GPU session, the build-ledger setting of each probed run of ``matrix`` in the order the runs finished
    (``finished_at``), and whether it alternated (no two runs in a row with one setting; needs both settings)."""
    from .errors import LabError

    runs = df[(df["matrix"] == matrix) & (df["probe"] == True)] if len(df) and "matrix" in df else df.iloc[:0]  # noqa: E712
    if len(runs) and "finished_at" not in runs:
        raise LabError(f"{matrix}: its run lines have no finished_at: the order of the ledger settings is not known")
    out = {}
    for sess, g in runs.groupby("gpu_session"):
        seq = list(g.sort_values("finished_at")["probe_ledger"])
        if not all(type(x).__name__ in ("bool", "bool_") for x in seq):   # an unknown setting is not "off"
            raise LabError(f"{matrix}, {sess}: a probed run line does not say whether the build ledger ran (probe_ledger)")
        seq = [bool(x) for x in seq]
        out[sess] = {"order": seq, "alternates": len(set(seq)) == 2 and all(a != b for a, b in zip(seq, seq[1:]))}
    return out


SNAPCORE_MATRIX = "snap-coredump-tp1"
# (g): the kernels stock cores had named at each concurrency before the matrix was written (its header)
# (32: triton_poi_fused_2/3 as the header writes it; 8: s20's RoPE core, triton_poi_fused_2)
SNAPCORE_KERNELS = {32: ("copy_and_expand_dflash_inputs_kernel", "triton_poi_fused_2", "triton_poi_fused_3"),
                    8: ("fused_sigmoid_gating_delta_rule_update_kernel", "triton_poi_fused_2")}


def _snapshot_runs(df, matrix: str, data_dir: str):
    """The run lines of ``matrix`` in recorded order, each as (line, "stem/run id", its engine's stored schedule
    snapshot files); a run whose engine has no stored snapshot is an error naming it."""
    from . import schedsnap
    from .errors import LabError

    runs = df[df["matrix"] == matrix] if len(df) and "matrix" in df else df.iloc[:0]
    for _, r in runs.sort_values(["gpu_session", "file", "started_at"]).iterrows():
        r = dict(r)
        stem = r["file"][: -len(".jsonl")]
        label = f"{stem}/{r['run_id']}"
        snaps = schedsnap.files_of_run(r, data_dir)
        if not snaps:
            raise LabError(f"{label}: no schedule snapshot stored for this run's engine (data/gpu/{stem}/*.sched/)")
        yield r, label, snaps


def snapcore_test(df, matrix: str = SNAPCORE_MATRIX, data_dir: str = "data"):
    """``matrices/snap-coredump-tp1.yaml``'s predictions, written in its header before the run, per run line: (e) the
    untapped stock engine (schedule snapshot and keep-running core dumps on) crashes; (f) its snapshot's group 7 holds
    s39's stale schedule (:data:`fa3sched.STALE_S39`, padding :data:`fa3sched.PADDING_S37`) on every line; (g) its core
    names one of the kernels stock cores had named at that concurrency (:data:`SNAPCORE_KERNELS`). A run without a
    stored snapshot is an error naming it; a crash without a core is recorded and does not hold (g)."""
    import pandas as pd

    from . import fa3sched
    from .errors import LabError

    rows = []
    for r, label, snaps in _snapshot_runs(df, matrix, data_dir):
        c = int(r["concurrency"])
        if c not in SNAPCORE_KERNELS:
            raise LabError(f"{label}: concurrency {c}: the matrix header predicts a kernel at "
                           f"{' and '.join(map(str, sorted(SNAPCORE_KERNELS)))} only")
        crashed = bool(r["crashed"])
        add = lambda tag, what, pred, meas, held: rows.append(  # noqa: E731
            {"run": label, "gpu_session": r["gpu_session"], "concurrency": c, "instruments": "snapshot, core dumps",
             "prediction": f"{tag} {what}", "predicted": pred, "measured": meas, "held": held})
        add("(e)", "untapped stock crashes", "crash", "crash" if crashed else r["outcome"], crashed)
        snapped = fa3sched.snapshot_schedules(snaps)
        add("(f)", "group 7's schedule at the first served step (snapshot)", fmt_schedule(fa3sched.STALE_S39),
            "; ".join(sorted(fmt_schedule(v) for v in snapped)) or "no group 7 in the snapshot",
            snapped == {fa3sched.STALE_S39})
        kernel = fault_kernel(r)
        add("(g)", "the core's faulting kernel", " or ".join(SNAPCORE_KERNELS[c]),
            kernel or ("no core dump" if crashed else "no crash"), kernel in SNAPCORE_KERNELS[c])
    return pd.DataFrame(rows, columns=PADDING_COLUMNS)


DRAFT8_MATRIX = "draft8-c32-tp1"
#: the target's attention layers that reuse another group's metadata, with the runs' 5-layer draft and the published 8
DRAFT8_REUSING_LAYERS = [7, 15, 23, 31, 39]
DRAFT8_GROUP = 5   # their group with 8 draft layers (kvgroups; tests/test_models.py); 7 with the runs' 5


def _draft_shape(r) -> tuple | None:
    """(layers, KV heads, head_dim) of the draft a run line names (the runner writes it as the line's ``draft``: the
    target's draft in ``models.TARGETS``), else None."""
    d = r.get("draft")
    return (d.get("layers"), d.get("kv_heads"), d.get("head_dim")) if isinstance(d, dict) else None


DRAFT8_PLANNED = {"d8-stock-snap-c32": ("(a)", 3), "d8-fix-c32": ("(d)", 3), "d8-piecewise-c32": ("(e)", 2)}


def _d8_kernel(kernel) -> bool:
    """(c)'s kernels: the DFlash input kernel, or an inductor pointwise kernel of the drafter (the RoPE kernel stock
    cores named at 32 was triton_poi_fused_2 or _3; an 8-layer drafter's graph may number it otherwise)."""
    return kernel == "copy_and_expand_dflash_inputs_kernel" or bool(re.fullmatch(r"triton_poi_fused_\d+", kernel or ""))


def _one_request_reading(v) -> str:
    """A schedule snapshot's buffer ``v`` (trailing zeros dropped) as a 1-request FA3 schedule: its written entries 0, 4
    and 8 beside s39's (:data:`fa3sched.STALE_S39`) and its padding (:func:`fa3sched.padding_1`), or why it is not one.
    Added after draft8-c32-tp1's first run (s70), whose snapshot held s39's written entries with another padding: a
    reading, not one of the matrix's predictions."""
    from . import fa3sched
    from .errors import LabError

    try:
        pad = fa3sched.padding_1(v)
    except LabError as e:
        return f"not a 1-request schedule ({e})"
    full = (list(v) + [0] * 13)[:13]
    written, s39 = (full[0], full[4], full[8]), tuple(fa3sched.STALE_S39[i] for i in (0, 4, 8))
    return (f"written {fmt_schedule(written)} ({'as' if written == s39 else 'not as'} s39's {fmt_schedule(s39)}); "
            f"padding {fmt_schedule(pad)} ({'as' if pad == fa3sched.padding_1(fa3sched.STALE_S39) else 'not as'} s39's)")


def draft8_predictions(df, data_dir: str = "data", matrix: str = DRAFT8_MATRIX):
    """``matrices/draft8-c32-tp1.yaml``'s predictions, written in its header before any run (s69), per run line:
    (0) the line names the published draft's shape (:data:`models.PUBLISHED_DRAFT`: 8 layers, 4 KV heads of 128): what
    the runner built the draft's folder from, not a reading of the engine (for the stock engine (b) is that reading);
    stock (``d8-stock-snap-c32``): (a) crashes, (b) its schedule snapshot's group holding the target's attention
    layers 7, 15, 23, 31, 39 is group 5 and holds :data:`fa3sched.STALE_S39`, (c) its core names the DFlash input
    kernel or a drafter pointwise kernel (:func:`_d8_kernel`); (d) the fix (``d8-fix-c32``) completes with every
    request, in a session where this matrix's stock engine crashed; (e) PIECEWISE (``d8-piecewise-c32``) completes with
    every request. A start-up error or a run the runner's deadline cut measured nothing: its row says so (held None)
    and it needs no snapshot. Per engine, one more row: how many runs it measured of those the header plans
    (:data:`DRAFT8_PLANNED`), held when all. After (b), per stock run, a row "(b, after the run)" added after s70's run
    (:func:`_one_request_reading`): a reading, not a prediction, so its ``held`` is None (as is a row that measured
    nothing). An empty table while the matrix has not run; a measured stock run without its stored snapshot is an error
    naming it."""
    import pandas as pd

    from . import fa3sched, kvgroups, models, schedsnap
    from .errors import LabError

    runs = df[df["matrix"] == matrix] if len(df) and "matrix" in df else df.iloc[:0]
    pub = models.PUBLISHED_DRAFT["shape"]
    want = (pub["layers"], pub["kv_heads"], pub["head_dim"])
    crashed_sessions = {r["gpu_session"] for _, r in runs.iterrows()
                        if r["engine_id"] == "d8-stock-snap-c32" and bool(r["crashed"])}
    rows, measured = [], {}
    for _, r in runs.sort_values(["gpu_session", "file", "started_at"]).iterrows():
        r = dict(r)
        label = f"{r['file'][: -len('.jsonl')]}/{r['run_id']}"
        c = int(r["concurrency"])
        add = lambda tag, what, pred, meas, held: rows.append(  # noqa: E731
            {"run": label, "gpu_session": r["gpu_session"], "concurrency": c, "engine": r["engine_id"],
             "prediction": f"{tag} {what}", "predicted": pred, "measured": meas, "held": held})
        shape = _draft_shape(r)
        add("(0)", "the draft's shape (layers, KV heads, head_dim)", str(want), str(shape), shape == want)
        complete = r["outcome"] == "ok" and int(r.get("requests_completed") or 0) == c
        done = f"{r['outcome']}, {int(r.get('requests_completed') or 0)} of {c} requests"
        if r["engine_id"] not in DRAFT8_PLANNED:
            raise LabError(f"{label}: engine {r['engine_id']!r} is not one of {matrix}'s")
        if r["outcome"] == "startup_error" or analysis.is_deadline_cut(r):
            add(DRAFT8_PLANNED[r["engine_id"]][0], "not judged: the run measured nothing", "-",
                "start-up error" if r["outcome"] == "startup_error" else "cut by the runner's deadline", None)
            continue
        measured[r["engine_id"]] = measured.get(r["engine_id"], 0) + 1
        if r["engine_id"] == "d8-stock-snap-c32":
            add("(a)", "stock crashes", "crash", r["outcome"], bool(r["crashed"]))
            snaps = schedsnap.files_of_run(r, data_dir)
            if not snaps:
                raise LabError(f"{label}: no schedule snapshot stored for this run's engine")
            seen = {(gid, v) for gid, layers, v in fa3sched.snapshot_groups(snaps)
                    if [kvgroups.layer_index(x) for x in layers] == DRAFT8_REUSING_LAYERS}
            add("(b)", "the group of layers 7, 15, 23, 31, 39 at the first served step (snapshot)",
                f"group {DRAFT8_GROUP} holding {fmt_schedule(fa3sched.STALE_S39)}",
                "; ".join(f"group {gid} holding {fmt_schedule(v)}" for gid, v in sorted(seen))
                or "no group of those layers in the snapshot",
                seen == {(DRAFT8_GROUP, fa3sched.STALE_S39)})
            for gid, v in sorted(seen):
                add("(b, after the run)", f"group {gid}'s buffer read as a 1-request schedule: the entries FA3 writes "
                    "(query rows, splits, heads in L2) and the padding it leaves (what the buffer held before)",
                    "not predicted", _one_request_reading(v), None)
            kernel = fault_kernel(r)
            add("(c)", "the core's faulting kernel", "copy_and_expand_dflash_inputs_kernel or triton_poi_fused_N",
                kernel or ("no core dump" if r["crashed"] else "no crash"), _d8_kernel(kernel))
        elif r["engine_id"] == "d8-fix-c32":
            beside = r["gpu_session"] in crashed_sessions
            add("(d)", "the fix completes beside a crashed stock engine of its session",
                f"ok, {c} of {c} requests; stock crashed in the session",
                done + ("; stock crashed in the session" if beside else "; no crashed stock engine in the session"),
                complete and beside)
        else:
            add("(e)", "PIECEWISE completes", f"ok, {c} of {c} requests", done, complete)
    if len(runs):
        for eng, (tag, planned) in DRAFT8_PLANNED.items():
            n = measured.get(eng, 0)
            rows.append({"run": f"{matrix}/{eng}", "gpu_session": ", ".join(sorted({str(x) for x in runs["gpu_session"]})),
                         "concurrency": 32, "engine": eng, "prediction": f"{tag} runs measured of those planned",
                         "predicted": str(planned), "measured": str(n), "held": n >= planned})
    return pd.DataFrame(rows, columns=["run", "gpu_session", "concurrency", "engine", "prediction", "predicted",
                                       "measured", "held"])


DRAFT8_FIX_MATRIX = "draft8-fix-c32-tp1"
DRAFT8_FIX_PLANNED = {"d8f-stock-control-c32": ("(a)", 1), "d8f-fix-c32": ("(b)", 13), "d8f-piecewise-c32": ("(c)", 3)}
DRAFT8_FIX_PAIRS = 3            # (d): the fix's greedy runs, each paired with PIECEWISE's of the same round
DRAFT8_FIX_MIN_IDENTICAL = 30   # (d): of 32 requests, token-identical in each pair
DRAFT8_FIX_ACCEPTANCE = (1.8, 1.9)   # (b): vLLM's mean acceptance length on each fixed run
DRAFT8_FIX_MIN_SHARE = 0.95          # (b): drafts x mean acceptance length / output tokens (drafting throughout)


def _judged_lines(runs, planned: dict, matrix: str, rows: list, measured: dict, order: list):
    """The per-line part every published-draft judge shares: for each run line of ``runs`` (in ``order``) add its (0)
    row (the published draft's shape), list a line that measured nothing (a start-up error, a deadline cut) as not
    judged, count the others per engine in ``measured``, and yield (line, add, concurrency, complete, done) for them:
    ``add(tag, what, predicted, measured, held)`` appends a row of that line. An engine ``planned`` does not name is an
    error."""
    from .errors import LabError

    pub = models_shape()
    for _, r in runs.sort_values(order).iterrows():
        r = dict(r)
        label = f"{r['file'][: -len('.jsonl')]}/{r['run_id']}"
        c = int(r["concurrency"])

        def add(tag, what, pred, meas, held, r=r, label=label):
            rows.append({"run": label, "gpu_session": r["gpu_session"], "engine": r["engine_id"],
                         "prediction": f"{tag} {what}", "predicted": pred, "measured": meas, "held": held})

        if r["engine_id"] not in planned:
            raise LabError(f"{label}: engine {r['engine_id']!r} is not one of {matrix}'s")
        shape = _draft_shape(r)
        add("(0)", "the draft's shape (layers, KV heads, head_dim)", str(pub), str(shape), shape == pub)
        if r["outcome"] == "startup_error" or analysis.is_deadline_cut(r):
            add(planned[r["engine_id"]][0], "not judged: the run measured nothing", "-",
                "start-up error" if r["outcome"] == "startup_error" else "cut by the runner's deadline", None)
            continue
        measured[r["engine_id"]] = measured.get(r["engine_id"], 0) + 1
        done = f"{r['outcome']}, {int(r.get('requests_completed') or 0)} of {c} requests"
        yield r, add, c, r["outcome"] == "ok" and int(r.get("requests_completed") or 0) == c, done


def _planned_rows(runs, planned: dict, matrix: str, rows: list, measured: dict, pairs: tuple) -> str:
    """The judges' closing rows: per engine, runs measured of those planned, then greedy pairs measured of those
    planned (``pairs``: tag, engine, planned, measured). Returns the sessions' label they carry."""
    sessions = ", ".join(sorted({str(x) for x in runs["gpu_session"]}, key=analysis.session_key))
    for eng, (tag, want) in planned.items():
        n = measured.get(eng, 0)
        rows.append({"run": f"{matrix}/{eng}", "gpu_session": sessions, "engine": eng,
                     "prediction": f"{tag} runs measured of those planned", "predicted": str(want),
                     "measured": str(n), "held": n >= want})
    tag, eng, want, n = pairs
    rows.append({"run": f"{matrix}/greedy pairs", "gpu_session": sessions, "engine": eng,
                 "prediction": f"{tag} greedy pairs measured of those planned", "predicted": str(want),
                 "measured": str(n), "held": n >= want})
    return sessions


def draft8_fix_predictions(df, matrix: str = DRAFT8_FIX_MATRIX):
    """``matrices/draft8-fix-c32-tp1.yaml``'s predictions, written in its header before any run (s71), judged per run
    line: (0) the published draft's shape; (a) the stock control crashes, its core naming the DFlash input kernel or a
    drafter pointwise kernel; (b) every fixed run completes all its requests with a mean acceptance length of 1.8-1.9
    and drafting steps giving at least 95% of its output (:func:`discriminate.drafting_share`);
    (c) PIECEWISE completes; (d) each greedy pair (:func:`output_agreement`, same session, round and temperature) has at
    least 30 of 32 requests token-identical; then the planned counts, and the fix-claim standard's row (at least 10
    fixed runs, every fixed run of the session complete, in a session whose stock control crashed; not a prediction
    of the header, the standard it serves). Runs that measured nothing (a start-up error, a deadline cut) are listed, not judged. Needs
    the published draft's lines (``analysis.load_runs(published_draft=True)``)."""
    import pandas as pd

    from . import discriminate

    cols = ["run", "gpu_session", "engine", "prediction", "predicted", "measured", "held"]
    runs = df[df["matrix"] == matrix] if len(df) and "matrix" in df else df.iloc[:0]
    if not len(runs):
        return pd.DataFrame(columns=cols)
    lo, hi = DRAFT8_FIX_ACCEPTANCE
    stock_crashed = {r["gpu_session"] for _, r in runs.iterrows()
                     if r["engine_id"] == "d8f-stock-control-c32" and bool(r["crashed"])}
    rows, measured, fixed_ok = [], {}, {}
    for r, add, c, complete, done in _judged_lines(runs, DRAFT8_FIX_PLANNED, matrix, rows, measured,
                                                   ["gpu_session", "file", "started_at"]):
        if r["engine_id"] == "d8f-stock-control-c32":
            kernel = fault_kernel(r)
            add("(a)", "the stock control crashes, its core naming the DFlash input kernel or triton_poi_fused_N",
                "crash; copy_and_expand_dflash_inputs_kernel or triton_poi_fused_N",
                f"{r['outcome']}; " + (kernel or ("no core dump" if r["crashed"] else "no crash")),
                bool(r["crashed"]) and _d8_kernel(kernel))
        elif r["engine_id"] == "d8f-fix-c32":
            m = r.get("spec_decode_metrics") if isinstance(r.get("spec_decode_metrics"), dict) else {}
            acc, share = m.get("acceptance_length"), discriminate.drafting_share(r)
            drafting = (acc is not None and lo <= float(acc) <= hi and share is not None
                        and share >= DRAFT8_FIX_MIN_SHARE)
            add("(b)", "the fix completes, drafting throughout",
                f"ok, {c} of {c} requests; mean acceptance length {lo}-{hi}; drafting steps' output >= "
                f"{DRAFT8_FIX_MIN_SHARE:.0%}",
                done + (f"; mean acceptance length {float(acc):.3f}" if acc is not None else "; no spec-decode counters")
                + (f"; drafting steps' output {share:.1%}" if share is not None else ""),
                complete and drafting)
            ok, other = fixed_ok.get(r["gpu_session"], (0, 0))
            fixed_ok[r["gpu_session"]] = (ok + complete, other + (not complete))
        else:
            add("(c)", "PIECEWISE completes", f"ok, {c} of {c} requests", done, complete)
    pairs = 0
    for session in sorted(set(runs["gpu_session"]), key=analysis.session_key):
        ag = output_agreement(runs, session)
        for _, a in ag.iterrows():
            pairs += 1
            same, n = (int(v) for v in a["identical requests"].split("/"))
            rows.append({"run": f"{a['run']} vs {a['reference run']}", "gpu_session": session, "engine": "d8f-fix-c32",
                         "prediction": "(d) the greedy pair's token-identical requests",
                         "predicted": f">= {DRAFT8_FIX_MIN_IDENTICAL} of 32", "measured": a["identical requests"],
                         "held": n == 32 and same >= DRAFT8_FIX_MIN_IDENTICAL})
    sessions = _planned_rows(runs, DRAFT8_FIX_PLANNED, matrix, rows, measured,
                             ("(d)", "d8f-fix-c32", DRAFT8_FIX_PAIRS, pairs))
    # the standard: in one session whose stock control crashed, at least 10 fixed runs, every one complete (a crash,
    # a hang or a request short counts against it; a start-up error or a deadline cut measured nothing)
    met = {x: fixed_ok.get(x, (0, 0)) for x in stock_crashed}
    best = max(sorted(met, key=analysis.session_key), key=lambda x: (met[x][1] == 0, met[x][0]), default=None)
    ok, other = met[best] if best else (0, 0)
    rows.append({"run": f"{matrix}/the standard", "gpu_session": best or sessions, "engine": "d8f-fix-c32",
                 "prediction": "(standard) fixed runs in a session whose stock control crashed",
                 "predicted": ">= 10 completed, 0 not completed",
                 "measured": f"{ok} completed, {other} not completed" if best else "no session with a crashed stock control",
                 "held": ok >= 10 and other == 0})
    return pd.DataFrame(rows, columns=cols)


DRAFT8_PROBE_MATRIX = "draft8-probe-c32-tp1"
DRAFT8_PROBE_PLANNED = {"d8p-stock-probe-c32": ("(a)", 1), "d8p-fix-probe-c32": ("(b)", 1),
                        "d8p-fix-greedy-c32": ("(c)", 3), "d8p-piecewise-greedy-c32": ("(c)", 3)}
DRAFT8_PROBE_STOCK_LAYERS = ("L7 attn", "L8 gdn")   # (a): last written identically, first written differently
DRAFT8_PROBE_MIN_FULL = 200     # (b): FULL steps the fix's probe compared
DRAFT8_PROBE_MAX_DRAFT_GAP = 1  # (c): vLLM's draft counts of a pair's two runs (the synthetic draws alike)


def draft8_probe_predictions(df, probes=None, matrix: str = DRAFT8_PROBE_MATRIX):
    """``matrices/draft8-probe-c32-tp1.yaml``'s predictions, written in its header before any run (s72), judged from
    its run lines and their step-probe logs (``probes``: :func:`probe_table` of the published draft's lines; read from
    data/gpu when None):
    (0) the published draft's shape on every line;
    (a) stock, probed: its first diverging step is its first FULL step, the last layer written identically there and
        the first written differently :data:`DRAFT8_PROBE_STOCK_LAYERS`, and the run did not complete or its probe
        recorded a first NaN step;
    (b) the fix, probed: all 32 requests completed, at least :data:`DRAFT8_PROBE_MIN_FULL` FULL steps compared, none
        diverging, none ended by an error, the largest output difference 0.0;
    (c) the greedy pair (:func:`output_agreement`, round by round): both engines complete every round, each pair's
        draft counts at most :data:`DRAFT8_PROBE_MAX_DRAFT_GAP` apart, each pair at least
        :data:`DRAFT8_FIX_MIN_IDENTICAL` of 32 requests token-identical;
    then the planned counts. A probed engine without its probe log is judged False (the probe is what it measures).
    Runs that measured nothing (a start-up error, a deadline cut) are listed, not judged. Needs the published draft's
    lines (``analysis.load_runs(published_draft=True)``)."""
    import math

    import pandas as pd

    cols = ["run", "gpu_session", "engine", "prediction", "predicted", "measured", "held"]
    runs = df[df["matrix"] == matrix] if len(df) and "matrix" in df else df.iloc[:0]
    if not len(runs):
        return pd.DataFrame(columns=cols)
    if probes is None:
        probes = probe_table(runs, sessions=sorted({f[: -len(".jsonl")] for f in runs["file"]}))
    rows, measured = [], {}
    for r, add, c, complete, done in _judged_lines(runs, DRAFT8_PROBE_PLANNED, matrix, rows, measured,
                                                   ["gpu_session", "file", "engine_id", "round"]):
        if r["engine_id"] in ("d8p-stock-probe-c32", "d8p-fix-probe-c32"):
            p = probes[(probes["session"] == r["file"][: -len(".jsonl")])
                       & (probes["engine"] == f"{r['engine_id']}.a{int(r['attempt'])}")] if len(probes) else probes
            if not len(p):
                add("(a)" if "stock" in r["engine_id"] else "(b)", "the step probe's log", "recorded",
                    f"{done}; no probe log", False)
                continue
            p = p.iloc[0]
            num = lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else v   # noqa: E731
            if r["engine_id"] == "d8p-stock-probe-c32":
                first, fd = num(p["first FULL step"]), num(p["first diverging step"])
                layers = (p["last layer written identically"], p["first layer written differently"])
                nan = num(p["first NaN step"])
                add("(a)", "stock diverges from its first FULL step at the reusing layer, and crashes or turns NaN",
                    f"first diverging step = first FULL step; {' / '.join(DRAFT8_PROBE_STOCK_LAYERS)}; not ok or a NaN step",
                    f"first FULL step {first}, first diverging {fd}; {layers[0]} / {layers[1]}; {done}"
                    + (f", first NaN step {int(nan)}" if nan is not None else ", no NaN step"),
                    first is not None and fd == first and tuple(layers) == DRAFT8_PROBE_STOCK_LAYERS
                    and (r["outcome"] != "ok" or nan is not None))
            else:
                full, div, err = int(p["FULL steps"]), int(p["FULL steps diverging"]), int(p["FULL steps ended by an error"])
                mx = num(p["max |output diff|"])
                add("(b)", "the fix completes, its FULL steps identical to the no-graph pass",
                    f"ok, {c} of {c} requests; >= {DRAFT8_PROBE_MIN_FULL} FULL steps, 0 diverging, 0 ended by an "
                    "error, max |output diff| 0.0",
                    f"{done}; {full} FULL steps, {div} diverging, {err} ended by an error, max |output diff| {mx}",
                    complete and full >= DRAFT8_PROBE_MIN_FULL and div == 0 and err == 0 and mx == 0.0)
        else:
            add("(c)", "the greedy engine completes", f"ok, {c} of {c} requests", done, complete)
    pairs = 0
    for session in sorted(set(runs["gpu_session"]), key=analysis.session_key):
        ev = pair_evidence(runs, session)
        for _, a in ev.iterrows():
            pairs += 1
            same, n = (int(v) for v in a["identical requests"].split("/"))
            fx, ref = a["drafts (FULL)"], a["drafts (reference)"]
            gap = abs(int(fx) - int(ref)) if fx is not None and ref is not None and fx == fx and ref == ref else None
            base = {"run": f"{a['run']} vs {a['reference run']}", "gpu_session": session, "engine": "d8p-fix-greedy-c32"}
            rows.append({**base, "prediction": "(c) the pair drew alike (draft counts)",
                         "predicted": f"at most {DRAFT8_PROBE_MAX_DRAFT_GAP} apart", "measured": f"{fx}, {ref}",
                         "held": gap is not None and gap <= DRAFT8_PROBE_MAX_DRAFT_GAP})
            rows.append({**base, "prediction": "(c) the greedy pair's token-identical requests",
                         "predicted": f">= {DRAFT8_FIX_MIN_IDENTICAL} of 32", "measured": a["identical requests"],
                         "held": n == 32 and same >= DRAFT8_FIX_MIN_IDENTICAL})
    _planned_rows(runs, DRAFT8_PROBE_PLANNED, matrix, rows, measured,
                  ("(c)", "d8p-fix-greedy-c32", DRAFT8_PROBE_PLANNED["d8p-fix-greedy-c32"][1], pairs))
    return pd.DataFrame(rows, columns=cols)


def models_shape() -> tuple:
    """(layers, KV heads, head_dim) of the published draft (``models.PUBLISHED_DRAFT``)."""
    from . import models

    pub = models.PUBLISHED_DRAFT["shape"]
    return (pub["layers"], pub["kv_heads"], pub["head_dim"])


def draft8_snapshots(df, matrix: str = DRAFT8_MATRIX, data_dir: str = "data"):
    """Every FlashAttention group's persistent FA3 schedule in each measured stock engine's snapshot of ``matrix``
    (first served step), one row per (run, group): its target layers and the buffer as :func:`fmt_schedule` writes it.
    Tells whether the padding s70 met is one engine's leftovers or the same in every engine and group. A measured
    stock run without its stored snapshot is an error naming it."""
    import pandas as pd

    from . import fa3sched, kvgroups, schedsnap
    from .errors import LabError

    runs = df[df["matrix"] == matrix] if len(df) and "matrix" in df else df.iloc[:0]
    rows = []
    for _, r in runs.sort_values(["gpu_session", "file", "started_at"]).iterrows():
        r = dict(r)
        if r["engine_id"] != "d8-stock-snap-c32" or r["outcome"] == "startup_error" or analysis.is_deadline_cut(r):
            continue
        label = f"{r['file'][: -len('.jsonl')]}/{r['run_id']}"
        snaps = schedsnap.files_of_run(r, data_dir)
        if not snaps:
            raise LabError(f"{label}: no schedule snapshot stored for this run's engine")
        for gid, layers, v in fa3sched.snapshot_groups(snaps):
            # the target's layers are named under language_model., the drafter's (numbered on from 40) are not
            whose = "target" if all(x.startswith("language_model.") for x in layers) else "draft"
            rows.append({"run": label, "gpu_session": r["gpu_session"], "group": gid,
                         "layers": f"{whose} " + ", ".join(str(kvgroups.layer_index(x)) for x in layers),
                         "buffer": fmt_schedule(v)})
    return pd.DataFrame(rows, columns=["run", "gpu_session", "group", "layers", "buffer"])


def draft8_work(df, matrix: str = DRAFT8_MATRIX):
    """Did each completed run of ``matrix`` do a spec-decode run's work? One row per measured run: requests completed,
    output tokens, drafts, mean acceptance length and wall time, from the run line (vLLM's own counters); crashed runs
    with what they have (their counters never came back)."""
    import pandas as pd

    runs = df[df["matrix"] == matrix] if len(df) and "matrix" in df else df.iloc[:0]
    rows = []
    for _, r in runs.sort_values(["gpu_session", "file", "started_at"]).iterrows():
        r = dict(r)
        if r["outcome"] == "startup_error" or analysis.is_deadline_cut(r):
            continue
        m = r.get("spec_decode_metrics") if isinstance(r.get("spec_decode_metrics"), dict) else {}
        acc = m.get("acceptance_length")
        rows.append({"run": f"{r['file'][: -len('.jsonl')]}/{r['run_id']}", "gpu_session": r["gpu_session"],
                     "engine": r["engine_id"], "outcome": r["outcome"],
                     "requests completed": f"{int(r.get('requests_completed') or 0)} of {int(r['concurrency'])}",
                     "output tokens": int(r["output_tokens"]) if pd.notna(r.get("output_tokens")) else None,
                     "drafts": int(m["num_drafts"]) if m.get("num_drafts") is not None else None,
                     "mean acceptance length": round(float(acc), 3) if acc is not None else None,
                     "wall s": round(float(r["wall_s"]), 1)})
    return pd.DataFrame(rows, columns=["run", "gpu_session", "engine", "outcome", "requests completed", "output tokens",
                                       "drafts", "mean acceptance length", "wall s"])


def padding_test(df, probes, probe_of, matrix: str = PADDING_MATRIX, b: int = 8, data_dir: str = "data"):
    """``matrices/probe-padding-tp1.yaml``'s predictions, written in its header before the run, checked per run line:
    (a) a stock sentinel probe without the build ledger reads group 7's stale 1-request schedule with the padding
    s36 and s37 recorded (:data:`fa3sched.PADDING_S37`), leaves requests 1..b-1 unwritten on FULL steps of ``b``
    requests, and completes; (b) with the ledger, s38's padding (:data:`fa3sched.PADDING_S38`), requests 4-7 of 8,
    completes; (c) in both, the engine's schedule snapshot (first served step) equals every stale schedule the probe
    read; (d) an untapped, unprobed stock engine crashes, and its snapshot's group-7 padding is recorded without a
    prediction (``held`` None). A run line whose probe log or snapshot is missing is an error naming it: a prediction
    without its measurement would read as not held."""
    import pandas as pd

    from . import fa3sched
    from .errors import LabError

    expect = {False: ("(a)", fa3sched.PADDING_S37, list(range(1, b))),
              True: ("(b)", fa3sched.PADDING_S38, [4, 5, 6, 7])}
    rows = []
    for r, label, snaps in _snapshot_runs(df, matrix, data_dir):
        stem = r["file"][: -len(".jsonl")]
        crashed = bool(r["crashed"])
        row = lambda tag, what, pred, meas, held, inst: rows.append(  # noqa: E731
            {"run": label, "gpu_session": r["gpu_session"], "concurrency": int(r["concurrency"]), "instruments": inst,
             "prediction": f"{tag} {what}", "predicted": pred, "measured": meas, "held": held})
        if r.get("probe") is not True:
            row("(d)", "untapped stock crashes", "crash", "crash" if crashed else r["outcome"], crashed, "snapshot")
            snapped = fa3sched.snapshot_schedules(snaps)
            pads = set()
            for v in snapped:
                try:
                    pads.add(fmt_schedule(fa3sched.padding_1(v)))
                except LabError:
                    pads.add(f"not a 1-request schedule: {fmt_schedule(v[:13])}")
            row("(d)", "group 7's padding at the first served step (snapshot)", "no prediction",
                "; ".join(sorted(pads)) or "no group 7 in the snapshot", None, "snapshot")
            continue
        ledger = r.get("probe_ledger")
        if not isinstance(ledger, bool):
            raise LabError(f"{label}: probed, but its line does not say whether the build ledger ran (probe_ledger)")
        engine = f"{r['engine_id']}.a{r['attempt']}"
        p = probes[(probes["session"] == stem) & (probes["engine"] == engine)]
        if len(p) != 1:
            raise LabError(f"{label}: {len(p)} probe logs of engine {engine} (expected 1)")
        m = fa3sched.padding_measured(probe_of(p["path"].iloc[0]), snaps, b)
        tag, pad, unw = expect[ledger]
        held_pad, held_unw, held_snap = fa3sched.padding_verdicts(m, pad, unw, b).values()
        inst = f"sentinel taps, {ledger_label(ledger)}, snapshot"
        row(tag, "completes", "ok", "crash" if crashed else r["outcome"], r["outcome"] == "ok" and not crashed, inst)
        row(tag, "group 7's stale schedule: padding on every read", fmt_schedule(pad),
            "; ".join(sorted(fmt_schedule(x) if x is not None else "not a 1-request schedule" for x in m["paddings"]))
            or "no stale read", held_pad, inst)
        row(tag, f"requests left unwritten at {b}, every FULL step of {b}", str(unw),
            "; ".join(sorted(m["unwritten"])) or f"no FULL step of {b}", held_unw, inst)
        stale = m["stale schedules"]
        row("(c)", "snapshot equals every stale read", "equal",
            f"{len(stale & m['snapshots'])} of {len(stale)} distinct stale schedules in the snapshot", held_snap, inst)
    return pd.DataFrame(rows, columns=PADDING_COLUMNS)


ADMIT_MATRIX = "probe-admit-tp1"
# the first NaN site each admission count was predicted to give at 28 (s46's header, before the runs): step, layer
# (divergence.short), requests; K=28 was run with no prediction
ADMIT_PREDICTED = {7: (10, "L23 attn", [14, 17, 21, 24]), 1: (11, "L23 attn", list(range(14, 28)))}


def admit_predictions(df, sites, t, probe_of):
    """The runs of ``probe-admit-tp1`` (s46), each against what its matrix header predicted before the run. ``sites``:
    :func:`first_site_runs` (its first NaN site); ``t``: :func:`oor_table` (outcome, row-0 step, last step);
    ``probe_of``: path -> probe log.

    - every run: the gate did what it was set to, read from the probe, not from the setting: the first step held K
      requests (``first step requests``) and the second all of the run's (``second step requests``);
    - K in :data:`ADMIT_PREDICTED`: the first NaN site is the one predicted (step, layer, requests), the run crashed,
      and its last recorded step is its first row-0 step.

    ``held``: all of that (None for a K with no prediction, whose gate check is ``gate as set``)."""
    import pandas as pd

    x = t[t["matrix"] == ADMIT_MATRIX]
    by_probe = {str(p): r for p, r in zip(sites["probe"], sites.to_dict("records"))} if len(sites) else {}
    out = []
    for _, r in x.iterrows():
        runs = probe_runs(df, r["session"], r["engine"])
        ks = {int(v) for v in runs.get("first_step_requests", pd.Series(dtype=object)).dropna()}
        if len(ks) != 1:
            raise LabError(f"{ADMIT_MATRIX}, {r['engine']}: run lines with first_step_requests {sorted(ks)}; "
                           "the check needs exactly one")
        k = ks.pop()
        steps = probe_of(r["path"])["steps"]
        first = steps[0].get("num_reqs") if steps else None
        second = steps[1].get("num_reqs") if len(steps) > 1 else None
        gate = first == k and second is not None and int(second) == int(r["concurrency"])
        site = by_probe.get(f"{r['session']}/{r['engine']}")
        got = (None if site is None or pd.isna(site["first NaN step"]) else
               (int(site["first NaN step"]), site["first NaN layer"], list(site["NaN requests"] or [])))
        pred = ADMIT_PREDICTED.get(k)
        at = (not pd.isna(r["row-0 step"])) and r["row-0 step"] == r["last step"]
        site_ok = None if pred is None else got == pred
        held = None if pred is None else bool(gate and site_ok and r["outcome"] == "crash" and at)
        out.append({"session": r["session"], "engine": r["engine"], "gpu_session": r["gpu_session"],
                    "concurrency": r["concurrency"],
                    "first step set": k, "first step requests": first, "second step requests": second,
                    "gate as set": bool(gate),
                    "predicted site": None if pred is None else f"step {pred[0]}, {pred[1]}, requests {pred[2]}",
                    "site": None if got is None else f"step {got[0]}, {got[1]}, requests {got[2]}",
                    "first NaN step": None if got is None else got[0], "site as predicted": site_ok,
                    "outcome": r["outcome"], "row-0 step": r["row-0 step"], "last step": r["last step"],
                    "at row-0 step": bool(at), "held": held})
    cols = ["session", "engine", "gpu_session", "concurrency", "first step set", "first step requests", "second step requests",
            "gate as set", "predicted site", "site", "first NaN step", "site as predicted", "outcome", "row-0 step",
            "last step", "at row-0 step", "held"]
    res = pd.DataFrame(out, columns=cols).sort_values(["session", "engine"], kind="stable").reset_index(drop=True)
    for c in ("first step requests", "second step requests", "first NaN step"):
        res[c] = res[c].astype("Int64")
    return res


def plot_admission(ax, sites, concurrency: int = 28):
    """Each stock plain-tap run of :func:`first_site_runs` at ``concurrency``: how many requests its first step admitted
    (x, log scale) against its first NaN step (y), hollow where arrival timing set that count and filled where the
    admission gate did; runs at one point are spread sideways a little, so each run is one marker. The title counts
    the runs and those with ids replaced or the build ledger off."""
    import numpy as np

    x = sites[(sites["concurrency"] == concurrency) & sites["first NaN step"].notna()
              & sites["first step requests"].notna()]
    if not len(x):
        raise LabError(f"no plain-tap stock run with a first NaN step at concurrency {concurrency} to plot")
    for gated, g in x.groupby(x["first step set"] != "arrival"):
        for (k, st), h in g.groupby(["first step requests", "first NaN step"]):
            spread = np.linspace(-0.06, 0.06, len(h)) if len(h) > 1 else np.zeros(1)
            ax.scatter(int(k) * np.exp(spread + (0.1 if gated else -0.1)), [int(st)] * len(h), s=36,
                       facecolors="tab:blue" if gated else "none", edgecolors="tab:blue" if gated else "tab:orange")
    ax.scatter([], [], facecolors="none", edgecolors="tab:orange", label="first step as requests arrived (s42-s45)")
    ax.scatter([], [], facecolors="tab:blue", edgecolors="tab:blue", label="first step set by the admission gate (s46)")
    ax.set_xscale("log")
    ks = sorted({int(v) for v in x["first step requests"]})
    ax.set_xticks(ks)
    ax.set_xticklabels([str(k) for k in ks])
    steps = sorted({int(v) for v in x["first NaN step"]})
    ax.set_yticks(range(min(steps) - 1, max(steps) + 2))
    ax.set_xlabel("requests the first (prefill) step admitted")
    ax.set_ylabel("first NaN step")
    extra = []
    if "ids replaced in" in x:
        extra.append(f"{int((x['ids replaced in'] != 'none').sum())} with ids replaced after the first NaN")
    if "build ledger" in x:
        extra.append(f"{int((x['build ledger'] == 'ledger off').sum())} ledger-off")
    ax.set_title(f"concurrency {concurrency}: {len(x)} stock plain-tap runs" + (f" ({', '.join(extra)})" if extra else ""),
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    return ax


DIFF_MATRIX = "verify-diff-tp1"
DIFF_CONTROLS_MATRIX = "verify-diff-controls-tp1"
DIFF_SERVER_MATRIX = "verify-diff-server-tp1"
DIFF_REST_MATRIX = "verify-diff-rest-tp1"
DIFF_CHECK_LINE = "vLLM with the upstream diff"   # what vllmdiff.check_loaded prints in each engine process


def diff_check_processes(r) -> int:
    """How many processes of a run's engine logged the overlay check (vllmdiff.check_loaded): each is a process that
    imported vLLM from the diff's overlay and found the diff's files as stamped. 0 when the log is not recorded."""
    log = analysis.engine_log(r)
    if log is None:
        return 0
    pids = re.findall(r"dflash-lab \[(\d+)\]: " + re.escape(DIFF_CHECK_LINE), analysis.read_text(log))
    return len(set(pids))


def fault_kernel(r):
    """The faulting kernel a run line's core dump named, else None."""
    f = r.get("fault")
    return f.get("kernel") if isinstance(f, dict) else None


def log_assert_text(r) -> str | None:
    """The device asserts a run's stored engine log printed, as :func:`analysis.assert_text` writes them; None when the
    log is not recorded, "" when it printed none."""
    log = analysis.engine_log(r)
    if log is None:
        return None
    return analysis.assert_text(analysis.log_asserts(log))


def _crash_with_core(what: str, sel) -> tuple:
    """(predicted, measured, held) of "``what``: crashes, its core names a kernel" over the run lines ``sel``. A crash
    whose core named nothing is measured with the runner's reason and the device asserts its engine log printed
    (the other evidence of where it faulted)."""
    ks = [fault_kernel(r) for _, r in sel.iterrows()]
    notes = []
    for _, r in sel[sel["crashed"]].iterrows():
        if fault_kernel(r):
            continue
        f = r.get("fault") if isinstance(r.get("fault"), dict) else {}
        asserts = log_assert_text(r)
        notes.append(f"{r['run_id']}: {f.get('error') or 'no core read'}; error line "
                     f"'{str(r.get('error') or '-')[:60]}'; engine log's device asserts: "
                     + (asserts if asserts else "none" if asserts == "" else "log not recorded"))
    return (f"{what}: crashes, its core names a kernel",
            f"{int(sel['crashed'].sum())} of {len(sel)} crashed; core: {', '.join(str(k) for k in ks) or '-'}"
            + "".join(f" ({n})" for n in notes),
            bool(len(sel) >= 1 and sel["crashed"].all() and all(ks)))


def _probe_prediction(p, what: str) -> tuple:
    """(predicted, measured, held) of "``what``: completes, every FULL step identical to the no-graph pass" over the
    probe-table rows ``p`` (one row expected): held None when there is none (the probe has not run)."""
    import pandas as pd

    pred = f"{what}: completes, every FULL step identical to the no-graph pass"
    if not len(p):
        return pred, "not run yet (no probe log)", None
    if len(p) != 1:
        return pred, f"{len(p)} probe logs", False
    q = p.iloc[0]
    return (pred,
            f"runs ok {q['runs ok / runs']}; {q['FULL steps diverging']} of {q['FULL steps']} FULL steps diverging "
            f"(up to {q['max requests in a FULL step']} requests), largest difference {q['max |output diff|']}, "
            f"first NaN step {q['first NaN step'] if pd.notna(q['first NaN step']) else 'none'}, "
            f"{q['violations']} canary violations",
            bool(q["runs ok / runs"] == "1/1" and q["FULL steps"] > 0 and q["FULL steps diverging"] == 0
                 and q["max |output diff|"] == 0 and pd.isna(q["first NaN step"])))


def _diff_integrity(diffed, diff_text: str) -> list[tuple]:
    """(predicted, measured, held) rows that the diff's runs ran the committed diff's code: every process of every
    run (the API process or offline driver, and the engine core: 2) logged the overlay check, and the runs' overlay
    stamps name the hunks of ``diff_text``."""
    from .vllmdiff import hunks_sha256

    procs = [diff_check_processes(r) for _, r in diffed.iterrows()]
    stamps = {r["vllm_diff_stamp"]["hunks_sha256"] for _, r in diffed.iterrows()
              if isinstance(r.get("vllm_diff_stamp"), dict)}
    want = hunks_sha256(diff_text)
    return [("every diff engine's processes imported the overlay and checked it (API process and engine core: 2)",
             f"processes with the check per run: {sorted(set(procs))}", bool(len(procs) > 0 and min(procs) >= 2)),
            ("the runs' overlay holds the committed diff's hunks",
             f"stamped {sorted(x[:12] for x in stamps)}, committed {want[:12]}", stamps == {want})]


def diff_predictions(df, probes, diff_text: str):
    """``verify-diff-tp1`` (s47) and its controls against what their headers predicted before the runs, one row per
    prediction: ``kind`` ("pre-registered": in the header before the runs; "integrity check": that the instrument did what
    it says, written after), ``predicted``, ``measured``, ``held``. ``probes``: :func:`probe_table`; ``diff_text``: the committed
    diff, whose hunks the runs' overlay stamps must name (the runs tested this diff's code, whatever its header says).

    (a) the stock control at 32 crashed, its core naming a kernel; (b) the diff's engine completed 10 of 10 at 32,
    3 of 3 at 8 and 3 of 3 at 20, every one of its engine processes having checked the overlay; (c) under the step
    probe at 8 it completed and none of its FULL steps differed from the no-graph pass (largest difference 0, no NaN);
    the controls at 8 and 20 crashed, each core naming a kernel. Raises when a matrix has no lines."""
    import pandas as pd

    d = df[df["matrix"] == DIFF_MATRIX]
    c = df[df["matrix"] == DIFF_CONTROLS_MATRIX]
    if not len(d):
        raise LabError(f"no run lines of {DIFF_MATRIX} in the data")
    rows = []

    def add(pred, measured, held, kind="pre-registered"):
        rows.append({"kind": kind, "predicted": pred, "measured": measured, "held": bool(held)})

    for what, sel, conc in (("(a) stock control", d[d["engine_id"] == "stock-control"], 32),
                            ("control", c[c["engine_id"] == "stock-control-c20"], 20),
                            ("control", c[c["engine_id"] == "stock-control-c8"], 8)):
        add(*_crash_with_core(f"{what}, stock at {conc}", sel))
    runs = d[(d["engine_id"] == "diff-c32")]
    for conc, need in ((32, 10), (8, 3), (20, 3)):
        g = runs[runs["concurrency"] == conc]
        ok = int((g["outcome"] == "ok").sum())
        add(f"(b) the diff at {conc}: completes {need} of {need}", f"{ok} of {len(g)} completed",
            len(g) == need and ok == need)
    # the header predicted the check in the engine log; that every process of every run logged it is stricter, and
    # was written after the runs: an integrity check of the instrument, like the stamp, not a prediction
    for row in _diff_integrity(d[d["fix_via"] == "upstream diff"], diff_text):
        add(*row, "integrity check")
    p = probes[(probes["gpu_session"].isin(set(d["gpu_session"]))) & (probes["fix"].str.startswith("upstream diff"))]
    pred, measured, held = _probe_prediction(p, "(c) the diff under the step probe at 8")
    add(pred, measured, bool(held))   # s47 ran it: a missing probe log here is a failure, not a run to come
    return pd.DataFrame(rows, columns=["kind", "predicted", "measured", "held"])


def _clients_clean(r) -> bool:
    """Every one of a server run's requests came back HTTP 200, none failed, each with all its tokens, and the server
    was alive after the run."""
    st = r.get("http_statuses")
    st = list(st) if isinstance(st, (list, tuple)) else []
    conc, mt = int(r["concurrency"]), r.get("max_tokens")
    return bool(len(st) == conc and set(st) == {200} and r.get("requests_failed") == 0
                and r.get("requests_completed") == conc and r.get("output_tokens") == conc * mt
                and r.get("server_alive") is True)


def clients_saw_stream_error(r) -> bool:
    """A crashed server run's failed requests all got HTTP 200 and then an in-stream error event (what s19's did)."""
    e = r.get("request_errors")
    if not isinstance(e, dict) or not e.get("failed"):
        return False
    n = e["failed"]
    return e.get("by_kind") == {"stream_error_event": n} and e.get("by_status") == {"200": n}


def server_runs(d):
    """One row per server run line of ``d``, what a reader of the report checks first: ``vLLM`` ("stock" or "upstream
    diff"), synthetic acceptance, concurrency, outcome, the clients' HTTP statuses (status: count) and errors (kind:
    count), requests completed and failed, output tokens, vLLM's counted acceptance length, and the core dump's
    faulting kernel (crashes)."""
    import pandas as pd

    cols = ["run", "vLLM", "synthetic acceptance", "concurrency", "outcome", "HTTP statuses", "client errors",
            "requests completed", "requests failed", "output tokens", "counted acceptance", "core: faulting kernel"]
    rows = []
    for _, r in d[d["mode"] == "server"].iterrows():
        st = r.get("http_statuses")
        st = list(st) if isinstance(st, (list, tuple)) else []
        err = r.get("request_errors") if isinstance(r.get("request_errors"), dict) else {}
        sd = r.get("spec_decode_metrics") if isinstance(r.get("spec_decode_metrics"), dict) else {}
        L = sd.get("acceptance_length")
        rows.append(dict(zip(cols, (
            r["run_id"], "upstream diff" if analysis.diff_of(r) else "stock" if r.get("fix") is not True else "plugin fix",
            r.get("acceptance"), int(r["concurrency"]), r["outcome"],
            ", ".join(f"{k}: {st.count(k)}" for k in sorted(set(st))) or "-",
            ", ".join(f"{k}: {v}" for k, v in (err.get("by_kind") or {}).items()) or "-",
            r.get("requests_completed"), r.get("requests_failed"), r.get("output_tokens"),
            f"{L:.3f}" if isinstance(L, (int, float)) else "-", fault_kernel(r) or "-"))))
    t = pd.DataFrame(rows, columns=cols)
    for c in ("requests completed", "requests failed", "output tokens"):   # counts, not floats (pandas' NaN-able ints)
        t[c] = pd.array([None if x is None or x != x else int(x) for x in t[c]], dtype="Int64")
    return t


def diff_server_predictions(df, diff_text: str):
    """``verify-diff-server-tp1`` (s48: the upstream diff on the OpenAI server, the report's path) against what its
    header predicted before the runs, one row per prediction, as :func:`diff_predictions`: (a) the stock server at 32
    crashes, its core names a kernel, its clients see HTTP 200 then an in-stream error; (b) the diff's server completes
    10 of 10 at 32, 3 of 3 at 8 and at 20, every request HTTP 200 with all its tokens and the server alive, no run
    counting below the schedule; (c) the stock server crashes at 8 and at 20, each core naming a kernel; (d) at
    synthetic acceptance 6.0 and 8 the diff counts exactly 6.000 in 3 of 3 and stock below 6 in 3 of 3, both
    completing. Then the two integrity checks of :func:`_diff_integrity`. Raises when the matrix has no lines."""
    import pandas as pd

    from . import acceptance

    d = df[df["matrix"] == DIFF_SERVER_MATRIX]
    if not len(d):
        raise LabError(f"no run lines of {DIFF_SERVER_MATRIX} in the data")
    rows = []

    def add(pred, measured, held, kind="pre-registered"):
        rows.append({"kind": kind, "predicted": pred, "measured": measured, "held": bool(held)})

    def eng(name):
        return d[d["engine_id"] == name]

    a = eng("stock-control")
    a = a[a["concurrency"] == 32]
    add(*_crash_with_core("(a) stock server at 32", a))
    add("(a) its clients: HTTP 200, then an in-stream error event",
        "; ".join(f"{r['request_errors'].get('failed')} failed, by kind {r['request_errors'].get('by_kind')}, "
                  f"by status {r['request_errors'].get('by_status')}" for _, r in a.iterrows()
                  if isinstance(r.get("request_errors"), dict)) or "-",
        len(a) >= 1 and all(clients_saw_stream_error(r) for _, r in a[a["crashed"]].iterrows()) and a["crashed"].any())
    b = eng("diff-server")
    for conc, need in ((32, 10), (8, 3), (20, 3)):
        g = b[b["concurrency"] == conc]
        ok = int((g["outcome"] == "ok").sum())
        clean = sum(_clients_clean(r) for _, r in g.iterrows())
        add(f"(b) the diff's server at {conc}: completes {need} of {need}, every request HTTP 200 with all its tokens",
            f"{ok} of {len(g)} completed; {clean} with every request clean", len(g) == need and ok == need == clean)
    cb = acceptance.counted_against_schedule(b, outcomes=("ok",))
    add("(b) no diff run at 1.86 counts below the schedule (acceptance.below)",
        f"{int(cb['below the schedule'].sum())} of {len(cb)} below; counted "
        f"{cb['counted mean'].min():.3f}-{cb['counted mean'].max():.3f}" if len(cb) else "no counters",
        len(cb) == len(b) == 16 and not cb["below the schedule"].any())
    c = eng("stock-controls")
    for conc in (8, 20):
        add(*_crash_with_core(f"(c) stock server at {conc}", c[c["concurrency"] == conc]))
    for name, pred, want in (("diff-acc6", "(d) the diff at acceptance 6.0 and 8: completes 3 of 3, counts exactly 6.000",
                              lambda x: abs(x - 6.0) < 1e-9),
                             ("stock-acc6", "(d) stock at acceptance 6.0 and 8: completes 3 of 3, counts below 6",
                              lambda x: x < 6.0 - 1e-9)):
        g = eng(name)
        g = g[(g["acceptance"] == 6.0) & (g["concurrency"] == 8)]
        # vLLM's counted value as recorded, not rounded: one token lost in a long run must not round back to 6.000
        counted = [sd.get("acceptance_length") if isinstance(sd, dict) else None for sd in g["spec_decode_metrics"]]
        read = [x for x in counted if isinstance(x, (int, float))]
        add(pred, f"{int((g['outcome'] == 'ok').sum())} of {len(g)} completed; counted "
                  + (", ".join(f"{x:.4f}" for x in read) or "-"),
            len(g) == 3 and (g["outcome"] == "ok").all() and len(read) == 3 and all(want(x) for x in read))
    for row in _diff_integrity(d[d["fix_via"] == "upstream diff"], diff_text):
        add(*row, "integrity check")
    return pd.DataFrame(rows, columns=["kind", "predicted", "measured", "held"])


def diff_rest_predictions(df, probes, diff_text: str):
    """``verify-diff-rest-tp1`` (s49-s50: the upstream diff offline at 64, 24 and 28, the concurrencies where offline
    stock crashed every run and the diff had not run) against what its header predicted before the runs, one row per
    prediction, as :func:`diff_predictions`: (a) the stock controls crash at 64, 24 and 28, each core naming a kernel,
    one row per concurrency and GPU session (each session that continued the matrix ran its controls first);
    (b) the diff completes 3 of 3 at each, no run counting below the schedule; (c) under the step probe at 64 the diff
    completes and every FULL step is identical to the no-graph pass. Then the integrity checks of
    :func:`_diff_integrity`. ``held`` is None for a prediction whose runs have no line yet (not run: neither held nor
    failed). ``probes``: :func:`probe_table`. Raises when the matrix has no lines."""
    from . import acceptance

    d = df[df["matrix"] == DIFF_REST_MATRIX]
    if not len(d):
        raise LabError(f"no run lines of {DIFF_REST_MATRIX} in the data")
    rows = []

    def add(pred, measured, held, kind="pre-registered"):
        rows.append({"kind": kind, "predicted": pred, "measured": measured, "held": None if held is None else bool(held)})

    stock = d[d["engine_id"] == "stock-controls"]
    # the controls run again in every GPU session that continues the matrix (runner: control engines): (a) is judged
    # per session, s49's beside (b) and s50's beside (c)
    for sess in sorted(set(stock["gpu_session"].dropna()), key=session_key):
        for conc in (64, 24, 28):
            s = stock[(stock["gpu_session"] == sess) & (stock["concurrency"] == conc)]
            add(*_crash_with_core(f"(a) stock control at {conc} ({analysis.short_session(sess)})", s))
    diff = d[d["engine_id"] == "diff"]
    for conc in (64, 24, 28):
        g = diff[diff["concurrency"] == conc]
        ok = int((g["outcome"] == "ok").sum())
        add(f"(b) the diff at {conc}: completes 3 of 3", f"{ok} of {len(g)} completed", len(g) == 3 and ok == 3)
    cb = acceptance.counted_against_schedule(diff, outcomes=("ok",))
    add("(b) no diff run counts below the schedule (acceptance.below)",
        f"{int(cb['below the schedule'].sum())} of {len(cb)} below; counted "
        f"{cb['counted mean'].min():.3f}-{cb['counted mean'].max():.3f}" if len(cb) else "no counters",
        len(cb) == len(diff) == 9 and not cb["below the schedule"].any())
    p = probes[(probes["engine"].str.startswith("diff-probe-c64.")) & probes["fix"].str.startswith("upstream diff")
               & probes["gpu_session"].isin(set(d["gpu_session"]))]
    add(*_probe_prediction(p, "(c) the diff under the step probe at 64"))
    for row in _diff_integrity(d[d["fix_via"] == "upstream diff"], diff_text):
        add(*row, "integrity check")
    return _judged_table(rows, ["kind", "predicted", "measured"])


def _judged_table(rows: list[dict], columns: list[str]):
    """``rows`` (dicts with ``columns`` and ``held``) as a table whose ``held`` is True, False or None (not run or not
    decided), kept in an object column: never NaN, never cast to bool."""
    import pandas as pd

    t = pd.DataFrame(rows, columns=columns)
    t["held"] = pd.Series([r["held"] for r in rows], dtype=object)
    return t


C24_CORE_MATRIX = "stock-c24-core-tp1"
# kernels that stock cores at TP=1 had named before s50 (the matrix's prediction (b) lists them)
STOCK_TP1_KERNELS = ("copy_and_expand_dflash_inputs_kernel", "triton_poi_fused_2",
                     "fused_sigmoid_gating_delta_rule_update_kernel")


def planned_runs(matrix_path) -> list[str]:
    """The run ids a matrix file plans (every engine's runs, rounds expanded, warm-ups left out)."""
    from .runner import load_matrix

    return [r.id for e in load_matrix(str(matrix_path))["engines"] for r in e["runs"] if not r.warmup]


def _planned_lines(df, matrix: str, matrix_path=None):
    """(``matrix``'s run lines but start-up errors, the run ids its matrix file plans: ``matrix_path``, by default the
    repository's ``matrices/<matrix>.yaml``). Raises when there is no such line, or a line's run is not one the file
    plans."""
    from pathlib import Path

    d = df[df["matrix"] == matrix]
    d = d[d["outcome"] != "startup_error"]   # an engine that never started ran nothing: its run counts as not run
    if not len(d):
        raise LabError(f"no run lines of {matrix} in the data")
    plan = planned_runs(matrix_path or Path(__file__).resolve().parents[1] / "matrices" / f"{matrix}.yaml")
    stray = sorted(set(d["run_id"]) - set(plan))
    if stray:
        raise LabError(f"{matrix}: run lines {stray} are not among the matrix file's planned runs {plan}")
    return d, plan


def c24_core_predictions(df, matrix_path=None):
    """``stock-c24-core-tp1`` (s50: stock at 24 again, after s49's control there left no core file) against its
    header's predictions, one row each, ``held`` True, False or None (not decided: a planned run has no line yet):
    (a) stock crashes at 24 in every planned fresh engine (the runs ``matrix_path`` plans, by default the repository's
    ``matrices/stock-c24-core-tp1.yaml``: 2); (b) each crash leaves a core naming a kernel that stock cores at TP=1
    had named before (:data:`STOCK_TP1_KERNELS`), or without a core records ``dump_started``.
    Raises when the matrix has no lines, or a line's run is not one the matrix file plans."""
    d, plan = _planned_lines(df, C24_CORE_MATRIX, matrix_path)
    # counted per planned run, not per line: a run recorded twice (a continued matrix) is one run
    planned, ran = len(plan), d["run_id"].nunique()
    crashed = int(d.groupby("run_id")["crashed"].all().sum())
    a_held = False if crashed < ran else (True if ran >= planned else None)
    rows = [{"predicted": f"(a) stock crashes at 24 in {planned} of {planned} fresh engines",
             "measured": f"{crashed} of {ran} run(s) crashed"
             + (f"; {planned - ran} planned run(s) not run" if ran < planned else ""),
             "held": a_held}]
    notes, ok = [], []
    for _, r in d[d["crashed"]].iterrows():
        k = fault_kernel(r)
        f = r.get("fault") if isinstance(r.get("fault"), dict) else {}
        if k:
            notes.append(f"{r['run_id']}: core names {k}" + (f" (grid {tuple(f['grid'])})" if f.get("grid") else ""))
            ok.append(k in STOCK_TP1_KERNELS)
        else:
            notes.append(f"{r['run_id']}: no core file, dump_started {f.get('dump_started')}")
            ok.append(f.get("dump_started") is True)
    rows.append({"predicted": "(b) each crash: a core naming a kernel stock cores had named, or dump_started recorded",
                 "measured": "; ".join(notes) or "no crash", "held": all(ok) if ok else None})
    return _judged_table(rows, ["predicted", "measured"])


PROBE_C24_MATRIX = "probe-c24-tp1"


def _all_held(flags, missing: bool):
    """A prediction judged over several logs: False when any log contradicts it, None when one is undecided or a
    planned run has no line yet, else True."""
    if any(f is False for f in flags):
        return False
    return None if missing or not flags or any(f is None for f in flags) else True


def c24_probe_predictions(df, pattern: str = divergence.PROBE_GLOB, matrix_path=None):
    """``probe-c24-tp1`` (s51: stock under the step probe at 24, the one crashing concurrency the probe had not run)
    against its header's predictions, one row each, ``held`` True, False or None (undecided, or a planned run has no
    line yet), judged per probe log (one per engine start):
    (a) the first FULL step's replay diverges, layers 0-7 written bit-identically, layer 8 (GDN) first written
        differently (:func:`divergence.first_divergence`);
    (b) a crashing log ends at its first row-0 step (:func:`divergence.row0_without_token`), or its core names a kernel
        of the target's forward with no row-0 step recorded (undecided: the faulting step has no line); a completed
        log has no row-0 step; a log of a run that neither crashed nor completed (a timeout) contradicts it when it
        records steps after its first row-0 step (that step did not fault), and is undecided otherwise;
    (c) each crash's core names a kernel stock cores at TP=1 had named (:data:`STOCK_TP1_KERNELS`); a crash without a
        core leaves it undecided.
    A run that completes leaves its engine to the next run, so two runs can share one log; it is judged once, on its
    first FULL step. Start-up errors count as runs not run.
    Raises when the matrix has no run lines, a line's run is not one the matrix file plans, or a run has no probe log."""
    rows, _, _, _ = _probe_c24_rows(df, PROBE_C24_MATRIX, pattern, matrix_path, judge_timeouts=True)
    return _judged_table(rows, ["predicted", "measured"])


def _log_key(file, engine_id, attempt) -> tuple[str, str]:
    """A run line's probe log, as probe and oor tables index it: (session, "<engine>.a<attempt>")."""
    return os.path.splitext(str(file))[0], f"{engine_id}.a{attempt}"


def _probe_c24_rows(df, matrix: str, pattern: str, matrix_path, judge_timeouts: bool):
    """Predictions (a)-(c) of a stock probe matrix at 24 (:func:`c24_probe_predictions` says how each is judged), as
    rows; the per-log facts later predictions read, ``{(session, engine): (probe-table row, oor-table row)}``; the
    matrix's run lines; and how many planned runs have no line.
    ``judge_timeouts`` False leaves a timed-out log out of (b) (``probe-hang-c24-tp1``'s header: r0 of probe-c24
    showed a row-0 step need not fault)."""
    runs, plan = _planned_lines(df, matrix, matrix_path)
    sessions = sorted({os.path.splitext(str(f))[0] for f in runs["file"]})
    keys = {_log_key(f, e, a) for f, e, a in zip(runs["file"], runs["engine_id"], runs["attempt"])}
    pt = probe_table(df, pattern, sessions=sessions)
    pt = pt[[(s, e) in keys for s, e in zip(pt["session"], pt["engine"])]].set_index(["session", "engine"])
    ot = oor_table(df, pattern, sessions=sessions)
    ot = ot[[(s, e) in keys for s, e in zip(ot["session"], ot["engine"])]].set_index(["session", "engine"])
    lost = sorted(keys - set(pt.index))
    if lost:
        raise LabError(f"{matrix}: no probe log for {[f'{s}/{e}' for s, e in lost]}")
    missing = len(plan) - runs["run_id"].nunique()
    from .runner import is_deadline_cut

    cut = {_log_key(r["file"], r["engine_id"], r["attempt"]) for _, r in runs.iterrows() if is_deadline_cut(r)}
    a, b, c = ([], []), ([], []), ([], [])
    for key in sorted(keys):
        p, o = pt.loc[key], ot.loc[key]
        # the runner records a deadline cut as a timeout; the name says which it was
        name = f"{key[1]} ({'cut at the runner deadline' if key in cut else o['outcome']})"
        first = _int_or_none(p["first FULL step"])
        ok_a = None if first is None else (_int_or_none(p["first diverging step"]) == first
                                           and _int_or_none(p["layers written identically before it"]) == 8
                                           and p["first layer written differently"] == "L8 gdn")
        a[0].append(f"{name}: first FULL step {first}, first diverging {_int_or_none(p['first diverging step'])}, "
                    f"{_int_or_none(p['layers written identically before it'])} layers identical before "
                    f"{p['first layer written differently']}")
        a[1].append(ok_a)
        r0, last, kernel = _int_or_none(o["row-0 step"]), _int_or_none(o["last step"]), o["core kernel"]
        ok_b = _row0_verdict(ot.loc[[key]].reset_index())
        if "crash" in str(o["outcome"]).split(", "):
            b[0].append(f"{name}: last step {last}, row-0 step {r0} ({o['row-0 how']})"
                        + (f", core {kernel}" if isinstance(kernel, str) else ""))
            c[0].append(f"{name}: " + (f"core names {kernel}" if isinstance(kernel, str) else "no core file"))
            c[1].append(kernel in STOCK_TP1_KERNELS if isinstance(kernel, str) else None)
        elif o["outcome"] == "ok":
            b[0].append(f"{name}: no row-0 step" if r0 is None else f"{name}: a row-0 step at {r0} and no crash")
        elif not judge_timeouts:
            # the header leaves such a run out of (b): it neither holds nor breaks it, nor leaves it undecided
            b[0].append(f"{name}: not judged (row-0 step {r0}, last step {last})")
            continue
        else:
            after = (last - r0) if r0 is not None and last is not None else 0
            b[0].append(f"{name}: " + (f"row-0 step {r0} ({o['row-0 how']}), then {after} more step(s) recorded "
                                       f"without a fault (last step {last})" if after > 0 else
                                       f"last step {last}, row-0 step {r0}: undecided"))
        b[1].append(ok_b)
    tail = f"; {missing} planned run(s) not run" if missing > 0 else ""
    b_text = ("(b) a crashing log ends at its first row-0 step; a completed one has none" if judge_timeouts else
              "(b) a crashing log ends at its first row-0 step; a completed one has none; a timeout is not judged")
    rows = [{"predicted": "(a) the first FULL step diverges, layers 0-7 identical, layer 8 (GDN) the first written differently",
             "measured": "; ".join(a[0]) + tail, "held": _all_held(a[1], missing > 0)},
            {"predicted": b_text, "measured": "; ".join(b[0]) + tail,
             "held": _all_held(b[1], missing > 0) if b[1] else None},
            {"predicted": "(c) each crash's core names a kernel stock cores at TP=1 had named",
             "measured": ("; ".join(c[0]) or "no crash, nothing to judge") + tail,
             "held": _all_held(c[1], missing > 0) if c[1] else None}]
    return rows, {k: (pt.loc[k], ot.loc[k]) for k in sorted(keys)}, runs, missing


PROBE_HANG_MATRIX = "probe-hang-c24-tp1"
# probe-hang-c24-tp1's header: a run cut at the deadline counts as stopped after this long without a step
HANG_SILENCE_S = 60.0


def probe_hang_predictions(df, pattern: str = divergence.PROBE_GLOB, matrix_path=None):
    """``probe-hang-c24-tp1`` (s53: probe-c24's probed run at 24 again, hang snapshot on, core dumps kept running)
    against its header's predictions: (a)-(c) as :func:`c24_probe_predictions` judges them, except that a timed-out
    log is left out of (b); and
    (d) a run that stopped was stopped by a kernel that does not end: every GPU sample of its snapshot shows
        utilization above 0, and the user-triggered dump holds at least one kernel. A run counts as stopped when its
        run timed out (``run_timeout_s``), or when the runner's deadline cut it and its probe log recorded no step in
        the :data:`HANG_SILENCE_S` before the cut (the snapshot's first GPU sample). A stopped run whose samples show
        0 % contradicts (d); one whose samples hold and whose dump was not taken is undecided; a run cut sooner is not
        judged (None), and its snapshot's readings are reported in ``measured`` all the same.
    Returns (the judged table, one row per run that stopped or was cut: what its snapshot recorded)."""
    import pandas as pd

    rows, logs, runs, missing = _probe_c24_rows(df, PROBE_HANG_MATRIX, pattern, matrix_path, judge_timeouts=False)
    seen, flags, facts = [], [], []
    for _, r in runs[runs["outcome"] == "timeout"].iterrows():
        key, o, h, samples, util, silent, cut = _silence(r, logs)
        stopped = (not cut) or (silent is not None and silent >= HANG_SILENCE_S)
        core = h.get("core") or {}
        kernels = [k.get("kernel") for k in core.get("kernels") or []]
        if not samples or not stopped:
            verdict = None
        elif any(u is None or u <= 0 for u in util):
            verdict = False
        else:
            verdict = True if kernels else (False if core.get("core_file") else None)
        flags.append(verdict)
        stacks = h.get("stacks") or {}
        facts.append({"run": f"{key[0]}/{r['run_id']}", "ended by": "runner deadline" if cut else "run timeout",
                      "last step": _int_or_none(o["last step"]), "s without a step before the snapshot": silent,
                      "stopped (header's rule)": stopped,
                      "GPU utilization %": "/".join("?" if u is None else f"{u:.0f}" for u in util) or None,
                      "GPU power W": (round(sum(s["power_w"] for s in samples) / len(samples), 1) if samples else None),
                      "stacks": "; ".join(f"{v.get('process') or pid}: " + (v["error"] if v.get("error") else
                                          (v.get("main") or ["?"])[0]) for pid, v in stacks.items()) or None,
                      "dump": hang_dump(r), "(d) held": verdict})
        seen.append(f"{key[1]}: " + ("ended by the deadline" if cut else "timed out")
                    + (f" {silent:.0f} s after its last step ({_int_or_none(o['last step'])})" if silent is not None else "")
                    + f", GPU utilization {facts[-1]['GPU utilization %']} %"
                    + (f", not judged (the header asks {HANG_SILENCE_S:.0f} s without a step)" if not stopped else ""))
    tail = f"; {missing} planned run(s) not run" if missing > 0 else ""
    judged = [f for f, x in zip(flags, facts) if x["stopped (header's rule)"]]
    rows.append({"predicted": "(d) a run that stopped was stopped by a kernel that does not end (utilization above 0 in "
                              "every sample, the dump holds a kernel)",
                 "measured": ("; ".join(seen) or "no run stopped, nothing to judge") + tail,
                 "held": _all_held(judged, missing > 0)})
    return _judged_table(rows, ["predicted", "measured"]), pd.DataFrame(facts)


def _silence(r, logs):
    """What a timed-out run's hang snapshot and probe log say of its stop: (log key, oor-table row, the line's ``hang``,
    the GPU samples, their utilization, seconds from the probe log's last step to the snapshot's first GPU sample
    (None where either is missing), whether the runner's deadline cut the run)."""
    from .runner import is_deadline_cut

    key = _log_key(r["file"], r["engine_id"], r["attempt"])
    p, o = logs[key]
    h = r.get("hang") if isinstance(r.get("hang"), dict) else {}
    samples = (h.get("gpu") or {}).get("samples") or []
    util = [s.get("utilization_pct") for s in samples]
    steps = divergence.load_probe(p["path"])["steps"]
    last_t = steps[-1]["t"] if steps else None
    cut_t = samples[0]["t"] if samples else None
    silent = None if last_t is None or cut_t is None else round(cut_t - last_t, 1)
    return key, o, h, samples, util, silent, is_deadline_cut(r)


def hang_dump(r, data_dir: str = "data") -> str | None:
    """What the dump a run line's hang snapshot asked for held: the kernels cuda-gdb listed; ``no CUDA kernel`` where
    cuda-gdb's stored log (``data/gpu/<runs file stem>/<gdb log name>``) says ``No CUDA kernels.`` (no kernel resident
    on the GPU when the dump was written); else the snapshot's error for the core. None where no dump was asked for."""
    from .runner import recorded_path

    h = r.get("hang") if isinstance(r.get("hang"), dict) else {}
    core = h.get("core")
    if not isinstance(core, dict):
        return None
    kernels = [k["kernel"] for k in core.get("kernels") or [] if k.get("kernel")]
    if kernels:
        return ", ".join(kernels)
    log = core.get("gdb_log")
    path = (recorded_path(os.path.join(analysis.gpu_folder(r, data_dir), os.path.basename(log)))
            if core.get("core_file") and isinstance(log, str) and isinstance(r.get("file"), str) else None)
    if path and re.search(r"^No CUDA kernels\.$", analysis.read_text(path), re.M):
        return "no CUDA kernel"
    return core.get("error")


def ledger_probe_agreement(lines: list[dict], probe: dict, vocab_size: int):
    """Each request running in a ledger's first spin against the step probe of the same engine: the ledger's updates
    that returned no token for it (``empty_at``, by the ledger's schedule count ``n``; under async scheduling the update
    counted ``n`` carries the output of the step scheduled at ``n - 1``) and the probe's steps where its first sampled
    id was out of vocabulary (:func:`divergence.out_of_vocab_ids`), with their batch rows; ``agree``: the two step sets
    are the same once ``n - 1`` is read as the probe's step number.
    Returns (that table, (matched, schedules)): how many of the spin ring's schedules that scheduled tokens match the
    probe's step of the same number in token count and requests, the check that the two counts are one numbering."""
    import pandas as pd

    cols = ["request", "no-token updates at", "out-of-vocabulary steps", "rows", "agree"]
    spins = [d for d in lines if d.get("kind") == "spin"]
    if not spins:
        return pd.DataFrame(columns=cols), (0, 0)
    index = {s["step"]: s for s in probe["steps"]}

    def req(rid) -> int:
        return int(str(rid).split("-")[0])   # vLLM's offline request id: "<prompt index>-<suffix>"

    sched = [e for e in spins[0].get("ring") or [] if e.get("ev") == "schedule" and e.get("tokens")]
    matched = sum(1 for e in sched if e.get("n") in index and index[e["n"]].get("num_tokens") == e["tokens"]
                  and sorted(index[e["n"]].get("reqs") or []) == sorted(req(k) for k in e.get("scheduled") or {}))
    oor = divergence.out_of_vocab_ids(probe, vocab_size)
    rows = []
    for q in spins[0].get("requests") or []:
        mine = oor[oor["request"] == req(q.get("id"))].sort_values("step")
        at = q.get("empty_at")
        steps = [int(s) for s in mine["step"]]
        rows.append({"request": q.get("id"), "no-token updates at": at, "out-of-vocabulary steps": steps,
                     "rows": [int(x) for x in mine["row"]],
                     "agree": None if at is None else sorted(int(n) - 1 for n in at) == steps})
    return pd.DataFrame(rows, columns=cols), (matched, len(sched))


def run_ledger_probe(r, data_dir: str = "data") -> str:
    """The stored step-probe log of one run line's engine (``data/gpu/<runs file stem>/<engine>.aN.probe/``): an error
    unless there is exactly one."""
    from .runner import recorded_glob

    folder = os.path.join(analysis.gpu_folder(r, data_dir), f"{r['engine_id']}.a{r['attempt']}.probe")
    probes = [p for _, p in recorded_glob(os.path.join(folder, "probe-*.jsonl"))]
    if len(probes) != 1:
        raise LabError(f"{folder}: {len(probes)} probe logs, one expected")
    return probes[0]


def run_vocab_size(r) -> int:
    """The vocabulary size of one run line's target (:data:`models.TARGETS`)."""
    import pandas as pd

    return _vocab_size(pd.DataFrame([r]))


# every matrix that ran the probed stock engine at 24 (s51-s58): the runs c24_trajectories compares
C24_TRAJECTORY_MATRICES = ("probe-c24-tp1", "probe-hang-c24-tp1", "probe-hang-ledger-c24-tp1", "probe-hang-ledger2-c24-tp1")
TRAJECTORY_COLUMNS = ["run", "gpu_session", "ended", "first step requests", "second step requests", "first step set",
                      "last step", "out-of-vocabulary ids", "requests with one", "first row-0 step", "row-0 how",
                      "its request", "core kernel", "trajectory"]


def trajectory_id(oor) -> str | None:
    """A short name for the set of (request, step) pairs whose first sampled id was out of vocabulary
    (:func:`divergence.out_of_vocab_ids`): the first 8 hex digits of its SHA-1 in a fixed order; None for an empty
    set. Two runs with the same name had out-of-vocabulary ids for the same requests at the same steps."""
    import hashlib

    pairs = sorted({(int(q), int(st)) for q, st in zip(oor["request"], oor["step"])})
    return hashlib.sha1(repr(pairs).encode()).hexdigest()[:8] if pairs else None


def _c24_probed(df, matrices, data_dir: str, lines=None):
    """The run lines :func:`c24_trajectories` and :func:`seq_advance_table` read (``matrices``' lines oldest first, or
    exactly ``lines``), start-up errors left out: ``(line, "<runs file stem>/<run_id>", probe log)``, the probe None
    for a deadline cut that left none; any other missing probe log is an error."""
    from . import divergence

    if lines is None:
        lines = df[df["matrix"].isin(matrices)].sort_values("started_at", kind="stable") if len(df) else df
    for _, r in lines.iterrows():
        if r["outcome"] == "startup_error":
            continue
        label = f"{os.path.splitext(os.path.basename(str(r['file'])))[0]}/{r['run_id']}"
        try:
            p = divergence.load_probe(run_ledger_probe(r, data_dir))
        except LabError:
            if not analysis.is_deadline_cut(r):
                raise
            p = None   # cut before the engine wrote its log: nothing measured
        yield r, label, p


def c24_trajectories(df, matrices=C24_TRAJECTORY_MATRICES, data_dir: str = "data", lines=None, up_to_step=None):
    """Every run line of the probed stock matrices at 24 (``matrices``; or exactly ``lines``, in their order) with its
    probe log: how it ended ("crash", "timeout", "deadline cut"), how many requests the engine's first step admitted
    (and whether the admission gate set it), its last step, its out-of-vocabulary ids (how many, for how many requests,
    :func:`trajectory_id` of their set), its first row-0 step (:func:`divergence.row0_without_token`: row 0's own
    out-of-vocabulary id, "sampled", or a request with no token moved into row 0, "moved") with the request in row 0
    there, and its core's kernel. One row per run line, oldest first where ``lines`` is not given; start-up errors
    (an engine that never ran) are left out. A deadline cut without a probe log is a row with nothing but how it ended;
    any other run line whose probe log is missing is an error (a run line without its data is not a trajectory).
    ``up_to_step``: the out-of-vocabulary columns (how many, for how many requests, the trajectory) count only the ids
    of steps up to it, e.g. to set a run cut at that step beside the prefixes of whole trajectories."""
    import pandas as pd

    from . import divergence

    rows = []
    for r, label, p in _c24_probed(df, matrices, data_dir, lines):
        row = {c: None for c in TRAJECTORY_COLUMNS}
        row.update({"run": label, "gpu_session": r["gpu_session"],
                    "ended": "deadline cut" if analysis.is_deadline_cut(r) else r["outcome"],
                    "first step set": _first_step_set(pd.DataFrame([r]))})
        if p is None:   # a deadline cut with no probe log: how it ended, nothing else
            rows.append(row)
            continue
        # a log may hold several runs of one engine start: this run's steps are all of them only for one run an engine
        if len(probe_runs(df, os.path.splitext(str(r["file"]))[0], f"{r['engine_id']}.a{r['attempt']}")) != 1:
            raise LabError(f"{r['file']} {r['run_id']}: its engine ran more than one run; trajectories need one per log")
        steps = p["steps"]
        vocab = run_vocab_size(r)
        oor = divergence.out_of_vocab_ids(p, vocab)
        if up_to_step is not None:
            oor = oor[oor["step"] <= up_to_step]
        r0 = divergence.row0_without_token(p, vocab)
        at = next((s for s in steps if r0 is not None and s["step"] == r0["step"]), None)
        fault = r.get("fault")
        row.update({"first step requests": int(steps[0]["num_reqs"]) if steps else None,
                    "second step requests": int(steps[1]["num_reqs"]) if len(steps) > 1 else None,
                    "last step": int(steps[-1]["step"]) if steps else None,
                    "out-of-vocabulary ids": len(oor), "requests with one": int(oor["request"].nunique()),
                    "first row-0 step": int(r0["step"]) if r0 else None, "row-0 how": r0["how"] if r0 else None,
                    "its request": int(at["reqs"][0]) if at and at.get("reqs") else None,
                    "core kernel": fault.get("kernel") if isinstance(fault, dict) else None,
                    "trajectory": trajectory_id(oor)})
        rows.append(row)
    t = pd.DataFrame(rows, columns=TRAJECTORY_COLUMNS)
    for c in ("first step requests", "second step requests", "last step", "out-of-vocabulary ids", "requests with one",
              "first row-0 step", "its request"):
        t[c] = t[c].astype("Int64")
    return t


def trajectory_groups(t):
    """:func:`c24_trajectories` by trajectory (runs without an out-of-vocabulary id left out): how many runs, the first
    step's request counts seen, how they ended, their last steps, first row-0 step and its request, and core kernels.
    Most runs first."""
    import pandas as pd

    t = t[t["trajectory"].notna()]
    rows = []
    for tid, g in t.groupby("trajectory", sort=False):
        def seen(col):
            return ", ".join(str(x) for x in sorted({int(v) for v in g[col].dropna()})) or None

        ended = g["ended"].value_counts()
        rows.append({"trajectory": tid, "runs": len(g), "first step requests": seen("first step requests"),
                     "ended": ", ".join(f"{n} {e}" for e, n in ended.items()),
                     "last step": seen("last step"), "first row-0 step": seen("first row-0 step"),
                     "row-0 how": ", ".join(sorted({str(v) for v in g["row-0 how"].dropna()})) or None,
                     "its request": seen("its request"),
                     "out-of-vocabulary ids": seen("out-of-vocabulary ids"),
                     "core kernels": ", ".join(sorted({k for k in g["core kernel"] if isinstance(k, str)})) or None,
                     "sessions": ", ".join(dict.fromkeys(analysis.short_session(x) for x in g["gpu_session"]))})
    cols = ["trajectory", "runs", "first step requests", "ended", "last step", "first row-0 step", "row-0 how",
            "its request", "out-of-vocabulary ids", "core kernels", "sessions"]
    return pd.DataFrame(rows, columns=cols).sort_values("runs", ascending=False, kind="stable").reset_index(drop=True)


def seq_advance_table(df, matrices=C24_TRAJECTORY_MATRICES, data_dir: str = "data"):
    """:func:`divergence.seq_advance_after_oor` for every run line of ``matrices`` whose probe log has an
    out-of-vocabulary id: per run, how many such rows it had, how many of them the same request had a later step after,
    the sequence-length advances to that step, and the smallest and largest advance between any other two steps of a
    request. A runner placing tokens by the scheduler's leaked count would show 1 + k after such a row, or, one step
    later in the async order, more than 1 + k after another step."""
    import pandas as pd

    from . import divergence

    rows = []
    for r, label, p in _c24_probed(df, matrices, data_dir):
        vocab = run_vocab_size(r)
        oor = divergence.out_of_vocab_ids(p, vocab) if p is not None else []
        if not len(oor):
            continue
        after, other = divergence.seq_advance_after_oor(p, vocab, oor=oor)
        rows.append({"run": label, "out-of-vocabulary rows": len(oor),
                     "request-steps after an out-of-vocabulary row": sum(after.values()),
                     "advances after them": ", ".join(f"{k} x{c}" for k, c in sorted(after.items())),
                     "other steps' advance, min": min(other) if other else None,
                     "other steps' advance, max": max(other) if other else None})
    return pd.DataFrame(rows, columns=["run", "out-of-vocabulary rows", "request-steps after an out-of-vocabulary row",
                                       "advances after them", "other steps' advance, min",
                                       "other steps' advance, max"])


def stop_silences(df, matrices=C24_TRAJECTORY_MATRICES, data_dir: str = "data"):
    """The probed stock runs at 24 that timed out (the runner's deadline cuts left out): each one's last recorded step and
    the seconds from it to the hang snapshot's first GPU sample, taken when the run's timeout came (None: no snapshot,
    as before s53). How long each stop had lasted when it was ended."""
    import pandas as pd

    rows = []
    for r, label, p in _c24_probed(df, matrices, data_dir):
        if r["outcome"] != "timeout" or analysis.is_deadline_cut(r) or p is None:
            continue
        h = r.get("hang") if isinstance(r.get("hang"), dict) else {}
        samples = (h.get("gpu") or {}).get("samples") or []
        last = p["steps"][-1] if p["steps"] else None
        rows.append({"run": label, "last step": int(last["step"]) if last else None,
                     "silent s": round(samples[0]["t"] - last["t"], 1) if samples and last else None})
    return pd.DataFrame(rows, columns=["run", "last step", "silent s"])


def plot_trajectories(ax, t):
    """Each run of :func:`c24_trajectories` with a trajectory: how many requests its first step admitted (x) against its
    last recorded step (y), one colour per trajectory, a cross where it crashed and a circle where it stopped (timeout
    or deadline cut); hollow where arrival timing set the first step, filled where the admission gate did. Runs at one
    point are spread sideways a little, so each run is one marker."""
    import numpy as np

    x = t[t["trajectory"].notna()]
    if not len(x):
        raise LabError("no probed run at 24 with an out-of-vocabulary id to plot")
    colours = dict(zip(trajectory_groups(x)["trajectory"], ["tab:blue", "tab:red", "tab:green", "tab:purple",
                                                           "tab:brown", "tab:olive"]))
    for (tid, crash, gated), g in x.groupby([x["trajectory"], x["ended"] == "crash", x["first step set"] != "arrival"]):
        c = colours.get(tid, "tab:gray")
        for (k, st), h in g.groupby(["first step requests", "last step"]):
            dx = (np.linspace(-0.18, 0.18, len(h)) if len(h) > 1 else np.zeros(1)) + (0.06 if gated else 0.0)
            if crash:
                ax.scatter(int(k) + dx, [int(st)] * len(h), s=44, marker="x", color=c)
            else:
                ax.scatter(int(k) + dx, [int(st)] * len(h), s=44, marker="o", facecolors=c if gated else "none",
                           edgecolors=c)
    for tid, c in colours.items():
        ax.scatter([], [], marker="s", color=c, label=f"trajectory {tid}")
    ax.scatter([], [], marker="x", color="black", label="crash")
    ax.scatter([], [], marker="o", facecolors="none", edgecolors="black", label="no step after (timeout or cut)")
    ks = sorted({int(v) for v in x["first step requests"]})
    ax.set_xticks(ks)
    ax.set_xlabel("requests the first (prefill) step admitted")
    ax.set_ylabel("last recorded step")
    from matplotlib.ticker import MaxNLocator

    steps = sorted({int(v) for v in x["last step"]})
    ax.set_ylim(min(steps) - 3, max(steps) + 3)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"concurrency 24: {len(x)} probed stock runs that reached NaN logits", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return ax


ADMIT_C24_MATRIX = "probe-admit-c24-tp1"
# probe-admit-c24-tp1's header, written before its runs: per first-step admission K, the trajectory
# (trajectory_id of c24_trajectories, s51-s58), how the run ends and its last recorded step
ADMIT_C24_EXPECTED = {1: ("b24b6dcf", "crash", 285), 2: ("49d3f971", "timeout", 295),
                      3: ("49d3f971", "timeout", 295), 4: ("18c2a7fd", "crash", 281)}
ADMIT_C24_HELD = [16, 20, 23]   # the requests (prompt indices) the header predicts a stop's ledger spin holds


def admit_c24_predictions(df, matrix_path=None, data_dir: str = "data"):
    """``probe-admit-c24-tp1`` (pre-registered in s58) against its header, one row per prediction, ``held`` True, False
    or None (undecided: a planned run has no measured line; a deadline cut measures nothing), and the per-run table
    (:func:`c24_trajectories` of the matrix's lines, start-up errors left out, with each line's K):
    (0) each run's first step holds its K requests and its second step all 24;
    (1)-(3) per K (:data:`ADMIT_C24_EXPECTED`): the trajectory and the ending: for K=1 and 4 a crash whose last
        recorded step is its first row-0 step (:func:`divergence.row0_without_token`), 285 and 281; for K=2 and 3 a
        timeout with no step recorded after 295 and a ledger spin holding exactly requests 16, 20 and 23, each at 511
        of 512 output tokens with the max_tokens guard among its early outs.
    Raises when the matrix has no run line (nothing to judge), or a line's run is not one the matrix file plans."""
    import pandas as pd

    from . import schedledger

    def eq(a, b) -> bool:   # pd.NA or None on either side is not equal (never a TypeError from bool(pd.NA))
        return a is not None and b is not None and not pd.isna(a) and not pd.isna(b) and a == b

    d, plan = _planned_lines(df, ADMIT_C24_MATRIX, matrix_path)
    lines = d.sort_values("started_at", kind="stable").reset_index(drop=True)
    t = c24_trajectories(df, data_dir=data_dir, lines=lines)
    if len(t) != len(lines):   # _planned_lines keeps no start-up error, so every line has its row
        raise LabError(f"{ADMIT_C24_MATRIX}: {len(lines)} run lines but {len(t)} trajectory rows")
    t["K"] = [int(k) for k in lines["first_step_requests"]]
    t["concurrency"] = [int(c) for c in lines["concurrency"]]
    measured = t[t["ended"] != "deadline cut"]
    missing = sorted(set(plan) - {x.split("/", 1)[1] for x in measured["run"]})
    tail = f"; {len(missing)} planned run(s) not measured" if missing else ""

    gate, per_k = ([], []), {k: ([], []) for k in ADMIT_C24_EXPECTED}
    for i, r in t.iterrows():
        name = f"K={r['K']}"
        if r["ended"] == "deadline cut":   # recorded as far as its probe went, never judged
            # the last recorded step, not the step the deadline came at: the runner takes the hang snapshot (a few
            # seconds, the engine still stepping) before it kills the engine
            seen = ("" if pd.isna(r["last step"]) else
                    f"; last recorded step {r['last step']} (first step {r['first step requests']}, second "
                    f"{r['second step requests']}; its out-of-vocabulary ids up to there: trajectory "
                    f"{r['trajectory']})" if isinstance(r["trajectory"], str) else
                    f"; last recorded step {r['last step']} (first step {r['first step requests']}, no "
                    "out-of-vocabulary id)")
            for box in (gate, per_k.get(r["K"], ([], []))):
                box[0].append(f"{name}: cut by the runner's deadline{seen}, not judged")
            continue
        gate[0].append(f"{name}: first step {r['first step requests']}, second {r['second step requests']}")
        gate[1].append(eq(r["first step requests"], r["K"]) and eq(r["second step requests"], r["concurrency"]))
        if r["K"] not in ADMIT_C24_EXPECTED:
            continue
        tid, ending, step = ADMIT_C24_EXPECTED[r["K"]]
        got = (f"{name}: trajectory {r['trajectory']}, {r['ended']}, last step {r['last step']}, first row-0 step "
               f"{r['first row-0 step']} ({r['row-0 how']}, request {r['its request']})"
               + (f", core {r['core kernel']}" if isinstance(r["core kernel"], str) else ""))
        ok = eq(r["trajectory"], tid) and r["ended"] == ending
        if ending == "crash":
            ok = ok and eq(r["last step"], step) and eq(r["first row-0 step"], step)
        else:
            ok = ok and not pd.isna(r["last step"]) and int(r["last step"]) <= step
            sp = schedledger.spin_table(ledger_lines(lines.iloc[i], data_dir))
            held = sorted(int(str(x).split("-")[0]) for x in sp["request"]) if len(sp) else []
            guard = bool(len(sp)) and (sp["max_tokens"] == 512).all() and (sp["output tokens"] == 511).all() and \
                all("max_tokens guard" in str(x).split(", ") for x in sp["early outs"])
            got += (f"; ledger spin: requests {held}" + (" at 511 of 512, max_tokens guard" if guard else
                                                         " (not all at 511 of 512 under the max_tokens guard)")
                    if len(sp) else "; no ledger spin")
            ok = ok and held == ADMIT_C24_HELD and guard
        per_k[r["K"]][0].append(got)
        per_k[r["K"]][1].append(bool(ok))
    rows = [{"predicted": "(0) each run's first step holds its K requests, its second step all 24",
             "measured": "; ".join(gate[0]) + tail, "held": _all_held(gate[1], bool(missing)) if gate[1] else None}]
    texts = {1: "(1) K=1: trajectory b24b6dcf, a crash at its first row-0 step, 285",
             2: "(2) K=2: trajectory 49d3f971, no step after 295, a timeout; the ledger holds 16, 20, 23 at 511 of 512",
             3: "(2) K=3: trajectory 49d3f971, no step after 295, a timeout; the ledger holds 16, 20, 23 at 511 of 512",
             4: "(3) K=4: trajectory 18c2a7fd, a crash at its first row-0 step, 281"}
    for k in (1, 2, 3, 4):
        m, f = per_k[k]
        not_run = [x for x in missing if f"-k{k}-" in x]
        rows.append({"predicted": texts[k], "measured": "; ".join(m) or "not run",
                     "held": _all_held(f, bool(not_run)) if f else None})
    return pd.DataFrame(rows, columns=["predicted", "measured", "held"]).astype({"held": object}), t


def run_ledger_agreement(r, data_dir: str = "data"):
    """:func:`ledger_probe_agreement` for one run line: its stored ledger, its probe log (:func:`run_ledger_probe`) and
    its target's vocabulary size. None where the run's ledger has no spin line."""
    lines = ledger_lines(r, data_dir)
    if not any(x.get("kind") == "spin" for x in lines):
        return None
    return ledger_probe_agreement(lines, divergence.load_probe(run_ledger_probe(r, data_dir)), run_vocab_size(r))


PROBE_HANG_LEDGER_MATRICES = ("probe-hang-ledger-c24-tp1", "probe-hang-ledger2-c24-tp1")
# the engine core's main-thread frames that (e) reads as the scheduling loop (vLLM 0.22.1's core.py), and the files
# whose frames mean the worker's step is still running in that thread (uniproc executor: the model runner may be
# waiting on the GPU), which (e) reads as not in the loop
LOOP_FRAMES = ("step_with_batch_queue", "_process_engine_step")
STEP_FILES = ("gpu_worker.py", "gpu_model_runner.py")


def ledger_files(r, data_dir: str = "data") -> list[str]:
    """The stored scheduler-ledger files of a run line's engine: ``data/gpu/<runs file stem>/<engine>.aN.ledger/``."""
    from .runner import recorded_glob

    folder = os.path.join(analysis.gpu_folder(r, data_dir), f"{r['engine_id']}.a{r['attempt']}.ledger")
    return [p for _, p in recorded_glob(os.path.join(folder, "ledger-*.jsonl"))]


def ledger_lines(r, data_dir: str = "data") -> list[dict]:
    """Every line of a run line's stored scheduler ledgers (:func:`ledger_files`, :func:`schedledger.read`)."""
    from . import schedledger

    return [x for p in ledger_files(r, data_dir) for x in schedledger.read(p)]


def probe_hang_ledger_predictions(df, pattern: str = divergence.PROBE_GLOB, matrix: str = PROBE_HANG_LEDGER_MATRICES[0],
                                  data_dir: str = "data", matrix_path=None):
    """A scheduler-ledger matrix at 24 (s56: ``probe-hang-ledger-c24-tp1``; ``probe-hang-ledger2-c24-tp1``) against its
    header's predictions: (a)-(c) as :func:`probe_hang_predictions` judges them; and, for each run that stops
    stepping (no probe step in the :data:`HANG_SILENCE_S` before the snapshot's first GPU sample; a run with less is
    not judged, None):
    (e) the engine core's ledger holds a spin line (no token scheduled for at least 10 s, at least one request
        running), and its recorded main-thread stack is in the scheduling loop (a frame of :data:`LOOP_FRAMES`) and
        not in the worker's step (no frame of :data:`STEP_FILES`);
    (f) in that spin line every running request's output is short of its ``max_tokens`` and at least one early out
        of ``Scheduler.schedule`` holds for it (:func:`schedledger.guards`);
    (g) ``probe-hang-ledger2-c24-tp1`` only: each such request's placeholders are ``1 + k`` (16 at k=15, the run
        line's ``num_speculative_tokens``) times the updates that returned no token for it while it was scheduled (the
        ledger's ``empty_updates``).
    Returns (the judged table, one row per timed-out run: its stop and its ledger's first spin)."""
    import pandas as pd

    from . import schedledger

    rows, logs, runs, missing = _probe_c24_rows(df, matrix, pattern, matrix_path, judge_timeouts=False)
    judge_g = matrix != PROBE_HANG_LEDGER_MATRICES[0]
    e, f, g, facts = ([], []), ([], []), ([], []), []
    for _, r in runs[runs["outcome"] == "timeout"].iterrows():
        key, o, h, samples, util, silent, cut = _silence(r, logs)
        stopped = silent is not None and silent >= HANG_SILENCE_S
        lines = ledger_lines(r, data_dir)
        spins = [x for x in lines if x.get("kind") == "spin"]
        sp = spins[0] if spins else None
        longest = max((x.get("s") or 0 for x in lines if x.get("kind") in ("spin", "spin_still")), default=None)
        core_stack = next((v.get("main") or [] for v in (h.get("stacks") or {}).values()
                           if v.get("process") == "EngineCore"), [])
        in_loop = (any(fr.startswith("core.py:") and any(n in fr for n in LOOP_FRAMES) for fr in core_stack)
                   and not any(fr.split(":")[0] in STEP_FILES for fr in core_stack))
        reqs = (sp or {}).get("requests") or []
        short = [q.get("out") is not None and q.get("max_tokens") is not None and q["out"] < q["max_tokens"] for q in reqs]
        held_by = [schedledger.guards(q, sp.get("max_model_len")) for q in reqs] if sp else []
        per = 1 + int(r.get("num_speculative_tokens") or 0)   # placeholders one scheduled step adds (1 + k)
        leak = [q.get("placeholders") == per * q["empty_updates"] if "empty_updates" in q else None for q in reqs]
        name = f"{key[1]} ({'cut at the runner deadline' if cut else 'run timeout'})"
        why = "" if stopped else f", not judged (the header asks {HANG_SILENCE_S:.0f} s without a step)"
        silence = f"{silent:.0f} s after its last step ({_int_or_none(o['last step'])})" if silent is not None else \
            "no probe step or GPU sample to time it"
        e[0].append(f"{name}: {silence}; " + (f"ledger spin of {sp['s']:.0f} s with {sp['running']} running and "
                                               f"{sp['empty']} empty schedules (longest spin line {longest:.0f} s)"
                                               if sp else "no spin line in the ledger")
                    + f"; engine core main thread at {core_stack[0] if core_stack else 'no stack'}" + why)
        if stopped:   # a run that did not stop is reported, not judged
            e[1].append(bool(sp and sp["s"] >= 10 and sp["running"] >= 1 and in_loop))
        f[0].append(f"{name}: " + ("; ".join(f"{q.get('id')} output {q.get('out')} of {q.get('max_tokens')}, "
                                             f"{', '.join(gs) or 'no early out'}" for q, gs in zip(reqs, held_by))
                                   if sp else "no spin line") + why)
        if stopped:
            f[1].append(bool(sp and reqs and all(short) and all(held_by)))
        if judge_g:
            g[0].append(f"{name}: " + ("; ".join(f"{q.get('id')} placeholders {q.get('placeholders')}, "
                                                 f"{q.get('empty_updates')} update(s) with no token" for q in reqs)
                                       if sp else "no spin line") + why)
            if stopped:
                g[1].append(None if sp and None in leak else bool(sp and reqs and all(leak)))
        facts.append({"run": f"{key[0]}/{r['run_id']}", "ended by": "runner deadline" if cut else "run timeout",
                      "last step": _int_or_none(o["last step"]), "s without a step before the snapshot": silent,
                      "stopped (header's rule)": stopped,
                      "GPU utilization %": "/".join("?" if u is None else f"{u:.0f}" for u in util) or None,
                      "engine core main thread": " <- ".join(core_stack[:2]) or None,
                      "spin s (first line)": sp["s"] if sp else None, "longest spin line s": longest,
                      "empty schedules (first line)": sp["empty"] if sp else None,
                      "running in the spin": sp["running"] if sp else None, "dump": hang_dump(r, data_dir),
                      "held by": "; ".join(f"{q.get('id')}: {', '.join(gs) or 'none'}" for q, gs in zip(reqs, held_by))
                      or None})
    tail = f"; {missing} planned run(s) not run" if missing > 0 else ""
    out = rows + [
        {"predicted": "(e) a run that stops stepping leaves a ledger spin (no token scheduled >= 10 s with requests "
                      "running), the engine core's main thread in the scheduling loop",
         "measured": ("; ".join(e[0]) or "no run timed out, nothing to judge") + tail,
         "held": _all_held(e[1], missing > 0)},
        {"predicted": "(f) in that spin every running request is short of max_tokens and held by an early out of "
                      "Scheduler.schedule",
         "measured": ("; ".join(f[0]) or "no run timed out, nothing to judge") + tail,
         "held": _all_held(f[1], missing > 0)}]
    if judge_g:
        out.append({"predicted": "(g) each held request's placeholders are 16 times its updates with no token",
                    "measured": ("; ".join(g[0]) or "no run timed out, nothing to judge") + tail,
                    "held": _all_held(g[1], missing > 0)})
    return _judged_table(out, ["predicted", "measured"]), pd.DataFrame(facts)


def _row0_verdict(log) -> bool | None:
    """One probe log (a one-row :func:`oor_table`) against the row-0 rule, by :func:`row0_rule`'s own categories: True
    for a crash at its first row-0 step or a completed run without one; False for a crash elsewhere, a completed run
    with one, or a ``passed`` log; None (undecided) for a log a target-forward core cut short, or a run that neither
    crashed nor completed and stopped at or before a row-0 step."""
    r = row0_rule(log)
    if r["at row-0 step"]:
        return True
    if len(r["not"]) or len(r["completed with one"]) or len(r["passed"]):
        return False
    return True if r["completed"] else None


def _int_or_none(v):
    """A count or step from a table cell as int; None for None, NaN or pandas' NA."""
    import pandas as pd

    return None if v is None or pd.isna(v) else int(v)
