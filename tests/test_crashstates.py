"""The report's crash states beside ours, and the crash rate per path, on the recorded data."""

import pytest

from dflash_lab import analysis, crashstates as C
from dflash_lab.errors import LabError


def test_side_by_side_puts_the_report_first_and_merges_identical_dumps():
    t = C.side_by_side(analysis.load_runs())
    assert list(t.columns[:2]) == ["report crash A", "report crash B"]
    assert t.loc["total_num_scheduled_tokens", "report crash B"] == 112
    ours = [c for c in t.columns if c.startswith("ours")]
    assert ours and all(t.loc["path", c] == "offline" for c in ours)
    # the CUDA_LAUNCH_BLOCKING=1 runs crashed at the very step of a run without it: one merged column
    merged = [c for c in ours if "CUDA_LAUNCH_BLOCKING=1" in t.loc["cell", c]]
    assert merged and all(";" in t.loc["cell", c] for c in merged)
    # instrumented runs (probe, canary) and fixed runs are not crash states of the product; s39's untapped engines,
    # whose only instrument is a host copy of the schedules (a matrix named probe-padding), are
    assert not any("step probe" in t.loc["cell", c] or "canary" in t.loc["cell", c] for c in ours)
    assert any("schedule snapshot" in t.loc["cell", c] for c in ours)


def test_path_rates_counts_only_natural_stock_runs():
    r = C.path_rates(analysis.load_runs()).set_index("path")
    # the crash configuration's acceptance first on each path; s21's acceptance-8.8 runs get a row of their own
    # s48: the stock server at 6.0 (beside the upstream diff's) gets its own row, never pooled with 1.86; s67: so does
    # the offline 0.22.1 control at 6.0 (release-control-0.22.1-acc6-c8-tp1: 5 runs at 8, sampled and greedy)
    assert list(r.index) == ["offline, TP=1", "offline, TP=1, acceptance 6", "offline, TP=1, acceptance 8.8",
                             "server, TP=1", "server, TP=1, acceptance 6", "offline, TP=2", "server, TP=2"]
    assert r.loc["server, TP=1, acceptance 6", 8] == "0/3"
    assert r.loc["offline, TP=1, acceptance 6", 8] == "0/5"
    k, n = C.parse_rate(r.loc["offline, TP=1", 32])
    assert k == n >= 15
    # s21: a plain c16 (keep-running core dumps are passive) joined the hooked runs, so the cell is no longer marked;
    # c8 crashed 3/3 in s20, 3/3 in s22, 1/1 in s39, 3/3 in s40 and 1/1 in s47 (the stock control beside the upstream
    # diff), where 12 and 16 complete: not monotonic
    assert r.loc["offline, TP=1", 16] == "0/8" and r.loc["offline, TP=1", 8] == "11/11" and r.loc["offline, TP=1", 12] == "0/4"
    # s22's one-run looks at 6 and 10 get columns of their own: no concurrency a stock run recorded is left out
    assert r.loc["offline, TP=1", 6] == "0/1" and r.loc["offline, TP=1", 10] == "0/1"
    assert [c for c in r.columns if isinstance(c, int)] == [1, 2, 4, 6, 8, 10, 12, 16, 20, 24, 28, 32, 64]
    # acceptance 8.8 is never pooled with 1.86: it completed at 16 and 32, and a row without crashes says so
    assert r.loc["offline, TP=1, acceptance 8.8", 32] == "0/3" and r.loc["offline, TP=1, acceptance 8.8", 16] == "0/3"
    assert r.loc["offline, TP=1, acceptance 8.8", "faulting kernel (core dump)"] == "no crash"
    assert r.loc["offline, TP=1, acceptance 8.8", "acceptance"] == "8.8" and r.loc["offline, TP=1", "acceptance"] == "1.86"
    # counted per run (file and run id: run ids repeat across sessions); s19 and s20 added the drafter's RoPE assert
    kern = r.loc["offline, TP=1", "faulting kernel (core dump)"]
    # s50's repeat at 24 (stock-c24-core-tp1) a third
    assert kern.startswith("copy_and_expand_dflash_inputs_kernel (") and "triton_poi_fused_2 (3)" in kern
    # s22: the stock control at 8 faulted first in the target's GDN kernel; s40: both snapshot engines at 8 too
    assert "fused_sigmoid_gating_delta_rule_update_kernel (4)" in kern   # and s47's control at 8
    assert all(v == "not run" or "/" in v for v in r[32])  # a path without runs says so
    assert r.loc["server, TP=1", 32] == "6/6"


