"""dflash_lab.report's gating: a notebook whose data is not recorded, or not enough for it, is listed as not
rendered with why; asked for by name it runs anyway (papermill is stubbed here: nothing is executed)."""

import json
import shutil

import pytest

from conftest import ROOT
from dflash_lab import report


def _root(tmp_path, *names):
    (tmp_path / "notebooks").mkdir()
    for n in names:
        for ext in (".ipynb", ".md"):   # each notebook with its Markdown twin, as in the repository
            shutil.copy(ROOT / "notebooks" / f"{n}{ext}", tmp_path / "notebooks")
    return tmp_path


def test_a_notebook_out_of_step_with_its_twin_is_a_warning_and_still_renders(tmp_path, stubbed, capsys):
    root = _root(tmp_path, "05_benchmark", "06_tradeoffs")
    _s24_shape(root)
    (root / "notebooks" / "05_benchmark.md").unlink()
    assert report.main(["--out", str(tmp_path / "out"), "--only", "05_benchmark"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "dflash-lab: warning: notebooks/05_benchmark.ipynb has no Markdown twin notebooks/05_benchmark.md: run `make pair`"]
    assert [n for n, _ in stubbed] == ["05_benchmark"]


def _s24_shape(root):
    """Fixed FULL and PIECEWISE at acceptance 1.86 only (what data/bench held first): 05 can render, 06 cannot."""
    from test_bench import line

    d = root / "data" / "bench"
    d.mkdir(parents=True)
    lines = [line(f"{m}/c2/r0", m, 2, 10, 10) for m in ("fixed", "piecewise")]
    lines += [line(f"{m}/c{c}/r0", m, c, 100.0 * c, 10) for m in ("fixed", "piecewise") for c in (1, 4, 8)]
    (d / "s.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))


@pytest.fixture
def stubbed(monkeypatch, tmp_path):
    """report.main on a repository at tmp_path, with the notebook runs and the findings page stubbed."""
    import dflash_lab.findings

    ran = []

    def run_one(nb, out_dir, params, kernel=None):
        ran.append((nb.stem, params))
        return True, str(out_dir / f"{nb.stem}.html")

    monkeypatch.setattr(report, "repo_root", lambda: tmp_path)
    monkeypatch.setattr(report, "run_one", run_one)
    monkeypatch.setattr(dflash_lab.findings, "write_findings", lambda root, out: None)
    return ran


def test_notebook06_declares_its_readiness_function():
    meta = json.loads((ROOT / "notebooks" / "06_tradeoffs.ipynb").read_text())["metadata"]["dflash_lab"]
    assert meta["ready"] == "dflash_lab.bench:tradeoffs_missing" and meta["requires"] == "data/bench/*.jsonl"


def test_not_ready_calls_the_named_function_in_the_root_with_the_parameters_it_takes(tmp_path):
    from bench_fixture import write_fixture

    root = _root(tmp_path, "05_benchmark", "06_tradeoffs")
    nb06, nb05 = root / "notebooks" / "06_tradeoffs.ipynb", root / "notebooks" / "05_benchmark.ipynb"
    _s24_shape(root)
    why = report.not_ready(nb06, root)
    assert why.startswith("needs completed 'no speculation' cells") and "both completed without a crash" in why
    assert report.not_ready(nb05, root) is None  # no readiness function: the data glob alone decides
    # a -p parameter the function takes is passed (another glob: the fixture has all modes and acceptances);
    # one it does not take (modes, for notebook 05) is not
    fx = write_fixture(tmp_path / "fx")
    assert report.not_ready(nb06, root, {"bench_glob": fx, "modes": ["x"]}) is None
    nb = json.loads(nb06.read_text())
    nb["metadata"]["dflash_lab"]["ready"] = "dflash_lab.bench"
    nb06.write_text(json.dumps(nb))
    with pytest.raises(ValueError, match="must be 'module:function'"):
        report.not_ready(nb06, root)


def test_report_lists_a_notebook_its_data_cannot_render_yet(tmp_path, stubbed, capsys):
    root = _root(tmp_path, "05_benchmark", "06_tradeoffs")
    _s24_shape(root)
    assert report.main(["--out", str(tmp_path / "out")]) == 0
    assert [n for n, _ in stubbed] == ["05_benchmark"]
    out = capsys.readouterr().out
    line06 = [l for l in out.splitlines() if l.startswith("06_tradeoffs:")]
    assert line06 == ["06_tradeoffs: not rendered: " + report.not_ready(root / "notebooks" / "06_tradeoffs.ipynb", root)]
    index = (tmp_path / "out" / "index.html").read_text()
    assert "06_tradeoffs</code> <span style=\"color:#555\">(not rendered: needs completed" in index
    assert "failed" not in index


def test_report_runs_a_notebook_named_with_only_whatever_its_data(tmp_path, stubbed):
    root = _root(tmp_path, "05_benchmark", "06_tradeoffs")
    _s24_shape(root)
    assert report.main(["--out", str(tmp_path / "out"), "--only", "06_tradeoffs", "-p", "held_out", "1.86"]) == 0
    assert stubbed == [("06_tradeoffs", {"held_out": 1.86})]


def test_a_parameter_no_notebook_declares_is_refused_before_anything_runs(tmp_path, stubbed, capsys):
    """A typo (-p max_num_seq 33) ran the defaults before, with papermill's warning only: now one line, a non-zero
    exit, nothing run and no page written."""
    root = _root(tmp_path, "05_benchmark", "06_tradeoffs")
    _s24_shape(root)
    with pytest.raises(SystemExit) as e:
        report.main(["--out", str(tmp_path / "out"), "--only", "06_tradeoffs", "-p", "held_ot", "1.86"])
    msg = str(e.value.code)
    assert msg.startswith("dflash-lab: error: no notebook run here has a parameter named held_ot (their parameters: "
                          "06_tradeoffs: ") and "held_out" in msg and "\n" not in msg
    assert stubbed == [] and not (tmp_path / "out").exists()


def test_each_notebook_gets_the_parameters_it_declares(tmp_path, stubbed):
    """-p session applies to 05 and 06, which declare it; held_out to 06 alone, not injected into 05."""
    root = _root(tmp_path, "05_benchmark", "06_tradeoffs")
    _s24_shape(root)
    assert {"session", "held_out"} <= set(report.declared_parameters(root / "notebooks" / "06_tradeoffs.ipynb"))
    assert "held_out" not in report.declared_parameters(root / "notebooks" / "05_benchmark.ipynb")
    assert report.main(["--out", str(tmp_path / "out"), "--only", "05_benchmark", "06_tradeoffs",
                        "-p", "held_out", "1.86", "-p", "session", "x"]) == 0
    assert stubbed == [("05_benchmark", {"session": "x"}), ("06_tradeoffs", {"held_out": 1.86, "session": "x"})]


def test_declared_parameters_are_read_by_pythons_parser(tmp_path):
    """Papermill's line parser drops a line with a second '=' (notebook 02's discard_prob has one in its comment):
    the names come from the cell's syntax tree, so such a parameter is not refused as unknown."""
    import nbformat

    assert "discard_prob" in report.declared_parameters(ROOT / "notebooks" / "02_kernel_bounds.ipynb")
    cell = nbformat.v4.new_code_cell("a = dict(x=1)  # x == 1\nb: int = 2\nc, d = 3, 4\nprint(a)\n")
    cell.metadata["tags"] = ["parameters"]
    nb = tmp_path / "t.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), str(nb))
    assert report.declared_parameters(nb) == ["a", "b", "c", "d"]
    cell.source = "a = (\n"
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), str(nb))
    with pytest.raises(SystemExit, match="t.ipynb: its parameters cell is not valid Python"):
        report.declared_parameters(nb)


