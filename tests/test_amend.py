"""Recorded lines corrected by rule (dflash_lab.amend), on s19's own recorded files."""

import json
import shutil

import pytest

from conftest import ROOT, run_cli
from dflash_lab.amend import amend, gdb_sections
from dflash_lab.errors import LabError
from dflash_lab.runner import read_lines

I = "2026-11-30_h200_discriminate2-i-tp1"
H = "2026-11-30_h200_discriminate2-h-tp1"
SERVER = "2026-11-30_h200_server-tp1"


@pytest.fixture
def data(tmp_path):
    """data/runs as recorded before the amendment (the amended lines' as_recorded values put back), and the logs."""
    d = tmp_path / "data"
    (d / "runs").mkdir(parents=True)
    for name in (H, I, SERVER):
        lines = read_lines(ROOT / "data" / "runs" / f"{name}.jsonl")
        for l in lines:
            for a in reversed(l.pop("amended", [])):
                for k, v in a["as_recorded"].items():
                    l[k] = v
                for k in set(a.get("added", [])):
                    l.pop(k, None)
        (d / "runs" / f"{name}.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
        shutil.copy(ROOT / "data" / "runs" / f"{name}.meta.json", d / "runs")
        shutil.copytree(ROOT / "data" / "gpu" / name, d / "gpu" / name)
    return d


def _by_id(path):
    return {l["run_id"]: l for l in read_lines(path)}


def test_the_second_call_s_lines_lead_with_their_own_cores(data):
    before = _by_id(data / "runs" / f"{I}.jsonl")
    # as recorded: c28/r0 led with the first call's c24/r1 core (a device assert), though its own core says otherwise
    assert before["stock-c24-c28/c28/r0"]["fault"]["kernel"] == "triton_poi_fused_2"
    out = amend(I, data_dir=str(data))
    assert out["amended"] == [{"run_id": "stock-c24-c28/c24/r2", "rule": "stale-core"},
                              {"run_id": "stock-c24-c28/c28/r0", "rule": "stale-core"}]
    after = _by_id(data / "runs" / f"{I}.jsonl")
    f = after["stock-c24-c28/c28/r0"]["fault"]
    assert f["kernel"] == "copy_and_expand_dflash_inputs_kernel" and f["pid"] == 2783 and f["process"] == "EngineCore"
    assert f["grid"] == [28, 1, 1] and f["source"] == "utils.py:542"
    assert f["stale_cores"] == ["/tmp/cudacore/discriminate2-tp1/stock-c24-c28.a2/core.2012"] and "cores" not in f
    assert after["stock-c24-c28/c24/r2"]["fault"]["pid"] == 2438
    a = after["stock-c24-c28/c28/r0"]["amended"][0]
    assert a["rule"] == "stale-core" and a["as_recorded"]["fault"]["kernel"] == "triton_poi_fused_2"
    # lines that were right stay byte for byte
    old = (data / "runs" / f"{I}.jsonl").read_text().splitlines()
    assert json.loads(old[2]) == before["stock-c24-c28/c28/r1"]
    assert "amendments" in json.loads((data / "runs" / f"{I}.meta.json").read_text())
    # again: nothing left to amend, nothing rewritten
    text = (data / "runs" / f"{I}.jsonl").read_text()
    assert amend(I, data_dir=str(data))["amended"] == []
    assert (data / "runs" / f"{I}.jsonl").read_text() == text


def test_the_first_call_s_own_cores_stand_and_an_unnamed_assert_is_read_again(data):
    before = _by_id(data / "runs" / f"{H}.jsonl")
    assert before["stock-c24-c28/c24/r1"]["fault"]["exception"] is None   # recorded before the parser knew asserts
    assert amend(H, data_dir=str(data))["amended"] == [{"run_id": "stock-c24-c28/c24/r1", "rule": "gdb-reread"}]
    after = _by_id(data / "runs" / f"{H}.jsonl")
    f = after["stock-c24-c28/c24/r1"]["fault"]
    assert f["exception"] == "Assertion failed (device-side assert)"
    assert {k: v for k, v in f.items() if k != "exception"} == {k: v for k, v in before["stock-c24-c28/c24/r1"]["fault"].items()
                                                                 if k != "exception"}   # only the empty field filled
    for rid in ("stock-control/c32/r0", "stock-c24-c28/c24/r0"):
        assert after[rid] == before[rid]


def test_server_crash_lines_get_what_the_clients_saw(data):
    before = _by_id(data / "runs" / f"{SERVER}.jsonl")
    assert "request_errors" not in before["server-stock/c32/r1"]
    out = amend(SERVER, data_dir=str(data))["amended"]
    assert out[0] == {"run_id": "server-stock/c32/r0", "rule": "gdb-reread"}
    assert [a["run_id"] for a in out if a["rule"] == "client-view"] == [f"server-stock/c32/r{i}" for i in range(4)]
    after = _by_id(data / "runs" / f"{SERVER}.jsonl")
    for rid in ("server-stock/c32/r0", "server-stock/c32/r1", "server-stock/c32/r2", "server-stock/c32/r3"):
        l = after[rid]
        assert l["outcome"] == "crash" and l["error"] == before[rid]["error"]
        assert l["fault"]["kernel"] == before[rid]["fault"]["kernel"] and l["fault"]["pid"] == before[rid]["fault"]["pid"]
        errs = l["request_errors"]
        assert errs["failed"] + l["requests_completed"] == 32 and set(errs["by_kind"]) == {"stream_error_event"}
        assert "InternalServerError" in errs["first_error"]["stream_error_event"]["error"]
    assert after["server-stock/c16/r0"] == before["server-stock/c16/r0"]   # ok lines untouched


def test_a_line_whose_only_core_is_claimed_is_refused(data):
    p = data / "runs" / f"{I}.jsonl"
    lines = read_lines(p)
    for l in lines:
        if l["run_id"] == "stock-c24-c28/c28/r0":
            l["fault"]["cores"] = l["fault"]["cores"][:1]   # only the claimed core
    text = "".join(json.dumps(l) + "\n" for l in lines)
    p.write_text(text)
    with pytest.raises(LabError, match="no other core of its own"):
        amend(I, data_dir=str(data))
    assert p.read_text() == text   # nothing half-written


def test_missing_file_is_one_clear_error(tmp_path):
    r = run_cli("dflash_lab", "amend", "no-such-run", "--data", str(tmp_path))
    assert r.returncode == 2 and "no such recorded run file" in r.stderr


def test_gdb_sections_split_by_core():
    text = "=== /c/core.1 (process unknown)\nOpening GPU coredump: /c/core.1\nA\n=== /c/core.2 (EngineCore)\nB\n"
    assert gdb_sections(text) == {"/c/core.1": "Opening GPU coredump: /c/core.1\nA\n", "/c/core.2": "B\n"}
    assert gdb_sections("Opening GPU coredump: /c/core.9\nX\n") == {"/c/core.9": "Opening GPU coredump: /c/core.9\nX\n"}
