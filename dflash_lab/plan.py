"""How much device time a bench matrix would take, estimated from the recorded bench lines (issue 11: a slice must
fit a GPU session; s25 and s26 each ran out of device time before their last engine).

Per engine of the matrix: its start-up (the recorded range for its mode: the shortest on a warm host or carried
caches, the longest cold), its warm-up sweep and its measured runs. A run's time comes from recorded runs of the same
mode, concurrency and max_tokens: at the same acceptance their mean wall time; at another acceptance, for a DFlash
mode, that wall time scaled by the recorded acceptance length over the planned one (a request needs 1/L as many
steps and a step's time does not depend on L: notebook 06's assumption, which TTFT and queueing bend); without
speculation the acceptance is a label, so any recorded acceptance serves. A run nothing recorded is named, not
guessed; so is every measured run of a probed engine (``probe: true``): bench lines are never probed, and the
probe runs each FULL step again without graphs (probed runs at 32 took 50-80 s offline where plain ones took 8-17 s),
so a plain run's time would understate it several times over. A mode that crashed at a concurrency adds, per planned run there, its recorded crash rate (at the run's
acceptance where measured runs were recorded at the concurrency, else at any acceptance) times a restart (its shortest start-up) and the core-dump wait; where those crashes were recorded at other
acceptances only, the summary says so (stock FULL's crashes are all at 1.86, and vLLM's synthetic schedule never
rejects every draft at 3.6 or 6.0, the precondition of the crash states notebook 05 names: there the restarts are
likely an overestimate). A fresh host's first engine starts slower than the same mode's shortest recorded start
even on carried caches (s30-s36: 148-186 s against 50-70 s): the warm total adds, once, the median over recorded GPU
sessions of (the session's first engine start - its mode's shortest recorded start).
Estimates, from data, of a future run: not measurements.
"""

from __future__ import annotations

from .errors import LabError


def first_start_penalty(runs_df) -> tuple[float, int]:
    """(median over GPU sessions of the session's first engine start minus the shortest recorded start of that engine's
    mode, how many sessions): what a fresh host's first engine costs beyond a warm start. (0, 0) without ordered starts."""
    import statistics

    if "run_start_t" not in runs_df:
        return 0.0, 0
    st = (runs_df.dropna(subset=["startup_s", "run_start_t", "gpu_session"]).sort_values("run_start_t", kind="stable")
          .drop_duplicates(["file", "gpu_session", "engine_id", "attempt"]))
    if st.empty:
        return 0.0, 0
    shortest = st.groupby("mode")["startup_s"].min()
    extra = [float(g["startup_s"].iloc[0] - shortest[g["mode"].iloc[0]]) for _, g in st.groupby("gpu_session")]
    return float(statistics.median(extra)), len(extra)


