"""Reading the step probe's logs (``data/gpu/<session>/<engine>.probe/probe-<pid>.jsonl[.xz|.gz]``).

The probe (:mod:`dflash_lab.probe`) writes, per target step, the canaries' violations and, on
FULL-graph steps, a layer-by-layer comparison of the graph replay with a no-graph reference pass
of the same step. This module turns those lines into tables for the notebooks: the first step
and layer where the two passes differ, the first non-finite values, the violations.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re

from .errors import LabError
from .runner import json_lines

PROBE_GLOB = "data/gpu/*/*.probe/probe-*.jsonl*"


def probe_files(pattern: str = PROBE_GLOB) -> list[str]:
    return sorted(glob.glob(pattern))


# set while a shared_probes() block runs: (path as given, its real path, size, mtime) -> the probe read from it
_shared: dict | None = None


@contextlib.contextmanager
def shared_probes():
    """Inside this block each probe log is read once: a second :func:`load_probe` of the same path returns the same
    dict, as long as the file's size and modification time are unchanged (a rewritten file is read again). For one
    build that reads the same logs in several places (the findings page read 113 logs 403 times, 53 of its 77 s).
    Callers must not change what they get. The logs stay in memory until the block ends (all of today's ~3 GB in
    Python objects, about what notebook 03 holds at once); outside any block nothing is kept."""
    global _shared
    outer, _shared = _shared, ({} if _shared is None else _shared)
    try:
        yield
    finally:
        if outer is None:
            _shared = None


def load_probe(path: str) -> dict:
    """{'steps': [...], 'samples': {step: line}, 'layout': line | None, 'session', 'engine', 'path'}.
    Read once per :func:`shared_probes` block."""
    if _shared is None:
        return _read_probe(path)
    try:
        st = os.stat(path)
    except OSError:
        return _read_probe(path)  # its own error for a missing file
    key = (str(path), os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _shared:
        _shared[key] = _read_probe(path)
    return _shared[key]


def _read_probe(path: str) -> dict:
    steps, samples, layout = [], {}, None
    for i, d in json_lines(path):
        if "step" not in d and d.get("kind") != "layout":
            raise LabError(f"{path}:{i}: not a probe line")
        kind = d.get("kind")
        if kind == "sample":
            samples[d["step"]] = d
        elif kind == "layout":
            layout = d
        else:
            steps.append(d)
    parts = os.path.normpath(path).split(os.sep)
    return {"steps": steps, "samples": samples, "layout": layout, "path": path,
            "session": parts[-3] if len(parts) >= 3 else None,
            "engine": parts[-2].replace(".probe", "") if len(parts) >= 2 else None}


def probe_key(probe: dict) -> str:
    """'<session>/<engine>', e.g. '2026-11-30_h200_root-probe-tp1/stock-probe.a1': what names one probed engine."""
    return f"{probe['session']}/{probe['engine']}"


def pick_probe(probes: list[dict], key: str) -> dict:
    """The one probe named by ``key``: its file's path, its '<session>/<engine>' key, or an engine name
    ('stock-probe.a1') that only one session has. A prefix does not select: 'stock-probe' would also name
    'stock-probe-low', whose file sorts first. An engine with several probe files (one per process, e.g. one per
    tensor-parallel rank) is named by path."""
    hits = ([p for p in probes if p["path"] == key] or [p for p in probes if probe_key(p) == key]
            or [p for p in probes if p["engine"] == key])
    have = sorted(probe_key(p) for p in probes)
    if not hits:
        raise LabError(f"no probed engine {key!r} (have {have})")
    if len(hits) > 1:
        raise LabError(f"{key!r} names {len(hits)} probe files: give '<session>/<engine>', or a file's path for an "
                       f"engine with one file per process ({sorted(p['path'] for p in hits)})")
    return hits[0]


def short(layer: str) -> str:
    """'language_model.model.layers.7.self_attn.attn' -> 'L7 attn'; '...linear_attn' -> 'L8 gdn'."""
    m = re.search(r"layers\.(\d+)\.", layer)
    n = m.group(1) if m else "?"
    kind = "gdn" if layer.endswith("linear_attn") else "attn"
    return f"L{n} {kind}"


def _target_layers(step: dict) -> list[str]:
    return [k for k in step.get("diverge", {}).get("layers", {}) if k.startswith("language_model.")]


def divergence_matrix(probe: dict):
    """(steps, layers, values): max relative difference of each layer's writes, FULL vs reference.

    ``inf`` where the graph replay wrote NaN/Inf and the reference did not; ``nan`` where both
    did (no comparison possible). Target layers only (the draft's layers share the metadata dict
    but are not run by the target's forward).
    """
    import numpy as np

    rows = [s for s in probe["steps"] if s.get("diverge", {}).get("layers")]
    if not rows:
        return [], [], np.zeros((0, 0))
    layers = _target_layers(rows[0])
    vals = np.zeros((len(rows), len(layers)))
    for i, s in enumerate(rows):
        for j, name in enumerate(layers):
            v = s["diverge"]["layers"].get(name, {})
            run_bad, ref_bad = v.get("nonfinite_run", 0), v.get("nonfinite_ref", 0)
            if run_bad > ref_bad:
                vals[i, j] = math.inf
            elif run_bad and ref_bad:
                vals[i, j] = math.nan
            else:
                vals[i, j] = float(v.get("max_rel", 0.0))
    return [s["step"] for s in rows], layers, vals


def first_divergence(probe: dict) -> dict | None:
    """The first FULL step whose replay differs from the reference, and where in the model it starts."""
    for s in probe["steps"]:
        d = s.get("diverge")
        if not d or not d.get("diverged"):
            continue
        layers = _target_layers(s)
        first = d.get("first_layer")
        equal = [x for x in layers[: layers.index(first)]] if first in layers else []
        before = layers[layers.index(first) - 1] if first in layers and layers.index(first) > 0 else None
        out = d.get("outputs", {}).get("hidden", {})
        return {"step": s["step"], "mode": s["mode"], "num_reqs": s.get("num_reqs"), "num_tokens": s.get("num_tokens"),
                "first_layer_written_differently": first,
                "layers_written_identically_before": len(equal),
                "all_before_bit_identical": all(d["layers"][x]["max_abs"] == 0.0 for x in equal),
                "last_layer_before": before,
                "hidden_rows_differ": out.get("rows_differ"), "hidden_max_abs": out.get("max_abs")}
    return None


ZERO_ACCEPTED_COLUMNS = ["step", "mode", "row", "request"]


def zero_accepted(probe: dict, group: str = "gdn0"):
    """Every (step, batch row, request) whose GDN spec-decode metadata carries an accepted count of 0, i.e. the step
    before gave that row no valid token. vLLM 0.22.1's ``fused_sigmoid_gating_delta_rule_update_kernel`` reads the
    row's initial state slot at column ``num_accepted_tokens - 1`` of ``ssm_state_indices`` (fused_sigmoid_gating.py
    106-111): for a row above 0 that is the previous row's last entry, a valid slot of another request; for row 0 it
    is the element before the tensor. ``reqs`` and the GDN rows are in the same batch order."""
    import pandas as pd

    rows = []
    for s in probe["steps"]:
        g = (s.get("gdn") or {}).get(group)
        if not g or g.get("na") is None:
            continue
        for row, (req, x) in enumerate(zip(s.get("reqs") or [], g["na"])):
            if x == 0:
                rows.append({"step": s["step"], "mode": s["mode"], "row": row, "request": req})
    return pd.DataFrame(rows, columns=ZERO_ACCEPTED_COLUMNS)


OOR_COLUMNS = ["step", "row", "request", "token"]


def out_of_vocab_ids(probe: dict, vocab_size: int):
    """Every (step, batch row, request) whose first sampled id, as the probe's sample line recorded it, is at or above
    ``vocab_size``. vLLM 0.22.1's drafter counts only ids below it as valid (spec_decode/utils.py:220), so such a row
    holds no valid token: the next step's accepted count for it is 0. With the probe's replacement on (probe_oor) the
    line records the replaced ids, and ``oor_replaced`` says how many there were."""
    import pandas as pd

    rows = [{"step": st, "row": row, "request": req, "token": int(tok)}
            for st, smp in sorted(probe["samples"].items())
            for row, (req, tok) in enumerate(zip(smp.get("reqs") or [], smp.get("first_token") or []))
            if int(tok) >= vocab_size]
    return pd.DataFrame(rows, columns=OOR_COLUMNS)


def seq_advance_after_oor(probe: dict, vocab_size: int, group: str = "attn0", oor=None):
    """How far each request's sequence length (the target's attention metadata ``group``, as the probe recorded it per
    step and request) moved from one of its steps to its next scheduled step, split by whether its first sampled id on
    the first of the two was out of vocabulary (:func:`out_of_vocab_ids`). vLLM 0.22.1's scheduler keeps the rejected
    draft tokens of such a row in ``num_computed_tokens`` (+1 + k); if the model runner placed the request's next
    tokens by that count, the length would jump by 1 + k after such a row. Returns ``(after, other)``: Counters of the
    advance, in tokens. ``oor``: :func:`out_of_vocab_ids` where the caller has it."""
    from collections import Counter

    oor = out_of_vocab_ids(probe, vocab_size) if oor is None else oor
    bad = {(int(st), int(q)) for st, q in zip(oor["step"], oor["request"])}
    seq: dict = {}
    for s in probe["steps"]:
        lens = ((s.get("attn") or {}).get(group) or {}).get("seq_lens") or []
        for q, n in zip(s.get("reqs") or [], lens):
            seq.setdefault(int(q), []).append((int(s["step"]), int(n)))
    after, other = Counter(), Counter()
    for q, xs in seq.items():
        xs.sort()
        for (a, la), (_, lb) in zip(xs, xs[1:]):
            (after if (a, q) in bad else other)[lb - la] += 1
    return after, other


def oor_links(probe: dict, vocab_size: int, group: str = "gdn0", oor=None, zero=None) -> dict:
    """Whether a step's accepted-0 rows (:func:`zero_accepted`) are exactly the requests whose first sampled id the
    step before was out of vocabulary (:func:`out_of_vocab_ids`), on every step that has either and whose previous
    step's sample line was recorded: ``linked`` such steps, ``unlinked`` the steps where the two sets differ.
    ``oor`` / ``zero``: those two tables when the caller has them already."""
    oor = out_of_vocab_ids(probe, vocab_size) if oor is None else oor
    zero = zero_accepted(probe, group) if zero is None else zero
    by_step_oor = {s: set(g["request"]) for s, g in oor.groupby("step")}
    by_step_zero = {s: set(g["request"]) for s, g in zero.groupby("step")}
    linked, unlinked = 0, []
    for s in probe["steps"]:
        st = s["step"]
        g = (s.get("gdn") or {}).get(group)
        if not g or g.get("na") is None or (st - 1) not in probe["samples"]:
            continue
        running = set(s.get("reqs") or [])
        want = by_step_oor.get(st - 1, set()) & running   # a request that finished is not in the next step
        got = by_step_zero.get(st, set())
        if want or got:
            if want == got:
                linked += 1
            else:
                unlinked.append(st)
    return {"linked": linked, "unlinked": unlinked}


ROW0_HOW = {"sampled": "row 0's own sampled id out of vocabulary (the same step's drafter inputs read it)",
            "moved": "a request with an accepted count of 0 moved into row 0 (the GDN kernel reads state column -1)"}


def row0_without_token(probe: dict, vocab_size: int, group: str = "gdn0") -> dict | None:
    """The first step in which batch row 0 holds a request with no valid token from its last step: its GDN accepted
    count is 0 at the step's start (``moved``: the request got an out-of-vocabulary id while in another row, then
    moved into row 0 when the batch was condensed), or its first sampled id in that step is out of vocabulary
    (``sampled``). In row 0 the column before the first is the element before the tensor (fused_sigmoid_gating.py
    106-111 for the GDN state indices; for the DFlash input kernel, v1/spec_decode/utils.py:526, the position read
    before a request's first context token). None when it never happened."""
    for s in probe["steps"]:
        g = (s.get("gdn") or {}).get(group) or {}
        if g.get("na") and int(g["na"][0]) == 0:
            return {"step": s["step"], "how": "moved"}
        smp = probe["samples"].get(s["step"]) or {}
        if smp.get("first_token") and int(smp["first_token"][0]) >= vocab_size:
            return {"step": s["step"], "how": "sampled"}
    return None


def row0_changes(probe: dict, group: str = "gdn0") -> list[dict]:
    """Every step at which batch row 0 holds another request than the step before (a finished request's slot taken
    when vLLM condenses the batch): the step, the request that left and the one that came, and the newcomer's GDN
    accepted count at that step's start (``accepted``; None where the step recorded no GDN metadata). A count of 0
    there is :func:`row0_without_token`'s ``moved``; a positive count is the same move without the fault's cause.
    ``returned``: whether the request that left row 0 appears in a later step (moved, not finished)."""
    out, prev = [], None
    for s in probe["steps"]:
        reqs = s.get("reqs") or []
        if not reqs:
            continue
        if prev is not None and reqs[0] != prev:
            na = ((s.get("gdn") or {}).get(group) or {}).get("na")
            out.append({"step": s["step"], "left": prev, "came": reqs[0],
                        "accepted": int(na[0]) if na else None})
        prev = reqs[0]
    # a request that left row 0 and is never seen again had finished (or was aborted); one seen later was moved
    later: dict = {}
    for s in probe["steps"]:
        for r in s.get("reqs") or []:
            later[r] = s["step"]
    for c in out:
        c["returned"] = later.get(c["left"], -1) >= c["step"]
    return out


def row0_replaced_steps(probe: dict) -> list[int]:
    """The steps on which the probe's replacement gave batch row 0 its only token: row 0 kept one sampled id
    (``valid``) and the step's sample line counts a replaced id (``oor_replaced``). Meaningful for a run whose
    replacement covered row 0 alone (``probe_oor: row0``), where every replaced id is row 0's: without the replacement
    row 0 would have held a request with no valid token on these steps."""
    out = []
    for k in sorted(probe["samples"]):
        smp = probe["samples"][k]
        valid = smp.get("valid") or []
        if valid and int(valid[0]) == 1 and int(smp.get("oor_replaced") or 0) >= 1:
            out.append(int(k))
    return out


def schedule_agreement(a: dict, b: dict, group: str = "gdn0") -> dict:
    """Two probe logs step by step: the steps both recorded, those whose batch rows held other requests (``reqs``),
    and those whose GDN accepted counts at the step's start differed (``na``). Two runs of one seeded workload that
    agree on every step are replicas of each other's schedule there."""
    def by_step(p):
        return {s["step"]: (s.get("reqs"), ((s.get("gdn") or {}).get(group) or {}).get("na")) for s in p["steps"]}

    sa, sb = by_step(a), by_step(b)
    common = sorted(set(sa) & set(sb))
    return {"common": common, "reqs differ": [k for k in common if sa[k][0] != sb[k][0]],
            "counts differ": [k for k in common if sa[k][1] != sb[k][1]]}


def nan_onset(probe: dict) -> dict | None:
    """The first step whose graph replay produced NaN/Inf outputs where the reference pass did not."""
    for s in probe["steps"]:
        out = s.get("diverge", {}).get("outputs", {}).get("hidden")
        if out and out.get("nonfinite_run", 0) > out.get("nonfinite_ref", 0):
            layers = s["diverge"].get("layers", {})
            first = next((k for k in _target_layers(s)
                          if layers[k].get("nonfinite_run", 0) > layers[k].get("nonfinite_ref", 0)), None)
            smp = probe["samples"].get(s["step"], {})
            return {"step": s["step"], "num_reqs": s.get("num_reqs"), "num_tokens": s.get("num_tokens"),
                    "rows_nonfinite_graph": out["nonfinite_run"], "rows_nonfinite_reference": out["nonfinite_ref"],
                    "first_layer_with_nonfinite_writes": first,
                    "logits_rows_nonfinite": smp.get("logits_nonfinite")}
    return None


def step_series(probe: dict):
    """One row per step: mode, requests, tokens, output difference, non-finite rows, violations."""
    import pandas as pd

    rows = []
    for s in probe["steps"]:
        out = s.get("diverge", {}).get("outputs", {}).get("hidden", {})
        smp = probe["samples"].get(s["step"], {})
        rows.append({"step": s["step"], "mode": s["mode"], "num_reqs": s.get("num_reqs"),
                     "num_tokens": s.get("num_tokens"), "hidden_max_abs_diff": out.get("max_abs"),
                     "rows_nonfinite_graph": out.get("nonfinite_run"), "rows_nonfinite_ref": out.get("nonfinite_ref"),
                     "logits_rows_nonfinite": smp.get("logits_nonfinite"),
                     "violations": s.get("n_violations", len(s.get("violations", []))),
                     "first_violation": (s.get("violations") or [{}])[0].get("field"),
                     "error": s.get("error")})
    return pd.DataFrame(rows)


def first_violations(probe: dict, n: int = 8) -> list[dict]:
    """The first violation of each field, in step order."""
    seen, out = set(), []
    for s in probe["steps"]:
        for v in s.get("violations", []):
            if v["field"] in seen:
                continue
            seen.add(v["field"])
            out.append({"step": s["step"], "num_reqs": s.get("num_reqs"), **{k: v.get(k) for k in
                        ("field", "group", "row", "value", "expected", "why", "layer", "tensor", "rows")}})
            if len(out) >= n:
                return out
    return out
