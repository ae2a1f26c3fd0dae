"""vLLM 0.22.1's synthetic acceptance, read from its own code (dflash_lab.acceptance), and the recorded runs against it."""

import pytest

from dflash_lab import acceptance, bench
from dflash_lab.errors import LabError


def test_the_pinned_schedule_accepts_whole_drafts_first():
    assert acceptance.rates(6.0, 15) == [1.0] * 5 + [0.0] * 10
    r = acceptance.rates(3.6, 15)
    assert r[:2] == [1.0, 1.0] and r[2] == pytest.approx(0.6) and r[3:] == [0.0] * 12
    assert acceptance.rates(1.0, 15) == [0.0] * 15 and acceptance.rates(16, 15) == [1.0] * 15


@pytest.mark.parametrize("length,expected", [
    (1.86, {1: 0.14, 2: 0.86}), (3.6, {3: 0.4, 4: 0.6}), (6.0, {6: 1.0}), (8.8, {8: 0.2, 9: 0.8}),
    (1.0, {1: 1.0}), (16.0, {16: 1.0}), (2.5, {2: 0.5, 3: 0.5})])
def test_tokens_per_step_are_the_two_integers_around_the_length(length, expected):
    d = acceptance.tokens_per_step(length, 15)
    assert d.keys() == expected.keys() and all(d[t] == pytest.approx(p) for t, p in expected.items())
    assert sum(t * p for t, p in d.items()) == pytest.approx(length)


def test_the_table_says_which_acceptances_ever_reject_every_draft():
    t = acceptance.schedule_table([6.0, 1.86, 3.6], 15).set_index("synthetic acceptance")
    assert list(t.index) == [1.86, 3.6, 6.0]
    assert t.loc[1.86, "steps rejecting every draft"] == pytest.approx(0.14)
    assert t.loc[3.6, "steps rejecting every draft"] == 0 and t.loc[6.0, "steps rejecting every draft"] == 0
    assert t.loc[6.0, "std per step"] == 0 and t.loc[6.0, "tokens per step (probability)"] == "6 (1.00)"


@pytest.mark.parametrize("length,k,msg", [
    (0.5, 15, r"must be in \[1, 16\] for k=15"), (17, 15, r"must be in \[1, 16\]"), ("x", 15, "must be a number"),
    (None, 15, "must be a number"), (2.0, 0, "positive integer"), (2.0, 1.5, "positive integer")])
def test_bad_input_is_one_clear_error(length, k, msg):
    with pytest.raises(LabError, match=msg):
        acceptance.rates(length, k)


def test_the_recorded_runs_match_the_schedule():
    """vLLM's own counters over every completed measured DFlash run: at 6.0 every run says exactly 6 (the schedule
    has no spread there), elsewhere the schedule's mean lies inside the runs' range."""
    t = acceptance.measured_against_schedule(bench.load_bench())
    if t.empty:
        pytest.skip("no bench runs recorded")
    assert set(t["k"]) == {15}
    for _, row in t.iterrows():
        assert row["measured lowest"] <= row["schedule mean"] + 1e-9 <= row["measured highest"] + 2e-9, row.to_dict()
    six = t[t["synthetic acceptance"] == 6.0]
    if len(six):
        assert (six["measured lowest"] == 6.0).all() and (six["measured highest"] == 6.0).all()
        assert six["runs"].sum() == 36
