"""Discriminating runs: what the root cause predicts for each variant of the crash configuration, beside
what the engine did.

The root cause (notebooks 03 and 04): a target KV-cache group that reuses another group's FlashAttention
metadata at run time has FULL CUDA graphs that read its own builder's FA3 schedule, left stale since
capture. A run's prediction comes from its configuration alone, never from its outcome:

- **reuse**: vLLM 0.22.1's own grouping (``kvgroups``, run verbatim) gives the target an attention group that
  reuses another's metadata, for this run's speculative method and draft shape (DFlash's draft layers split
  the target's attention layers in two groups; MTP's one layer has the target's shape and does not);
- **FULL**: the target replays FULL graphs (``cudagraph_mode`` FULL_*, not ``--enforce-eager``);
- **FA3 schedule**: the target's attention backend keeps an ahead-of-time schedule in a builder buffer
  (FLASH_ATTN; TRITON_ATTN has none), and part 1 of the fix, which refreshes that buffer, is off.

With all three the stale schedule is read: at concurrency >= ``CRASH_CONCURRENCY`` (where every stock run has
crashed) the prediction is a crash; below it, "open" (the divergence starts at concurrency 2 already, where
the canary named it, but whether it turns into a fault depends on the values). Without one of them the
prediction is that the run completes. ``flash_attn_max_num_splits_for_cuda_graph=1`` keeps the stale schedule
but may make it harmless: "open", for the step probe to decide.

The engine's own log says what actually ran (``engine_facts``): the cudagraph mode vLLM resolved, whether FULL
decode graphs were captured, and the attention backends it chose (the target's first, the drafter's last).
A run predicted to complete counts as agreeing only if it also did the work: drafting on (nearly) every step.
"""

from __future__ import annotations

import gzip
import os
import re

from . import analysis, kvgroups

CRASH_CONCURRENCY = 32           # the lowest concurrency at which stock FULL_AND_PIECEWISE crashed in every run
MIN_DRAFTING_SHARE = 0.9         # a run that completes is a control only if this share of its output came
                                 # from drafting steps (num_drafts x acceptance length / output tokens)

_MODE_RE = re.compile(r"'cudagraph_mode': <CUDAGraphMode\.(\w+):")
_BACKEND_RES = (re.compile(r"Using AttentionBackendEnum\.(\w+) backend"),
                re.compile(r"Using (\w+) attention backend out of potential backends"))
_FULL_CAPTURE = "Capturing CUDA graphs (decode, FULL)"


def _read_text(path: str) -> str:
    if path.endswith(".gz"):
        with gzip.open(path, "rt", errors="replace") as fh:
            return fh.read()
    with open(path, errors="replace") as fh:
        return fh.read()


def engine_log(r, data_dir: str = "data") -> str | None:
    """The stored engine log of a run line: ``data/gpu/<runs file stem>/<log name>`` (or ``.gz``), else None."""
    log, f = r.get("log"), r.get("file")
    if not isinstance(log, str) or not isinstance(f, str):
        return None
    base = os.path.join(data_dir, "gpu", os.path.basename(f)[: -len(".jsonl")] if f.endswith(".jsonl") else f,
                        os.path.basename(log))
    for p in (base, base + ".gz"):
        if os.path.isfile(p):
            return p
    return None


def engine_facts(text: str) -> dict:
    """What an engine log says ran: the resolved cudagraph mode, whether FULL decode graphs were captured, the
    attention backends in the order vLLM chose them (target first, drafter last). None where the stored log
    does not say (logs over 3 MB are stored as their tail, without the start-up)."""
    modes = _MODE_RE.findall(text)
    found = []
    for line in text.splitlines():
        for rx in _BACKEND_RES:
            m = rx.search(line)
            if m:
                found.append(m.group(1))
                break
    started = bool(modes) or bool(found)
    return {"cudagraph_mode": modes[0] if modes else None,
            "full_graphs_captured": (_FULL_CAPTURE in text) if started else None,
            "target_attention": found[0] if found else None,
            "drafter_attention": found[-1] if len(found) > 1 else None}


