"""fa3sched: FA3's precomputed schedule decoded, and which requests a replay reading a stale one leaves unwritten."""

import pytest

from dflash_lab import fa3sched as F
from dflash_lab.errors import LabError

# group 7's persistent buffer as the probe recorded it on every FULL step of s36 (a 1-request batch's schedule:
# rows [128, pad, pad, pad], splits [1, pad..], heads-in-L2 [2, pad..], semaphore 0; the tail zeroed by vLLM)
STALE = [128, 0, 31, 0, 1, 0, 0, 0, 2, 0, 0, 0, 0] + [0] * 84


def fresh(b, rows=128, splits=1, l2=2):
    b4 = F.round_up4(b)
    v = [0] * (1 + 3 * b4)
    for i in range(b):
        v[i], v[b4 + i], v[2 * b4 + i] = rows, splits, l2
    return v


def test_decode_reads_the_offsets_of_the_batch_size():
    d = F.decode(STALE[:25], 8)
    assert d["seqlen_q"] == [128, 0, 31, 0, 1, 0, 0, 0]
    assert d["num_splits"] == [2, 0, 0, 0, 0, 0, 0, 0]  # request 0 reads the 1-request batch's heads-in-L2 entry
    assert d["nheads_l2"] == [0] * 8 and d["semaphore"] == 0
    assert F.decode(STALE[:13], 1) == {"b": 1, "b4": 4, "seqlen_q": [128], "num_splits": [1], "nheads_l2": [2],
                                       "semaphore": 0}


@pytest.mark.parametrize("n,b,msg", [(24, 8, "do not fit"), (17, 8, "only the 3-vector layout"), (5, 0, "0 requests")])
def test_decode_refuses_what_it_cannot_place(n, b, msg):
    with pytest.raises(LabError, match=msg):
        F.decode([0] * n, b)


def test_coverage_of_the_stale_schedule_by_batch_size():
    U, W = F.UNWRITTEN, F.WRITTEN
    assert F.coverage(STALE[:13], fresh(1), 1) == [W]
    assert F.coverage(STALE[:13], fresh(3), 3) == [W, U, U]
    assert F.coverage(STALE[:25], fresh(8), 8) == [W] + [U] * 7
    assert F.coverage(STALE[:37], fresh(9), 9) == [U] * 9  # splits now read from the zeroed tail
    assert F.coverage(STALE[:97], fresh(32), 32) == [U] * 32
    assert F.coverage(fresh(8), fresh(8), 8) == [W] * 8


def test_coverage_partial_and_combined_rows():
    g = fresh(4, rows=256)
    g[0] = 64  # one 128-row tile of the request's two: the second tile is never computed
    g[1] = 200  # two tiles: every row of the request (the rows past 256 would be masked)
    g[2], g[4 + 2] = 0, 4  # no rows, but 4 splits: the combine reads partials nobody wrote
    assert F.coverage(g, fresh(4, rows=256), 4) == [F.PARTIAL, F.WRITTEN, F.COMBINED, F.WRITTEN]
    g1 = fresh(1)
    g1[0] = 31  # fewer rows than the step's 128, but inside the one tile FA3 computes: all written
    assert F.coverage(g1, fresh(1), 1) == [F.WRITTEN]
    g[12] = 5
    with pytest.raises(LabError, match="semaphore 5"):
        F.coverage(g, fresh(4, rows=256), 4)


@pytest.mark.parametrize("splits,l2,msg", [(33, 2, "more than the 32"), (1, 0, "divides by it")])
def test_coverage_refuses_what_it_cannot_tell(splits, l2, msg):
    g = fresh(1, splits=splits, l2=l2)
    with pytest.raises(LabError, match=msg):
        F.coverage(g, fresh(1), 1)


