"""The upstream diff applied as a diff (dflash_lab.vllmdiff): strictly, into an overlay that leaves vLLM untouched,
and checked in the engine process."""

import difflib
import json
import os
import subprocess
import sys

import pytest

from conftest import run_fake_matrix
from dflash_lab import patch, vllmdiff
from dflash_lab.errors import LabError
from dflash_lab.runner import validate_matrix
from dflash_lab.vllm_sources import read_source

DIFF = "patches/vllm-0.22.1-dflash.diff"


def test_the_committed_diff_applies_exactly_to_vllm_0_22_1_and_gives_the_patched_files(root):
    """What the GPU's overlay runs is what the CPU tests test: the diff, applied strictly to the pinned 0.22.1
    sources, gives exactly patch.patched_source for each of its four files."""
    text = (root / DIFF).read_text()
    new = vllmdiff.apply_tree(text, read_source)
    assert sorted(new) == sorted(patch.UPSTREAM_FILES)
    for rel, t in new.items():
        assert t == patch.patched_source(rel) != read_source(rel), rel
    assert vllmdiff.hunks_sha256(text) == vllmdiff.hunks_sha256(patch.upstream_diff())


def _diff(rel, old, new, header="why\n"):
    return header + "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{rel}", f"b/{rel}"))


OLD = "".join(f"v{i} = {i}\n" for i in range(1, 30))
NEW = OLD.replace("v5 = 5\n", "v5 = 'five'\nv5b = 5\n").replace("v25 = 25\n", "")


def test_a_hunk_is_applied_at_its_own_line_numbers_only():
    d = _diff("vllm/a.py", OLD, NEW)
    assert vllmdiff.apply_tree(d, lambda rel: OLD) == {"vllm/a.py": NEW}
    # the same change, the file shifted by one line: patch(1) would apply it with an offset; this refuses it
    with pytest.raises(LabError, match=r"vllm/a.py: hunk 1 does not apply at line 2: line 2 is 'v1 = 1\\n', "
                                       r"the diff expects 'v2 = 2\\n'"):
        vllmdiff.apply_tree(d, lambda rel: "v0 = 0\n" + OLD)
    with pytest.raises(LabError, match="hunk 2 does not apply"):
        vllmdiff.apply_tree(d, lambda rel: OLD.replace("v24 = 24\n", "v24 = 'changed'\n"))


@pytest.mark.parametrize("text,msg", [
    ("only prose\n", "no '--- a/' line"),
    ("--- a/vllm/a.py\n+++ b/vllm/b.py\n@@ -1 +1 @@\n-x\n+y\n", "is not followed by"),
    ("--- a/vllm/a.py\n+++ b/vllm/a.py\n@@ -1,2 +1,2 @@\n-x\n+y\n", "ends early"),
    ("--- a/vllm/a.py\n+++ b/vllm/a.py\n", "changes no file"),
    ("--- a/vllm/a.py\n+++ b/vllm/a.py\nnot a hunk\n", "expected a hunk header"),
])
def test_a_malformed_diff_is_refused_by_name(text, msg):
    with pytest.raises(LabError, match=msg):
        vllmdiff.parse(text)


def _fake_vllm(tmp_path):
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("__version__ = '0.22.1'\n")
    (site / "vllm" / "a.py").write_text(OLD)
    (site / "vllm" / "b.py").write_text("untouched\n")
    d = tmp_path / "x.diff"
    d.write_text(_diff("vllm/a.py", OLD, NEW))
    return site, d


