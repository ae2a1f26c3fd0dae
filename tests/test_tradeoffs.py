"""dflash_lab.tradeoffs (notebook 06's tables and figures) on the hand-made bench fixture (not measurements)."""

import pandas as pd
import pytest

from bench_fixture import write_fixture
from dflash_lab import bench, tradeoffs

MODE = "DFlash FULL (fixed)"


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    glob = write_fixture(tmp_path_factory.mktemp("bench"))
    return bench.cells(bench.load_bench(glob))


def test_step_fits_recover_the_fixture_step_costs(cells):
    """The fixture's DFlash step costs 12 + 0.004 x 16 c ms and a plain step 8 + 0.05 c ms (3% noise): the straight
    lines fitted on all slices find those intercepts and slopes, and the fit table says so cell by cell."""
    sf = tradeoffs.step_fits(cells, MODE)
    line = sf["fits"]["line"]
    assert sf["mode"] == MODE and set(sf["fits"]) == set(bench.STEP_MODELS)
    assert line["spec"]["a_ms"] == pytest.approx(12, rel=0.1) and line["spec"]["b_ms_per_token"] == pytest.approx(0.004, rel=0.15)
    assert line["base"]["a_ms"] == pytest.approx(8, rel=0.1) and line["base"]["b_ms_per_token"] == pytest.approx(0.05, rel=0.15)
    t = tradeoffs.fit_table(sf, MODE)
    assert set(t["mode"]) == {MODE, "no speculation"} and len(t) == len(sf["spec_pts"]) + len(sf["base_pts"])
    assert (t["fitted / measured"] - 1).abs().max() < 0.1
    w = tradeoffs.worst_fit(t)
    assert w["miss"] == pytest.approx((t["fitted / measured"] - 1).abs().max()) and w["concurrency"] in set(t["concurrency"])
    assert tradeoffs.worst_fit(t.iloc[0:0]) is None


def test_break_even_tables_put_the_model_beside_the_measured_cells(cells):
    sf = tradeoffs.step_fits(cells, MODE)
    bem, be = tradeoffs.break_even_tables(cells, MODE, sf["fits"]["line"])
    assert list(be["concurrency"]) == sorted(cells["concurrency"].unique())
    assert (be["requests running"] == be["concurrency"]).all()   # the fixture records no waiting requests
    # the measured column is the mean over acceptances of bench.break_even_measured
    c1 = bem[bem["concurrency"] == 1]["break-even acceptance length"].mean()
    assert be.set_index("concurrency").loc[1, "break-even acceptance length (measured cells)"] == pytest.approx(c1)
    # the model's break-even gives a predicted speedup of 1
    m = sf["fits"]["line"]
    for _, r in be.iterrows():
        L = r["break-even acceptance length (model)"]
        assert bench.predict_speedup(m["spec"], m["base"], L, int(r["concurrency"]), 15) == pytest.approx(1.0)


def test_same_tokens_table_pairs_steps_of_equal_target_tokens():
    ft = pd.DataFrame([
        {"mode": MODE, "concurrency": 1, "tokens per step": 16, "step ms (measured)": 7.0},
        {"mode": MODE, "concurrency": 1, "tokens per step": 16, "step ms (measured)": 9.0},
        {"mode": MODE, "concurrency": 4, "tokens per step": 64, "step ms (measured)": 12.0},
        {"mode": "no speculation", "concurrency": 16, "tokens per step": 16, "step ms (measured)": 4.0},
        {"mode": "no speculation", "concurrency": 1, "tokens per step": 1, "step ms (measured)": 4.5}])
    same = tradeoffs.same_tokens_table(ft, MODE)
    assert list(same.index) == [16]   # only 16 tokens per step is measured both ways
    assert same.loc[16, "DFlash step ms"] == 8.0 and same.loc[16, "DFlash / plain"] == 2.0
    assert same.loc[16, "plain concurrency"] == 16


def test_held_out_miss_prefers_the_cells_where_no_request_waited():
    assert tradeoffs.held_out_miss({"line": {"all": (0.3, 64), "not queued": (0.1, 8)}}, "line") == 0.1
    assert tradeoffs.held_out_miss({"line": {"all": (0.3, 64), "not queued": None}}, "line") == 0.3
    assert tradeoffs.held_out_miss({}, "line") is None


def test_figures_keep_one_colour_per_series(cells):
    """Left panel: DFlash and no speculation each in one colour (points, line, joined steps); right panel: one
    colour per concurrency for its measured curve and its dashed model curve."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    sf = tradeoffs.step_fits(cells, MODE)
    bem, _ = tradeoffs.break_even_tables(cells, MODE, sf["fits"]["line"])
    fig = tradeoffs.plot_step_model(cells, sf, "line", bem, 0.12)
    a1, a2 = fig.axes
    by_label = {ln.get_label(): to_hex(ln.get_color()) for ln in a1.get_lines()}
    assert by_label["DFlash: straight line"] == by_label["DFlash: joined measured step times"] != by_label[
        "no speculation: straight line"]
    measured = [ln for ln in a2.get_lines() if ln.get_label().endswith("(measured cells)")]
    dashed = [ln for ln in a2.get_lines() if ln.get_linestyle() == "--" and not ln.get_label().startswith("straight")
              and len(ln.get_xdata())]
    assert len(measured) == len(dashed) == len(cells["concurrency"].unique())
    assert [to_hex(x.get_color()) for x in measured] == [to_hex(x.get_color()) for x in dashed]
    assert any("missed one held-out acceptance by up to 12%" in t.get_text() for t in a2.get_legend().get_texts())
    grid = bench.speedup_grid(cells, MODE)
    heat = tradeoffs.plot_speedup_heatmap(grid, MODE)
    texts = [t.get_text() for t in heat.axes[0].texts]
    assert len(texts) == grid.size and all(t.endswith("x") or t == "crash / n.a." for t in texts)
    plt.close("all")
