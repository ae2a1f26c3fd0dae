"""Bounds analyses of ``copy_and_expand_dflash_inputs_kernel`` for notebooks 02 and 04."""

from __future__ import annotations

import json
import os

import numpy as np

from .errors import LabError
from .records import OUTPUTS, Record, load_record
from .replay import query_slots, replay
from .scenarios import Step, make_record, standard_scenarios


ENGINE_OUTPUTS = ("out_query_positions_ptr", "out_query_slot_mapping_ptr", "out_context_slot_mapping_ptr")


def replay_matches_engine(rec: Record, res) -> bool:
    """Whether a replay reproduces, bit for bit, the outputs an engine-recorded launch holds."""
    return all(np.array_equal(res.outputs[o][: len(rec.arrays[o])], rec.arrays[o]) for o in ENGINE_OUTPUTS)


def _viol_text(res) -> str:
    return "; ".join(f"{v.op} {v.param}[{v.offset_min}] (extent {v.extent}, program {v.program_id[0]})"
                     for v in res.violations) or "none"


def launch_summary(rec: Record, res) -> dict:
    qs = query_slots(rec, res.outputs)
    rej = rec.arrays.get("num_rejected_tokens_ptr")
    qsl = rec.arrays["query_start_loc_ptr"]
    all_rej = [] if rej is None else [i for i in range(rec.num_reqs) if int(rej[i]) >= int(qsl[i + 1] - qsl[i])]
    return {
        "requests": rec.num_reqs,
        "violations": _viol_text(res),
        "guard_writes": sum(res.guard_writes.values()),
        "requests_all_rejected": all_rej,
        "slots_outside_allocation": sum(len(q["outside_allocation"]) for q in qs),
        "negative_slots": sum(len(q["negative"]) for q in qs),
        "slots_outside_cache": sum(len(q["outside_cache"]) for q in qs),
    }


def scenario_row(name: str, kernel: str = "stock") -> dict:
    """One standard scenario (:func:`scenarios.standard_scenarios`) replayed: the row :func:`scenario_table` gives it."""
    sc = {x.name: x for x in standard_scenarios()}
    if name not in sc:
        raise LabError(f"no standard scenario {name!r} (have {sorted(sc)})")
    rec = make_record(sc[name].step)
    return {"scenario": name, "what": sc[name].why, **launch_summary(rec, replay(rec, kernel))}


def scenario_table(kernel: str = "stock") -> list[dict]:
    rows = []
    for sc in standard_scenarios():
        rec = make_record(sc.step)
        res = replay(rec, kernel)
        rows.append({"scenario": sc.name, "what": sc.why, **launch_summary(rec, res)})
    return rows


def random_step(batch: int, k: int, block_size: int, computed_range: tuple, accept_rate: float,
                discard_prob: float, rng, **kw) -> Step:
    """A verify step with per-request acceptance drawn from a geometric model.

    Each draft is accepted with probability ``accept_rate`` until the first rejection
    (vLLM's rejection sampler stops at the first rejected draft); a request is discarded
    (valid_count 0, so num_rejected = k + 1) with probability ``discard_prob``.
    """
    lo, hi = computed_range
    if not (0 <= lo <= hi):
        raise LabError(f"bad context range {computed_range}")
    computed = rng.integers(lo, hi + 1, size=batch).tolist()
    rejected = []
    for _ in range(batch):
        if rng.random() < discard_prob:
            rejected.append(k + 1)
            continue
        a = 0
        while a < k and rng.random() < accept_rate:
            a += 1
        rejected.append(k - a)
    return Step(num_computed=computed, num_scheduled=[k + 1] * batch, num_rejected=rejected, k=k,
                block_size=block_size, seed=int(rng.integers(1 << 30)), **kw)


def sweep(batch_sizes, launches: int, k: int, block_size: int, computed_range, accept_rate: float,
          discard_prob: float, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for b in batch_sizes:
        for i in range(launches):
            step = random_step(b, k, block_size, computed_range, accept_rate, discard_prob, rng,
                               max_num_seqs=max(64, b))
            rec = make_record(step)
            res = replay(rec, "stock")
            s = launch_summary(rec, res)
            rows.append({"batch": b, "launch": i, "out_of_bounds": bool(res.violations),
                         "req0_all_rejected": 0 in s["requests_all_rejected"],
                         "later_req_all_rejected": any(r > 0 for r in s["requests_all_rejected"]),
                         "slots_outside_allocation": s["slots_outside_allocation"],
                         "violations": s["violations"]})
    return rows


def parity(paths: list[str]) -> list[dict]:
    """Stock vs patched kernel on each record: violations, and whether the outputs are identical.

    An engine-recorded launch whose stock replay does not reproduce the engine's own outputs
    (copied after the CUDA fault) gets a short row with ``stock_replay_equals_engine_outputs``
    False and no patched replay.
    """
    from .replay import prewarm

    prewarm(paths)  # parallel cache fill; the loop below then reads the cache
    rows = []
    for p in paths:
        rec = load_record(p)
        a = replay(rec, "stock")
        engine_same = None
        if rec.meta.get("source", "").startswith("vLLM 0.22.1 engine"):
            engine_same = replay_matches_engine(rec, a)
            if not engine_same:  # host copies taken after the CUDA fault: not a launch the engine ran
                rows.append({"record": os.path.relpath(p), "requests": rec.num_reqs,
                             "stock_replay_equals_engine_outputs": False})
                continue
        b = replay(rec, "patched")
        diff = {}
        for o in OUTPUTS:
            if o in a.outputs and not np.array_equal(a.outputs[o], b.outputs[o]):
                diff[o] = int((a.outputs[o] != b.outputs[o]).sum())
        s = launch_summary(rec, a)
        rows.append({"record": os.path.relpath(p), "requests": rec.num_reqs,
                     "requests_all_rejected": s["requests_all_rejected"],
                     "stock_violations": _viol_text(a), "patched_violations": _viol_text(b),
                     "stock_in_bounds": not a.violations, "outputs_identical": not diff,
                     "differing_elements": json.dumps(diff) if diff else "",
                     "stock_replay_equals_engine_outputs": engine_same})
    return rows
