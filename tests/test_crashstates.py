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
    assert r.loc["offline, TP=1", "faulting kernel (core dump)"] == "copy_and_expand_dflash_inputs_kernel"
    assert all(v == "not run" or "/" in v for v in r[32])  # a path without runs says so
