"""FA3's precomputed schedule (the ``scheduler_metadata`` vLLM 0.22.1 passes to FlashAttention 3), decoded.

Layout, from vllm-project/flash-attention at 5824e6e (the commit vLLM 0.22.1's ``flash_attn.py`` cites;
``hopper/flash_api.cpp`` 554-700 builds it, ``mha_fwd`` 1043-1088 reads it back): for ``b`` requests and
``b4 = round_up(b, 4)``, ``nvec`` vectors of ``b4`` int32 each, then one semaphore::

    [0, b4)                 prepare_seqlen_q    query rows per request (tokens x query heads per KV head, GQA packed)
    [b4, 2 b4)              num_splits_dynamic  KV splits per request        (present when num_splits > 1)
    [(nvec-1) b4, nvec b4)  num_nheads_in_l2    heads kept in L2 together   (present for causal/local attention)
    [nvec b4]               tile_count_semaphore

A FULL CUDA graph captured for ``b`` requests reads those offsets of its builder's persistent buffer,
whatever was last written there. What the forward does with one request's entries
(``hopper/tile_scheduler.hpp`` 479-513, ``flash_fwd_combine_kernel.h`` 453-454):

- 0 splits, or 0 query rows: the main kernel gives the request no tile, and the combine, which skips
  requests with at most one split, does not write it either: its output rows are **never written** and
  keep whatever the buffer held;
- fewer query rows than the step has, by more than the last 128-row tile covers: only the tiles covering the
  rows it reads are computed (**partial**);
- query rows but more than one split and nothing computed: the combine mixes split partials that were
  never written this call (**combined from unwritten partials**).

:func:`coverage` applies these rules to a recorded schedule; :func:`unwritten_table` compares them with
what the step probe's sentinel taps measured on the GPU (:mod:`dflash_lab.probe`).
"""

from __future__ import annotations

import re

from .errors import LabError

class NotModelled(LabError):
    """A schedule whose effect :func:`coverage` does not model (skipped tiles, splits past the graphs' split buffers, a
    head swizzle dividing by 0): a limit of the model, not a malformed record, which stays a plain :class:`LabError`."""


WRITTEN, UNWRITTEN, PARTIAL, COMBINED = "written", "unwritten", "partial", "combined from unwritten partials"
# query rows per tile: hopper/tile_size.h tile_size_fwd_sm90 at 5824e6e gives kBlockM 128 for 2-byte elements and
# head dim > 192 (Qwen3.6-35B-A3B's attention: 256); rows past the step's own inside a tile are masked, not written
BLOCK_M = 128
MAX_SPLITS = 32  # vLLM's flash_attn_max_num_splits_for_cuda_graph: what the graphs' split buffers are sized for


# the entries of a 1-request schedule (13 of them: 3 vectors of 4, then the semaphore) that FA3's prepare kernel does not
# write: each vector's padding past request 0. get_scheduler_metadata allocates its output with torch::empty
# (hopper/flash_api.cpp:673 at 5824e6e) and the kernel writes only entries batch_idx < num_batch
# (hopper/flash_prepare_scheduler.cu:202-206), so these hold whatever the caching allocator's block held before;
# vLLM then copies all 13 into the persistent buffer (flash_attn.py:547) and zeroes only the entries after them
PADDING_1 = (1, 2, 3, 5, 6, 7, 9, 10, 11)


def padding_1(vec) -> tuple[int, ...]:
    """The values a 1-request schedule ``vec`` holds where FA3 wrote nothing (:data:`PADDING_1`). ``vec`` may be a
    persistent buffer holding one (longer, zeroed after the 13 entries) or shortened by its trailing zeros; anything
    else is not a 1-request schedule and is refused."""
    vec = [int(x) for x in vec]
    if len(vec) < 9 or any(vec[13:]):
        raise LabError(f"FA3 schedule: {len(vec)} entries, not a 1-request schedule (13, zeroed after)")
    vec = (vec + [0] * 13)[:13]
    return tuple(vec[i] for i in PADDING_1)


def stale_paddings(probe: dict, group: str = "7") -> dict:
    """One probe's stale reads of ``group``: {their padding (:func:`padding_1`), or None where the stale schedule is
    not a 1-request one: how many FULL-step reads}."""
    out: dict = {}
    for v, n in stale_vectors([probe], group=group).items():
        try:
            key = padding_1(v)
        except LabError:
            key = None
        out[key] = out.get(key, 0) + n
    return out