def probe(taps_by_step, stale=STALE[:25], b=8):
    layout = {"kind": "layout", "kv_cache_groups": [
        {"gid": 6, "layers": ["m.layers.3.attn"]}, {"gid": 7, "layers": ["m.layers.7.attn", "m.layers.15.attn"]}]}
    steps = [{"step": 1, "mode": "PIECEWISE", "num_reqs": b}]
    for s, taps in taps_by_step.items():
        steps.append({"step": s, "mode": "FULL", "num_reqs": b, "taps": taps,
                      "schedules": {"6": {"n": 25, "same": True},
                                    "7": {"n": 25, "same": False, "graph": stale, "step": fresh(b)}}})
    return {"steps": steps, "layout": layout, "session": "s", "engine": "e"}


def tap(unwritten=None, nonfinite=(), ref=0):
    t = {"req_nonfinite_run": list(nonfinite), "nonfinite_run": 16 * len(nonfinite), "nonfinite_ref": ref,
         "req_differ": list(unwritten or []), "rows_differ": 16 * len(unwritten or [])}
    if unwritten is not None:
        t["req_unwritten_run"], t["unwritten_run"] = list(unwritten), 16 * len(unwritten)
    return t


def test_unwritten_table_compares_prediction_and_measurement_per_stale_layer():
    ok = list(range(1, 8))
    p = probe({2: {"m.layers.3.attn": tap([]), "m.layers.7.attn": tap(ok), "m.layers.15.attn": tap(ok[:-1])}})
    t = F.unwritten_table([p])
    assert list(t.layer) == ["m.layers.7.attn", "m.layers.15.attn"]  # group 6 reads its own, fresh schedule
    assert list(t.match) == [True, False]
    plain = probe({2: {"m.layers.7.attn": tap(None), "m.layers.15.attn": tap(None)}})
    assert F.unwritten_table([plain]).empty  # no sentinel: nothing measured about unwritten rows


def test_nan_origin_is_the_first_layer_with_nan_the_reference_lacks():
    p = probe({2: {"m.layers.3.attn": tap(None, [1], ref=16), "m.layers.7.attn": tap(None),
                   "m.layers.15.attn": tap(None, [1, 2])},
               3: {"m.layers.7.attn": tap(None, [0])}})
    o = F.nan_origin(p)
    assert (o["step"], o["layer"], o["requests"], o["within_unwritten"]) == (2, "m.layers.15.attn", [1, 2], True)
    p = probe({2: {"m.layers.7.attn": tap(None, [0])}})
    assert F.nan_origin(p)["within_unwritten"] is False  # request 0 is written: NaN there would be FA's own
    assert F.nan_origin(probe({2: {"m.layers.7.attn": tap(None)}})) is None


def test_nan_rows_by_step_counts_only_the_rows_the_reference_lacks_per_layer_and_step():
    p = probe({2: {"m.layers.15.attn": tap(None, [1, 2]), "m.layers.3.attn": tap(None, [1], ref=16),
                   "m.layers.7.attn": tap(None)},
               3: {"m.layers.7.attn": tap(None, [0, 4, 5], ref=16)}})
    t = F.nan_rows_by_step(p)
    # model order within a step; a layer's NaN the reference pass has too is not new (layer 3 at step 2)
    assert list(zip(t["step"], t["layer number"], t["group"], t["NaN rows beyond the reference"])) == [
        (2, 3, 6, 0), (2, 7, 7, 0), (2, 15, 7, 32), (3, 7, 7, 32)]
    # the graph pass's requests with NaN, whether or not the reference had them too (layer 3 at step 2)
    assert list(t["requests with NaN (graph pass)"]) == [[1], [], [1, 2], [0, 4, 5]]
    # steps without taps (the PIECEWISE step) give no rows; a probe without FULL taps an empty table with the columns
    empty = F.nan_rows_by_step(probe({}))
    assert empty.empty and "NaN rows beyond the reference" in empty.columns
    # a tap without counts (None) reads as none, not as an error
    t = F.nan_rows_by_step(probe({2: {"m.layers.7.attn": {**tap(None), "nonfinite_run": None}}}))
    assert list(t["NaN rows beyond the reference"]) == [0]