def test_the_overlay_changes_the_diffs_files_only_and_never_the_installed_package(tmp_path):
    site, d = _fake_vllm(tmp_path)
    ov = vllmdiff.overlay(d, package=site / "vllm", base=tmp_path / "ov")
    path = tmp_path / "ov" / os.path.basename(ov["path"])
    assert (path / "vllm" / "a.py").read_text() == NEW and (site / "vllm" / "a.py").read_text() == OLD
    assert (path / "vllm" / "b.py").read_text() == "untouched\n"
    assert os.path.samefile(path / "vllm" / "b.py", site / "vllm" / "b.py")          # linked, not copied
    assert not os.path.samefile(path / "vllm" / "a.py", site / "vllm" / "a.py")
    assert ov["reused"] is False and set(ov["files"]) == {"vllm/a.py"}
    assert vllmdiff.overlay(d, package=site / "vllm", base=tmp_path / "ov")["reused"] is True
    # the overlay comes first on PYTHONPATH: that process imports the patched file, and the check says so
    code = ("import os, vllm.a; from dflash_lab import vllmdiff; print(vllm.a.__file__); "
            "print(vllmdiff.check_loaded())")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ov["path"], str(site), os.getcwd()]),
               DFLASH_LAB_VLLM_DIFF=ov["path"])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == str(path / "vllm" / "a.py")
    assert "1 changed files as stamped" in r.stdout


def test_a_diff_that_does_not_apply_builds_nothing(tmp_path):
    site, d = _fake_vllm(tmp_path)
    (site / "vllm" / "a.py").write_text(OLD.replace("v4 = 4\n", "v4 = 'four'\n"))
    with pytest.raises(LabError, match="hunk 1 does not apply"):
        vllmdiff.overlay(d, package=site / "vllm", base=tmp_path / "ov")
    assert not (tmp_path / "ov").exists() or not any((tmp_path / "ov").iterdir())


def test_the_engine_side_check_refuses_a_process_that_imported_another_vllm(tmp_path):
    site, d = _fake_vllm(tmp_path)
    ov = vllmdiff.overlay(d, package=site / "vllm", base=tmp_path / "ov")
    code = "from dflash_lab import vllmdiff; vllmdiff.check_loaded()"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.getcwd()]), DFLASH_LAB_VLLM_DIFF=ov["path"])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "not from the overlay" in r.stderr
    # a changed file in the overlay is caught too
    (tmp_path / "ov" / os.path.basename(ov["path"]) / "vllm" / "a.py").write_text(OLD)
    env["PYTHONPATH"] = os.pathsep.join([ov["path"], str(site), os.getcwd()])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "the stamp says" in r.stderr


@pytest.mark.parametrize("eng,msg", [
    ({"vllm_diff": "patches/nope.diff", "hook": False}, "no such file"),
    ({"vllm_diff": "README.md", "hook": False}, "must be the path of a .diff file"),
    ({"vllm_diff": DIFF, "hook": False, "fix": True}, "vllm_diff and fix: true together"),
    ({"vllm_diff": DIFF}, "vllm_diff needs hook: false"),
    ({"vllm_diff": DIFF, "hook": False, "env": {"PYTHONPATH": "/x"}}, "leave it out of env"),
    ({"env": {"DFLASH_LAB_VLLM_DIFF": "/x"}}, "which the runner sets from matrix keys"),
])
def test_bad_diff_engines_are_refused(eng, msg):
    with pytest.raises(LabError, match=msg):
        validate_matrix({"engines": [{"id": "a", **eng, "runs": [{"concurrency": 1}]}]}, "m.yaml")


def _run(tmp_path, engines, site):
    from conftest import ROOT

    return run_fake_matrix(tmp_path, engines, {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT), str(ROOT / "tests")]),
                                               "TMPDIR": str(tmp_path / "tmp")})