def snapshot_table(paths):
    """Per schedule-snapshot line (``dflash_lab.schedsnap``; one per worker process) and FA group whose FULL graphs read
    a persistent schedule: what the buffer held when the first served step began (its first 13 entries), and its
    entries 1-3, 5-7 and 9-11 where it holds no more than 13 (:func:`padding_1`): the padding, if it is a 1-request
    schedule. The contents alone do not say the batch size it was built for (a short 2-request schedule fits 13
    entries too); for a stock engine's group 7 the build ledger showed it is the 1-request capture's (s38)."""
    import pandas as pd

    from . import schedsnap

    cols = ["file", "pid", "group", "layers", "entries", "head", "entries 1-3, 5-7, 9-11", "error"]
    rows = []
    for path in paths:
        for line in schedsnap.read(path):
            if line.get("error"):
                rows.append({"file": str(path), "pid": line.get("pid"), "error": line["error"]})
                continue
            for g in line["groups"]:
                if not g.get("use_full_cuda_graph"):
                    continue
                buf = [int(x) for x in g["buffer"]]
                try:
                    pad = list(padding_1(buf))
                except LabError:
                    pad = None   # fewer than 9 or more than 13 entries before the zeroed tail
                rows.append({"file": str(path), "pid": line.get("pid"), "group": g["gid"], "layers": len(g["layers"]),
                             "entries": g["entries"], "head": buf[:13], "entries 1-3, 5-7, 9-11": pad, "error": None})
    return pd.DataFrame(rows, columns=cols)


PADDING_S37 = (0, 31, 0, 0, 0, 0, 0, 0, 0)   # what every stock tap probe of s36 and s37 read there
PADDING_S38 = (0x7FFF7FFF,) * 9              # ... and every one of s38 (build ledger on)
# group 7's whole schedule (trailing zeros dropped) in s39's three untapped engines at the first served step: the
# 1-request capture's, with PADDING_S37 (matrices/snap-coredump-tp1.yaml predicts it, (f))
STALE_S39 = (128, 0, 31, 0, 1, 0, 0, 0, 2)


def snapshot_groups(snapshot_paths):
    """Every (group id, its layer names, its persistent schedule) of every snapshot line (``dflash_lab.schedsnap``),
    the schedule with its trailing zeros dropped, as :func:`stale_vectors` drops them."""
    from . import schedsnap

    for path in snapshot_paths:
        for line in schedsnap.read(path):
            for g in line.get("groups", []):
                v = [int(x) for x in g["buffer"]]
                while v and v[-1] == 0:   # the writer trims them too (schedsnap._trim); a reader must not rely on it
                    v.pop()
                yield int(g["gid"]), list(g.get("layers", [])), tuple(v)


def snapshot_schedules(snapshot_paths, group: str = "7") -> set[tuple]:
    """The persistent schedules ``group``'s builder held when the first served step began, one per snapshot line."""
    return {v for gid, _, v in snapshot_groups(snapshot_paths) if gid == int(group)}


def padding_measured(probe: dict, snapshot_paths, b: int = 8, group: str = "7") -> dict:
    """What one tap probe and its engine's schedule snapshot recorded of ``group``'s stale schedule: the distinct
    schedules its FULL steps read stale, their paddings (:func:`stale_paddings`; None: not a 1-request schedule), the
    requests a pre-fill measured unwritten on FULL steps of ``b`` requests (each step's set, :func:`unwritten_by_batch`)
    and the snapshot's schedules (:func:`snapshot_schedules`)."""
    t = unwritten_by_batch([probe], group=group)
    return {"stale schedules": set(stale_vectors([probe], group=group)),
            "paddings": set(stale_paddings(probe, group)),
            "unwritten": set(t[t["requests"] == b]["unwritten (measured)"]) if len(t) else set(),
            "snapshots": snapshot_schedules(snapshot_paths, group)}


def padding_checks(probe: dict, snapshot_paths, expect_padding, expect_unwritten: list[int], b: int = 8,
                   group: str = "7") -> dict[str, bool]:
    """matrices/probe-padding-tp1.yaml's (a)/(b) and (c) on one sentinel probe: every stale read of ``group`` held
    ``expect_padding`` in its padding; on FULL steps of ``b`` requests the requests left unwritten were
    ``expect_unwritten`` on every step (the measured set, :func:`unwritten_by_batch`); and the engine's schedule
    snapshot of that group (taken when the first served step began) equals every stale schedule the probe read,
    trailing zeros aside. A check with nothing to check (no stale read, no step of ``b`` requests, no snapshot)
    does not hold."""
    return padding_verdicts(padding_measured(probe, snapshot_paths, b, group), expect_padding, expect_unwritten, b)