def test_stock_full_keeps_the_published_drafts_runs_apart():
    """Runs of the published draft's shape (qwen36-35b-a3b-draft8, 8 layers) are another configuration: they never
    enter the assumed draft's crash counts, and target=None takes them."""
    import pandas as pd

    df = analysis.load_runs()
    one = analysis.stock_full(df).head(1)
    d8 = one.assign(target_name="qwen36-35b-a3b-draft8", run_id="d8/c32/r0")
    both = pd.concat([df, d8], ignore_index=True)
    assert len(analysis.stock_full(both)) == len(analysis.stock_full(df))
    assert len(analysis.stock_full(both, target=None)) == len(analysis.stock_full(df)) + 1
    assert set(analysis.stock_full(both, target="qwen36-35b-a3b-draft8")["run_id"]) == {"d8/c32/r0"}


def test_stock_full_keeps_one_acceptance():
    import pandas as pd

    df = analysis.load_runs()
    assert set(analysis.stock_full(df)["acceptance"]) == {1.86}
    assert {1.86, 8.8} <= set(analysis.stock_full(df, acceptance=None)["acceptance"])
    assert set(analysis.stock_full(df, acceptance=8.8)["concurrency"]) == {16, 32}
    assert analysis.same_acceptance(1.86, 1.86) and not analysis.same_acceptance(8.8, 1.86)
    assert analysis.same_acceptance("natural", "natural") and not analysis.same_acceptance([0.9, 0.8], 1.86)
    assert analysis.same_acceptance([0.9, 0.8], (0.9, 0.8)) and not analysis.same_acceptance([0.9, 0.8], [0.9])
    assert not analysis.same_acceptance(True, 1) and not analysis.same_acceptance(None, 1.86)
    assert not analysis.same_acceptance(float("nan"), float("nan")) and not analysis.same_acceptance(None, None)
    import numpy as np
    assert analysis.same_acceptance(np.float32(1.86), 1.86) and analysis.same_acceptance(2, np.int64(2))
    assert analysis.acceptance_label(analysis.acceptance_key([0.9, 0.5])) == "[0.9, 0.5]"
    assert analysis.acceptance_label(analysis.acceptance_key(float("nan"))) == "unknown"
    assert analysis.at_acceptance(df.iloc[:0], 1.86).dtype == bool   # an empty frame gives an empty mask, not columns
    assert len(pd.DataFrame(columns=df.columns)[analysis.at_acceptance(pd.DataFrame(columns=df.columns), 1.86)]) == 0


def test_parse_rate_and_the_active_instrument_mark():
    assert C.parse_rate("3/3") == (3, 3) and C.parse_rate("0/3 (launch hook)") == (0, 3)
    assert C.parse_rate("not run") is None
    import pandas as pd
    # a passive instrument (core dumps) marks nothing; one active instrument shared by every run does
    assert C._only_with(pd.DataFrame({"instruments": ["core dump on", "none"]})) == ""
    assert C._only_with(pd.DataFrame({"instruments": ["launch hook", "launch hook, CUDA_LAUNCH_BLOCKING=1"]})) == " (launch hook)"
    assert C._only_with(pd.DataFrame({"instruments": ["launch hook", "none"]})) == ""
    assert C._only_with(pd.DataFrame({"instruments": ["none"], "temperature": [0.0]})) == " (greedy)"
    assert C._only_with(pd.DataFrame({"instruments": ["none", "none"], "temperature": [0.0, 0.7]})) == ""


def test_threshold_states_s20():
    """s20 (threshold-tp1): crashes at 8, 20 and 28 with no request finishing in the crash step, and at 20 and 28 none
    finished at all: the crash needs no request to finish."""
    st = C.threshold_states(analysis.load_runs())
    assert set(st["concurrency"]) >= {8, 20, 24, 28, 32, 64}
    early = st[st["concurrency"].isin([20, 28])]
    assert len(early) >= 4 and (early["finished before the step"] == 0).all() and (early["finished since the previous step"] == 0).all()
    c8 = st[st["concurrency"] == 8]
    # three crash steps from s20, three from s22 (threshold2 and verify-fix-e's control), one from s39's untapped
    # engine with the schedule snapshot (probe-padding), three from s40's (probe-padding, snap-coredump) and one from
    # s47's control beside the upstream diff (verify-diff-controls), all alike
    assert len(c8) == 11 and set(c8["scheduled tokens"]) == {112} and (c8["finished since the previous step"] == 0).all()
    assert sorted(c8["file"].str.extract(r"_h200_(\w+?)-")[0]) == (["probe"] * 2 + ["snap"] * 2 + ["threshold"] * 3
                                                                   + ["threshold2"] * 2 + ["verify"] * 2)

    # the server's and fixed runs are not in the offline rows
    assert not st["run"].str.startswith("server").any() and not st["run"].str.startswith("fix").any()
    fig = C.plot_threshold(C.path_rates(analysis.load_runs()), st)
    assert len(fig.axes) == 2


