"""The fix-verification tables, on the recorded GPU data and on small hand-made frames."""

from pathlib import Path

import pandas as pd
import pytest

from dflash_lab import analysis, divergence as D, verification as V
from dflash_lab.errors import LabError

SESSION = "2026-11-30-s14"


@pytest.fixture(scope="module")
def df():
    return analysis.load_runs()


def test_session_counts_and_verdict(df):
    t = V.session_table(df, SESSION)
    v = V.verdict(t)
    assert v["stock_crashed"] >= 1 and v["fix_runs"] == {16: 3, 32: 10, 64: 3} and v["meets_counts"]
    # the canary run and the probe runs are instruments, not controls or fix runs
    assert t[t["what"].str.startswith("stock control")]["runs"].sum() == 1


def test_verdict_fails_without_a_crashing_control():
    t = pd.DataFrame([{"what": "stock control (FULL_AND_PIECEWISE)", "concurrency": 32, "runs": 3, "ok": 3, "crashed": 0},
                      *({"what": "fix 2 (FULL_AND_PIECEWISE)", "concurrency": c, "runs": n, "ok": n, "crashed": 0}
                        for c, n in ((16, 3), (32, 10), (64, 3)))])
    assert not V.verdict(t)["meets_counts"]
    t.loc[0, ["ok", "crashed"]] = [0, 3]
    assert V.verdict(t)["meets_counts"]
    t.loc[2, ["ok", "crashed"]] = [9, 1]
    assert not V.verdict(t)["meets_counts"]


def test_probe_table_stock_vs_fix(df):
    pt = V.probe_table(df).set_index("engine")
    stock, fix = pt.loc["stock-probe.a1"], pt.loc["fix2-probe.a1"]
    assert stock["fix"] == "stock" and stock["FULL steps diverging"] == stock["FULL steps"] > 0
    assert stock["first layer written differently"] == "L8 gdn" and stock["last layer written identically"] == "L7 attn"
    assert fix["fix"].startswith("fix 2") and fix["FULL steps"] > 800 and fix["FULL steps diverging"] == 0
    assert fix["max |output diff|"] == 0.0 and fix["concurrencies"] == "2, 16, 32"


def test_canary_table_names_group_7(df):
    c = V.canary_table(df)
    row = c[c["fix"] == "stock"].iloc[0]
    assert (row["field"], row["group"], row["step"], row["concurrency"]) == ("attn.scheduler_metadata", 7, 2, 2)


def test_canary_regex_reads_the_longer_message():
    m = V.CANARY_RE.search("CanaryError: dflash-lab canary: step 5, attn.scheduler_metadata, row 3, value 0, "
                           "expected 7, 12 entries differ (KV-cache group 7's ...)")
    assert m.groups() == ("5", "attn.scheduler_metadata", "3", "0")


def test_warm_runs_drop_the_first_run_of_each_engine_start(df):
    w = V.warm_runs(df[df["gpu_session"] == SESSION])
    fix32 = w[(w["concurrency"] == 32).to_numpy() & [V.is_fix2(r) for _, r in w.iterrows()]]
    assert len(fix32) == 9 and "fix2-b/c32/r0" not in set(fix32["run_id"])
    tp = V.throughput_table(df, SESSION).set_index("mode")
    assert tp.loc["stock, PIECEWISE", "warm runs"] == 1


def test_deadline_cut_runs_are_not_counted_as_runs():
    base = {"target_name": "t", "tensor_parallel_size": 1, "acceptance": 1.86, "cell": "c", "concurrency": 32,
            "file": "f", "crashed": False}
    df = pd.DataFrame([{**base, "outcome": "ok", "error": None},
                       {**base, "outcome": "timeout", "error": "runner deadline reached during the run"},
                       {**base, "outcome": "timeout", "error": "run exceeded 240 s"}])
    row = analysis.crash_table(df).iloc[0]
    assert (row["runs"], row["cut_by_deadline"], row["timeouts"]) == (2, 1, 1)


def test_instruments_are_named_and_recovered_from_the_matrix(df):
    # the CUDA_LAUNCH_BLOCKING=1 runs predate the runner's 'env' field: their matrix (named in the meta) gives it
    blk = df[df["file"] == "2026-11-30_h200_localize-blocking-tp1.jsonl"]
    assert set(blk["instruments"]) == {"launch hook, CUDA_LAUNCH_BLOCKING=1"}
    assert "CUDA_LAUNCH_BLOCKING=1" in blk["cell"].iloc[0]
    plain = df[(df["run_id"] == "stock-control/c32/r0") & (df["file"] == "2026-11-30_h200_verify-fix-a-tp1.jsonl")]
    assert list(plain["instruments"]) == ["none"]
    dumped = df[(df["run_id"] == "stock-control/c32/r0") & (df["file"] == "2026-11-30_h200_discriminate2-a-tp1.jsonl")]
    assert list(dumped["instruments"]) == ["core dump on"]
    assert analysis.instruments({"hook_dir": float("nan"), "coredump": True, "env": {"A": "1"}}) == ["core dump on", "A=1"]


def test_canary_stops_are_not_crashes(df):
    c = df[df["canary"] == True]
    assert len(c) and not c["crashed"].any() and c["stopped_by_canary"].all()
    ct = analysis.crash_table(df)
    row = ct[ct["cell"].str.contains("canaries raise")].iloc[0]
    assert (row["runs"], row["crashed"], row["stopped_by_canary"]) == (0, 0, 1)


def test_stock_full_breakdown(df):
    s = analysis.stock_full(df)
    assert not s["fix"].any() and not (s["probe"] == True).any() and not (s["canary"] == True).any()
    # TP=1 (offline and server): at TP=2, 32 crashed 1 of 5 (s27; tests/test_crashstates.py)
    s32 = s[(s["concurrency"] == 32) & (s["tensor_parallel_size"] == 1) & ~s.apply(analysis.is_deadline_cut, axis=1)]
    text = analysis.breakdown(s32)
    assert text.startswith(f"{len(s32)}/{len(s32)} crashed (") and "plain" in text and "with core dump on" in text


def test_position_matched_pairs_runs_by_their_place_after_the_engine_start(df):
    pm = V.position_matched(df, SESSION)
    assert list(pm["position after engine start"]) == [0, 1]
    assert pm.iloc[1]["fix 2 FULL tok/s"] == 1451.0 and pm.iloc[1]["PIECEWISE tok/s"] == 1572.8


def test_record_outputs_writes_tokens_and_digests(tmp_path):
    from dflash_lab.worker import record_outputs

    d = record_outputs(str(tmp_path / "o"), "e/c2/r0", [[1, 2, 3], [1, 2, 3], [4]])
    assert d[0] == d[1] != d[2] and len(d[0]) == 16
    saved = __import__("json").loads((tmp_path / "o" / "e_c2_r0.json").read_text())
    assert saved["token_ids"][2] == [4] and saved["digests"] == d


def test_output_agreement_pairs_full_runs_with_the_reference_mode():
    base = {"gpu_session": "S", "outcome": "ok", "concurrency": 2, "round": 0, "temperature": 0.0,
            "spec_method": "dflash", "fix_parts": None}
    df = pd.DataFrame([
        {**base, "run_id": "fix/c2/r0", "cudagraph_mode": "FULL_AND_PIECEWISE", "fix": True,
         "fix_parts": ["fa3_schedule_refresh"], "output_digests": ["a", "b"]},
        {**base, "run_id": "stock/c2/r0", "cudagraph_mode": "FULL_AND_PIECEWISE", "fix": False, "output_digests": ["a", "x"]},
        {**base, "run_id": "pw/c2/r0", "cudagraph_mode": "PIECEWISE", "fix": False, "output_digests": ["a", "b"]},
        {**base, "run_id": "pw/c2/r0-hot", "cudagraph_mode": "PIECEWISE", "fix": False, "temperature": 0.7,
         "output_digests": ["q", "q"]},
    ])
    a = V.output_agreement(df, "S").set_index("run")
    assert a.loc["fix/c2/r0", "identical requests"] == "2/2" and a.loc["fix/c2/r0", "all identical"]
    assert a.loc["stock/c2/r0", "identical requests"] == "1/2" and not a.loc["stock/c2/r0", "all identical"]
    assert (a["reference run"] == "pw/c2/r0").all()


def test_warm_up_is_the_first_run_of_the_engine_not_of_a_concurrency():
    base = {"file": "f", "engine_id": "e", "attempt": 1, "outcome": "ok", "probe": False, "canary": False}
    d = pd.DataFrame([{**base, "run_id": "e/c2/r0", "concurrency": 2}, {**base, "run_id": "e/c32/r0", "concurrency": 32},
                      {**base, "run_id": "e/c32/r1", "concurrency": 32}, {**base, "run_id": "e/c32/r2", "concurrency": 32,
                                                                          "attempt": 2}])
    d["position"] = analysis.engine_positions(d)
    assert list(d["position"]) == [0, 1, 2, 0]  # a restart (attempt 2) starts over
    assert list(V.warm_runs(d[d["concurrency"] == 32])["run_id"]) == ["e/c32/r0", "e/c32/r1"]


S15 = "2026-11-30-s15"


def test_counts_come_from_the_session_that_meets_them_not_the_latest(df):
    # s15 (tokens and throughput) has fix-2 runs at 32 only: it must not replace s14 as the counts session
    assert S15 in V.sessions_with_fix2(df) and not V.verdict(V.session_table(df, S15))["meets_counts"]
    # s22 (the fix at 8-28) is later still and has no run at 32: it does not replace s14 either
    assert "2026-11-30-s22" in V.sessions_with_fix2(df)
    assert not V.verdict(V.session_table(df, "2026-11-30-s22"))["meets_counts"]
    # s35 (fix 2 under the step probe at 8 and 64, one run each): it does not replace s14 either
    assert not V.verdict(V.session_table(df, "2026-12-01-s35"))["meets_counts"]
    # s36, s37 and s38 are the latest, and every run of them was instrumented (attention taps; s38 also the build
    # ledger): empty tables, no verdict
    late = ["2026-12-01-s36", "2026-12-01-s37", "2026-12-02-s38"]
    assert V.sessions_with_fix2(df)[-3:] == late
    for x in late:
        t = V.session_table(df, x)
        assert t.empty and "what" in t and not V.verdict(t)["meets_counts"]
    assert V.counts_session(df) == SESSION
    # the stock run at concurrency 2 records outputs: the control is the crash configuration only
    v15 = V.verdict(V.session_table(df, S15))
    assert (v15["stock_crashed"], v15["stock_runs"]) == (1, 1)


def test_end_to_end_tokens_against_piecewise_on_the_recorded_session(df):
    assert S15 in V.output_sessions(df) and SESSION not in V.output_sessions(df)
    ag = V.output_agreement(df, S15)
    fx = ag[ag["fix"].str.startswith("fix 2")]
    assert sum(int(x.split("/")[0]) for x in fx["identical requests"]) == 128
    assert sum(int(x.split("/")[1]) for x in fx["identical requests"]) == 130
    assert V.identical_totals(ag) == (128, 130) and V.identical_totals(ag.iloc[0:0]) == (0, 0)
    assert (ag["distinct outputs in the reference run"] >= 2).all()  # identical prompts, several outputs: noise floor
    div = V.token_divergence(df, S15)
    assert len(div) == 2 and set(div["first differing output position"]) == {1}
    # FULL's output is one the PIECEWISE engine also gives that prompt at other batch slots of the same run
    assert div["FULL's output occurs in the reference run"].all() and (div["reference requests with FULL's output"] > 20).all()
    assert list(div["request"]) == [2, 2]  # the same batch slot both times: repeatable, not random


def test_token_divergence_finds_the_first_differing_position(tmp_path):
    import json

    stem = "2099-01-01_x"
    for eng, toks in (("full", [[1, 2, 3], [1, 9, 9]]), ("pw", [[1, 2, 3], [1, 2, 3]])):
        d = tmp_path / "gpu" / stem / f"{eng}.a1.outputs"
        d.mkdir(parents=True)
        (d / f"{eng}_c2_r0.json").write_text(json.dumps({"run": f"{eng}/c2/r0", "token_ids": toks}))
    base = {"gpu_session": "s", "outcome": "ok", "concurrency": 2, "round": 0, "temperature": 0.0,
            "file": stem + ".jsonl", "fix": False}
    df = pd.DataFrame([dict(base, run_id="full/c2/r0", engine_id="full", cudagraph_mode="FULL_AND_PIECEWISE",
                            output_digests=["a", "b"]),
                       dict(base, run_id="pw/c2/r0", engine_id="pw", cudagraph_mode="PIECEWISE", output_digests=["a", "a"])])
    div = V.token_divergence(df, "s", data_dir=str(tmp_path))
    assert len(div) == 1 and div.iloc[0]["request"] == 1 and div.iloc[0]["first differing output position"] == 1
    assert (div.iloc[0]["token (FULL)"], div.iloc[0]["token (reference)"]) == (9, 2)
    assert not div.iloc[0]["FULL's output occurs in the reference run"]


def _greedy_frame(tmp_path, runs):
    """Run lines and their recorded outputs: runs = [(engine, mode, round, token lists, logprob lists, drafts)]."""
    import hashlib
    import json

    stem = "2099-01-01_y"
    rows = []
    for eng, mode, rnd, toks, lps, drafts in runs:
        d = tmp_path / "gpu" / stem / f"{eng}.a1.outputs"
        d.mkdir(parents=True, exist_ok=True)
        rid = f"{eng}/c{len(toks)}/greedy-r{rnd}"
        (d / (rid.replace("/", "_") + ".json")).write_text(json.dumps({"run": rid, "token_ids": toks, "logprobs": lps}))
        rows.append({"gpu_session": "s", "outcome": "ok", "concurrency": len(toks), "round": rnd, "temperature": 0.0,
                     "file": stem + ".jsonl", "fix": mode != "PIECEWISE", "fix_parts": None, "spec_method": "dflash",
                     "run_id": rid, "engine_id": eng, "attempt": 1, "cudagraph_mode": mode,
                     "spec_decode_metrics": {"num_drafts": drafts},
                     "output_digests": [hashlib.sha1(json.dumps(t).encode()).hexdigest()[:16] for t in toks]})
    return pd.DataFrame(rows)


