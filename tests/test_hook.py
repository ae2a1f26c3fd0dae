"""The engine-side checks of the launch hook, on host copies built from a replayed launch (no GPU)."""

import numpy as np

from dflash_lab import hook, plugin
from dflash_lab.records import load_record, save_record
from dflash_lab.replay import replay
from dflash_lab.scenarios import Step, make_record


def host_copies(rec, res):
    h = {p: (a if a is not None else None) for p, a in rec.arrays.items() if a is not None}
    for o, v in res.outputs.items():
        h[o] = v
    h["seq_lens"] = np.asarray(rec.meta["seq_lens"], dtype=np.int32)
    return h


def test_findings_for_all_rejected_unallocated_and_wild_slots(tmp_path):
    rec = make_record(Step(num_computed=[100, 417], num_scheduled=[16, 16], num_rejected=[16, 0]))
    res = replay(rec, "stock")
    h = host_copies(rec, res)
    kinds = {(f["kind"], f["req"]) for f in hook.check_launch(h, rec.scalars, rec.grid,
                                                              rec.meta["allocated_blocks"], 20000 * 16)}
    assert ("C2", 0) in kinds        # request 0: every context token rejected
    assert ("C1", 0) in kinds        # its garbage positions land outside its blocks
    h["out_query_slot_mapping_ptr"] = h["out_query_slot_mapping_ptr"].copy()
    h["out_query_slot_mapping_ptr"][16] = 10 ** 9  # request 1: a slot past the cache
    kinds = {(f["kind"], f["req"]) for f in hook.check_launch(h, rec.scalars, rec.grid, None, 20000 * 16)}
    assert ("fault", 1) in kinds


def test_clean_launch_has_no_finding_and_round_trips_as_a_record(tmp_path):
    rec = make_record(Step(num_computed=[100, 200], num_scheduled=[16, 16], num_rejected=[3, 15]))
    res = replay(rec, "stock")
    h = host_copies(rec, res)
    assert hook.check_launch(h, rec.scalars, rec.grid, rec.meta["allocated_blocks"], 20000 * 16) == []
    r2 = hook.to_record(h, rec.scalars, rec.grid, rec.meta["allocated_blocks"], 20000 * 16, 65536)
    save_record(tmp_path / "x.npz", r2)
    back = load_record(tmp_path / "x.npz")
    again = replay(back, "stock")
    assert np.array_equal(again.outputs["out_query_slot_mapping_ptr"], res.outputs["out_query_slot_mapping_ptr"])


def test_plugin_does_nothing_without_its_variables(monkeypatch):
    monkeypatch.delenv("DFLASH_LAB_FIX", raising=False)
    monkeypatch.delenv("DFLASH_LAB_HOOK", raising=False)
    monkeypatch.delenv("DFLASH_LAB_PROBE", raising=False)
    monkeypatch.delenv("DFLASH_LAB_CANARY", raising=False)
    plugin.register()  # must not import vLLM (not installed on the CPU) nor fail
    assert plugin._done == set()