def test_keep_running_core_dumps_print_the_device_asserts():
    """s20: with the driver's skip_abort the process lives on after the core dump and prints the failed device asserts,
    the two position-index bounds of the drafter's RoPE kernel; the runs whose process the driver ended print none.
    s22: where the core names the DFlash input kernel or the RoPE kernel, both asserts print; the c8 control whose core
    names the target's GDN kernel printed none. s40 (snap-coredump-tp1): the same split, 2 and 2; s47 (the controls beside the
    upstream diff): 2 and 1. s49 (the controls beside the diff at 64, 24 and 28): 3 and 0, the one at 24 without a core
    file (its process was gone before one was written), its asserts read from the engine log all the same. s50 (the
    controls again, and stock-c24-core's repeat at 24): 4 and 0, every one with a core (3 the DFlash input kernel, the
    repeat at 24 the RoPE kernel). s51 (the repeat's second run at 24): 1 and 0, its core the DFlash input kernel.
    s57 (probe-hang-ledger2-c24-tp1's crash at 24, under the step probe and the ledger): 1 and 0, the RoPE kernel.
    s58 (that matrix's r1, and probe-hang-c24-tp1's r1, both at 24 under the step probe): 2 and 0, the RoPE kernel.
    s62 (probe-admit-c24-tp1's K=4 and K=1 crashes at 24, under the step probe, the ledger and the admission gate): 2
    and 0, the RoPE kernel. s65 (the 0.22.1 control beside vLLM 0.26.0 at 32): 1 and 0, the DFlash input kernel."""
    ft = analysis.fault_table(analysis.load_runs())
    keep = ft[ft["cell"].str.contains("keep running")]
    # s47: the stock controls beside the upstream diff at 32, 20 and 8; s49 and s50: at 64, 24, 28; s51: 24; s57: 24;
    # s58: 24 twice; s62: 24 twice; s65: 32
    assert len(keep) == 26
    s65 = keep[keep["file"] == "2026-12-05_h200_release-control-0.22.1-c32-tp1.jsonl"]
    assert list(s65["faulting kernel"]) == ["copy_and_expand_dflash_inputs_kernel"] and (s65["cores"] == 1).all()
    s62 = keep[keep["file"] == "2026-12-05_h200_probe-admit-c24-b-tp1.jsonl"]
    assert sorted(s62["run"]) == ["stock-admit-k1-c24/c24/r0", "stock-admit-k4-c24/c24/r0"]
    assert list(s62["faulting kernel"]) == ["triton_poi_fused_2"] * 2 and (s62["cores"] == 1).all()
    assert set(s62["error line"]) == {"CUDA error: unspecified launch failure"}
    s58 = keep[keep["file"].isin(["2026-12-04_h200_probe-hang-c24-f-tp1.jsonl",
                                  "2026-12-04_h200_probe-hang-ledger2-c24-e-tp1.jsonl"])]
    assert list(s58["faulting kernel"]) == ["triton_poi_fused_2"] * 2 and (s58["cores"] == 1).all()
    s57 = keep[keep["file"] == "2026-12-04_h200_probe-hang-ledger2-c24-b-tp1.jsonl"]
    assert list(s57["faulting kernel"]) == ["triton_poi_fused_2"] and (s57["cores"] == 1).all()
    s51 = keep[keep["file"] == "2026-12-03_h200_stock-c24-core-b-tp1.jsonl"]
    assert list(s51["faulting kernel"]) == ["copy_and_expand_dflash_inputs_kernel"] and (s51["cores"] == 1).all()
    s50 = keep[keep["file"].isin(
        ["2026-12-03_h200_verify-diff-rest-c-tp1.jsonl", "2026-12-03_h200_verify-diff-rest-d-tp1.jsonl",
         "2026-12-03_h200_stock-c24-core-a-tp1.jsonl"])]
    assert sorted(s50["faulting kernel"]) == ["copy_and_expand_dflash_inputs_kernel"] * 3 + ["triton_poi_fused_2"]
    assert (s50["cores"] == 1).all()
    s49 = keep[keep["file"] == "2026-12-03_h200_verify-diff-rest-b-tp1.jsonl"].set_index("concurrency")
    assert s49.loc[24, "faulting kernel"] == "unread" and s49.loc[24, "cores"] == 0
    assert s49.loc[24, "error line"] == "CUDA error: unspecified launch failure"
    rope = analysis.compiled_kernel("triton_poi_fused_2")["device_asserts"]
    gdn = keep["faulting kernel"] == "fused_sigmoid_gating_delta_rule_update_kernel"
    assert sorted(keep.loc[gdn, "run"]) == ["stock-control-c8/c8/r0"] * 2 + ["stock-snap-core-c8/c8/r0", "stock-snap-core-c8/c8/r1"]
    assert (keep.loc[gdn, "device asserts (engine log)"] == "").all() and set(keep.loc[gdn, "concurrency"]) == {8}
    for text in keep.loc[~gdn, "device asserts (engine log)"]:
        assert all(a in text for a in rope)
    dumped = ft[ft["cell"].str.endswith("(core dump on)")]
    assert len(dumped) and (dumped["device asserts (engine log)"] == "").all()