def test_report_without_data_and_with_a_broken_readiness_check(tmp_path, stubbed, capsys):
    root = _root(tmp_path, "05_benchmark", "06_tradeoffs")
    assert report.main(["--out", str(tmp_path / "out")]) == 0  # no data/bench: both listed, neither run
    assert stubbed == []
    assert "06_tradeoffs: not rendered: its data (data/bench/*.jsonl) is not recorded yet" in capsys.readouterr().out
    from test_bench import line

    _s24_shape(root)
    (root / "data" / "bench" / "bad.jsonl").write_text(json.dumps(dict(line("x", "fixed", 1, 1, 1), mode="offline")) + "\n")
    assert report.main(["--out", str(tmp_path / "out")]) == 1  # the check's own error fails that notebook only
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "notebook 06_tradeoffs: readiness check failed: LabError:" in err[0]
    assert "not a server-mode run" in err[0]
    assert [n for n, _ in stubbed] == ["05_benchmark"]  # the others still run (05 would fail on that line itself)
    assert "(failed: readiness check: LabError:" in (tmp_path / "out" / "index.html").read_text()


def test_a_rendered_notebook_opens_with_a_contents_list_of_its_sections():
    """nbconvert's headings (ids, anchor links) become a nested contents list under the title: h3 inside the h2 before
    it, the anchor's pilcrow and any markup left out of the text; a page with fewer than 3 sections is left as it is."""
    import re

    def h(level, hid, text):
        return f'<h{level} id="{hid}">{text}<a class="anchor-link" href="#{hid}">&#182;</a></h{level}>'

    body = ("<html><body>" + h(1, "t", "03 · Title") + "<p>intro</p>" + h(3, "early", "Before any h2")
            + h(2, "a", "Matrix: <code>crashed</code> runs") + h(3, "a1", "At 8") + h(3, "a2", "At 20 &amp; 28")
            + h(2, "b", "Status") + "</body></html>")
    out = report.with_contents(body)
    nav = re.search(r'<details class="dflash-lab-contents" open>(.*?)</details>', out, re.S).group(1)
    assert out.index("</h1>") < out.index("<details") < out.index("<p>intro</p>")
    assert re.findall(r'href="#([^"]+)">([^<]*)<', nav) == [
        ("early", "Before any h2"), ("a", "Matrix: crashed runs"), ("a1", "At 8"), ("a2", "At 20 &amp; 28"),
        ("b", "Status")]
    assert nav.count("<ul>") == nav.count("</ul>") == 2 and nav.count("<li>") == nav.count("</li>") == 5
    assert "&#182;" not in nav
    assert out.replace(re.search(r"<details.*?</details>", out, re.S).group(0), "") == body
    few = "<h1>t</h1>" + h(2, "a", "A") + h(2, "b", "B")
    assert report.with_contents(few) == few and report.with_contents(h(2, "a", "A") * 4) == h(2, "a", "A") * 4