def test_greedy_pair_evidence_rounds_and_output_forms(tmp_path):
    a, b, c = [5, 5, 9, 9], [5, 9, 9, 9], [5, 7, 7, 7]
    la = [-0.1, -0.2, -0.3, -0.4]
    full, pw = "FULL_AND_PIECEWISE", "PIECEWISE"
    df = _greedy_frame(tmp_path, [
        ("fx", full, 0, [a, b, b], [la, [-0.1, -0.25, -0.3, -0.4], la], 100),
        ("fx", full, 1, [b, b, b], [la, la, la], 101),
        ("pw", pw, 0, [b, b, a], [[-0.1005, -0.2, -0.3, -0.4], la, la], 104),
        ("pw", pw, 1, [b, c, b], [la, la, la], 101)])
    ev = V.pair_evidence(df, "s", data_dir=str(tmp_path)).set_index("run")
    r0 = ev.loc["fx/c3/greedy-r0"]
    assert r0["identical requests"] == "1/3" and (r0["drafts (FULL)"], r0["drafts (reference)"]) == (100, 104)
    assert r0["differing requests part at"] == "1" and r0["tokens there (FULL/reference)"] == "5/9, 9/5"
    # slots drawing independently: FULL gives a 1/3 and b 2/3, the reference a 1/3 and b 2/3: (1/9 + 4/9) x 3
    assert r0["identical if slots drew independently"] == pytest.approx(5 / 3, abs=0.01)
    # along the common prefixes (request 1 whole: 0.05 at position 1; request 0 and 2 only position 0: 0.0005)
    assert r0["max |dlogprob| vs reference"] == pytest.approx(0.05)
    assert r0["floor within the FULL run"] == pytest.approx(0.05) and r0["floor within the reference run"] == pytest.approx(0.0005)
    r1 = ev.loc["fx/c3/greedy-r1"]
    assert r1["identical requests"] == "2/3" and r1["tokens there (FULL/reference)"] == "9/7"
    # a run line without vLLM's counters: no KeyError, its drafts not recorded
    df2 = df.copy()
    df2.loc[df2["run_id"] == "pw/c3/greedy-r0", "spec_decode_metrics"] = None
    assert pd.isna(V.pair_evidence(df2, "s", data_dir=str(tmp_path)).set_index("run").loc["fx/c3/greedy-r0",
                                                                                          "drafts (reference)"])
    assert len(V.pair_evidence(df2.drop(columns="spec_decode_metrics"), "s", data_dir=str(tmp_path))) == 2
    # rounds of one engine against each other: the repeatability floor (greedy runs only)
    hot = df[df["run_id"] == "fx/c3/greedy-r1"].assign(run_id="fx/c3/r5", round=5, temperature=0.7)
    ra = V.round_agreement(pd.concat([df, hot], ignore_index=True), "s").set_index("engine")
    assert ra.loc["fx.a1", "identical requests"] == "2/3" and ra.loc["pw.a1", "identical requests"] == "1/3"
    assert ra.loc["pw.a1", "mode"] == "stock, PIECEWISE" and len(ra) == 2
    # what each slot emitted at position 1, with the target's log-probability of it
    lp = V.logprobs_at(df, "s", data_dir=str(tmp_path))
    assert set(zip(lp["token"], lp["log-probability"], lp["requests"])) == {(9, -0.2, 8), (5, -0.2, 2), (9, -0.25, 1),
                                                                          (7, -0.2, 1)}
    assert set(lp["tokens before it"]) == {"5"}
    # each run's distinct outputs as runs of one token, most frequent first, with their slots
    f = V.output_forms(df, "s", data_dir=str(tmp_path))
    f0 = f[f["run"] == "fx/c3/greedy-r0"]
    assert list(f0["output"]) == ["5x1 9x3", "5x2 9x2"] and list(f0["slots"]) == ["1, 2", "0"]
    assert set(f0["forms"]) == {2} and f[f["run"] == "fx/c3/greedy-r1"]["forms"].iloc[0] == 1
    assert "5x1 7x3" in set(f["output"])
    # nothing recorded: empty tables with their columns
    none = df.assign(gpu_session="t")
    for t in (V.pair_evidence(none, "s"), V.round_agreement(none, "s"), V.output_forms(none, "s"),
              V.logprobs_at(none, "s")):
        assert t.empty and len(t.columns)


def test_draft8_fix_outputs_on_the_recorded_session():
    # s72 (draft8-fix-c32-tp1): the greedy pairs fell short of the predicted 30 of 32; what the tokens show
    d8 = analysis.load_runs(published_draft=True)
    ev = V.pair_evidence(d8, "2026-12-06-s72")
    assert sorted(int(x.split("/")[0]) for x in ev["identical requests"]) == [21, 23, 26]
    assert set(ev["differing requests part at"]) == {"1"}
    # at chance: what slots drawing independently would give (s15's aligned draws gave 31-32 against ~22-26)
    assert (abs(ev["identical requests"].str.split("/").str[0].astype(int)
                - ev["identical if slots drew independently"]) < 1).all()
    s15 = V.pair_evidence(analysis.load_runs(), "2026-11-30-s15")
    s15 = s15[s15["identical requests"].str.endswith("/32")]
    assert (s15["identical if slots drew independently"] < 27).all() and (s15["drafts (FULL)"] - s15["drafts (reference)"]).abs().max() <= 1
    lp = V.logprobs_at(d8, "2026-12-06-s72")
    assert list(zip(lp["token"], lp["log-probability"], lp["requests"])) == [(130155, -12.43525, 164), (201, -12.05768, 28)]
    ra = V.round_agreement(d8, "2026-12-06-s72")
    assert len(ra) == 6 and set(ra["concurrency"]) == {32}
    f = V.output_forms(d8, "2026-12-06-s72")
    assert f["run"].nunique() == 6 and f.groupby("run")["requests"].sum().eq(32).all()


def test_record_outputs_keeps_logprobs_and_sampled_logprobs_picks_the_sampled_token(tmp_path):
    import json
    from types import SimpleNamespace as NS

    from dflash_lab.worker import record_outputs, sampled_logprobs

    c = NS(token_ids=[7, 8], logprobs=[{7: NS(logprob=-0.5), 3: NS(logprob=-0.1)}, {8: NS(logprob=-2.0)}])
    assert sampled_logprobs(c) == [-0.5, -2.0]
    assert sampled_logprobs(NS(token_ids=[1], logprobs=None)) == []
    record_outputs(str(tmp_path), "e/c1/r0", [[7, 8]], [[-0.5, -2.0]])
    assert json.loads((tmp_path / "e_c1_r0.json").read_text())["logprobs"] == [[-0.5, -2.0]]


def test_logprob_agreement_compares_the_common_prefix_against_each_engines_noise(tmp_path):
    import json

    stem = "2099-01-02_x"
    recs = {"full": ([[1, 2, 3], [1, 2, 5]], [[-1.0, -2.0, -3.0], [-1.0, -2.25, -9.0]]),
            "pw": ([[1, 2, 3], [1, 2, 3]], [[-1.0, -2.5, -3.0], [-1.0, -2.5, -3.0]])}
    for eng, (toks, lps) in recs.items():
        d = tmp_path / "gpu" / stem / f"{eng}.a1.outputs"
        d.mkdir(parents=True)
        (d / f"{eng}_c2_r0.json").write_text(json.dumps({"run": f"{eng}/c2/r0", "token_ids": toks, "logprobs": lps}))
    base = {"gpu_session": "s", "outcome": "ok", "concurrency": 2, "round": 0, "temperature": 0.0,
            "file": stem + ".jsonl", "fix": False, "spec_method": "dflash", "fix_parts": None}
    df = pd.DataFrame([dict(base, run_id="full/c2/r0", engine_id="full", cudagraph_mode="FULL_AND_PIECEWISE",
                            output_digests=["a", "b"]),
                       dict(base, run_id="pw/c2/r0", engine_id="pw", cudagraph_mode="PIECEWISE", output_digests=["a", "a"])])
    r = V.logprob_agreement(df, "s", data_dir=str(tmp_path)).iloc[0]
    # request 0: 3 positions, max 0.5; request 1: tokens part at position 2, so 2 positions, max 0.25
    assert r["positions compared"] == 5 and r["max |dlogprob| vs reference"] == 0.5
    assert (r["positions within the FULL run"], r["max |dlogprob| within the FULL run"]) == (2, 0.25)
    assert (r["positions within the reference run"], r["max |dlogprob| within the reference run"]) == (3, 0.0)
    # runs recorded before log-probabilities existed are left out, not compared as zero
    assert V.logprob_agreement(analysis.load_runs(), S15).empty


def test_session_labels_sort_naturally():
    labels = ["2026-11-30-s10", "2026-11-30-s9", "2026-12-01-s1"]
    assert sorted(labels, key=V.session_key) == ["2026-11-30-s9", "2026-11-30-s10", "2026-12-01-s1"]


def test_a_nan_logprob_is_never_read_as_agreement():
    import math

    n, w = V._prefix_logprob_diff([1, 2], [-1.0, float("nan")], [1, 2], [-1.0, -2.0])
    assert n == 2 and math.isnan(w)
    assert math.isnan(V._within_run([[1, 2], [1, 2], [1, 2]], [[-1.0, -2.0], [-1.0, float("nan")], [-1.0, -2.0]])[1])


def test_fix_where_stock_crashes():
    """The fix's runs beside stock at the same concurrency (s21: stock completes at 16, so the fix's 3/3 there is no
    evidence about the crash); s22 ran the fix and part 1 alone where stock crashes below 32, after stock controls at 8
    and 20 that crashed."""
    from dflash_lab import analysis, verification

    t = verification.fix_where_stock_crashes(analysis.load_runs())
    f2 = t[t["fix"] == "fix 2 (all parts)"].set_index("concurrency")
    assert f2.loc[32, "stock there"] == "crashes" and f2.loc[64, "stock there"] == "crashes"
    assert f2.loc[16, "stock there"] == "completes" and f2.loc[16, "fix completed / runs"] == "3/3"
    assert f2.loc[32, "fix completed / runs"] == "14/14" and "2026-11-30-s14" in f2.loc[32, "sessions with a crashed stock control"]
    for c in (8, 20, 24, 28):
        assert f2.loc[c, "stock there"] == "crashes" and f2.loc[c, "fix completed / runs"] == "3/3"
        assert f2.loc[c, "sessions with a crashed stock control"] == "2026-11-30-s22"
    p1 = t[t["fix"] == "part 1 alone"].set_index("concurrency")
    assert list(p1.index) == [8, 20, 32] and (p1["fix completed / runs"] == "3/3").all()
    assert (p1["stock there"] == "crashes").all()


def test_session_table_compares_stock_and_fix_at_one_acceptance():
    import pandas as pd
    from dflash_lab import analysis, verification

    df = analysis.load_runs()
    s14 = df[df["gpu_session"] == "2026-11-30-s14"].copy()
    other = s14.copy()
    other["acceptance"] = 8.8                     # the same runs at another acceptance: never paired with 1.86
    both = pd.concat([s14, other], ignore_index=True)
    assert verification.session_table(both, "2026-11-30-s14").equals(verification.session_table(s14, "2026-11-30-s14"))
    at88 = verification.session_table(both, "2026-11-30-s14", acceptance=8.8)
    assert verification.verdict(at88)["fix_runs"] == verification.verdict(verification.session_table(s14, "2026-11-30-s14"))["fix_runs"]


def test_standard_where_stock_crashes():
    """The standard moved to where stock crashes: met at 32 (s14 + s15, each with a crashed control) and 64, and since s22
    at 8 and 20-28 too; without s22 (the data before it) 8 is open, and a fix run from a session without a crashed stock
    control does not count."""
    import pandas as pd
    from dflash_lab import analysis, verification

    df = analysis.load_runs()
    t = verification.standard_where_stock_crashes(df).set_index("concurrency")
    assert list(t.index) == [8, 20, 24, 28, 32, 64]
    assert t.loc[32, "met"] and t.loc[32, "needed"] == 10 and t["met"].all()
    assert t.loc[8, "fix runs"] == 3 and t.loc[8, "sessions"] == "2026-11-30-s22"
    df = df[df["gpu_session"] != "2026-11-30-s22"]      # the data before s22: nothing of the fix at 8
    t = verification.standard_where_stock_crashes(df).set_index("concurrency")
    assert not t.loc[8, "met"] and t.loc[8, "fix runs"] == 0 and t.loc[8, "sessions"] == "-"
    # three fix runs at 8 in a session without any stock run: not counted
    f = df[(df["gpu_session"] == "2026-11-30-s14") & (df["fix"] == True) & (df["concurrency"] == 16)].copy()
    f["concurrency"], f["gpu_session"] = 8, "2026-11-30-s99"
    assert not verification.standard_where_stock_crashes(pd.concat([df, f], ignore_index=True)).set_index("concurrency").loc[8, "met"]
    f["gpu_session"] = "2026-11-30-s14"                # the same runs in a session whose control crashed: counted
    t2 = verification.standard_where_stock_crashes(pd.concat([df, f], ignore_index=True)).set_index("concurrency")
    assert t2.loc[8, "met"] and t2.loc[8, "fix runs"] == 3


def test_rows_where_keeps_the_columns_of_an_empty_frame():
    from dflash_lab import analysis

    df = analysis.load_runs()
    kept = analysis.rows_where(df, lambda r: r["concurrency"] == 12)
    assert len(kept) == (df["concurrency"] == 12).sum() > 0 and list(kept.columns) == list(df.columns)
    empty = analysis.rows_where(df.iloc[:0], lambda r: True)
    assert len(empty) == 0 and list(empty.columns) == list(df.columns)
    assert len(analysis.rows_where(df, lambda r: False)) == 0


def _fill_line(file, engine, c, taps, fix=False, crashed=False):
    return {"file": file, "matrix": "probe-fill-tp1", "engine_id": engine, "attempt": 1, "concurrency": c,
            "probe_taps": taps, "probe_fill_layers": [7] if taps in ("nan", "zero") else None, "fix": fix,
            "crashed": crashed, "outcome": "crash" if crashed else "ok", "error": "CUDA error" if crashed else None,
            "gpu_session": "s", "spec_decode_metrics": None if crashed else {"acceptance_length": 1.864}}


def test_fill_table_puts_each_outcome_beside_its_prediction():
    from tests.test_fa3sched import probe, tap

    ok = list(range(1, 8))
    df = pd.DataFrame([_fill_line("f.jsonl", "nan8", 8, "nan", crashed=True), _fill_line("f.jsonl", "zero8", 8, "zero"),
                       _fill_line("f.jsonl", "fixnan8", 8, "nan", fix=True), _fill_line("f.jsonl", "plain8", 8, "1"),
                       _fill_line("g.jsonl", "x", 8, "1")])
    probes = []
    for eng, t in (("nan8", tap(ok, ok)), ("zero8", tap(ok)), ("fixnan8", tap([])), ("plain8", tap(None))):
        p = probe({2: {"m.layers.7.attn": t}})
        p.update(session="f", engine=f"{eng}.a1")
        probes.append(p)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(V, "untapped_outcome", lambda df, c: "crash")
        t = V.fill_table(df, probes).set_index("engine")
    # plain8 has no pre-fill: its prediction is what untapped stock did there (patched: crashed), and it completed
    assert list(t["predicted"]) == ["crash", "ok", "ok", "crash"] and list(t["outcome"]) == ["crash", "ok", "ok", "ok"]
    assert t.loc["plain8", "pre-fill"] == "none" and t.loc["plain8", "fill layers"] == ""
    # the strata: stock only (the fix completes whatever the fill), one per concurrency
    assert V.fill_strata(t.reset_index()) == [(8, 1, 1, 1, 3)]
    assert t.loc["nan8", "first NaN step"] == 2 and t.loc["zero8", "unwritten as predicted"] == 1
    assert t.loc["zero8", "fill layers"] == "7" and t.loc["zero8", "acceptance"] == 1.86
    assert bool(t.loc["fixnan8", "fix"]) and t.loc["fixnan8", "pre-fill"] == "nan"
    pt = pd.DataFrame({"session": ["f", "g", "h"]})
    assert list(V.of_matrix(pt, df, "probe-fill-tp1")["session"]) == ["f", "g"]
    orphan = probe({2: {"m.layers.7.attn": tap(ok)}})
    orphan.update(session="f", engine="gone.a1")
    from dflash_lab.errors import LabError
    with pytest.raises(LabError, match="0 run lines match"):
        V.fill_table(df, [orphan])


def test_untapped_outcome_on_the_recorded_runs(df):
    assert V.untapped_outcome(df, 32) == "crash" and V.untapped_outcome(df, 16) == "ok"
    assert V.untapped_outcome(df, 3) is None  # never run there
    # the lines behind it: offline TP=1 stock at 1.86 only, no probe (s41's probed engines at 20 are not among them)
    u20 = V.untapped_runs(df, 20)
    assert len(u20) >= 4 and (u20["concurrency"] == 20).all() and not u20["probe"].fillna(False).astype(bool).any()
    assert (u20["tensor_parallel_size"] == 1).all() and u20["crashed"].all()