def test_plot_nan_rows_draws_layers_by_step_with_their_groups():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = probe({2: {"m.layers.15.attn": tap(None, [1, 2]), "m.layers.3.attn": tap(None, [1], ref=16),
                   "m.layers.7.attn": tap(None)},
               3: {"m.layers.7.attn": tap(None, [0, 4, 5], ref=16)}})
    fig, ax = plt.subplots()
    try:
        im = F.plot_nan_rows(ax, F.nan_rows_by_step(p), "t")
        # rows: layers in model order with their group; columns: the FULL steps; a layer with no tap at a step is blank
        assert [x.get_text() for x in ax.get_yticklabels()] == ["L3 attn (group 6)", "L7 attn (group 7)", "L15 attn (group 7)"]
        assert [x.get_text() for x in ax.get_xticklabels()] == ["2", "3"]
        a = im.get_array()
        assert a[2, 0] == 32 and a[1, 1] == 32 and a[0, 0] == 0 and bool(a.mask[0, 1])
        assert im.get_clim() == (0, 32) and ax.get_title() == "t"
        # nothing to draw (no FULL step with taps): one clear error, not a pandas one
        with pytest.raises(LabError, match="no FULL step with taps"):
            F.plot_nan_rows(ax, F.nan_rows_by_step(probe({})), "empty")
    finally:
        plt.close(fig)


def test_tap_summary_and_stale_vectors():
    p = probe({2: {"m.layers.7.attn": tap(list(range(1, 8)), [1]), "m.layers.15.attn": tap([])},
               3: {"m.layers.7.attn": tap([])}})
    assert F.tap_summary(p) == {"FULL steps with taps": 2, "steps differing": 1, "steps with new NaN": 1,
                                "steps with unwritten rows": 1, "pre-filled": True}
    assert F.stale_vectors([p]) == {(128, 0, 31, 0, 1, 0, 0, 0, 2): 2}
    assert F.has_taps(p) and not F.has_taps({"steps": [{"step": 1, "mode": "FULL"}]})


def test_replay_reads_zero_extends_the_buffer():
    r = F.replay_reads([128, 0, 31, 0, 1, 0, 0, 0, 2], 3)
    assert r == {"requests in the step": 3, "query rows read": [128, 0, 31], "splits read": [1, 0, 0],
                 "requests written": [0]}
    assert F.replay_reads([128, 0, 31, 0, 1, 0, 0, 0, 2], 16)["requests written"] == []


def test_a_step_replaying_a_graph_of_another_batch_size_is_not_compared():
    ok = list(range(1, 8))
    p = probe({2: {"m.layers.7.attn": tap(ok)}})
    p["steps"][1]["desc"] = "BatchDescriptor(num_tokens=128, num_reqs=8, uniform=True)"
    assert len(F.unwritten_table([p])) == 1
    p["steps"][1]["desc"] = "BatchDescriptor(num_tokens=160, num_reqs=10, uniform=True)"
    assert F.unwritten_table([p]).empty


def test_predicted_outcome_follows_what_the_unwritten_rows_hold():
    assert F.predicted_outcome(False, "nan") == "crash"
    assert F.predicted_outcome(False, "zero") == F.predicted_outcome(False, "sentinel") == "ok"
    assert F.predicted_outcome(True, "nan") == "ok"  # the fix writes every row over the pre-fill
    assert F.predicted_outcome(False, None, "crash") == "crash" and F.predicted_outcome(False, None) is None
    with pytest.raises(LabError, match="pre-fill 'inf'"):
        F.predicted_outcome(False, "inf")


def test_fill_summary_counts_predicted_unwritten_and_the_first_nan():
    ok = list(range(1, 8))
    p = probe({2: {"m.layers.7.attn": tap(ok, ok), "m.layers.15.attn": tap(ok[:-1], ok)},
               3: {"m.layers.7.attn": tap(ok, ok), "m.layers.15.attn": tap(ok, ok)}})
    s = F.fill_summary(p)
    assert (s["stale layer-steps"], s["unwritten measured"], s["unwritten as predicted"]) == (4, 4, 3)
    assert (s["first FULL step"], s["last step"], s["first NaN step"]) == (2, 3, 2)
    assert s["first NaN layer"] == "m.layers.7.attn" and s["NaN only in unwritten requests"] is True
    plain = F.fill_summary(probe({2: {"m.layers.7.attn": tap(None)}}))
    assert plain["unwritten as predicted"] is None and plain["first NaN step"] is None and not plain["pre-filled"]


