"""``reports/findings.html``: one self-contained page for the issue thread (figures embedded, no code).

Built from the same recorded data as the notebooks (``data/``) and the figures the notebooks
just wrote (``figures/``); every number on the page is computed here from those files.
"""

from __future__ import annotations

import base64
import glob
import html
import json
import numbers
import os
import re
import time
from collections import Counter
from pathlib import Path

from . import analysis, atomic
from .errors import LabError

# A paragraph break inside a summary item. A clause that opens a new topic (a matrix's test, a path, a session) begins
# with it; the page renders each paragraph on its own, the topic that opens it in bold (:func:`item_html`).
PARA = "\n\n"


def topic_of(para: str) -> str | None:
    """The topic that opens a paragraph, to print in bold: the words before its first ':' or '?' (the '?' kept), or
    before a parenthesis whose close is followed by ':' ("Who wrote it (matrix, session): ..."); None when there is
    no such short opening (at most 70 characters before it), or when the paragraph opens in lower case (an entry of a
    list, such as the faulting kernels' "offline, TP=1, ...", not a topic)."""
    if not para[:1].isupper() and not para[:1].isdigit():
        return None
    m = re.match(r"[^:?(;]{1,70}?(?=:|\?| \()", para)
    if not m:
        return None
    head, rest = m.group(0), para[m.end():]
    if rest[0] == ":":
        return head
    if rest[0] == "?":
        return head + "?"
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "(") - (ch == ")")
        if ch == ")" and depth == 0:
            return head if rest[i + 1:i + 2] == ":" else None
    return None


def item_html(text: str) -> str:
    """One summary item as HTML paragraphs: split at :data:`PARA`, each paragraph escaped, its opening topic
    (:func:`topic_of`) in bold."""
    out = []
    for para in (p.strip() for p in text.split(PARA)):
        if not para:
            continue
        head = topic_of(para)
        out.append(f"<p><b>{html.escape(head)}</b>{html.escape(para[len(head):])}</p>" if head
                   else f"<p>{html.escape(para)}</p>")
    return "".join(out)


def _img(path: Path) -> str:
    if not path.exists():
        return f"<p><i>(figure {path.name} not rendered)</i></p>"
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{path.name}" style="max-width:100%" src="data:image/png;base64,{data}">'


def _rows(df, cols) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in cols) + "</tr>"
                   for _, r in df.iterrows())
    return f"<table border=1 cellpadding=4 style='border-collapse:collapse'><tr>{head}</tr>{body}</table>"


def write_findings(root: Path, out: Path) -> Path:
    from . import divergence

    with divergence.shared_probes():  # its clauses read the same probe logs many times over
        return _write_findings(root, out)