def test_fill_pooled_reads_the_strata_and_the_crashes_outside_the_nan_runs():
    def row(s, c, fill, outcome, first=None, within=None, finite=None, fix=False):
        return {"gpu_session": s, "concurrency": c, "fix": fix, "pre-fill": fill, "outcome": outcome,
                "first NaN step": first, "NaN only in unwritten requests": within, "earlier writes finite": finite}

    t = pd.DataFrame([row("a", 8, "nan", "crash", 3, True, True), row("a", 8, "zero", "ok"),
                      row("b", 20, "nan", "crash", 3, True, True), row("b", 20, "sentinel", "ok"),
                      row("b", 20, "none", "crash", 10, True, True), row("b", 20, "nan", "ok", fix=True)])
    pool = V.fill_pooled(t)
    assert pool["strata"] == [(("a", 8), 1, 1, 1, 2), (("b", 20), 1, 1, 2, 3)]
    assert pool["p"] == pytest.approx(1 / 2 * 2 / 3) and not pool["all_crashes_nan"]
    assert pool["filled_as_ruled"] and pool["own_nan"] and list(pool["other"]["pre-fill"]) == ["none"]
    # the plain crash without NaN of its own first: not own_nan; a finite-filled crash: not as ruled
    t.loc[4, "first NaN step"] = None
    assert not V.fill_pooled(t)["own_nan"]
    t.loc[3, "outcome"] = "crash"
    assert not V.fill_pooled(t)["filled_as_ruled"]
    # no stratum with a crash: nothing to test
    assert V.fill_pooled(t[t["outcome"] == "ok"]) is None


def test_plain_sites_groups_the_unfilled_stock_runs_by_their_first_nan_site():
    L15, L23 = "language_model.model.layers.15.self_attn.attn", "language_model.model.layers.23.self_attn.attn"

    def row(s, c, fill="none", outcome="crash", first=10, layer=L15, reqs=(10, 12), last=16, fix=False):
        return {"gpu_session": s, "concurrency": c, "fix": fix, "pre-fill": fill, "outcome": outcome,
                "first FULL step": 3, "first NaN step": first, "first NaN layer": layer,
                "NaN requests": list(reqs) if reqs is not None else None, "NaN only in unwritten requests": first is not None,
                "earlier writes finite": first is not None, "last step": last}

    t = pd.DataFrame([row("s41", 20), row("s42", 20), row("s42", 20, last=17),
                      row("s42", 28, first=11, layer=L23, reqs=(14, 15), last=23),
                      row("s42", 28, first=11, layer=L23, reqs=(14, 16), last=23),
                      row("s42", 28, fill="nan", first=3, layer="x", reqs=(0,), last=3),   # filled: not a plain run
                      row("s42", 20, first=5, fix=True)])                                   # the fix: not stock
    sites = V.plain_sites(t).set_index("concurrency")
    assert list(sites.columns) == V.PLAIN_SITE_COLUMNS[1:]
    r20, r28 = sites.loc[20], sites.loc[28]
    assert (r20["runs"], r20["crashed"], r20["GPU sessions"], r20["sites"]) == (3, 3, "s41, s42", 1)
    assert (r20["first NaN step"], r20["first NaN layer"], r20["NaN requests"]) == (10, L15, [10, 12])
    assert r20["own NaN"] and r20["last steps"] == [16, 17] and r20["first FULL step"] == "3"
    # other requests are another site: no single site to report
    assert r28["sites"] == 2 and pd.isna(r28["first NaN step"]) and r28["NaN requests"] is None and r28["runs"] == 2
    # a run with no NaN at all is a site of its own and not "own NaN"
    t2 = pd.concat([t, pd.DataFrame([row("s43", 20, outcome="ok", first=None, layer=None, reqs=None, last=281)])])
    r = V.plain_sites(t2).set_index("concurrency").loc[20]
    assert r["sites"] == 2 and not r["own NaN"] and r["crashed"] == 3 and r["runs"] == 4
    assert len(V.plain_sites(t[t["pre-fill"] == "nan"])) == 0


def test_matrix_run_lines_keeps_the_recorded_order_and_the_start_up_errors():
    df = pd.DataFrame({"matrix": ["m1", "other", "m1", "m2"], "file": ["a.jsonl", "x.jsonl", "a.jsonl", "b.jsonl"],
                       "run_id": ["e1/c28/r0", "e/c8/r0", "e2/c20/r0", "e3/c28/r0"],
                       "outcome": ["startup_error", "ok", "crash", "ok"], "startup_s": [None, 50.0, 62.3, 55.8],
                       "runner_wall_s": [None, 80.0, 11.1, None], "probe_ledger": [None, None, True, True],
                       "error": ["start-up limit", None, "CUDA error", None]})
    t = V.matrix_run_lines(df, ["m1", "m2"])
    assert list(t["run"]) == ["a/e1/c28/r0", "a/e2/c20/r0", "b/e3/c28/r0"]
    assert list(t["outcome"]) == ["startup_error", "crash", "ok"] and list(t["error"]) == ["start-up limit", "CUDA error", ""]
    assert list(t.columns) == ["run", "outcome", "engine start s", "run wall s", "build ledger", "error"]
    # run lines recorded before a column existed read as unknown, not as an error
    assert list(V.matrix_run_lines(df.drop(columns=["probe_ledger"]), ["m2"])["build ledger"]) == [None]
    assert V.matrix_run_lines(df, ["none"]).empty


def test_fill_strata_by_session_keeps_sessions_apart():
    t = pd.DataFrame({"gpu_session": ["a", "a", "b", "b", "b"], "concurrency": [8, 8, 8, 8, 32],
                      "fix": [False, False, False, True, False], "pre-fill": ["nan", "zero", "sentinel", "nan", "nan"],
                      "outcome": ["crash", "ok", "ok", "ok", "crash"]})
    assert V.fill_strata(t) == [(8, 1, 1, 1, 3), (32, 1, 1, 1, 1)]
    assert V.fill_strata(t, by_session=True) == [(("a", 8), 1, 1, 1, 2), (("b", 8), 0, 0, 0, 1), (("b", 32), 1, 1, 1, 1)]


def _oor_rows():
    base = {"matrix": "probe-oor-tp1", "gpu_session": "s", "concurrency": "20", "first NaN-logits step": 10,
            "out-of-vocabulary first ids": 0, "row-0 how": None, "first out-of-vocabulary step": pd.NA,
            "earlier steps without a token above row 0": 0, "core kernel": None, "core row": pd.NA,
            "core rows": pd.NA}
    return pd.DataFrame([
        dict(base, engine="ctl", **{"ids replaced": False, "outcome": "crash", "NaN-logits steps": 7,
                                    "ids replaced (count)": pd.NA, "accepted-0 rows": 18, "row-0 step": 16,
                                    "row-0 how": "sampled", "last step": 16, "out-of-vocabulary first ids": 22,
                                    "first out-of-vocabulary step": 10,
                                    "earlier steps without a token above row 0": 5}),
        dict(base, engine="oor", **{"ids replaced": True, "outcome": "ok", "NaN-logits steps": 272,
                                    "ids replaced (count)": 5357, "accepted-0 rows": 0, "row-0 step": pd.NA,
                                    "last step": 281}),
        dict(base, engine="other", matrix="probe-fill-tp1", **{"ids replaced": False, "outcome": "ok",
                                                               "NaN-logits steps": 0, "ids replaced (count)": pd.NA,
                                                               "accepted-0 rows": 0, "row-0 step": pd.NA,
                                                               "last step": 281})])


def test_oor_predictions_hold_only_when_the_replacement_run_also_kept_its_nan_and_lost_no_count():
    t = _oor_rows()
    x = V.oor_predictions(t)
    assert list(x["engine"]) == ["ctl", "oor"] and list(x["predicted"]) == ["crash", "ok"] and x["held"].all()
    t.loc[1, "accepted-0 rows"] = 3                                # an accepted count of 0 despite the replacement
    assert list(V.oor_predictions(t)["held"]) == [True, False]
    t.loc[1, ["accepted-0 rows", "NaN-logits steps"]] = [0, 0]     # no NaN at all: the intervention was not tested
    assert list(V.oor_predictions(t)["held"]) == [True, False]


def test_row0_rule_needs_every_crash_at_its_row0_step_and_no_completed_run_with_one():
    t = _oor_rows()
    r = V.row0_rule(t)
    assert r["holds"] and (r["crashes"], r["at row-0 step"], r["completed"]) == (1, 1, 2)
    assert r["by how"] == {"sampled": ["20"]}
    assert (r["earlier steps above row 0"], r["distinct"], r["at the first id"], r["completed testable"]) == (5, 1, 0, 0)
    t.loc[2, "out-of-vocabulary first ids"] = 3                     # a completed run that did have such ids
    assert V.row0_rule(t)["completed testable"] == 1
    t.loc[0, "last step"] = 17                                     # crashed a step after it
    assert not V.row0_rule(t)["holds"] and len(V.row0_rule(t)["not"]) == 1
    t.loc[0, "last step"] = 16
    t.loc[1, "row-0 step"] = 40                                     # a completed run that had one
    assert not V.row0_rule(t)["holds"] and len(V.row0_rule(t)["completed with one"]) == 1
    t.loc[1, "gpu_session"] = "2026-12-02-s44"                     # the offending run came after the rule was read
    assert V.row0_rule(t, up_to_session=43)["holds"] and not V.row0_rule(t)["holds"]
    t.loc[1, "row-0 step"] = pd.NA
    assert V.row0_rule(t)["holds"]
    t.loc[1, ["outcome", "row-0 step", "last step"]] = ["timeout", 40, 54]   # a hang whose log went past its row-0 step
    r = V.row0_rule(t)
    assert not r["holds"] and list(r["passed"].index) == [1] and r["completed"] == 1
    t.loc[1, "last step"] = 40                                      # stopped at it: undecided, not against the rule
    assert V.row0_rule(t)["holds"] and not len(V.row0_rule(t)["passed"])
    t.loc[1, ["outcome", "row-0 step", "last step"]] = ["ok, crash", 40, 40]   # two runs, one log: a crash ended it
    r = V.row0_rule(t)
    assert r["crashes"] == 2 and r["at row-0 step"] == 2 and r["holds"]
    t.loc[1, ["outcome", "row-0 step", "last step"]] = ["ok", pd.NA, 16]
    assert (V.session_no("2026-12-02-s44"), V.session_no("local")) == (44, None)
    with pytest.raises(LabError, match="no crashing run"):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        V.plot_row0(plt.subplots()[1], t[t["outcome"] == "ok"])


def test_row0_rule_counts_a_cut_log_only_once_a_replica_confirmed_its_faulting_step():
    t = _oor_rows()
    t.loc[0, ["row-0 step", "row-0 how", "last step"]] = [pd.NA, None, 498]   # no row-0 step in what was written
    assert not V.row0_rule(t)["holds"] and len(V.row0_rule(t)["not"]) == 1
    t.loc[0, "core kernel"] = analysis.GDN_KERNEL                   # its core stopped the process in the target's forward
    r = V.row0_rule(t)
    # cut, but nothing says its faulting step was a row-0 step: undecided, and the rule is not shown to hold
    assert not r["holds"] and len(r["cut"]) == 1 and len(r["undecided"]) == 1 and len(r["not"]) == 0
    r = V.row0_rule(t, confirmed={("s", "ctl")})                     # a replica read that step as a row-0 step
    assert r["holds"] and len(r["confirmed cut"]) == 1 and len(r["undecided"]) == 0 and r["at row-0 step"] == 0
    assert not V.row0_rule(t, confirmed={("s", "oor")})["holds"]     # another engine's confirmation does not count
    t.loc[0, "core kernel"] = analysis.DFLASH_INPUT_KERNEL          # a drafter kernel runs after the step's line
    assert not V.row0_rule(t, confirmed={("s", "ctl")})["holds"] and len(V.row0_rule(t)["cut"]) == 0
    t.loc[0, ["core kernel", "row-0 step", "row-0 how"]] = [analysis.GDN_KERNEL, 300, "moved"]
    assert not V.row0_rule(t, confirmed={("s", "ctl")})["holds"]    # a row-0 step 198 steps before its end: not cut


def test_core_batch_row_reads_the_focused_request_from_the_grid():
    gdn = {"kernel": analysis.GDN_KERNEL, "grid": [1, 4, 544], "focus_block": [0, 0, 15]}
    assert analysis.core_batch_row(gdn, 32) == {"row": 0, "rows": 17}
    assert analysis.core_batch_row(dict(gdn, focus_block=[0, 3, 40]), 32) == {"row": 1, "rows": 17}
    assert analysis.core_batch_row(dict(gdn, focus_block=[0, 3, 40]), 16) == {"row": 2, "rows": 34}
    with pytest.raises(LabError, match="value heads"):
        analysis.core_batch_row(gdn)
    with pytest.raises(LabError, match="not a multiple of 24"):
        analysis.core_batch_row(gdn, 24)
    dfl = {"kernel": analysis.DFLASH_INPUT_KERNEL, "grid": [20, 1, 1], "focus_block": [3, 0, 0]}
    assert analysis.core_batch_row(dfl) == {"row": 3, "rows": 20}
    assert analysis.core_batch_row({"kernel": "triton_poi_fused_2", "grid": [9, 1, 1], "focus_block": [0, 0, 0]}) is None
    assert analysis.core_batch_row(dict(dfl, grid=None)) is None and analysis.core_batch_row(None) is None


def test_a_probed_engine_with_several_core_dumps_is_named_not_fatal():
    runs = pd.DataFrame({"fault": [{"kernel": analysis.GDN_KERNEL}, {"kernel": analysis.DFLASH_INPUT_KERNEL}],
                         "tensor_parallel_size": [1, 1]})
    assert V._core(runs) == {"kernel": "2 core dumps", "row": None, "rows": None}
    assert "2 core dumps" not in V.TARGET_FORWARD_KERNELS                 # never counted as cut by row0_rule
    assert V._core(runs.iloc[:0]) == {"kernel": None, "row": None, "rows": None}


def test_schedule_agreement_and_step_ranges():
    def log(rows):
        return {"steps": [{"step": k, "reqs": r, "gdn": {"gdn0": {"na": n}}} for k, r, n in rows]}
    a = log([(1, [0], None), (2, [0, 1], [1, 1]), (3, [0, 1], [2, 1]), (4, [1], [1])])
    b = log([(1, [0, 1], None), (2, [0, 1], [1, 1]), (3, [0, 1], [2, 2]), (5, [1], [1])])
    assert D.schedule_agreement(a, b) == {"common": [1, 2, 3], "reqs differ": [1], "counts differ": [3]}
    assert V.step_ranges([3, 1, 2, 7, 9, 10, 10]) == "1-3, 7, 9-10" and V.step_ranges([]) == ""


