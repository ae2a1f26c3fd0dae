"""Step probe for the target model of vLLM 0.22.1: canaries and a FULL-graph divergence check.

Installed by :mod:`dflash_lab.plugin` in every vLLM process; it acts only in the process that
runs the target model (``GPUModelRunner._model_forward``), and only when asked:

- ``DFLASH_LAB_CANARY=1``: after every target forward, synchronise and check invariants; raise
  :class:`CanaryError` naming the first violation (step, row, field, value). A silent corruption
  then surfaces as a readable error at the step where it begins.
- ``DFLASH_LAB_PROBE=<folder>``: the same checks, recorded instead of raised (unless
  ``DFLASH_LAB_CANARY=1`` too), one JSON line per step in ``probe-<pid>.jsonl``; and on every step
  that replays a FULL CUDA graph, a **reference pass**: the same forward, with the same inputs and
  the same attention metadata, run once more without graphs (``cudagraph_runtime_mode=NONE``)
  *before* the graph replay. The probe compares, layer by layer, what each pass wrote (the
  Gated-DeltaNet recurrent and conv states, the attention K/V of this step's tokens) and the
  model outputs, row by row. The first layer whose writes differ is the first diverging op.
  ``DFLASH_LAB_PROBE_REF=0`` keeps the canaries and drops the reference pass.

State discipline of the reference pass (the production values must stay those of the graph
replay): a verify step reads each request's GDN recurrent state from column
``num_accepted - 1`` of its state indices and its conv state from column 0, and overwrites
both. Those slots are snapshotted before the reference pass and restored after it; every
other slot the forward writes (GDN columns ``0..q_len-1``, the step's K/V slots) is written
again by the graph replay that follows. What this cannot see: a bug in the metadata itself
(both passes use the same metadata: the canaries check that). A graph replay that reads a slot
outside that read set (or skips a write) sees the reference pass's value there instead of the
previous step's: the divergence is still reported at that layer, but from there on the engine's
values are no longer exactly those of a run without the probe.

Checks (each a ``violation`` with ``step``, ``field``, ``row``, ``value``):

- ``hidden.nonfinite``: NaN/Inf in a row of the model's hidden states (or its auxiliary hidden
  states, which the DFlash drafter consumes);
- ``gdn.state_index``: a live request's state index outside ``[1, num_slots)`` or shared with
  another live request; padded rows not on the null block;
- ``gdn.num_accepted``: outside ``[1, k + 1]`` (``0`` makes the GDN kernel read column -1);
- ``gdn.query_len``: a spec-decode row whose query length is not in ``[1, k + 1]``;
- ``attn.slot``: a K/V slot of a live token outside the cache, or in a block that is not in
  the request's own block-table row;
- ``block_table.gpu``: a block-table row on the GPU that differs from the runner's CPU row;
- ``attn.scheduler_metadata`` (FULL-graph steps): a FlashAttention builder's persistent FA3
  schedule, which that group's captured graphs read, differs from the schedule the step's
  metadata carries (the root cause of the DFlash crash, :mod:`dflash_lab.patch` part 1);
- ``state.nonfinite``: NaN/Inf in a GDN state or K/V written this step.

``DFLASH_LAB_PROBE_TAPS`` (with ``DFLASH_LAB_PROBE``) adds what the writes above cannot show, because
an attention layer's *output* is not state: the FlashAttention forward is wrapped (before any graph is
captured, so the wrapper's copies are captured too) to copy each layer's output into a persistent
buffer, and FULL steps compare those, layer by layer and request by request, between the reference
pass and the graph replay (``taps`` in the step's line). ``=sentinel`` (``=nan``, ``=zero``) also fills
the step's rows of each output with :data:`SENTINEL` (NaN, 0) before FlashAttention runs, in the layers
``DFLASH_LAB_PROBE_FILL_LAYERS`` names (all by default): rows still holding it afterwards are rows the
kernel never wrote (``unwritten``). That changes what an unwritten row holds (the fill instead of
whatever the buffer held), so a pre-filled run shows *which* rows are left unwritten, a plain run
*what* they then hold. Every tap buffer is poisoned (:data:`TAP_POISON`) before each compared pass, so
a layer the pass did not run is left out of the comparison instead of showing the previous pass's
values. With taps on, FULL steps also record every FA group's persistent schedule next to the step's
(``schedules``), where they differ, and (from s38's matrices on) its builder's last ``build``: the batch it was
for, whether it came before the first served step, and whether the buffer still holds what it left
(``last_build``); the layout line lists each FA builder's builds before the first served step
(``builds_before_first_step``: the capture order), :class:`BuildLedger`.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time

ENV_PROBE = "DFLASH_LAB_PROBE"
ENV_CANARY = "DFLASH_LAB_CANARY"
ENV_REF = "DFLASH_LAB_PROBE_REF"
ENV_TAPS = "DFLASH_LAB_PROBE_TAPS"  # "1": attention-output taps; "sentinel" / "nan" / "zero": taps + that pre-fill
ENV_FILL_LAYERS = "DFLASH_LAB_PROBE_FILL_LAYERS"  # "7,15,23": pre-fill only these layer numbers (default: every one)
# "0": no build ledger with the taps. The ledger clones each FA builder's buffer after every build, which changes the
# caching allocator's blocks around capture; s38's stale schedules held other padding than s37's (without it)
ENV_LEDGER = "DFLASH_LAB_PROBE_LEDGER"
# "1": an intervention, not an observation. Every sampled token id at or above the vocabulary size is replaced by
# OOR_TOKEN right after sampling, before anything reads it. vLLM 0.22.1's rejection sampler returns vocab_size itself
# for some rows of NaN logits (s43, from the recorded sample lines), and the drafter's next-token kernel counts such a
# row as holding no valid token (spec_decode/utils.py:220, `token_ids < vocab_size`), which no other row of a served
# request can be. With the replacement the row keeps one valid token: whether the crash needs those ids is the test.
# "row0" / "others": the same for batch row 0 only / the rows above it only, to tell the two entries of the row-0
# coincidence (notebook 03) apart.
ENV_OOR = "DFLASH_LAB_PROBE_OOR"
OOR_ROWS = {"all": slice(None), "row0": slice(0, 1), "others": slice(1, None)}  # which batch rows a replacement covers
OOR_TOKEN = 0  # what argmax returns for an all-NaN row: the token the other NaN rows already carry
FILLS = {"sentinel": 8192.0, "nan": float("nan"), "zero": 0.0}
TAP_ROWS = 1024  # rows copied per layer: FULL graphs replay at most the largest capture size (512 here)
SENTINEL = 8192.0  # exact in bf16/fp16/fp32; a softmax-weighted mean of V rows does not land on it by chance
TAP_POISON = -4096.0  # written into every tap buffer before each compared pass: a tap still all poison was not copied
SENTINEL_DTYPES = ("torch.bfloat16", "torch.float16", "torch.float32")  # 8192 overflows fp8 e4m3 to NaN
GDN_HEADS_FINGERPRINTED = 4  # recurrent-state heads summed per slot (all heads evolve from the same inputs)
MAX_VIOLATIONS_PER_STEP = 20


class CanaryError(RuntimeError):
    """An invariant of the target step failed (raised only with ``DFLASH_LAB_CANARY=1``)."""


# ----------------------------------------------------------------------------- layer views

_LAYER_NO = re.compile(r"layers\.(\d+)\.")


def layer_number(name: str) -> int:
    m = _LAYER_NO.search(name)
    return int(m.group(1)) if m else 1 << 30


def classify(meta) -> str | None:
    """'gdn' for Gated-DeltaNet metadata, 'attn' for paged attention metadata, else None."""
    if meta is None:
        return None
    if hasattr(meta, "spec_state_indices_tensor") and hasattr(meta, "num_spec_decodes"):
        return "gdn"
    if hasattr(meta, "slot_mapping") and hasattr(meta, "block_table") and hasattr(meta, "seq_lens"):
        return "attn"
    return None


def step_layers(attn_metadata: dict, layers: dict) -> list[tuple[str, str, object, object]]:
    """(name, kind, metadata, layer) for the layers this forward touches, in model order."""
    out = []
    for name, meta in attn_metadata.items():
        kind = classify(meta)
        layer = layers.get(name)
        if kind is None or layer is None:
            continue
        out.append((name, kind, meta, layer))
    out.sort(key=lambda x: (layer_number(x[0]), x[0]))
    return out


def gdn_rows(meta):
    """Host copies of the live spec-decode rows of one GDN metadata object (synchronises)."""
    import numpy as np

    n = int(meta.num_spec_decodes or 0)
    if n == 0 or meta.spec_state_indices_tensor is None:
        return None
    idx_all = meta.spec_state_indices_tensor.cpu().numpy()
    na_all = meta.num_accepted_tokens.cpu().numpy() if meta.num_accepted_tokens is not None else None
    qsl = meta.spec_query_start_loc.cpu().numpy() if meta.spec_query_start_loc is not None else None
    idx = idx_all[:n]
    qlen = None if qsl is None else np.diff(qsl[: n + 1])
    cols = idx.shape[1]
    written = idx if qlen is None else np.where(np.arange(cols)[None, :] < qlen[:, None], idx, 0)
    return {
        "n": n,
        "idx": idx,
        "written": written[written > 0].astype(np.int64),
        "conv_slots": idx[:, 0][idx[:, 0] > 0].astype(np.int64),
        "idx_pad": idx_all[n:],
        "na": None if na_all is None else na_all[:n],
        "na_pad": None if na_all is None else na_all[n:],
        "qlen": qlen,
        "mixed": int(getattr(meta, "num_prefills", 0) or 0) + int(getattr(meta, "num_decodes", 0) or 0) > 0,
    }


def check_gdn(rows: dict, num_slots: int, k: int, group: str) -> list[dict]:
    """Invariants of the GDN spec-decode metadata of one KV-cache group."""
    import numpy as np

    out = []
    idx, na, qlen = rows["idx"], rows["na"], rows["qlen"]
    live = idx.reshape(-1)
    bad = np.nonzero((idx < 1) | (idx >= num_slots))
    for r, c in zip(*bad):
        out.append({"field": "gdn.state_index", "group": group, "row": int(r), "col": int(c),
                    "value": int(idx[r, c]), "allowed": [1, num_slots - 1]})
    vals, counts = np.unique(live[live > 0], return_counts=True)
    for v in vals[counts > 1][:4]:
        rows_with = sorted({int(r) for r in np.nonzero((idx == v).any(axis=1))[0]})
        if len(rows_with) > 1:
            out.append({"field": "gdn.state_index", "group": group, "row": rows_with[0], "value": int(v),
                        "why": f"slot shared by rows {rows_with[:6]}"})
    if rows["idx_pad"].size and (rows["idx_pad"] != 0).any():
        r = int(np.nonzero((rows["idx_pad"] != 0).any(axis=1))[0][0])
        out.append({"field": "gdn.state_index", "group": group, "row": rows["n"] + r,
                    "value": rows["idx_pad"][r].tolist()[:4], "why": "padded row not on the null block"})
    if na is not None:
        for r in np.nonzero((na < 1) | (na > k + 1))[0]:
            out.append({"field": "gdn.num_accepted", "group": group, "row": int(r), "value": int(na[r]),
                        "allowed": [1, k + 1]})
    if qlen is not None and not rows["mixed"]:
        for r in np.nonzero((qlen < 1) | (qlen > k + 1))[0]:
            out.append({"field": "gdn.query_len", "group": group, "row": int(r), "value": int(qlen[r]),
                        "allowed": [1, k + 1]})
    return out


def check_attn_slots(slots, block_table, seq_lens, query_start_loc, num_slots: int, kernel_block: int,
                     group: str) -> list[dict]:
    """Every live token's K/V slot lies in the cache and in a block of its own request's row."""
    out = []
    n = len(seq_lens)
    for r in range(n):
        s, e = int(query_start_loc[r]), int(query_start_loc[r + 1])
        sl = slots[s:e]
        nb = -(-int(seq_lens[r]) // kernel_block)
        own = set(int(b) for b in block_table[r, :nb])
        for j, v in enumerate(sl):
            v = int(v)
            if v == -1:
                continue
            if v < 0 or v >= num_slots:
                out.append({"field": "attn.slot", "group": group, "row": r, "token": s + j, "value": v,
                            "why": f"outside the cache [0, {num_slots})"})
                break
            if v // kernel_block not in own:
                out.append({"field": "attn.slot", "group": group, "row": r, "token": s + j, "value": v,
                            "why": f"block {v // kernel_block} not in the request's {nb} blocks"})
                break
    return out


def _fa_schedules(attn_groups, attn_metadata: dict):
    """(group id, attention group, builder, its persistent schedule, the step's schedule) of every group whose builder
    keeps a persistent FA3 schedule and whose step metadata carries one."""
    for gid, ags in enumerate(attn_groups):
        for ag in ags:
            builder = ag.get_metadata_builder(0) if hasattr(ag, "get_metadata_builder") else ag.metadata_builders[0]
            own = getattr(builder, "scheduler_metadata", None)
            meta = attn_metadata.get(ag.layer_names[0]) if ag.layer_names else None
            cur = getattr(meta, "scheduler_metadata", None)
            if own is not None and cur is not None:
                yield gid, ag, builder, own, cur


def check_graph_schedules(attn_groups, attn_metadata: dict) -> list[dict]:
    """Each FA builder's persistent schedule (what its FULL graphs read) vs the step's metadata."""
    import torch

    out = []
    for gid, ag, builder, own, cur in _fa_schedules(attn_groups, attn_metadata):
        if not getattr(builder, "use_full_cuda_graph", False):
            continue
        n = cur.shape[0]
        graph = own[:n]
        if not torch.equal(graph, cur):
            diff = torch.nonzero(graph != cur).flatten()
            i = int(diff[0])
            out.append({"field": "attn.scheduler_metadata", "group": gid, "row": i,
                        "value": int(graph[i]), "expected": int(cur[i]), "entries_differ": int(diff.numel()),
                        "why": f"KV-cache group {gid}'s FULL graphs read a stale FA3 schedule "
                               f"(layers {ag.layer_names[0]}...)"})
    return out


def nonfinite_rows(t, n: int):
    """Indices of rows of ``t[:n]`` holding NaN or Inf (synchronises)."""
    import torch

    x = t[:n]
    if x.dim() == 1:
        x = x[:, None]
    bad = ~torch.isfinite(x.float()).all(dim=tuple(range(1, x.dim())))
    return torch.nonzero(bad).flatten().cpu().tolist()


def outputs_of(model_output) -> dict:
    """Named tensors of a model output: 'hidden' and 'aux<i>' for the auxiliary hidden states."""
    import torch

    if isinstance(model_output, torch.Tensor):
        return {"hidden": model_output}
    out = {}
    if isinstance(model_output, (tuple, list)) and model_output:
        if isinstance(model_output[0], torch.Tensor):
            out["hidden"] = model_output[0]
        rest = model_output[1] if len(model_output) > 1 else None
        if isinstance(rest, torch.Tensor):
            out["aux0"] = rest
        elif isinstance(rest, (tuple, list)):
            for i, a in enumerate(rest):
                if isinstance(a, torch.Tensor):
                    out[f"aux{i}"] = a
    return out


# ----------------------------------------------------------------------------- snapshots

def gdn_read_slots(rows: dict):
    """(recurrent-state slots read, conv-state slots read-and-written) of the live rows."""
    import numpy as np

    idx, na = rows["idx"], rows["na"]
    col = np.clip(na.astype(np.int64) - 1, 0, idx.shape[1] - 1)
    return idx[np.arange(len(idx)), col], idx[:, 0]


def snapshot(step_gdn: list) -> list:
    """Copies of the GDN slots a verify step reads and overwrites: [(tensor, index, saved)]."""
    import torch

    saved = []
    for _name, layer, rows in step_gdn:
        conv, ssm = layer.kv_cache[0], layer.kv_cache[1]
        ssm_slots, conv_slots = gdn_read_slots(rows)
        for t, s in ((ssm, ssm_slots), (conv, conv_slots)):
            s = [int(x) for x in s if x > 0]
            if not s:
                continue
            index = torch.tensor(s, device=t.device, dtype=torch.long)
            saved.append((t, index, t.index_select(0, index)))
    return saved


def restore(saved: list) -> None:
    for t, index, data in saved:
        t.index_copy_(0, index, data)


def fingerprint(step_gdn: list, step_attn: list) -> dict:
    """Per layer, float64 sums of what this step wrote: one value per written slot.

    GDN: the recurrent state of every (row, column < q_len) slot (first heads), and the conv state.
    Attention: the K and V of every live token of this step.
    """
    import torch

    fp = {}
    for name, layer, rows in step_gdn:
        conv, ssm = layer.kv_cache[0], layer.kv_cache[1]
        sub = ssm.narrow(1, 0, min(GDN_HEADS_FINGERPRINTED, ssm.shape[1])) if ssm.dim() > 1 else ssm
        si = torch.as_tensor(rows["written"], device=ssm.device)
        ci = torch.as_tensor(rows["conv_slots"], device=conv.device)
        s_val = sub.index_select(0, si).reshape(len(si), -1)
        c_val = conv.index_select(0, ci).reshape(len(ci), -1)
        fp[name] = {"kind": "gdn",
                    "ssm": s_val.double().sum(1), "ssm_bad": (~torch.isfinite(s_val)).sum(1),
                    "conv": c_val.double().sum(1), "conv_bad": (~torch.isfinite(c_val)).sum(1)}
    for name, layer, slots in step_attn:
        kv = layer.kv_cache
        kv = kv[0] if isinstance(kv, (list, tuple)) else kv
        live = slots[slots >= 0]
        bs = kv.shape[2]
        blk, off = live // bs, live % bs
        k = kv[0][blk, off].reshape(len(live), -1)
        v = kv[1][blk, off].reshape(len(live), -1)
        fp[name] = {"kind": "attn", "k": k.double().sum(1), "v": v.double().sum(1),
                    "k_bad": (~torch.isfinite(k)).sum(1), "v_bad": (~torch.isfinite(v)).sum(1)}
    return fp


def _diff(a, b) -> tuple[float, float, int]:
    """(max |a-b|, max |a-b| / (max |a| + tiny), rows that differ); NaN on both sides counts as equal."""
    import torch

    if a.numel() == 0:
        return 0.0, 0.0, 0
    both_nan = torch.isnan(a) & torch.isnan(b)
    d = torch.where(both_nan, torch.zeros_like(a), (a - b).abs())
    d = torch.where(torch.isnan(d), torch.full_like(d, float("inf")), d)
    scale = float(torch.nan_to_num(a.abs(), nan=0.0, posinf=0.0).max()) + 1e-30
    mx = float(d.max())
    return mx, mx / scale, int((d > 0).sum())


def compare(fp_ref: dict, fp_run: dict, order: list[str], rel_tol: float) -> dict:
    """Layer-by-layer comparison of two fingerprints; the first layer beyond ``rel_tol``."""
    layers, first = {}, None
    for name in order:
        a, b = fp_ref.get(name), fp_run.get(name)
        if a is None or b is None:
            continue
        keys = ("ssm", "conv") if a["kind"] == "gdn" else ("k", "v")
        worst = (0.0, 0.0, 0)
        bad_ref = bad_run = 0
        for key in keys:
            r = _diff(a[key], b[key])
            worst = max(worst, r, key=lambda x: x[1])
            bad_ref += int(a[key + "_bad"].sum())
            bad_run += int(b[key + "_bad"].sum())
        layers[name] = {"kind": a["kind"], "max_abs": worst[0], "max_rel": worst[1], "rows_differ": worst[2],
                        "nonfinite_ref": bad_ref, "nonfinite_run": bad_run}
        if first is None and (worst[1] > rel_tol or bad_ref != bad_run):
            first = name
    return {"first_layer": first, "layers": layers}


def compare_outputs(ref: dict, run: dict, n: int, rel_tol: float) -> dict:
    import torch

    out = {}
    for key, a in ref.items():
        b = run.get(key)
        if b is None:
            continue
        a2, b2 = a[:n].float(), b[:n].float()
        d = (a2 - b2).abs().reshape(n, -1)
        d = torch.where(torch.isnan(d), torch.full_like(d, float("inf")), d)
        row_max = d.max(dim=1).values
        scale = float(torch.nan_to_num(a2.abs(), nan=0.0, posinf=0.0).max()) + 1e-30
        rows = torch.nonzero(row_max > rel_tol * scale).flatten().cpu().tolist()
        out[key] = {"max_abs": float(row_max.max()) if n else 0.0, "rows_differ": len(rows),
                    "first_rows": rows[:8], "nonfinite_ref": len(nonfinite_rows(a, n)),
                    "nonfinite_run": len(nonfinite_rows(b, n))}
    return out


# ----------------------------------------------------------------------------- attention-output taps

class AttnTaps:
    """Persistent copies of each attention layer's output, written by a wrapped attention forward.

    The copy is ordinary stream work, so a FULL graph captured with the wrapper in place replays it:
    after a replay, ``buf[name]`` holds what the graph's attention wrote, which is otherwise gone.
    ``fill`` (a value, or None): written into the output before the attention runs, in the layers
    ``fill_layers`` (layer numbers; None: all), so rows the kernel leaves unwritten hold it afterwards.
    """

    def __init__(self, fill: float | None = None, fill_layers: set | None = None, rows: int = TAP_ROWS):
        self.fill = fill
        self.fill_layers = fill_layers
        self.rows = rows
        self.buf: dict = {}

    def fills(self, name: str) -> bool:
        return self.fill is not None and (self.fill_layers is None or layer_number(name) in self.fill_layers)

    def wrap(self, forward):
        taps = self

        def tapped(impl, layer, query, key, value, kv_cache, attn_metadata, output=None, *a, **kw):
            name = getattr(layer, "layer_name", None)
            live = attn_metadata is not None and output is not None and name is not None
            if live and taps.fills(name):
                if str(output.dtype) not in SENTINEL_DTYPES:
                    raise ValueError(f"{ENV_TAPS}: attention output dtype {output.dtype} cannot hold the pre-fill "
                                     f"{taps.fill} exactly (use {ENV_TAPS}=1)")
                # the step's own rows only: padded rows (beyond num_actual_tokens) FA3 never writes by design
                # (s36's sentinel runs, before this, filled whole buffers). ``n`` is read here, in Python: a FULL
                # graph bakes in the count it was captured with, so a replay fills the captured rows. That is the
                # step's rows when the step is a capture size (uniform decode, 16 tokens a request: s37's FULL steps
                # all were); a replay padded up to a larger graph would fill its padding rows too.
                n = getattr(attn_metadata, "num_actual_tokens", None)
                (output[:n] if isinstance(n, int) and n > 0 else output).fill_(taps.fill)
            res = forward(impl, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
            if live:
                taps.copy(name, output)
            return res

        tapped._dflash_lab_taps = True
        return tapped

    def copy(self, name: str, output) -> None:
        import torch

        o = output.reshape(output.shape[0], -1)
        n = min(o.shape[0], self.rows)
        b = self.buf.get(name)
        if b is None or b.shape[1] != o.shape[1] or b.dtype != o.dtype:
            b = self.buf[name] = torch.full((self.rows, o.shape[1]), float("nan"), dtype=o.dtype, device=o.device)
        b[:n].copy_(o[:n])

    def snapshot(self, names) -> dict:
        return {n: self.buf[n].clone() for n in names if n in self.buf}

    def poison(self) -> None:
        """Before a compared pass: a layer this pass does not run (or whose copy a graph lacks) keeps the poison,
        instead of silently keeping the previous pass's values."""
        for b in self.buf.values():
            b.fill_(TAP_POISON)


def _requests_of(rows, qsl) -> list[int]:
    """Batch indices of the requests that own token ``rows`` (``qsl``: query start locations)."""
    import numpy as np

    if len(rows) == 0:
        return []
    r = np.searchsorted(np.asarray(qsl), np.asarray(rows), side="right") - 1
    return sorted({int(x) for x in r})


def compare_taps(ref: dict, run: dict, order: list[str], n: int, qsl, rel_tol: float,
                 fill: float | None = None, filled=None) -> dict:
    """Per attention layer: which tokens (and requests) the replay's output differs in, is NaN/Inf in,
    or (pre-filled runs) never wrote, against the reference pass of the same step.

    ``fill``: the pre-fill value (None: no pre-fill); ``filled(name)``: whether that layer was pre-filled
    (default: every layer)."""
    import torch

    def is_fill(x):
        return torch.isnan(x) if fill is not None and fill != fill else x == fill

    out = {}
    for name in order:
        a, b = ref.get(name), run.get(name)
        if a is None or b is None:
            continue
        a2, b2 = a[:n].float(), b[:n].float()
        if n == 0 or bool((a2 == TAP_POISON).all()) or bool((b2 == TAP_POISON).all()):
            continue  # not copied in one of the passes (a drafter layer in the target's forward): nothing compared
        d = (a2 - b2).abs()
        d = torch.where(torch.isnan(a2) & torch.isnan(b2), torch.zeros_like(d), d)
        d = torch.where(torch.isnan(d), torch.full_like(d, float("inf")), d)
        row_max = d.max(dim=1).values
        scale = float(torch.nan_to_num(a2.abs(), nan=0.0, posinf=0.0).max()) + 1e-30
        differ = torch.nonzero(row_max > rel_tol * scale).flatten().cpu().tolist()
        bad_ref, bad_run = nonfinite_rows(a2, n), nonfinite_rows(b2, n)
        rec = {"max_abs": float(row_max.max()), "rows_differ": len(differ),
               "req_differ": _requests_of(differ, qsl),
               "nonfinite_ref": len(bad_ref), "nonfinite_run": len(bad_run),
               "req_nonfinite_run": _requests_of(bad_run, qsl)}
        if fill is not None and (filled is None or filled(name)):
            un_ref = torch.nonzero(is_fill(a2).all(dim=1)).flatten().cpu().tolist()
            un_run = torch.nonzero(is_fill(b2).all(dim=1)).flatten().cpu().tolist()
            part_run = int(is_fill(b2).any(dim=1).sum()) - len(un_run)
            rec.update({"unwritten_ref": len(un_ref), "unwritten_run": len(un_run),
                        "req_unwritten_run": _requests_of(un_run, qsl), "partly_unwritten_run": part_run})
        out[name] = rec
    return out


MAX_BUILD_HISTORY = 600  # builds per builder kept from before the first served step (s37's engines: 32 FULL captures)


class BuildLedger:
    """What each FA metadata builder with a persistent FA3 schedule last wrote there through ``build``.

    The stale schedule's writer was inferred from its contents (a 1-request batch's) and vLLM's capture order; this
    records it. Per builder: its ``build`` calls that wrote the buffer before the first served step (the batch each
    was for: in 0.22.1 the capture runs, and the first step's own build), and its last such ``build`` with a device
    copy of the buffer it left, so that a FULL step can say whether the buffer its graphs read is still exactly that
    (nothing else wrote it since), and whether that build came before the first served step or since the previous one.
    A build that wrote nothing there (``fast_build``, the drafter's: no AOT schedule) is not one. Builders are told apart
    by a token set on them, not ``id()``: vLLM's capture-memory profiling builds on builders it then frees, whose
    addresses CPython reuses. Builds under stream capture (none in 0.22.1) would be recorded without a copy."""

    def __init__(self):
        self.seq = 0
        self.builders = 0
        self.first_step_seq: int | None = None   # the ledger's count when the first served step's forward began
        self.prev_step_seq: int | None = None    # ... when the previous served step's forward began
        self.step_seq: int | None = None         # ... when this one's did
        self.last: dict = {}
        self.before: dict = {}

    def wrap(self, build):
        ledger = self

        def build_(builder, common_prefix_len, common_attn_metadata, *a, **kw):
            res = build(builder, common_prefix_len, common_attn_metadata, *a, **kw)
            try:
                ledger.record(builder, common_attn_metadata, res)
            except Exception:  # noqa: BLE001 - bookkeeping only, never in the engine's way
                pass
            return res

        build_._dflash_lab_builds = True
        return build_

    def key(self, builder, create: bool = False):
        k = getattr(builder, "_dflash_lab_ledger_key", None)
        if k is None and create:
            self.builders += 1
            k = builder._dflash_lab_ledger_key = self.builders
        return k

    def record(self, builder, cm, res) -> None:
        own = getattr(builder, "scheduler_metadata", None)
        if own is None or not getattr(builder, "use_full_cuda_graph", False):
            return
        wrote = getattr(res, "scheduler_metadata", None)
        if wrote is None or wrote.data_ptr() != own.data_ptr():
            return   # this build left the persistent buffer alone (fast_build: no schedule computed)
        key = self.key(builder, create=True)
        self.seq += 1
        nr, nt = getattr(cm, "num_reqs", None), getattr(cm, "num_actual_tokens", None)
        nr, nt = (int(nr) if isinstance(nr, int) else None), (int(nt) if isinstance(nt, int) else None)
        self.last[key] = {"seq": self.seq, "num_reqs": nr, "num_tokens": nt,
                          "copy": None if _capturing() else own.clone()}
        if self.first_step_seq is None:
            h = self.before.setdefault(key, [])
            if len(h) < MAX_BUILD_HISTORY:
                h.append([nr, nt])

    def step_began(self) -> None:
        """A served step's forward begins (its own builds are done by then)."""
        if self.first_step_seq is None:
            self.first_step_seq = self.seq
        self.prev_step_seq, self.step_seq = self.step_seq, self.seq

    def of(self, builder) -> dict | None:
        """The builder's last build: the batch it was for, whether it came before the first served step or since the
        previous served step, and whether the buffer still holds what it left (None: no copy was taken)."""
        import torch

        r = self.last.get(self.key(builder))
        if r is None:
            return None
        own = builder.scheduler_metadata
        return {"num_reqs": r["num_reqs"], "num_tokens": r["num_tokens"], "seq": r["seq"],
                # before the first served step's forward: a capture run (in 0.22.1), or step 1's own build
                "before_first_step": self.first_step_seq is not None and r["seq"] <= self.first_step_seq,
                "since_previous_step": self.prev_step_seq is not None and r["seq"] > self.prev_step_seq,
                "buffer_as_left": None if r["copy"] is None else bool(torch.equal(r["copy"], own))}

    def history(self, builder) -> list | None:
        """[num_reqs, num_tokens] of each build before the first served step (at most MAX_BUILD_HISTORY)."""
        return self.before.get(self.key(builder))


def graph_schedules(attn_groups, attn_metadata: dict, ledger: BuildLedger | None = None) -> dict:
    """Per FA group (FULL steps): the persistent schedule its graphs read, and the step's, where they differ; with a
    ``ledger``, the builder's last build too (``last_build``: :meth:`BuildLedger.of`)."""
    out = {}
    first = None   # the first FA group's step schedule: with the fix, a later group's step metadata points into its own
    for gid, _ag, builder, own, cur in _fa_schedules(attn_groups, attn_metadata):   # buffer, so "same" is then trivial
        n = int(cur.shape[0])
        graph, step = own[:n].cpu().tolist(), cur.cpu().tolist()
        first = step if first is None else first
        out[str(gid)] = ({"n": n, "same": True} if graph == step else
                         {"n": n, "same": False, "graph": graph, "step": step})
        if ledger is not None:
            out[str(gid)]["same_as_first_group_step"] = graph == first
            out[str(gid)]["last_build"] = ledger.of(builder)
    return out


# ----------------------------------------------------------------------------- the probe

class StepProbe:
    """Per-process state: step counter, request ids, output file."""

    def __init__(self, outdir: str | None, raise_on_violation: bool, reference: bool, rel_tol: float = 1e-3,
                 taps: AttnTaps | None = None, ledger: bool = True, oor: str | None = None):
        self.outdir = outdir
        if oor is not None and oor not in OOR_ROWS:
            raise ValueError(f"oor={oor!r}: expected one of {sorted(OOR_ROWS)} or None")
        self.oor = oor  # which rows' out-of-vocabulary sampled ids are replaced (ENV_OOR): an intervention
        self.taps = taps if reference else None
        self.builds = BuildLedger() if self.taps is not None and ledger else None
        self.raise_on_violation = raise_on_violation
        self.reference = reference and outdir is not None
        self.rel_tol = rel_tol
        self.step = 0
        self.req_no: dict = {}
        self.pending_drafts = None
        self.pending_sample = None
        self.last_sampled: dict = {}
        self.first_divergence = None
        self.first_violation = None
        self.lock = threading.Lock()
        self.path = None
        if outdir:
            os.makedirs(outdir, exist_ok=True)
            self.path = os.path.join(outdir, f"probe-{os.getpid()}.jsonl")

    def write(self, obj: dict) -> None:
        if not self.path:
            return
        line = json.dumps(obj, default=_jsonable) + "\n"
        with self.lock, open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def req_numbers(self, req_ids) -> list[int]:
        out = []
        for r in req_ids:
            if r not in self.req_no:
                self.req_no[r] = len(self.req_no)
            out.append(self.req_no[r])
        return out

    # -------------------------------------------------------------- the wrapped forward
    def forward(self, runner, orig, args, kwargs):
        import torch
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available() or _capturing():
            return orig(runner, *args, **kwargs)
        ctx = get_forward_context()
        if not isinstance(ctx.attn_metadata, dict) or not ctx.attn_metadata:
            return orig(runner, *args, **kwargs)
        if getattr(getattr(runner, "input_batch", None), "num_reqs", 0) == 0:
            return orig(runner, *args, **kwargs)  # profiling, warm-up and capture runs: no request
        self.step += 1
        step = self.step
        if self.builds is not None:
            self.builds.step_began()
        if step == 1:
            self.write_layout(runner)
        line = {"step": step, "t": round(time.time(), 3), "mode": ctx.cudagraph_runtime_mode.name,
                "desc": str(ctx.batch_descriptor) if ctx.batch_descriptor is not None else None}
        try:
            ib = runner.input_batch
            n_reqs = ib.num_reqs
            line["num_reqs"] = n_reqs
            line["reqs"] = self.req_numbers(ib.req_ids[:n_reqs])
        except Exception as e:  # noqa: BLE001 - bookkeeping only
            n_reqs = None
            line["reqs_error"] = repr(e)
        if self.pending_drafts is not None:
            line["drafts_in"] = self.pending_drafts
            self.pending_drafts = None
        k = runner.speculative_config.num_speculative_tokens if runner.speculative_config else 0
        layers = ctx.no_compile_layers
        per_layer = step_layers(ctx.attn_metadata, layers)
        violations: list[dict] = []
        step_gdn, step_attn, groups = [], [], {}
        # ---------------- metadata (before the forward: the same for both passes)
        try:
            _sync()
            seen = {}
            for name, kind, meta, layer in per_layer:
                if kind == "gdn":
                    key = id(meta)
                    if key not in seen:
                        rows = gdn_rows(meta)
                        seen[key] = rows
                        if rows is not None:
                            g = f"gdn{sum(1 for v in groups.values() if v.startswith('gdn'))}"
                            groups[key] = g
                            num_slots = int(layer.kv_cache[1].shape[0])
                            violations += check_gdn(rows, num_slots, k, g)
                            line.setdefault("gdn", {})[g] = {
                                "n": rows["n"], "idx": rows["idx"], "na": rows["na"], "qlen": rows["qlen"],
                                "layers": 0}
                    rows = seen[key]
                    if rows is not None:
                        step_gdn.append((name, layer, rows))
                        line["gdn"][groups[key]]["layers"] += 1
                else:
                    slots_t = ctx.slot_mapping.get(name) if isinstance(ctx.slot_mapping, dict) else None
                    if slots_t is None:
                        slots_t = meta.slot_mapping
                    nt = int(meta.num_actual_tokens)
                    slots = slots_t[:nt]
                    step_attn.append((name, layer, slots))
                    key = id(meta)
                    if key not in seen:
                        seen[key] = True
                        kv = layer.kv_cache[0] if isinstance(layer.kv_cache, (list, tuple)) else layer.kv_cache
                        nr = int(meta.seq_lens.shape[0]) if n_reqs is None else min(n_reqs, int(meta.seq_lens.shape[0]))
                        sl = meta.seq_lens[:nr].cpu().numpy()
                        g = f"attn{sum(1 for v in groups.values() if v.startswith('attn'))}"
                        groups[key] = g
                        violations += check_attn_slots(
                            slots.cpu().numpy(), meta.block_table[:nr].cpu().numpy(), sl,
                            meta.query_start_loc[: nr + 1].cpu().numpy(), int(kv.shape[1] * kv.shape[2]),
                            int(kv.shape[2]), g)
                        line.setdefault("attn", {})[g] = {"seq_lens": sl, "num_tokens": nt,
                                                         "max_seq_len": getattr(meta, "max_seq_len", None),
                                                         "max_num_splits": getattr(meta, "max_num_splits", None)}
            if n_reqs is not None:
                for gi, bt in enumerate(runner.input_batch.block_table.block_tables):
                    cpu = bt.block_table.cpu[:n_reqs]
                    gpu = bt.block_table.gpu[:n_reqs].cpu()
                    if not torch.equal(cpu, gpu):
                        r = int(torch.nonzero((cpu != gpu).any(dim=1)).flatten()[0])
                        violations.append({"field": "block_table.gpu", "group": gi, "row": r,
                                           "value": gpu[r, :4].tolist(), "expected": cpu[r, :4].tolist()})
            if ctx.cudagraph_runtime_mode == CUDAGraphMode.FULL and hasattr(runner, "attn_groups"):
                violations += check_graph_schedules(runner.attn_groups, ctx.attn_metadata)
        except Exception as e:  # noqa: BLE001 - a probe failure is recorded, never hides the step
            if is_cuda_error(e):  # an earlier kernel faulted: this step is where it surfaced
                line["error"] = f"{type(e).__name__}: {e}"[:2000]
                self.write(line)
                raise
            line["probe_error"] = f"metadata: {type(e).__name__}: {e}"
        violations += self.check_accepted_continuity(line)
        order = [name for name, _k, _m, _l in per_layer]
        # ---------------- the reference pass (FULL steps only)
        ref_out = fp_ref = ref_taps = None
        attn_names = [name for name, _l, _s in step_attn]
        is_full = ctx.cudagraph_runtime_mode == CUDAGraphMode.FULL
        if self.taps is not None and is_full and hasattr(runner, "attn_groups"):
            try:
                line["schedules"] = graph_schedules(runner.attn_groups, ctx.attn_metadata, self.builds)
            except Exception as e:  # noqa: BLE001 - bookkeeping only
                line["schedules_error"] = f"{type(e).__name__}: {e}"
        if self.reference and is_full and "probe_error" not in line:
            saved = None
            try:
                if self.taps is not None:
                    self.taps.poison()
                saved = snapshot(step_gdn)
                ctx.cudagraph_runtime_mode = CUDAGraphMode.NONE
                ctx.moe_layer_index = 0
                out = orig(runner, *args, **kwargs)
                ref_out = {key: t.clone() for key, t in outputs_of(out).items()}
                _sync()
                fp_ref = fingerprint(step_gdn, step_attn)
                if self.taps is not None:
                    ref_taps = self.taps.snapshot(attn_names)
            except Exception as e:  # noqa: BLE001
                if is_cuda_error(e):
                    line["error"] = f"reference pass: {type(e).__name__}: {e}"[:2000]
                    self.write(line)
                    raise
                line["probe_error"] = f"reference pass: {type(e).__name__}: {e}"
                ref_out = fp_ref = None
            finally:
                if saved is not None:
                    restore(saved)
                ctx.cudagraph_runtime_mode = CUDAGraphMode.FULL
                ctx.moe_layer_index = 0
            del saved
        # ---------------- the production pass
        try:
            if ref_taps is not None:
                self.taps.poison()
            out = orig(runner, *args, **kwargs)
            _sync()
        except Exception as e:
            line["error"] = f"{type(e).__name__}: {e}"[:2000]
            line["violations"] = violations[:MAX_VIOLATIONS_PER_STEP]
            self.write(line)
            raise
        try:
            outs = outputs_of(out)
            ntok = max(int(getattr(m, "num_actual_tokens", 0) or 0) for m in ctx.attn_metadata.values())
            line["num_tokens"] = ntok
            for key, t in outs.items():
                rows_bad = nonfinite_rows(t, ntok)
                if rows_bad:
                    violations.append({"field": "hidden.nonfinite", "tensor": key, "row": rows_bad[0],
                                       "rows": len(rows_bad), "value": "nan/inf"})
            fp_run = fingerprint(step_gdn, step_attn)
            for name in order:
                f = fp_run.get(name)
                if f is None:
                    continue
                bad = sum(int(f[x].sum()) for x in f if x.endswith("_bad"))
                if bad:
                    violations.append({"field": "state.nonfinite", "layer": name, "row": None,
                                       "value": bad, "why": "NaN/Inf in what this step wrote"})
                    break
            if fp_ref is not None:
                cmp = compare(fp_ref, fp_run, order, self.rel_tol)
                cmp["outputs"] = compare_outputs(ref_out, outs, ntok, self.rel_tol)
                diverged = cmp["first_layer"] is not None or any(
                    o["rows_differ"] or o["nonfinite_ref"] != o["nonfinite_run"] for o in cmp["outputs"].values())
                line["diverge"] = {"diverged": diverged, "first_layer": cmp["first_layer"],
                                   "outputs": cmp["outputs"],
                                   "layers_worst": _worst_layers(cmp["layers"], 3)}
                if ref_taps is not None:
                    qsl = next(m.query_start_loc for _n, k_, m, _l in per_layer if k_ == "attn")
                    qsl = (qsl if n_reqs is None else qsl[: n_reqs + 1]).cpu().numpy()
                    # the rows of this group's requests only (ntok is the largest over all groups' metadata)
                    line["taps"] = compare_taps(ref_taps, self.taps.snapshot(attn_names), attn_names,
                                                min(ntok, int(qsl[-1])), qsl, self.rel_tol, self.taps.fill,
                                                self.taps.fills)
                if diverged:
                    line["diverge"]["layers"] = cmp["layers"]
                    if self.first_divergence is None:
                        self.first_divergence = step
        except Exception as e:  # noqa: BLE001
            line["probe_error"] = f"checks: {type(e).__name__}: {e}"
        for v in violations:
            v["step"] = step
        line["violations"] = violations[:MAX_VIOLATIONS_PER_STEP]
        line["n_violations"] = len(violations)
        if violations and self.first_violation is None:
            self.first_violation = step
        self.write(line)
        if violations and self.raise_on_violation:
            v = violations[0]
            raise CanaryError(f"dflash-lab canary: step {step}, {v['field']}, row {v.get('row')}, "
                              f"value {v.get('value')}"
                              + (f", expected {v['expected']}" if "expected" in v else "")
                              + (f", {v['entries_differ']} entries differ" if "entries_differ" in v else "")
                              + (f" ({v['why']})" if v.get("why") else "")
                              + (f", layer {v['layer']}" if v.get("layer") else ""))
        return out

    def write_layout(self, runner) -> None:
        """One 'layout' line: the engine's KV-cache groups (spec kind, layer names), as resolved."""
        try:
            kvc = runner.kv_cache_config
            groups = [{"gid": i, "spec": type(g.kv_cache_spec).__name__,
                       "block_size": getattr(g.kv_cache_spec, "block_size", None), "layers": list(g.layer_names)}
                      for i, g in enumerate(kvc.kv_cache_groups)]
            builders, before = {}, {}
            for gid, ags in enumerate(getattr(runner, "attn_groups", [])):
                builders[gid] = [type(ag.get_metadata_builder(0)).__name__ for ag in ags]
                if self.builds is not None:
                    h = [self.builds.history(ag.get_metadata_builder(0)) for ag in ags]
                    if any(x is not None for x in h):
                        before[gid] = h
            line = {"kind": "layout", "kv_cache_groups": groups, "builders": builders,
                    "num_blocks": getattr(kvc, "num_blocks", None)}
            if self.builds is not None:
                # per group and builder: [num_reqs, num_tokens] of each build before the first served step, in order
                line["builds_before_first_step"] = before
            self.write(line)
        except Exception as e:  # noqa: BLE001 - bookkeeping only
            self.write({"kind": "layout", "error": f"{type(e).__name__}: {e}"})

    def check_accepted_continuity(self, line: dict) -> list[dict]:
        """A request's num_accepted this step equals its valid sampled tokens of its previous step."""
        out = []
        prev = self.last_sampled
        g = (line.get("gdn") or {}).get("gdn0")
        if not prev or g is None or g["na"] is None or "reqs" not in line:
            return out
        for row, (req, na) in enumerate(zip(line["reqs"], g["na"])):
            want = prev.get(req)
            if want is not None and int(na) != want:
                out.append({"field": "gdn.num_accepted", "group": "gdn0", "row": row, "value": int(na),
                            "why": f"request {req} had {want} valid sampled tokens in its previous step"})
        return out

    def after_sample(self, runner, logits) -> None:
        """Non-finite logits rows (the verify logits the sampler sees)."""
        if logits is None or self.step == 0:
            return
        rows = nonfinite_rows(logits, logits.shape[0])
        self.pending_sample = {"logits_rows": int(logits.shape[0]), "logits_nonfinite": len(rows),
                               "logits_first_bad": rows[:8]}

    def after_sampler(self, runner, sampler_output) -> None:
        """Out-of-vocabulary sampled ids: counted on every step, and replaced first when ``oor`` is on (the sample
        line's ``oor_sampled`` is the count the sampler returned, ``oor_replaced`` how many were replaced)."""
        ids = getattr(sampler_output, "sampled_token_ids", None)
        if ids is None or self.step == 0:
            return
        vocab = int(runner.input_batch.vocab_size)
        pending = self.pending_sample if self.pending_sample is not None else {}
        pending["oor_sampled"] = out_of_vocab(ids, vocab)
        if self.oor:
            pending["oor_replaced"] = replace_out_of_vocab(ids[OOR_ROWS[self.oor]], vocab)
        self.pending_sample = pending

    def after_update(self, runner, sampled_token_ids) -> None:
        """Sampled tokens per request that are not the placeholder -1 (``valid``), and each row's first id; one
        'sample' line. ``valid`` counts an id at or above the vocabulary size too, which vLLM does not (s43: the
        sampler returns one from NaN logits); such a row's next accepted count is 0, not ``valid``, so the accepted-count
        continuity check flags it (``divergence.oor_links`` reads those rows from ``first_token``)."""
        if self.step == 0:
            return
        ib = runner.input_batch
        n = sampled_token_ids.shape[0]
        counts = (sampled_token_ids != -1).sum(dim=1).cpu().tolist()
        reqs = self.req_numbers(ib.req_ids[:n])
        self.last_sampled = dict(zip(reqs, counts))
        line = {"kind": "sample", "step": self.step, "reqs": reqs, "valid": counts,
                "first_token": sampled_token_ids[:, 0].cpu().tolist(), **(self.pending_sample or {})}
        self.pending_sample = None
        bad = line.get("logits_nonfinite")
        self.write(line)
        if bad and self.raise_on_violation:
            raise CanaryError(f"dflash-lab canary: step {self.step}, logits.nonfinite, row "
                              f"{line['logits_first_bad'][0]}, value nan/inf ({bad} of {line['logits_rows']} rows)")

    def after_propose(self, result) -> None:
        import torch

        if isinstance(result, torch.Tensor) and result.dim() == 2:
            self.pending_drafts = result[:, :2].cpu().tolist()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def is_cuda_error(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}"
    return "CUDA" in text or "AcceleratorError" in text or "cudaError" in text


def _worst_layers(layers: dict, n: int) -> list:
    return sorted(([k, v["max_rel"]] for k, v in layers.items()), key=lambda x: -x[1])[:n]


def _jsonable(x):
    import numpy as np

    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    return str(x)


_PROBE: dict = {}


def enabled() -> bool:
    return bool(os.environ.get(ENV_PROBE)) or os.environ.get(ENV_CANARY, "0") not in ("", "0")


def taps_from_env() -> AttnTaps | None:
    """``DFLASH_LAB_PROBE_TAPS``: unset/0 none, ``1`` taps, ``sentinel`` / ``nan`` / ``zero`` taps with that pre-fill
    (8192, NaN, 0), in the layers ``DFLASH_LAB_PROBE_FILL_LAYERS`` names (comma-separated layer numbers; unset: all)."""
    v = os.environ.get(ENV_TAPS, "").strip().lower()
    if v in ("", "0"):
        return None
    if v != "1" and v not in FILLS:
        raise ValueError(f"{ENV_TAPS}={v!r}: expected 0, 1, " + ", ".join(FILLS))
    if not os.environ.get(ENV_PROBE):
        raise ValueError(f"{ENV_TAPS} needs {ENV_PROBE} (the taps are compared in the probe's reference pass)")
    raw = os.environ.get(ENV_FILL_LAYERS, "").strip()
    layers = None
    if raw:
        if v == "1":
            raise ValueError(f"{ENV_FILL_LAYERS} needs a pre-fill ({ENV_TAPS}=" + "|".join(FILLS) + ")")
        try:
            layers = {int(x) for x in raw.split(",") if x.strip()}
        except ValueError:
            raise ValueError(f"{ENV_FILL_LAYERS}={raw!r}: expected comma-separated layer numbers") from None
    return AttnTaps(fill=FILLS.get(v), fill_layers=layers)


def oor_from_env() -> str | None:
    """``DFLASH_LAB_PROBE_OOR``: ``1`` replaces out-of-vocabulary sampled ids in every row ("all"), ``row0`` / ``others``
    in batch row 0 / the rows above it only (:func:`replace_out_of_vocab`); unset or ``0`` leaves them (None)."""
    v = os.environ.get(ENV_OOR, "").strip()
    if v not in ("", "0", "1", "row0", "others"):
        raise ValueError(f"{ENV_OOR}={v!r}: expected 0, 1, row0 or others")
    return {"": None, "0": None, "1": "all"}.get(v, v)


def out_of_vocab(sampled, vocab_size: int) -> int:
    """How many sampled ids are ``>= vocab_size`` (``-1``, the rejected placeholder, is not counted)."""
    return int((sampled >= vocab_size).sum().item())


def replace_out_of_vocab(sampled, vocab_size: int, token: int = OOR_TOKEN) -> int:
    """In place: every id ``>= vocab_size`` becomes ``token``; placeholders (``-1``) and valid ids are left alone.
    Returns how many ids were replaced."""
    if not 0 <= token < vocab_size:
        raise ValueError(f"replacement token {token} is not a valid id for a vocabulary of {vocab_size}")
    bad = sampled >= vocab_size
    n = int(bad.sum().item())
    if n:
        sampled.masked_fill_(bad, token)
    return n


def ledger_from_env() -> bool:
    """``DFLASH_LAB_PROBE_LEDGER``: unset or ``1`` keeps the build ledger (with the taps), ``0`` leaves it out."""
    v = os.environ.get(ENV_LEDGER, "").strip()
    if v not in ("", "0", "1"):
        raise ValueError(f"{ENV_LEDGER}={v!r}: expected 0 or 1")
    if v == "0" and os.environ.get(ENV_TAPS, "").strip() in ("", "0"):
        raise ValueError(f"{ENV_LEDGER}=0 needs {ENV_TAPS} (the ledger only runs with the taps)")
    return v != "0"


def install() -> StepProbe:
    """Wrap ``GPUModelRunner._model_forward`` (and the DFlash proposer's ``propose``)."""
    if "probe" in _PROBE:
        return _PROBE["probe"]
    taps = taps_from_env()
    probe = StepProbe(os.environ.get(ENV_PROBE) or None,
                      raise_on_violation=os.environ.get(ENV_CANARY, "0") not in ("", "0"),
                      reference=os.environ.get(ENV_REF, "1") not in ("", "0"), taps=taps,
                      ledger=ledger_from_env(), oor=oor_from_env())
    _PROBE["probe"] = probe
    if probe.taps is not None:
        from vllm.v1.attention.backends import flash_attn as fa

        impl = fa.FlashAttentionImpl
        if not getattr(impl.forward, "_dflash_lab_taps", False):
            impl.forward = probe.taps.wrap(impl.forward)
        B = fa.FlashAttentionMetadataBuilder
        if probe.builds is not None and not getattr(B.build, "_dflash_lab_builds", False):
            B.build = probe.builds.wrap(B.build)
    from vllm.v1.worker import gpu_model_runner as gmr

    R = gmr.GPUModelRunner
    if not getattr(R._model_forward, "_dflash_lab_probe", False):
        orig = R._model_forward

        def _model_forward(self, *args, **kwargs):
            return probe.forward(self, orig, args, kwargs)

        _model_forward._dflash_lab_probe = True
        R._model_forward = _model_forward

        orig_sample = R._sample

        def _sample(self, logits, *a, **kw):
            probe.after_sample(self, logits)
            out = orig_sample(self, logits, *a, **kw)
            probe.after_sampler(self, out)  # before _update_states_after_model_execute and the drafter read it
            return out

        R._sample = _sample
        orig_update = R._update_states_after_model_execute

        def _update_states_after_model_execute(self, output_token_ids, *a, **kw):
            res = orig_update(self, output_token_ids, *a, **kw)
            probe.after_update(self, output_token_ids)
            return res

        R._update_states_after_model_execute = _update_states_after_model_execute
    try:
        from vllm.v1.spec_decode import dflash as dflash_mod

        P = dflash_mod.DFlashProposer
        if not getattr(P.propose, "_dflash_lab_probe", False):
            orig_p = P.propose

            def propose(self, *a, **kw):
                res = orig_p(self, *a, **kw)
                try:
                    probe.after_propose(res)
                except Exception:  # noqa: BLE001 - bookkeeping only
                    pass
                return res

            propose._dflash_lab_probe = True
            P.propose = propose
    except ImportError:
        pass
    return probe