def test_exact_test_with_one_stratum_is_fishers():
    one = lambda *t: F.exact_stratified([t])  # noqa: E731
    assert one(4, 4, 4, 11) == pytest.approx(1 / 330)  # 4 crashes, all on the 4 runs of the condition
    assert one(2, 2, 2, 6) == pytest.approx(1 / 15)
    assert one(0, 3, 2, 6) == pytest.approx(1.0)
    assert one(1, 2, 2, 6) == pytest.approx(1 - 6 / 15)  # P(X >= 1) = 1 - C(4,2)/C(6,2)
    with pytest.raises(LabError, match="not a 2x2 table"):
        one(3, 2, 3, 6)


def test_exact_stratified_sums_the_condition_events_over_independent_strata():
    # s37: at 8, 2 crashes in 5 stock runs, both NaN-filled (of 2); at 16, 2 in 4, both NaN-filled (of 2)
    assert F.exact_stratified([(2, 2, 2, 5), (2, 2, 2, 4)]) == pytest.approx(1 / 10 * 1 / 6)
    # not the most extreme: P(X8 + X16 >= 3) = P(2,1) + P(1,2) + P(2,2), hypergeometric in each stratum
    p8 = {0: 3 / 10, 1: 6 / 10, 2: 1 / 10}
    p16 = {0: 1 / 6, 1: 4 / 6, 2: 1 / 6}
    want = p8[2] * p16[1] + p8[1] * p16[2] + p8[2] * p16[2]
    assert F.exact_stratified([(2, 2, 2, 5), (1, 2, 2, 4)]) == pytest.approx(want)
    assert F.exact_stratified([(2, 2, 2, 5)]) == pytest.approx(1 / 10)
    with pytest.raises(LabError, match="no strata"):
        F.exact_stratified([])


def test_fill_summary_names_the_pass_the_last_step_ended_in():
    p = probe({2: {"m.layers.7.attn": tap(None)}})
    assert F.fill_summary(p)["last step ended in"] is None
    p["steps"][-1]["error"] = "reference pass: AcceleratorError: CUDA error: an illegal memory access was encountered"
    assert F.fill_summary(p)["last step ended in"] == "reference pass"
    p["steps"][-1]["error"] = "AcceleratorError: CUDA error: device-side assert triggered"
    assert F.fill_summary(p)["last step ended in"] == "checks or graph pass"


def test_last_build_table_counts_what_each_groups_last_build_was():
    lb7 = {"num_reqs": 1, "num_tokens": 16, "before_first_step": True, "since_previous_step": False,
           "buffer_as_left": True}
    lb6 = {"num_reqs": 8, "num_tokens": 128, "before_first_step": False, "since_previous_step": True,
           "buffer_as_left": True}
    p = {"session": "s", "engine": "e", "layout": {"builds_before_first_step": {"7": [[[32, 512], [1, 16]]]}},
         "steps": [{"step": 1, "mode": "PIECEWISE"},
                   *({"step": s, "mode": "FULL",
                      "schedules": {"6": {"n": 25, "same": True, "same_as_first_group_step": True, "last_build": lb6},
                                    "7": {"n": 25, "same": False, "same_as_first_group_step": False, "last_build": lb7}}}
                     for s in (2, 3)),
                   {"step": 4, "mode": "FULL", "schedules": {"6": {"n": 25, "same": True}}},   # before the ledger
                   {"step": 5, "mode": "FULL", "schedules": {"8": {"n": 25, "same": True, "last_build": None}}}]}
    t = F.last_build_table([p]).set_index("group")
    assert t.loc[7, "FULL steps"] == 2 and t.loc[7, "stale"] == 2 and t.loc[7, "built for (requests)"] == "1"
    assert t.loc[7, "built for (tokens)"] == "16" and t.loc[7, "as the first group's step schedule"] == 0
    assert t.loc[6, "as the first group's step schedule"] == 2
    assert t.loc[8, "no build recorded"] == 1 and t.loc[8, "built for (requests)"] == ""
    assert t.loc[7, "before the first step"] == 2 and t.loc[7, "buffer as the build left it"] == 2
    assert t.loc[6, "stale"] == 0 and t.loc[6, "since the previous step"] == 2 and t.loc[6, "FULL steps"] == 2
    assert F.builds_before_first_step(p, 7) == [[32, 512], [1, 16]] and F.builds_before_first_step(p, 6) is None
    assert F.last_build_table([{"steps": [{"step": 1, "mode": "FULL", "schedules": {"7": {"same": False}}}]}]).empty