def _core_case():
    """One probe-oor-core-tp1 run of each kind and its s44 replica, as oor_table rows, with their probe logs."""
    def log(last, extra=None, first=3):
        steps = [{"step": 1, "reqs": list(range(first)), "num_reqs": first}]
        steps += [{"step": k, "reqs": list(range(18)), "num_reqs": 18, "gdn": {"gdn0": {"na": [1] * 18}}}
                  for k in range(2, last + 1)]
        return {"steps": steps + (extra or [])}
    moved = [{"step": 41, "reqs": list(range(17)), "num_reqs": 17, "gdn": {"gdn0": {"na": [0] + [1] * 16}}}]
    logs = {"core-r0": log(40), "rep-r0": log(40, moved, first=1), "core-oth": log(14, first=7),
            "rep-oth": log(16)}
    logs["core-oth"]["steps"][5]["gdn"]["gdn0"]["na"] = [2] * 18          # a schedule that differed from the replica's
    base = {"gpu_session": "s45", "concurrency": "20", "outcome": "crash", "NaN-logits steps": 30,
            "first NaN-logits step": 10, "first row-0 change": 30}
    t = pd.DataFrame([
        dict(base, matrix=V.CORE_MATRIX, engine="r0", path="core-r0", **{
            "replaced in": "row0 only", "core kernel": analysis.GDN_KERNEL, "core row": 0, "core rows": 17,
            "row-0 step": pd.NA, "row-0 how": None, "last step": 40, "row-0 ids replaced": 9}),
        dict(base, matrix=V.CORE_MATRIX, engine="oth", path="core-oth", **{
            "replaced in": "others only", "core kernel": analysis.DFLASH_INPUT_KERNEL, "core row": 0, "core rows": 20,
            "row-0 step": 14, "row-0 how": "sampled", "last step": 14, "row-0 ids replaced": pd.NA}),
        dict(base, matrix=V.ROW0_MATRIX, engine="rep-r0", path="rep-r0", gpu_session="s44", **{
            "replaced in": "row0 only", "core kernel": None, "core row": pd.NA, "core rows": pd.NA,
            "row-0 step": 41, "row-0 how": "moved", "last step": 41, "row-0 ids replaced": 9}),
        dict(base, matrix=V.ROW0_MATRIX, engine="rep-oth", path="rep-oth", gpu_session="s44", **{
            "replaced in": "others only", "core kernel": None, "core row": pd.NA, "core rows": pd.NA,
            "row-0 step": 16, "row-0 how": "sampled", "last step": 16, "row-0 ids replaced": pd.NA})])
    return t, logs


def test_oor_core_predictions_read_the_faulting_step_of_a_cut_log_from_its_replica():
    t, logs = _core_case()
    x = V.oor_core_predictions(t, logs.__getitem__).set_index("engine")
    assert x["held"].all() and list(x.index) == ["r0", "oth"]
    assert (x.loc["r0", "faulting step"], x.loc["r0", "agree from"], x.loc["r0", "steps differing"]) == (41, 2, "1")
    assert x.loc["r0", "replica rows at its last step"] == 17 and x.loc["r0", "step as replica"]
    assert x.loc["r0", "rows at its last step"] == 18                # the core's 17-row launch is not step 40's
    assert x.loc["r0", "replica error"] is None                      # the synthetic replica recorded none
    assert V.confirmed_cuts(x.reset_index()) == {("s45", "r0")}      # what row0_rule may count
    assert x.loc["oth", "faulting step"] == 14 and not x.loc["oth", "step as replica"]   # not the replica's 16
    assert x.loc["oth", "steps differing"] == "1, 6"
    for col, bad in (("core kernel", analysis.DFLASH_INPUT_KERNEL),   # a drafter kernel where the GDN kernel was due
                     ("core row", 1),                                 # the focused block in another row
                     ("core rows", 18),                               # a launch of the step before, not the replica's next
                     ("row-0 step", 12)):                             # a row-0 step in the written log
        u = t.copy()
        u.loc[0, col] = bad
        assert list(V.oor_core_predictions(u, logs.__getitem__)["held"]) == [False, True], col
    bad = {k: v for k, v in logs.items()}
    bad["core-r0"] = {"steps": [dict(s) for s in logs["core-r0"]["steps"]]}
    bad["core-r0"]["steps"][35] = dict(bad["core-r0"]["steps"][35], reqs=list(range(17)))   # diverged late
    assert list(V.oor_core_predictions(t, bad.__getitem__)["held"]) == [False, True]
    u = t.copy()
    u.loc[0, "row-0 ids replaced"] = pd.NA                           # the replacement never gave row 0 a token
    assert list(V.oor_core_predictions(u, logs.__getitem__)["held"]) == [False, True]
    assert V.confirmed_cuts(V.oor_core_predictions(u, logs.__getitem__)) == set()
    u = t.copy()
    u.loc[1, "core kernel"] = analysis.GDN_KERNEL                    # row 0's own id faulting in the GDN kernel
    assert list(V.oor_core_predictions(u, logs.__getitem__)["held"]) == [True, False]
    with pytest.raises(LabError, match="exactly one replica"):
        V.oor_core_predictions(t[t["engine"] != "rep-oth"], logs.__getitem__)


def _row0_rows():
    base = {"matrix": V.ROW0_MATRIX, "gpu_session": "s", "ids replaced": True, "outcome": "crash",
            "first NaN-logits step": 10, "first out-of-vocabulary step": 10, "out-of-vocabulary first ids": 1,
            "earlier steps without a token above row 0": 0, "ids replaced (count)": 100}
    return pd.DataFrame([
        dict(base, engine="others", concurrency="20", **{
            "replaced in": "others only", "NaN-logits steps": 7, "accepted-0 rows": 0, "row-0 step": 16,
            "row-0 how": "sampled", "last step": 16, "row-0 changes": 0, "row-0 changes with a count of 0": 0,
            "first row-0 change": pd.NA, "accepted-0 rows above 0 before it": 0, "row-0 ids replaced": pd.NA,
            "first row-0 id replaced": pd.NA, "row-0 changes with a count unknown": 0,
            "row-0 requests that came back": 0}),
        dict(base, engine="row0", concurrency="28", **{
            "replaced in": "row0 only", "NaN-logits steps": 480, "accepted-0 rows": 900, "row-0 step": 591,
            "row-0 how": "moved", "last step": 591, "row-0 changes": 10, "row-0 changes with a count of 0": 1,
            "first row-0 change": 275, "accepted-0 rows above 0 before it": 899, "row-0 ids replaced": 75,
            "first row-0 id replaced": 23, "row-0 changes with a count unknown": 0,
            "row-0 requests that came back": 0}),
        dict(_oor_rows().iloc[0].to_dict(), **{"replaced in": None, "row-0 changes": 0,
                                               "row-0 changes with a count of 0": 0, "first row-0 change": pd.NA,
                                               "accepted-0 rows above 0 before it": 5, "row-0 ids replaced": pd.NA,
                                               "first row-0 id replaced": pd.NA,
                                               "row-0 changes with a count unknown": 0,
                                               "row-0 requests that came back": 0})])


def test_row0_predictions_hold_only_at_the_predicted_row0_step():
    t = _row0_rows()
    x = V.row0_predictions(t, {20: [16], 28: [23]})
    assert list(x["engine"]) == ["others", "row0"] and x["held"].all()       # the stock control is another matrix's
    assert list(x["rows replaced"]) == ["others", "row0"] and list(x["as stock"]) == [True, None]
    assert V.row0_predictions(t)["as stock"].isna().all()                   # no stock steps given: not compared
    t.loc[0, "last step"] = 17                                             # others crashed a step after row 0's id
    assert list(V.row0_predictions(t)["held"]) == [False, True]
    t.loc[0, ["last step", "outcome", "row-0 step"]] = [300, "ok", pd.NA]   # others completed: the rule fails
    assert list(V.row0_predictions(t)["held"]) == [False, True]
    t = _row0_rows()
    t.loc[1, "row-0 how"] = "sampled"                                       # row 0's own id: the replacement missed it
    assert list(V.row0_predictions(t)["held"]) == [True, False]
    t.loc[1, ["outcome", "row-0 step", "row-0 how", "last step"]] = ["crash", pd.NA, None, 400]
    assert list(V.row0_predictions(t)["held"]) == [True, False]             # a crash with no row-0 step
    t.loc[1, "outcome"] = "ok"                                              # completed, never a count of 0 in row 0
    assert list(V.row0_predictions(t)["held"]) == [True, True]
    t.loc[1, "accepted-0 rows above 0 before it"] = 0                       # ... but no row above 0 lost its token
    assert list(V.row0_predictions(t)["held"]) == [True, False]
    t.loc[1, "accepted-0 rows above 0 before it"] = 899
    t.loc[1, "row-0 ids replaced"] = 0                                      # ... or row 0 never needed the replacement
    assert list(V.row0_predictions(t)["held"]) == [True, False]
    t.loc[1, "replaced in"] = "all rows"
    with pytest.raises(LabError, match="not one part of the batch: row0"):
        V.row0_predictions(t)


def test_oor_table_reads_the_recorded_probes():
    df = analysis.load_runs()
    t = V.oor_table(df)
    x = V.oor_predictions(t)
    assert len(x) == 5 and x["held"].all()
    # s45's GDN-kernel core cut one log short of its faulting step: the rule holds on the logs up to s50 once its
    # replica confirmed that step; s51's probe at 24 went 14 steps past its first row-0 step (281) without a fault and
    # then timed out, against the rule; s53's repeat (probe-hang-c24-tp1) had the same events at the same steps, until the
    # runner's deadline cut it; s54's second repeat (call B) again, cut 23 s after step 295; s56's fourth attempt and its
    # ledger run again, and s57's two runs of the second ledger matrix that stopped (its crash came at its row-0 step),
    # and s58's r0 and r2 of probe-hang-c24-tp1 (its r1 crashed at its row-0 step, 281), and s62's K=3 run of the
    # admission gate's test (its K=4 and K=1 runs crashed at their row-0 steps, 281 and 285), and s72's K=2 run of it
    conf = V.confirmed_cuts(V.oor_core_predictions(t, D.load_probe))
    assert V.row0_rule(t, up_to_session=V.ROW0_HELD_UNTIL, confirmed=conf)["holds"]
    r51 = V.row0_rule(t, confirmed=conf)
    assert not r51["holds"] and len(r51["passed"]) == 11 and r51["at row-0 step"] + len(r51["confirmed cut"]) == r51["crashes"]
    assert sorted(r51["passed"]["matrix"]) == sorted([V.PROBE_C24_MATRIX] + [V.PROBE_HANG_MATRIX] * 5 + [
        V.PROBE_HANG_LEDGER_MATRICES[0]] + [V.PROBE_HANG_LEDGER_MATRICES[1]] * 2 + [V.ADMIT_C24_MATRIX] * 2)
    for i in range(11):
        assert (r51["passed"][["concurrency", "outcome", "row-0 step", "row-0 how", "last step"]].iloc[i].tolist()
                == ["24", "timeout", 281, "sampled", 295])
    # s44: the pre-registered row-0 test, 4 runs, every prediction held; each row0 run's request in row 0 changed
    # several times before the one whose newcomer had a count of 0, the crash step
    r = V.row0_predictions(t)
    assert len(r) == 4 and r["held"].all()
    z = r[r["rows replaced"] == "row0"]
    assert (z["row-0 changes with a count of 0"] == 1).all() and (z["row-0 changes"] > 1).all()
    # the replacement gave row 0 its only token first on the step the others-replaced run crashed at
    o = r[r["rows replaced"] == "others"].set_index("concurrency")["last step"]
    assert all(int(f) == int(o[c]) for c, f in zip(z["concurrency"], z["first row-0 id replaced"]))
    assert (z["row-0 requests that came back"] == 0).all() and (z["row-0 changes with a count unknown"] == 0).all()
    assert (t.loc[t["outcome"] == "ok", "row-0 changes with a count of 0"] == 0).all()
    assert (t["unlinked steps"].map(len) == 0).all() and t["linked steps"].sum() > 1000
    # s45: the same entries at 20 with core dumps, each faulting in batch row 0 in the kernel predicted before the run
    k = V.oor_core_predictions(t, D.load_probe).set_index("rows replaced")
    assert len(k) == 2 and k["held"].all() and (k["core row"] == 0).all()
    assert k.loc["row0", "core kernel"] == analysis.GDN_KERNEL and k.loc["row0", "faulting step"] == 499
    assert k.loc["others", "core kernel"] == analysis.DFLASH_INPUT_KERNEL
    # the core's 17-sequence launch is not the 18-request last line's; the replica's error reached Python in the
    # probe's no-graph reference pass of the move step
    assert (k.loc["row0", "core rows"], k.loc["row0", "rows at its last step"]) == (17, 18)
    assert k.loc["row0", "replica error"].startswith("reference pass: RuntimeError: CUDA error: CUBLAS")
    assert len(V.row0_rule(t)["cut"]) == 1 and not V.row0_rule(t, up_to_session=V.ROW0_HELD_UNTIL)["holds"]
    assert V.row0_rule(t, up_to_session=V.ROW0_HELD_UNTIL, confirmed=V.confirmed_cuts(k.reset_index()))["holds"]


def test_first_sites_group_runs_by_concurrency_and_site():
    r = pd.DataFrame([
        {"concurrency": 28, "site": "step 11, L23 attn", "gpu_session": "2026-12-02-s42", "build ledger": "ledger on",
         "ids replaced in": "none"},
        {"concurrency": 28, "site": "step 10, L23 attn", "gpu_session": "2026-12-02-s44", "build ledger": "ledger off",
         "ids replaced in": "none"},
        {"concurrency": 28, "site": "step 10, L23 attn", "gpu_session": "2026-12-02-s44", "build ledger": "ledger on",
         "ids replaced in": "others"},
        {"concurrency": 20, "site": None, "gpu_session": "s41", "build ledger": "ledger on", "ids replaced in": "none"}])
    r["first step requests"] = pd.array([1, 7, 3, pd.NA], dtype="Int64")
    r["first step set"] = ["arrival", "7 of 28", "arrival", "arrival"]
    s = V.first_sites(r)
    assert s[28][0]["gated"] == 1 and s[28][1]["gated"] == 0
    assert [x["runs"] for x in s[28]] == [2, 1] and s[28][0]["ledger"] == "ledger off, ledger on"
    assert s[28][0]["replaced"] == "none, others" and s[28][1]["sessions"] == "s42"
    assert s[28][0]["first steps"] == "3, 7" and s[28][1]["first steps"] == "1"
    assert s[20] == [{"site": None, "runs": 1, "sessions": "s41", "ledger": "ledger on", "replaced": "none",
                      "first steps": "", "gated": 0}]


def test_first_site_runs_read_every_plain_tap_stock_engine():
    df = analysis.load_runs()
    r = V.first_site_runs(df, V.probe_table(df), D.load_probe)
    assert set(r["concurrency"]) == {20, 28} and r["earlier writes finite"].all()
    assert {"none", "all", "row0", "others"} <= set(r["ids replaced in"]) and "ledger off" in set(r["build ledger"])
    s = V.first_sites(r)
    # s44: the step at 28 moved; s45: the requests at 20 once; s46: all 28 in the first step gave a third site at 28
    assert len(s[20]) == 2 and len(s[28]) == 3
    assert set(r["first step set"]) == {"arrival", "1 of 28", "7 of 28", "28 of 28"}
    assert r["first step requests"].notna().all() and r["first step requests"].between(1, 28).all()
    assert V.first_site_runs(df.iloc[0:0], V.probe_table(df).iloc[0:0], D.load_probe).empty


def test_output_agreement_of_a_session_whose_runs_all_crashed_is_empty():
    # s44's runs all crashed: an empty mask over no completed run once selected columns, not rows (KeyError)
    df = pd.DataFrame([{"gpu_session": "s44", "outcome": "crash", "output_digests": None, "cudagraph_mode": "FULL",
                        "fix": False, "concurrency": 20, "round": 0, "temperature": 0.0, "run_id": "a"}])
    assert V.output_agreement(df, "s44").empty
    assert V.output_agreement(df.assign(outcome="ok"), "s44").empty      # completed, but recorded no outputs


