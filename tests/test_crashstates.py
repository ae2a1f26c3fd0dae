"""The report's crash states beside ours, and the crash rate per path, on the recorded data."""

from dflash_lab import analysis, crashstates as C


def test_side_by_side_puts_the_report_first_and_merges_identical_dumps():
    t = C.side_by_side(analysis.load_runs())
    assert list(t.columns[:2]) == ["report crash A", "report crash B"]
    assert t.loc["total_num_scheduled_tokens", "report crash B"] == 112
    ours = [c for c in t.columns if c.startswith("ours")]
    assert ours and all(t.loc["path", c] == "offline" for c in ours)
    # the CUDA_LAUNCH_BLOCKING=1 runs crashed at the very step of a run without it: one merged column
    merged = [c for c in ours if "CUDA_LAUNCH_BLOCKING=1" in t.loc["cell", c]]
    assert merged and all(";" in t.loc["cell", c] for c in merged)
    # instrumented runs (probe, canary) and fixed runs are not crash states of the product
    assert not any("probe" in c or "canary" in c for c in ours)


def test_path_rates_counts_only_natural_stock_runs():
    r = C.path_rates(analysis.load_runs()).set_index("path")
    assert list(r.index) == ["offline, TP=1", "server, TP=1", "offline, TP=2", "server, TP=2"]
    k, n = (int(x) for x in r.loc["offline, TP=1", 32].split("/"))
    assert k == n >= 8 and r.loc["offline, TP=1", 16] == "0/3"
    # counted per run (file and run id: run ids repeat across sessions); s19 added the drafter's RoPE assert
    kern = r.loc["offline, TP=1", "faulting kernel (core dump)"]
    assert kern.startswith("copy_and_expand_dflash_inputs_kernel (") and "triton_poi_fused_2 (1)" in kern
    assert all(v == "not run" or "/" in v for v in r[32])  # a path without runs says so


def test_server_path_s19():
    r = C.path_rates(analysis.load_runs()).set_index("path")
    assert r.loc["server, TP=1", 16] == "0/5" and r.loc["server, TP=1", 32] == "4/4"
    assert r.loc["server, TP=1", "faulting kernel (core dump)"] == (
        "copy_and_expand_dflash_inputs_kernel (3), triton_poi_fused_2 (1)")


def test_client_view_shows_what_the_clients_of_a_crashed_server_got():
    v = C.client_view(analysis.load_runs())
    assert len(v) == 4 and set(v["HTTP statuses"]) == {"200 x32"}
    assert all(k.startswith("stream_error_event x") for k in v["how it failed"])
    assert (v["completed"] + v["failed"] == 32).all()
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
    assert r.loc["server, TP=1", 16] == "0/5"


def test_the_dflash_kernel_grid_says_how_many_requests_were_running():
    ft = analysis.fault_table(analysis.load_runs())
    c28 = ft[ft["run"].str.startswith("stock-c24-c28/c28")]
    assert list(c28["requests in the step"]) == [28, 28, 28]     # s19: all 28 still running: early in the batch
    assert set(ft.loc[ft["faulting kernel"] == "triton_poi_fused_2", "requests in the step"].dropna()) == set()