def test_device_asserts_parses_runtime_lines():
    line = ("/x/inductor_cache/k7/ck75.py:53: unknown: block: [{b},0,0], thread: [{t},0,0] "
            "Assertion `index out of bounds: 0 <= tmp16 < 262144` failed.")
    text = "\n".join([line.format(b=0, t=1), line.format(b=0, t=2), line.format(b=3, t=1), "noise"])
    assert analysis.device_asserts(text) == [{"source": "ck75.py:53", "message": "index out of bounds: 0 <= tmp16 < 262144",
                                              "threads": 3, "blocks": 2}]
    assert analysis.device_asserts("no asserts here") == []


def test_server_path_s19_s21_s48():
    """s19 ran 4 of the server's c32 runs, s21 the fifth (another GPU session, its own file); s48's stock servers beside
    the upstream diff's added one run each at 32, 8 and 20."""
    r = C.path_rates(analysis.load_runs()).set_index("path")
    assert r.loc["server, TP=1", 16] == "0/5" and r.loc["server, TP=1", 32] == "6/6"
    assert r.loc["server, TP=1", 8] == "1/1" and r.loc["server, TP=1", 20] == "1/1"
    assert r.loc["server, TP=1", "faulting kernel (core dump)"] == (
        "copy_and_expand_dflash_inputs_kernel (6), fused_sigmoid_gating_delta_rule_update_kernel (1), triton_poi_fused_2 (1)")


def test_client_view_shows_what_the_clients_of_a_crashed_server_got():
    v = C.client_view(analysis.load_runs())
    assert len(v) == 8 and set(v["HTTP statuses"]) == {"200 x32", "200 x8", "200 x20"}   # s19: 4, s21: 1, s48: 3
    assert all(k.startswith("stream_error_event x") for k in v["how it failed"])
    assert (v["completed"] + v["failed"] == v["concurrency"]).all()
    assert all('"code": 500' in b and "InternalServerError" in b for b in v["first error body"])


def test_the_drafter_rope_kernel_is_recorded_with_its_asserts():
    k = analysis.compiled_kernel("triton_poi_fused_2")
    assert k["defined_in"] == ["eagle_head"]
    assert k["device_asserts"] and all(a.endswith("< 262144") for a in k["device_asserts"])
    # 262144: the draft's max_position_embeddings (the RoPE cos/sin cache rows), from the real-size target's text config
    from dflash_lab.models import QWEN36_TEXT
    assert QWEN36_TEXT["max_position_embeddings"] == 262144
    assert analysis.compiled_kernel("no_such_kernel") is None


def test_path_rates_key_runs_by_file_and_run_id():
    """One run id in two files (two sessions of one matrix): each file's fault counts for its own path only."""
    import pandas as pd

    df = analysis.load_runs()
    srv = df[(df["mode"] == "server") & df["crashed"]].iloc[[0]].copy()
    off = df[(df["mode"].fillna("offline") == "offline") & df["crashed"] & (df["run_id"] == "stock-control/c32/r0")].iloc[[0]].copy()
    off["fault"] = [dict(kernel="kernel_only_offline")]
    srv["fault"] = [dict(kernel="kernel_only_server")]
    srv["run_id"] = off["run_id"].values                 # the same run id on both paths
    r = C.path_rates(pd.concat([off, srv], ignore_index=True)).set_index("path")
    assert r.loc["offline, TP=1", "faulting kernel (core dump)"] == "kernel_only_offline (1)"
    assert r.loc["server, TP=1", "faulting kernel (core dump)"] == "kernel_only_server (1)"


def test_path_rates_without_any_crash():
    df = analysis.load_runs()
    ok = df[~df["crashed"]]
    r = C.path_rates(ok).set_index("path")
    assert r.loc["server, TP=1", 16] == "0/5" and r.loc["server, TP=1", "faulting kernel (core dump)"] == "no crash"


def test_the_dflash_kernel_grid_says_how_many_requests_were_running():
    ft = analysis.fault_table(analysis.load_runs())
    c28 = ft[ft["run"].str.startswith("stock-c24-c28/c28")]
    assert list(c28["requests in the step"]) == [28, 28, 28]     # s19: all 28 still running: early in the batch
    assert set(ft.loc[ft["faulting kernel"] == "triton_poi_fused_2", "requests in the step"].dropna()) == set()