def _builds_probe(lb7, extra7=None, hist=None, n_steps=2):
    lb6 = {"num_reqs": 8, "num_tokens": 128, "before_first_step": False, "since_previous_step": True,
           "buffer_as_left": True}
    s7 = {"n": 25, "same": False, "same_as_first_group_step": False, "last_build": lb7, **(extra7 or {})}
    hist = [[32 - i, 16 * (32 - i)] for i in range(32)] if hist is None else hist
    return {"layout": {"builds_before_first_step": {"7": [[[64, 1024]] + hist]}},
            "steps": [{"step": 1, "mode": "PIECEWISE"}] + [
                {"step": s, "mode": "FULL", "schedules": {
                    "6": {"n": 25, "same": True, "same_as_first_group_step": True, "last_build": lb6}, "7": s7}}
                for s in range(2, 2 + n_steps)]}


CAPTURED_1 = {"num_reqs": 1, "num_tokens": 16, "before_first_step": True, "since_previous_step": False,
              "buffer_as_left": True}


def test_build_predictions_hold_only_when_every_full_step_agrees():
    assert all(F.build_predictions(_builds_probe(CAPTURED_1), fix=False).values())
    wrong = F.build_predictions(_builds_probe({**CAPTURED_1, "num_reqs": 2}), fix=False)
    assert not wrong["(a) stale group: last written by the 1-request capture build, nothing since"]
    assert wrong["(c) fresh group: built every step"]
    unordered = [[32 - i, 16 * (32 - i)] for i in range(32)][::-1]
    assert not F.build_predictions(_builds_probe(CAPTURED_1, hist=unordered), fix=False)[
        "(b) stale group: its builds before the first step end with the FULL captures, largest first"]
    p = _builds_probe(CAPTURED_1)
    del p["steps"][-1]["schedules"]["7"]   # a FULL step without the group's record fails the prediction
    assert not F.build_predictions(p, fix=False)["(a) stale group: last written by the 1-request capture build, nothing since"]
    assert not any(F.build_predictions({"steps": [], "layout": {}}, fix=False).values())


def test_build_prediction_for_the_fix():
    refreshed = {**CAPTURED_1, "buffer_as_left": False}
    p = _builds_probe(refreshed, extra7={"same": True, "same_as_first_group_step": True})
    assert list(F.build_predictions(p, fix=True).values()) == [True]
    p = _builds_probe(CAPTURED_1, extra7={"same": True, "same_as_first_group_step": False})
    assert list(F.build_predictions(p, fix=True).values()) == [False]


# group 7's buffer as s38 recorded it on every stale read: the same 1-request schedule, but the entries FA3's prepare
# kernel leaves unwritten (its output is torch::empty) held 0x7FFF7FFF instead of s36/s37's 0, 31, 0
PAD38 = 0x7FFF7FFF
STALE38 = [128, PAD38, PAD38, PAD38, 1, PAD38, PAD38, PAD38, 2, PAD38, PAD38, PAD38, 0] + [0] * 84