def _attention_config(r) -> dict:
    ea = r.get("engine_args")
    return (ea.get("attention_config") or {}) if isinstance(ea, dict) else {}


def _draft_layers(r) -> int:
    d = r.get("draft")
    return int(d.get("layers") or 0) if isinstance(d, dict) else 0


def reuses_metadata(r) -> bool:
    """Does vLLM 0.22.1's grouping give this run's target an attention group reusing another's metadata?"""
    method = r.get("spec_method")
    if method == "dflash":
        layers = kvgroups.hybrid_layers(draft_layers=_draft_layers(r))
    elif method == "mtp":
        layers = kvgroups.hybrid_layers(mtp_layers=max(1, int(r.get("mtp_layers") or 1)))
    else:   # no speculation, ngram: no draft layers
        layers = kvgroups.hybrid_layers()
    return bool(kvgroups.metadata_reusers(kvgroups.groups(layers)))


def predict(r, facts: dict | None = None) -> tuple[str, str]:
    """("crash" | "completes" | "open", why) for a run line, from its configuration (and the engine's log
    facts where present: they override what the run asked for)."""
    facts = facts or {}
    parts = r.get("fix_parts")
    if r.get("fix") and not isinstance(parts, (list, tuple)):   # lines before fix_parts: fix 1 (no part 1)
        parts = []
    refresh = bool(r.get("fix")) and "fa3_schedule_refresh" in (parts or [])
    mode = facts.get("cudagraph_mode") or r.get("cudagraph_mode")
    backend = facts.get("target_attention") or _attention_config(r).get("backend") or "FLASH_ATTN"
    if not reuses_metadata(r):
        return "completes", "vLLM's grouping gives the target one attention group: no metadata reuse"
    if r.get("enforce_eager") or not str(mode).startswith("FULL") or facts.get("full_graphs_captured") is False:
        return "completes", "no FULL graph replays: attention reads the step's own schedule"
    if refresh:
        return "completes", "part 1 copies the step's schedule into the reusing group's graph buffer"
    if backend != "FLASH_ATTN":
        return "completes", f"{backend} keeps no ahead-of-time schedule in a builder buffer"
    if _attention_config(r).get("flash_attn_max_num_splits_for_cuda_graph") == 1:
        return "open", "the stale schedule is still read; with one split it may be harmless (the step probe decides)"
    if int(r.get("concurrency") or 0) >= CRASH_CONCURRENCY:
        return "crash", "the reusing group's FULL graphs read the stale FA3 schedule"
    return "open", (f"the stale schedule is read, but below concurrency {CRASH_CONCURRENCY} stock has not crashed "
                    "in every run")


def drafting_share(r) -> float | None:
    """Share of a completed run's output tokens that came from drafting steps: num_drafts x mean acceptance
    length / output tokens (1.0: every decode step drafted). None without spec-decode metrics."""
    m = r.get("spec_decode_metrics")
    out = r.get("output_tokens")
    if not isinstance(m, dict) or not m.get("num_drafts") or not isinstance(out, (int, float)) or not out:
        return None
    return m["num_drafts"] * float(m.get("acceptance_length") or 0.0) / float(out)


def configuration(r) -> str:
    """A run's engine configuration without what was attached to observe it (core dumps, hook, environment)."""
    return analysis.cell_label({**dict(r), "coredump": False, "hook_dir": None, "env": None})


