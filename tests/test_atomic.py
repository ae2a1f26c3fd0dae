"""dflash_lab.atomic: what the library writes for people to read is replaced in one rename, readable as a plain
open() would have made it (not mkstemp's 0600: the rendered report was unreadable to anyone but its writer), with a
read-only record kept read-only, and nothing half-written or left behind when the write fails."""

import os
import stat

import numpy as np
import pytest

from dflash_lab import atomic, nbutil, records, report


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield 0o644
    os.umask(old)


def _mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_a_new_file_gets_the_umask_mode(tmp_path, umask022):
    p = atomic.write_text(tmp_path / "sub" / "a.html", "<p>x</p>")
    assert p.read_text() == "<p>x</p>" and _mode(p) == umask022
    assert sorted(x.name for x in p.parent.iterdir()) == ["a.html"]


def test_a_read_only_file_stays_read_only(tmp_path, umask022):
    p = tmp_path / "runs.jsonl"
    p.write_text("old\n")
    p.chmod(0o444)
    atomic.write_text(p, "new\n")
    assert p.read_text() == "new\n" and _mode(p) == 0o444


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "f.png"
    p.write_bytes(b"old")

    def boom(tmp):
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic.replace_with(p, boom, suffix=".png")
    assert p.read_bytes() == b"old" and [x.name for x in tmp_path.iterdir()] == ["f.png"]


def test_figures_and_records_are_readable_by_others(tmp_path, umask022):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1])
    png = nbutil.save_fig(fig, "99", "t", figures_dir=str(tmp_path / "figures"))
    plt.close(fig)
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and _mode(png) == umask022
    npz = tmp_path / "r" / "x.npz"
    records.save_npz_atomic(npz, {"a": np.arange(3)})
    assert (np.load(npz)["a"] == np.arange(3)).all() and _mode(npz) == umask022
    assert sorted(x.name for x in npz.parent.iterdir()) == ["x.npz"]


def test_a_rendered_notebook_is_readable_by_others(tmp_path, umask022):
    """report.run_one on a two-cell notebook, executed for real by papermill: the HTML is 0644 under umask 022."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# T\n\n## Part"),
                                         nbformat.v4.new_code_cell("print(6 * 7)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    src = tmp_path / "t.ipynb"
    nbformat.write(nb, str(src))
    out = tmp_path / "reports"
    out.mkdir()
    ok, where = report.run_one(src, out, {})
    assert ok, where
    assert "42" in open(where).read() and _mode(where) == umask022
    assert sorted(x.name for x in out.iterdir()) == ["t.html"]


def test_the_umask_is_read_not_assumed(tmp_path):
    old = os.umask(0o027)
    try:
        p = atomic.write_text(tmp_path / "a.html", "x")
        assert _mode(p) == 0o640 and atomic._umask() == 0o027
    finally:
        os.umask(old)
