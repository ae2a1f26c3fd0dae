"""Discriminating runs: what the root cause predicts for each variant of the crash configuration, beside
what the engine did.

The root cause (notebooks 03 and 04): a target KV-cache group that reuses another group's FlashAttention
metadata at run time has FULL CUDA graphs that read its own builder's FA3 schedule, left stale since
capture. A run's prediction comes from its configuration alone, never from its outcome:

- **reuse**: vLLM 0.22.1's own grouping (``kvgroups``, run verbatim) gives the target two attention groups of
  one spec, for this run's speculative method and draft shape (DFlash's draft layers split the target's attention
  layers in two groups; MTP's one layer has the target's shape and does not), *and* the target's attention
  builder reuses metadata across them (``supports_update_block_table``, read from the backend's 0.22.1 source:
  FLASH_ATTN does, TRITON_ATTN does not and builds every group's metadata itself);
- **FULL**: the target replays FULL graphs (``cudagraph_mode`` FULL_*, not ``--enforce-eager``);
- **FA3 schedule**: the target's attention backend keeps an ahead-of-time schedule in a builder buffer
  (FLASH_ATTN on an H200, i.e. FA3; FA2 has none, not separated here), and part 1 of the fix, which refreshes that
  buffer, is off.

Which of these a variant removes matters: TRITON_ATTN removes the reuse itself (and the schedule with it), so it
cannot tell the stale FA3 schedule from FlashAttention's metadata reuse in general; part 1 alone removes only the
stale schedule, which makes it the specific test.

With all three the stale schedule is read: at concurrency >= ``CRASH_CONCURRENCY`` (where every stock run has
crashed) the prediction is a crash; below it, "open" (the divergence starts at concurrency 2 already, where
the canary named it, but whether it turns into a fault depends on the values). Without one of them the
prediction is that the run completes. ``flash_attn_max_num_splits_for_cuda_graph=1`` keeps the stale schedule
but may make it harmless: "open", for the step probe to decide.

The engine's own log says what actually ran (``engine_facts``): the cudagraph mode vLLM resolved, whether FULL
decode graphs were captured (counted only once start-up finished: an engine that died during capture says nothing
about it), and the attention backends it chose (the target's first, the drafter's last). A run predicted to complete
counts as agreeing only if it also did the work: ``drafting_share`` >= ``MIN_DRAFTING_SHARE``, a proxy for drafting on
nearly every step.
"""

from __future__ import annotations

import ast
import math
import re

from . import analysis, kvgroups
from .errors import LabError
from .vllm_sources import read_source

CRASH_CONCURRENCY = 32           # the concurrency the discriminating variants ran at, where stock crashed in every run
                                 # (below it stock's outcome depends on the concurrency: s20-s21, 8 crashed, 12 and 16 completed)
MIN_DRAFTING_SHARE = 0.9         # a run that completes is a control only if this share of its output came
                                 # from drafting steps (num_drafts x acceptance length / output tokens)

_MODE_RE = re.compile(r"'cudagraph_mode': <CUDAGraphMode\.(\w+):")
_BACKEND_RES = (re.compile(r"Using AttentionBackendEnum\.(\w+) backend"),
                re.compile(r"Using (\w+) attention backend out of potential backends"))
_FULL_CAPTURE = "Capturing CUDA graphs (decode, FULL)"
_STARTED = "init engine (profile, create kv cache, warmup model) took"   # vLLM's line once start-up has finished
# the plugin's line for each FA3 builder whose split bound it changed (dflash_lab.splits)
_SPLITS_RE = re.compile(r"FA3 splits: (drafter|target) builder of .*?: max_num_splits (\d+) -> (\d+)")
BACKEND_SOURCES = {"FLASH_ATTN": "vllm/v1/attention/backends/flash_attn.py",   # AttentionBackendEnum -> module
                   "TRITON_ATTN": "vllm/v1/attention/backends/triton_attn.py",  # (vLLM's registry.py)
                   "FLASHINFER": "vllm/v1/attention/backends/flashinfer.py",
                   "FLEX_ATTENTION": "vllm/v1/attention/backends/flex_attention.py"}
_REUSE_FLAG = {}


