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
    (None, 15, "must be a number"), (True, 15, "must be a number"), (float("nan"), 15, r"must be in \[1, 16\]"),
    (2.0, 0, "positive integer"), (2.0, 1.5, "positive integer"), (2.0, True, "positive integer")])
def test_bad_input_is_one_clear_error(length, k, msg):
    with pytest.raises(LabError, match=msg):
        acceptance.rates(length, k)


def test_numpy_numbers_are_numbers_and_the_conversions_are_vllms_own_text():
    np = pytest.importorskip("numpy")
    assert acceptance.rates(np.float64(6.0), np.int64(15)) == acceptance.rates(6.0, 15)
    for name in ("rates", "conditional"):
        assert acceptance._vllm(name).__code__.co_filename.startswith("<vllm 0.22.1 vllm/")


def test_logged_rates_are_read_from_the_stats_lines(tmp_path):
    log = tmp_path / "e.log"
    log.write_text("INFO SpecDecoding metrics: Mean acceptance length: 3.60, Accepted: 9 tokens, Per-position acceptance "
                   "rate: 1.000, 1.000, 0.600, 0.000, Avg Draft acceptance rate: 65.0%\nINFO other line\n")
    assert acceptance.logged_rates(str(log)) == [[1.0, 1.0, 0.6, 0.0]]
    with pytest.raises(LabError, match="cannot read the engine log"):
        acceptance.logged_rates(str(tmp_path / "missing.log"))


def test_the_recorded_runs_match_the_schedule(root):
    """vLLM's own counters over every completed measured DFlash run: at 6.0 every run of s29 says exactly 6 (the
    schedule has no spread there), elsewhere the schedule's mean lies inside the runs' range - for every mode but
    stock FULL, whose completed runs at 3.6 (s30, s31) reach far below it (2.69 at 8 in s31)."""
    runs = bench.load_bench(str(root / "data" / "bench" / "*.jsonl"))
    t = acceptance.measured_against_schedule(runs)
    assert set(t["k"]) == {15} and {1.86, 3.6} <= set(t["synthetic acceptance"])
    stock = t["mode"] == "DFlash FULL (stock)"
    for _, row in t[~stock].iterrows():
        assert row["measured lowest"] <= row["schedule mean"] + 1e-9 <= row["measured highest"] + 2e-9, row.to_dict()
    s36 = t[stock & (t["synthetic acceptance"] == 3.6)].iloc[0]
    assert s36["runs"] == 21 and s36["measured lowest"] < 2.69   # its runs at 8 in s31 (the per-cell table judges each)
    six = acceptance.measured_against_schedule(runs[runs["gpu_session"] == "2026-12-01-s29"])
    assert set(six["synthetic acceptance"]) == {6.0} and six["runs"].sum() == 36
    assert (six["measured lowest"] == 6.0).all() and (six["measured highest"] == 6.0).all()


def test_every_recorded_stats_line_prints_the_schedules_exact_positions(root):
    """Each DFlash engine log's SpecDecoding lines: the positions the schedule accepts always or never are printed as
    1.000 and 0.000 in every line - except in stock FULL's engines at 3.6 and 6.0 (s30, s31), whose lines show positions
    the schedule always accepts below 1.000; at 3.6 position 3 is the fractional one (rate 0.6), at 6.0 there is none."""
    t = acceptance.logs_against_schedule(bench.load_bench(str(root / "data" / "bench" / "*.jsonl")))
    printed = t[t["stats lines"] > 0]
    stock = printed["mode"] == "DFlash FULL (stock)"
    assert len(printed[~stock]) >= 14 and printed.loc[~stock, "exact in every line"].all()
    off = printed[stock & ~printed["exact in every line"].astype(bool)]
    assert set(off["gpu_session"]) == {"2026-12-01-s30", "2026-12-01-s31"} and set(off["synthetic acceptance"]) == {3.6, 6.0}
    assert len(off) == 4 and set(off.loc[off["gpu_session"] == "2026-12-01-s31", "synthetic acceptance"]) == {3.6}
    assert set(t.loc[t["synthetic acceptance"] == 3.6, "fractional position"]) == {3}
    six = t[t["synthetic acceptance"] == 6.0]
    assert len(six) >= 5 and (six["exact positions"] == "15 of 15").all() and six["fractional position"].isna().all()