def estimate(matrix_path: str, runs_df, budget_s: float = 1800.0, staging_s: float = 90.0) -> dict:
    """``{"engines": [row per engine], "total_cold_s", "total_warm_s", "budget_s", "fits_cold", "unknown"}``;
    ``runs_df`` from :func:`dflash_lab.bench.load_bench`."""
    from . import bench, runner

    m = runner.load_matrix(matrix_path)
    rows, unknown = [], []
    done = runs_df[runs_df["outcome"].isin(["ok", "crash"])]
    for eng in m["engines"]:
        e = eng["engine"]
        mode = bench.engine_mode(e)
        rec = done[done["mode"] == mode]
        starts = rec.drop_duplicates(["file", "gpu_session", "engine_id", "attempt"])["startup_s"].dropna()
        warm_s, runs_s, crash_s, scaled, n_unknown, crash_accs = 0.0, 0.0, 0.0, 0, 0, set()
        for r in eng["runs"]:
            same = rec[(rec["concurrency"] == r.concurrency) & (rec["max_tokens"] == r.max_tokens)
                       & (rec["outcome"] == "ok") & (rec["warmup"].astype(bool) == bool(r.warmup))]
            if r.warmup:
                warm_s += float(same["wall_s"].mean()) if len(same) else m["warmup_estimate_s"]
                continue
            at = same[same["acceptance"] == r.acceptance]
            if e["probe"]:
                n_unknown += 1
                unknown.append(r.id)
            elif len(at):
                runs_s += float(at["wall_s"].mean())
            elif len(same) and e["spec_method"] == "none":
                runs_s += float(same["wall_s"].mean())
            elif len(same) and same["acceptance_length"].notna().any():
                s = same.dropna(subset=["acceptance_length"])
                runs_s += float((s["wall_s"] * s["acceptance_length"] / r.acceptance).mean())
                scaled += 1
            else:
                n_unknown += 1
                unknown.append(r.id)
            here = rec[rec["concurrency"] == r.concurrency]
            at_acc = here["acceptance"] == r.acceptance
            if (at_acc & ~here["warmup"].astype(bool)).any():   # measured runs at its own acceptance there: that rate,
                here = here[at_acc]                               # not another's (a warm-up is too short)
            if len(here) and here["crashed"].any() and len(starts):
                crash_s += float(here["crashed"].mean()) * (float(starts.min()) + m["coredump_wait_s"] * bool(e["coredump"]))
                crash_accs |= {float(a) for a in here.loc[here["crashed"].astype(bool), "acceptance"]}
        rows.append({"engine": eng["id"], "mode": mode, "acceptance": eng["runs"][0].acceptance,
                     "start-up s (recorded)": ("none recorded" if not len(starts) else f"{starts.min():.0f}"
                                               if round(starts.min()) == round(starts.max())
                                               else f"{starts.min():.0f}-{starts.max():.0f}"),
                     "warm-ups s": round(warm_s), "runs s": round(runs_s), "crash restarts s": round(crash_s),
                     "_work": warm_s + runs_s + crash_s, "_crash_accs": sorted(crash_accs), "_crash_s": crash_s,
                     "runs scaled from another acceptance": scaled, "runs with no record": n_unknown,
                     "_cold": float(starts.max()) if len(starts) else None,
                     "_warm": float(starts.min()) if len(starts) else None})
    if any(r["_cold"] is None for r in rows):
        missing = [r["mode"] for r in rows if r["_cold"] is None]
        raise LabError(f"{matrix_path}: no recorded start-up for {missing}: cannot estimate its device time")
    work = sum(r["_work"] for r in rows)   # the rows show rounded seconds; the totals add the exact ones
    cold = staging_s + work + sum(r["_cold"] for r in rows)
    first_s, first_n = first_start_penalty(runs_df)
    warm = staging_s + work + sum(r["_warm"] for r in rows) + first_s
    elsewhere, borrowed_s = [], 0.0   # engines whose crash restarts come from crashes at other acceptances only
    for r in rows:
        r.pop("_cold"), r.pop("_warm"), r.pop("_work")
        accs, crash_s = r.pop("_crash_accs"), r.pop("_crash_s")
        if accs and r["acceptance"] not in accs:
            elsewhere.append(f"{r['engine']} at {r['acceptance']:g} (crashes recorded at {', '.join(f'{a:g}' for a in accs)})")
            borrowed_s += crash_s
    return {"engines": rows, "crash_rates_elsewhere": elsewhere, "borrowed_crash_s": round(borrowed_s, 1),
            "total_cold_s": round(cold, 1), "total_warm_s": round(warm, 1), "budget_s": budget_s,
            "staging_s": staging_s, "fits_cold": cold <= budget_s, "fits_warm": warm <= budget_s, "unknown": unknown,
            "first_start_s": round(first_s, 1), "first_start_sessions": first_n}


def summary_line(est: dict, matrix_path: str) -> str:
    """One line: the estimate against the budget."""
    u = est["unknown"]
    return (f"{matrix_path}: about {est['total_cold_s']:.0f} s of device time with every engine starting cold, "
            f"{est['total_warm_s']:.0f} s on warm caches (staging {est['staging_s']:.0f} s included"
            + (f"; a fresh host's first engine +{est['first_start_s']:.0f} s, the median over "
               f"{est['first_start_sessions']} recorded sessions" if est.get("first_start_sessions") else "")
            + f"), against "
            f"{est['budget_s']:.0f} s: {'fits' if est['fits_cold'] else 'does not fit'} cold, "
            f"{'fits' if est['fits_warm'] else 'does not fit'} warm"
            + (f"; {len(u)} run(s) with no record to estimate from: {', '.join(u[:6])}{'...' if len(u) > 6 else ''}"
               if u else "")
            + (f"; crash restarts from another acceptance's crash rate: {'; '.join(est['crash_rates_elsewhere'])}"
               f" (without them: {est['total_cold_s'] - est['borrowed_crash_s']:.0f} s cold, "
               f"{est['total_warm_s'] - est['borrowed_crash_s']:.0f} s warm)"
               if est.get("crash_rates_elsewhere") else ""))