def test_padding_is_what_a_one_request_schedule_leaves_unwritten():
    assert F.padding_1(STALE[:13]) == (0, 31, 0, 0, 0, 0, 0, 0, 0)
    assert F.padding_1(STALE38) == (PAD38,) * 9
    with pytest.raises(LabError, match="13"):
        F.padding_1([128, 0, 0])
    assert F.padding_1(STALE[:9]) == (0, 31, 0, 0, 0, 0, 0, 0, 0)   # trailing zeros dropped (stale_vectors)
    with pytest.raises(LabError, match="not a 1-request schedule"):
        F.padding_1(fresh(8))   # entries past the 13th written: another batch size's schedule


def test_a_schedule_the_model_refuses_is_kept_without_a_prediction():
    # 8 requests read s38's buffer: requests 1-3 get 0x7FFF7FFF splits, which coverage() refuses
    with pytest.raises(LabError, match="more than the 32"):
        F.coverage(STALE38[:25], fresh(8), 8)
    p = probe({2: {"m.layers.7.attn": tap([4, 5, 6, 7])}}, stale=STALE38[:25])
    rows = list(F.step_rows(p))
    assert len(rows) == 1 and rows[0]["predicted"] is None and "more than the 32" in rows[0]["not modelled"]
    assert rows[0]["unwritten"] == [4, 5, 6, 7]
    # a malformed record is not a limit of the model: it still raises
    bad = probe({2: {"m.layers.7.attn": tap([1])}}, stale=STALE38[:24])
    with pytest.raises(LabError, match="do not fit"):
        list(F.step_rows(bad))
    t = F.unwritten_table([p])
    assert t["match"].isna().all()
    s = F.fill_summary(p)
    # refused layer-steps count as stale but not as measured against a prediction
    assert (s["stale layer-steps"], s["not modelled"], s["unwritten measured"], s["unwritten as predicted"]) == (1, 1, 0, None)
    # a NaN there has no prediction to lie within
    q = probe({2: {"m.layers.7.attn": tap(None, [4])}}, stale=STALE38[:25])
    assert F.nan_origin(q)["within_unwritten"] is None


def test_unwritten_by_batch_groups_steps_by_what_was_measured_and_predicted():
    ok = list(range(1, 8))
    p = probe({2: {"m.layers.7.attn": tap(ok), "m.layers.15.attn": tap(ok)},
               3: {"m.layers.7.attn": tap(ok), "m.layers.15.attn": tap(ok)}})
    q = probe({2: {"m.layers.7.attn": tap([4, 5, 6, 7]), "m.layers.15.attn": tap([4, 5])}}, stale=STALE38[:25])
    q["session"] = "s38"
    t = F.unwritten_by_batch([p, q])
    assert len(t) == 2
    a, b = t.iloc[0], t.iloc[1]
    assert (a["session"], a["requests"], a["FULL steps"]) == ("s", 8, 2)
    assert a["unwritten (measured)"] == a["unwritten (predicted)"] == str(ok)
    assert a["padding read"] == str([0, 31, 0, 0, 0, 0, 0, 0, 0])
    # the two layers of the group disagree: both sets are listed, and the prediction says why there is none
    assert b["unwritten (measured)"] == "[4, 5]; [4, 5, 6, 7]" and b["unwritten (predicted)"].startswith("not modelled")
    plain = probe({2: {"m.layers.7.attn": tap(None)}})
    assert F.unwritten_by_batch([plain]).empty   # no fill: nothing measured


def test_stale_paddings_counts_reads_per_padding():
    ok = list(range(1, 8))
    p = probe({2: {"m.layers.7.attn": tap(ok)}, 3: {"m.layers.7.attn": tap(ok)}})
    assert F.stale_paddings(p) == {(0, 31, 0, 0, 0, 0, 0, 0, 0): 2}
    q = probe({2: {"m.layers.7.attn": tap(ok)}}, stale=fresh(8))   # an 8-request schedule: no padding to read
    assert F.stale_paddings(q) == {None: 1}