def test_counters_below_the_schedule_are_counted_in_its_standard_errors():
    import pandas as pd

    bench_like = pd.DataFrame([
        {"outcome": "crash", "run_id": "s/c8/r0", "mode": "DFlash FULL (stock)", "concurrency": 8, "acceptance": 1.86,
         "num_speculative_tokens": 15, "acceptance_length": 1.12, "num_drafts": 1956, "gpu_session": "S"},
        {"outcome": "crash", "run_id": "s/c8/r1", "mode": "DFlash FULL (stock)", "concurrency": 8, "acceptance": 1.86,
         "num_speculative_tokens": 15, "acceptance_length": None, "num_drafts": None, "gpu_session": "S"},
        {"outcome": "ok", "run_id": "f/c8/r0", "mode": "DFlash FULL (fixed)", "concurrency": 8, "acceptance": 6.0,
         "num_speculative_tokens": 15, "acceptance_length": 6.0, "num_drafts": 500, "gpu_session": "S"}])
    t = acceptance.counted_against_schedule(bench_like)
    assert list(t["run_id"]) == ["s/c8/r0"]          # the crash without counters is left out, the ok run not asked for
    se = (0.86 * 0.14) ** 0.5 / 1956 ** 0.5
    assert t.loc[0, "standard errors"] == pytest.approx((1.12 - 1.86) / se, abs=0.05)
    ok = acceptance.counted_against_schedule(bench_like, outcomes=("ok",))
    assert ok.loc[0, "counted mean"] == 6.0 and ok["standard errors"].isna().all()   # no spread at an integer length
    runs_like = pd.DataFrame([{"outcome": "crash", "run_id": "server-stock/c32/r0", "mode": "server", "concurrency": 32,
                               "acceptance": 1.86, "num_speculative_tokens": 15, "gpu_session": "T",
                               "spec_decode_metrics": {"acceptance_length": 1.86, "num_drafts": 8667}}])
    assert acceptance.counted_against_schedule(runs_like).loc[0, "standard errors"] == 0


def test_the_recorded_crashes_at_8_counted_far_below_the_schedule_and_completed_runs_did_not(root):
    from dflash_lab import analysis

    runs = bench.load_bench(str(root / "data" / "bench" / "*.jsonl"))
    c8 = acceptance.counted_against_schedule(runs[runs["gpu_session"] == "2026-12-01-s26"])
    assert len(c8) == 3 and (c8["concurrency"] == 8).all() and (c8["standard errors"] < -20).all()
    server = acceptance.counted_against_schedule(analysis.load_runs(str(root / "data" / "runs" / "*.jsonl")))
    assert len(server) >= 5 and (server["concurrency"] == 32).all() and (server["standard errors"].abs() < 3).all()
    ok = acceptance.counted_against_schedule(runs, outcomes=("ok",))
    z = ok.loc[ok["path"] != "DFlash FULL (stock)", "standard errors"].dropna()
    assert len(z) >= 100 and abs(z.mean()) < 0.3 and z.abs().max() < 4
    # every completed run of the fixed FULL, PIECEWISE and eager engines at 6.0 counted exactly 6, none below
    rest = ok[(ok["path"] != "DFlash FULL (stock)")]
    assert not rest["below the schedule"].any() and (rest.loc[rest["synthetic acceptance"] == 6.0, "counted mean"] == 6.0).all()