def padding_verdicts(m: dict, expect_padding, expect_unwritten: list[int], b: int = 8) -> dict[str, bool]:
    """:func:`padding_checks`'s three verdicts on what :func:`padding_measured` returned (``m``), in that order:
    padding, requests left unwritten at ``b``, snapshot."""
    stale = m["stale schedules"]
    return {"padding as expected on every stale read": bool(stale) and m["paddings"] == {tuple(expect_padding)},
            f"requests left unwritten at {b} as expected on every such step": m["unwritten"] == {str(list(expect_unwritten))},
            "snapshot equals every stale read": bool(stale) and bool(m["snapshots"]) and stale <= m["snapshots"]}


def round_up4(b: int) -> int:
    return (b + 3) // 4 * 4


def decode(vec, b: int) -> dict:
    """The vectors of a schedule of length ``n = 1 + round_up(b, 4) * nvec`` for ``b`` requests.

    ``nvec`` is read off the length; 3 (query rows, splits, heads in L2) is what vLLM's FULL graphs use
    (``num_splits`` 32, causal). Other lengths are refused: the offsets would be guesses.
    """
    vec = [int(x) for x in vec]
    if b < 1:
        raise LabError(f"FA3 schedule: {b} requests")
    b4 = round_up4(b)
    n = len(vec)
    if n < 1 + b4 or (n - 1) % b4:
        raise LabError(f"FA3 schedule: {n} entries do not fit 1 + {b4} x nvec for {b} requests")
    nvec = (n - 1) // b4
    if nvec != 3:
        raise LabError(f"FA3 schedule: {nvec} vectors for {b} requests; only the 3-vector layout "
                       "(splits > 1, causal) that vLLM's FULL graphs use is decoded")
    return {"b": b, "b4": b4, "seqlen_q": vec[:b], "num_splits": vec[b4:b4 + b],
            "nheads_l2": vec[2 * b4:2 * b4 + b], "semaphore": vec[3 * b4]}