def builder_reuses_metadata(backend: str) -> bool | None:
    """Does this backend's metadata builder set ``supports_update_block_table = True`` in vLLM 0.22.1's source (the
    condition under which ``_build_attn_group_metadata`` reuses a group's metadata for the next group of the same
    spec)? None for a backend not listed in ``BACKEND_SOURCES``."""
    if backend not in BACKEND_SOURCES:
        return None
    if backend not in _REUSE_FLAG:
        tree = ast.parse(read_source(BACKEND_SOURCES[backend]))
        builders = [c for c in tree.body if isinstance(c, ast.ClassDef) and c.name.endswith("MetadataBuilder")]
        if not builders:
            raise LabError(f"{BACKEND_SOURCES[backend]}: no *MetadataBuilder class (vLLM source changed?)")
        flag = False
        for c in builders:
            for st in c.body:
                if (isinstance(st, (ast.AnnAssign, ast.Assign)) and isinstance(st.value, ast.Constant)
                        and any(isinstance(t, ast.Name) and t.id == "supports_update_block_table"
                                for t in (st.targets if isinstance(st, ast.Assign) else [st.target]))):
                    flag = flag or bool(st.value.value)
        _REUSE_FLAG[backend] = flag
    return _REUSE_FLAG[backend]


def engine_facts(text: str) -> dict:
    """What an engine log says ran: the resolved cudagraph mode, whether FULL decode graphs were captured, the
    attention backends in the order vLLM chose them (target first, drafter last), the FA3 split bounds the
    plugin changed. None where the stored log
    does not say (logs over 3 MB are stored as their tail, without the start-up)."""
    modes = _MODE_RE.findall(text)
    found = []
    for line in text.splitlines():
        for rx in _BACKEND_RES:
            m = rx.search(line)
            if m:
                found.append(m.group(1))
                break
    bounds = sorted({f"{side} {a} -> {b}" for side, a, b in _SPLITS_RE.findall(text)})
    return {"cudagraph_mode": modes[0] if modes else None,
            "full_graphs_captured": (_FULL_CAPTURE in text) if _STARTED in text else None,
            "target_attention": found[0] if found else None,
            "drafter_attention": found[-1] if len(found) > 1 else None,
            # e.g. "drafter 32 -> 1": the FA3 split bounds the plugin changed (None: the log shows none)
            "split_bounds_changed": "; ".join(bounds) or None}


def _attention_config(r) -> dict:
    ea = r.get("engine_args")
    return (ea.get("attention_config") or {}) if isinstance(ea, dict) else {}


def _draft(r) -> dict:
    d = r.get("draft")
    return d if isinstance(d, dict) else {}


def reuses_metadata(r) -> bool:
    """Does vLLM 0.22.1's grouping give this run's target two attention groups of one spec (the second reusing the
    first's metadata when the backend's builder allows it)? The draft's layer count and attention shape come from
    the run line (the project's assumed shape when the line has none)."""
    method = r.get("spec_method")
    if method == "dflash":
        d = _draft(r)
        shape = (int(d.get("kv_heads") or 4), int(d.get("head_dim") or 128))
        layers = kvgroups.hybrid_layers(draft_layers=int(d.get("layers") or 0), draft_attn=shape)
    elif method == "mtp":
        layers = kvgroups.hybrid_layers(mtp_layers=max(1, int(r.get("mtp_layers") or 1)))
    else:   # no speculation, ngram: no draft layers
        layers = kvgroups.hybrid_layers()
    return bool(kvgroups.metadata_reusers(kvgroups.groups(layers)))


def _target_one_split(r) -> bool:
    """Whether the plugin bounded the target's FA3 splits for FULL graphs to 1 (``fa_splits: target:1``). The
    drafter's bound does not touch the target's reusing group, so it changes no prediction."""
    v = r.get("fa_splits")
    return isinstance(v, str) and v.replace(" ", "") == "target:1"


def predict(r, facts: dict | None = None) -> tuple[str, str]:
    """("crash" | "completes" | "open", why) for a run line, from its configuration (and the engine's log
    facts where present: they override what the run asked for)."""
    facts = facts or {}
    refresh = "fa3_schedule_refresh" in analysis.fix_parts_of(r)
    mode = facts.get("cudagraph_mode") or r.get("cudagraph_mode")
    backend = facts.get("target_attention") or _attention_config(r).get("backend") or "FLASH_ATTN"
    if not reuses_metadata(r):
        return "completes", "vLLM's grouping gives the target one attention group: no metadata reuse"
    reuse = builder_reuses_metadata(backend)
    if reuse is None:
        return "open", f"{backend}: this project has not read whether its builder reuses metadata"
    if not reuse:
        return "completes", (f"{backend}'s builder does not reuse metadata across groups (supports_update_block_table "
                             "False): every group builds its own, and no ahead-of-time schedule is kept")
    if r.get("enforce_eager") or not str(mode).startswith("FULL") or facts.get("full_graphs_captured") is False:
        return "completes", "no FULL graph replays: attention reads the step's own schedule"
    if refresh:
        return "completes", "part 1 copies the step's schedule into the reusing group's graph buffer"
    if backend != "FLASH_ATTN":
        return "open", f"{backend} reuses metadata; whether its FULL graphs read a stale builder buffer is not modelled"
    if _attention_config(r).get("flash_attn_max_num_splits_for_cuda_graph") == 1 or _target_one_split(r):
        return "open", "the stale schedule is still read; with one split it may be harmless (the step probe decides)"
    if int(r.get("concurrency") or 0) >= CRASH_CONCURRENCY:
        return "crash", "the reusing group's FULL graphs read the stale FA3 schedule"
    return "open", (f"the stale schedule is read; below concurrency {CRASH_CONCURRENCY} whether it ends in a crash "
                    "depends on the concurrency in a way the mechanism does not model")


