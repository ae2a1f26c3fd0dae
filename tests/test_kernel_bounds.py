"""vLLM 0.22.1's own DFlash input kernel, instrumented, on launches built as vLLM builds them."""

from dflash_lab.replay import query_slots, replay
from dflash_lab.scenarios import Step, make_record, verify_step


def test_request0_all_rejected_reads_before_target_positions():
    rec = make_record(Step(num_computed=[100, 200], num_scheduled=[16, 16], num_rejected=[16, 0]))
    res = replay(rec, "stock")
    assert [(v.param, v.op, v.offset_min, v.extent, v.program_id, v.line) for v in res.violations] == [
        ("target_positions_ptr", "load", -1, 32, (0, 0, 0), 526)]
    # the garbage read becomes request 0's positions and slots: none lies in its allocation
    q = query_slots(rec, res.outputs)[0]
    assert len(q["outside_allocation"]) == 16


def test_realistic_verify_launches_are_clean():
    for computed, accepted in [([365, 518, 574, 365, 413, 432, 440], [0, 1, 0, 2, 0, 0, 3]),
                               ([117 + i for i in range(32)], [(7 * i) % 16 for i in range(32)])]:
        rec = make_record(verify_step(computed, accepted))
        res = replay(rec, "stock")
        assert res.ok, res.violations
        assert all(not q["outside_allocation"] for q in query_slots(rec, res.outputs))


def test_all_accepted_at_block_edge_writes_outside_the_allocation():
    # seq_len + k crosses a block boundary: vLLM 0.22.1 allocates k lookahead slots, DFlash needs k + 1
    rec = make_record(verify_step([417, 100], [15, 15]))
    res = replay(rec, "stock")
    assert res.ok  # in bounds for the kernel ...
    q = query_slots(rec, res.outputs)
    assert len(q[0]["outside_allocation"]) == 1  # ... but one slot is not the request's
    assert q[1]["outside_allocation"] == []


def test_later_request_all_rejected_borrows_the_previous_position():
    rec = make_record(Step(num_computed=[100, 200], num_scheduled=[16, 16], num_rejected=[0, 16]))
    res = replay(rec, "stock")
    assert res.ok
    pos = query_slots(rec, res.outputs)[1]["positions"]
    assert pos[0] == 116  # request 0's last context position + 1, not 200


def test_one_standard_scenario_replays_by_name():
    import pytest

    from dflash_lab import bounds
    from dflash_lab.errors import LabError

    r = bounds.scenario_row("req0_all_rejected")
    assert r["requests_all_rejected"] == [0] and r["violations"].startswith("load target_positions_ptr[-1]")
    assert bounds.scenario_row("req1_all_rejected")["violations"] == "none"
    with pytest.raises(LabError, match="no standard scenario 'nope'"):
        bounds.scenario_row("nope")
