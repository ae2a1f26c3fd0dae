"""Recorded lines corrected by rule (dflash_lab.amend), on s19's own recorded files."""

import hashlib
import json
import os
import shutil

import pytest

from conftest import ROOT, run_cli
from dflash_lab.amend import amend, gdb_sections
from dflash_lab.errors import LabError
from dflash_lab.runner import read_lines

I = "2026-11-30_h200_discriminate2-i-tp1"
H = "2026-11-30_h200_discriminate2-h-tp1"
SERVER = "2026-11-30_h200_server-tp1"
# the lines as ingested (commit 9bfba78), before any amendment: sha256 of json.dumps(lines, sort_keys=True). The fixture
# rebuilds them from the amended files' own records of what they replaced; these pin that rebuild to the originals
AS_INGESTED = {H: "8c2ed1175438cbc6dc20a1a151282874145cb2707316a21374d0ef14e4319cbc",
               I: "06ea324de0e872eb1756ab4f9000d82cb641a06ac0c970767752d0137be929f7",
               SERVER: "f58ed57ec9ed2886fe73e1cacc05bbf7b7fb91e785480e8f80968840462b763a"}


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
        assert hashlib.sha256(json.dumps(lines, sort_keys=True).encode()).hexdigest() == AS_INGESTED[name], name
        (d / "runs" / f"{name}.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
        meta = json.loads((ROOT / "data" / "runs" / f"{name}.meta.json").read_text())
        meta.pop("amendments", None)
        (d / "runs" / f"{name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
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
    # the recorded wall time measured until the earlier call's core was seen: not this run's
    assert before["stock-c24-c28/c28/r0"]["wall_s"] < 1 and after["stock-c24-c28/c28/r0"]["wall_s"] is None
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


def test_permissions_kept_and_an_interrupted_amend_is_listed_next_time(data, monkeypatch):
    from dflash_lab import amend as A

    p, meta = data / "runs" / f"{I}.jsonl", data / "runs" / f"{I}.meta.json"
    os.chmod(p, 0o444)
    real = A.atomic.write_text
    calls = []

    def die_before_meta(path, text):
        calls.append(path)
        if path.name.endswith(".meta.json"):
            raise KeyboardInterrupt   # stopped between the two writes
        real(path, text)

    monkeypatch.setattr(A.atomic, "write_text", die_before_meta)
    with pytest.raises(KeyboardInterrupt):
        amend(I, data_dir=str(data))
    assert oct(os.stat(p).st_mode & 0o777) == "0o444"            # a read-only record stays read-only
    assert "amendments" not in json.loads(meta.read_text())
    monkeypatch.setattr(A.atomic, "write_text", real)
    assert amend(I, data_dir=str(data))["amended"] == []           # the lines are done ...
    listed = json.loads(meta.read_text())["amendments"][0]["changes"]   # ... and the meta catches up
    assert {c["run_id"] for c in listed} == {"stock-c24-c28/c24/r2", "stock-c24-c28/c28/r0"}


def test_a_rank_core_of_an_earlier_line_is_claimed_too(data):
    """Tensor parallelism: an earlier line's second rank core, listed only in its fault.cores, is not a later
    line's own."""
    p = data / "runs" / f"{I}.jsonl"
    lines = read_lines(p)
    h = read_lines(data / "runs" / f"{H}.jsonl")
    c24r1 = next(l for l in h if l["run_id"] == "stock-c24-c28/c24/r1")
    # pretend c24/r1's engine also dumped core.2783 (a second rank): then c28/r0 has no core of its own left
    c24r1["fault"]["cores"] = [{"pid": 2012, "process": "EngineCore"}, {"pid": 2783, "process": "Worker_TP1"}]
    (data / "runs" / f"{H}.jsonl").write_text("".join(json.dumps(l) + "\n" for l in h))
    text = p.read_text()
    with pytest.raises(LabError, match="stock-c24-c28/c28/r0"):
        amend(I, data_dir=str(data))
    assert p.read_text() == text


TP2 = "2026-12-01_h200x2_tp2-offline-c"


def test_tp2_ranks_are_named_from_the_recorded_engine_log(tmp_path):
    """s27 (TP=2): vLLM named each worker 'Worker' before its rank was set and 'Worker_TP<n>' after; the runner
    recorded the first. The rule names both ranks of each crash from the engine log recorded beside the lines."""
    d = tmp_path / "data"
    (d / "runs").mkdir(parents=True)
    lines = read_lines(ROOT / "data" / "runs" / f"{TP2}.jsonl")
    for l in lines:   # as ingested
        for a in reversed(l.pop("amended", [])):
            l.update(a["as_recorded"])
    assert {c["process"] for l in lines if l.get("fault") for c in l["fault"]["cores"]} == {"Worker"}
    (d / "runs" / f"{TP2}.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    shutil.copytree(ROOT / "data" / "gpu" / TP2, d / "gpu" / TP2)
    out = amend(TP2, data_dir=str(d))
    assert out["amended"] == [{"run_id": "tp2-stock/c16/r1", "rule": "process-name"},
                              {"run_id": "tp2-stock/c16/r2", "rule": "process-name"}]
    after = _by_id(d / "runs" / f"{TP2}.jsonl")
    f = after["tp2-stock/c16/r1"]["fault"]
    assert (f["process"], f["pid"]) == ("Worker_TP1", 3180)
    assert [(c["process"], c["pid"]) for c in f["cores"]] == [("Worker_TP1", 3180), ("Worker_TP0", 3179)]
    assert after["tp2-stock/c16/r2"]["fault"]["process"] == "Worker_TP0"
    assert after["tp2-stock/c16/r1"]["amended"][0]["as_recorded"]["fault"]["process"] == "Worker"
    # the ok lines are untouched, and a second run finds nothing to amend
    assert "amended" not in after["tp2-stock/c32/r3"]
    assert amend(TP2, data_dir=str(d))["amended"] == []


def test_tapped_lines_learn_whether_the_build_ledger_ran_from_their_probe_log(tmp_path):
    """On recorded files: s37's probe (no ledger) and s38's (ledger on), one engine each, ingested copies."""
    d = tmp_path / "data"
    (d / "runs").mkdir(parents=True)
    expect = {"2026-12-01_h200_probe-fill-a-tp1": ("stock-taps-c16", False),
              "2026-12-02_h200_probe-builds-a-tp1": ("stock-builds-c16", True)}
    for name, (eng, _) in expect.items():
        lines = [l for l in read_lines(ROOT / "data" / "runs" / f"{name}.jsonl") if l["engine_id"] == eng]
        for l in lines:   # as ingested: before any amendment
            l.pop("probe_ledger", None)
            l.pop("amended", None)
        (d / "runs" / f"{name}.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
        src = ROOT / "data" / "gpu" / name / f"{eng}.a1.probe"
        shutil.copytree(src, d / "gpu" / name / f"{eng}.a1.probe")
    for name, (eng, ledger) in expect.items():
        out = amend(name, str(d))
        assert out["amended"] == [{"run_id": f"{eng}/c16/r0", "rule": "build-ledger"}]
        (line,) = read_lines(d / "runs" / f"{name}.jsonl")
        assert line["probe_ledger"] is ledger and line["amended"][-1]["added"] == ["probe_ledger"]
        assert amend(name, str(d))["amended"] == []   # a second run finds nothing


def test_the_client_view_reads_an_events_file_ingest_stored_compressed(data):
    """ingest keeps a JSONL file above 1 MiB xz-compressed: the events a crash line's client view comes from are read
    as stored, so a compressed one gives the same amendment as the plain file."""
    import lzma

    gpu = data / "gpu" / SERVER
    events = sorted(gpu.glob("*.events.jsonl"))
    assert events
    for ev in events:
        ev.with_name(ev.name + ".xz").write_bytes(lzma.compress(ev.read_bytes()))
        ev.unlink()
    out = amend(SERVER, data_dir=str(data))["amended"]
    assert [a["run_id"] for a in out if a["rule"] == "client-view"] == [f"server-stock/c32/r{i}" for i in range(4)]


def test_a_server_gone_after_its_run_had_no_counters_read(tmp_path):
    """s48's three stock server crashes, as ingested: the worker then put the counters read before the run in place of
    the unread ones, so each line said 0 drafts. Amended to None; the completed runs and s19's crash lines (their
    server still answered) stay byte for byte."""
    d = tmp_path / "data"
    (d / "runs").mkdir(parents=True)
    name = "2026-12-03_h200_verify-diff-server-b-tp1"
    lines = read_lines(ROOT / "data" / "runs" / f"{name}.jsonl")
    for l in lines:   # as ingested: before any amendment
        if l.get("amended"):
            l["spec_decode_metrics"] = l["amended"][0]["as_recorded"]["spec_decode_metrics"]
            l.pop("spec_counters_read", None)
            l.pop("amended")
    text = "".join(json.dumps(l) + "\n" for l in lines)
    (d / "runs" / f"{name}.jsonl").write_text(text)
    out = amend(name, str(d))
    assert out["amended"] == [{"run_id": "stock-controls/c8/r0", "rule": "unread-counters"}]
    got = {l["run_id"]: l for l in read_lines(d / "runs" / f"{name}.jsonl")}
    crash = got["stock-controls/c8/r0"]
    assert crash["spec_decode_metrics"] is None and crash["spec_counters_read"] is False
    assert crash["amended"][0]["as_recorded"]["spec_decode_metrics"]["num_drafts"] == 0
    assert all(l["spec_decode_metrics"]["num_drafts"] > 0 for k, l in got.items() if k != "stock-controls/c8/r0")
    assert amend(name, str(d))["amended"] == []   # a second run finds nothing
    # s19's crash lines were read while the server still answered: nothing to amend there
    s19 = d / "runs" / "2026-11-30_h200_server-tp1.jsonl"
    shutil.copy(ROOT / "data" / "runs" / s19.name, s19)
    assert not [c for c in amend(s19.stem, str(d))["amended"] if c["rule"] == "unread-counters"]