def _write_findings(root: Path, out: Path) -> Path:
    from . import divergence, kvgroups, verification

    os.chdir(root)
    df = analysis.load_runs()
    ct = analysis.crash_table(df)

    def cell(label, conc, exact=True):
        sel = ct[(ct["cell"] == label if exact else ct["cell"].str.contains(label, regex=False)) & (ct["concurrency"] == conc)]
        return f"{int(sel['crashed'].sum())}/{int(sel['runs'].sum())}" if len(sel) and sel["runs"].sum() else "not run"

    prov = df.iloc[0]
    sig = analysis.crash_signatures(df)
    ft = analysis.fault_table(df)
    named = ft[ft["faulting kernel"] != "no core dump"]
    # one entry per (path, configuration, kernel, exception, source), with the number of core dumps that named it
    # (the path keeps TP=2's or the server's dumps apart from the offline TP=1 ones of the same configuration)
    each = [f"{r['path']}, {r['cell']}: {r['faulting kernel']} ("
            + (r["exception"] if isinstance(r["exception"], str) else "no core file read")   # a crash whose core never came
            + (f", {r['source']}" if isinstance(r["source"], str) else "") + ")" for _, r in named.iterrows()]
    # a paragraph per entry: the page lists them
    faults = "".join(f"{PARA}{e} x{each.count(e)} dumps." if each.count(e) > 1 else f"{PARA}{e}."
                     for e in dict.fromkeys(each))
    pt = verification.probe_table(df)
    # stock's own configuration under the probe; the log that reached the most requests per FULL step (the
    # concurrency-32 run that ends in NaN) is described, the others (fewer requests per FULL step) are summed up beside it
    sp = pt[pt["configuration"] == verification.STOCK_PROBE].sort_values("max requests in a FULL step", kind="stable")
    stock_probe = divergence.load_probe(sp.iloc[-1]["path"]) if len(sp) else None
    low = sp.iloc[:-1]
    fd = divergence.first_divergence(stock_probe) if stock_probe else None
    nan = divergence.nan_onset(stock_probe) if stock_probe else None
    reuse = kvgroups.metadata_reusers(kvgroups.groups(kvgroups.hybrid_layers(draft_layers=5)))
    from .models import PUBLISHED_DRAFT

    pub = PUBLISHED_DRAFT["shape"]
    d8_runs = analysis.load_runs(published_draft=True)
    d8_fix = verification.draft8_fix_predictions(d8_runs)
    d8_std = d8_fix[d8_fix["prediction"].str.startswith("(standard)")] if len(d8_fix) else d8_fix
    ran_pub = draft8_gpu_clause([r for _, _, r in analysis.recorded_lines("data/runs/*.jsonl")
                                 if r.get("matrix") == verification.DRAFT8_MATRIX], d8_fix,
                                verification.pair_evidence(d8_runs, d8_std["gpu_session"].iloc[0]) if len(d8_std) else None)
    same_split = (kvgroups.reusing_layers(kvgroups.hybrid_layers(draft_layers=pub["layers"],
                                                                 draft_attn=(pub["kv_heads"], pub["head_dim"])))
                  == kvgroups.reusing_layers(kvgroups.hybrid_layers(draft_layers=5)) != [])
    fixed = df[df["fix"] == True]
    fix2 = analysis.rows_where(fixed, lambda r: analysis.fix_label(r).startswith("fix 2"))
    fix1 = analysis.rows_where(fixed, lambda r: analysis.fix_label(r).startswith("fix 1"))
    from . import crashstates

    stock_all = analysis.stock_full(df)
    stock_all = stock_all[~stock_all.apply(analysis.is_deadline_cut, axis=1)]
    on_path = lambda d, mode: d[(d["mode"].fillna("offline") == mode) & (d["tensor_parallel_size"] == 1)]
    stock, server = on_path(stock_all, "offline"), on_path(stock_all, "server")
    eager = df[(df["spec_method"] == "dflash") & (df["enforce_eager"] == True)]
    greedy = lambda g: " (greedy: temperature 0)" if crashstates.all_greedy(g) else ""
    others = "; ".join(f"{c}: {analysis.breakdown(stock[stock.concurrency == c])}{greedy(stock[stock.concurrency == c])}"
                       for c in sorted(set(stock["concurrency"])) if c != 32)
    low_crash, mid_ok = crashstates.not_monotonic(stock)
    crash_everywhere = sorted(int(c) for c, g in stock.groupby("concurrency") if len(g) and g["crashed"].all())
    acc88 = on_path(analysis.stock_full(df, acceptance=crashstates.REPORT_STATES["report crash A"]["acceptance (mean length)"]),
                    "offline")
    cv = crashstates.client_view(df)
    server_line = (
        ("The OpenAI server at TP=1 (streamed chat completions from N concurrent clients, the report's prompt, 512 tokens): "
         + "; ".join(f"concurrency {c}: {analysis.breakdown(server[server.concurrency == c])}" for c in sorted(set(server["concurrency"])))
         + (f". Clients of a crashed server got HTTP {', '.join(sorted(set(cv['HTTP statuses']), key=_numbers_in))} and then, inside the stream, "
            f"{', '.join(sorted(set(cv['first error body'].dropna())))}; requests already finished completed." if len(cv) else "."))
        if len(server) else "The OpenAI server path: not run on the GPU yet.")
    bench_runs = _bench_runs(root)   # read once: the speed sentence and the server sentence both use it
    server_line += _bench_stock_clause(root, bench_runs)
    server_line += _tp2_clause(df, stock_all, crashstates.rank_faults(df), stock)
    rope = analysis.compiled_kernel("triton_poi_fused_2")
    # crashes whose process outlived the core dump (keep-running): the engine log shows which device asserts failed
    keep = ft[ft["cell"].str.contains("keep running", regex=False)]
    both = [t for t in keep["device asserts (engine log)"] if rope and all(a in t for a in rope["device_asserts"])]
    summary = [
        f"Workaround today: cudagraph_mode=PIECEWISE (--compilation-config '{{\"cudagraph_mode\": \"PIECEWISE\"}}'): "
        f"{cell('dflash k=15, PIECEWISE', 32, exact=False)} runs crashed at concurrency 32, against "
        f"{int(stock[stock.concurrency == 32]['crashed'].sum())}/{len(stock[stock.concurrency == 32])} for the default "
        f"FULL_AND_PIECEWISE." + _splits1_warning(pt) + _stock_loss_clause(bench_runs),
        f"Reproduced: DFlash k=15 + FULL_AND_PIECEWISE graphs on the real-size Qwen3.6-35B-A3B architecture (dummy weights, "
        f"synthetic acceptance 1.86, TP=1, H200, offline engine) dies on a CUDA fault (cudaErrorIllegalAddress in the "
        f"runs without core dumps; with core dumps on, the driver ends the process after writing the core unless it keeps "
        f"running (skip_abort)) at concurrency 32: "
        f"{analysis.breakdown(stock[stock.concurrency == 32])}"
        + (f"; at other concurrencies, {others} (repeats of the seeded workload are close replicas, not independent samples)"
           if others else "")
        + f"; --enforce-eager {int(eager['crashed'].sum())}/{len(eager)} at 32."
        + (PARA + f"Not monotonic in concurrency in the runs so far: {_with_sessions(stock, low_crash)} crashed where "
           f"{_with_sessions(stock, mid_ok)} completed"
           + (f" (each of these concurrencies also ran in GPU session {', '.join(_short(x) for x in common)})" if (common := _common_sessions(
               stock, low_crash + mid_ok)) else " (never in one GPU session)") + "."
           if low_crash and mid_ok else "")
        + (PARA + "At synthetic acceptance 8.8 (the report's crash A acceptance), stock offline TP=1: "
           + "; ".join(f"concurrency {c}: {analysis.breakdown(acc88[acc88.concurrency == c])}" for c in sorted(set(acc88["concurrency"])))
           + _first_position(acc88) + "." if len(acc88) else ""),
        server_line,
        f"Faulting kernels, from CUDA core dumps, per path and configuration:{faults or ' none recorded.'}"
        f"{PARA}All are consumers of values that were already wrong"
        + (f"; triton_poi_fused_2 is defined only in the drafter's compiled graph (vLLM compile tag "
           f"{', '.join(rope['defined_in'])}): its fused q/k norm + RoPE, whose device asserts bound the position index "
           "(the drafter's positions are written by the DFlash input kernel, so this is consistent with the same chain "
           f"ending one kernel later) into the RoPE cache ({'; '.join(rope['device_asserts'])})"
           + (f"; in {len(both)} of {len(keep)} crashes whose process outlived the core dump, the engine log shows both "
              "asserts failing, after the DFlash input kernel's fault where the core names that kernel first (the positions "
              "themselves are not printed)" + _without_asserts(keep, rope) if len(keep) else
              "; which assert fired is not recorded")
           if rope else "")
        + ".",
    ]
    if fd:
        summary.append(
            f"First wrong value (step probe, one run at concurrency {sp.iloc[-1]['reached']}, every "
            f"FULL-graph step replayed against a no-graph pass of the same step): "
            f"from the first FULL step (step {fd['step']}, {fd['num_reqs']} requests) on, {fd['hidden_rows_differ']} of "
            f"{fd['num_tokens']} output rows differ; "
            + ("layers 0-7 write bit-identically, " if fd["all_before_bit_identical"] else "")
            + f"the first layer writing differently is "
            f"{divergence.short(fd['first_layer_written_differently'])}: the output of attention layer 7 diverged."
            + (f" The first {nan['num_tokens']}-token replay (step {nan['step']}, {nan['num_reqs']} requests) is NaN in "
               f"{nan['rows_nonfinite_graph']} rows, the reference pass in {nan['rows_nonfinite_reference']}." if nan else "")
            + (PARA + f"Stock probed with fewer requests per FULL step too ({len(low)} probe log(s), concurrency "
               f"{_concurrencies(low)}): {int(low['FULL steps diverging'].sum())} "
               f"of {int(low['FULL steps'].sum())} FULL steps diverge"
               + (f" (the other {int(low['FULL steps ended by an error'].sum())}: a crash step, whose pass ended in a CUDA "
                  "error before the comparison)" if int(low['FULL steps'].sum() - low['FULL steps diverging'].sum())
                  == int(low['FULL steps ended by an error'].sum()) > 0 else "")
               + ", each log first at "
               f"{', '.join(sorted(set(low['first layer written differently'].dropna())))}; "
               + _low_nan(low) + "." if len(low) else "")
            + _unwritten_clause(df, pt) + oor_clause(df))
    can = verification.canary_table(df)
    stock_can = can[(can["fix"] == "stock") & (can["field"] == "attn.scheduler_metadata")]
    summary.append(
        "Root cause: the DFlash draft of the runs (5 layers, an assumed shape) makes vLLM split the target's 10 attention "
        "layers into two KV-cache groups of the same spec"
        + (f" (so does the published draft's shape, {pub['layers']} layers as public material quotes its config and as "
           "0.22.1 builds them, all full attention, by vLLM's own grouping code on the CPU; "
           + (ran_pub + ")" if ran_pub else "not yet run on the GPU)") if same_split else
           f" (the published draft's shape, {pub['layers']} layers as public material quotes its config, would not: "
           "vLLM's own grouping code on the CPU)")
        + "; at run time the second group "
        f"({', '.join(str(kvgroups.layer_index(x)) for r in reuse for x in r['layers'])}) reuses the first group's "
        "FlashAttention metadata (update_block_table), while its FULL graphs were captured reading its own builder's "
        "persistent FA3 scheduler_metadata, which nothing refreshes after capture. Eager and PIECEWISE read the metadata "
        "object and are right. Without DFlash (or with MTP) the target's attention layers form one group (vLLM's own "
        "grouping code, run on the CPU)."
        + (f" On the GPU the synchronous canary names it: stock at concurrency {int(stock_can['concurrency'].iloc[0])} "
           f"stopped at step {int(stock_can['step'].iloc[0])} on attn.scheduler_metadata of KV-cache group "
           f"{int(stock_can['group'].iloc[0])}." if len(stock_can) else " The canary naming the stale field has not run on the GPU.")
        + upstream_clause(root))
    sessions = verification.sessions_with_fix2(df)
    fix_line = (f"Fix: the plugin copies the reused schedule into the group's own buffer (patches/vllm-0.22.1-dflash.diff, "
                f"hunk 1, is the same change for upstream); on vLLM's own update_block_table/build code, with the one modelled "
                f"fact that a FULL graph reads its builder's buffer, the graph then reads the step's schedule, for the plugin and "
                f"for the diff's own code (tests/test_root_cause.py fails without it). The earlier kernel-only fix crashed "
                f"{int(fix1['crashed'].sum())}/{len(fix1)}.")
    if sessions:
        cs = verification.counts_session(df)
        v = verification.verdict(verification.session_table(df, cs))
        fp = verification.untapped(pt[pt["fix"].str.startswith("fix 2")])
        fix_line += (PARA + f"GPU session {cs}, through the plugin: stock control crashed {v['stock_crashed']}/{v['stock_runs']}; "
                     "with the fix "
                     + ", ".join(f"concurrency {c}: {v['fix_runs'][c] - v['fix_not_ok'][c]}/{v['fix_runs'][c]} completed"
                                 for c in (32, 16, 64))
                     + (f"; the step probe with the fix ({len(fp)} engine(s), concurrency {_concurrencies(fp)}, up to "
                        f"{int(fp['max requests in a FULL step'].max())} requests per FULL step): the target's outputs on all "
                        f"{int(fp['FULL steps'].sum())} FULL-graph steps identical to a no-graph pass of the same step with the "
                        f"same metadata ({int(fp['FULL steps diverging'].sum())} differ)" if len(fp) else "") + ".")
        p1 = verification.untapped(pt[pt["fix"] == "part 1 only: FA3 schedule refresh"])
        if len(p1):
            fix_line += (PARA + f"Part 1 alone (the schedule copy, no kernel edits, no k+1) under the step probe ({len(p1)} engine(s), "
                         f"up to {int(p1['max requests in a FULL step'].max())} requests per step): "
                         f"{int(p1['FULL steps'].sum()) - int(p1['FULL steps diverging'].sum())} of {int(p1['FULL steps'].sum())} "
                         "FULL-graph steps identical to the no-graph pass.")
        wsc = verification.fix_where_stock_crashes(df)
        f2 = wsc[wsc["fix"] == "fix 2 (all parts)"]
        ev, no_ev = f2[f2["stock there"] == "crashes"], f2[f2["stock there"] == "completes"]
        never = sorted(set(crash_everywhere) - set(f2["concurrency"]))
        fix_line += (PARA + "Where offline TP=1 stock crashes every run, the fix (TP=1) completed "
                     + ", ".join(f"{x} at concurrency {c}" for c, x in zip(ev["concurrency"], ev["fix completed / runs"]))
                     + (f"; at {', '.join(map(str, no_ev['concurrency']))} TP=1 stock completes too, so the fix's runs there are no "
                        "evidence about the crash" if len(no_ev) else "")
                     + (f"; the fix has not run at {', '.join(map(str, never))}, where stock crashes" if never else "") + "."
                     + _part1_line(wsc))
        fix_line += _diff_line(df, pt) + _diff_rest_line(df, pt) + _diff_server_line(df)
        fix_line += PARA + _end_to_end_line(df)
    else:
        fix_line += f" GPU runs with it: {len(fix2)}."
    summary.append(fix_line)
    summary.append(_discriminating_line(df) + _splits1_probe_clause(pt))
    summary.append(
        "Ruled out as the cause: the report's buffer-vs-capture-size suspicion (no drafter batch pads for its "
        "configuration, notebook 01); the DFlash input kernel's unmasked last_pos load is a real out-of-bounds read "
        "(notebook 02) but it is reached only after the wrong values exist.")
    summary.append(bench_line(root, bench_runs))
    # the thread reads top down: the crash and its cause first, the detail after, the benchmark's per-session
    # recommendations (the longest item; the glance table above holds its numbers) last
    summary = summary[:1] + sorted(summary[1:], key=_summary_rank)
    # a run the runner's deadline cut measured nothing and is not among the runs: its own column says how many there were
    evidence = ct[["cell", "concurrency", "acceptance", "tensor_parallel_size", "crashed / runs", "cut_by_deadline",
                   "files"]].rename(columns={"cut_by_deadline": "cut by the runner's deadline (not counted)"})
    cmds = [
        (_repro_min_label(root), "python scripts/repro_min.py"),
        ("Reproduce (GPU host, after scripts/gpu/setup.sh)", "python -m dflash_lab run matrices/repro-tp1.yaml --out data/runs/NEW.jsonl"),
        ("The step probe and the core dumps", "matrices/root-probe-tp1.yaml; matrices/root-coredump-tp1.yaml"),
        ("Fix verification", "matrices/verify-fix-a-tp1.yaml, -b-, -c- (one GPU session); matrices/verify-fix-d-tp1.yaml "
                             "(tokens and throughput against PIECEWISE, with its own stock control)"),
        ("Discriminating runs (stock control first, then each variant x3)",
         "python -m dflash_lab run matrices/discriminate2-tp1.yaml --out ... [--skip-done data/runs/*discriminate2*.jsonl]"),
        ("Isolation cells", "python -m dflash_lab run matrices/isolate-tp1.yaml --out ...; matrices/isolate2-tp1.yaml; matrices/localize-blocking-tp1.yaml"),
        ("Replay a launch record (CPU)", "python -m dflash_lab replay data/records/req0_all_rejected.npz --json"),
        ("Render everything (CPU)", "make report"),
    ]
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>dflash-lab findings</title></head>
<body style="font-family:sans-serif;max-width:70em;margin:2em auto">
<h1>DFlash + CUDA graphs: cudaErrorIllegalAddress in vLLM 0.22.1 - findings</h1>
<h2>Workaround, and the speed to expect</h2>{item_html(summary[0])}
{glance_html(bench_runs)}
<h2>Summary</h2><ol>{''.join(f'<li>{item_html(s)}</li>' for s in summary[1:])}</ol>
<h2>Evidence: crashed runs / runs</h2>{_rows(evidence, list(evidence.columns))}
<p>Crash signature: {html.escape(sig[0]['error']) if sig else 'none'}</p>
<h2>Figures</h2>
{_img(root / 'figures' / '03-divergence.png')}
{_img(root / 'figures' / '03-crash_matrix.png')}
{_img(root / 'figures' / '01-drafter_batches.png')}
{_img(root / 'figures' / '01-grid_heatmap.png')}
<h2>Reproduce</h2><ul>{''.join(f'<li>{html.escape(a)}: <code>{html.escape(b)}</code></li>' for a, b in cmds)}</ul>
<h2>Environment of the GPU runs</h2>
<p>{html.escape(str(prov['gpu']))}, driver {html.escape(str(prov['driver']))}, vLLM {html.escape(str(prov['vllm_version']))},
torch {html.escape(str(prov['torch_version']))}, Triton {html.escape(str(prov['triton_version']))};
target: {html.escape(str(prov['target']['architecture']))}; weights: dummy (vLLM load_format=dummy);
draft: {html.escape(json.dumps(prov['draft']))} (assumed shape).</p>
<p>Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} from data/ by <code>make report</code>.</p>
</body></html>"""
    return atomic.write_text(out / "findings.html", page)


def _v2_reuse(v2: dict) -> str:
    if not v2.get("present"):
        return "no V2 runner"
    if not v2.get("reuses metadata"):
        return "its V2 runner reuses no metadata"
    if v2.get("reuse limited to Mamba"):
        return ("its V2 runner reuses metadata only for Mamba groups"
                + (", at capture as at run time" if v2.get("capture takes the reuse path too") else ""))
    return "its V2 runner's reuse rule is not read"


def _absent_because(r: dict) -> str:
    """Why a release's verdict is 'absent', from the fact that failed (upstream.check's order)."""
    g, v1, fa = r["grouping"], r["v1 runner"], r["flash_attn builder"]
    if not v1["present"]:
        why = "no V1 runner; " + _v2_reuse(r["v2 runner"])
    elif g.get("checked") and not g["reusing attention groups"]:
        why = "its grouping puts the target's attention layers in one group"
    elif fa.get("reusing group's graph reads the capture's schedule") is False:
        why = "its update_block_table gives the reusing group's graph the step's schedule"
    else:
        why = "its V1 runner does not hand a later group the first group's metadata at run time only"
    return why + ("; the DFlash input kernel is gone too" if r.get("dflash input kernel", "") is None else "")


def draft8_gpu_clause(lines: list[dict], fix_standard=None, pairs=None) -> str:
    """What the GPU runs with the published draft's shape (``matrices/draft8-c32-tp1.yaml``'s run lines) measured, per
    engine, for the root-cause sentence (inside its parentheses); "" while none is recorded. Runs that measured nothing
    (a start-up error, a deadline cut) are not counted. Stock's crashes are split by session where there are several,
    and the fix's runs are counted per session, naming whether that session's stock crashed (the fix-claim standard's
    control). ``fix_standard``: :func:`verification.draft8_fix_predictions`'s table (``draft8-fix-c32-tp1``, the
    standard with this shape), said as not run while empty; ``pairs``: :func:`verification.pair_evidence` of its
    session, which says where its greedy pairs' runs came after their engines' starts."""
    from . import verification

    if not lines:
        return ""
    measured = [r for r in lines if r.get("outcome") != "startup_error" and not analysis.is_deadline_cut(r)]
    by = {e: [r for r in measured if r.get("engine_id") == e] for e in verification.DRAFT8_PLANNED}
    stock, fix, pw = by["d8-stock-snap-c32"], by["d8-fix-c32"], by["d8-piecewise-c32"]
    runs = lambda n: f"{n} run" + ("" if n == 1 else "s")   # noqa: E731
    short = lambda rs: sorted({analysis.short_session(r.get("gpu_session")) for r in rs},   # noqa: E731
                              key=lambda x: analysis.session_key(str(x)))
    crashed = lambda rs: sum(analysis.is_crash(r) for r in rs)   # noqa: E731
    in_session = lambda rs, s: [r for r in rs if analysis.short_session(r.get("gpu_session")) == s]   # noqa: E731
    complete = lambda rs: sum(r.get("outcome") == "ok"   # noqa: E731
                              and int(r.get("requests_completed") or 0) == int(r["concurrency"]) for r in rs)
    out = []
    if stock:
        kernels = sorted({verification.fault_kernel(r) for r in stock if verification.fault_kernel(r)})
        each = short(stock)
        out.append(f"its stock engine crashed {crashed(stock)} of {runs(len(stock))} at "
                   + " and ".join(str(c) for c in sorted({int(r["concurrency"]) for r in stock}))
                   + (" (" + ", ".join(f"{crashed(in_session(stock, x))} of {len(in_session(stock, x))} in {x}"
                                       for x in each) + ")" if len(each) > 1 else "")
                   + (f", the core naming {', '.join(kernels)}" if kernels else ""))
    if fix:
        per = [f"{complete(in_session(fix, x))} of {runs(len(in_session(fix, x)))} in {x}"
               + (", beside that session's stock crashes" if crashed(in_session(stock, x))
                  else ", where stock did not crash") for x in short(fix)]
        out.append("the fix completed " + " and ".join(per)
                   + (" (sampled: its tokens not compared with a reference path)"
                      if all(float(r.get("temperature") or 0) > 0 for r in fix) else ""))
    if pw:
        out.append(f"PIECEWISE completed {complete(pw)} of {runs(len(pw))}")
    if not out:
        return "its GPU runs measured nothing yet; notebook 03"
    sessions = short(measured)
    missing = [name for name, rs in (("the fix", fix), ("PIECEWISE", pw)) if not rs]
    return (f"on the GPU, in session{'s' if len(sessions) > 1 else ''} {' and '.join(sessions)}, " + "; ".join(out)
            + (f"; {' and '.join(missing)} {'has' if len(missing) == 1 else 'have'} not run with it" if missing else "")
            + _fix_standard_clause(fix_standard, pairs) + "; notebook 03")


def _pair_places(pairs) -> str:
    """Where a failed greedy comparison's runs came after their engines' starts, when the two sides differ: the
    synthetic acceptance draws from one generator seeded at engine start, so such pairs compared different draws."""
    col = "runs before it on its engine (FULL, reference)"
    if pairs is None or not len(pairs) or col not in pairs:
        return ""
    places = [tuple(int(v) for v in x.split(", ")) for x in pairs[col] if "None" not in x]
    if not places or all(a == b for a, b in places):
        return ""
    span = lambda xs: f"{min(xs)}-{max(xs)}" if min(xs) != max(xs) else str(xs[0])   # noqa: E731
    return (f" (its paired runs came {span([a for a, _ in places])} runs after the fixed engine's start and "
            f"{span([b for _, b in places])} after PIECEWISE's, so they compared different synthetic-acceptance draws)")


def _verdict(x) -> bool | None:
    """A prediction table's ``held`` as True, False or None (None, NaN or pd.NA: not judged); numpy's bools too."""
    import pandas as pd

    if x is None or (not isinstance(x, (bool, int)) and pd.isna(x)):
        return None
    return bool(x)


def _fix_standard_clause(t, evidence=None) -> str:
    """The fix-claim standard with the published draft's shape (``draft8-fix-c32-tp1``), from its judged table and
    (``evidence``) :func:`verification.pair_evidence` of its session."""
    from . import verification

    name = verification.DRAFT8_FIX_MATRIX
    if t is None:
        return ""
    if not len(t):
        return f"; the fix-claim standard with it ({name}: 10 runs, outputs compared) has not run"
    std = t[t["prediction"].str.startswith("(standard)")].iloc[0]
    d = t[t["prediction"].str.startswith("(d) the greedy")]
    planned = t[t["prediction"].str.startswith("(d) greedy pairs measured")]
    pairs = list(d["measured"])
    each = ", ".join(pairs)
    judged = [_verdict(x) for x in d["held"]]
    all_planned = not len(planned) or _verdict(planned["held"].iloc[0]) is True   # the row draft8_fix_predictions adds
    if not pairs:
        outputs = "no greedy pair compared, so the output part is not met"
    elif None in judged:   # None or NaN: not judged
        outputs = (f"greedy pairs with PIECEWISE {each} requests token-identical, not all judged, so the output part "
                   "is undecided")
    elif all(judged):
        outputs = (f"greedy pairs with PIECEWISE {each} requests token-identical, as predicted (>= "
                   f"{verification.DRAFT8_FIX_MIN_IDENTICAL} of 32)"
                   + ("" if all_planned else f", but only {len(pairs)} of the planned pairs measured"))
    else:
        outputs = (f"greedy pairs with PIECEWISE {each} requests token-identical, short of the predicted "
                   f"{verification.DRAFT8_FIX_MIN_IDENTICAL} of 32, so the output part is not met as pre-registered"
                   + _pair_places(evidence))
    return (f"; the fix-claim standard with it ({name}, session {analysis.short_session(std['gpu_session'])}): "
            f"fixed runs beside a crashed stock control {std['measured']} (the count "
            f"{'met' if std['held'] else 'not met'}), {outputs}")


def upstream_clause(root) -> str:
    """Later vLLM releases (``data/upstream/releases.jsonl``, :mod:`dflash_lab.upstream`): where the precondition
    is in their own code and in which runner, where it is not and why; "" while nothing is recorded."""
    from . import upstream

    path = Path(root) / "data" / "upstream" / "releases.jsonl"
    if not path.is_file():
        return ""
    rows = sorted(upstream.load(path), key=lambda r: upstream.version_key(r["version"]))
    by = {v: [r for r in rows if r["verdict"] == v] for v in upstream.VERDICTS}
    names = lambda rs: ", ".join(r["version"] for r in rs)   # noqa: E731
    parts = []
    if by[upstream.PRESENT]:
        parts.append(f"in {names(by[upstream.PRESENT])} the precondition is in the V1 model runner, the one this engine "
                     "gets by default by the release's own rule: the target's attention split into groups of one spec, "
                     "a later group handed the first group's metadata at run time only, and the release's "
                     "update_block_table leaving its captured graph on the capture's FA3 schedule")
    if by[upstream.OPT_IN]:
        v2 = sorted({_v2_reuse(r["v2 runner"]) for r in by[upstream.OPT_IN]})
        parts.append(f"in {names(by[upstream.OPT_IN])} it is still in the V1 runner, but by the release's rule this engine "
                     f"gets the V2 runner by default ({'; '.join(v2)}): there the precondition needs "
                     "VLLM_USE_V2_MODEL_RUNNER=0")
    for r in by[upstream.ABSENT]:
        parts.append(f"in {r['version']} it is absent ({_absent_because(r)})")
    if by[upstream.UNDECIDED]:
        parts.append("not decided from the source: " + names(by[upstream.UNDECIDED]))
    return (PARA + "Later vLLM releases (their own sources, read on the CPU by python -m dflash_lab upstream-check, "
            "each wheel's sha256 from PyPI's index; not runs): " + "; ".join(parts) + "." + _published_draft_clause(rows)
            + release_runs_clause(root))


def _published_draft_clause(rows) -> str:
    """What the records say of the published draft's shape (8 layers: ``grouping``'s
    :data:`upstream.PUBLISHED_GROUPING`) and of a draft mixing sliding and full layers (:data:`upstream.DRAFT_WINDOWS`),
    computed from them; "" for records without those fields (written before s70)."""
    from . import upstream, verification

    layers = verification.DRAFT8_REUSING_LAYERS
    said = ", ".join(str(x) for x in layers)

    names = lambda rs: _ranges([r["version"] for r in rs], [r["version"] for r in rows])   # noqa: E731
    pub = [r["grouping"].get(upstream.PUBLISHED_GROUPING) for r in rows]
    out = ""
    if rows and all(g and g.get("checked") for g in pub):
        split = [r for r, g in zip(rows, pub) if [x["layers"] for x in g["reusing attention groups"]] == [layers]]
        rest = [r for r in rows if r not in split]
        lead = f" With the published draft's {upstream.PUBLISHED_SHAPE['layers']} layers "
        if not split:
            out += lead + (f"no release's grouping puts the target's attention layers {said} in a group that "
                           "reuses another's metadata.")
        else:
            out += (lead + "the grouping of "
                    + (f"every release read ({names(split)})" if not rest else names(split))
                    + f" still puts the target's attention layers {said} in a group that reuses another's "
                    "metadata" + (f" (not so in {names(rest)})" if rest else "") + ".")
    win = [r.get(upstream.DRAFT_WINDOWS) for r in rows]
    if rows and all(w and w.get("checked") for w in win):
        full = [r for r, w in zip(rows, win) if w["mixed sliding and full layers"] == upstream.WIN_IGNORED]
        out += (" If the published checkpoint mixes sliding-window and full layers (public sources disagree), "
                + (f"only {names(full)} of these build" if full else "none of these builds")
                + " such a draft as full attention (as 0.22.1 does) in the V1 runner, where the precondition is: the "
                "others refuse it, run it on the V2 runner or build its windows (notebook 04; read, not run).")
    return out


def _ranges(versions: list[str], order: list[str]) -> str:
    """``versions`` as runs of releases consecutive in ``order`` (every release read, oldest first): "0.26.0-0.33.0",
    a run of two as "0.23.0 and 0.24.0", runs joined by commas."""
    idx = sorted(order.index(v) for v in versions)
    runs, start = [], None
    for i, k in enumerate(idx):
        if start is None:
            start = k
        if i + 1 == len(idx) or idx[i + 1] != k + 1:
            a, b = order[start], order[k]
            runs.append(a if a == b else f"{a} and {b}" if k == start + 1 else f"{a}-{b}")
            start = None
    return ", ".join(runs)


def release_runs_clause(root) -> str:
    """The GPU runs of later releases (``data/upstream/runs/``, :func:`upstream.gpu_runs`) beside the 0.22.1 controls
    of their sessions; without any: that none has run."""
    from . import upstream

    up = Path(root) / "data" / "upstream" / "runs" / "*.jsonl"
    if not glob.glob(str(up)):
        return " Whether any of them crashes has not been run (notebook 04)."
    t = upstream.gpu_runs(str(up), str(Path(root) / "data" / "runs" / "*.jsonl"))
    said = []
    for r in _merged_sampling(t):
        ctrl = r["0.22.1 controls (same session and configuration)"]
        if r.get("diff"):
            beside = " (an engine with a diff: no stock 0.22.1 engine is its control)"
        elif not ctrl:
            beside = ", with no 0.22.1 control in that session"
        elif r["0.22.1 crashed"]:
            beside = (f", where the same engine on 0.22.1 crashed {r['0.22.1 crashed']} of {ctrl} in that session "
                      f"(core: {r['0.22.1 cores']})")
        else:
            beside = f", and the same engine on 0.22.1 crashed in none of {ctrl} in that session"
        said.append(f"{r['vLLM']} {'crashed ' + str(r['crashed']) + ' of ' if r['crashed'] else 'completed '}"
                    f"{r['runs'] if r['crashed'] else str(r['completed']) + ' of ' + str(r['runs'])} runs "
                    f"({r['configuration']}; session {analysis.short_session(r['GPU session'])})" + beside)
    out = PARA + "On the GPU (notebook 04): " + "; ".join(said) + "."
    quiet = t[(t["crashed"] == 0) & (t["0.22.1 crashed"] > 0) & (t["vLLM"] == "0.26.0")]
    rec = Path(root) / "data" / "upstream" / "releases.jsonl"
    kept = sorted((r["version"] for r in (upstream.load(rec) if rec.is_file() else [])
                   if upstream._link4(r.get("recovered token")).startswith("no (")), key=upstream.version_key)
    if len(quiet) and "0.26.0" in kept:
        out += (" Read from 0.26.0's source, not measured: the grouping, the V1 runner's reuse and the FlashAttention "
                f"builder's schedule are as in 0.22.1, while vLLM PR #44744 (from {kept[0]}, by upstream-check's reading of "
                "each release's kernel) keeps the rejection sampler's recovered id inside the vocabulary, so a NaN row no "
                "longer loses its token, which the GDN and DFlash input kernels then misread: wrong values need no "
                "longer end in a crash.")
    out += release_greedy_clause(root)
    if len(quiet) and "0.26.0" in kept:
        out += " Releases after 0.26.0 pin torch 2.13 or 2.14, which the GPU host lacks."
    return out


def _merged_sampling(t) -> list[dict]:
    """The rows of :func:`upstream.gpu_runs` with one engine's sampled and greedy rows of a session as one (the matrices
    run both kinds in one engine: 3 at temperature 0.7 and 2 greedy), their counts summed and the configuration naming
    each kind's share ("512 tokens, 3 at temperature 0.7 and 2 greedy"). Rows merge only within one set of matrices
    (the configuration string leaves out fields that tell engines apart: target, engine arguments, environment), only
    when none crashed (a merged count would not say which kind crashed), and never one with 0.22.1 controls with one
    without. A row alone is as it was."""
    groups: dict[tuple, list[dict]] = {}
    for _, r in t.iterrows():
        parts = r["configuration"].split(", ")
        kind = [i for i, x in enumerate(parts) if x == "greedy" or x.startswith("temperature ")]
        rest = ", ".join(x if i not in kind else "{sampling}" for i, x in enumerate(parts))
        key = (r["vLLM"], r["GPU session"], rest if len(kind) == 1 and not r["crashed"] else r["configuration"],
               bool(r.get("diff")), bool(r["0.22.1 controls (same session and configuration)"]), r.get("matrices"))
        groups.setdefault(key, []).append(dict(r, _sampling=parts[kind[0]] if len(kind) == 1 else None))
    out = []
    for (_, _, rest, _, _, _), rows in groups.items():
        if len(rows) == 1:
            out.append(rows[0])
            continue
        m = dict(rows[0])
        for col in ("runs", "crashed", "completed", "0.22.1 controls (same session and configuration)", "0.22.1 crashed"):
            m[col] = sum(int(x[col]) for x in rows)
        m["0.22.1 cores"] = ", ".join(dict.fromkeys(c for x in rows for c in str(x["0.22.1 cores"] or "").split(", ")
                                                    if c and c != "-")) or rows[0]["0.22.1 cores"]
        share = " and ".join(f"{x['runs']} {'greedy' if x['_sampling'] == 'greedy' else 'at ' + x['_sampling']}"
                             for x in rows)
        m["configuration"] = rest.replace("{sampling}", share)
        out.append(m)
    return out


def release_greedy_clause(root) -> str:
    """What the greedy runs of the acceptance-6.0 matrices (s66's, run in s67) measured against the reference-path
    outputs of their workload (:func:`upstream.greedy_against_reference`); empty while none is recorded."""
    from . import upstream

    up, runs = str(Path(root) / "data" / "upstream" / "runs" / "*.jsonl"), str(Path(root) / "data" / "runs" / "*.jsonl")
    data = str(Path(root) / "data")
    try:
        d = upstream.release_frame([upstream.ACC6_RELEASE_MATRIX, upstream.ACC6_CONTROL_MATRIX], up, runs)
    except LabError:        # no line of these matrices recorded: nothing to say
        return ""
    pool = upstream.run_pool(up, runs)
    try:
        per = upstream.greedy_against_reference(d, pool, data_dir=data)
    except LabError as e:   # a greedy run without a reference or without its outputs: said, not a broken page
        return f" The greedy runs of {upstream.ACC6_RELEASE_MATRIX} could not be judged: {e}."
    every = upstream.reference_summary(per)
    s = every[every["graphs"] == "FULL_AND_PIECEWISE"] if len(every) else every
    new, old = (s[s["vLLM"] == v] if len(s) else s for v in ("0.26.0", "0.22.1"))
    if new.empty:
        return ""

    def off(g):   # "k of n" requests off the reference, per run
        return ", ".join(sorted({f"{int(b) - int(a)} of {b}" for a, b in (x.split("/") for x in
                                                                           g["requests equal to a reference output"])}))

    t = upstream.acc6_runs(d, data)
    counted = sorted({f"{v:.3f}" for v in t[(t["vLLM"] == "0.26.0") & (t["temperature"] == 0)
                                             & (t["graphs"] == "FULL_AND_PIECEWISE")]["counted acceptance"]})
    ends = bool((new["tokens off the reference"] == new["of them at step ends"]).all())
    sess = ", ".join(sorted({analysis.short_session(x) for x in new["GPU session"]}))
    ref = per.iloc[0]
    out = (f" Measured in session {sess} (concurrency 8, synthetic acceptance 6.0, greedy; notebook 04): in each of "
           f"0.26.0's {len(new)} FULL_AND_PIECEWISE runs, {off(new)} requests left the outputs that the reference-path "
           f"runs of this prompt give ({ref['reference runs']} stock {ref['reference graphs']} runs on vLLM "
           f"{ref['reference vLLM']})."
           + (" Every wrong token was a step's last one, the target's own sample." if ends else "")
           + (" None had a non-finite log-probability" if not new["non-finite log-probabilities"].sum() else
              f" {int(new['non-finite log-probabilities'].sum())} sampled tokens had a non-finite log-probability")
           + f", and vLLM counted {', '.join(counted)} tokens per step.")
    if len(old):
        out += (f" The same engine on 0.22.1 in that session left them in {off(old)} requests, with "
                f"{int(old['non-finite log-probabilities'].sum())} non-finite log-probabilities.")
    out += (" With dummy weights the distributions are nearly flat, so a small numerical difference can flip a greedy "
            f"choice; the reference outputs differ only within their first "
            f"{int(ref['reference outputs differ within the first'])} tokens.")
    pw = every[(every["vLLM"] == "0.26.0") & (every["graphs"] == "PIECEWISE")] if len(every) else every
    if not len(pw):
        out += " 0.26.0's own PIECEWISE engine has not run at that shape."
    else:
        out += (f" 0.26.0's own PIECEWISE engine (session "
                f"{', '.join(sorted({analysis.short_session(x) for x in pw['GPU session']}))}"
                f") gave the reference output in {_requests_equal(pw)} requests of its {len(pw)} greedy runs, its "
                f"requests' log-probabilities within {pw['max |dlogprob| vs request 0'].max():.3f} of request 0's "
                f"(stock FULL's in session {sess}, along the tokens its requests share with request 0 before they part: "
                f"up to {new['max |dlogprob| vs request 0'].max():.2f}).")
    wrong = {analysis.short_session(x) for x, eq in zip(new["GPU session"], new["requests equal to a reference output"])
             if eq.split("/")[0] != eq.split("/")[1]}
    right = {analysis.short_session(x) for x in new["GPU session"]} - wrong
    return out + _release_part1_clause(up, runs, data, wrong, right)


def _requests_equal(table, column: str = "requests equal to a reference output") -> str:
    """'k of n' over a column of per-run 'k/n' counts: requests equal to a reference output (a
    :func:`upstream.reference_summary`), or identical to PIECEWISE's (:func:`upstream.session_agreement`)."""
    pairs = [tuple(int(v) for v in x.split("/")) for x in table[column]]
    return f"{sum(a for a, _ in pairs)} of {sum(b for _, b in pairs)}"


def _release_part1_clause(up, runs, data, stock_wrong, stock_right=frozenset()) -> str:
    """What the fix's part 1 ported to 0.26.0 (:data:`upstream.PART1_RELEASE_MATRIX`) measured: its predictions
    (:func:`upstream.part1_predictions`) and its greedy runs against the same session's 0.26.0 PIECEWISE runs
    (:func:`upstream.session_agreement`); until it has run, that no run has tested the cause on 0.26.0.
    ``stock_wrong``: the sessions (short labels) whose stock 0.26.0 FULL greedy runs left the reference output;
    ``stock_right``: those whose stock FULL greedy runs all gave it (where a part-1 session has one of these, the wrong
    tokens did not recur beside part 1 and the session tested nothing). The
    stale schedule is concluded to be the cause only where such a session also ran part 1, with every prediction
    held and the part-1 runs paired with PIECEWISE of their session (the standard: an intervention beside its own
    control); otherwise the sentence says what the runs are consistent with and what would decide it."""
    from . import upstream

    try:
        pred, s = upstream.part1_predictions(up, runs, data_dir=data)
    except LabError:
        return " No run has tested the stale schedule as the cause on 0.26.0."
    d = upstream.release_frame([upstream.PART1_RELEASE_MATRIX], up, runs)
    sessions = {analysis.short_session(x) for x in d["gpu_session"]}
    sess = ", ".join(sorted(sessions))
    held = list(pred["held"])
    verdict = ("all four predictions written before its runs held" if all(h is True for h in held) else
               "its predictions written before the runs: " + ", ".join(
                   f"{p.split(')')[0]}) {'held' if h is True else 'failed' if h is False else 'not decided'}"
                   for p, h in zip(pred["predicted"], held)))
    out = (f" With only the fix's part 1 ported to 0.26.0 (patches/vllm-0.26.0-part1.diff: 0.22.1's FlashAttention "
           f"schedule refresh, the same lines), the same FULL_AND_PIECEWISE engine (session {sess}) gave the reference "
           f"output in {_requests_equal(s) if len(s) else '0 of 0'} requests of its {len(s)} greedy runs ({verdict})")
    sa = upstream.session_agreement([upstream.ACC6_RELEASE_MATRIX, upstream.PART1_RELEASE_MATRIX], up, runs, data)
    ours = set(zip(d["gpu_session"], d["run_id"]))
    sa = sa[[x in ours for x in zip(sa["GPU session"], sa["run"])]] if len(sa) else sa
    if len(sa):
        out += (f"; against 0.26.0 PIECEWISE of the same session, round by round, "
                f"{_requests_equal(sa, 'identical requests')} requests had identical tokens, log-probabilities within "
                f"{sa['max |dlogprob| vs reference'].max():.3f} of PIECEWISE's (PIECEWISE's own spread between requests "
                f"of one run: {sa['max |dlogprob| within the reference run'].max():.3f})")
    if not (len(s) and all(h is True for h in held)):
        return out + "."
    paired = {analysis.short_session(x) for x in sa["GPU session"]} if len(sa) else set()
    beside = sorted(set(stock_wrong) & sessions)
    if set(beside) & paired:
        beside = sorted(set(beside) & paired)
        return out + (f". In session {', '.join(beside)} stock FULL left the reference output beside it: part 1 changes "
                      "nothing but the schedule the FULL graph reads, so at this shape the stale schedule is what makes "
                      "0.26.0's target tokens wrong.")
    if beside:
        return out + (f". In session {', '.join(beside)} stock FULL left the reference output beside it, but no 0.26.0 "
                      "PIECEWISE run of that session pairs with part 1's runs: not concluded.")
    clean = sorted(set(stock_right) & sessions)
    if clean and stock_wrong:
        return out + (f". In session {', '.join(clean)} stock FULL gave the reference output too, so that session "
                      f"did not test the cause: stock FULL's wrong tokens (session {', '.join(sorted(stock_wrong))}) "
                      "did not recur beside part 1.")
    if not stock_wrong:
        return out + (". No stock FULL greedy run has left the reference output, so part 1 has no wrong tokens to be set "
                      "against.")
    return out + (". That is what the stale schedule as the cause predicts, but stock FULL's wrong tokens were measured in "
                  f"session {', '.join(sorted(stock_wrong))}, on another host: it is decided when stock FULL "
                  "and part 1 run in one session.")


def _bench_runs(root):
    """Every bench line under ``root`` (:func:`bench.load_bench`), or None when none is recorded."""
    from . import bench

    pattern = str(Path(root) / "data" / "bench" / "*.jsonl")
    return bench.load_bench(pattern) if glob.glob(pattern) else None


def _tp2_clause(df, stock_all, ranks, tp1_offline) -> str:
    """Stock offline runs at tensor parallelism 2 (issue 12): crashed / runs per concurrency beside TP=1's, what
    each rank's core dump named, and the TP=2 controls (:func:`_tp2_controls`). Empty when none ran."""
    tp2 = stock_all[(stock_all["mode"].fillna("offline") == "offline") & (stock_all["tensor_parallel_size"] == 2)]
    if not len(tp2):
        return ""
    per_c = "; ".join(
        f"concurrency {c}: {int(g['crashed'].sum())}/{len(g)} crashed"
        + (f" (TP=1: {int(t['crashed'].sum())}/{len(t)})" if len(t := tp1_offline[tp1_offline.concurrency == c]) else "")
        for c, g in tp2.groupby("concurrency"))
    gpus = ", ".join(sorted({f"{int(n)} x {g}" for g, n in zip(tp2.get("gpu", []), tp2.get("gpu_count", []))
                             if isinstance(g, str) and isinstance(n, numbers.Number) and n == n}))
    r2 = ranks[ranks["path"] == "offline, TP=2"]
    crashes = ""
    if len(r2):
        named = r2["kernels"].value_counts()
        crashes = (f"; the {len(r2)} crashes' core dumps name " + ", ".join(f"{k} ({n})" for k, n in sorted(named.items()))
                   + f"; in {int(r2['same kernel on every rank'].sum())} of {len(r2)} every rank's core names the same "
                   "kernel; the dump that finished first was "
                   + ", ".join(f"{p}'s {n} times" for p, n in sorted(r2["dump finished first"].value_counts().items()))
                   + (" (triton_poi_fused_3: the drafter's RoPE kernel, TP=1's triton_poi_fused_2, compiled for one "
                      "rank; notebook 03)" if r2["kernels"].str.contains("triton_poi_fused_3", regex=False).any() else ""))
    return (PARA + f"Offline at TP=2 ({gpus + '; ' if gpus else ''}NVLink multicast off, as the runner sets it for every engine; "
            f"{', '.join(sorted(set(tp2['gpu_session'].dropna())))}): {per_c}{crashes}. " + _tp2_controls(df, stock_all))


def _tp2_controls(df, stock_all) -> str:
    """The TP=2 PIECEWISE control, the fix and the stock server, each per path and concurrency, or named as not run."""
    d = df[df["tensor_parallel_size"] == 2]
    d = d[~d.apply(analysis.is_deadline_cut, axis=1)] if len(d) else d
    dflash = d[(d["spec_method"] == "dflash") & (d["enforce_eager"] != True)]
    pw = dflash[(dflash["cudagraph_mode"] == "PIECEWISE") & (dflash["fix"] != True)]
    fix = dflash[(dflash["cudagraph_mode"] == "FULL_AND_PIECEWISE") & (dflash["fix"] == True)]
    srv = stock_all[(stock_all["mode"] == "server") & (stock_all["tensor_parallel_size"] == 2)]

    def per_path(runs, what, not_run):
        if not len(runs):
            return not_run
        return "; ".join(f"{what}, {mode}: " + ", ".join(f"concurrency {c}: {analysis.breakdown(g)}"
                                                         for c, g in m.groupby("concurrency"))
                         for mode, m in runs.groupby(runs["mode"].fillna("offline")))

    parts = [per_path(pw, "DFlash PIECEWISE at TP=2", "The PIECEWISE control at TP=2: not run yet"),
             per_path(fix, "DFlash FULL_AND_PIECEWISE with the fix at TP=2", "the fix at TP=2: not run yet"),
             per_path(srv, "stock at TP=2", "the server at TP=2: not run yet")]
    return "; ".join(parts) + "."


_UNREAD = object()   # a caller that did not read the bench lines: the function reads them itself


def _bench_stock_clause(root, runs=_UNREAD) -> str:
    """The benchmark's stock FULL server engine (issue 11) as crash evidence, per synthetic acceptance: its crashed /
    runs per concurrency and vLLM's error text, the kernels core dumps named where the engine took them (s26's took
    none), vLLM's counters over the crashed runs, and the completed runs whose counters fell below the schedule (tokens
    lost without a crash); or "" when the benchmark has no stock runs."""
    from . import crashstates

    stock = _bench_runs(root) if runs is _UNREAD else runs
    if stock is None:
        return ""
    stock = stock[stock["mode"] == crashstates.BENCH_STOCK]
    if stock.empty:
        return ""
    parts = []
    for acc, g in stock.groupby("acceptance", sort=True):
        concs = sorted({int(c) for c in g["concurrency"]})
        row, states = crashstates.bench_stock(g, concs)
        errors = sorted({st["CUDA error"] for st in states})
        parts.append(
            f"at synthetic acceptance {acc:g} ({', '.join(_short(x) for x in sorted(set(g['gpu_session'])))}; "
            f"{row['instruments attached']}): " + "; ".join(f"concurrency {c}: {row[c]} crashed" for c in concs)
            + (f"; crash steps of {'/'.join(str(st['num_running_reqs']) for st in states)} running requests, "
               f"{'/'.join(str(st['total_num_scheduled_tokens']) for st in states)} scheduled tokens; vLLM printed "
               f"{', '.join(errors)}" if states else "")
            + (f"; core dumps name {row['faulting kernel (core dump)']}" if row["faulting kernel (core dump)"]
               not in ("-", "no crash", "no core dump") else "; no core dump" if g["crashed"].any() else "")
            + _counted_clause(g) + _lost_clause(g))
    return (PARA + "In the benchmark's stock FULL server engine (issue 11; warm-ups included), "
            + "; ".join(parts) + ".")


def _stock_loss_clause(runs) -> str:
    """For the workaround line: where stock FULL completed every run of a benchmark cell yet vLLM's counters put every
    one below the synthetic schedule while another mode of the same session counted it in every run (notebooks 03,
    05): stock FULL is no choice where it does not crash either. "" when the data shows no such cell."""
    from . import acceptance, crashstates

    if runs is None:
        return ""
    t = acceptance.counters_by_cell(runs)
    if t.empty:
        return ""
    key = ["gpu_session", "synthetic acceptance", "concurrency"]
    stock = t[(t["path"] == crashstates.BENCH_STOCK) & (t["runs"] >= 3) & (t["runs below"] == t["runs"])]
    ref = t[(t["path"] != crashstates.BENCH_STOCK) & (t["runs below"] == 0)]
    both = stock.merge(ref, on=key, suffixes=("", " ref"))
    if both.empty:
        return ""
    parts = []
    for (sess, acc, c), g in both.groupby(key, sort=True):
        r = g.iloc[0]
        parts.append(f"at synthetic acceptance {acc:g} and concurrency {int(c)} ({_short(sess)}) every stock run ({r['runs']}) "
                     f"counted {r['counted mean']} tokens per step against the schedule's {r['schedule mean']:g}, where "
                     + " and ".join(sorted(set(g["path ref"]))) + " counted it in every run")
    return (" Stock FULL graphs are no choice where they do not crash either: in the benchmark, "
            + "; ".join(parts) + " - tokens lost without a crash (notebooks 03 and 05).")


def _lost_clause(runs) -> str:
    """The completed runs (warm-ups included) whose counters fell below the synthetic schedule: tokens lost without a
    crash (notebook 05), per concurrency with the counted means; "" when none did."""
    from . import acceptance

    t = acceptance.counted_against_schedule(runs, outcomes=("ok",))
    low = t[t["below the schedule"]]
    if low.empty:
        return ""
    per = "; ".join(f"{len(g)} at {c} ({', '.join(f'{m:.3f}' for m in sorted(g['counted mean']))})"
                    for c, g in low.groupby("concurrency", sort=True))
    return (f"; {len(low)} of its {len(t)} completed runs counted below the schedule's {low['schedule mean'].iloc[0]:g}: "
            f"{per} - tokens lost without a crash (notebook 05)")


def _counted_clause(runs) -> str:
    """vLLM's acceptance counters over the crashed server runs against the synthetic schedule (notebook 03)."""
    from . import acceptance

    t = acceptance.counted_against_schedule(runs)
    if t.empty:
        return ""
    se = t["standard errors"].dropna()
    below = t["below the schedule"].astype(bool)
    reason = "the sampler accepts whatever the token, so those runs' counted rows lost tokens after sampling"
    lost = ""
    if below.all():
        lost = f"; {reason}"
    elif below.any():
        at = ", ".join(str(c) for c in sorted(set(t.loc[below, "concurrency"])))
        lost = f"; {int(below.sum())} of {len(t)} below the schedule (at concurrency {at}): {reason}; the others counted it"
    return ("; vLLM's acceptance counters over those crashed runs read "
            + "; ".join(", ".join(f"{m:.2f}" for m in g["counted mean"]) + f" against the synthetic schedule's {s:g}"
                        for s, g in t.groupby("schedule mean", sort=True))
            + (f", {_signed(se.min())} to {_signed(se.max())} of the schedule's standard errors" if len(se) else "")
            + (f" ({len(t) - len(se)} at an integer acceptance, where the schedule has no spread)"
               if len(se) and len(se) < len(t) else "")
            + lost + " (notebook 03)")


def _signed(z: float) -> str:
    """A gap in standard errors: whole numbers from 10 up, one decimal below (a -0.3 is not "-0")."""
    return f"{z:+.0f}" if abs(z) >= 10 else f"{z:+.1f}"


def bench_line(root=".", runs=_UNREAD) -> str:
    """The findings page's sentence on speed (issue 11): every side-by-side ratio of mean output throughput the
    benchmark has, per GPU session and acceptance, with the spread of the repeats, what the cells ran on, and the
    ratios not measured yet. Nothing is compared across sessions (``bench.speedup``)."""
    import pandas as pd

    from . import bench

    df = _bench_runs(root) if runs is _UNREAD else runs
    if df is None:
        return "Speed (issue 11 benchmark): not measured yet."
    c = bench.cells(df)
    # the ratios, as the advice below and the glance table, without the runs that compiled a Triton kernel (a spike of
    # that engine start, not of the mode); notebook 05 shows them with and without
    nojit = bench.cells(bench.without_jit_runs(df))
    tables, missing = bench.speedup_tables(nojit)
    parts = []
    for name, t in tables.items():
        for (session, acc), g in t.groupby(["gpu_session", "acceptance"], sort=True):
            cells = "; ".join(
                (f"concurrency {int(r['concurrency'])}: {r['ratio']:.2f}x ({r['low']:.2f}-{r['high']:.2f}, "
                 f"repeats {r['n']})") if pd.notna(r["ratio"])
                else f"concurrency {int(r['concurrency'])}: no ratio ({r['note']})" for _, r in g.iterrows())
            parts.append(f"{name}, synthetic acceptance {acc:g}, GPU session {session}: {cells}")
    crashed = c[c["crashed"] > 0]
    jit = bench.jit_runs(df)
    jit = jit.assign(gpu_session=df.loc[jit.index, "gpu_session"])
    jit_text = [f"{m} at concurrency {int(k)} in {_short(sess)} ({len(g)} run{'s' if len(g) > 1 else ''}: "
                f"{', '.join(sorted(set(', '.join(g['jit_compiles']).split(', '))))})"
                for (sess, m, k), g in jit.groupby(["gpu_session", "mode", "concurrency"], sort=True)]
    plans = glob.glob(str(Path(root) / "matrices" / "bench-*.yaml"))
    planned = bench.planned_cells(str(Path(root) / "matrices" / "bench-*.yaml")) if plans else None
    advice = []
    # chosen without the runs that compiled a Triton kernel too, as notebook 05's choice; the crashes are all kept (a
    # JIT run is a completed one)
    for acc in sorted(c["acceptance"].unique()):
        for p in bench.recommend_by_session(nojit, acc, planned, crash_history=c):
            rows = p["rows"]
            picks = "; ".join(f"concurrency {r['concurrency']}: {r['mode']}" + _margin_text(r)
                              + (f" (but beaten in another session: {r['beaten in another session']})"
                                 if r.get("beaten in another session", "-") != "-" else "")
                              for r in rows)
            prone = rows[0]["left out (crashed)"] if rows else "-"
            advice.append(f"synthetic acceptance {acc:g}, GPU session {p['session']} ({p['scope'].split(': ', 1)[1]}"
                          + (f"; left out as crash-prone: {prone}" if prone != "-" else "") + f"): {picks}")
    queued = bench.queued_cells(c)
    queue_text = "; ".join(
        f"{m} at concurrency {int(k)}, synthetic acceptance {a:g}, in {_short(sess)} (at most {int(run)} running, "
        f"{int(w)} waiting, KV cache {kv:.1f}% full)"
        for sess, m, k, a, run, w, kv in zip(queued["gpu_session"], queued["mode"], queued["concurrency"], queued["acceptance"],
                                             queued["peak_running"], queued["peak_waiting"], queued["peak_kv_cache_pct"]))
    # one cell per session (s30 and s31 each crashed stock at 32): the session tells the two apart
    crash_text = "; ".join(f"{m} at concurrency {int(k)}, synthetic acceptance {a:g}, in {_short(sess)} ({x})"
                           for m, k, a, sess, x in zip(crashed["mode"], crashed["concurrency"], crashed["acceptance"],
                                                       crashed["gpu_session"], crashed["crashed / runs"]))
    # a paragraph per session's choice and per pair of modes: the thread reads it as a list, not one sentence
    be = _break_even_clause(nojit, bench.queued_cells(nojit))
    return (f"Speed (issue 11 benchmark: {_bench_setup(df)}). The fastest mode that never crashed, per concurrency range, in "
            "each GPU session at each synthetic acceptance, chosen among that session's modes since ratios never pair "
            "sessions, without the runs that compiled a Triton kernel (notebook 05; margin: ratio of mean output "
            "throughputs over the runner-up):"
            + "".join(f"{PARA}At {a}." for a in advice)
            + (f"{PARA}{be}." if be else "")
            + f"{PARA}Every side-by-side ratio of mean output throughputs, without those runs, in brackets the slowest over "
            "the fastest repeat and the reverse:"
            + ("".join(f"{PARA}{x}." for x in parts) if parts else " no pair of modes measured side by side yet.")
            + (f"{PARA}Cells whose engine queued requests, so their throughput and TTFT include queueing: {queue_text}"
               + _capacity_clause(df) + "." if len(queued) else "")
            + (f"{PARA}Crashed cells: {crash_text}." if len(crashed) else f"{PARA}No benchmark run crashed.")
            + (f"{PARA}{len(jit)} measured run(s) included a Triton JIT compile ({'; '.join(jit_text)}), left out of the "
               "ratios and the choices above; notebook 05 shows the ratios with them too." if len(jit) else "")
            + (f"{PARA}Not measured side by side yet: {'; '.join(missing)}." if missing else ""))


def _bench_setup(df) -> str:
    """What the benchmark's lines ran: workload, architecture, weights, k, TP, and what a synthetic acceptance is."""
    done = df[df["outcome"].isin(["ok", "crash"])]
    measured = done[~done["warmup"]]
    each = lambda col: "/".join(str(int(x)) for x in sorted(set(measured[col].dropna()))) or "?"
    ks = "/".join(str(int(x)) for x in sorted(set(measured.loc[measured["num_speculative_tokens"] > 0,
                                                                "num_speculative_tokens"]))) or "?"
    return (f"the OpenAI server on loopback, streamed chat completions of {each('max_tokens')} tokens, "
            f"{', '.join(sorted(set(done['target'].dropna())))} architecture, {', '.join(sorted(set(done['weights'].dropna())))} "
            f"weights, DFlash k={ks}, TP={each('tensor_parallel_size')}; a synthetic acceptance L is vLLM's minimum-variance "
            "schedule: a request gains floor(L) or floor(L) + 1 tokens per step, exactly L at an integer L, notebook 05")


def glance_html(runs) -> str:
    """The speed a user can expect, for the top of the findings page: DFlash (with the fix, and today's PIECEWISE
    workaround) over no speculation, per acceptance and concurrency, each ratio inside one GPU session."""
    from . import bench

    if runs is None:
        return "<p>Speed: not measured yet (issue 11's benchmark has no recorded line).</p>"
    # runs that compiled a Triton kernel inside the measurement are left out (a latency spike of that engine start,
    # notebook 05 shows the ratios with and without them)
    c = bench.cells(bench.without_jit_runs(runs))
    t = bench.glance_table(c)
    if t.empty:
        return "<p>Speed: no DFlash mode measured beside no speculation in one GPU session yet.</p>"
    # the left-out runs of the cells the table shows: its sessions' and acceptances', its modes' and no speculation's
    jit = bench.jit_runs(runs)
    shown = {(s, a) for s, a in zip(t["session"], t["acceptance"])}
    j = runs.loc[jit.index]
    left = sum(1 for s, a, m in zip(j["gpu_session"], j["acceptance"], j["mode"])
               if (s, a) in shown and (m in bench.GLANCE_MODES or m == "no speculation"))
    t = t.assign(acceptance=[f"{a:g}" for a in t["acceptance"]], session=[_short(x) for x in t["session"]])
    t.columns = [f"concurrency {c}" if isinstance(c, int) else c for c in t.columns]
    return (f"<p>{html.escape('Output throughput of DFlash over no speculation (FULL_AND_PIECEWISE graphs, no draft), each ratio between cells of one GPU session: mean (slowest over fastest repeat and the reverse); below 1x no speculation is faster' + _queued_note(c) + (f'; {left} measured run(s) of these cells that compiled a Triton kernel left out (notebook 05 shows the ratios with them)' if left else '') + '; [a/b runs]: fewer than 3 measured repeats on a side (a: DFlash, b: no speculation). DFlash FULL (fixed) is FULL_AND_PIECEWISE with the fix (plugin); DFlash PIECEWISE is the workaround. Setup: ' + _bench_setup(runs) + '.')}</p>"
            + _rows(t, list(t.columns)))


def _queued_note(cells_df) -> str:
    """What the glance table's ``*`` means, from the queued DFlash cells: the most requests their engines ran at once."""
    from . import bench

    q = bench.queued_cells(cells_df)
    q = q[q["mode"].isin(bench.GLANCE_MODES)]
    if q.empty:
        return ""
    ran = sorted({int(x) for x in q["peak_running"].dropna()})
    return ("; * the DFlash engine queued requests there (it ran at most "
            + "/".join(map(str, ran)) + " at once: its KV cache, notebook 05)")


def _margin_text(row) -> str:
    """A recommendation row's margin: over the runner-up(s) of the range; for a tie, which of the two leads on the
    mean (the runner-up is the other), or that the lead changes within the range."""
    if not row["runner-up"]:
        return ""
    if len(row["modes"]) == 1:
        return f", {row['margin over runner-up']} over {row['runner-up']}"
    leaders = [m for m in row["modes"] if m != row["runner-up"]]
    if " / " in row["runner-up"] or len(leaders) != 1:
        return ", the lead on the mean changing within the range"
    return f", {leaders[0]} ahead on the mean by {row['margin over runner-up']}"


def _break_even_clause(cells_df, queued, mode: str = "DFlash FULL (fixed)") -> str:
    """The acceptance length at which ``mode`` would match no speculation, from the measured cells (notebook 06);
    ``queued``: the cells whose engine queued requests, marked where they are ``mode``'s."""
    from . import bench

    be = bench.break_even_measured(cells_df, mode).dropna(subset=["break-even acceptance length"])
    if be.empty:
        return ""
    q = queued[queued["mode"] == mode]
    waited = {(s_, a, int(k)) for s_, a, k in zip(q["gpu_session"], q["acceptance"], q["concurrency"])}
    parts = []
    for (session, acc), g in be.groupby(["gpu_session", "acceptance"], sort=True):
        parts.append(f"measured at synthetic acceptance {acc:g} in {_short(session)}: "
                     + ", ".join(f"{r['break-even acceptance length']:.2f} at concurrency {int(r['concurrency'])}"
                                 + (" (DFlash queued there)" if (session, acc, int(r["concurrency"])) in waited else "")
                                 for _, r in g.iterrows()))
    return (f"The acceptance length at which {mode} would match no speculation (measured acceptance length over "
            "measured speedup, assuming the DFlash step time does not depend on the acceptance; notebook 06), "
            + "; ".join(parts) + _holdout_clause(cells_df, mode))


def _holdout_clause(cells_df, mode: str) -> str:
    """Notebook 06's held-out check (its default: the largest acceptance held out, per acceptance the session with
    ``mode`` beside no speculation with the most completed cells, then modes, the latest of those; each session that measured the
    held-out acceptance checked in turn), or nothing while the data cannot make it."""
    from . import bench

    c = bench.one_session(cells_df, modes=(mode, "no speculation"))
    if bench.tradeoffs_gaps(c, mode) or bench.holdout_gaps(c, mode):
        return ""
    acc = max(c["acceptance"].unique())
    reps = [r for r in bench.holdout_replicates(cells_df, c, acc, mode) if r["misses"]]
    if len(reps) > 1:   # each session that measured the held-out acceptance checks the same DFlash fit
        text = (f"Fitted without acceptance {acc:g} and checked against its measured speedups in each GPU session that "
                "measured it: " + "; ".join(f"in {_short(r['session'])}, {bench.holdout_parts(r['misses'])}" for r in reps))
    else:
        text = bench.holdout_sentence(bench.holdout_misses(bench.holdout_check(c, acc, mode)["table"]), acc).rstrip(".")
    return (". " + text + " (notebook 06's step-time models for " + mode + "; the check tests a model, the assumption "
            "above and the drift between sessions together)")


def _capacity_clause(bench_df) -> str:
    """Why DFlash engines queue: vLLM's KV-block accounting (:mod:`dflash_lab.kvcapacity`), said only as far as it
    matches the engine logs."""
    from . import kvcapacity

    rows = [r for r in kvcapacity.engines(bench_df) if not r["not checked"]]
    spec = [r for r in rows if r["k"] > 0]
    if not spec:
        return ""
    if not all(kvcapacity.matches(r) for r in rows):
        return " (vLLM's KV-block accounting as modelled in dflash_lab.kvcapacity does not match every engine log: see notebook 05)"
    # the engine the rules were checked on most (an engine that died in its first run has few tokens per request)
    r = max(spec, key=lambda x: x["stats lines"])
    plain = [x for x in rows if x["k"] == 0]
    with_lines = [x for x in rows if x["stats lines"]]
    return (f" (vLLM 0.22.1 keeps 1 + k Gated-DeltaNet states per request and layer with speculative decoding: "
            f"a k={r['k']} request of {r['request tokens']} tokens holds {r['MiB per request'] / 1024:.2f} GiB of KV cache"
            + (f" against {plain[0]['MiB per request']:.0f} MiB without speculation" if plain else "")
            + f", so {r['fits']} fit at once; the rules predict the attention block size of {len(rows)} engine logs and the "
            f"{sum(x['stats lines'] for x in rows)} distinct KV-usage lines of {len(with_lines)} of them to the log's 0.1 %, "
            "notebook 05)")


def _with_sessions(runs, concurrencies) -> str:
    """'8 (s20), 12 (s21)': each concurrency with the GPU sessions its runs came from (short labels)."""
    out = []
    for c in concurrencies:
        g = runs.loc[runs["concurrency"] == c, "gpu_session"]
        sess = sorted({_short(x) for x in g.dropna()}) + (["a session before labels"] if g.isna().any() else [])
        out.append(f"{c} ({', '.join(sess)})")
    return ", ".join(out)


_short = analysis.short_session


def _common_sessions(runs, concurrencies) -> list:
    """The GPU sessions that ran every one of these concurrencies (in session order)."""
    sets = [set(runs.loc[runs["concurrency"] == c, "gpu_session"].dropna()) for c in concurrencies]
    return sorted(set.intersection(*sets), key=analysis.session_key) if sets else []


def _without_asserts(keep, rope) -> str:
    """The keep-running crashes whose engine log does not show both RoPE asserts, grouped by concurrency, kernel and
    what their log printed: how many, and which kernel their core named."""
    none = keep[[not all(a in t for a in rope["device_asserts"]) for t in keep["device asserts (engine log)"]]]
    groups = none.groupby([none["concurrency"].astype(int), "faulting kernel", "device asserts (engine log)"], sort=True)
    return "".join(f"; {'the one' if len(g) == 1 else f'the {len(g)}'} at concurrency {c} whose core"
                   f"{'' if len(g) == 1 else 's'} {'names' if len(g) == 1 else 'name'} {k} printed "
                   + ("none" if not printed else f"only {printed}")
                   for (c, k, printed), g in groups)


def _numbers_in(text: str) -> list[int]:
    """Sort key: the whole numbers in ``text``, in order ("200 x8" before "200 x20")."""
    return [int(x) for x in re.findall(r"\d+", text)]


def _diff_line(df, pt) -> str:
    """The upstream diff applied as a diff (verify-diff-tp1, s47): what held of its pre-registered predictions and
    integrity checks, or that it has not run. The diff's text is :func:`patch.upstream_diff` (what the committed file
    holds: tests/test_patch.py)."""
    from . import verification
    from .patch import upstream_diff

    if "matrix" not in df or not (df["matrix"] == verification.DIFF_MATRIX).any():
        return PARA + "The upstream diff itself has not run on the GPU (only through the plugin)."
    dp = verification.diff_predictions(df, pt, upstream_diff())
    d = df[df["matrix"].isin([verification.DIFF_MATRIX, verification.DIFF_CONTROLS_MATRIX])]
    stock = d[d["fix"] != True].sort_values("concurrency", ascending=False)  # noqa: E712
    runs = d[(d["fix_via"] == "upstream diff") & (d["probe"] != True)]  # noqa: E712
    by_c = ", ".join(f"{int((g['outcome'] == 'ok').sum())}/{len(g)} at {int(c)}"
                     for c, g in runs.groupby("concurrency", sort=False))   # in the order the runs ran
    probe = dp[dp["predicted"].str.startswith("(c)")]
    return (PARA + f"The upstream diff applied as a diff (GPU session {', '.join(sorted(set(d['gpu_session'])))}, no plugin fix; "
            f"{_held_of(dp, 'pre-registered')} predictions written before the runs held, and "
            f"{_held_of(dp, 'integrity check')} checks that each engine process ran the committed diff's code): stock controls crashed "
            f"{int(stock['crashed'].sum())}/{len(stock)} (at {', '.join(str(int(c)) for c in stock['concurrency'])}); with the "
            f"diff {by_c} completed (one engine start, in that order)"
            + (f"; under the step probe at 8: {probe['measured'].iloc[0]}" if len(probe) else "") + ".")


def _diff_rest_line(df, pt) -> str:
    """The upstream diff offline at 64, 24 and 28 (verify-diff-rest-tp1, s49-s50): its predictions (decided, held, not
    run yet, and which failed as written), the stock controls of each session with what named their fault, the diff's
    runs and counted acceptance, its step probe at 64; empty when it has not run."""
    from . import acceptance, verification
    from .patch import upstream_diff

    if "matrix" not in df or not (df["matrix"] == verification.DIFF_REST_MATRIX).any():
        return ""
    dp = verification.diff_rest_predictions(df, pt, upstream_diff())
    d = df[df["matrix"] == verification.DIFF_REST_MATRIX]
    pre = dp[dp["kind"] == "pre-registered"]
    decided = pre[pre["held"].map(lambda h: h is not None)]
    failed = decided[decided["held"].map(lambda h: h is False)]
    pending = pre[pre["held"].map(lambda h: h is None)]
    stock = d[d["engine_id"] == "stock-controls"]
    named = []
    for _, r in stock.iterrows():
        k = verification.fault_kernel(r)
        where = f"{int(r['concurrency'])} ({analysis.short_session(r['gpu_session'])})"
        if k:
            named.append(f"{where}: {k}")
        else:
            a = verification.log_assert_text(r)
            named.append(f"{where}: no core file, its engine log printed "
                         + (f"{len(a.split('; '))} failed device asserts, the drafter's RoPE position bounds"
                            if a and all("< 262144" in x for x in a.split("; "))
                            else f"device asserts: {a}" if a else "no device assert"))
    diff = d[(d["fix_via"] == "upstream diff") & (d["probe"] != True)]  # noqa: E712
    by_c = ", ".join(f"{int((g['outcome'] == 'ok').sum())}/{len(g)} at {int(c)}"
                     for c, g in diff.groupby("concurrency", sort=False))
    cb = acceptance.counted_against_schedule(diff, outcomes=("ok",))
    sess = ", ".join(sorted(set(d["gpu_session"].dropna()), key=analysis.session_key))
    probe = dp[dp["predicted"].str.startswith("(c)") & dp["held"].map(lambda h: h is not None)]
    psess = d.loc[(d["fix_via"] == "upstream diff") & (d["probe"] == True), "gpu_session"]  # noqa: E712
    return (PARA + f"Offline at 64, 24 and 28, where stock crashes every run (GPU sessions {sess}; each session ran its "
            f"stock controls first): stock controls crashed {int(stock['crashed'].sum())}/{len(stock)} (at "
            f"{'; at '.join(named)}); with the diff {by_c} completed (one engine start, in that order, "
            f"{', '.join(sorted(set(diff['gpu_session'].dropna())))}), "
            f"{int(cb['below the schedule'].sum()) if len(cb) else 0} of {len(cb)} counting "
            f"below the schedule" + (f" (counted {cb['counted mean'].min():.3f}-{cb['counted mean'].max():.3f})" if len(cb) else "")
            + (f"; under the step probe at 64 ({', '.join(sorted(set(psess.dropna())))}): {probe['measured'].iloc[0]}"
               if len(probe) else "")
            + f". Of its {len(pre)} predictions written before the runs, {int(sum(h is True for h in decided['held']))} of "
            f"{len(decided)} decided held"
            + (f"; failed as written: {'; '.join(x.split(':')[0] for x in failed['predicted'])}" if len(failed) else "")
            + (f"; not run yet: {'; '.join(x.split(':')[0] for x in pending['predicted'])}" if len(pending) else "")
            + f"; {_held_of(dp, 'integrity check')} integrity checks held.")


def _diff_server_line(df) -> str:
    """The upstream diff on the OpenAI server (verify-diff-server-tp1, s48): what held of its predictions and checks,
    the stock servers beside it, the diff's runs and the counted acceptance at 6.0; empty when it has not run."""
    from . import verification
    from .patch import upstream_diff

    if "matrix" not in df or not (df["matrix"] == verification.DIFF_SERVER_MATRIX).any():
        return ""
    dp = verification.diff_server_predictions(df, upstream_diff())
    sr = verification.server_runs(df[df["matrix"] == verification.DIFF_SERVER_MATRIX])
    at = lambda who, acc: sr[(sr["vLLM"] == who) & (sr["synthetic acceptance"] == acc)]
    stock, diff = at("stock", 1.86), at("upstream diff", 1.86)
    by_c = ", ".join(f"{int((g['outcome'] == 'ok').sum())}/{len(g)} at {int(c)}"
                     for c, g in diff.groupby("concurrency", sort=False))
    counted = lambda who: ", ".join(at(who, 6.0)["counted acceptance"])
    clean = bool(dp.loc[dp["predicted"].str.startswith("(b) the diff's server at"), "held"].all())
    sess = ", ".join(sorted(set(df.loc[df["matrix"] == verification.DIFF_SERVER_MATRIX, "gpu_session"].dropna())))
    return (PARA + f"On the OpenAI server, the report's path (GPU session {sess}; {_held_of(dp, 'pre-registered')} predictions "
            f"written before the runs held, and {_held_of(dp, 'integrity check')} integrity checks): stock servers crashed "
            f"{int((stock['outcome'] == 'crash').sum())}/{len(stock)} (at "
            + ", ".join(f"{c}: {k}" for c, k in zip(stock["concurrency"], stock["core: faulting kernel"]))
            + f"); the diff's server completed {by_c} (one server start, in that order)"
            + (", every request HTTP 200 with all its tokens" if clean else ", not every request clean (notebook 04)")
            + f"; at synthetic acceptance 6.0 and concurrency 8 the diff counted {counted('upstream diff')} tokens "
            f"per step, stock {counted('stock')} (the schedule gives exactly 6).")


def _held_of(dp, kind: str) -> str:
    k = dp[dp["kind"] == kind]
    return f"{int(k['held'].sum())} of {len(k)}"


def _part1_line(wsc) -> str:
    """Part 1 alone where offline stock crashes every run (a fix_where_stock_crashes table), with its sessions."""
    p1 = wsc[(wsc["fix"] == "part 1 alone") & (wsc["stock there"] == "crashes")]
    if not len(p1):
        return ""
    return (" Part 1 alone there: " + ", ".join(f"{x} at concurrency {c} ({', '.join(_short(z) for z in str(ss).split(', '))}"
                                                + (", whose stock control crashed" if ctl != "-" else ", no crashed stock control")
                                                + ")"
                                                for c, x, ss, ctl in zip(p1["concurrency"], p1["fix completed / runs"],
                                                                         p1["fix sessions"],
                                                                         p1["sessions with a crashed stock control"]))
            + ".")


def _row0(path) -> str:
    """Where a probe log's GDN accepted counts of 0 fell (divergence.zero_accepted): rows above 0 read another
    request's slot silently; row 0 reads before the state-index tensor."""
    from . import divergence

    p = divergence.load_probe(path)
    z = divergence.zero_accepted(p)
    if not len(z):
        return ""
    r0 = z[z["row"] == 0]
    last = p["steps"][-1]["step"]
    return (f"; then GDN accepted counts of 0 on {z['step'].nunique()} steps, in batch rows above 0"
            + (f" until step {int(r0['step'].min())}, which put one in row 0"
               + (" (the crash step: the GDN kernel reads state column -1, before the index tensor in row 0)"
                  if int(r0["step"].min()) == last else "") if len(r0) else ", never in row 0"))


def _concurrencies(rows) -> str:
    """The concurrencies probe table rows asked for, merged and sorted ("2, 8, 16")."""
    return ", ".join(str(c) for c in sorted({int(c) for x in rows["concurrencies"] for c in str(x).split(", ") if c}))


def _low_nan(low) -> str:
    """Which of the stock probe logs below 32 requests wrote NaN, and where (probe table rows)."""
    bad = low[low["first NaN step"].notna()]
    if not len(bad):
        return "none wrote NaN"
    parts = []
    for _, r in bad.iterrows():
        first = " (its first FULL step)" if r["first NaN step"] == r["first FULL step"] else ""
        parts.append(f"at concurrency {r['concurrencies']} ({_short(r['gpu_session'])}) from step {int(r['first NaN step'])}"
                     f"{first}, NaN rows graph / reference {r['NaN rows graph / reference']}" + _row0(r["path"]))
    from . import verification
    finite = low[low["first NaN step"].isna()]
    # a finite log that ended before the step where the other logs of its concurrency went NaN (s54's call cut by the
    # runner's deadline at step 226, before step 275) says nothing about that step: named apart, not summed up as finite
    onset = bad.groupby("concurrencies")["first NaN step"].min()
    short = finite["last step"].notna() & finite.apply(
        lambda r: r["concurrencies"] in onset.index and r["last step"] < onset[r["concurrencies"]], axis=1).astype(bool)
    early = [f"at concurrency {r['concurrencies']} ({_short(r['gpu_session'])}) finite up to its last step "
             f"{int(r['last step'])}, before step {int(onset[r['concurrencies']])} where the other logs at "
             f"{r['concurrencies']} went NaN" for _, r in finite[short].iterrows()]
    rest = sorted(verification.reached(finite[~short]))
    return (f"NaN in {len(bad)} of them: " + "; ".join(parts + early)
            + (f"; at {', '.join(str(c) for c in rest)} finite on every FULL step" if rest else ""))


def _first_position(runs) -> str:
    """How often the synthetic sampler accepted the first draft position in these runs: at 1.0 no step rejected
    every draft (the state notebook 02 ties to the DFlash input kernel's out-of-bounds read never occurred)."""
    first = [m["per_position_rates"][0] for m in runs["spec_decode_metrics"]
             if isinstance(m, dict) and m.get("per_position_rates")]
    if not first:
        return ""
    span = f"{min(first):.0%}" if min(first) == max(first) else f"{min(first):.0%}-{max(first):.0%}"
    return (f"; the first draft position was accepted in {span} of drafts"
            + (", so no step rejected every draft" if min(first) == 1.0 else ""))


def _splits1_rows(pt):
    """The step-probe rows of FA3 splits 1 on both sides whose run completed."""
    return pt[pt["configuration"].fillna("").str.contains("flash_attn_max_num_splits_for_cuda_graph=1, step probe")
              & (pt["runs ok / runs"] == "1/1")]


def _splits1_warning(pt) -> str:
    """For the workaround paragraph: FA3 splits 1 completes, but is not one (its probe's FULL steps are wrong)."""
    rows = _splits1_rows(pt)
    if not len(rows):
        return ""
    return (" Not a workaround: FA3 with one split per graph (attention_config flash_attn_max_num_splits_for_cuda_graph=1) "
            f"completes, but its FULL replays are wrong ({int(rows['FULL steps diverging'].sum())} of "
            f"{int(rows['FULL steps'].sum())} FULL steps diverged from the no-graph pass in its step probe).")


def _splits1_probe_clause(pt) -> str:
    """FA3 splits 1 under the step probe: a completed run is not a right one (its FULL steps against the no-graph pass)."""
    rows = _splits1_rows(pt)
    if not len(rows):
        return ""
    full, div = int(rows["FULL steps"].sum()), int(rows["FULL steps diverging"].sum())
    nan = rows["first NaN step"].notna().any()
    return (PARA + f"Under the step probe, FA3 splits 1 on both sides completed ({len(rows)} run(s) at concurrency "
            f"{_concurrencies(rows)}, {', '.join(_short(x) for x in rows['gpu_session'])}), but {div} of its {full} FULL steps "
            f"diverged from the no-graph pass, first at {', '.join(sorted(set(rows['first layer written differently'].dropna())))}, "
            + ("with NaN" if nan else "none with NaN")
            + ": one split leaves the stale schedule's outputs wrong, not right.")


SUMMARY_ORDER = ("Reproduced", "Root cause", "First wrong value", "Fix", "Faulting kernels", "The OpenAI server",
                 "Discriminating runs", "Ruled out", "Speed")


def _summary_rank(item: str) -> int:
    """An item's place in the findings page's summary (:data:`SUMMARY_ORDER`, by how it begins); any other last."""
    return next((i for i, lead in enumerate(SUMMARY_ORDER) if item.startswith(lead)), len(SUMMARY_ORDER))


def _probe_loader():
    """path -> probe log, each read once: the tap, pre-fill and build-ledger clauses share logs (xz, some MB each)."""
    from . import divergence

    loaded: dict = {}

    def probe_of(path):
        if path not in loaded:
            loaded[path] = divergence.load_probe(path)
        return loaded[path]

    return probe_of


def _unwritten_clause(df, pt) -> str:
    """Why the stale schedule gives wrong values and, in some replays, NaN: the attention-output taps (probe.py) against
    the rows FA3 leaves unwritten by the recorded schedule (fa3sched.py). Empty without tap probes."""
    from . import fa3sched, verification

    fixes = dict(zip(pt["path"], pt["fix"]))
    # only the tap probes' logs (the others, the c64 ones decompressing to ~10 MB each, hold no taps), of s36's matrix:
    # probe-fill-tp1's pre-fills ask another question (_prefill_clause)
    taps_pt = verification.of_matrix(verification.tapped(pt), df, TAPS_MATRIX)
    probe_of = _probe_loader()
    probes = [p for p in (probe_of(x) for x in taps_pt["path"]) if fa3sched.has_taps(p)]
    stock = [p for p in probes if fixes.get(p["path"]) == "stock"]
    fill = (_prefill_clause(df, pt, probe_of) + _builds_clause(df, pt, probe_of) + _padding_clause(df, pt, probe_of)
            + _snapcore_clause(df))
    if not stock:
        return fill
    runs = (df[df["probe_taps"].notna() & (df["fix"] != True) & (df["matrix"] == TAPS_MATRIX)] if "probe_taps" in df
            else df.iloc[:0])
    sessions = sorted({_short(x) for x in runs["gpu_session"].dropna()})
    stale = {gid: fa3sched.stale_vectors(stock, group=gid) for gid in
             sorted({g for p in stock for st in p["steps"] for g, v in (st.get("schedules") or {}).items()
                     if not v.get("same", True)})}
    out = PARA + f"Why (attention-output taps, {', '.join(sessions)}):"
    if len(stale) == 1 and len(vecs := next(iter(stale.values()))) == 1:
        gid, vec = next(iter(stale)), list(next(iter(vecs)))
        reads = {b: fa3sched.replay_reads(vec, b)["requests written"] for b in (2, 8, 9, 32)}
        rule = reads[2] == [0] and reads[8] == [0] and reads[9] == [] and reads[32] == []
        out += (f" group {gid}'s graphs read its buffer as last written, {vec} then zeros on every stale read these taps "
                "recorded, a 1-request batch's FA3 schedule"
                + ("; decoded for b requests it gives no split, so no tile, to requests 1..b-1 up to 8 requests and to "
                   "every request from 9 on, whose attention output rows FA3 then never writes" if rule else "") + ";")
    else:
        out += f" the stale schedules recorded differ between reads ({sum(len(v) for v in stale.values())} distinct);"
    ut = fa3sched.unwritten_table(stock)
    if len(ut):
        steps = ut.groupby(["session", "engine", "step"]).ngroups
        ok_steps = ut.groupby(["session", "engine", "step"])["match"].all().sum()
        out += (f" with a sentinel pre-filled, the requests left unwritten were those predicted from the recorded schedule "
                f"on {int(ok_steps)} of {steps} FULL steps ({ut.groupby(['session', 'engine']).ngroups} engines, "
                f"concurrency {', '.join(str(c) for c in sorted(set(runs[runs['probe_taps'] == 'sentinel']['concurrency'])))})")
    plain = [p for p in stock if not fa3sched.tap_summary(p)["pre-filled"]]
    orig = [o for o in (fa3sched.nan_origin(p) for p in plain) if o]
    if orig:
        out += (f"; with plain taps the first non-finite value the no-graph pass lacks was in an attention output of the "
                f"stale group, inside those requests, in {sum(o['within_unwritten'] for o in orig)} of {len(plain)} probed "
                "engines: those rows kept NaN the graph's memory held")
    sent, pl = runs[runs["probe_taps"] == "sentinel"], runs[runs["probe_taps"] == "1"]
    shared = sent[sent["concurrency"].isin(set(pl["concurrency"]))]
    if len(shared) and len(pl):
        one = runs["gpu_session"].nunique() == 1
        out += (f"; with the sentinel instead, stock completed {int((shared['outcome'] == 'ok').sum())} of {len(shared)} "
                f"where plain-tap stock crashed {int(pl['crashed'].sum())} of {len(pl)} (concurrency "
                f"{', '.join(str(c) for c in sorted(set(pl['concurrency'])))}{', one session' if one else ''}), outputs still "
                "wrong: consistent with the crash needing that NaN, not decided by those runs (the sentinel filled every "
                "FlashAttention output" + ("" if fill else "; matrices/probe-fill-tp1.yaml is the test") + ")")
    return out + "." + fill


TAPS_MATRIX, BUILDS_MATRIX = "probe-taps-tp1", "probe-builds-tp1"
# the pre-fill matrices: 8 and 16 (s37, one sentinel run at 8 in s38), 32 (s38), 20 (s41, once) and 28 (s42, once, with
# a plain-tap run at 20), each predicted before its run; probe-early2-tp1 (s42) repeats probe-early-tp1's plain-tap
# engines, and its header, copied from probe-early-tp1's, counts it here too
FILL_MATRICES = ("probe-fill-tp1", "probe-fill32-tp1", "probe-fill20-tp1", "probe-early-tp1", "probe-early2-tp1")
# the build ledger's test and the unprobed engines' schedule snapshot (s39, s40), predicted before its run: the name
# verification.padding_test reads, one definition
from .verification import PADDING_MATRIX  # noqa: E402


def fill_rows(df, pt):
    """The probe-table rows of the pre-fill matrices' engines (:data:`FILL_MATRICES`)."""
    import pandas as pd

    from . import verification

    tp = verification.tapped(pt)
    return pd.concat([verification.of_matrix(tp, df, m) for m in FILL_MATRICES])


def _prefill_clause(df, pt, probe_of=None) -> str:
    """Does the crash need the NaN the unwritten rows hold? The pre-fill matrices' runs (group 7's attention outputs
    alone pre-filled with NaN, 0 or the sentinel), each outcome against fa3sched.predicted_outcome, and the exact test
    per GPU session and concurrency over stock's runs. Empty without them. ``probe_of``: a :func:`_probe_loader`."""
    from . import verification

    rows = fill_rows(df, pt)
    if not len(rows):
        return ""
    probe_of = probe_of or _probe_loader()
    t = verification.fill_table(df, [probe_of(x) for x in rows["path"]])
    known = t[t["predicted"].notna()]
    held = known["predicted"] == known["outcome"]
    nan = t[(t["pre-fill"] == "nan") & ~t["fix"]]
    finite = t[t["pre-fill"].isin(["zero", "sentinel"]) & ~t["fix"]]
    fixnan = t[(t["pre-fill"] == "nan") & t["fix"]]
    plain = t[(t["pre-fill"] == "none") & ~t["fix"]]
    conc = lambda r: ", ".join(str(c) for c in sorted(set(r["concurrency"]))) or "none"  # noqa: E731
    ok = lambda r: int((r["outcome"] == "ok").sum())  # noqa: E731
    sessions = ", ".join(sorted({_short(x) for x in t["gpu_session"]}))
    ran = set(df["matrix"]) if "matrix" in df else set()
    matrices = " and ".join(m for m in FILL_MATRICES if m in ran) or " and ".join(FILL_MATRICES)
    out = (PARA + f"Does the crash need that NaN? ({matrices}, {sessions}, every engine under the step probe: group 7's "
           "attention outputs alone pre-filled before FA3 runs, each outcome predicted in the matrix before the run): "
           f"{int(held.sum())} of {len(known)} runs with a prediction ended as predicted"
           + (f" ({len(t) - len(known)} had none)" if len(known) < len(t) else "")
           + f"; with NaN there stock crashed {int((nan['outcome'] == 'crash').sum())} of {len(nan)} (concurrency "
           f"{conc(nan)}); with 0 or the sentinel it completed {ok(finite)} of {len(finite)} (concurrency {conc(finite)}), "
           f"{int(finite['steps differing'].sum())} of {int(finite['FULL steps with taps'].sum())} FULL steps still differing "
           f"from the no-graph pass; without a pre-fill stock completed {ok(plain)} of {len(plain)} (concurrency "
           f"{conc(plain)}); fix 2 with the same NaN completed {ok(fixnan)} of {len(fixnan)} with "
           f"{int(fixnan['steps differing'].sum())} FULL steps differing from the no-graph pass")
    if len(known) and not held.all():
        return out + ". Not every outcome held its prediction: the crash is not explained by the unwritten rows' NaN alone."
    # per session and concurrency where some stock run crashed: s38's stale schedules held other padding than s37's
    pool = verification.fill_pooled(t)
    if pool is None:
        return out + "."
    strata, other = pool["strata"], pool["other"]
    where = ", ".join(str(c) for c in sorted({x[0][1] for x in strata}))
    per = "; ".join(f"{_short(sx)} at {c}: {e} crash{'es' if e != 1 else ''} in {n} run{'s' if n != 1 else ''}"
                    + ("" if ci == e else f", {n_in} NaN-filled")
                    for (sx, c), ci, n_in, e, n in strata)
    odds = (f"), 1 in {round(1 / pool['p'])} if the pre-fill did not matter (exact test, one-sided, per session and "
            "concurrency")
    admitted = lambda: admit_clause(df, verification.first_site_runs(df, pt, probe_of), probe_of)  # noqa: E731
    if pool["all_crashes_nan"]:
        return out + (f". At {where} (TP=1, offline) the crash follows the NaN in the rows FA3 leaves unwritten: within "
                      "each session and concurrency every stock crash was a NaN-filled run (" + per + odds + ")."
                      + admitted())
    if pool["filled_as_ruled"] and pool["own_nan"]:
        sites = verification.first_site_runs(df, pt, probe_of)
        them = "the other crash" if len(other) == 1 else f"the {len(other)} other crashes"
        return out + (f". At {where} (TP=1, offline) the crash follows the NaN in the rows FA3 leaves unwritten: within "
                      "each session and concurrency every NaN-filled stock run crashed and every 0- or sentinel-filled one "
                      f"completed; {them} had no pre-fill, and NaN of {'its' if len(other) == 1 else 'their'} own in the "
                      f"requests FA3 left unwritten before {'it' if len(other) == 1 else 'they'} died ("
                      + plain_sites_text(verification.plain_sites(other)) + "; what a probed engine's graph memory held "
                      "there" + first_sites_text(verification.first_sites(sites)) + ") (" + per + odds
                      + "; a run without a pre-fill counts as not NaN-filled)." + admit_clause(df, sites, probe_of))
    return out + (". Within each session and concurrency the crashes were not all NaN-filled runs, and the others are "
                  "not shown to have had NaN of their own in the unwritten rows first (" + per + odds + "): these runs do "
                  "not show the crash following the unwritten rows' NaN." + admitted())


def oor_clause(df, pattern: str | None = None) -> str:
    """From the NaN to the illegal address (s43): the sampler's out-of-vocabulary ids, their link to the accepted counts
    of 0, probe-oor-tp1's pre-registered outcome and the row-0 rule over every probe record
    (verification.oor_table). Empty without a probe with non-finite logits."""
    from . import divergence, verification

    t = verification.oor_table(df, pattern or divergence.PROBE_GLOB)
    plain = t[~t["ids replaced"]] if len(t) else t
    nan = plain[plain["NaN-logits steps"] > 0] if len(plain) else plain
    if not len(nan):
        return ""
    fin = plain[plain["NaN-logits steps"] == 0]
    every = bool((nan["out-of-vocabulary first ids"] > 0).all()) and bool((fin["out-of-vocabulary first ids"] == 0).all())
    unlinked = int(t["unlinked steps"].map(len).sum())
    text = (PARA + f"From the NaN to the illegal address (s43): in {'every one' if every else 'not every one'} of the "
            f"{len(nan)} probed runs whose verify logits held NaN the rejection sampler returned an id equal to the "
            f"vocabulary size (248320, one past the last valid id) as some request's first token"
            + (f", and in none of the {len(fin)} others" if every else "")
            + "; vLLM's drafter and parse_output count only ids below it, so such a row has no valid token, and on "
            f"{int(t['linked steps'].sum())} recorded steps the GDN accepted counts of 0 were "
            + ("exactly those requests, the step after" if not unlinked else f"not always those requests ({unlinked} steps differ)")
            + ".")
    pred = verification.oor_predictions(t)
    if len(pred):
        on, ctl = pred[pred["ids replaced"]], pred[~pred["ids replaced"]]
        text += (PARA + f"Pre-registered ({verification.OOR_MATRIX}): with those ids replaced by token 0 after sampling, "
                 f"{int((on['outcome'] == 'ok').sum())} of {len(on)} runs at "
                 f"{', '.join(sorted(set(on['concurrency']), key=int))} completed with NaN logits to the end and no "
                 f"count of 0, and the same session's stock control crashed {int((ctl['outcome'] == 'crash').sum())} of "
                 f"{len(ctl)}; {int(pred['held'].sum())} of {len(pred)} predictions held. Few runs of a seeded "
                 "workload (close replicas); the replacement is an intervention, not a fix: outputs stay wrong.")
    rule = verification.row0_rule(t, verification.ROW0_FOUND_IN)
    if rule["crashes"]:
        text += (PARA + f"Found afterwards in the records of s13-s{verification.ROW0_FOUND_IN}: {rule['at row-0 step']} of "
                 f"the {rule['crashes']} crashing probe logs ended at the first step in which batch row 0 held a request "
                 "with no valid token (where, by vLLM's source, the DFlash input kernel, or with a moved-in count of 0 "
                 "the GDN kernel, reads before its buffer; these probes took no core dumps), while rows above 0 held "
                 f"such requests on {rule['earlier steps above row 0']} earlier steps without a fault.")
    r0 = verification.row0_predictions(t)
    if len(r0):
        oth, row0 = r0[r0["rows replaced"] == "others"], r0[r0["rows replaced"] == "row0"]
        and_ = lambda col, d: " and ".join(str(v) for v in d[col])  # noqa: E731
        text += (PARA + f"Tested ({verification.ROW0_MATRIX}, pre-registered, "
                 f"{', '.join(sorted(set(map(_short, r0['gpu_session']))))}): {int(r0['held'].sum())} of {len(r0)} runs "
                 "ended as predicted")
        if not r0["held"].all() or not len(oth) or not len(row0):
            return (text + (" (not: " + ", ".join(r0.loc[~r0["held"], "engine"]) + ")." if not r0["held"].all() else ".")
                    + passed_clause(t, df=df, pattern=pattern))
        text += (f". With the ids replaced in rows above 0 only, each run crashed at the first step row 0's own id was "
                 f"out of vocabulary (step {and_('last step', oth)} at {and_('concurrency', oth)}). With row 0's "
                 f"replaced only, the replacement gave row 0 its only token on {and_('row-0 ids replaced', row0)} steps, "
                 f"first at step {and_('first row-0 id replaced', row0)} (at {and_('concurrency', row0)}), and the run "
                 f"went on; rows above 0 went without a token on {and_('accepted-0 rows above 0 before it', row0)} "
                 "request-steps before it crashed, at the step a request with an accepted count of 0 was moved into "
                 f"row 0 (step {and_('last step', row0)})")
        clean = bool((row0["row-0 changes with a count of 0"] == 1).all()
                     and (row0["row-0 changes with a count unknown"] == 0).all()
                     and (row0["row-0 requests that came back"] == 0).all())
        if clean:
            text += (f", after {' and '.join(str(int(n) - 1) for n in row0['row-0 changes'])} earlier changes of row 0's "
                     "request (finished requests) to requests with a token")
        text += ". The runs crashed only on steps where row 0 held a request without a valid token."
        core = verification.oor_core_predictions(t, divergence.load_probe)
        if not len(core):
            return text + (" One run per cell, no core dumps: which kernel faulted is read from vLLM's source, not "
                           "observed.") + passed_clause(t, core, df, pattern)
        return text + core_clause(core) + passed_clause(t, core, df, pattern)
    return text + passed_clause(t, df=df, pattern=pattern)


def stop_clause(df, pattern: str | None = None, data_dir: str = "data") -> str:
    """Why the probed runs at 24 that went past their row-0 step stopped stepping (s56): the hang snapshot's judged run
    (:func:`verification.probe_hang_predictions`) and the scheduler ledger's first spin
    (:func:`verification.probe_hang_ledger_predictions`), as prose; empty where neither matrix has a run that says it."""
    from . import divergence, verification

    pattern = pattern or divergence.PROBE_GLOB
    out = ""
    try:
        _, hf = verification.probe_hang_predictions(df, pattern)
    except LabError:   # no run line or no probe log of the matrix (e.g. the run lines without data/gpu)
        hf = None
    if hf is not None and len(hf):
        j = hf[hf["stopped (header's rule)"] == True]  # noqa: E712 - a column of bools
        if len(j):
            verdicts = [v for v in j["(d) held"] if v is not None]
            utils = sorted({str(u) for u in j["GPU utilization %"]})
            dumps = [str(x) for x in j["dump"] if not str(x).startswith("not asked")]
            steps = sorted({str(int(x)) for x in j["last step"]})
            verdict = ("contradicting" if verdicts and not any(verdicts) else
                       "as in" if verdicts and all(verdicts) else
                       f"({sum(bool(v) for v in verdicts)} of {len(verdicts)} judged as in)")
            out += (PARA + f"Why they stop ({verification.PROBE_HANG_MATRIX}, pre-registered): "
                    + (f"the {len(j)} runs its rule judges stopped ("
                       + ", ".join(f"{x:.0f}" for x in j["s without a step before the snapshot"])
                       + f" s after their last step, {' or '.join(steps)})" if len(j) > 1 else
                       f"the one run its rule judges stopped ({j['s without a step before the snapshot'].iloc[0]:.0f} s "
                       f"after its last step, {steps[0]})")
                    + f" read GPU utilization {' or '.join(utils)} %"
                    + (f", and the dump{'s' if len(dumps) > 1 else ''} taken in {len(dumps)} of them held "
                       + " / ".join(sorted(set(dumps))) if dumps else "")
                    + f", {verdict} the prediction of a kernel that does not end.")
    try:
        _, lf = verification.probe_hang_ledger_predictions(df, pattern, data_dir=data_dir)
    except LabError:
        return out
    runs = df[df["matrix"] == verification.PROBE_HANG_LEDGER_MATRICES[0]]
    if not len(lf) or not len(runs):
        return out
    return (out + _ledger_sentence(lf, runs, data_dir) + _ledger2_sentence(df, pattern, data_dir)
            + _trajectory_sentence(df, data_dir))


def _trajectory_sentence(df, data_dir: str) -> str:
    """The probed runs at 24 by trajectory (:func:`verification.c24_trajectories`, read afterwards in s58) and, once
    ``probe-admit-c24-tp1`` has lines, its pre-registered test, as prose; empty where no run has a trajectory."""
    import pandas as pd

    from . import verification

    try:
        t = verification.c24_trajectories(df, data_dir=data_dir)
    except LabError:   # the run lines without data/gpu
        return ""
    g = verification.trajectory_groups(t)
    if not len(g):
        return ""

    def reqs(r):
        return " or ".join(r["first step requests"].split(", ")) + (
            " request" if r["first step requests"] == "1" else " requests")

    def whose(r):
        return (f"request {r['its request']}'s own id in row 0" if r["row-0 how"] == "sampled" else
                f"request {r['its request']} in row 0 ({r['row-0 how']})")

    def ending(r):
        n = r["runs"]
        if r["ended"] == f"{n} crash" and r["last step"] == r["first row-0 step"]:
            return f"a crash at its first row-0 step, {r['last step']}, with {whose(r)} ({n} of {n})"
        if "crash" not in r["ended"]:
            how = ", ".join(f"{x.split(' ', 1)[0]} {x.split(' ', 1)[1]}{'s' if x.split(' ', 1)[0] != '1' else ''}"
                            for x in r["ended"].split(", "))
            return (f"no step recorded after {r['last step']} ({n} of {n}: {how}; a cut is not a judged stop), "
                    f"{whose(r)} at step {r['first row-0 step']} without a fault")
        return f"{r['ended']}, last step {r['last step']}"

    parts = [f"a first step of {reqs(r)}: trajectory {r['trajectory']}, {ending(r)}" for _, r in g.iterrows()]
    # said only as far as the runs bear it out: each admission count seen with one trajectory, each trajectory with
    # one kind of ending (crashes only, or runs with no step after one step)
    counts = [set(str(r["first step requests"]).split(", ")) for _, r in g.iterrows()]
    one_traj = all(not (a & b) for i, a in enumerate(counts) for b in counts[i + 1:])
    one_end = all(r["ended"] == f"{r['runs']} crash" or "crash" not in r["ended"] for _, r in g.iterrows())
    text = (PARA + f"Read afterwards (s58): the {int(g['runs'].sum())} probed runs at 24 that reached NaN logits followed "
            f"{len(g)} trajectories, each named by the set of requests and steps whose first sampled id was out of "
            "vocabulary"
            + (", each number of requests the engine's first step admitted (left to arrival timing offline) went with "
               "one trajectory" if one_traj else "")
            + (", and each trajectory with one kind of ending" if one_end else "")
            + ": " + "; ".join(parts) + ".")
    if not (df["matrix"] == verification.ADMIT_C24_MATRIX).any():
        return text + (PARA + f"The admission gate's test of this ({verification.ADMIT_C24_MATRIX}, pre-registered) has not "
                       "run yet.")
    try:
        at, ar = verification.admit_c24_predictions(df, data_dir=data_dir)
    except LabError as e:   # its lines are there but cannot be judged: said, not passed over
        return text + PARA + f"The admission gate's test ({verification.ADMIT_C24_MATRIX}) could not be judged: {e}."
    cuts = ar[ar["ended"] == "deadline cut"]
    # a cut is never judged; what its probe recorded up to the cut is said as that, beside the verdict counts
    seen = [f"K={r['K']}, before its first recorded step" if pd.isna(r["last step"]) else
            f"K={r['K']}, last recorded step {r['last step']} (first step {r['first step requests']} of "
            f"{r['concurrency']}" + (f"; its out-of-vocabulary ids up to there were trajectory {r['trajectory']}'s)"
                                     if isinstance(r["trajectory"], str) else "; no out-of-vocabulary id)")
            for _, r in cuts.iterrows()]
    # which prediction is which, by its number and K ("(2) K=3", "(0) every run"); a failed one with what was measured
    held, failed, open_ = [], [], []
    for p, h, m in zip(at["predicted"], at["held"], at["measured"]):
        t = p.split(":", 1)[0] if re.match(r"\(\d\) K=\d+:", p) else p.split(" ", 1)[0] + " every run"
        if h is None:
            open_.append(t + (" (not run)" if m == "not run" else ""))
        elif h:
            held.append(t)
        else:
            failed.append(f"{t}, measured {m}")
    which = "; ".join(f"{name}: {sep.join(xs)}" for name, sep, xs in
                      (("held", ", ", held), ("failed", "; ", failed), ("undecided", ", ", open_)) if xs)
    return text + (PARA + f"The admission gate's test ({verification.ADMIT_C24_MATRIX}, pre-registered): "
                   f"{len(held)} of {len(at)} predictions held, {len(failed)} failed, {len(open_)} undecided ({which})"
                   + (f"; {len(cuts)} run(s) cut by the runner's deadline, not judged: {'; '.join(seen)}"
                      if len(cuts) else "") + ".")


def _ledger_sentence(lf, runs, data_dir: str) -> str:
    """s56's ledger run (``probe-hang-ledger-c24-tp1``): its first spin, as one sentence; empty without a spin."""
    from . import schedledger, verification

    f = lf.iloc[0]
    t = schedledger.spin_table(verification.ledger_lines(runs.iloc[0], data_dir))
    if not len(t):
        return ""
    outs = sorted({f"{int(o)} of {int(m)}" for o, m in zip(t["output tokens"], t["max_tokens"])})
    judged = bool(f["stopped (header's rule)"])
    return (
        f" A scheduler ledger in one more run ({verification.PROBE_HANG_LEDGER_MATRICES[0]}, its predictions "
        + ("judged" if judged else f"not judged: {f['s without a step before the snapshot']:.0f} s without a step, below "
           f"its {verification.HANG_SILENCE_S:.0f} s rule")
        + f") recorded no token scheduled for {f['longest spin line s']:.0f} s on end with {len(t)} requests running, "
        f"each at {' or '.join(outs)} output tokens and held by "
        + ("vLLM's async max_tokens guard" if (t["early outs"] == "max_tokens guard").all() else
           "an early out of Scheduler.schedule (" + "; ".join(t["early outs"]) + ")")
        + f" with {', '.join(str(int(x)) for x in t['placeholders'])} output placeholders and no step in flight: a step "
        "whose row returns no token leaves its placeholders in place (vLLM 0.22.1's update_from_output adjusts them only "
        "for a row with a token), so the guard skips the request forever.")


def _ledger2_sentence(df, pattern: str, data_dir: str) -> str:
    """``probe-hang-ledger2-c24-tp1`` (s57, pre-registered (e)-(g)): how its measured runs ended and, for those that
    stopped, what their ledgers, probe logs and dumps agree on, as one sentence; empty without a run line."""
    from . import schedledger, verification

    m = verification.PROBE_HANG_LEDGER_MATRICES[1]
    runs = df[df["matrix"] == m]
    if not len(runs):
        return ""
    try:
        t, lf = verification.probe_hang_ledger_predictions(df, pattern, matrix=m, data_dir=data_dir)
    except LabError:   # the run lines without data/gpu
        return ""
    measured = runs[~runs.apply(analysis.is_deadline_cut, axis=1)]
    crashes = measured[measured["outcome"] == "crash"]
    stop_rows = lf[lf["stopped (header's rule)"] == True]  # noqa: E712 - a column of bools
    stopped = [r for _, r in measured.iterrows() if r["outcome"] == "timeout"]
    agree = [verification.run_ledger_agreement(r, data_dir) for r in stopped]
    spins = [schedledger.spin_table(verification.ledger_lines(r, data_dir))
             for r in stopped]
    per = [1 + int(r.get("num_speculative_tokens") or 0) for r in stopped]
    leak = bool(spins) and all(len(s) and list(s["placeholders"]) == [k * n for n in s["updates with no token"]]
                               for s, k in zip(spins, per))
    at_oor = bool(agree) and all(a is not None and a[0]["agree"].all() and a[1][0] == a[1][1] for a in agree)
    held = {p.split(")")[0] + ")": h for p, h in zip(t["predicted"], t["held"])}
    undecided = [k for k in ("(e)", "(f)", "(g)") if held.get(k) is None]
    crash_bits: list[str] = []
    for _, r in crashes.iterrows():
        o = verification.oor_table(df, pattern, sessions=[os.path.splitext(str(r["file"]))[0]])
        kernel = (r.get("fault") or {}).get("kernel") if isinstance(r.get("fault"), dict) else None
        step = o["row-0 step"].iloc[0] if len(o) else None
        crash_bits.append(f"at its first row-0 step ({int(step)})" if step is not None and step == o["last step"].iloc[0]
                          else "elsewhere than its first row-0 step")
        if kernel:
            crash_bits[-1] += f", core {kernel}"
    dumps = sorted({str(x) for x in stop_rows["dump"]})
    replay = ""
    try:
        from . import asyncsched

        got = asyncsched.replay_spins(spins, [k - 1 for k in per])   # per: 1 + k placeholders a step; one child
        if got:
            same = all(g == c and h == len(s) for (g, c, h), s in zip(got, spins))
            replay = ("; vLLM 0.22.1's own AsyncScheduler, run on the CPU (dflash_lab.asyncsched) with those counts and "
                      "each request's last empty row on its final step, "
                      + ("ends in the ledgers' state, request for request (output, computed tokens, placeholders), and "
                         "never schedules them again" if same else "does not end in the ledgers' state"))
    except LabError as e:   # the CPU environment without vLLM's Python dependencies: said, not skipped silently
        replay = f"; the CPU replay through vLLM's scheduler did not run ({e})"
    adv = verification.seq_advance_table(df, data_dir=data_dir)
    if len(adv):
        n_after = int(adv["request-steps after an out-of-vocabulary row"].sum())
        still = bool(adv["advances after them"].str.fullmatch(r"0 x\d+").all())
        lo, hi = adv["other steps' advance, min"].min(), adv["other steps' advance, max"].max()
        replay += (f"; the leaked computed tokens stay in the scheduler: of the {int(adv['out-of-vocabulary rows'].sum())}"
                   f" out-of-vocabulary rows of the {len(adv)} probed runs at 24, the {n_after} followed by a later step "
                   "of the same request left its attention length "
                   + ("unmoved to that step" if still else "moved to that step as " + "; ".join(adv["advances after them"]))
                   + f", and between any other two steps it moved {int(lo)}-{int(hi)} tokens"
                   + (" (a runner placing tokens by the leaked count would move it by more than 1 + k somewhere)"
                      if still and per and hi <= per[0] else ""))
    return (
        PARA + f"Pre-registered again ({m}): of its {len(measured)} measured runs"
        + (f" ({', '.join(f'{r} {n} times' if n > 1 else f'{r} once' for r, n in Counter(x.rsplit('/', 1)[-1] for x in measured['run_id']).items())})"
           if measured["run_id"].nunique() < len(measured) else "")
        + f", {len(crashes)} crashed"
        + (" (" + "; ".join(b if n == 1 else f"{n} {b.replace('its first', 'their first')}"
                            for b, n in Counter(crash_bits).items()) + ")" if crash_bits else "")
        + f" and {len(stop_rows)} stopped after step {', '.join(sorted({str(int(x)) for x in stop_rows['last step']}))} "
        f"({' and '.join(f'{x:.0f} s' for x in stop_rows['s without a step before the snapshot'])} without a step)"
        + (f"; in each stop the {' and '.join(sorted({str(len(s)) for s in spins}))} requests running were held "
           + ("by the max_tokens guard " if all((s["early outs"] == "max_tokens guard").all() for s in spins) else "")
           + f"with placeholders {per[0]} times their updates that returned no token" if leak else
           "; the placeholders were not all 1 + k times the updates that returned no token")
        + (", and those updates came exactly at the probe's steps where the request's first sampled id was out of "
           "vocabulary" if at_oor else ", and those updates did not all match the probe's out-of-vocabulary steps")
        + (f"; the dump taken in the stop: {', '.join(dumps)}" if dumps else "")
        + replay
        + (f"; {sum(h is True for h in t['held'])} of its {len(t)} predictions held"
           + "".join(f", {p.split(')')[0]})" + " failed" for p, h in zip(t["predicted"], t["held"]) if h is False)
           if not undecided else f"; {sum(h is None for h in t['held'])} of its {len(t)} predictions undecided until "
           "its planned runs have run")
        + ".")


def passed_clause(t, core=None, df=None, pattern: str | None = None) -> str:
    """The probe logs of runs that went past their first row-0 step without a fault (:func:`verification.row0_rule`'s
    ``passed``: neither crashed nor completed), as prose, followed, given the run lines ``df``, by why they stop
    (:func:`stop_clause`); empty when there is none. ``core``: :func:`verification.oor_core_predictions` over ``t``
    where the caller has it (read here otherwise)."""
    from . import divergence, verification

    if core is None:
        core = verification.oor_core_predictions(t, divergence.load_probe)
    rule = verification.row0_rule(t, confirmed=verification.confirmed_cuts(core))
    passed = rule["passed"]
    if not len(passed):
        return ""
    cut = len(rule["confirmed cut"])
    ended = (f"{rule['at row-0 step']} of the {rule['crashes']} crashing probe logs ended at their first row-0 step"
             + (f" and {cut} one step before it (a GDN-kernel core stopped the process before the probe wrote the step; "
                "its replica shows the move)" if cut else ""))
    # runs that did the same (concurrency, outcome, row-0 step and how, steps after it) are said once, with their sessions
    same: dict = {}
    for _, r in passed.iterrows():
        key = (r["concurrency"], "neither crashed nor completed" if r["outcome"] == "timeout" else r["outcome"],
               int(r["row-0 step"]), r["row-0 how"] == "sampled", int(r["last step"]) - int(r["row-0 step"]))
        same.setdefault(key, []).append(_short(r["gpu_session"]))
    parts = []
    for (c, outcome, step, own, after), sessions in same.items():
        n = len(sessions)
        order = sorted(dict.fromkeys(sessions), key=lambda x: (int(x[1:]) if x[1:].isdigit() else 0, x))  # s9 before s10
        names = [f"{x} ({sessions.count(x)} runs)" if sessions.count(x) > 1 else x for x in order]
        where = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        what = f"{'its' if n == 1 else 'their'} own out-of-vocabulary id" if own else "a count of 0 moved in"
        parts.append(f"in {where} a probed run at {c} ({outcome}) had its first row-0 step at {step} ({what}) and "
                     f"recorded {after} more steps without a fault" if n == 1 else
                     f"in {where} {n} probed runs at {c} ({outcome}) each had their first row-0 step at {step} ({what}) "
                     f"and recorded {after} more steps without a fault")
    return (PARA + "Not every row-0 step faults: " + "; ".join(parts)
            + f". {ended[0].upper() + ended[1:]}, but not every row-0 step crashed."
            + (stop_clause(df, pattern) if df is not None else ""))


def core_clause(core) -> str:
    """:func:`verification.oor_core_predictions` as prose: each row-0 entry's faulting kernel, as predicted or not."""
    import pandas as pd

    from . import verification

    text = (PARA + f"Core dumps at each entry ({verification.CORE_MATRIX}, pre-registered, "
            f"{', '.join(sorted(set(map(_short, core['gpu_session']))))}): {int(core['held'].sum())} of {len(core)} "
            "runs faulted in the kernel and batch row predicted")
    parts = []
    for _, r in core.iterrows():
        row = "" if pd.isna(r["core row"]) else f", the focused block in batch row {r['core row']} of {r['core rows']}"
        if r["rows replaced"] == "others":
            parts.append(f"row 0's own out-of-vocabulary id (at {r['concurrency']}): {r['core kernel']}{row}, at the "
                         f"run's first row-0 step ({r['faulting step']}"
                         + ("" if r["step as replica"] else f"; not the step the header named, its s44 replica's "
                            f"{r['replica last step']}: the two schedules differed on steps {r['steps differing']}")
                         + ")")
        else:
            own = r["rows at its last step"]
            parts.append(f"a count of 0 moved into row 0 (at {r['concurrency']}): {r['core kernel']}{row}, in the step "
                         f"after the record's last line ({r['faulting step']}; the dump stopped the process inside the "
                         "target's forward, most likely the probe's no-graph reference pass, where the s44 replica's "
                         "error surfaced, before the probe wrote that step), which the s44 replica, identical on "
                         f"steps {r['agree from']}-{r['last step']}, recorded as the move, with "
                         f"{r['replica rows at its last step']} requests"
                         + ("" if pd.isna(own) or pd.isna(r["core rows"]) or int(own) == int(r["core rows"]) else
                            f" (the launch's {r['core rows']} sequences are not the last line's {own} requests: the "
                            "launch is not that step's)"))
    text += (": " + "; ".join(parts)) if core["held"].all() else (
        " (not: " + ", ".join(core.loc[~core["held"], "engine"]) + ")")
    return text + ". One run per cell."


def admit_clause(df, sites, probe_of) -> str:
    """:func:`verification.admit_predictions` as a sentence: the first NaN step against the first step's admissions,
    set by the admission gate (s46). Empty without its runs."""
    from . import verification

    if "matrix" not in df or not (df["matrix"] == verification.ADMIT_MATRIX).any():
        return ""
    stems = {str(f)[: -len(".jsonl")] for f in df.loc[df["matrix"] == verification.ADMIT_MATRIX, "file"]}
    x = verification.admit_predictions(df, sites, verification.oor_table(df, sessions=stems), probe_of)
    if not len(x):
        return ""
    pred = x[x["held"].notna()]
    text = (PARA + f"Tested ({verification.ADMIT_MATRIX}, pre-registered, "
            f"{', '.join(sorted(set(map(_short, x['gpu_session']))))}, at {', '.join(sorted(set(x['concurrency'])))}): "
            "with the engine's first step set to admit K requests once all had arrived (dflash_lab/admit.py; the probe "
            f"recorded K in the first step and the rest in the second in {int(x['gate as set'].sum())} of {len(x)} runs), "
            f"{int(pred['held'].astype(bool).sum())} of {len(pred)} runs with a prediction ended as predicted "
            f"({pred['first step set'].nunique()} predicted conditions, each repeated: close replicas of one seeded "
            "workload)")
    if not pred["held"].astype(bool).all():
        return text + " (not: " + ", ".join(pred.loc[~pred["held"].astype(bool), "engine"]) + ")."
    parts = []
    for k, g in x.groupby("first step set", sort=True):
        steps = sorted(set(int(v) for v in g["first NaN step"].dropna()))
        parts.append(f"K={k}: first NaN at step {' or '.join(map(str, steps))} in {len(g)} run(s)"
                     + ("" if k in verification.ADMIT_PREDICTED else ", with no prediction"))
    return text + ("; " + "; ".join(parts) + ", every run crashing at its first row-0 step"
                   if x["at row-0 step"].all() and (x["outcome"] == "crash").all() else "; " + "; ".join(parts)) + (
        f". The engines' settings differed only in K (build ledger on, no replacement, one session; K=28 always ran "
        f"last), and the first NaN step at {', '.join(sorted(set(x['concurrency'])))} followed it.")


def first_sites_text(by: dict) -> str:
    """:func:`verification.first_sites` as a clause: over every stock engine probed with plain taps (any matrix), how
    many first NaN sites each concurrency showed. Empty when each concurrency showed one."""
    many = {c: v for c, v in by.items() if len(v) > 1}
    if not many:
        return ""
    return ("; over every stock engine probed with plain taps, any matrix (" + ", ".join(
        f"{sum(x['runs'] for x in v)} at {c}" for c, v in sorted(by.items())) + "), the first site moved: " + "; ".join(
        f"at {c}, " + " and ".join(f"{x['runs']} run(s) at {x['site'] or 'no NaN'} ({x['sessions']}; {x['ledger']}; "
                                   f"ids replaced: {x['replaced']}; first step admitted {x['first steps']} requests"
                                   + (f", set by the admission gate in {x['gated']}" if x.get("gated") else "") + ")"
                                   for x in v) for c, v in sorted(many.items())))


def plain_sites_text(sites) -> str:
    """:func:`verification.plain_sites` rows as prose: per concurrency, the runs and their one first NaN site."""
    import pandas as pd

    from .divergence import short

    def one(r):
        n = f"{r['runs']} run{'s' if r['runs'] != 1 else ''}"
        if r["sites"] != 1:
            return f"at {r['concurrency']}, {n} at {r['sites']} different first sites"
        if pd.isna(r["first NaN step"]):
            return f"at {r['concurrency']}, {n}, no NaN recorded"
        return f"at {r['concurrency']}, {n}, first at step {int(r['first NaN step'])} in {short(r['first NaN layer'])}"
    return "; ".join(one(r) for _, r in sites.iterrows())


def _builds_clause(df, pt, probe_of=None) -> str:
    """Who wrote the stale schedule (probe-builds-tp1: the build ledger, predictions (a)-(d) in its header), and what
    the 1-request schedule's padding held with the build ledger off and on (fa3sched.padding_1; every stock tap probe
    of the taps, builds, pre-fill and padding matrices). Empty without the builds runs.
    ``probe_of``: a :func:`_probe_loader`."""
    from . import fa3sched, verification

    rows = verification.of_matrix(verification.tapped(pt), df, BUILDS_MATRIX)
    if not len(rows):
        return ""
    probe_of = probe_of or _probe_loader()
    probes = [probe_of(x) for x in rows["path"]]
    fixes = dict(zip(rows["path"], rows["fix"]))
    preds: dict = {}
    for p in probes:   # a prediction holds only if it holds on every engine it is checked on
        for k, v in fa3sched.build_predictions(p, fixes.get(p["path"]) != "stock").items():
            preds[k] = preds.get(k, True) and v
    held = sorted(k.split(")")[0] + ")" for k, v in preds.items() if v)
    failed = [k for k, v in preds.items() if not v]
    sessions = ", ".join(sorted({_short(x) for x in rows["gpu_session"].dropna()}))
    stock = [p for p in probes if fixes.get(p["path"]) == "stock"]
    hists = [fa3sched.builds_before_first_step(p, 7) or [] for p in stock]
    concs = ", ".join(sorted(set(rows["concurrencies"].astype(str))))
    out = (PARA + f"Who wrote it ({BUILDS_MATRIX}, {sessions}, the probe's build ledger, {len(stock)} stock and "
           f"{len(probes) - len(stock)} fixed engine(s) at {concs}): {len(held)} of {len(preds)} predictions written "
           "before the run held" + (f" ({', '.join(held)})" if held else "")
           + (f"; not held: {'; '.join(failed)}" if failed else ""))
    capture = [[32 - i, 16 * (32 - i)] for i in range(32)]
    if not failed and hists and all(h == capture for h in hists):
        out += (f"; group 7's builder built {len(hists[0])} times before the first served step, the FULL captures from "
                "32 requests down to 1, and on every FULL step of the stock engine(s) its buffer was exactly what the "
                "last, the 1-request capture's build, had left: nothing wrote it after capture")
    # the padding FA3 leaves in a 1-request schedule, per build-ledger setting, from every stock tap probe's stale reads
    import pandas as pd

    tp = verification.tapped(pt)
    mine = pd.concat([verification.of_matrix(tp, df, m) for m in (TAPS_MATRIX, BUILDS_MATRIX, PADDING_MATRIX) + FILL_MATRICES])
    spt = verification.stale_padding_table(mine, probe_of)
    if len(spt) and spt["padding"].notna().all():
        spt["ledger"] = spt["build ledger"].map(verification.ledger_label)
        per = {led: (set(g["padding"]), sorted({_short(x) for x in g["gpu_session"]}), g["probe"].nunique())
               for led, g in spt.groupby("ledger")}
        if all(len(v[0]) == 1 for v in per.values()):
            out += ("; the 1-request schedule's 9 padding entries (FA3's prepare kernel writes only request 0's; its output "
                    "is torch::empty) held " + "; ".join(f"{_padding(next(iter(v[0])))} in every stock tap probe with the "
                                                         f"{led.replace('ledger ', 'build ledger ')} ({', '.join(v[1])}, {v[2]} probes)"
                                                         for led, v in sorted(per.items())))
        else:   # some ledger setting saw more than one padding
            out += "; the 1-request schedule's padding varied: " + "; ".join(
                f"{len(v[0])} different set(s) with the {led}" for led, v in sorted(per.items()))
        by_b = _unwritten_at(df, pt, (3, 8), probe_of)
        if len(set(by_b[8].values())) > 1:
            out += ("; with a sentinel pre-filled, group 7 left unwritten, on FULL steps of 8 requests, "
                    + "; ".join(f"requests {u} in {k}" for k, u in sorted(by_b[8].items()))
                    + (", and on steps of 3, " + "; ".join(f"{u} in {k}" for k, u in sorted(by_b[3].items()))
                       if len(set(by_b[3].values())) > 1 else "")
                    + ": below 9 requests what a replay writes depends on what that uninitialised memory held")
    return out + "."


def _padding_clause(df, pt, probe_of=None, data_dir: str = "data") -> str:
    """probe-padding-tp1 (s39, s40, pre-registered): the build ledger switched on and off, alternating, within each
    session (verification.ledger_order), and the stale schedule unprobed engines hold at their first served step
    (verification.padding_test). Empty without its runs."""
    from . import fa3sched, verification

    t = verification.padding_test(df, pt, probe_of or _probe_loader(), data_dir=data_dir)
    if not len(t):
        return ""
    decided = t[t["held"].notna()]
    held = decided["held"].astype(bool)
    tags = decided["prediction"].str.slice(0, 3)
    crashes = t[t["prediction"] == "(d) untapped stock crashes"]
    pads = t[t["prediction"].str.startswith("(d) group 7's padding")]["measured"]
    probed = t[t["instruments"] != "snapshot"]["run"].nunique()
    out = (PARA + f"The build ledger tested, and the unprobed engines' schedule ({PADDING_MATRIX}, "
           f"{', '.join(sorted({_short(x) for x in t['gpu_session']}))}, {t['run'].nunique()} runs: {probed} probed, "
           f"{t['run'].nunique() - probed} with only a host copy of each FA3 schedule when the first served step began): "
           f"{int(held.sum())} of {len(decided)} checks held as predicted before the run")
    if not held.all():
        out += " (not held: " + "; ".join(f"{r} {p}: {m}" for r, p, m in
                                          zip(decided[~held]["run"], decided[~held]["prediction"], decided[~held]["measured"])) + ")"
    led = tags.isin(["(a)", "(b)"])
    n_off = t[t["prediction"] == "(a) completes"]["run"].nunique()
    n_on = t[t["prediction"] == "(b) completes"]["run"].nunique()
    # the sessions whose probes alternated between both settings: there the comparison is inside one session
    both = sorted(_short(s) for s, o in verification.ledger_order(df).items() if o["alternates"])
    if both and held[led].all():
        out += (f"; in {'each of ' + ' and '.join(both) if len(both) > 1 else both[0]}, alternating, the padding followed "
                f"the ledger setting (off: s36's and s37's, {n_off} of {n_off} runs; on: s38's, {n_on} of {n_on}): the "
                "ledger, not the session, most plausibly set s38's")
    off_pad = verification.fmt_schedule(fa3sched.PADDING_S37)
    # the ledger-off sentinel runs: s36's and s37's (the taps and pre-fill matrices) and this matrix's
    off_sessions = ", ".join(["s36", "s37"] + sorted({_short(x) for x in t[t["prediction"].str.startswith("(a)")]["gpu_session"]}))
    if len(crashes):
        out += "; untapped stock crashed " + ", ".join(f"{int(g['held'].sum())} of {len(g)} at {c}"
                                                      for c, g in crashes.groupby("concurrency"))
        if len(pads) == len(crashes) and set(pads) == {off_pad} and "(a)" in set(tags) and held[tags == "(a)"].all():
            out += (f", and group 7 held the padding {off_pad} in each at its first served step (schedule snapshot on): "
                    f"the ledger-off probes' stale schedule, whose replays the sentinel runs ({off_sessions}) showed "
                    "leaving requests 1..b-1 of b up to 8 unwritten, and every request from 9 on (s36, s38)")
        else:
            out += f"; their group 7 padding at the first served step: {'; '.join(sorted(set(pads)))}"
    return out + "."


def _snapcore_clause(df, data_dir: str = "data") -> str:
    """snap-coredump-tp1 (s40, pre-registered): the unprobed engines with the schedule snapshot, now with core dumps
    (verification.snapcore_test). Empty without its runs."""
    from . import fa3sched, verification

    t = verification.snapcore_test(df, data_dir=data_dir)
    if not len(t):
        return ""
    held = t["held"].astype(bool)
    out = (PARA + f"With core dumps ({verification.SNAPCORE_MATRIX}, {', '.join(sorted({_short(x) for x in t['gpu_session']}))}, "
           f"{t['run'].nunique()} untapped stock runs with the snapshot): {int(held.sum())} of {len(t)} checks held as "
           "predicted before the run")
    if not held.all():
        return out + " (not held: " + "; ".join(f"{r} {p}: {m}" for r, p, m in zip(
            t[~held]["run"], t[~held]["prediction"], t[~held]["measured"])) + ")."
    kern = t[t["prediction"].str.startswith("(g)")]
    return out + ("; every run crashed, group 7 held " + verification.fmt_schedule(fa3sched.STALE_S39)
                  + " at the first served step in each, and the cores named "
                  + "; ".join(f"at {c} {', '.join(f'{k} {n} of {len(g)}' for k, n in g['measured'].value_counts().items())}"
                              for c, g in kern.groupby("concurrency", sort=False)) + ".")


def _padding(pad) -> str:
    """A schedule's padding for prose: one value when all entries hold it, else the list; large values in hex."""
    from .verification import fmt_schedule, fmt_value

    return f"all {fmt_value(pad[0])}" if len(set(pad)) == 1 else fmt_schedule(pad)


def _unwritten_at(df, pt, sizes, probe_of) -> dict:
    """Per batch size in ``sizes`` and GPU session with its build-ledger setting ("s39 (ledger off)"), the set of
    requests group 7 left unwritten on the most FULL steps of that many requests, over the stock sentinel runs of the
    pre-fill matrices and of probe-padding-tp1 (fa3sched.unwritten_by_batch), each probe matched to its own run line
    and read once (``probe_of``: path -> probe log)."""
    import pandas as pd

    from . import fa3sched, verification

    out: dict = {b: {} for b in sizes}
    if "probe_taps" not in df:
        return out
    matrices = FILL_MATRICES + (PADDING_MATRIX,)
    runs = df[df["matrix"].isin(matrices) & (df["probe_taps"] == "sentinel") & (df["fix"] != True)]  # noqa: E712
    tp = verification.tapped(pt)
    rows = pd.concat([verification.of_matrix(tp, df, m) for m in matrices])
    steps: dict = {}
    for path, sess, eng, fx, led in zip(rows["path"], rows["gpu_session"], rows["engine"], rows["fix"], rows["build ledger"]):
        if fx != "stock" or not len(verification.probe_runs(runs, path.split("/")[-3], eng)):
            continue
        key = f"{_short(sess)} ({verification.ledger_label(led)})"
        t = fa3sched.unwritten_by_batch([probe_of(path)])
        for b, m, n in zip(t["requests"], t["unwritten (measured)"], t["FULL steps"]):
            if b in out:
                steps[(b, key, m)] = steps.get((b, key, m), 0) + int(n)
    for (b, key, m), n in sorted(steps.items(), key=lambda x: -x[1]):
        out[b].setdefault(key, m)
    return out


def _discriminating_line(df) -> str:
    """The discriminating runs of every session whose own stock control crashed: each variant's outcome beside
    what the mechanism predicts from its configuration (dflash_lab.discriminate)."""
    from . import discriminate

    t = discriminate.table(df)
    sessions = discriminate.controlled_sessions(t)
    if not sessions:
        return "Discriminating runs: none recorded in a session whose stock control crashed."
    per, agree, decided, disagree, not_controls, shares = [], 0, 0, 0, 0, []
    for x in sessions:
        sm = discriminate.session_summary(t, x)
        agree, decided = agree + sm["agree"], decided + sm["decided"]
        disagree, not_controls = disagree + sm["disagree"], not_controls + sm["not_controls"]
        rows = t[(t["gpu_session"] == x) & ~t["stock control"] & (t["runs"] > 0)]
        shares += list(rows[rows["discriminates"]]["output from drafting steps"].dropna())
        parts = [f"{r['configuration'].replace('dflash k=15, ', '')} at concurrency {r['concurrency']}: {r['crashed / runs']} "
                 f"crashed (predicted: {r['prediction']}"
                 + (f"; core dump: {r['faulting kernel (core dump)']}" if r["faulting kernel (core dump)"] != "-" else "")
                 + ("" if r["discriminates"] else f"; below concurrency {discriminate.CRASH_CONCURRENCY}: not discriminating")
                 + ")" for _, r in rows.iterrows()]
        per.append(f"session {x} (stock control crashed {sm['stock_control_crashed']}/{sm['stock_control_runs']}): "
                   + ("; ".join(parts) or "no variant measured"))
    verdict = ("Every decided prediction held" if decided and decided == agree
               else f"{agree} of {decided} decided predictions held, {disagree} failed, "
                    f"{not_controls} completed without drafting")
    drafting = (f"in the completed runs at least {min(shares):.1%} of the output came from drafting steps" if shares
                else "no run completed")
    return (f"Discriminating runs (predictions from each configuration, notebook 03): {verdict[0].lower()}{verdict[1:]}; "
            f"{drafting}. By GPU session:" + "".join(f"{PARA}{x[0].upper()}{x[1:]}." for x in per))


def _end_to_end_line(df) -> str:
    """The fix against an independent PIECEWISE engine: greedy tokens and throughput, in one session."""
    from . import verification

    osess = verification.output_sessions(df)
    if not osess:
        return "End-to-end tokens and throughput against a PIECEWISE engine: not measured."
    o = osess[-1]
    ov = verification.verdict(verification.session_table(df, o))
    ag = verification.output_agreement(df, o)
    same, total = verification.identical_totals(ag)
    div = verification.token_divergence(df, o)
    tp = verification.throughput_table(df, o).set_index("mode")
    f, p = tp.loc["fix 2, FULL_AND_PIECEWISE"], tp.loc["stock, PIECEWISE"]
    pm_ = verification.position_matched(df, o)
    warm = pm_[pm_["position after engine start"] > 0]
    out = (f"GPU session {o} (stock control at concurrency 32 crashed {ov['stock_crashed']}/{ov['stock_runs']}): the fix ran "
           f"greedy beside an independent PIECEWISE engine with no garbage output, {same}/{total} requests token-identical")
    if len(div):
        out += (f"; the {len(div)} others, batch slot(s) {sorted(set(div['request']))}, part at output position "
                f"{sorted(set(div['first differing output position']))} with an output PIECEWISE gives the same prompt at "
                "other slots (a repeatable difference token ids cannot judge: with dummy weights nearly every token is one "
                "repeated id, and stock matched too at concurrency 2, so this check is coarse)")
    if f["warm runs"] and p["warm runs"]:
        out += (f"; throughput at concurrency 32: {f['median tok/s'] / p['median tok/s']:.2f}x PIECEWISE on the medians of "
                f"{int(f['warm runs'])} and {int(p['warm runs'])} warm runs ({warm['ratio'].min():.2f}x-{warm['ratio'].max():.2f}x "
                "run by run: parity within the spread).")
    else:
        out += "; throughput against PIECEWISE: no warm runs of both modes."
    return out


def repro_min_runs(root="."):
    """Every recorded GPU run of scripts/repro_min.py (data/gpu/*repro-min*/), oldest first: its GPU session, how
    its verdict was reached (meta.json's "judged"; else printed on the host, or --rejudge on the CPU from the
    children's files), the verdict's first word and the verdict line. A run without a verdict.txt has ``verdict`` None."""
    import pandas as pd

    from .analysis import session_key

    rows = []
    for d in Path(root).glob("data/gpu/*repro-min*"):
        try:
            meta = json.loads((d / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
        v = d / "verdict.txt"
        line = v.read_text().strip() if v.exists() else None
        rows.append({"folder": str(d.relative_to(root)), "gpu_session": meta.get("gpu_session"),
                     # a run whose verdict was reached some other way says so in its meta.json ("judged")
                     "judged": (meta.get("judged") or (
                         "on the CPU from the files its engines wrote (scripts/repro_min.py --rejudge)"
                         if "--rejudge" in str(meta.get("verdict_by", "")) else "as printed on the GPU host"))
                     if line else None,
                     "verdict": line.split(":", 1)[0] if line else None, "verdict line": line,
                     "start-up s": _startups(d)})
    rows.sort(key=lambda r: (session_key(r["gpu_session"] or ""), r["folder"]))
    return pd.DataFrame(rows, columns=["folder", "gpu_session", "judged", "verdict", "verdict line", "start-up s"])


def _engine_startups(run_dir: Path) -> dict:
    """{role: seconds}: each engine's start-up as its child recorded it (children/<role>.started.json; an engine
    that never finished starting, or whose file is unreadable, has none)."""
    got = {}
    for role in ("stock", "reference", "fixed"):
        try:
            v = float(json.loads((run_dir / "children" / f"{role}.started.json").read_text())["startup_s"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue
        got[role] = v
    return got


def _startups(run_dir: Path) -> str | None:
    """'stock 147.9, reference 162.3, fixed 37.8' (see _engine_startups)."""
    return ", ".join(f"{r} {v:g}" for r, v in _engine_startups(run_dir).items()) or None


def repro_min_startups(root=".", limit_s: float = 120.0):
    """Every recorded engine start-up of scripts/repro_min.py: folder, GPU session, role, seconds, whether it is
    under ``limit_s`` (the issue's 2 minutes), whether its log says it loaded compiled graphs from vLLM's cache
    instead of compiling them ("Directly load the compiled graph"), how many Triton autotuning passes it printed
    (only for runs whose device command set TRITON_PRINT_AUTOTUNING=1, else None), and where its worker's Triton
    cache was (the ``caches`` field the script records since s24: "compile cache" when TRITON_CACHE_DIR pointed into
    vLLM's torch_compile_cache, "~/.triton/cache" when it was unset; None where not recorded); and the runs with all
    three engines under the limit."""
    import pandas as pd

    runs = repro_min_runs(root)
    rows = []
    for folder, session in zip(runs["folder"], runs["gpu_session"]):
        d = Path(root) / folder
        try:
            printed = "TRITON_PRINT_AUTOTUNING=1" in json.loads((d / "meta.json").read_text()).get("device_command", "")
        except (OSError, ValueError, AttributeError):
            printed = False
        for role, v in _engine_startups(d).items():
            try:
                log = (d / "children" / f"{role}.log").read_text(errors="replace")
            except OSError:
                log = ""
            rows.append({"folder": folder, "gpu_session": session, "role": role, "startup_s": v,
                         "under limit": v < limit_s, "graphs from cache": "Directly load the compiled graph" in log,
                         "autotuning passes": log.count("Triton autotuning for function") if printed else None,
                         "Triton cache": _triton_cache(d / "children" / f"{role}.started.json")})
    t = pd.DataFrame(rows, columns=["folder", "gpu_session", "role", "startup_s", "under limit", "graphs from cache",
                                    "autotuning passes", "Triton cache"])
    all_under = [f for f, g in t.groupby("folder", sort=False) if len(g) == 3 and g["under limit"].all()]
    return t, all_under


def _triton_cache(started: Path) -> str | None:
    """Where an engine's worker kept Triton's cache (see repro_min_startups), from its started.json."""
    try:
        c = json.loads(started.read_text())["caches"]["TRITON_CACHE_DIR"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(c, dict):
        return None
    path = c.get("path")
    if not path:
        return "~/.triton/cache"
    return "compile cache" if "torch_compile_cache" in path else path


def _repro_min_label(root) -> str:
    """The minimal reproducer's latest recorded GPU verdict (by its GPU session)."""
    runs = repro_min_runs(root)
    runs = runs[runs["verdict"].notna()]
    if not len(runs):
        return "Minimal reproducer (vLLM 0.22.1 only; no GPU verdict recorded yet)"
    r = runs.iloc[-1]
    return (f"Minimal reproducer (vLLM 0.22.1 only). Its GPU run {r['folder']} "
            f"(session {r['gpu_session']}), {r['judged']}: {r['verdict line']}")
