"""scripts/gpu/host-runs.sh: a call's runs stay on the GPU host, so the next call of the same matrix there (sent in one
batch with it, SKIP_HOST=1) continues the matrix instead of running its measured runs again."""

import json
import os
import shutil
import subprocess

import pytest
import yaml

from conftest import run_cli
from dflash_lab.runner import read_lines

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def sh(root, tmp_path, *args):
    return subprocess.run(["bash", str(root / "scripts" / "gpu" / "host-runs.sh"), *args], capture_output=True,
                          text=True, env=dict(os.environ, HOST_RUNS=str(tmp_path / "kept")), timeout=60)


def listed(root, tmp_path, name):
    r = sh(root, tmp_path, "list", name)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_keep_and_list(root, tmp_path):
    assert listed(root, tmp_path, "m") == []                       # a fresh host: nothing kept, nothing left out
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "nothing kept" in sh(root, tmp_path, "keep", "m", str(empty)).stdout
    assert "nothing kept" in sh(root, tmp_path, "keep", "m", str(tmp_path / "missing.jsonl")).stdout
    assert listed(root, tmp_path, "m") == []
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"run_id": "e/c1/r0"}\n')
    b.write_text('{"run_id": "e/c1/r1"}\n')
    for f in (a, b):
        assert sh(root, tmp_path, "keep", "m", str(f)).returncode == 0
    assert sh(root, tmp_path, "keep", "m-tp1", str(a)).returncode == 0
    got = listed(root, tmp_path, "m")
    assert len(got) == 2 and [open(f).read() for f in got] == [a.read_text(), b.read_text()]   # oldest first
    assert len(listed(root, tmp_path, "m-tp1")) == 1                 # m's list does not take m-tp1's file, nor back
    assert not list((tmp_path / "kept").glob("*.part"))
    for bad in (("keep", "../x", str(a)), ("list", "a b"), ("what",)):
        r = sh(root, tmp_path, *bad)
        assert r.returncode == 2 and "host-runs.sh:" in r.stderr


def test_a_second_call_continues_with_what_the_first_kept(root, tmp_path):
    m = {"name": "t", "worker": "fake_worker", "run_timeout_s": 4, "startup_timeout_s": 4,
         "defaults": {"target": "tiny-dense"},
         "engines": [{"id": "e1", "runs": [{"concurrency": 2, "rounds": 2}]}]}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(m))
    out1 = tmp_path / "o1.jsonl"
    r = run_cli("dflash_lab", "run", str(path), "--out", str(out1), timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    assert sh(root, tmp_path, "keep", "t", str(out1)).returncode == 0
    m["engines"].append({"id": "e2", "runs": [{"concurrency": 2}]})    # the rest of the matrix
    path.write_text(yaml.safe_dump(m))
    out2 = tmp_path / "o2.jsonl"
    r = run_cli("dflash_lab", "run", str(path), "--out", str(out2), "--skip-done", *listed(root, tmp_path, "t"),
                timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    assert [l["run_id"] for l in read_lines(out2)] == ["e2/c2/r0"] and "2 run(s) already measured" in r.stdout
    assert json.loads(open(listed(root, tmp_path, "t")[0]).readline())["run_id"] == "e1/c2/r0"