def _admit_case():
    """Three probe-admit-tp1 runs (K=7, K=1, K=28) as run lines, oor_table rows, first_site_runs rows and probe logs."""
    engines = [("k7", 7, 10, [14, 17, 21, 24]), ("k1", 1, 11, list(range(14, 28))), ("k28", 28, 10, [3])]
    df = pd.DataFrame([{"file": "sess.jsonl", "engine_id": e, "attempt": 1, "first_step_requests": k}
                       for e, k, _, _ in engines])
    t = pd.DataFrame([{"session": "sess", "engine": f"{e}.a1", "path": e, "matrix": V.ADMIT_MATRIX,
                       "gpu_session": "s46", "concurrency": "28", "outcome": "crash", "row-0 step": 23,
                       "last step": 23} for e, _, _, _ in engines])
    sites = pd.DataFrame([{"probe": f"sess/{e}.a1", "first NaN step": s, "first NaN layer": "L23 attn",
                           "NaN requests": q} for e, _, s, q in engines])
    logs = {e: {"steps": [{"step": 1, "num_reqs": k}, {"step": 2, "num_reqs": 28}]} for e, k, _, _ in engines}
    return df, t, sites, logs


def _held(x):
    """(K=7's held, K=1's held) of an admit_predictions table."""
    h = x.set_index("engine")["held"]
    return h["k7.a1"], h["k1.a1"]


def test_admit_predictions_need_the_gate_the_site_and_the_row0_crash():
    df, t, sites, logs = _admit_case()
    x = V.admit_predictions(df, sites, t, logs.__getitem__).set_index("engine")
    assert list(x.index) == ["k1.a1", "k28.a1", "k7.a1"]               # sorted by session and engine
    assert x["held"].to_dict() == {"k1.a1": True, "k28.a1": None, "k7.a1": True} and x["gate as set"].all()
    assert pd.isna(x.loc["k28.a1", "predicted site"]) and x.loc["k7.a1", "first NaN step"] == 10
    s = sites.copy()
    s.loc[0, "first NaN step"] = 11                                   # K=7 at step 11: contradicts the lead
    assert _held(V.admit_predictions(df, s, t, logs.__getitem__)) == (False, True)
    s = sites.copy()
    s.at[1, "NaN requests"] = [14, 17, 21, 24]                        # K=1 with K=7's requests
    assert _held(V.admit_predictions(df, s, t, logs.__getitem__)) == (True, False)
    bad = {k: v for k, v in logs.items()}
    bad["k7"] = {"steps": [{"step": 1, "num_reqs": 3}, {"step": 2, "num_reqs": 28}]}   # the gate did not hold
    y = V.admit_predictions(df, sites, t, bad.__getitem__)
    assert _held(y) == (False, True) and not y.set_index("engine").loc["k7.a1", "gate as set"]
    u = t.copy()
    u.loc[1, "row-0 step"] = 12                                       # crashed 11 steps after its row-0 step
    assert _held(V.admit_predictions(df, sites, u, logs.__getitem__)) == (True, False)
    u = t.copy()
    u.loc[0, "outcome"] = "ok"
    assert _held(V.admit_predictions(df, sites, u, logs.__getitem__)) == (False, True)
    with pytest.raises(LabError, match="the check needs exactly one"):
        V.admit_predictions(df.assign(first_step_requests=None), sites, t, logs.__getitem__)
    assert not len(V.admit_predictions(df, sites, t.assign(matrix="other"), logs.__getitem__))


def test_the_recorded_admission_test_held_as_pre_registered():
    """s46 (probe-admit-tp1): with the first step's admissions set by the gate, K=7 gave step 10 and K=1 step 11 at
    28, every time, each run crashing at its first row-0 step."""
    df = analysis.load_runs()
    pt = V.probe_table(df)
    x = V.admit_predictions(df, V.first_site_runs(df, pt, D.load_probe), V.oor_table(df), D.load_probe)
    pred = x[x["first step set"].isin(V.ADMIT_PREDICTED)]
    assert len(pred) == 9 and pred["held"].all() and x["gate as set"].all() and x["gpu_session"].nunique() == 1
    assert (x["outcome"] == "crash").all() and x["at row-0 step"].all()
    # the same rows from the matrix's own probe logs alone (what findings.admit_clause reads)
    stems = {f[: -len(".jsonl")] for f in df.loc[df["matrix"] == V.ADMIT_MATRIX, "file"]}
    y = V.admit_predictions(df, V.first_site_runs(df, pt, D.load_probe), V.oor_table(df, sessions=stems), D.load_probe)
    assert y.equals(x) and len(V.oor_table(df, sessions={"no-such-session"})) == 0
    k28 = x[x["first step set"] == 28]
    assert len(k28) == 2 and set(k28["first NaN step"]) == {10} and k28["held"].isna().all()


def test_plot_admission_draws_every_run_and_refuses_none():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sites = pd.DataFrame({"concurrency": [28, 28, 28, 20], "first NaN step": [10, 11, 11, 10],
                          "first step requests": pd.array([7, 1, 1, 3], dtype="Int64"),
                          "first step set": ["7 of 28", "arrival", "1 of 28", "arrival"]})
    ax = V.plot_admission(plt.subplots()[1], sites)
    assert sum(len(c.get_offsets()) for c in ax.collections) == 3          # the three runs at 28, none at 20
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "7"]
    with pytest.raises(LabError, match="at concurrency 64"):
        V.plot_admission(plt.subplots()[1], sites, 64)
    plt.close("all")


def _diff_case():
    df = analysis.load_runs()
    d = df[df["matrix"].isin([V.DIFF_MATRIX, V.DIFF_CONTROLS_MATRIX])].copy()
    return df, d, V.probe_table(df), Path("patches/vllm-0.22.1-dflash.diff").read_text()


def _failed(t):
    """The first 30 characters of each prediction that did not hold."""
    return list(t.loc[~t["held"], "predicted"].str[:30])


def test_the_recorded_diff_test_held_as_pre_registered():
    """s47 (verify-diff-tp1 and its controls): stock crashed at 32, 20 and 8; vLLM with the upstream diff applied as a
    diff completed 10/10 at 32 and 3/3 at 8 and 20, its probe at 8 bit-identical to the no-graph pass."""
    df, d, pt, text = _diff_case()
    t = V.diff_predictions(df, pt, text)
    assert len(t) == 9 and t["held"].all(), t
    assert d["gpu_session"].nunique() == 1 and (d.loc[d["fix_via"] == "upstream diff", "fix"] == True).all()  # noqa: E712
    # the analysis never counts the diff's runs as stock: they are fixed runs of their own label
    assert not len(analysis.stock_full(d[d["fix_via"] == "upstream diff"], acceptance=None))
    w = V.fix_where_stock_crashes(df)
    w = w[w["fix"] == "the upstream diff, as a diff"].set_index("concurrency")
    assert w["fix completed / runs"].to_dict() == {8: "3/3", 20: "3/3", 24: "3/3", 28: "3/3", 32: "10/10", 64: "3/3"}
    # s49 ran the diff at 24, 28 and 64 (verify-diff-rest-tp1), beside its own stock controls
    assert w["sessions with a crashed stock control"].to_dict() == {8: "2026-12-03-s47", 20: "2026-12-03-s47",
                                                                     24: "2026-12-03-s49", 28: "2026-12-03-s49",
                                                                     32: "2026-12-03-s47", 64: "2026-12-03-s49"}


def test_diff_predictions_fail_on_a_crash_a_missing_check_another_diff_or_a_diverging_step(monkeypatch):
    df, d, pt, text = _diff_case()
    i = df.index[(df["matrix"] == V.DIFF_MATRIX) & (df["run_id"] == "diff-c32/c32/r3")][0]
    bad = df.copy()
    bad.loc[i, ["outcome", "crashed"]] = ["crash", True]
    assert _failed(V.diff_predictions(bad, pt, text)) == ["(b) the diff at 32: completes "]
    j = df.index[(df["matrix"] == V.DIFF_CONTROLS_MATRIX) & (df["engine_id"] == "stock-control-c8")][0]
    bad = df.copy()
    bad.loc[j, ["outcome", "crashed"]] = ["ok", False]                 # a control that completed is no control
    assert _failed(V.diff_predictions(bad, pt, text)) == ["control, stock at 8: crashes, "]
    # another diff than the one the runs stamped
    other = text.replace("+        own = getattr(self", "+        own = getattr(self  ", 1)
    assert _failed(V.diff_predictions(df, pt, other)) == ["the runs' overlay holds the co"]
    p = pt.copy()
    k = p.index[p["fix"].str.startswith("upstream diff")][0]
    p.loc[k, "FULL steps diverging"] = 1
    assert _failed(V.diff_predictions(df, p, text)) == ["(c) the diff under the step pr"]
    monkeypatch.setattr(V, "diff_check_processes", lambda r: 1)          # only one process checked the overlay
    assert _failed(V.diff_predictions(df, pt, text)) == ["every diff engine's processes "]
    with pytest.raises(LabError, match="no run lines of verify-diff-tp1"):
        V.diff_predictions(df[df["matrix"] != V.DIFF_MATRIX], pt, text)


def _server_diff_case():
    df = analysis.load_runs()
    return df, Path("patches/vllm-0.22.1-dflash.diff").read_text()


def _at(df, run_id, matrix=V.DIFF_SERVER_MATRIX):
    return df.index[(df["matrix"] == matrix) & (df["run_id"] == run_id)][0]


def _edited(df, matrix, run_id, **fields):
    """A copy of ``df`` whose line ``run_id`` of ``matrix`` has ``fields`` (``acceptance_length``: in its counters)."""
    bad = df.copy()
    i = _at(df, run_id, matrix)
    if "acceptance_length" in fields:
        bad.at[i, "spec_decode_metrics"] = {**df.at[i, "spec_decode_metrics"],
                                            "acceptance_length": fields.pop("acceptance_length")}
    for k, v in fields.items():
        bad.at[i, k] = v
    return bad


def test_the_recorded_server_diff_test_held_as_pre_registered():
    """s48 (verify-diff-server-tp1): on the OpenAI server, stock crashed at 32, 8 and 20; the diff's server completed
    10/10 at 32 and 3/3 at 8 and 20 with every request clean, and at acceptance 6.0 it counted exactly 6 where stock
    counted below."""
    df, text = _server_diff_case()
    t = V.diff_server_predictions(df, text)
    assert len(t) == 12 and t["held"].all(), t
    assert list(t["kind"]).count("pre-registered") == 10
    w = V.fix_where_stock_crashes(df, mode="server").set_index("concurrency")
    assert w["fix completed / runs"].to_dict() == {8: "3/3", 20: "3/3", 32: "10/10"}
    assert set(w["sessions with a crashed stock control"]) == {"2026-12-03-s48"}
    assert set(w["stock there"]) == {"crashes"}
    # the offline table keeps the offline runs only
    assert "2026-12-03-s48" not in " ".join(V.fix_where_stock_crashes(df)["fix sessions"])
    with pytest.raises(LabError, match="mode must be offline or server"):
        V.fix_where_stock_crashes(df, mode="tp2")


def test_server_diff_predictions_fail_on_a_crash_a_bad_request_a_lost_token_or_a_control_that_completes():
    df, text = _server_diff_case()

    def failed(run_id, **fields):
        """The predictions that fail once ``run_id``'s line has ``fields``."""
        return _failed(V.diff_server_predictions(_edited(df, V.DIFF_SERVER_MATRIX, run_id, **fields), text))

    # a crashed run also leaves the counters one run short of the 16
    assert failed("diff-server/c32/r4", outcome="crash", crashed=True) == ["(b) the diff's server at 32: c",
                                                                           "(b) no diff run at 1.86 counts"]
    assert failed("diff-server/c32/r7", acceptance_length=1.80) == ["(b) no diff run at 1.86 counts"]
    # one request refused, one that came back short: not a clean run
    assert failed("diff-server/c8/r1", http_statuses=[200] * 7 + [500]) == ["(b) the diff's server at 8: co"]
    assert failed("diff-server/c20/r2", output_tokens=20 * 512 - 1) == ["(b) the diff's server at 20: c"]
    assert failed("diff-acc6/c8/r1", acceptance_length=5.99) == ["(d) the diff at acceptance 6.0"]
    # a loss too small to show at 3 decimals is still a loss
    assert failed("diff-acc6/c8/r2", acceptance_length=5.9999) == ["(d) the diff at acceptance 6.0"]
    assert failed("stock-acc6/c8/r0", acceptance_length=6.0) == ["(d) stock at acceptance 6.0 an"]
    assert failed("stock-controls/c8/r0", outcome="ok", crashed=False) == ["(c) stock server at 8: crashes"]
    errors = df.at[_at(df, "stock-control/c32/r0"), "request_errors"]
    assert failed("stock-control/c32/r0", request_errors={**errors, "by_status": {"500": 24}}) == \
        ["(a) its clients: HTTP 200, the"]                                    # refused, not streamed
    with pytest.raises(LabError, match="no run lines of verify-diff-server-tp1"):
        V.diff_server_predictions(df[df["matrix"] != V.DIFF_SERVER_MATRIX], text)


def _rest_failed(t):
    """The first 30 characters of each decided prediction that did not hold (held False; None is not run)."""
    return list(t.loc[t["held"].map(lambda h: h is False), "predicted"].str[:30])


def test_the_recorded_rest_diff_test_as_pre_registered():
    """s49-s50 (verify-diff-rest-tp1): stock crashed at 64, 24 and 28 in both sessions, the diff completed 3/3 at each
    (s49); s49's control at 24 left no core file (its engine log printed both drafter RoPE asserts), so its '(a)' failed
    as written, while s50's controls each left a core naming the DFlash input kernel; s50's probe at 64 was
    bit-identical on all 280 FULL steps."""
    df, text = _server_diff_case()
    pt = V.probe_table(df)
    t = V.diff_rest_predictions(df, pt, text)
    assert len(t) == 13 and list(t["kind"]).count("pre-registered") == 11
    assert _rest_failed(t) == ["(a) stock control at 24 (s49):"]
    c24 = t.loc[t["predicted"].str.startswith("(a) stock control at 24 (s49)"), "measured"].iloc[0]
    assert c24.startswith("1 of 1 crashed; core: None") and "unspecified launch failure" in c24
    assert "0 <= tmp16 < 262144" in c24 and "0 <= tmp48 < 262144" in c24
    s50 = t[t["predicted"].str.contains(r"\(s50\)")]
    assert len(s50) == 3 and all(h is True for h in s50["held"])
    assert all("copy_and_expand_dflash_inputs_kernel" in m for m in s50["measured"])
    probe = t[t["predicted"].str.startswith("(c)")]
    assert len(probe) == 1 and probe["held"].iloc[0] is True
    assert probe["measured"].iloc[0].startswith("runs ok 1/1; 0 of 280 FULL steps diverging")
    assert sum(h is True for h in t["held"]) == 12 and not any(h is None for h in t["held"])
    w = V.fix_where_stock_crashes(df)
    w = w[w["fix"] == "the upstream diff, as a diff"].set_index("concurrency")
    assert {c: w.loc[c, "fix completed / runs"] for c in (24, 28, 64)} == {24: "3/3", 28: "3/3", 64: "3/3"}
    assert {w.loc[c, "sessions with a crashed stock control"] for c in (24, 28, 64)} == {"2026-12-03-s49"}