def test_empty_steps_bound():
    """max_tokens 512, k 15, one step in flight when a step is scheduled: up to 528 output tokens + placeholders is
    normal; beyond, each 16 (one step's 1 + k placeholders never removed) is at least one step whose row came back empty."""
    assert C.empty_steps([0, 512, 528], 512, 15) == [0, 0, 0]
    assert C.empty_steps([529, 544, 545, 925], 512, 15) == [1, 1, 2, 25]
    assert C.empty_steps([545], 512, 15, in_flight=2) == [1]


def test_concurrency_8_crash_steps_show_many_empty_steps():
    """s20, s22, s39, s40 and s47, concurrency 8: every crash step's dump has 7 requests past the bound by 13-27 steps; the
    report's crash B and the early crashes at 20 and 28 show none."""
    st = C.threshold_states(analysis.load_runs())
    c8 = st[st["concurrency"] == 8]
    assert len(c8) == 11 and (c8["requests with empty steps"] == 7).all()
    assert sorted(c8["empty steps per request (at least)"]) == ["13..24", "16..25"] + ["16..27"] * 9
    early = st[st["concurrency"].isin([20, 28])]
    assert (early["requests with empty steps"] == 0).all()
    t = C.side_by_side(analysis.load_runs())
    assert t.loc["requests with empty steps", "report crash B"] == 0


def test_not_monotonic():
    import pandas as pd

    def runs(rates):
        return pd.DataFrame([{"concurrency": c, "crashed": i < k} for c, (k, n) in rates.items() for i in range(n)])

    # s21's offline shape: 8 crashes, 12 and 16 complete, 20 up crash again
    assert C.not_monotonic(runs({1: (0, 3), 8: (3, 3), 12: (0, 2), 16: (0, 3), 20: (3, 3), 32: (3, 3)})) == ([8], [12, 16])
    assert C.not_monotonic(runs({1: (0, 3), 8: (3, 3), 32: (3, 3)})) == ([], [])        # a clean threshold
    assert C.not_monotonic(runs({1: (0, 3), 8: (1, 3), 16: (0, 3)})) == ([], [])        # a partial rate decides nothing
    assert C.not_monotonic(runs({})) == ([], [])
    # only "crash" and "ok" decide: a concurrency with a timeout among its runs is neither crashed nor completed
    t = runs({8: (3, 3), 16: (0, 3)})
    t["outcome"] = ["crash"] * 3 + ["ok", "ok", "timeout"]
    assert C.not_monotonic(t) == ([], [])
    t["outcome"] = ["crash"] * 3 + ["ok"] * 3
    assert C.not_monotonic(t) == ([8], [16])
    off = analysis.stock_full(analysis.load_runs()).query("mode != 'server' and tensor_parallel_size == 1")
    low, mid = C.not_monotonic(off)
    assert low == [8] and mid == [10, 12, 16]
    # s22 alone shows it: 8 crashed, 6, 10, 12 and 16 completed, 20 crashed, in one GPU session
    assert C.not_monotonic(off[off["gpu_session"] == "2026-11-30-s22"]) == ([8], [10, 12, 16])


def test_log_asserts_reads_a_log_once_per_version(tmp_path, monkeypatch):
    log = tmp_path / "e.log"
    line = ("/x/k7/ck.py:53: unknown: block: [1,0,0], thread: [2,0,0] Assertion `index out of bounds: 0 <= tmp16 < 262144` "
            "failed.\n")
    log.write_text(line)
    calls = []
    real = analysis.read_text
    monkeypatch.setattr(analysis, "read_text", lambda p: calls.append(p) or real(p))
    first = analysis.log_asserts(str(log))
    assert first[0]["threads"] == 1 and analysis.log_asserts(str(log)) == first and len(calls) == 1
    first[0]["threads"] = 99                      # a caller's change does not reach the cache
    assert analysis.log_asserts(str(log))[0]["threads"] == 1
    import os
    log.write_text(line * 3)                      # a new version of the file is read again
    os.utime(log, ns=(1, 10**18))
    assert analysis.log_asserts(str(log))[0]["threads"] == 3 and len(calls) == 2


def test_path_rates_never_drop_a_run_for_its_acceptance():
    """A stock run at "natural" acceptance, a per-position list or no usable value gets a row of its own."""
    df = analysis.load_runs()
    d = df.copy()
    c12 = d.index[(d["run_id"].str.startswith("stock-threshold-mid/c12"))]
    d["acceptance"] = d["acceptance"].astype(object)
    d.loc[c12[0], "acceptance"] = "natural"
    d.at[c12[1], "acceptance"] = [0.9, 0.5]
    r = C.path_rates(d).set_index("path")
    assert r.loc["offline, TP=1", 12] == "0/2"   # s22's two plain c12 runs stay at 1.86
    assert r.loc["offline, TP=1, acceptance natural", 12] == "0/1"
    assert r.loc["offline, TP=1, acceptance [0.9, 0.5]", 12] == "0/1"
    total = lambda t: sum(C.parse_rate(v)[1] for v in t.drop(columns=["acceptance", "faulting kernel (core dump)",
                                                                     "instruments attached"]).values.ravel() if C.parse_rate(v))
    assert total(r) == total(C.path_rates(df).set_index("path"))


