"""Notebooks: stored without outputs, run through papermill with other parameters, bad ones refused."""

import json

import nbformat
import papermill as pm
import pytest

from conftest import ROOT, run_cli

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