def test_rest_diff_predictions_fail_on_a_crash_a_lost_token_a_completed_control_or_a_diverging_probe():
    df, text = _server_diff_case()
    pt = V.probe_table(df)

    def failed(run_id, **fields):
        return _rest_failed(V.diff_rest_predictions(_edited(df, V.DIFF_REST_MATRIX, run_id, **fields), pt, text))

    base = ["(a) stock control at 24 (s49):"]
    assert failed("diff/c64/r1", outcome="crash", crashed=True) == base + ["(b) the diff at 64: completes ",
                                                                           "(b) no diff run counts below t"]
    assert failed("diff/c28/r2", acceptance_length=1.70) == base + ["(b) no diff run counts below t"]
    # the first stock-controls/c64/r0 line is s49's
    assert failed("stock-controls/c64/r0", outcome="ok", crashed=False) == ["(a) stock control at 64 (s49):"] + base
    # the probe at 64: not run yet without its log, failed when a FULL step diverges or a second log appears
    probe = pt["engine"].str.startswith("diff-probe-c64.")
    assert probe.sum() == 1
    t = V.diff_rest_predictions(df, pt[~probe], text)
    c = t[t["predicted"].str.startswith("(c)")]
    assert c["held"].iloc[0] is None and c["measured"].iloc[0].startswith("not run yet")
    bad = pt.copy()
    bad.loc[probe, "FULL steps diverging"], bad.loc[probe, "max |output diff|"] = 3, 0.5
    assert _rest_failed(V.diff_rest_predictions(df, bad, text)) == base + ["(c) the diff under the step pr"]
    import pandas as pd
    twice = pd.concat([pt, pt[probe]], ignore_index=True)
    assert _rest_failed(V.diff_rest_predictions(df, twice, text)) == base + ["(c) the diff under the step pr"]
    other = text.replace("+        own = getattr(self", "+        own = getattr(self  ", 1)
    assert _rest_failed(V.diff_rest_predictions(df, pt, other)) == base + ["the runs' overlay holds the co"]
    with pytest.raises(LabError, match="no run lines of verify-diff-rest-tp1"):
        V.diff_rest_predictions(df[df["matrix"] != V.DIFF_REST_MATRIX], pt, text)


def test_the_recorded_c24_core_repeat_as_pre_registered():
    """s50-s51 (stock-c24-core-tp1): both planned engines crashed at 24, each leaving a core: s50's the drafter's RoPE
    kernel (a device-side assert, 'unspecified launch failure'), s51's the DFlash input kernel."""
    df, _ = _server_diff_case()
    t = V.c24_core_predictions(df)
    assert list(t["held"]) == [True, True]
    assert t["measured"].iloc[0] == "2 of 2 run(s) crashed"
    assert t["measured"].iloc[1] == ("stock-c24/c24/r0: core names triton_poi_fused_2 (grid (576, 1, 1)); "
                                     "stock-c24/c24/r1: core names copy_and_expand_dflash_inputs_kernel (grid (13, 1, 1))")


def test_c24_core_predictions_fail_on_a_completed_run_or_another_kernel():
    df, _ = _server_diff_case()
    m = V.C24_CORE_MATRIX

    def held(d=df, **fields):
        return list(V.c24_core_predictions(_edited(d, m, "stock-c24/c24/r0", **fields))["held"])

    assert held(outcome="ok", crashed=False) == [False, True]
    i = _at(df, "stock-c24/c24/r0", m)
    assert held(fault={**df.at[i, "fault"], "kernel": "some_other_kernel"}) == [True, False]
    assert held(fault={"kernel": None, "error": "no core file", "dump_started": True}) == [True, True]
    assert held(fault={"kernel": None, "error": "no core file", "dump_started": False}) == [True, False]
    # with only the first engine's line, (a) waits for the second
    first = df[~((df["matrix"] == m) & (df["run_id"] == "stock-c24/c24/r1"))]
    t = V.c24_core_predictions(first)
    assert list(t["held"]) == [None, True] and t["measured"].iloc[0] == "1 of 1 run(s) crashed; 1 planned run(s) not run"
    assert held(first, outcome="ok", crashed=False) == [False, None]
    # r0 recorded twice (a continued matrix) is still one run: (a) waits for r1
    import pandas as pd
    twice = pd.concat([first, first.loc[[i]]], ignore_index=True)
    assert V.c24_core_predictions(twice)["measured"].iloc[0] == "1 of 1 run(s) crashed; 1 planned run(s) not run"
    # an engine that never started ran nothing: its line is a run not run, not a run that did not crash
    assert held(outcome="startup_error", crashed=False) == [None, True]
    with pytest.raises(LabError, match="no run lines of stock-c24-core-tp1"):
        V.c24_core_predictions(df[df["matrix"] != m])


def test_c24_core_predictions_read_the_planned_runs_from_the_matrix_file(tmp_path):
    """(a) is decided against the runs the matrix file plans, not a number written into the code: a file planning
    one round decides it on one recorded crash; a line whose run the file does not plan is refused."""
    df, _ = _server_diff_case()
    m = V.C24_CORE_MATRIX
    assert V.planned_runs("matrices/stock-c24-core-tp1.yaml") == ["stock-c24/c24/r0", "stock-c24/c24/r1"]
    src = open("matrices/stock-c24-core-tp1.yaml").read()
    assert "rounds: 2" in src
    one = tmp_path / "one.yaml"
    one.write_text(src.replace("rounds: 2", "rounds: 1"))
    first = df[~((df["matrix"] == m) & (df["run_id"] == "stock-c24/c24/r1"))]
    t = V.c24_core_predictions(first, one)
    assert list(t["held"]) == [True, True] and t["measured"].iloc[0] == "1 of 1 run(s) crashed"
    assert t["predicted"].iloc[0] == "(a) stock crashes at 24 in 1 of 1 fresh engines"
    with pytest.raises(LabError, match=r"run lines \['stock-c24/c24/r1'\] are not among"):
        V.c24_core_predictions(df, one)
    with pytest.raises(LabError, match="no such matrix file"):
        V.c24_core_predictions(df, tmp_path / "missing.yaml")


def test_server_runs_reads_each_server_line_as_its_clients_saw_it():
    df, _ = _server_diff_case()
    t = V.server_runs(df[df["matrix"] == V.DIFF_SERVER_MATRIX]).set_index("run")
    assert len(t) == 25 and set(t["vLLM"]) == {"stock", "upstream diff"}
    c = t.loc["stock-control/c32/r0"]
    assert (c["outcome"], c["HTTP statuses"], c["client errors"], c["requests failed"]) == \
        ("crash", "200: 32", "stream_error_event: 24", 24)
    assert c["core: faulting kernel"] == "copy_and_expand_dflash_inputs_kernel" and c["counted acceptance"] == "-"
    assert t.loc["diff-acc6/c8/r2", "counted acceptance"] == "6.000" and t.loc["diff-acc6/c8/r2", "output tokens"] == 4096
    # offline lines are not server runs
    assert not len(V.server_runs(df[df["matrix"] == V.DIFF_MATRIX]))


def _c64_as_c24(df, sessions=("2026-12-01_h200_probe-c64-a-tp1", "2026-12-01_h200_probe-c64-b-tp1")):
    """s35's two stock probe-c64 lines relabelled as probe-c24-tp1's two planned runs (real probe logs, another
    concurrency) in place of that matrix's own lines: the judging run on other recorded logs."""
    out = df[df["matrix"] != V.PROBE_C24_MATRIX].copy()
    for n, s in enumerate(sessions):
        i = out.index[(out["file"] == f"{s}.jsonl") & (out["engine_id"] == "stock-probe-c64")][0]
        out.at[i, "matrix"] = V.PROBE_C24_MATRIX
        out.at[i, "run_id"] = f"stock-probe-c24/c24/r{n}"
    return out


def test_c24_probe_predictions_judge_each_probe_log():
    """Both s35 stock logs at 64 diverge first at their first FULL step (280) from layer 8, and each crash ended at its
    first row-0 step (289 and 280, an out-of-vocabulary id in row 0); neither engine took a core dump, so (c) is
    undecided, not held."""
    df = analysis.load_runs()
    t = V.c24_probe_predictions(_c64_as_c24(df))
    assert list(t["held"]) == [True, True, None]
    assert "stock-probe-c64.a1 (crash): last step 289, row-0 step 289 (sampled)" in t["measured"].iloc[1]
    assert "first FULL step 280, first diverging 280, 8 layers identical before L8 gdn" in t["measured"].iloc[0]
    assert t["measured"].iloc[2].count("no core file") == 2
    # one of the two planned runs: nothing is decided yet
    one = _c64_as_c24(df, sessions=("2026-12-01_h200_probe-c64-a-tp1",))
    t1 = V.c24_probe_predictions(one)
    assert list(t1["held"]) == [None, None, None] and t1["measured"].iloc[0].endswith("; 1 planned run(s) not run")


def test_c24_probe_predictions_fail_on_a_contradicting_log(monkeypatch):
    df = _c64_as_c24(analysis.load_runs())
    i = _at(df, "stock-probe-c24/c24/r0", V.PROBE_C24_MATRIX)
    # a completed run whose log holds a row-0 step contradicts (b)
    t = V.c24_probe_predictions(_edited(df, V.PROBE_C24_MATRIX, "stock-probe-c24/c24/r0", outcome="ok", crashed=False))
    assert t["held"].iloc[1] is False and "a row-0 step at 289 and no crash" in t["measured"].iloc[1]
    # a core naming a kernel stock never named contradicts (c); one naming the DFlash input kernel holds
    other = {"kernel": "some_other_kernel", "error": None, "core_file": "/tmp/cudacore/x/core.1"}
    assert V.c24_probe_predictions(_edited(df, V.PROBE_C24_MATRIX, "stock-probe-c24/c24/r0", fault=other))["held"].iloc[2] is False
    known = {"kernel": "copy_and_expand_dflash_inputs_kernel", "error": None, "core_file": "/tmp/cudacore/x/core.1"}
    both = _edited(_edited(df, V.PROBE_C24_MATRIX, "stock-probe-c24/c24/r0", fault=known),
                   V.PROBE_C24_MATRIX, "stock-probe-c24/c24/r1", fault=known)
    assert list(V.c24_probe_predictions(both)["held"]) == [True, True, True]
    # a probe log that diverged first elsewhere contradicts (a)
    real = V.probe_table

    def elsewhere(*args, **kw):
        t = real(*args, **kw)
        return t.assign(**{"first layer written differently": "L16 gdn"})

    monkeypatch.setattr(V, "probe_table", elsewhere)
    assert V.c24_probe_predictions(df)["held"].iloc[0] is False

    def no_full(*args, **kw):   # a log with no FULL step leaves (a) undecided, not failed
        t = real(*args, **kw)
        return t.assign(**{"first FULL step": None})

    monkeypatch.setattr(V, "probe_table", no_full)
    assert V.c24_probe_predictions(df)["held"].iloc[0] is None
    monkeypatch.setattr(V, "probe_table", real)
    with pytest.raises(LabError, match="no run lines of probe-c24-tp1"):
        V.c24_probe_predictions(df[df["matrix"] != V.PROBE_C24_MATRIX])
    with pytest.raises(LabError, match="no probe log for"):
        V.c24_probe_predictions(df.assign(attempt=df["attempt"].where(df.index != i, 9)))


def test_the_recorded_probe_at_24_as_pre_registered():
    """probe-c24-tp1, both planned runs. s51's r0: the first FULL step (3, 24 requests) diverged from layer 8 as
    predicted; the row-0 rule did not hold: row 0's own out-of-vocabulary id at step 281 did not fault, the log went on
    to step 295, and the run timed out at 300 s (the engine stopped stepping). s52's r1 (a fresh host): the same first
    divergence; it crashed at its first row-0 step (285), so (b) held for it but not overall; the driver logged that
    it began a dump and no core file appeared, so (c) stays undecided."""
    t = V.c24_probe_predictions(analysis.load_runs())
    assert list(t["held"]) == [True, False, None]
    assert t["measured"].iloc[0] == ("stock-probe-c24.a1 (timeout): first FULL step 3, first diverging 3, 8 layers "
                                     "identical before L8 gdn; stock-probe-c24.a1 (crash): first FULL step 3, first "
                                     "diverging 3, 8 layers identical before L8 gdn")
    assert t["measured"].iloc[1] == ("stock-probe-c24.a1 (timeout): row-0 step 281 (sampled), then 14 more step(s) "
                                     "recorded without a fault (last step 295); stock-probe-c24.a1 (crash): last step "
                                     "285, row-0 step 285 (sampled)")
    assert t["measured"].iloc[2] == "stock-probe-c24.a1 (crash): no core file"


def _one_planned_hang_run(tmp_path):
    """probe-hang-c24-tp1's matrix file with one planned run (the one recorded in s53), so that nothing is missing."""
    text = (Path(V.__file__).resolve().parents[1] / "matrices" / f"{V.PROBE_HANG_MATRIX}.yaml").read_text()
    p = tmp_path / "m.yaml"
    p.write_text(text.replace("rounds: 3", "rounds: 1"))
    return p


def test_the_recorded_hang_probe_at_24_as_pre_registered():
    """probe-hang-c24-tp1, all three planned runs (s58) after four r0 attempts cut by the runner's deadline (s53-s56).
    Every log's first FULL step (3) diverged from layer 8: (a) held. s58's r1 crashed at its first row-0 step (281),
    its core naming the drafter's RoPE kernel: (b) and (c) held (the header leaves the timeouts out of (b)). s58's r0
    and r2 stopped after step 295, timed out 78 s and 93 s later with 0 % GPU utilization, and the dump the snapshot
    took held no kernel: (d) failed, as it had for s56's cut (83 s, 0 %). s53's and s54's call B were cut 14 s and 23 s
    after step 295, below the header's 60 s; s54's call A while it still stepped. In s53-s54 the engine core wrote no
    stacks within 5 s; from s56 on, with the watcher, it did."""
    t, facts = V.probe_hang_predictions(analysis.load_runs())
    assert list(t["held"]) == [True, True, True, False]
    cut = ("stock-probe-hang-c24.a1 (cut at the runner deadline): first FULL step 3, first diverging 3, 8 layers "
           "identical before L8 gdn")
    a = t["measured"].iloc[0].split("; ")
    assert a[:4] == [cut] * 4 and len(a) == 7 and "planned run(s) not run" not in t["measured"].iloc[0]
    assert a[4:] == [f"stock-probe-hang-c24.a{n} ({o}): first FULL step 3, first diverging 3, 8 layers identical "
                     "before L8 gdn" for n, o in ((1, "timeout"), (1, "crash"), (2, "timeout"))]
    b = t["measured"].iloc[1].split("; ")
    assert b[0] == b[2] == b[3] == ("stock-probe-hang-c24.a1 (cut at the runner deadline): not judged (row-0 step 281, "
                                    "last step 295)")
    assert b[1] == "stock-probe-hang-c24.a1 (cut at the runner deadline): not judged (row-0 step None, last step 226)"
    assert b[5] == "stock-probe-hang-c24.a1 (crash): last step 281, row-0 step 281 (sampled), core triton_poi_fused_2"
    assert t["measured"].iloc[2] == "stock-probe-hang-c24.a1 (crash): core names triton_poi_fused_2"
    d = t["measured"].iloc[3].split("; ")
    assert d[0].startswith("stock-probe-hang-c24.a1: ended by the deadline 14 s after its last step (295), GPU utilization "
                           "0/0/0 %, not judged")
    assert d[2].startswith("stock-probe-hang-c24.a1: ended by the deadline 23 s after its last step (295), GPU utilization "
                           "0/0/0 %, not judged")
    assert d[3] == "stock-probe-hang-c24.a1: ended by the deadline 83 s after its last step (295), GPU utilization 0/0/0 %"
    assert d[4] == "stock-probe-hang-c24.a1: timed out 78 s after its last step (295), GPU utilization 0/0/0 %"
    assert d[5] == "stock-probe-hang-c24.a2: timed out 93 s after its last step (295), GPU utilization 0/0/0 %"
    got = facts[["ended by", "last step", "stopped (header's rule)", "GPU utilization %"]].values.tolist()
    assert got == [["runner deadline", 295, False, "0/0/0"], ["runner deadline", 226, False, "28/26/25"],
                   ["runner deadline", 295, False, "0/0/0"], ["runner deadline", 295, True, "0/0/0"],
                   ["run timeout", 295, True, "0/0/0"], ["run timeout", 295, True, "0/0/0"]]
    assert facts["s without a step before the snapshot"].iloc[1] < 0   # a step came after the snapshot began
    assert facts["stacks"].iloc[:3].str.startswith("EngineCore: no stacks written within 5 s; worker: threading.py:355 "
                                                   "wait").all()
    assert facts["stacks"].iloc[3] == "worker: threading.py:355 wait; EngineCore: <frozen abc>:119 __instancecheck__"
    assert facts["stacks"].iloc[4:].str.endswith("EngineCore: core.py:1249 _process_engine_step").all()
    assert facts["dump"].iloc[:4].str.startswith("not asked for").all()
    assert (facts["dump"].iloc[4:] == "no CUDA kernel").all()
    assert facts["(d) held"].iloc[:3].isna().all() and (facts["(d) held"].iloc[3:] == False).all()  # noqa: E712