def drafting_share(r) -> float | None:
    """Share of a completed run's output tokens that came from drafting steps: num_drafts x mean acceptance
    length / output tokens (1.0: every decode step drafted). None without spec-decode metrics."""
    m = r.get("spec_decode_metrics")
    out = r.get("output_tokens")
    if not isinstance(m, dict) or not isinstance(out, (int, float)) or not math.isfinite(out) or out <= 0:
        return None
    drafts, length = m.get("num_drafts"), m.get("acceptance_length")
    if not isinstance(drafts, (int, float)) or not isinstance(length, (int, float)) or not drafts \
            or not math.isfinite(drafts) or not math.isfinite(length):
        return None
    return drafts * float(length) / float(out)


def configuration(r) -> str:
    """A run's engine configuration without what was attached to observe it (core dumps, hook, hang snapshot,
    environment)."""
    return analysis.cell_label({**dict(r), "coredump": False, "hook_dir": None, "env": None, "hang_snapshot": False})


def table(df, matrix_contains: str = "discriminate", data_dir: str = "data"):
    """One row per (GPU session, configuration, concurrency) of the runs whose matrix name contains
    ``matrix_contains``: prediction and why, crashed / runs, whether the outcomes agree, drafting, what the engine
    log says ran, the faulting kernels of core dumps, the instruments attached, the files. Engines that never
    started and runs the session deadline cut short measured nothing: they are counted apart, not as runs."""
    import pandas as pd

    d = df[df["matrix"].astype(str).str.contains(matrix_contains, regex=False)].copy()
    d["configuration"] = [configuration(r) for _, r in d.iterrows()]
    d["_cut"] = [analysis.is_deadline_cut(r) for _, r in d.iterrows()]
    stock = set(analysis.stock_full(d).index)
    facts = {}
    for i, r in d.iterrows():
        p = analysis.engine_log(dict(r), data_dir) if r["outcome"] != "startup_error" else None
        facts[i] = engine_facts(analysis.read_text(p)) if p else {}
    rows = []
    for (session, cfg, conc), all_g in d.groupby(["gpu_session", "configuration", "concurrency"], dropna=False,
                                                 sort=False):
        g = all_g[(all_g["outcome"] != "startup_error") & ~all_g["_cut"]]
        preds = {predict(dict(r), facts[i]) for i, r in all_g.iterrows()}
        pred = "; ".join(sorted({p for p, _ in preds}))
        why = "; ".join(sorted({w for _, w in preds}))
        completed = g[g["outcome"] == "ok"]
        crashed = int(g["crashed"].sum())
        other = g[(g["outcome"] != "ok") & ~g["crashed"]]
        other_txt = ", ".join(f"{n} {o}" for o, n in other["outcome"].value_counts().items())
        shares = [drafting_share(dict(r)) for _, r in completed.iterrows()]
        if not len(g):
            agrees = "- (no run measured)"
        elif pred == "crash":
            agrees = "yes" if crashed == len(g) else "no: " + ", ".join(
                x for x in (f"{len(completed)} completed" if len(completed) else "", other_txt) if x)
        elif pred == "completes":
            if crashed or len(other):
                agrees = "no: " + ", ".join(x for x in (f"{crashed} crashed" if crashed else "", other_txt) if x)
            elif any(x is None or x < MIN_DRAFTING_SHARE for x in shares):
                agrees = "not a control: no evidence of drafting on nearly every step"
            else:
                agrees = "yes"
        else:
            agrees = "-"

        def seen(key):
            vals = {facts[i].get(key) for i in g.index if facts[i].get(key) is not None}
            return ", ".join(sorted(map(str, vals))) if vals else "not in the stored log"

        faults = sorted({str(f["kernel"]) for f in (g["fault"] if "fault" in g else [])
                         if isinstance(f, dict) and f.get("kernel")})
        dumps = sum(1 for f in (g["fault"] if "fault" in g else []) if isinstance(f, dict) and f.get("kernel"))
        drafts = completed["spec_decode_metrics"].apply(
            lambda m: m.get("num_drafts") if isinstance(m, dict) else None).dropna()
        known = [x for x in shares if x is not None]
        rows.append({"gpu_session": session, "configuration": cfg, "concurrency": int(conc),
                     "stock control": len(g) > 0 and set(g.index) <= stock and int(conc) >= CRASH_CONCURRENCY,
                     "prediction": pred, "why": why, "runs": len(g), "crashed": crashed,
                     # below the concurrency where stock crashes in every run, a completed run tells nothing apart
                     "discriminates": int(conc) >= CRASH_CONCURRENCY,
                     "crashed / runs": f"{crashed} / {len(g)}",
                     "other outcomes": other_txt or "-",
                     "not measured": int((all_g["outcome"] == "startup_error").sum() + all_g["_cut"].sum()),
                     "agrees": agrees,
                     "drafts per completed run": round(float(drafts.mean())) if len(drafts) else None,
                     "output from drafting steps": round(min(known), 3) if known else None,
                     "FULL decode graphs captured": seen("full_graphs_captured") if len(g) else "-",
                     "target attention (log)": seen("target_attention") if len(g) else "-",
                     "FA3 split bounds changed (log)": seen("split_bounds_changed") if len(g) else "-",
                     "runs whose log shows a changed split bound": sum(1 for i in g.index if facts[i].get("split_bounds_changed")),
                     "faulting kernel (core dump)": ", ".join(faults) or "-",
                     "crashed runs with a core dump": f"{dumps} of {crashed}" if crashed else "-",
                     "core dumps": dumps,
                     "instruments": "; ".join(sorted(set(g["instruments"]))) if len(g) else "-",
                     "files": ", ".join(sorted(set(all_g["file"])))})
    return pd.DataFrame(rows)


