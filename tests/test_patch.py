"""Regression tests of the fix: fail on the stock kernel, pass on the patched one."""

import glob

import pytest

from dflash_lab import bounds, patch
from dflash_lab.errors import LabError
from dflash_lab.kernels import vllm_kernel
from dflash_lab.records import load_record
from dflash_lab.replay import query_slots, replay
from dflash_lab.scenarios import Step, make_record


@pytest.mark.parametrize("rejected", [[16, 0], [20, 0]])
def test_last_pos_load_stays_in_the_request(rejected):
    rec = make_record(Step(num_computed=[100, 200], num_scheduled=[16, 16], num_rejected=rejected))
    assert replay(rec, "stock").violations, "the stock kernel should read out of bounds here"
    res = replay(rec, "patched")
    assert res.ok
    q = query_slots(rec, res.outputs)[0]
    # nothing accepted: the first query token sits at the request's first context position
    assert q["positions"][0] == 100
    assert q["outside_allocation"] == [] and q["negative"] == []


def test_all_rejected_later_request_uses_its_own_position():
    rec = make_record(Step(num_computed=[100, 200], num_scheduled=[16, 16], num_rejected=[0, 16]))
    assert query_slots(rec, replay(rec, "stock").outputs)[1]["positions"][0] == 116
    assert query_slots(rec, replay(rec, "patched").outputs)[1]["positions"][0] == 200


def test_positions_past_max_model_len_get_no_slot():
    rec = load_record("data/records/past_max_model_len.npz")
    stock = query_slots(rec, replay(rec, "stock").outputs)[0]
    patched = query_slots(rec, replay(rec, "patched").outputs)[0]
    over = [i for i, p in enumerate(patched["positions"]) if p >= 65536]
    assert over, "the scenario must reach past max_model_len"
    assert all(patched["slots"][i] == -1 for i in over)
    assert all(stock["slots"][i] >= 0 for i in over)  # stock writes them into the last block


def test_parity_on_every_in_bounds_standard_launch():
    rows = bounds.parity(sorted(glob.glob("data/records/*.npz")))
    for r in rows:
        if r["stock_in_bounds"] and not r["requests_all_rejected"] and "past_max_model_len" not in r["record"]:
            assert r["outputs_identical"], r


def test_every_anchor_matches_once_and_a_changed_kernel_is_refused():
    stock = vllm_kernel().text
    patched = patch.patch_text(stock)
    assert patched.count("dflash-lab") >= 3
    with pytest.raises(LabError, match="found 0 times"):
        patch.patch_text(stock.replace("last_pos = tl.load(target_positions_ptr + valid_ctx_end - 1)", "last_pos = 0"))


def test_replay_extra_args_derive_seq_lens_without_meta():
    rec = make_record(Step(num_computed=[100, 200], num_scheduled=[16, 16], num_rejected=[0, 0]))
    rec.meta.pop("seq_lens")
    extra = patch.replay_extra_args(rec, "cpu")
    assert extra["seq_lens_ptr"].tolist() == [116, 216] and extra["num_lookahead_tokens"] == 16


def test_committed_upstream_diff_is_current(root):
    assert (root / "patches" / "vllm-0.22.1-dflash.diff").read_text() == patch.upstream_diff()


def test_fix_parts_are_selected_by_name_and_unknown_names_refused():
    from dflash_lab.errors import LabError

    assert patch.selected_parts("") == patch.FIX_PARTS
    assert patch.selected_parts(" dflash_kernel_edits , fa3_schedule_refresh") == ("fa3_schedule_refresh", "dflash_kernel_edits")
    with pytest.raises(LabError, match="unknown part"):
        patch.selected_parts("fa3_schedule_refresh,everything")