def test_row0_rule_leaves_a_timeout_out_instead_of_leaving_it_undecided(tmp_path):
    """(b) in probe-hang-c24-tp1's header: "A run that times out is not judged by (b)". Before s58 a timeout made (b)
    undecided for the whole matrix, so (b) could never hold while a run timed out. Now it holds over the crashes; with
    only timeouts there is nothing to judge (None)."""
    df = analysis.load_runs()
    t, _ = V.probe_hang_predictions(df)
    assert t["held"].iloc[1] is True   # s58's r1 crashed at its row-0 step; the five timeouts are left out
    # r0's lines alone (s53-s58: four deadline cuts and a timeout), against a plan of r0 only: nothing to judge
    r0 = df[(df["matrix"] != V.PROBE_HANG_MATRIX) | (df["run_id"] == "stock-probe-hang-c24/c24/r0")]
    t, _ = V.probe_hang_predictions(r0, matrix_path=_one_planned_hang_run(tmp_path))
    assert t["held"].iloc[1] is None and t["measured"].iloc[1].count("not judged") == 5


def test_hang_predictions_judge_a_stopped_run_by_its_snapshot(tmp_path):
    """(d) on the recorded line, edited: a run that timed out (run_timeout_s) counts as stopped; 0 % in a sample
    contradicts (d); utilization in every sample and a dump holding a kernel holds it; utilization with no dump taken is
    undecided; a deadline cut counts as stopped only after 60 s without a step. s56's run (83 s, 0 %: False) is left
    out, so that the edited s53 line decides (d)."""
    df = analysis.load_runs()
    df = df[(df["matrix"] != V.PROBE_HANG_MATRIX) | df["file"].astype(str).str.contains("probe-hang-c24-a-tp1")]
    m = _one_planned_hang_run(tmp_path)
    run = "stock-probe-hang-c24/c24/r0"
    h = df.at[_at(df, run, V.PROBE_HANG_MATRIX), "hang"]
    t, _ = V.probe_hang_predictions(df, matrix_path=m)
    assert list(t["held"]) == [True, None, None, None]   # one planned run: (a) held; (b) leaves a timeout out
    timed_out = _edited(df, V.PROBE_HANG_MATRIX, run, error="run exceeded 150 s")
    t, facts = V.probe_hang_predictions(timed_out, matrix_path=m)
    assert t["held"].iloc[3] is False and bool(facts["stopped (header's rule)"].iloc[0])
    busy = {**h, "gpu": {"samples": [{**s, "utilization_pct": 100.0} for s in h["gpu"]["samples"]]}}
    t, _ = V.probe_hang_predictions(_edited(timed_out, V.PROBE_HANG_MATRIX, run, hang=busy), matrix_path=m)
    assert t["held"].iloc[3] is None   # the dump was not taken
    dumped = {**busy, "core": {"core_file": "/tmp/c/core.1", "kernels": [{"kernel": "fused_moe_kernel"}]}}
    t, facts = V.probe_hang_predictions(_edited(timed_out, V.PROBE_HANG_MATRIX, run, hang=dumped), matrix_path=m)
    assert t["held"].iloc[3] is True and facts["dump"].iloc[0] == "fused_moe_kernel"
    empty = {**busy, "core": {"core_file": "/tmp/c/core.1", "kernels": []}}
    t, _ = V.probe_hang_predictions(_edited(timed_out, V.PROBE_HANG_MATRIX, run, hang=empty), matrix_path=m)
    assert t["held"].iloc[3] is False
    late = {**h, "gpu": {"samples": [{**s, "t": s["t"] + 60} for s in h["gpu"]["samples"]]}}
    t, facts = V.probe_hang_predictions(_edited(df, V.PROBE_HANG_MATRIX, run, hang=late), matrix_path=m)
    assert bool(facts["stopped (header's rule)"].iloc[0]) and t["held"].iloc[3] is False
    assert "not judged" not in t["measured"].iloc[3].split("; ")[0]   # the edited run


# --- the scheduler ledger at 24 (s56) ---------------------------------------------------------------------------------
LEDGER_RUN = "stock-probe-ledger-c24/c24/r0"


def _ledger_case(tmp_path, edit=None, matrix=V.PROBE_HANG_LEDGER_MATRICES[0]):
    """The recorded ledger run, with its ledger copied into a data folder of its own (``edit`` changes the spin line's
    requests) and, for the second ledger matrix, its line relabelled and a matrix file planning it."""
    import json
    import shutil

    df = analysis.load_runs()
    if matrix != V.PROBE_HANG_LEDGER_MATRICES[0]:   # the relabelled line stands alone (s57's own runs left out)
        df = df[df["matrix"] != matrix]
    i = _at(df, LEDGER_RUN, V.PROBE_HANG_LEDGER_MATRICES[0])
    r = df.loc[i]
    src = V.ledger_files(r)
    assert len(src) == 1
    dst = Path(tmp_path) / "data" / Path(src[0]).relative_to("data")
    dst.parent.mkdir(parents=True)
    shutil.copy(src[0], dst)
    if edit:
        lines = [json.loads(x) for x in dst.read_text().splitlines()]
        for ln in lines:
            if ln["kind"] == "spin":
                edit(ln["requests"])
        dst.write_text("".join(json.dumps(x) + "\n" for x in lines))
    m = None
    if matrix != V.PROBE_HANG_LEDGER_MATRICES[0]:
        df = df.copy()
        df.at[i, "matrix"] = matrix
        text = (Path(V.__file__).resolve().parents[1] / "matrices" / f"{V.PROBE_HANG_LEDGER_MATRICES[0]}.yaml").read_text()
        m = Path(tmp_path) / "m.yaml"
        m.write_text(text.replace(f"name: {V.PROBE_HANG_LEDGER_MATRICES[0]}", f"name: {matrix}"))
    return df, str(Path(tmp_path) / "data"), m


def test_the_recorded_ledger_run_at_24():
    """probe-hang-ledger-c24-tp1 (s56, one run): a run timeout 53 s after step 295, below the header's 60 s, so (e)
    and (f) are not judged; its ledger holds a spin of 40 s on end (lines at 10, 20 and 40 s) with three requests
    running, each at 511 of 512 output tokens and held by the async max_tokens guard, and the engine core's main
    thread in core.py's 1 ms sleep after a step that executed nothing."""
    t, facts = V.probe_hang_ledger_predictions(analysis.load_runs())
    assert list(t["held"]) == [True, None, None, None, None]
    assert t["measured"].iloc[3] == (
        "stock-probe-ledger-c24.a1 (run timeout): 53 s after its last step (295); ledger spin of 10 s with 3 running and "
        "7591 empty schedules (longest spin line 40 s); engine core main thread at core.py:1249 _process_engine_step, "
        "not judged (the header asks 60 s without a step)")
    assert t["measured"].iloc[4] == (
        "stock-probe-ledger-c24.a1 (run timeout): 16-9ee988f3 output 511 of 512, max_tokens guard; 20-97b52f8f output "
        "511 of 512, max_tokens guard; 23-93b7ef9d output 511 of 512, max_tokens guard, not judged (the header asks 60 s "
        "without a step)")
    f = facts.iloc[0]
    assert f["ended by"] == "run timeout" and not f["stopped (header's rule)"] and f["GPU utilization %"] == "0/0/0"
    assert f["engine core main thread"] == "core.py:1249 _process_engine_step <- core.py:1199 run_busy_loop"
    assert (f["spin s (first line)"], f["longest spin line s"], f["running in the spin"]) == (10.0, 40.0, 3)


def test_the_recorded_ledger2_runs_at_24():
    """probe-hang-ledger2-c24-tp1: s57's four calls each ran r0 (the first cut by the runner's deadline 9 s into the
    run; then a crash and two stops), and s58 ran r1 (a crash), so both planned runs are measured and every prediction
    held. Both crashes came at their first row-0 step (285) with the drafter's RoPE core; the two runs that stopped
    after step 295 each held the same three requests at 511 of 512 with placeholders 16 times their updates with no
    token, those updates at the probe's out-of-vocabulary steps, and the hang dump held no CUDA kernel."""
    m2 = V.PROBE_HANG_LEDGER_MATRICES[1]
    df = analysis.load_runs()
    t, facts = V.probe_hang_ledger_predictions(df, matrix=m2)
    assert len(t) == 6 and list(t["held"]) == [True] * 6
    assert not t["measured"].str.contains("planned run").any()
    crash = "stock-probe-ledger2-c24.a1 (crash): last step 285, row-0 step 285 (sampled), core triton_poi_fused_2"
    assert t["measured"].iloc[1].count(crash) == 2 and t["measured"].iloc[1].count("not judged") == 3
    assert t["measured"].iloc[5].count("16-") == 2 and "23-93ce31fb placeholders 64, 4 update(s) with no token" in t["measured"].iloc[5]
    stopped = facts[facts["stopped (header's rule)"] == True]  # noqa: E712
    assert list(stopped["s without a step before the snapshot"]) == [63.3, 71.1] and (stopped["dump"] == "no CUDA kernel").all()
    cut = facts[facts["ended by"] == "runner deadline"]
    assert len(cut) == 1 and int(cut["last step"].iloc[0]) == 12 and cut["dump"].iloc[0].startswith("not asked for")
    runs = df[(df["matrix"] == m2) & (df["outcome"] == "timeout") & ~df.apply(analysis.is_deadline_cut, axis=1)]
    for _, r in runs.iterrows():
        agree, (matched, scheduled) = V.run_ledger_agreement(r)
        assert agree["agree"].all() and matched == scheduled == 7
        assert agree["out-of-vocabulary steps"].tolist() == [[281], [280], [276, 281, 282, 288]]
        assert agree["rows"].tolist() == [[0], [13], [8, 8, 8, 3]]
    assert V.run_ledger_agreement(df[(df["matrix"] == m2) & (df["outcome"] == "crash")].iloc[0]) is None   # no spin


def test_ledger_probe_agreement_fails_where_the_steps_differ():
    """The agreement is a check, not a restatement: a no-token update moved one step, a schedule whose tokens differ
    from the probe's step, and a spin with no count (s56's ledger) read False, fewer matched, and undecided."""
    import copy

    m2 = V.PROBE_HANG_LEDGER_MATRICES[1]
    df = analysis.load_runs()
    r = df[(df["matrix"] == m2) & (df["outcome"] == "timeout") & ~df.apply(analysis.is_deadline_cut, axis=1)].iloc[0]
    lines = V.ledger_lines(r)
    probe = D.load_probe(V.run_ledger_probe(r))
    vocab = V.run_vocab_size(r)
    t, (matched, scheduled) = V.ledger_probe_agreement(lines, probe, vocab)
    assert t["agree"].all() and matched == scheduled
    moved = copy.deepcopy(lines)
    spin = next(x for x in moved if x["kind"] == "spin")
    spin["requests"][0]["empty_at"] = [n + 1 for n in spin["requests"][0]["empty_at"]]
    next(e for e in spin["ring"] if e["ev"] == "schedule" and e["tokens"])["tokens"] += 1
    t, (matched2, _) = V.ledger_probe_agreement(moved, probe, vocab)
    assert list(t["agree"]) == [False, True, True] and matched2 == matched - 1
    for q in spin["requests"]:
        del q["empty_at"]
    t, _ = V.ledger_probe_agreement(moved, probe, vocab)
    assert all(a is None for a in t["agree"])
    t, counts = V.ledger_probe_agreement([x for x in lines if x["kind"] != "spin"], probe, vocab)
    assert t.empty and counts == (0, 0)


def test_hang_dump_reads_the_stored_gdb_log(tmp_path):
    """A dump with kernels names them; one whose stored cuda-gdb log says "No CUDA kernels." reads "no CUDA kernel"; one
    without that line (or without its log) gives the snapshot's error; no core asked for gives None."""
    folder = tmp_path / "data" / "gpu" / "x"
    folder.mkdir(parents=True)
    r = {"file": "data/runs/x.jsonl", "hang": {"core": {"core_file": "/c/core.1", "kernels": [{"kernel": "k1"}],
                                                      "gdb_log": "/tmp/runlogs/e.a1.hang.core.log"}}}
    assert V.hang_dump(r, str(tmp_path / "data")) == "k1"
    r["hang"]["core"].update(kernels=[], error="cuda-gdb exited with 1")
    assert V.hang_dump(r, str(tmp_path / "data")) == "cuda-gdb exited with 1"   # no stored log
    (folder / "e.a1.hang.core.log").write_text("Opening GPU coredump: /c/core.1\nNo CUDA kernels.\n")
    assert V.hang_dump(r, str(tmp_path / "data")) == "no CUDA kernel"
    (folder / "e.a1.hang.core.log").write_text("Opening GPU coredump: /c/core.1\nvalue is not available\n")
    assert V.hang_dump(r, str(tmp_path / "data")) == "cuda-gdb exited with 1"
    assert V.hang_dump({"file": "data/runs/x.jsonl", "hang": {}}, str(tmp_path / "data")) is None