def session_summary(t, session: str) -> dict:
    """Counts of one session's rows: whether its stock control crashed, and how the predictions fared (decided:
    rows at or above the crash concurrency with a crash/completes prediction and a measured run)."""
    s = t[t["gpu_session"] == session]
    decided = s[s["prediction"].isin(["crash", "completes"]) & (s["runs"] > 0) & s["discriminates"]]
    ctrl = s[s["stock control"]]
    return {"session": session, "rows": len(s), "decided": len(decided),
            "agree": int((decided["agrees"] == "yes").sum()),
            "disagree": int(decided["agrees"].str.startswith("no:").sum()),
            "min_drafting_share": (float(decided["output from drafting steps"].dropna().min())
                                   if decided["output from drafting steps"].notna().any() else None),
            "not_controls": int(decided["agrees"].str.startswith("not a control").sum()),
            "stock_control_crashed": int(ctrl["crashed"].sum()), "stock_control_runs": int(ctrl["runs"].sum())}


def controlled_sessions(t) -> list[str]:
    """GPU sessions whose own stock control crashed: only their variant runs can be compared with stock."""
    return sorted({s for s in t["gpu_session"].dropna()
                   if session_summary(t, s)["stock_control_crashed"] > 0}, key=analysis.session_key)


def variant(t, configuration: str, concurrency: int = CRASH_CONCURRENCY) -> dict:
    """One configuration at one concurrency over every session whose stock control crashed: the runs measured,
    how many crashed, whether every measured row agreed with its prediction, the lowest drafting share, the
    faulting kernels and what the engine logs say ran. ``runs`` is 0 when no such session measured it."""
    sessions = controlled_sessions(t)
    v = t[(t["configuration"] == configuration) & (t["concurrency"] == concurrency)
          & t["gpu_session"].isin(sessions) & (t["runs"] > 0)]
    shares = v["output from drafting steps"].dropna()
    drafts = v["drafts per completed run"].dropna()
    kernels = sorted({k for x in v["faulting kernel (core dump)"] for k in str(x).split(", ") if k and k != "-"})
    return {"configuration": configuration, "concurrency": concurrency,
            "sessions": list(dict.fromkeys(v["gpu_session"])),
            "runs": int(v["runs"].sum()), "crashed": int(v["crashed"].sum()),
            "predictions": sorted(set(v["prediction"])),
            "all_agree": bool(len(v)) and bool((v["agrees"] == "yes").all()),
            "min_drafting_share": float(shares.min()) if len(shares) else None,
            "min_drafts_per_run": int(drafts.min()) if len(drafts) else None,
            "faulting_kernels": kernels,
            "target_attention": sorted({x for x in v["target attention (log)"] if x not in ("-", "not in the stored log")}),
            "split_bounds_changed": sorted(set(v["FA3 split bounds changed (log)"])),
            "runs_with_split_bound_log": int(v["runs whose log shows a changed split bound"].sum()),
            "core_dumps": int(v["core dumps"].sum()),
            "full_graphs_captured": sorted(set(v["FULL decode graphs captured"]))}