def test_bench_stock_s26_server_crashes_at_8():
    from dflash_lab import bench

    runs = bench.load_bench()
    row, st = C.bench_stock(runs[runs["gpu_session"] == "2026-12-01-s26"], [1, 4, 8, 16, 32])
    assert row["path"] == "server, TP=1, benchmark"
    assert row[8] == "3/3 (1 a warm-up)" and row[1] == "0/6 (3 a warm-up)" and row[32] == "not run"
    assert row["faulting kernel (core dump)"].startswith("no core dump")
    assert [s["total_num_scheduled_tokens"] for s in st] == [112] * 3
    assert [s["scheduled requests"] for s in st] == [7] * 3 and [s["num_running_reqs"] for s in st] == [7, 8, 7]
    # these crashed runs measured their acceptance (1.12-1.15 against the 1.86 setting): shown as measured, and said
    assert {s["acceptance is"] for s in st} == {"measured in the run"}
    assert sorted(s["acceptance (mean length)"] for s in st) == [1.12, 1.12, 1.15]
    # the offline crash states recorded none: the setting, said as such
    assert {s["acceptance is"] for s in C.our_states(analysis.load_runs())} == {
        "the synthetic setting (the run recorded no measurement)"}
    assert sorted(s["CUDA error"] for s in st) == ["CUBLAS_STATUS_EXECUTION_FAILED", "device-side assert triggered",
                                                  "device-side assert triggered"]
    # the warm-up's lost steps are bounded by its own max_tokens (32), the measured runs' by 512
    w = next(s for s in st if "warm-up" in s["cell"])
    assert w["empty steps per request (at least)"] == "0..4" and w["num_output_tokens"] == "40..112"
    t = C.side_by_side(analysis.load_runs(), extra=st)
    assert t.columns[-1].endswith("full-stock.a3") and t.loc["concurrency", t.columns[-1]] == 8


def test_bench_stock_is_counted_per_acceptance_and_s30_crashed_only_at_the_reports():
    """s30: stock FULL at 3.6 and 6.0 completed every run (the schedule never rejects every draft there), while its
    same-session control at 1.86 crashed at 32 with the DFlash input kernel in its core dump."""
    from dflash_lab import bench

    runs = bench.load_bench()
    rows, st = C.bench_stock_by_acceptance(runs, [8, 32, 64])
    by = {r["path"]: r for r in rows}
    assert list(by) == [f"server, TP=1, benchmark, acceptance {a}" for a in ("1.86", "3.6", "6")]
    # s31 ran 1.86's stock 32 and 64 once each: both crashed, the DFlash input kernel and the drafter's RoPE asserts
    one = by["server, TP=1, benchmark, acceptance 1.86"]
    assert (one[32], one[64]) == ("2/2", "1/1")
    assert one["faulting kernel (core dump)"].startswith("copy_and_expand_dflash_inputs_kernel (2), triton_poi_fused_2 (1)")
    three = by["server, TP=1, benchmark, acceptance 3.6"]
    assert (three[8], three[32], three[64]) == ("0/5 (2 a warm-up)", "0/6", "0/3")
    assert (by["server, TP=1, benchmark, acceptance 6"][32], by["server, TP=1, benchmark, acceptance 6"][64]) == ("0/6", "0/3")
    assert by["server, TP=1, benchmark, acceptance 6"][8] == "0/5 (2 a warm-up)"
    assert sorted(s["concurrency"] for s in st) == [8, 8, 8, 32, 32, 64]


