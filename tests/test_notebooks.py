"""Notebooks: stored without outputs, run through papermill with other parameters, bad ones refused."""

import json
import shutil

import nbformat
import papermill as pm
import pytest

from conftest import ROOT, run_cli
from dflash_lab import bench

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_notebooks_are_stored_without_outputs():
    assert NOTEBOOKS
    for p in NOTEBOOKS:
        nb = nbformat.read(str(p), as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{p.name}: exactly one parameters cell"
        for c in nb.cells:
            if c.cell_type == "code":
                assert c.outputs == [] and c.execution_count is None, f"{p.name} has outputs"


def test_every_cell_is_there_once():
    """A notebook's cells have distinct ids and no two cells the same source: an edit that copies cells over others
    (f5c9c51 put two copies of notebook 04's greedy-output cells where a new section belonged) shows here."""
    for p in NOTEBOOKS:
        cells = json.loads(p.read_text())["cells"]
        ids = [c.get("id") for c in cells]
        assert None not in ids and len(set(ids)) == len(ids), f"{p.name}: missing or repeated cell ids"
        sources = ["".join(c["source"]).strip() for c in cells]
        repeated = {s[:60] for s in sources if s and sources.count(s) > 1}
        assert not repeated, f"{p.name}: cells repeated: {sorted(repeated)}"


def test_every_notebook_has_its_markdown_twin_with_the_same_cells():
    """notebooks/NN_name.md (jupytext) is what a review reads in a diff: it must say what the notebook runs."""
    from dflash_lab.report import pair_mismatches
    assert pair_mismatches(ROOT) == [], "run `make pair` after editing a notebook or its twin"


def test_a_twin_out_of_step_is_named(tmp_path):
    from dflash_lab.report import pair_mismatches
    d = tmp_path / "notebooks"
    d.mkdir()
    for stem in ("01_buffer_vs_capture", "05_benchmark", "06_tradeoffs"):
        for ext in (".ipynb", ".md"):
            shutil.copy(ROOT / "notebooks" / f"{stem}{ext}", d)
    assert pair_mismatches(tmp_path) == []
    md = d / "01_buffer_vs_capture.md"
    md.write_text(md.read_text().replace("max_num_seqs = 64", "max_num_seqs = 65", 1))   # the parameters cell
    (d / "06_tradeoffs.md").unlink()
    shutil.copy(ROOT / "notebooks" / "02_kernel_bounds.md", d)
    md5 = d / "05_benchmark.md"
    md5.write_text(md5.read_text().replace("requires: data/bench/*.jsonl", "requires: data/other/*.jsonl", 1))
    out = pair_mismatches(tmp_path)
    same_cells = ("the notebook and its Markdown twin have the same cells but differ in their metadata (a cell's, or "
                  "the notebook's: kernelspec, dflash_lab)")
    assert out == ["notebooks/06_tradeoffs.ipynb has no Markdown twin notebooks/06_tradeoffs.md",
                   "notebooks/02_kernel_bounds.md has no notebook notebooks/02_kernel_bounds.ipynb",
                   "notebooks/01_buffer_vs_capture: the notebook and its Markdown twin differ from cell 1 on (13 and 13 cells)",
                   f"notebooks/05_benchmark: {same_cells}"], out
    # a cell's metadata other than its tags, and the kernel papermill starts, count too
    shutil.copy(ROOT / "notebooks" / "05_benchmark.md", d)
    for change in ("cell", "kernel"):
        nb5 = nbformat.read(str(ROOT / "notebooks" / "05_benchmark.ipynb"), as_version=4)
        if change == "cell":
            nb5.cells[2].metadata["jupyter"] = {"source_hidden": True}
        else:
            nb5.metadata["kernelspec"]["name"] = "python2"
        nbformat.write(nb5, str(d / "05_benchmark.ipynb"))
        assert pair_mismatches(tmp_path)[3] == f"notebooks/05_benchmark: {same_cells}", change
    nb = nbformat.read(str(d / "01_buffer_vs_capture.ipynb"), as_version=4)
    del nb.metadata["jupytext"]
    nbformat.write(nb, str(d / "01_buffer_vs_capture.ipynb"))
    assert "is not paired" in pair_mismatches(tmp_path)[2]


def test_notebook01_with_other_parameters(tmp_path):
    res = tmp_path / "r.json"
    pm.execute_notebook(str(ROOT / "notebooks/01_buffer_vs_capture.ipynb"), str(tmp_path / "o.ipynb"),
                        parameters={"max_num_seqs": 33, "num_speculative_tokens": 3, "grid_max_num_seqs": [8, 33],
                                    "grid_k": [3, 15], "results_json": str(res)},
                        cwd=str(ROOT), progress_bar=False)
    d = json.loads(res.read_text())
    assert d["knobs"]["max_num_seqs"] == 33
    assert d["batches_over_buffer"] == [33]  # 132 query tokens replay the 136-token graph
    assert d["report_config"]["batches_padded"] == []


def test_notebook01_bad_parameter_is_one_clear_error(tmp_path):
    with pytest.raises(pm.PapermillExecutionError) as e:
        pm.execute_notebook(str(ROOT / "notebooks/01_buffer_vs_capture.ipynb"), str(tmp_path / "o.ipynb"),
                            parameters={"max_num_seqs": -3}, cwd=str(ROOT), progress_bar=False)
    assert e.value.ename == "ParameterError"
    assert "bad notebook parameter max_num_seqs=-3: must be >= 1" in e.value.evalue


def test_report_command_fails_cleanly_on_a_bad_parameter(tmp_path):
    r = run_cli("dflash_lab.report", "--out", str(tmp_path), "--only", "01_buffer_vs_capture",
                "-p", "cudagraph_mode", "SIDEWAYS")
    assert r.returncode == 1
    err = [l for l in r.stderr.splitlines() if l.startswith("dflash-lab: error:")]
    assert len(err) == 1 and "cudagraph_mode" in err[0] and "SIDEWAYS" in err[0]
    assert not (tmp_path / "01_buffer_vs_capture.html").exists()


# Notebooks 05/06 read data/bench/, which the GPU benchmark fills; here they run on hand-made lines
# (tests/bench_fixture.py, sessions labelled 'fixture-*'), figures into a temporary folder.
def _bench_nb(name, tmp_path, glob_=None, **params):
    from bench_fixture import write_fixture

    glob_ = glob_ or write_fixture(tmp_path / "bench")
    res = tmp_path / "r.json"
    pm.execute_notebook(str(ROOT / f"notebooks/{name}.ipynb"), str(tmp_path / "o.ipynb"),
                        parameters={"bench_glob": glob_, "results_json": str(res), "figures_dir": str(tmp_path / "fig"),
                                    **params}, cwd=str(ROOT), progress_bar=False)
    return json.loads(res.read_text())


def test_notebook05_on_fixture_lines(tmp_path):
    d = _bench_nb("05_benchmark", tmp_path, acceptances=[1.86, 6.0])
    assert d["sessions"] == ["fixture-a", "fixture-c"]
    rec = d["recommendations"]["1.86"]
    assert rec[0]["mode"] == "DFlash FULL (fixed)" and "DFlash FULL (stock)" in rec[0]["left out (crashed)"]
    fx_pw = d["speedups"]["DFlash FULL (fixed) / DFlash PIECEWISE"]
    assert all(1.0 < r["ratio"] < 1.2 for r in fx_pw)  # the fixture's PIECEWISE is 8% slower
    assert sorted((tmp_path / "fig").glob("05-*.png"))
    cov = d["coverage"]  # the fixture measures every cell the bench matrices plan
    assert cov["cells"] == {"planned": 90, "measured": 90, "unplanned": 0} and cov["modes"]["not_measured"] == []
    assert d["speedups_not_measured"] == []


def test_notebook05_session_alone_shows_the_acceptances_it_measured(tmp_path):
    """``-p session X`` alone: X's acceptances only (the fixture's sessions each measured one), not an error at the
    first acceptance X lacks; asking for an acceptance X did not measure is one clear parameter error."""
    d = _bench_nb("05_benchmark", tmp_path, session="fixture-b")
    assert d["sessions"] == ["fixture-b"] and list(d["recommendations"]) == ["3.6"]
    for params, message in (({"acceptances": [1.86, 3.6]}, "session='fixture-b': no cells at acceptance [1.86]; it measured [3.6]"),
                            ({"acceptances": [1.86]}, "session='fixture-b': no cells at the acceptances shown")):
        with pytest.raises(pm.PapermillExecutionError) as e:
            _bench_nb("05_benchmark", tmp_path, session="fixture-b", **params)
        assert e.value.ename == "ParameterError" and message in e.value.evalue


def _partial_slice(tmp_path):
    """s24's shape: fixed FULL and PIECEWISE at acceptance 1.86 only, one PIECEWISE run cut by the deadline."""
    from bench_fixture import write_fixture

    from dflash_lab.runner import DEADLINE_CUT

    glob_ = write_fixture(tmp_path / "bench", accs={1.86: "fixture-a"}, modes=("fixed", "piecewise"))
    f = tmp_path / "bench" / "fixture-a.jsonl"
    lines = [json.loads(l) for l in f.read_text().splitlines()]
    cut = dict(next(l for l in lines if l["run_id"] == "piecewise/c1/r2"), run_id="piecewise/c1/r3", outcome="timeout",
               error=DEADLINE_CUT, serve_metrics=None, spec_decode_metrics=None)
    f.write_text("".join(json.dumps(l) + "\n" for l in lines + [cut]))
    return glob_


def test_notebook05_on_a_partial_slice_says_what_is_not_measured_yet(tmp_path):
    d = _bench_nb("05_benchmark", tmp_path, glob_=_partial_slice(tmp_path))
    cov = d["coverage"]
    assert cov["cells"] == {"planned": 90, "measured": 12, "unplanned": 0} and cov["cut_by_deadline"] == 1
    assert cov["modes"] == {"measured": ["DFlash FULL (fixed)", "DFlash PIECEWISE"],
                            "not_measured": ["DFlash FULL (stock)", "DFlash eager", "no speculation"]}
    assert cov["acceptances"] == {"measured": [1.86], "not_measured": [3.6, 6.0]}
    assert cov["concurrencies"] == {"measured": [1, 4, 8, 16, 32, 64], "not_measured": []}
    assert list(d["speedups"]) == ["DFlash FULL (fixed) / DFlash PIECEWISE"]
    assert "DFlash FULL (fixed) / no speculation" in d["speedups_not_measured"]
    assert d["recommendations"]["1.86"][0]["mode"] == "DFlash FULL (fixed)"
    assert sorted(p.name for p in (tmp_path / "fig").glob("05-*.png")) == ["05-throughput.png", "05-tpot.png"]


def test_notebook05_shows_the_pairs_of_every_session_of_a_slice(tmp_path):
    """s24 + s25's shape: one acceptance measured in two sessions (fixed FULL + PIECEWISE; fixed FULL + no
    speculation + eager). The figures show the latest session; the speedup tables keep each session's pairs, each
    row naming its session, and pair nothing across them (PIECEWISE / no speculation stays unmeasured)."""
    from bench_fixture import write_fixture

    write_fixture(tmp_path / "bench", accs={1.86: "fixture-a"}, modes=("fixed", "piecewise"))
    glob_ = write_fixture(tmp_path / "bench", accs={1.86: "fixture-b"}, modes=("fixed", "nospec", "eager"))
    d = _bench_nb("05_benchmark", tmp_path, glob_=glob_)
    assert d["sessions"] == ["fixture-b"]
    sp = d["speedups"]
    assert {r["gpu_session"] for r in sp["DFlash FULL (fixed) / DFlash PIECEWISE"]} == {"fixture-a"}
    assert {r["gpu_session"] for r in sp["DFlash FULL (fixed) / no speculation"]} == {"fixture-b"}
    assert {r["gpu_session"] for r in sp["DFlash eager / no speculation"]} == {"fixture-b"}
    assert "DFlash PIECEWISE / no speculation" in d["speedups_not_measured"]
    # fixed FULL ran in both sessions: its drift, later over earlier, at each concurrency
    assert {(r["mode"], r["sessions"]) for r in d["drift"]} == {("DFlash FULL (fixed)", "fixture-b / fixture-a")}
    # a recommendation per session, each among its own modes
    assert list(d["recommendations_by_session"]["1.86"]) == ["fixture-a", "fixture-b"]
    assert len(d["drift"]) == 6
    # with the session parameter, that session's pairs only; its recommendation still knows what the other measured
    d = _bench_nb("05_benchmark", tmp_path, glob_=glob_, session="fixture-a")
    assert list(d["speedups"]) == ["DFlash FULL (fixed) / DFlash PIECEWISE"]
    assert list(d["recommendations_by_session"]["1.86"]) == ["fixture-a"]
    assert all(r["beaten in another session"] == "-" or "fixture-b" in r["beaten in another session"]
               for r in d["recommendations_by_session"]["1.86"]["fixture-a"])


@pytest.mark.parametrize("params, message", [
    ({"acceptances": [9.9]}, "acceptances=[9.9]: no cells at [9.9]; recorded: [1.86]"),
    ({"modes": ["DFlash eager"]}, "modes=['DFlash eager']: no cells of ['DFlash eager'] in the sessions shown"),
])
def test_notebook05_asks_for_what_the_partial_slice_lacks_in_one_line(tmp_path, params, message):
    with pytest.raises(pm.PapermillExecutionError) as e:
        _bench_nb("05_benchmark", tmp_path, glob_=_partial_slice(tmp_path), **params)
    assert e.value.ename == "ParameterError" and message in e.value.evalue


def test_notebook06_on_a_partial_slice_is_one_clear_error(tmp_path):
    from dflash_lab import bench

    glob_ = _partial_slice(tmp_path)
    with pytest.raises(pm.PapermillExecutionError) as e:
        _bench_nb("06_tradeoffs", tmp_path, glob_=glob_)
    assert e.value.ename == "LabError"
    assert e.value.evalue == ("the recorded bench data cannot render this notebook yet: "
                              + bench.tradeoffs_missing(glob_))


def test_notebook06_on_one_acceptance_renders_and_says_the_held_out_check_waits(tmp_path):
    """s25's shape: fixed FULL and no speculation at 1.86 only: the heat map, the fit, the break-even (model and
    measured cells) and the floor render; the held-out check says it needs a second acceptance."""
    from bench_fixture import write_fixture

    glob_ = write_fixture(tmp_path / "bench", accs={1.86: "fixture-a"}, modes=("fixed", "nospec"))
    d = _bench_nb("06_tradeoffs", tmp_path, glob_=glob_)
    assert d["held_out"] is None and d["holdout"] == []
    assert d["holdout_gaps"] == ["a second synthetic acceptance (recorded: 1.86)"]
    assert [r["concurrency"] for r in d["break_even_measured"]] == [1, 4, 8, 16, 32, 64]
    assert all(r["break-even acceptance length"] > 0 for r in d["break_even_measured"])
    assert sorted(p.name for p in (tmp_path / "fig").glob("06-*.png")) == ["06-speedup_heatmap.png", "06-step_model.png"]
    with pytest.raises(pm.PapermillExecutionError) as e:   # a held-out acceptance that was not recorded
        _bench_nb("06_tradeoffs", tmp_path, glob_=glob_, held_out=3.6)
    assert "held_out" in e.value.evalue and "3.6" in e.value.evalue


def test_notebook06_on_fixture_lines(tmp_path):
    d = _bench_nb("06_tradeoffs", tmp_path, held_out=3.6)
    assert d["held_out"] == 3.6 and all(abs(r["error (measured steps)"]) < 0.1 for r in d["holdout"])
    assert set(d["holdout_misses"]) == {"line", "measured steps"}
    assert d["model"] == bench.better_model({m: {k: tuple(v) if v else None for k, v in x.items()}
                                             for m, x in d["holdout_misses"].items()})
    assert 1.1 < d["floor_ms"] < 1.35
    # the DFlash step at 1 beside a plain step of the same 16 target tokens (no speculation at 16)
    assert d["same_tokens"]["dflash_c1_ms"] > 0 and d["same_tokens"]["plain_16_tokens_ms"] > 0
    assert {r["mode"] for r in d["floor_table"]} == {"DFlash FULL (fixed)", "no speculation"}
    assert [r["tokens per step"] for r in d["same_tokens_table"]] == [16, 64]   # DFlash at 1 and 4, plain at 16 and 64
    assert all(1.0 < r["break-even acceptance length (model)"] < 2.0 for r in d["break_even"])
    # the fixture's DFlash step does not depend on the acceptance: the measured cells' break-even agrees with the model
    assert all(abs(r["break-even acceptance length (measured cells)"] / r["break-even acceptance length (model)"] - 1) < 0.1
               for r in d["break_even"])
    assert d["holdout_gaps"] == []


def test_notebook05_bad_parameter_is_one_clear_error(tmp_path):
    with pytest.raises(pm.PapermillExecutionError) as e:
        _bench_nb("05_benchmark", tmp_path, modes=["DFlash warp speed"])
    assert e.value.ename == "ParameterError" and "modes=['DFlash warp speed']" in e.value.evalue


def test_report_lists_a_notebook_without_its_data_as_not_rendered(tmp_path):
    from dflash_lab.report import missing_inputs

    nb = tmp_path / "notebooks" / "05_benchmark.ipynb"
    nb.parent.mkdir()
    nb.write_text((ROOT / "notebooks" / "05_benchmark.ipynb").read_text())
    assert missing_inputs(nb, tmp_path) == "data/bench/*.jsonl"
    (tmp_path / "data" / "bench").mkdir(parents=True)
    (tmp_path / "data" / "bench" / "s.jsonl").write_text("{}\n")
    assert missing_inputs(nb, tmp_path) is None


# The report's own render, in CI: every notebook on the committed records, its claims enforced (check_claims'
# default), through the path `make report` takes (papermill, then HTML). Without this a change could leave CI green
# while `make report` fails on a sentence the data no longer supports, or on a notebook that no longer runs.
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_renders_on_the_recorded_data_with_its_claims_enforced(nb, tmp_path):
    from dflash_lab import report

    assert report.not_ready(nb, ROOT) is None, f"{nb.stem}: the committed data no longer renders it"
    # figures into a temporary folder: a test never writes into the checkout's figures/, which make report fills
    declared = report.declared_parameters(nb)
    draws = "save_fig(" in nb.read_text()
    assert not draws or "figures_dir" in declared, f"{nb.stem}: saves figures but declares no figures_dir"
    before = {p.name: p.stat().st_mtime_ns for p in (ROOT / "figures").glob("*.png")}
    ok, info = report.run_one(nb, tmp_path, {"figures_dir": str(tmp_path / "fig")} if draws else {})
    assert ok, f"{nb.stem}: {info}"
    assert {p.name: p.stat().st_mtime_ns for p in (ROOT / "figures").glob("*.png")} == before
    assert not draws or sorted((tmp_path / "fig").glob(f"{nb.stem[:2]}-*.png"))
    page = (tmp_path / f"{nb.stem}.html").read_text()
    assert "NOT supported by this data" not in page
    if "check_claims" in declared:
        assert "supported by the data: " in page, f"{nb.stem}: no claim was checked"