def test_ledger_predictions_judge_a_stopped_run(tmp_path):
    """(e)-(g) on the recorded line, edited to have stopped (its snapshot 10 s later): held as recorded; (e) fails for a
    main thread in the worker's step or outside the loop; (f) fails for a request that reached max_tokens; (g), on the second ledger matrix,
    is undecided without the count s56's ledger did not keep, holds for 16 placeholders per update with no token and
    fails otherwise."""
    df, data, _ = _ledger_case(tmp_path)
    i = _at(df, LEDGER_RUN, V.PROBE_HANG_LEDGER_MATRICES[0])
    h = df.at[i, "hang"]
    late = {**h, "gpu": {"samples": [{**s, "t": s["t"] + 10} for s in h["gpu"]["samples"]]}}
    stopped = _edited(df, V.PROBE_HANG_LEDGER_MATRICES[0], LEDGER_RUN, hang=late)
    t, facts = V.probe_hang_ledger_predictions(stopped, data_dir=data)
    assert list(t["held"]) == [True, None, None, True, True] and bool(facts["stopped (header's rule)"].iloc[0])
    core = next(k for k, v in late["stacks"].items() if v["process"] == "EngineCore")
    gpu_wait = {**late, "stacks": {**late["stacks"], core: {**late["stacks"][core], "main": [
        "gpu_model_runner.py:100 _to_list", "gpu_worker.py:9 execute_model", "core.py:499 step_with_batch_queue"]}}}
    t, _ = V.probe_hang_ledger_predictions(_edited(df, V.PROBE_HANG_LEDGER_MATRICES[0], LEDGER_RUN, hang=gpu_wait),
                                           data_dir=data)
    assert t["held"].iloc[3] is False   # the worker's step is still running in the engine core's thread
    no_loop = {**late, "stacks": {**late["stacks"], core: {**late["stacks"][core], "main": ["cuda.py:1 synchronize"]}}}
    t, _ = V.probe_hang_ledger_predictions(_edited(df, V.PROBE_HANG_LEDGER_MATRICES[0], LEDGER_RUN, hang=no_loop),
                                           data_dir=data)
    assert t["held"].iloc[3] is False

    def done(reqs):
        reqs[0]["out"] = 512

    df2, data2, _ = _ledger_case(tmp_path / "done", edit=done)
    t, _ = V.probe_hang_ledger_predictions(_edited(df2, V.PROBE_HANG_LEDGER_MATRICES[0], LEDGER_RUN, hang=late),
                                           data_dir=data2)
    assert t["held"].iloc[4] is False
    m2 = V.PROBE_HANG_LEDGER_MATRICES[1]
    for edit, want in ((None, None), (lambda q: [x.update(empty_updates=x["placeholders"] // 16) for x in q], True),
                       (lambda q: [x.update(empty_updates=1) for x in q], False)):
        d3, data3, m = _ledger_case(tmp_path / f"g{want}", edit=edit, matrix=m2)
        t, _ = V.probe_hang_ledger_predictions(_edited(d3, m2, LEDGER_RUN, hang=late), matrix=m2, data_dir=data3,
                                               matrix_path=m)
        assert len(t) == 6 and t["held"].iloc[5] is want, (want, t["measured"].iloc[5])


# --- trajectories at 24 and the admission test (s58) ------------------------------------------------------------------
def test_the_recorded_runs_at_24_follow_three_trajectories():
    """Read afterwards (s58), the lead of probe-admit-c24-tp1: the 15 probed stock run lines at 24 (s51-s58). Two cut
    before any NaN have no out-of-vocabulary id. The other 13 follow three trajectories, each going with the first
    step's admission count: 1 request -> b24b6dcf, crash at 285 (3 of 3); 2 or 3 -> 49d3f971, no step after 295
    (9 of 9); 4 -> 18c2a7fd, crash at 281 (1 of 1). Request 16 in row 0 at step 281 faulted only in 18c2a7fd."""
    t = V.c24_trajectories(analysis.load_runs())
    assert len(t) == 15 and t["trajectory"].isna().sum() == 2
    assert (t.loc[t["trajectory"].isna(), "ended"] == "deadline cut").all()
    assert (t["second step requests"].dropna() == 24).all()
    g = V.trajectory_groups(t).set_index("trajectory")
    assert list(g.index) == ["49d3f971", "b24b6dcf", "18c2a7fd"]
    assert g.loc["49d3f971", ["runs", "first step requests", "ended", "last step", "first row-0 step", "its request",
                              "out-of-vocabulary ids"]].tolist() == [9, "2, 3", "6 timeout, 3 deadline cut", "295",
                                                                     "281", "16", "23"]
    assert g.loc["b24b6dcf", ["runs", "first step requests", "ended", "last step", "first row-0 step", "its request",
                              "core kernels"]].tolist() == [3, "1", "3 crash", "285", "285", "17", "triton_poi_fused_2"]
    assert g.loc["18c2a7fd", ["runs", "first step requests", "ended", "last step", "first row-0 step", "its request",
                              "out-of-vocabulary ids"]].tolist() == [1, "4", "1 crash", "281", "281", "16", "15"]


def test_trajectory_id_names_the_set_not_its_order():
    import pandas as pd

    a = pd.DataFrame({"request": [3, 1, 1], "step": [7, 5, 5], "row": [0, 2, 2], "token": [1, 1, 1]})
    b = pd.DataFrame({"request": [1, 3], "step": [5, 7], "row": [4, 4], "token": [9, 9]})
    assert V.trajectory_id(a) == V.trajectory_id(b) and len(V.trajectory_id(a)) == 8
    assert V.trajectory_id(b.assign(step=[5, 8])) != V.trajectory_id(b)
    assert V.trajectory_id(b.iloc[:0]) is None


def _admit_c24_case(labels):
    """Recorded probed runs at 24 relabelled as probe-admit-c24-tp1's runs: ``labels`` maps (run file part, run_id
    suffix) to the K it is relabelled as; the first step requests recorded are what the gate would have set. The
    matrix's own recorded lines are left out, so the case is the relabelled runs alone."""
    df = analysis.load_runs()
    df = df[df["matrix"] != V.ADMIT_C24_MATRIX].copy()
    df["first_step_requests"] = df.get("first_step_requests")
    for (part, rid), k in labels.items():
        i = df.index[df["file"].astype(str).str.contains(part) & df["run_id"].str.endswith(rid)]
        assert len(i) == 1, (part, rid)
        df.loc[i, "matrix"] = V.ADMIT_C24_MATRIX
        df.loc[i, "run_id"] = f"stock-admit-k{k}-c24/c24/r0"
        df.loc[i, "first_step_requests"] = k
    return df


ADMIT_AS_RECORDED = {("probe-hang-c24-f-tp1", "r1"): 4, ("probe-hang-ledger2-c24-b-tp1", "r0"): 1,
                     ("probe-hang-ledger2-c24-c-tp1", "r0"): 3, ("probe-hang-ledger2-c24-d-tp1", "r0"): 2}


def test_admit_predictions_hold_on_runs_that_admitted_as_predicted():
    """The judge of probe-admit-c24-tp1 on four recorded runs whose first step admitted 4, 1, 3 and 2 by arrival, as
    if the gate had set it: every prediction holds (the header's lead was read from these runs, so this checks the
    judge, not the lead)."""
    t, runs = V.admit_c24_predictions(_admit_c24_case(ADMIT_AS_RECORDED))
    assert list(t["held"]) == [True, True, True, True, True], t.to_string()
    assert "ledger spin: requests [16, 20, 23] at 511 of 512, max_tokens guard" in t["measured"].iloc[3]
    assert "core triton_poi_fused_2" in t["measured"].iloc[4]
    assert sorted(runs["K"]) == [1, 2, 3, 4]


def test_admit_predictions_fail_on_another_trajectory_and_wait_for_missing_runs():
    """A run labelled K=1 that admitted 3 and followed 49d3f971 breaks (0) and (1); a planned run with no line leaves
    its row undecided and (0) too."""
    swapped = {**ADMIT_AS_RECORDED, ("probe-hang-ledger2-c24-b-tp1", "r0"): 3, ("probe-hang-ledger2-c24-c-tp1", "r0"): 1}
    t, _ = V.admit_c24_predictions(_admit_c24_case(swapped))
    assert t["held"].iloc[0] is False and t["held"].iloc[1] is False and t["held"].iloc[3] is False
    three = {k: v for k, v in ADMIT_AS_RECORDED.items() if v != 2}
    t, _ = V.admit_c24_predictions(_admit_c24_case(three))
    assert t["held"].iloc[0] is None and t["held"].iloc[2] is None and t["measured"].iloc[2] == "not run"
    assert t["held"].iloc[1] is True and "1 planned run(s) not measured" in t["measured"].iloc[0]
    df = analysis.load_runs()
    with pytest.raises(LabError, match="no run lines of probe-admit-c24-tp1"):
        V.admit_c24_predictions(df[df["matrix"] != V.ADMIT_C24_MATRIX])


S59_ADMIT = "2026-12-04_h200_probe-admit-c24-a-tp1"


def test_admit_predictions_on_s59s_cut_run():
    """probe-admit-c24-tp1's s59 call alone (later calls' lines left out): one K=4 run, cut by the runner's deadline 59
    s in, after a 434 s cold engine start. A cut is not judged, so every prediction is undecided. Its probe is still
    shown as far as it went: the gate set the first step to 4 of 24 and the second to all 24, and its out-of-vocabulary
    ids up to its last recorded step, 281 (15 ids, 13 requests, request 16's own id in row 0 at 281), are trajectory
    18c2a7fd's. 281 is the last recorded step, not the step the deadline came at (near 272): the engine kept stepping
    through the hang snapshot the runner takes before it kills it."""
    df = analysis.load_runs()
    df = df[(df["matrix"] != V.ADMIT_C24_MATRIX) | df["file"].astype(str).str.contains(S59_ADMIT)]
    t, runs = V.admit_c24_predictions(df)
    assert list(t["held"]) == [None] * 5
    assert len(runs) == 1 and runs["K"].iloc[0] == 4 and runs["ended"].iloc[0] == "deadline cut"
    r = runs.iloc[0]
    assert (r["first step requests"], r["second step requests"], r["last step"]) == (4, 24, 281)
    assert (r["trajectory"], r["out-of-vocabulary ids"], r["requests with one"]) == ("18c2a7fd", 15, 13)
    assert (r["first row-0 step"], r["row-0 how"], r["its request"]) == (281, "sampled", 16)
    assert t["measured"].iloc[4] == ("K=4: cut by the runner's deadline; last recorded step 281 (first step 4, second "
                                     "24; its out-of-vocabulary ids up to there: trajectory 18c2a7fd), not judged")
    assert t["measured"].iloc[0].endswith("; 4 planned run(s) not measured")
    assert list(t["measured"].iloc[1:4]) == ["not run"] * 3


def test_trajectories_up_to_a_step_set_a_cut_run_beside_the_prefixes():
    """up_to_step counts only the ids of steps up to it: at 281 the four-request trajectory's one run keeps its name
    (it ended there), and the runs of the other two each share one prefix that is not 18c2a7fd's, so a run cut at 281
    with 18c2a7fd's ids is told apart from them (s59's K=4 cut, nb03)."""
    df = analysis.load_runs()
    whole, pre = V.c24_trajectories(df), V.c24_trajectories(df, up_to_step=281)
    assert (pre["run"] == whole["run"]).all()
    pairs = set(zip(whole["trajectory"].dropna(), pre["trajectory"].dropna()))
    assert pairs == {("18c2a7fd", "18c2a7fd"), ("49d3f971", "364794ae"), ("b24b6dcf", "84b56e58")}
    assert (pre["out-of-vocabulary ids"].dropna() <= whole["out-of-vocabulary ids"].dropna()).all()
    assert V.c24_trajectories(df, up_to_step=0)["trajectory"].isna().all()


def test_stop_silences_of_the_timed_out_runs_at_24():
    """How long each stopped run at 24 had gone without a step when its timeout came (nb03's trajectory section):
    six timeouts, all after step 295; s51's had no hang snapshot; the shortest, s56's ledger run, 53 s."""
    t = V.stop_silences(analysis.load_runs())
    assert len(t) == 6 and set(t["last step"]) == {295}
    assert t["silent s"].isna().sum() == 1 and t["run"].iloc[0].startswith("2026-12-03_h200_probe-c24-a-tp1/")
    assert sorted(t["silent s"].dropna()) == [52.9, 63.3, 71.1, 78.5, 93.0]
    assert t.loc[t["silent s"].idxmin(), "run"].startswith("2026-12-04_h200_probe-hang-ledger-c24-a-tp1/")


def test_seq_advance_after_an_out_of_vocabulary_row():
    """The rule on a made-up probe: request 7's row at step 2 is out of vocabulary; its length stays (0) to its next
    step, where a runner placing tokens by the scheduler's count would move it by 1 + k. Request 8 moves 3 and 16."""
    probe = {"steps": [{"step": st, "reqs": [7, 8], "attn": {"attn0": {"seq_lens": lens}}}
                       for st, lens in ((1, [50, 60]), (2, [52, 63]), (3, [52, 79]))],
             "samples": {2: {"reqs": [7, 8], "first_token": [100, 5]}}}
    after, other = D.seq_advance_after_oor(probe, 100)
    assert dict(after) == {0: 1} and dict(other) == {2: 1, 3: 1, 16: 1}
    probe["steps"][2]["attn"]["attn0"]["seq_lens"] = [68, 79]
    assert dict(D.seq_advance_after_oor(probe, 100)[0]) == {16: 1}
    # in the async order a shift may show one step later: then another step moves more than 1 + k
    probe["steps"][2]["attn"]["attn0"]["seq_lens"] = [52, 79]
    probe["steps"].append({"step": 4, "reqs": [7, 8], "attn": {"attn0": {"seq_lens": [69, 80]}}})
    after, other = D.seq_advance_after_oor(probe, 100)
    assert dict(after) == {0: 1} and max(other) == 17


def test_the_runner_does_not_place_tokens_by_the_leaked_count():
    """s58, from the recorded probes at 24: of the 288 out-of-vocabulary rows (13 runs), the 232 followed by a later step
    of the same request left its target attention length unmoved to that step, and between any other two steps it moved
    1-16, never more than 1 + k: the scheduler's +16 computed tokens after such a row (asyncsched, the ledger's 575/623)
    do not reach the model runner's positions, neither at the next step nor one step later."""
    t = V.seq_advance_table(analysis.load_runs())
    assert len(t) == 13 and t["out-of-vocabulary rows"].sum() == 288
    assert t["request-steps after an out-of-vocabulary row"].sum() == 232
    assert t["advances after them"].str.fullmatch(r"0 x\d+").all()
    assert (t["other steps' advance, min"] == 1).all() and (t["other steps' advance, max"] == 16).all()


def test_admit_predictions_fail_on_a_wrong_spin_or_a_crash_off_its_row0_step(monkeypatch):
    """The ledger and row-0 halves are checked: a spin without request 23 breaks (2); a crash whose first row-0 step
    came a step before its last breaks (3); each leaves the other predictions as they were."""
    from dflash_lab import schedledger as SL

    df = _admit_c24_case(ADMIT_AS_RECORDED)
    real_spin = SL.spin_table
    monkeypatch.setattr(SL, "spin_table", lambda lines: real_spin(lines).iloc[:2])
    t, _ = V.admit_c24_predictions(df)
    assert list(t["held"]) == [True, True, False, False, True]
    monkeypatch.setattr(SL, "spin_table", real_spin)
    real_row0 = D.row0_without_token

    def early(probe, vocab, group="gdn0"):
        got = real_row0(probe, vocab, group)
        return {"step": 280, "how": "moved"} if got and got["step"] == 281 else got
    monkeypatch.setattr(D, "row0_without_token", early)
    t, runs = V.admit_c24_predictions(df)
    assert list(t["held"]) == [True, True, True, True, False]   # (2) does not read the row-0 step
    assert "first row-0 step 280 (moved" in t["measured"].iloc[4]


def test_admit_predictions_leave_out_a_startup_error_and_a_cut_without_a_probe():
    """An engine that never started ran nothing, and a deadline cut before the engine wrote its probe measured
    nothing: neither breaks the judge; the run they stand for stays to be measured."""
    from dflash_lab.runner import DEADLINE_CUT

    df = _admit_c24_case({k: v for k, v in ADMIT_AS_RECORDED.items() if v != 2})
    base = df[df["matrix"] == V.ADMIT_C24_MATRIX].iloc[0]
    extra = pd.DataFrame([{**base, "run_id": "stock-admit-k2-c24/c24/r0", "first_step_requests": 2,
                           "outcome": "startup_error", "file": "2099-01-01_h200_none-a-tp1.jsonl", "fault": None},
                          {**base, "run_id": "stock-admit-k2-c24/c24/r0", "first_step_requests": 2, "outcome": "timeout",
                           "error": f"{DEADLINE_CUT} after 3 s", "file": "2099-01-01_h200_none-b-tp1.jsonl",
                           "started_at": "2099-01-01T00:00:00+00:00", "fault": None}])
    t, runs = V.admit_c24_predictions(pd.concat([df, extra], ignore_index=True))
    assert len(runs) == 4 and runs["ended"].iloc[-1] == "deadline cut" and pd.isna(runs["trajectory"].iloc[-1])
    assert t["held"].iloc[2] is None and "cut by the runner's deadline, not judged" in t["measured"].iloc[2]
    assert t["held"].iloc[0] is None and list(t["held"].iloc[[1, 3, 4]]) == [True, True, True]