def table(df, matrix_contains: str = "discriminate", data_dir: str = "data"):
    """One row per (GPU session, configuration, concurrency) of the runs whose matrix name contains
    ``matrix_contains``: prediction and why, crashed / runs (engines that never started counted apart),
    whether the outcome agrees, drafting, what the engine log says ran, the faulting kernels of core dumps,
    the instruments attached, the files."""
    import pandas as pd

    d = df[df["matrix"].astype(str).str.contains(matrix_contains, regex=False)].copy()
    d["configuration"] = [configuration(r) for _, r in d.iterrows()]
    stock = set(analysis.stock_full(d).index)
    rows = []
    for (session, cfg, conc), all_g in d.groupby(["gpu_session", "configuration", "concurrency"], dropna=False,
                                                 sort=False):
        g = all_g[all_g["outcome"] != "startup_error"]
        facts = []
        for _, r in g.iterrows():
            p = engine_log(dict(r), data_dir)
            facts.append(engine_facts(_read_text(p)) if p else {})
        preds = {predict(dict(r), f) for (_, r), f in zip(all_g.iterrows(), facts + [{}] * len(all_g))}
        pred = "; ".join(sorted({p for p, _ in preds}))
        why = "; ".join(sorted({w for _, w in preds}))
        completed = g[g["outcome"] == "ok"]
        shares = [s for s in (drafting_share(dict(r)) for _, r in completed.iterrows()) if s is not None]
        crashed = int(g["crashed"].sum())
        if not len(g):
            agrees = "- (no engine started)"
        elif pred == "crash":
            agrees = "yes" if crashed == len(g) else f"no: {len(g) - crashed} completed"
        elif pred == "completes":
            if crashed:
                agrees = f"no: {crashed} crashed"
            elif len(shares) < len(completed) or (shares and min(shares) < MIN_DRAFTING_SHARE):
                agrees = "not a control: drafted on too few steps"
            else:
                agrees = "yes" if len(completed) == len(g) else f"- ({len(g) - len(completed)} neither ok nor crashed)"
        else:
            agrees = "-"

        def seen(key):
            vals = {f.get(key) for f in facts if f.get(key) is not None}
            return ", ".join(sorted(map(str, vals))) if vals else "not in the stored log"

        faults = sorted({str(f["kernel"]) for f in (g["fault"] if "fault" in g else [])
                         if isinstance(f, dict) and f.get("kernel")})
        drafts = completed["spec_decode_metrics"].apply(
            lambda m: m.get("num_drafts") if isinstance(m, dict) else None).dropna()
        rows.append({"gpu_session": session, "configuration": cfg, "concurrency": int(conc),
                     "stock control": len(g) > 0 and set(g.index) <= stock and int(conc) >= CRASH_CONCURRENCY,
                     "prediction": pred, "why": why, "runs": len(g), "crashed": crashed,
                     "crashed / runs": f"{crashed} / {len(g)}",
                     "engine start failures": int((all_g["outcome"] == "startup_error").sum()),
                     "agrees": agrees,
                     "drafts per completed run": round(float(drafts.mean())) if len(drafts) else None,
                     "output from drafting steps": round(min(shares), 3) if shares else None,
                     "FULL decode graphs captured": seen("full_graphs_captured") if len(g) else "-",
                     "target attention (log)": seen("target_attention") if len(g) else "-",
                     "faulting kernel (core dump)": ", ".join(faults) or "-",
                     "instruments": "; ".join(sorted(set(g["instruments"]))) if len(g) else "-",
                     "files": ", ".join(sorted(set(all_g["file"])))})
    return pd.DataFrame(rows)


def session_summary(t, session: str) -> dict:
    """Counts of one session's rows: whether its stock control crashed, and how the predictions fared."""
    s = t[t["gpu_session"] == session]
    decided = s[s["prediction"].isin(["crash", "completes"]) & (s["runs"] > 0)]
    ctrl = s[s["stock control"]]
    return {"session": session, "rows": len(s), "decided": len(decided),
            "agree": int((decided["agrees"] == "yes").sum()),
            "disagree": int(decided["agrees"].str.startswith("no:").sum()),
            "not_controls": int(decided["agrees"].str.startswith("not a control").sum()),
            "stock_control_crashed": int(ctrl["crashed"].sum()), "stock_control_runs": int(ctrl["runs"].sum())}