def test_the_runner_starts_only_the_diff_engine_on_the_overlay_and_records_it(tmp_path):
    site, d = _fake_vllm(tmp_path)
    (tmp_path / "tmp").mkdir()
    lines, logs = _run(tmp_path, [{"id": "diff", "vllm_diff": str(d), "runs": [{"concurrency": 1, "rounds": 2}]},
                                  {"id": "plain", "runs": [{"concurrency": 1}]}], site)
    by = {l["run_id"]: l for l in lines}
    assert [l["outcome"] for l in lines] == ["ok"] * 3
    st = by["diff/c1/r0"]["vllm_diff_stamp"]
    assert by["diff/c1/r1"]["vllm_diff"] == str(d) and by["plain/c1/r0"]["vllm_diff"] is None
    assert "vllm_diff_stamp" not in by["plain/c1/r0"]
    assert st["hunks_sha256"] == vllmdiff.hunks_sha256(d.read_text()) and list(st["files"]) == ["vllm/a.py"]
    assert st["source"] == str((site / "vllm").resolve()) and st["path"].startswith(str(tmp_path / "tmp"))
    assert f"DFLASH_LAB_VLLM_DIFF={st['path']} PYTHONPATH={st['path']}{os.pathsep}{site}" in logs["diff"]
    assert "DFLASH_LAB_VLLM_DIFF= " in logs["plain"] and st["path"] not in logs["plain"]


def test_a_diff_that_does_not_apply_ends_its_engine_with_one_clear_line_per_run(tmp_path):
    site, d = _fake_vllm(tmp_path)
    (tmp_path / "tmp").mkdir()
    (site / "vllm" / "a.py").write_text(OLD.replace("v6 = 6\n", "v6 = 'six'\n"))
    lines, logs = _run(tmp_path, [{"id": "diff", "vllm_diff": str(d), "runs": [{"concurrency": 1, "rounds": 2}]},
                                  {"id": "plain", "runs": [{"concurrency": 1}]}], site)
    assert [(l["run_id"], l["outcome"]) for l in lines] == [
        ("diff/c1/r0", "startup_error"), ("diff/c1/r1", "startup_error"), ("plain/c1/r0", "ok")]
    assert lines[0]["error"].startswith("vllm_diff: vllm/a.py: hunk 1 does not apply at line 2: line 6 is")
    assert "diff" not in logs                                          # no engine was started for it
    assert json.dumps(lines[0])                                        # a whole line, readable


@pytest.mark.parametrize("text,msg", [
    ("why\n--- /dev/null\n+++ b/vllm/new.py\n@@ -0,0 +1 @@\n+x\n--- a/vllm/a.py\n+++ b/vllm/a.py\n@@ -1 +1 @@\n-a\n+b\n",
     "before the first '--- a/' file header"),
    ("--- a/vllm/../../etc/x\n+++ b/vllm/../../etc/x\n@@ -1 +1 @@\n-a\n+b\n", "only files inside the vllm package"),
    ("--- a/setup.py\n+++ b/setup.py\n@@ -1 +1 @@\n-a\n+b\n", "only files inside the vllm package"),
    ("--- a/vllm/a.py\n+++ b/vllm/a.py\n@@ -1,1 +1,1 @@\n-a\n-b\n+c\n", "counts 2 old and 1 new lines"),
])
def test_a_new_file_a_path_outside_vllm_or_a_miscounted_hunk_is_refused(text, msg):
    with pytest.raises(LabError, match=msg):
        vllmdiff.parse(text)


def test_overlapping_hunks_are_refused():
    h = "--- a/vllm/a.py\n+++ b/vllm/a.py\n@@ -2,2 +2,2 @@\n v2 = 2\n-v3 = 3\n+v3 = 'x'\n@@ -3,1 +3,1 @@\n-v3 = 3\n+v3 = 'y'\n"
    with pytest.raises(LabError, match="hunk 2 .* overlaps the hunk before it"):
        vllmdiff.apply_tree(h, lambda rel: OLD)


def test_a_form_feed_inside_a_line_is_not_a_line_break():
    old = "a = '\x0c'\nb = 1\n"
    d = "--- a/vllm/a.py\n+++ b/vllm/a.py\n@@ -2 +2 @@\n-b = 1\n+b = 2\n"
    assert vllmdiff.apply_tree(d, lambda rel: old) == {"vllm/a.py": "a = '\x0c'\nb = 2\n"}