def test_bench_stock_counts_only_stock_runs_that_finished_or_crashed():
    import pandas as pd

    rows = [("DFlash FULL (stock)", "crash", 8, False), ("DFlash FULL (stock)", "ok", 8, True),
            ("DFlash FULL (stock)", "startup_error", 8, False), ("DFlash FULL (stock)", "timeout", 16, False),
            ("DFlash FULL (fixed)", "crash", 16, False), ("no speculation", "ok", 1, False)]
    df = pd.DataFrame([{"mode": m, "outcome": o, "concurrency": c, "warmup": w, "crashed": o == "crash",
                        "cut_by_deadline": False, "tensor_parallel_size": 1, "acceptance": 1.86, "engine_log": None}
                       for m, o, c, w in rows])
    row, st = C.bench_stock(df, [1, 8, 16])
    assert (row[1], row[8], row[16]) == ("not run", "1/2 (1 a warm-up)", "0/0 (1 timed out)")
    cut = df.assign(cut_by_deadline=df["outcome"] == "timeout")   # a deadline cut is no outcome of the engine
    assert C.bench_stock(cut, [16])[0][16] == "not run"
    assert st == []   # no engine log kept: no state
    two = df.assign(engine_log="x.log", outcome="crash", crashed=True)[df["mode"] == "DFlash FULL (stock)"]
    with pytest.raises(LabError, match="one engine log for several crashes"):
        C.bench_stock(two, [8])
    assert C.bench_stock(df[df["mode"] != "DFlash FULL (stock)"], [8])[0]["faulting kernel (core dump)"] == "-"
    assert row["faulting kernel (core dump)"] == "no core dump" and row["instruments attached"] == "2 plain"
    # the s2 bench matrices take core dumps on the stock engine from s27 on: their kernels are named
    dumps = df.assign(coredump=True, fault=[{"kernel": "triton_poi_fused_2"}, None, None, None, None, None])
    extra = dumps.iloc[[0]].assign(concurrency=16, fault=[None])
    row = C.bench_stock(pd.concat([dumps, extra], ignore_index=True), [8, 16])[0]
    assert row["faulting kernel (core dump)"] == "triton_poi_fused_2 (1), no core dump (1)"
    assert row["instruments attached"] == "3 with core dump on"


def test_tp2_s27_offline_row_and_ranks():
    """s27 (nvidia-h200-x2): stock offline TP=2 crashed at 16 in every run (TP=1: 0 of 8) and once in 5 at 32;
    both ranks' cores name the same kernel in every crash."""
    df = analysis.load_runs()
    r = C.path_rates(df).set_index("path")
    assert r.loc["offline, TP=2", 16] == "3/3" and r.loc["offline, TP=2", 32] == "1/5"
    assert r.loc["offline, TP=2", "faulting kernel (core dump)"] == \
        "copy_and_expand_dflash_inputs_kernel (1), triton_poi_fused_3 (3)"
    rf = C.rank_faults(df)
    assert len(rf) == 4 and set(rf["path"]) == {"offline, TP=2"}
    assert rf["same kernel on every rank"].all() and set(rf["ranks with a core"]) == {"2 of 2"}
    assert sorted(rf["dump finished first"]) == ["Worker_TP0", "Worker_TP0", "Worker_TP1", "Worker_TP1"]
    assert all(k.startswith("Worker_TP0: ") and "; Worker_TP1: " in k for k in rf["kernel per rank"])
    # the TP=2 kernel is TP=1's drafter q/k norm + RoPE at one rank's head counts: same asserts, drafter graph only
    k2, k1 = analysis.compiled_kernel("triton_poi_fused_3"), analysis.compiled_kernel("triton_poi_fused_2")
    assert k2["defined_in"] == ["eagle_head"] and k2["device_asserts"] == k1["device_asserts"]


def test_rank_faults_says_when_a_rank_has_no_core():
    import pandas as pd
    df = analysis.load_runs()   # a recorded stock TP=2 crash line, its fault replaced
    row = df[df["run_id"] == "tp2-stock/c16/r0"].iloc[0].to_dict()
    one = dict(row, run_id="one-core", fault={"kernel": "k1", "process": "Worker_TP1", "pid": 7})
    two = dict(row, run_id="two-kernels", fault={"kernel": "k1", "process": "Worker_TP0", "pid": 8, "cores": [
        {"process": "Worker_TP0", "pid": 8, "kernel": "k1"}, {"process": "Worker_TP1", "pid": 9, "kernel": "k2"}]})
    none = dict(row, run_id="no-dump", fault=None)
    unread = dict(row, run_id="unread", fault={"kernel": None, "process": "Worker_TP0", "pid": 8, "error": "gdb", "cores": [
        {"process": "Worker_TP0", "pid": 8, "kernel": None}, {"process": "Worker_TP1", "pid": 9, "kernel": None}]})
    rf = C.rank_faults(pd.DataFrame([one, two, none, unread])).set_index("run")
    assert rf.loc["unread", "ranks with a core"] == "2 of 2" and not rf.loc["unread", "same kernel on every rank"]
    assert rf.loc["one-core", "ranks with a core"] == "1 of 2" and not rf.loc["one-core", "same kernel on every rank"]
    assert not rf.loc["two-kernels", "same kernel on every rank"]
    assert rf.loc["two-kernels", "kernel per rank"] == "Worker_TP0: k1; Worker_TP1: k2"
    assert rf.loc["no-dump", "dump finished first"] == "no core dump" and rf.loc["no-dump", "ranks with a core"] == "0 of 2"