def test_stock_full_lost_tokens_without_crashing_where_fixed_full_and_piecewise_did_not(root):
    """s30, one GPU session at 6.0: stock FULL's three measured runs at 8 counted 5.11 (about 0.89 tokens lost per
    request-step), where the fixed FULL and PIECEWISE engines counted the schedule's exact 6 in every run; at 3.6 stock
    counted 3.30 in both runs at 64."""
    t = acceptance.counters_by_cell(bench.load_bench(str(root / "data" / "bench" / "*.jsonl")))
    s30 = t[t["gpu_session"] == "2026-12-01-s30"].set_index(["path", "synthetic acceptance", "concurrency"])
    c8 = s30.loc[("DFlash FULL (stock)", 6.0, 8)]
    assert c8["below the schedule"] == "3 of 3" and c8["counted mean"] == "5.107-5.108"
    assert c8["tokens lost per request-step"] == pytest.approx(0.892, abs=0.001)
    for mode in ("DFlash FULL (fixed)", "DFlash PIECEWISE"):
        assert s30.loc[(mode, 6.0, 8), "below the schedule"] == "0 of 3" and s30.loc[(mode, 6.0, 8), "counted mean"] == "6.000"
    assert s30.loc[("DFlash FULL (stock)", 3.6, 64), "below the schedule"] == "2 of 2"
    assert [s30.loc[("DFlash FULL (stock)", 6.0, c), "below the schedule"] for c in (1, 4, 16, 64)] == ["0 of 3"] * 4
    # at 3.6, 32, stock sits 2.2-3.9 standard errors below: inside what the control reaches (3.1), so not judged a loss
    assert s30.loc[("DFlash FULL (stock)", 3.6, 32), "below the schedule"] == "0 of 5"


def test_seven_of_eight_requests_losing_a_token_every_step_is_what_stock_counted_at_6_and_8(root):
    """lossy_counts: k of 8 requests losing one token in every step. k = 0 is the fixed engines' 688 drafts at exactly
    6; k = 7 is 807 drafts at 5.1066, what s30's stock run r1 counted (r0 and r2: one request-step fewer); no other k
    comes near."""
    assert acceptance.lossy_counts(8, 0, 6.0, 512) == {"drafts counted": 688, "counted mean": 6.0}
    seven = acceptance.lossy_counts(8, 7, 6.0, 512)
    assert seven["drafts counted"] == 807 and seven["counted mean"] == pytest.approx(5.10657, abs=1e-5)
    runs = bench.load_bench(str(root / "data" / "bench" / "*.jsonl"))
    r1 = runs[(runs["gpu_session"] == "2026-12-01-s30") & (runs["run_id"] == "full-stock/c8/r1")].iloc[0]
    assert int(r1["num_drafts"]) == 807 and r1["acceptance_length"] == pytest.approx(seven["counted mean"], abs=1e-6)
    others = [acceptance.lossy_counts(8, k, 6.0, 512)["counted mean"] for k in (6, 8)]
    assert all(abs(x - r1["acceptance_length"]) > 0.1 for x in others)
    with pytest.raises(LabError, match="integer acceptance"):
        acceptance.lossy_counts(8, 7, 3.6, 512)
    with pytest.raises(LabError):
        acceptance.lossy_counts(8, 9, 6.0, 512)


def test_below_the_schedule_needs_its_spread_or_any_shortfall_at_an_integer_length():
    # beyond the control's widest gap (3.1 standard errors over 152 runs): 4, strictly
    assert acceptance.below(-4.5, 3.5, 3.6) and not acceptance.below(-3.9, 3.58, 3.6) and not acceptance.below(-4.0, 3.5, 3.6)
    assert not acceptance.below(2.0, 3.7, 3.6) and not acceptance.below(None, 6.0, 6.0)
    assert acceptance.below(None, 5.989, 6.0) and not acceptance.below(None, 6.0, 6.0)
    assert acceptance.below(float("nan"), 5.9, 6.0)