def test_a_failed_build_leaves_no_scratch_and_another_overlay_is_not_overwritten(tmp_path, monkeypatch):
    site, d = _fake_vllm(tmp_path)

    def boom(src, dst):
        dst.mkdir(parents=True)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(vllmdiff, "_link_tree", boom)
    with pytest.raises(LabError, match="cannot build the vllm overlay .*No space left"):
        vllmdiff.overlay(d, package=site / "vllm", base=tmp_path / "ov")
    assert list((tmp_path / "ov").iterdir()) == []                      # the scratch folder is gone
    monkeypatch.undo()
    ov = vllmdiff.overlay(d, package=site / "vllm", base=tmp_path / "ov")
    assert ov["linked"] == 3 and ov["copied"] == 0                      # every file linked; a.py's link then replaced
    stamp = tmp_path / "ov" / os.path.basename(ov["path"]) / vllmdiff.STAMP
    st = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**st, "files": {"vllm/a.py": "0" * 64}}))
    with pytest.raises(LabError, match="an overlay with other contents is already there"):
        vllmdiff.overlay(d, package=site / "vllm", base=tmp_path / "ov")


def test_a_reinstalled_vllm_gets_an_overlay_of_its_own(tmp_path):
    site, d = _fake_vllm(tmp_path)
    rec = site / "vllm-0.22.1.dist-info" / "RECORD"
    rec.parent.mkdir()
    rec.write_text("vllm/a.py,sha256=x,1\n")
    first = vllmdiff.overlay(d, package=site / "vllm", base=tmp_path / "ov")
    rec.write_text("vllm/a.py,sha256=y,1\n")                           # the same path, another install
    second = vllmdiff.overlay(d, package=site / "vllm", base=tmp_path / "ov")
    assert first["path"] != second["path"] and not second["reused"]


def test_the_installed_package_behind_an_overlay_is_the_original(tmp_path):
    site, d = _fake_vllm(tmp_path)
    ov = vllmdiff.overlay(d, package=site / "vllm", base=tmp_path / "ov")
    code = "from dflash_lab import vllmdiff; print(vllmdiff.installed_package())"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ov["path"], str(site), os.getcwd()]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == str((site / "vllm").resolve()), r.stderr


def test_the_runners_second_diff_engine_reuses_the_overlay_and_says_so(tmp_path):
    site, d = _fake_vllm(tmp_path)
    (tmp_path / "tmp").mkdir()
    lines, logs = _run(tmp_path, [{"id": "d1", "vllm_diff": str(d), "runs": [{"concurrency": 1}]},
                                  {"id": "d2", "vllm_diff": str(d), "runs": [{"concurrency": 1}]}], site)
    assert [l["outcome"] for l in lines] == ["ok", "ok"]
    assert lines[0]["vllm_diff_stamp"]["path"] == lines[1]["vllm_diff_stamp"]["path"]
    assert len(list((tmp_path / "tmp").glob("dflash-lab-vllm-diff-*"))) == 1


def test_a_diff_line_and_a_plugin_fix_on_one_run_line_is_refused():
    from dflash_lab import analysis

    assert analysis.as_fix({"vllm_diff": DIFF, "fix": False})["fix_via"] == "upstream diff"
    assert analysis.as_fix({"fix": True})["fix_via"] == "plugin"
    with pytest.raises(LabError, match="both the upstream diff and the plugin's fix"):
        analysis.as_fix({"run_id": "x", "vllm_diff": DIFF, "fix": True})


def test_the_bench_names_a_diff_engine_apart_from_stock():
    from dflash_lab import bench

    r = {"spec_method": "dflash", "cudagraph_mode": "FULL_AND_PIECEWISE", "fix": False}
    assert bench.mode_of(r) == "DFlash FULL (stock)"
    assert bench.mode_of({**r, "vllm_diff": DIFF}) == "DFlash FULL (upstream diff)"


def test_the_findings_say_when_the_diff_has_not_run():
    import pandas as pd

    from dflash_lab import findings

    assert "has not run on the GPU" in findings._diff_line(pd.DataFrame({"matrix": ["other"]}), None)