def test_kernel_shape_diff_on_the_recorded_rope_kernels(tmp_path):
    d = analysis.kernel_shape_diff("triton_poi_fused_2", "triton_poi_fused_3")
    assert d and ("5120", "2560") in d and all(int(x) == 2 * int(y) or int(x) - 64 == 2 * (int(y) - 64) for x, y in d)
    with pytest.raises(LabError, match="not recorded"):
        analysis.kernel_shape_diff("triton_poi_fused_2", "no_such_kernel")
    # another kernel (a different operation, not only other integers) is not the same kernel
    folder = tmp_path / "x_compile-cache-t"
    folder.mkdir()
    (folder / "k_a.py").write_text("def k_a(x):\n    return x * 4\n")
    (folder / "k_b.py").write_text("def k_b(x):\n    return x + 4\n")
    (folder / "k_c.py").write_text("def k_c(x):\n    return x * 2\n")
    assert analysis.kernel_shape_diff("k_a", "k_b", data_dir=str(tmp_path)) is None
    assert analysis.kernel_shape_diff("k_a", "k_c", data_dir=str(tmp_path)) == [("4", "2")]


def test_rope_focus_solves_the_combo_grid():
    # s20's c8 core (TP=1: 32 q / 4 KV heads per rank): 112 tokens, 1024 per block -> 28 k blocks + 224 q blocks
    (x,) = C.rope_focus(252, 32, q_heads=32, kv_heads=4, tokens_per_request=16, tokens=112)
    assert (x["xblock"], x["branch"], x["token range"], x["rows"]) == (1024, "q", (2, 2), (0, 0))
    # without the step's token count the grid alone is ambiguous: every (XBLOCK, T) that fits is returned
    fits = C.rope_focus(252, 32, 32, 4, 16)
    assert len(fits) > 1 and (1024, 112) in {(f["xblock"], f["tokens"]) for f in fits}
    assert C.rope_focus(252, 32, 32, 4, 16, tokens=113) == [] and C.rope_focus(252, 300, 32, 4, 16, tokens=112) == []
    # a k-branch block: the first 28 blocks of that grid, 4 tokens each
    (k,) = C.rope_focus(252, 27, 32, 4, 16, tokens=112)
    assert (k["branch"], k["token range"], k["rows"]) == ("k", (108, 111), (6, 6))


def test_rope_focus_table_on_the_recorded_cores():
    t = C.rope_focus_table(analysis.load_runs())
    # every rank's core, read from the recorded cuda-gdb text: 4 TP=1 crashes (one core each; s50's repeat at 24 the
    # fourth), 3 TP=2 crashes x 2 ranks
    assert len(t) == 10 and sorted(t["core"][t["TP"] == 2]) == ["Worker_TP0"] * 3 + ["Worker_TP1"] * 3
    known = t[t["T (dumped step)"].notna()]
    # where the crash step was dumped (T = scheduled requests x 16): one fit, the focused block in batch row 0's q tokens
    assert len(known) == 8 and (known["batch rows"] == "0").all() and (known["branch"] == "q").all()
    assert not known["fits (XBLOCK, T)"].str.contains("), (", regex=False).any()
    # the block shapes had one XBLOCK each there (128 threads: 1024, 256: 512); applied to the two undumped cores
    rest = t[t["T (dumped step)"].isna()]
    assert list(rest["XBLOCK of that block shape where T was known"]) == [1024, 1024]
    assert (rest["batch rows at that XBLOCK"] == "0").all()


def test_bench_stock_reads_core_dumps_through_load_bench(tmp_path):
    """The s2 bench matrices take keep-running core dumps on the stock engine (from s27): the fault and the coredump
    flag of recorded bench lines must reach bench_stock through bench.load_bench."""
    import json

    from dflash_lab import bench
    from dflash_lab.runner import read_lines

    src = "data/bench/2026-12-01_h200_bench-acc1.86-s2-3-tp1.jsonl"   # s26: one stock engine start, crashed at 8
    lines = read_lines(src)
    stock = [l for l in lines if bench.mode_of(l) == C.BENCH_STOCK]
    assert any(l["outcome"] == "crash" for l in stock), src
    for l in stock:
        l["coredump"] = "keep-running"
        if l["outcome"] == "crash":
            l["fault"] = {"kernel": "copy_and_expand_dflash_inputs_kernel", "process": "EngineCore", "pid": 1}
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(l) + "\n" for l in stock))
    row, _ = C.bench_stock(bench.load_bench(str(tmp_path / "*.jsonl")), [8])
    assert row["faulting kernel (core dump)"] == f"copy_and_expand_dflash_inputs_kernel ({sum(l['outcome'] == 'crash' for l in stock)})"
    assert row["instruments attached"] == f"{sum(l['outcome'] in ('ok', 'crash') for l in stock)} with core dump on"