def coverage(graph_vec, step_vec, b: int, block_m: int = BLOCK_M, max_splits: int = MAX_SPLITS) -> list[str]:
    """Per request, what the FA3 forward of a replay reading ``graph_vec`` writes of the step's output.

    ``step_vec`` is the step's own schedule (what vLLM computed for this batch): its query rows are the
    rows the step has. The main kernel covers ``ceil(rows / block_m)`` tiles of the rows it reads; rows the
    step has beyond them are not written (PARTIAL). Cases whose outcome this model cannot tell are refused:
    a non-zero semaphore (tiles skipped in scheduler order), more splits than the graphs' split buffers hold
    (writes out of bounds), one split with 0 heads in L2 (a division by zero in the head swizzle).
    """
    g, s = decode(graph_vec, b), decode(step_vec, b)
    if g["semaphore"] != 0:
        raise NotModelled(f"FA3 schedule: semaphore {g['semaphore']} at entry: skipped tiles are not modelled")
    out = []
    for i, (rows_g, splits_g, l2_g, rows_s) in enumerate(zip(g["seqlen_q"], g["num_splits"], g["nheads_l2"],
                                                              s["seqlen_q"])):
        if splits_g > max_splits:
            raise NotModelled(f"FA3 schedule: request {i} reads {splits_g} splits, more than the {max_splits} the split "
                           "buffers hold: out-of-bounds writes are not modelled")
        if splits_g == 1 and rows_g > 0 and l2_g <= 0:
            raise NotModelled(f"FA3 schedule: request {i} reads 1 split and {l2_g} heads in L2: the head swizzle divides "
                           "by it; not modelled")
        if splits_g <= 0 or rows_g <= 0:
            out.append(COMBINED if splits_g > 1 and rows_s > 0 else UNWRITTEN)
        elif -(-rows_g // block_m) * block_m < rows_s:
            out.append(PARTIAL)
        else:
            out.append(WRITTEN)
    return out


def group_layers(layout: dict | None) -> dict[str, list[str]]:
    """KV-cache group id (as the probe's ``schedules`` key it) -> its layer names, from the probe's layout line."""
    if not layout or "kv_cache_groups" not in layout:
        return {}
    return {str(g["gid"]): list(g["layers"]) for g in layout["kv_cache_groups"]}


def _prefix(name: str) -> str:
    return name[: name.find("layers.")] if "layers." in name else ""


def target_layers(layout: dict | None) -> set[str] | None:
    """The target model's layer names: those named like its Gated-DeltaNet layers (``language_model.model.``); the
    drafter's (``model.layers.40``.., numbered after the target's) are left out: they do not run in the target's
    forward, so the taps recorded there (before the tap buffers were poisoned between passes) hold the drafter's
    last values in both passes. None when the layout has no GDN group to tell them apart."""
    if not layout or "kv_cache_groups" not in layout:
        return None
    gdn = {_prefix(n) for g in layout["kv_cache_groups"] if g.get("spec") == "MambaSpec" for n in g["layers"]}
    if len(gdn) != 1:
        return None
    pre = next(iter(gdn))
    return {n for g in layout["kv_cache_groups"] for n in g["layers"] if _prefix(n) == pre}


def _target_taps(probe: dict, taps: dict) -> dict:
    keep = target_layers(probe.get("layout"))
    return taps if keep is None else {n: t for n, t in taps.items() if n in keep}


def step_rows(probe: dict):
    """Per FULL step with recorded schedules and taps, per FA group whose graphs read a stale schedule:
    the requests :func:`coverage` predicts unwritten (or partial), and, per layer of that group, the requests
    the taps found unwritten (sentinel runs) or non-finite (plain runs). A schedule :func:`coverage` refuses gives
    ``predicted`` None and the reason in ``"not modelled"``."""
    groups = group_layers(probe.get("layout"))
    for st in probe["steps"]:
        sched, taps = st.get("schedules"), st.get("taps")
        if st.get("mode") != "FULL" or not sched or not taps or st.get("num_reqs") is None:
            continue
        b = int(st["num_reqs"])
        m = re.search(r"num_reqs=(\d+)", str(st.get("desc") or ""))
        if m and int(m.group(1)) != b:
            continue  # the graph was captured for another batch size: its offsets are not the step's; not modelled
        for gid, s in sorted(sched.items()):
            if s.get("same", True):
                continue
            try:
                cov = coverage(s["graph"], s["step"], b)
            except NotModelled as e:
                # a schedule the model refuses (its padding entries read as 2**31 splits, s38): the step is kept, with
                # no prediction, so that the measured rows still count and the refusal is said, not raised
                cov, refused = None, str(e).removeprefix("FA3 schedule: ")
            else:
                refused = None
            predicted = None if cov is None else [i for i, c in enumerate(cov) if c != WRITTEN]
            for layer in groups.get(gid, []):
                t = taps.get(layer)
                if t is None:
                    continue
                yield {"step": st["step"], "num_reqs": b, "num_tokens": st.get("num_tokens"), "group": int(gid),
                       "layer": layer, "predicted": predicted, "kinds": sorted(set(cov)) if cov else [],
                       "not modelled": refused,
                       "unwritten": t.get("req_unwritten_run"), "unwritten_rows": t.get("unwritten_run"),
                       "unwritten_ref": t.get("unwritten_ref"), "nonfinite": t["req_nonfinite_run"],
                       "nonfinite_ref": t["nonfinite_ref"], "differ": t["req_differ"]}


def unwritten_table(probes: list[dict]):
    """One row per (engine, FULL step, stale group layer) of the sentinel-tap probes: predicted unwritten
    requests against the measured ones, and whether they match."""
    import pandas as pd

    rows = []
    for p in probes:
        for r in step_rows(p):
            if r["unwritten"] is None:
                continue  # a plain-tap run: no sentinel, nothing to say about unwritten rows
            rows.append({"session": p["session"], "engine": p["engine"], **r,
                         "match": None if r["predicted"] is None else r["predicted"] == r["unwritten"]})
    return pd.DataFrame(rows)


def unwritten_by_batch(probes: list[dict], group: str = "7"):
    """Per pre-filled probe and batch size, over the FULL steps where ``group``'s graphs read a stale schedule: the
    requests the fill survived in (FA3 never wrote them; the same on every layer of the group, else each set is
    listed), how many steps, what :func:`coverage` predicted from the recorded schedule (or why it could not), and the
    stale schedule's padding (:func:`padding_1`, when it is a 1-request one)."""
    import pandas as pd

    rows: dict = {}
    for p in probes:
        for r in step_rows(p):
            if r["group"] != int(group) or r["unwritten"] is None:
                continue
            k = (p["session"], p["engine"], r["num_reqs"], r["step"])
            d = rows.setdefault(k, {"unwritten": set(), "predicted": r["predicted"], "not modelled": r["not modelled"]})
            d["unwritten"].add(tuple(r["unwritten"]))
    pads = {}
    for p in probes:
        for st in p["steps"]:
            s = (st.get("schedules") or {}).get(group)
            if s and not s.get("same", True) and (p["session"], p["engine"]) not in pads:
                try:
                    pads[(p["session"], p["engine"])] = padding_1(s["graph"])
                except LabError:
                    pads[(p["session"], p["engine"])] = ()   # not a 1-request schedule: no padding to show
    agg: dict = {}
    for (sess, eng, b, _), d in rows.items():
        meas = "; ".join(str(list(u)) for u in sorted(d["unwritten"]))
        pred = str(d["predicted"]) if d["predicted"] is not None else f"not modelled ({d['not modelled']})"
        key = (sess, eng, b, meas, pred)
        agg[key] = agg.get(key, 0) + 1
    out = [{"session": sess, "engine": eng, "padding read": str(list(pads.get((sess, eng), ()))), "requests": b,
            "unwritten (measured)": meas, "unwritten (predicted)": pred, "FULL steps": n}
           for (sess, eng, b, meas, pred), n in sorted(agg.items())]
    return pd.DataFrame(out, columns=["session", "engine", "padding read", "requests", "unwritten (measured)",
                                      "unwritten (predicted)", "FULL steps"])


def nan_origin(probe: dict) -> dict | None:
    """First FULL step whose taps show NaN/Inf in an attention output that the reference pass has finite:
    the layer (model order), its requests, and whether they all lie among the requests :func:`coverage`
    predicts unwritten for that layer's group."""
    from .probe import layer_number

    stale = {}
    for r in step_rows(probe):
        stale[(r["step"], r["layer"])] = r
    full = [st for st in probe["steps"] if st.get("mode") == "FULL"]
    for st in full:
        taps = _target_taps(probe, st.get("taps") or {})
        bad = [(layer_number(n), n, t) for n, t in taps.items() if t["nonfinite_run"] > t["nonfinite_ref"]]
        if not bad:
            continue
        no, layer, t = min(bad)
        r = stale.get((st["step"], layer))
        before = [v for n, v in (st.get("diverge", {}).get("layers") or {}).items() if layer_number(n) < no]
        return {"step": st["step"], "first FULL step": full[0]["step"], "num_reqs": st["num_reqs"],
                "num_tokens": st.get("num_tokens"), "layer": layer, "rows": t["nonfinite_run"],
                "requests": t["req_nonfinite_run"],
                "predicted_unwritten": r["predicted"] if r else [],
                # None: the step's schedule is one coverage() refuses, so there is no prediction to lie within
                "within_unwritten": (None if r and r["predicted"] is None
                                     else bool(r) and set(t["req_nonfinite_run"]) <= set(r["predicted"])),
                # every state and K/V the step wrote before that layer is finite (the probe's layer comparison)
                "earlier_writes_finite": bool(before) and all(v["nonfinite_run"] == 0 for v in before)}
    return None


def nan_rows_by_step(probe: dict):
    """Per FULL step with taps and per target attention layer (model order): how many more attention-output rows the
    graph pass had non-finite (NaN/Inf) than the reference pass (``NaN rows beyond the reference``: a difference of
    counts, 0 where not more; rows both passes hold non-finite cancel, so once the no-graph pass inherits NaN states the
    count falls), the graph pass's requests with non-finite rows, and the layer's KV-cache group: how a replay's NaN
    appears and spreads, step by step (:func:`nan_origin` gives only the first)."""
    import pandas as pd

    from .probe import layer_number

    group_of = {n: int(gid) for gid, names in group_layers(probe.get("layout")).items() for n in names}
    rows = []
    for st in probe["steps"]:
        if st.get("mode") != "FULL" or not st.get("taps"):
            continue
        for name, t in sorted(_target_taps(probe, st["taps"]).items(), key=lambda kv: layer_number(kv[0])):
            more = max(0, int(t.get("nonfinite_run") or 0) - int(t.get("nonfinite_ref") or 0))
            rows.append({"step": st["step"], "num_reqs": st.get("num_reqs"), "layer": name,
                         "layer number": layer_number(name), "group": group_of.get(name),
                         "NaN rows beyond the reference": more,
                         "requests with NaN (graph pass)": list(t.get("req_nonfinite_run") or [])})
    return pd.DataFrame(rows, columns=["step", "num_reqs", "layer", "layer number", "group",
                                       "NaN rows beyond the reference", "requests with NaN (graph pass)"])


def plot_nan_rows(ax, grid, title: str):
    """Draw one :func:`nan_rows_by_step` table on ``ax``: target attention layers (rows, with their KV-cache group) by
    FULL step (columns), colour the non-finite rows beyond the reference pass. Returns the image (for a colour bar)."""
    col = "NaN rows beyond the reference"
    if not len(grid):
        raise LabError(f"{title}: no FULL step with taps to draw")
    mat = grid.pivot_table(index="layer number", columns="step", values=col, aggfunc="sum")
    im = ax.imshow(mat.values, aspect="auto", cmap="Reds", vmin=0, vmax=max(1, int(grid[col].max())))
    ax.set_xticks(range(len(mat.columns)))
    ax.set_xticklabels(mat.columns, fontsize=7)
    grp = grid.drop_duplicates("layer number").set_index("layer number")["group"]
    ax.set_yticks(range(len(mat.index)))
    ax.set_yticklabels([f"L{n} attn (group {grp[n]})" for n in mat.index], fontsize=7)
    ax.set_xlabel("target step (FULL steps)")
    ax.set_title(title, fontsize=8)
    return im


def has_taps(probe: dict) -> bool:
    return any("taps" in st for st in probe["steps"])


def tap_summary(probe: dict) -> dict:
    """FULL steps with taps; of them, steps where some attention output differs from the reference pass, holds
    NaN/Inf the reference lacks, or (sentinel runs) has rows FA3 never wrote."""
    full = [st for st in probe["steps"] if st.get("mode") == "FULL" and st.get("taps")]

    def any_(pred):
        return sum(1 for st in full if any(pred(t) for t in _target_taps(probe, st["taps"]).values()))

    return {"FULL steps with taps": len(full),
            "steps differing": any_(lambda t: t["rows_differ"] > 0),
            "steps with new NaN": any_(lambda t: t["nonfinite_run"] > t["nonfinite_ref"]),
            "steps with unwritten rows": any_(lambda t: (t.get("unwritten_run") or 0) > 0),
            "pre-filled": any("unwritten_run" in t for st in full for t in st["taps"].values())}


def stale_vectors(probes: list[dict], group: str | None = None) -> dict[tuple, int]:
    """Distinct persistent schedules the stale groups' graphs read (trailing zeros dropped) -> FULL steps seen
    (one group's only, with ``group``: its id as the probe's ``schedules`` key it)."""
    seen: dict[tuple, int] = {}
    for p in probes:
        for st in p["steps"]:
            for gid, s in (st.get("schedules") or {}).items():
                if group is not None and gid != group:
                    continue
                if not s.get("same", True):
                    v = list(s["graph"])
                    while v and v[-1] == 0:
                        v.pop()
                    seen[tuple(v)] = seen.get(tuple(v), 0) + 1
    return seen


def replay_reads(buffer, b: int, rows_per_request: int = 128) -> dict:
    """What a FULL replay for ``b`` requests reads from a persistent ``buffer`` (shorter buffers are zero-extended,
    as vLLM zeroes the tail), and which requests it writes when each has ``rows_per_request`` query rows."""
    b4 = round_up4(b)
    n = 1 + 3 * b4
    graph = (list(buffer) + [0] * n)[:n]
    step = [rows_per_request] * b + [0] * (n - b)
    d = decode(graph, b)
    cov = coverage(graph, step, b)
    return {"requests in the step": b, "query rows read": d["seqlen_q"], "splits read": d["num_splits"],
            "requests written": [i for i, c in enumerate(cov) if c == WRITTEN]}


FILLS = ("nan", "zero", "sentinel")  # what probe.py's pre-fills write: NaN, 0, 8192


def predicted_outcome(fix: bool, fill: str | None, unfilled: str | None = None) -> str | None:
    """What a run's outcome should be if a stock FULL replay crashes exactly when the attention output rows FA3 leaves
    unwritten (group 7's, at 2 and more requests) hold non-finite values, and for no other reason.

    ``fix``: the schedule is refreshed, every row is written over any pre-fill: ``"ok"``. Stock with ``fill`` in the
    stale group's layers: ``"nan"`` -> ``"crash"``, ``"zero"`` / ``"sentinel"`` -> ``"ok"``. No pre-fill: the rows hold
    whatever the graph's memory held, which the hypothesis does not say: ``unfilled`` (what untapped stock did at that
    concurrency, or None when that is not one outcome)."""
    if fill is not None and fill not in FILLS:
        raise LabError(f"pre-fill {fill!r}: expected one of {', '.join(FILLS)} or none")
    if fix:
        return "ok"
    if fill is None:
        return unfilled
    return "crash" if fill == "nan" else "ok"


def _pass_of(error) -> str | None:
    """Which pass of a probed step raised, from the probe's ``error`` text: ``"reference pass"`` (the no-graph pass,
    prefixed so by probe.py), else ``"checks or graph pass"`` (probe.py records those unprefixed)."""
    if not error:
        return None
    return "reference pass" if str(error).startswith("reference pass:") else "checks or graph pass"


def fill_summary(probe: dict) -> dict:
    """One probed engine of a pre-fill matrix: its FULL steps against the reference pass (:func:`tap_summary`), how
    many of the stale group's layer-steps left unwritten exactly the requests the recorded schedule predicts (pre-filled
    runs; a step with one request has none to leave), and where the first NaN the reference lacks appeared
    (:func:`nan_origin`)."""
    s = tap_summary(probe)
    rows = list(step_rows(probe))
    measured = [r for r in rows if r["unwritten"] is not None and r["predicted"] is not None]
    full = [st for st in probe["steps"] if st.get("mode") == "FULL"]
    o = nan_origin(probe)
    return {**s, "first FULL step": full[0]["step"] if full else None,
            "last step": probe["steps"][-1]["step"] if probe["steps"] else None,
            # which pass of the last step raised ("reference pass", "graph pass"), None when none did
            "last step ended in": _pass_of(probe["steps"][-1].get("error")) if probe["steps"] else None,
            "stale layer-steps": len(rows),
            # of them, layer-steps whose schedule coverage() refuses: no prediction, left out of the two counts below
            "not modelled": sum(r["predicted"] is None for r in rows),
            "unwritten as predicted": sum(r["predicted"] == r["unwritten"] for r in measured) if measured else None,
            "unwritten measured": len(measured),
            "first NaN step": o["step"] if o else None, "first NaN layer": o["layer"] if o else None,
            "NaN requests": o["requests"] if o else None,
            "NaN only in unwritten requests": o["within_unwritten"] if o else None,
            "earlier writes finite": o["earlier_writes_finite"] if o else None}


def _hypergeom(events: int, runs_in: int, runs: int) -> dict[int, float]:
    """P(x of the ``events`` fall on the ``runs_in`` runs of the condition), x -> probability, outcomes exchangeable."""
    from math import comb

    lo, hi = max(0, events - (runs - runs_in)), min(events, runs_in)
    return {x: comb(runs_in, x) * comb(runs - runs_in, events - x) / comb(runs, events) for x in range(lo, hi + 1)}


def exact_stratified(strata) -> float:
    """The exact one-sided test over independent strata (each ``(events_in, runs_in, events, runs)``, e.g. one per
    concurrency, where the outcome without the condition differs): the chance, if the condition did not matter within
    any stratum, that the events falling on the condition's runs add up to at least the observed total (the exact
    conditional test of a common odds ratio; with one stratum, Fisher's)."""
    dist, observed = {0: 1.0}, 0
    for events_in, runs_in, events, runs in strata:
        if not (0 <= events_in <= min(events, runs_in) and 0 <= events <= runs and 0 <= runs_in <= runs
                and events - events_in <= runs - runs_in):
            raise LabError(f"{events_in} of {events} events in {runs_in} of {runs} runs: not a 2x2 table")
        h = _hypergeom(events, runs_in, runs)
        new: dict[int, float] = {}
        for a, pa in dist.items():
            for x, px in h.items():
                new[a + x] = new.get(a + x, 0.0) + pa * px
        dist, observed = new, observed + events_in
    if not strata:
        raise LabError("no strata: nothing to test")
    return sum(p for x, p in dist.items() if x >= observed)


def last_build_table(probes: list[dict]):
    """Per probed engine and FA group, over its FULL steps whose ``schedules`` carry the builder's last build (probe.py's
    BuildLedger, from s38's matrices on): whether the graphs' buffer was stale, the batch sizes that last build was for,
    and on how many steps it came before the first served step, since the previous step, and still held the buffer
    exactly as it left it. Empty for probe logs recorded before the ledger."""
    import pandas as pd

    rows = []
    for p in probes:
        per: dict = {}
        for st in p["steps"]:
            if st.get("mode") != "FULL":
                continue
            for gid, s in (st.get("schedules") or {}).items():
                lb = s.get("last_build")
                if "last_build" not in s:
                    continue
                d = per.setdefault(gid, {"FULL steps": 0, "stale": 0, "as the first group's step schedule": 0,
                                         "built for (requests)": set(), "built for (tokens)": set(),
                                         "before the first step": 0, "since the previous step": 0,
                                         "buffer as the build left it": 0, "no build recorded": 0})
                d["FULL steps"] += 1
                d["stale"] += not s.get("same", True)
                # the fix points a later group's step metadata into its own buffer, so "same" is trivially true there:
                # freshness is the buffer against the first FA group's step schedule
                d["as the first group's step schedule"] += s.get("same_as_first_group_step") is True
                if lb is None:
                    d["no build recorded"] += 1
                    continue
                d["built for (requests)"].add(lb.get("num_reqs"))
                d["built for (tokens)"].add(lb.get("num_tokens"))
                d["before the first step"] += bool(lb.get("before_first_step"))
                d["since the previous step"] += bool(lb.get("since_previous_step"))
                d["buffer as the build left it"] += lb.get("buffer_as_left") is True
        for gid, d in sorted(per.items()):
            join = lambda v: ", ".join(str(x) for x in sorted(v, key=lambda x: (x is None, x)))  # noqa: E731
            rows.append({"session": p.get("session"), "engine": p.get("engine"), "group": int(gid), **d,
                         "built for (requests)": join(d["built for (requests)"]),
                         "built for (tokens)": join(d["built for (tokens)"])})
    return pd.DataFrame(rows)


def builds_before_first_step(probe: dict, group: int) -> list[list] | None:
    """[num_reqs, num_tokens] of each build of ``group``'s (first) FA builder before the first served step, in order
    (the layout line's ``builds_before_first_step``: in 0.22.1 the capture runs, and the first step's own build); None
    when not recorded."""
    h = ((probe.get("layout") or {}).get("builds_before_first_step") or {}).get(str(group))
    return h[0] if h else None


def build_predictions(probe: dict, fix: bool, stale: str = "7", fresh: str = "6", max_reqs: int = 32,
                      tokens_per_request: int = 16) -> dict[str, bool]:
    """matrices/probe-builds-tp1.yaml's predictions, checked on one probe log: (a)-(c) for a stock engine, (d) for fix 2.
    Each holds only if it holds on every FULL step line (a FULL step without schedules, or without the group, or
    with ``last_build`` null, fails it); with no FULL step at all nothing holds."""
    full = [st for st in probe["steps"] if st.get("mode") == "FULL"]

    def every(gid, pred):
        return bool(full) and all((s := (st.get("schedules") or {}).get(gid)) is not None and pred(s) for st in full)

    def lb(s):
        return s.get("last_build") or {}

    def capture_1(s):   # the group's last build was the 1-request capture's, before the first served step
        b = lb(s)
        return b.get("num_reqs") == 1 and b.get("num_tokens") == tokens_per_request and b.get("before_first_step") is True

    capture = [[max_reqs - i, tokens_per_request * (max_reqs - i)] for i in range(max_reqs)]
    if fix:
        return {"(d) fix: group 7's buffer is the step's schedule, written outside build": every(stale, lambda s: (
            s.get("same_as_first_group_step") is True and capture_1(s) and lb(s).get("buffer_as_left") is False))}
    hist = builds_before_first_step(probe, int(stale)) or []
    return {
        "(a) stale group: last written by the 1-request capture build, nothing since": every(stale, lambda s: (
            s.get("same") is False and s.get("same_as_first_group_step") is False and capture_1(s)
            and lb(s).get("since_previous_step") is False and lb(s).get("buffer_as_left") is True)),
        "(b) stale group: its builds before the first step end with the FULL captures, largest first":
            hist[-max_reqs:] == capture,
        "(c) fresh group: built every step": every(fresh, lambda s: (
            s.get("same") is True and s.get("same_as_first_group_step") is True
            and lb(s).get("since_previous_step") is True and lb(s).get("buffer_as_left") is True)),
    }