def test_the_stock_prediction_is_checked_once_stock_runs_at_an_acceptance_that_never_rejects_every_draft():
    import pandas as pd

    planned = pd.DataFrame({"acceptance": [1.86, 3.6, 6.0], "mode": ["DFlash FULL (stock)"] * 3, "concurrency": [8] * 3})
    run = lambda acc, outcome, c=8: {"mode": "DFlash FULL (stock)", "acceptance": acc, "outcome": outcome,
                                     "crashed": outcome == "crash", "concurrency": c}
    runs = pd.DataFrame([run(1.86, "crash"), run(1.86, "ok", 4), run(3.6, "ok"), run(3.6, "ok", 32),
                         run(6.0, "crash", 16), run(6.0, "ok"), run(6.0, "timeout")])
    runs["num_speculative_tokens"] = 15
    runs["num_drafts"] = 1000
    runs["run_id"] = [f"r{i}" for i in range(len(runs))]
    runs["acceptance_length"] = [None, 1.86, 3.6, 3.2, None, 5.9, None]   # 3.6 at 32: lost tokens; 6.0 at 8 too
    t = acceptance.stock_prediction(runs, planned).set_index("synthetic acceptance")
    assert t.loc[3.6, "completed runs counting below the schedule"] == "1 of 2 (at 32)"
    assert t.loc[6.0, "completed runs counting below the schedule"] == "1 of 1 (at 8)"
    assert t.loc[1.86, "completed runs counting below the schedule"] == "0 of 1"
    assert t.loc[1.86, "prediction"].startswith("crash possible") and t.loc[1.86, "stock runs"] == "1/2 crashed"
    assert t.loc[1.86, "prediction holds"] is None                      # "possible" is not a prediction a run can fail
    assert t.loc[3.6, "prediction holds"] is True and t.loc[3.6, "stock runs"] == "0/2 crashed"
    assert t.loc[6.0, "prediction holds"] is False and t.loc[6.0, "crashed at"] == "16"
    none = acceptance.stock_prediction(runs.iloc[0:0], planned).set_index("synthetic acceptance")
    assert (none["stock runs"] == "not run yet").all() and none["prediction holds"].isna().all()


def test_a_stats_line_off_the_schedule_or_of_another_k_is_caught(tmp_path):
    import pandas as pd

    def log(name, *rates):
        p = tmp_path / name
        p.write_text("".join(f"SpecDecoding metrics: Per-position acceptance rate: {', '.join(f'{x:.3f}' for x in r)}, "
                             "Avg Draft acceptance rate: 10.0%\n" for r in rates))
        return str(p)

    good = log("good.log", [1, 1, 0.61, 0], [1, 1, 0.58, 0])
    off = log("off.log", [1, 0.97, 0.6, 0])           # position 2 must be 1.000 at 3.6
    runs = pd.DataFrame([{"mode": "DFlash FULL (fixed)", "engine_log": p, "num_speculative_tokens": 4, "acceptance": 3.6,
                          "gpu_session": "S"} for p in (good, off)])
    t = acceptance.logs_against_schedule(runs).set_index("engine log")
    assert bool(t.loc["/".join(good.split("/")[-2:]), "exact in every line"])
    assert not bool(t.loc["/".join(off.split("/")[-2:]), "exact in every line"])
    assert t.loc["/".join(good.split("/")[-2:]), "logged range"] == "0.580-0.610"
    assert t.loc["/".join(good.split("/")[-2:]), "fractional position"] == 3
    with pytest.raises(LabError, match="prints 4 positions, the runs say k=15"):
        acceptance.logs_against_schedule(runs.assign(num_speculative_tokens=15))


def test_the_counter_figure_shows_every_run_and_stock_falling_below(root):
    """Notebook 05's counter figure: one panel per recorded acceptance, a point per DFlash run with counters; stock
    FULL's measured runs at 3.6 and 8 (s31) sit about 0.9 tokens per request-step below the schedule, the other modes'
    on it; no run with counters is an error, not an empty figure."""
    import matplotlib
    import pandas as pd

    matplotlib.use("Agg")
    runs = bench.load_bench(str(root / "data" / "bench" / "*.jsonl"))
    dflash = runs[runs["mode"] != "no speculation"]
    fig = acceptance.plot_counted_gap(dflash)
    axes = [a for a in fig.axes if a.get_title()]
    assert [a.get_title() for a in axes] == [f"synthetic acceptance {a}" for a in ("1.86", "3.6", "6")]
    ys = [y for line in axes[1].get_lines() if line.get_linestyle() == "None" for y in line.get_ydata()]
    n36 = len(acceptance.counted_against_schedule(dflash[dflash["acceptance"] == 3.6], outcomes=("ok", "crash")))
    assert len(ys) == n36 > 100   # every run once (the zero line has a line style)
    assert sum(y < -0.8 for y in ys) >= 3 and min(ys) > -1.0
    with pytest.raises(LabError, match="no DFlash run with vLLM's acceptance counters"):
        acceptance.plot_counted_gap(pd.DataFrame(columns=runs.columns))
