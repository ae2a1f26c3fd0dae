import json
import tarfile

import pytest

from dflash_lab.errors import LabError
from dflash_lab.ingest import ingest


def make_out(tmp_path, lines):
    out = tmp_path / "OUT"
    out.mkdir()
    (out / "runs.jsonl").write_text(lines)
    logs = tmp_path / "runlogs"
    (logs / "e.a1.hook").mkdir(parents=True)
    (logs / "e.a1.log").write_text("engine log\n")
    (logs / "e.a1.hook" / "stats-1.json").write_text("{}")
    with tarfile.open(out / "logs.tgz", "w:gz") as tf:
        tf.add(logs, arcname="runlogs")
    return out


def test_ingest_then_refuse_to_overwrite(tmp_path):
    out = make_out(tmp_path, json.dumps({"run_id": "a", "outcome": "ok"}) + "\n")
    data = tmp_path / "data"
    data.mkdir()
    meta = ingest(str(out), "s1", data_dir=str(data))
    assert meta["lines"] == 1 and (data / "runs" / "s1.jsonl").exists()
    assert (data / "gpu" / "s1" / "e.a1.hook" / "stats-1.json").exists()
    with pytest.raises(LabError, match="already exists"):
        ingest(str(out), "s1", data_dir=str(data))


def test_corrupt_runs_write_nothing(tmp_path):
    out = make_out(tmp_path, '{"run_id": "a", "outcome": "ok"}\nnot json\n')
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(LabError, match="runs.jsonl:2"):
        ingest(str(out), "s2", data_dir=str(data))
    assert not (data / "runs").exists() and not (data / "gpu").exists()
    assert list(data.iterdir()) == []


def test_large_probe_log_kept_xz_compressed_and_readable(tmp_path):
    from dflash_lab.divergence import load_probe
    from dflash_lab.ingest import XZ_ABOVE

    out = tmp_path / "OUT"
    out.mkdir()
    (out / "runs.jsonl").write_text(json.dumps({"run_id": "a", "outcome": "ok", "gpu_session": "S"}) + "\n")
    probe = tmp_path / "runlogs" / "e.a1.probe"
    probe.mkdir(parents=True)
    step = {"step": 1, "mode": "FULL", "pad": "x" * 2000}
    n = XZ_ABOVE // 2000 + 10
    (probe / "probe-7.jsonl").write_text("".join(json.dumps({**step, "step": i}) + "\n" for i in range(n)))
    with tarfile.open(out / "logs.tgz", "w:gz") as tf:
        tf.add(tmp_path / "runlogs", arcname="runlogs")
    data = tmp_path / "data"
    data.mkdir()
    meta = ingest(str(out), "s3", data_dir=str(data))
    kept = data / "gpu" / "s3" / "e.a1.probe" / "probe-7.jsonl.xz"
    assert kept.exists() and kept.stat().st_size < XZ_ABOVE // 10
    assert not kept.with_suffix("").exists() and not kept.with_suffix(".gz").exists()
    assert "e.a1.probe/probe-7.jsonl.xz" in meta["files"]
    assert meta["gpu_session"] == "S"  # taken from the lines
    assert [s["step"] for s in load_probe(str(kept))["steps"]] == list(range(n))


def test_gpu_session_label_must_agree_with_the_lines(tmp_path):
    out = make_out(tmp_path, json.dumps({"run_id": "a", "outcome": "ok", "gpu_session": "S1"}) + "\n")
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(LabError, match="GPU session"):
        ingest(str(out), "s4", data_dir=str(data), gpu_session="S2")
    assert list(data.iterdir()) == []
    meta = ingest(str(out), "s4", data_dir=str(data), gpu_session="S1")
    assert json.loads((data / "runs" / "s4.meta.json").read_text())["gpu_session"] == "S1" == meta["gpu_session"]


def test_load_runs_takes_the_session_from_meta(tmp_path):
    from dflash_lab.analysis import load_runs

    with open("data/runs/2026-11-30_h200_verify-fix-b-tp1.jsonl") as f:  # a recorded line, session unset
        line = json.loads(f.readline())
    line.pop("gpu_session", None)
    out = make_out(tmp_path, json.dumps(line) + "\n")
    data = tmp_path / "data"
    data.mkdir()
    ingest(str(out), "s5", data_dir=str(data), gpu_session="L")
    df = load_runs(str(data / "runs" / "*.jsonl"))
    assert list(df["gpu_session"]) == ["L"]


def test_corrupt_gzip_log_is_named(tmp_path):
    from dflash_lab.runner import json_lines

    bad = tmp_path / "probe-1.jsonl.gz"
    bad.write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(LabError, match="probe-1.jsonl.gz: not a readable gzip"):
        list(json_lines(bad))
    bad_xz = tmp_path / "probe-2.jsonl.xz"
    bad_xz.write_bytes(b"\xfd7zXZ\x00 not really xz")
    with pytest.raises(LabError, match="probe-2.jsonl.xz: not a readable xz"):
        list(json_lines(bad_xz))


def test_engine_logs_read_through_the_same_reader(tmp_path):
    """analysis.read_text (engine logs) and json_lines (run and probe lines) share one decompressing reader: a log's
    stray bytes are replaced, a corrupt compressed log is named, a missing one stays FileNotFoundError (bench's
    reader skips those)."""
    import gzip
    import lzma

    from dflash_lab.analysis import read_text

    raw = b"ok \xff line\n"
    (tmp_path / "a.log").write_bytes(raw)
    (tmp_path / "b.log.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "c.log.xz").write_bytes(lzma.compress(raw))
    for name in ("a.log", "b.log.gz", "c.log.xz"):
        assert read_text(str(tmp_path / name)) == "ok \ufffd line\n"
    (tmp_path / "d.log.gz").write_bytes(b"\x1f\x8b broken")
    with pytest.raises(LabError, match="d.log.gz: not a readable gzip"):
        read_text(str(tmp_path / "d.log.gz"))
    with pytest.raises(FileNotFoundError):
        read_text(str(tmp_path / "missing.log"))
    (tmp_path / "e.jsonl").write_bytes(b'{"a": "\xff"}\n')
    from dflash_lab.runner import json_lines

    with pytest.raises(LabError, match="e.jsonl: not UTF-8"):
        list(json_lines(tmp_path / "e.jsonl"))


def test_recorded_gzipped_probe_logs_still_read(tmp_path):
    """Probe logs ingested before s35 are .gz: the readers keep taking them."""
    import gzip

    from dflash_lab.divergence import load_probe

    lines = "".join(json.dumps({"step": i, "mode": "FULL"}) + "\n" for i in range(3))
    gz = tmp_path / "s" / "e.a1.probe" / "probe-1.jsonl.gz"
    gz.parent.mkdir(parents=True)
    gz.write_bytes(gzip.compress(lines.encode()))
    assert [s["step"] for s in load_probe(str(gz))["steps"]] == [0, 1, 2]


def test_bench_ingest_needs_server_lines_and_a_session(tmp_path):
    srv = {"run_id": "a", "outcome": "ok", "mode": "server"}
    out = make_out(tmp_path, json.dumps(srv) + "\n")
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(LabError, match="GPU session label"):
        ingest(str(out), "b1", data_dir=str(data), kind="bench")
    ingest(str(out), "b1", data_dir=str(data), kind="bench", gpu_session="S")
    assert (data / "bench" / "b1.jsonl").exists() and not (data / "runs").exists()
    out2 = tmp_path / "o2"
    out2.mkdir()
    (out2 / "runs.jsonl").write_text(json.dumps({"run_id": "b", "outcome": "ok", "mode": "offline"}) + "\n")
    with pytest.raises(LabError, match="server-mode"):
        ingest(str(out2), "b2", data_dir=str(data), kind="bench", gpu_session="S")


def test_a_later_call_of_the_same_session_does_not_record_earlier_logs_again(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for k in "123":
        (tmp_path / k).mkdir()
    first = make_out(tmp_path / "1", json.dumps({"run_id": "a", "outcome": "ok", "gpu_session": "S"}) + "\n")
    ingest(str(first), "call1", data_dir=str(data), gpu_session="S")
    # the second call's host folder still holds call 1's engine log (identical) beside its own
    second = make_out(tmp_path / "2", json.dumps({"run_id": "b", "outcome": "ok", "gpu_session": "S"}) + "\n")
    logs = tmp_path / "2" / "runlogs"
    (logs / "f.a1.log").write_text("engine f\n")
    with tarfile.open(second / "logs.tgz", "w:gz") as tf:
        tf.add(logs, arcname="runlogs")
    meta = ingest(str(second), "call2", data_dir=str(data), gpu_session="S")
    assert meta["files"] == ["f.a1.log"]
    assert sorted(meta["already_recorded"]) == ["e.a1.hook/stats-1.json (byte-identical to call1/e.a1.hook/stats-1.json)",
                                                "e.a1.log (byte-identical to call1/e.a1.log)"]
    assert not (data / "gpu" / "call2" / "e.a1.log").exists() and (data / "gpu" / "call2" / "f.a1.log").exists()
    # another GPU session keeps its own copy: its files are its evidence
    third = make_out(tmp_path / "3", json.dumps({"run_id": "c", "outcome": "ok", "gpu_session": "T"}) + "\n")
    meta3 = ingest(str(third), "call3", data_dir=str(data), gpu_session="T")
    assert "e.a1.log" in meta3["files"] and "already_recorded" not in meta3


def _tgz(path, members):
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tf:
        for name, text in members.items():
            b = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(b)
            tf.addfile(info, io.BytesIO(b))


def test_a_reproducer_run_over_several_calls_is_recorded_whole(tmp_path):
    import pytest

    from dflash_lab.errors import LabError
    from dflash_lab.ingest import ingest_repro

    c1, c2, data = tmp_path / "c1", tmp_path / "c2", tmp_path / "data"
    c1.mkdir(), c2.mkdir()
    (c1 / "repro_min.json").write_text(json.dumps({"verdict_line": "INCONCLUSIVE: fixed not run", "vllm": "0.22.1"}))
    (c1 / "workdir.txt").write_text("/tmp/repro-min-x\n")
    (c1 / "notes.txt").write_text("not a reproducer file\n")
    _tgz(c1 / "children.tgz", {"./stock.log": "early\n"})
    (c2 / "repro_min.rejudged.json").write_text(json.dumps({"verdict_line": "REPRODUCED: all three"}))
    run = {"vllm": "0.22.1", "started_at": "2026-12-01T00:42:00Z", "command": "python3 scripts/repro_min.py",
           "workdir": "/tmp/repro-min-x"}
    _tgz(c2 / "children.tgz", {"./run.json": json.dumps(run), "./stock.log": "late\n", "./core.nvcudmp": "x",
                               "./stock.started.json": json.dumps({"startup_s": 147.9}),
                               "./fixed.json": json.dumps({"role": "fixed", "gpu": "NVIDIA H200",
                                                           "versions": {"torch": "2.11.0", "triton": "3.6.0"}})})
    meta = ingest_repro([(str(c1), "cmd one"), (str(c2), "cmd two")], "r1", data_dir=str(data),
                        gpu_session="s", git_commit="abc", provenance={"driver": "580"})
    d = data / "gpu" / "r1"
    assert (d / "verdict.txt").read_text() == "REPRODUCED: all three\n"
    assert meta["judged"] == "by scripts/repro_min.py on the GPU host (--rejudge, call 2)"
    assert (d / "children" / "stock.log").read_text() == "late\n" and not (d / "children" / "core.nvcudmp").exists()
    assert (d / "call1" / "repro_min.json").exists() and meta["children_from"] == "call2/children.tgz"
    assert (d / "call1" / "workdir.txt").exists()
    assert meta["left_out"] == ["call1/notes.txt", "call1/children.tgz (an earlier snapshot of the work folder)"]
    assert meta["provenance_given"] == ["driver"]
    assert meta["startup_s"] == {"stock": 147.9} and meta["device_command"] == "call 1: cmd one | call 2: cmd two"
    p = meta["provenance"]
    assert (p["gpu"], p["torch_version"], p["started_at"], p["driver"], p["git_commit"]) == (
        "NVIDIA H200", "2.11.0", "2026-12-01T00:42:00Z", "580", "abc")
    assert json.loads((d / "meta.json").read_text()) == meta
    with pytest.raises(LabError, match="already exists"):
        ingest_repro([(str(c2), "again")], "r1", data_dir=str(data))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LabError, match="holds no output"):
        ingest_repro([(str(tmp_path / "empty"), "x")], "r2", data_dir=str(data))
    rejudge_only = tmp_path / "c3"        # a last call that judged but did not pack the work folder
    rejudge_only.mkdir()
    (rejudge_only / "rc.txt").write_text("rc=0\n")
    with pytest.raises(LabError, match=r"changed the work folder \(call 2\) has no children"):
        ingest_repro([(str(c2), "x"), (str(rejudge_only), "y")], "r4", data_dir=str(data))
    # a trailing call that only judged the work folder again (--rejudge writes nothing there): the earlier
    # call's snapshot is still the work folder as it was left, and the later verdict is the record's
    (rejudge_only / "repro_min.rejudged.json").write_text(json.dumps({"verdict_line": "REPRODUCED: judged again",
                                                                       "workdir": "/tmp/repro-min-x"}))
    (rejudge_only / "rejudge.log").write_text("REPRODUCED: judged again\n")
    meta = ingest_repro([(str(c1), "x"), (str(c2), "y"), (str(rejudge_only), "z")], "r6", data_dir=str(data))
    assert meta["children_from"] == "call2/children.tgz" and meta["judged"].endswith("(--rejudge, call 3)")
    assert (data / "gpu" / "r6" / "children" / "stock.log").read_text() == "late\n"
    assert "call3/repro_min.rejudged.json" in meta["files"]
    other = tmp_path / "c5"               # a rejudge of another work folder does not speak for this snapshot
    other.mkdir()
    (other / "repro_min.rejudged.json").write_text(json.dumps({"verdict_line": "REPRODUCED", "workdir": "/tmp/repro-min-B"}))
    with pytest.raises(LabError, match="not the same work folder"):
        ingest_repro([(str(c2), "y"), (str(other), "z")], "r8", data_dir=str(data))
    by_hand = tmp_path / "c6"             # nor does a call that also ran a child by hand and did not pack the folder
    by_hand.mkdir()
    (by_hand / "repro_min.rejudged.json").write_text(json.dumps({"verdict_line": "REPRODUCED", "workdir": "/tmp/repro-min-x"}))
    (by_hand / "fixed_by_hand.log").write_text("engine log\n")
    with pytest.raises(LabError, match=r"call 2\) has no children"):
        ingest_repro([(str(c2), "y"), (str(by_hand), "z")], "r9", data_dir=str(data))
    ran_engines = tmp_path / "c4"         # and a last call that ran the reproducer again may have changed it
    ran_engines.mkdir()
    (ran_engines / "repro_min.log").write_text("REPRODUCED\n")
    (ran_engines / "repro_min.rejudged.json").write_text(json.dumps({"verdict_line": "REPRODUCED"}))
    with pytest.raises(LabError, match=r"call 3\) has no children"):
        ingest_repro([(str(c1), "x"), (str(c2), "y"), (str(ran_engines), "z")], "r7", data_dir=str(data))
    _tgz(c1 / "children3.tgz", {"./a.log": "x"})
    with pytest.raises(LabError, match="more than one children"):
        ingest_repro([(str(c1), "x")], "r5", data_dir=str(data))
    _tgz(c2 / "children.tgz", {"../evil.log": "x"})
    with pytest.raises(LabError, match="unsafe member"):
        ingest_repro([(str(c2), "x")], "r3", data_dir=str(data))
    assert sorted(p.name for p in (data / "gpu").iterdir()) == ["r1", "r6"] and not list(data.glob(".ingest-*"))


def test_large_engine_log_kept_xz_and_found_by_its_readers(tmp_path):
    from dflash_lab import analysis, coredump
    from dflash_lab.ingest import LOG_XZ_ABOVE
    from dflash_lab.runner import recorded_glob, recorded_path

    out = tmp_path / "OUT"
    out.mkdir()
    line = {"run_id": "e/c8/r0", "outcome": "crash", "gpu_session": "S", "engine_id": "e", "attempt": 1,
            "log": "/tmp/runlogs/e.a1.log"}
    (out / "runs.jsonl").write_text(json.dumps(line) + "\n")
    logs = tmp_path / "runlogs"
    logs.mkdir()
    assert_line = ("(EngineCore pid=41) kernel.py:53: unknown: block: [0,0,0], thread: [1,0,0] "
                   "Assertion `index out of bounds: 0 <= tmp16 < 262144` failed.\n")
    text = assert_line * (LOG_XZ_ABOVE // len(assert_line) + 10)
    (logs / "e.a1.log").write_text(text)
    (logs / "small.a1.log").write_text("a short engine log\n")
    (logs / "notes.log").write_text("x" * (LOG_XZ_ABOVE + 10))   # not an engine log: kept as it is
    with tarfile.open(out / "logs.tgz", "w:gz") as tf:
        tf.add(logs, arcname="runlogs")
    data = tmp_path / "data"
    data.mkdir()
    meta = ingest(str(out), "s9", data_dir=str(data))
    folder = data / "gpu" / "s9"
    assert (folder / "e.a1.log.xz").exists() and not (folder / "e.a1.log").exists()
    assert (folder / "e.a1.log.xz").stat().st_size < LOG_XZ_ABOVE // 10
    assert (folder / "small.a1.log").exists() and (folder / "notes.log").exists()
    assert "e.a1.log.xz" in meta["files"] and "small.a1.log" in meta["files"]
    # the readers find it under its written name and read it through
    stored = analysis.engine_log(dict(line, file="s9.jsonl"), str(data))
    assert stored == str(folder / "e.a1.log.xz") and analysis.read_text(stored) == text
    assert analysis.log_asserts(stored)[0]["message"] == "index out of bounds: 0 <= tmp16 < 262144"
    assert coredump.processes(stored) == {41: "EngineCore"}
    assert recorded_path(folder / "e.a1.log") == str(folder / "e.a1.log.xz")
    assert [n for n, _ in recorded_glob(str(folder / "*.log"))] == [str(folder / x) for x in
                                                                     ("e.a1.log", "notes.log", "small.a1.log")]
    (folder / "e.a1.log").write_text(text)   # the same log stored twice is refused, not read twice
    with pytest.raises(LabError, match="recorded twice"):
        recorded_glob(str(folder / "*.log"))


def test_an_earlier_calls_compressed_log_is_recognised_by_its_content(tmp_path):
    """A large engine log is stored xz-compressed; the copy an earlier call of the session recorded may have been
    written with other xz settings (or another liblzma): same content, other bytes. It is left out all the same, and
    a compressed log whose content differs is kept."""
    import lzma

    data = tmp_path / "data"
    data.mkdir()
    big = "".join(f"INFO step {i} of a long engine log\n" for i in range(6000))   # above LOG_XZ_ABOVE
    assert len(big) > 100_000
    (tmp_path / "1").mkdir()
    first = make_out(tmp_path / "1", json.dumps({"run_id": "a", "outcome": "ok", "gpu_session": "S"}) + "\n")
    ingest(str(first), "call1", data_dir=str(data), gpu_session="S")
    # call 1 recorded g.a1.log compressed with preset 0 (as another xz might have)
    (data / "gpu" / "call1" / "g.a1.log.xz").write_bytes(lzma.compress(big.encode(), preset=0))
    (data / "gpu" / "call1" / "h.a1.log.xz").write_bytes(lzma.compress(big.encode(), preset=0))
    (tmp_path / "2").mkdir()
    second = make_out(tmp_path / "2", json.dumps({"run_id": "b", "outcome": "ok", "gpu_session": "S"}) + "\n")
    logs = tmp_path / "2" / "runlogs"
    (logs / "g.a1.log").write_text(big)
    (logs / "h.a1.log").write_text(big + "one more line\n")
    with tarfile.open(second / "logs.tgz", "w:gz") as tf:
        tf.add(logs, arcname="runlogs")
    meta = ingest(str(second), "call2", data_dir=str(data), gpu_session="S")
    assert (data / "gpu" / "call2" / "h.a1.log.xz").exists() and "h.a1.log.xz" in meta["files"]
    assert not (data / "gpu" / "call2" / "g.a1.log.xz").exists()
    assert "g.a1.log.xz (identical once decompressed to call1/g.a1.log.xz)" in meta["already_recorded"]
    assert "e.a1.log (byte-identical to call1/e.a1.log)" in meta["already_recorded"]


def test_ingest_keeps_sigstages_records_without_run_lines(tmp_path):
    """A GPU call of ``python -m dflash_lab sigstages`` (s55) leaves no runs.jsonl: its records go to data/gpu/NAME
    with the meta, and nothing to data/runs."""
    out = tmp_path / "OUT"
    out.mkdir()
    for name in ("sigstages.jsonl", "sigstages-coredump.jsonl", "sigstages-unregister-cold.jsonl"):
        (out / name).write_text(json.dumps({"stage": "provenance", "ok": True}) + "\n")
    (out / "other.jsonl").write_text("{}\n")
    data = tmp_path / "data"
    data.mkdir()
    meta = ingest(str(out), "sig", data_dir=str(data), device_command="python3 -m dflash_lab sigstages ...",
                  gpu_session="S")
    assert meta["lines"] == 0 and not (data / "runs").exists()
    assert sorted(p.name for p in (data / "gpu" / "sig").iterdir()) == [
        "meta.json", "sigstages-coredump.jsonl", "sigstages-unregister-cold.jsonl", "sigstages.jsonl"]
    assert json.loads((data / "gpu" / "sig" / "meta.json").read_text())["device_command"].startswith("python3")


def test_a_session_run_under_another_label_is_relabelled_keeping_the_label_it_ran_with(tmp_path):
    lines = [{"run_id": r, "outcome": "ok", "gpu_session": "s65-h200", "wall_s": 1.5} for r in ("a", "b")]
    out = make_out(tmp_path, "".join(json.dumps(l) + "\n" for l in lines))
    data = tmp_path / "data"
    data.mkdir()
    for bad, msg in (("s65", "a session label is DATE-sN"),):
        with pytest.raises(LabError, match=msg):
            ingest(str(out), "x", data_dir=str(data), relabel_session=bad)
    with pytest.raises(LabError, match="disagree"):
        ingest(str(out), "x", data_dir=str(data), relabel_session="2026-12-05-s65", gpu_session="2026-12-05-s64")
    meta = ingest(str(out), "r", data_dir=str(data), relabel_session="2026-12-05-s65")
    got = [json.loads(l) for l in (data / "runs" / "r.jsonl").read_text().splitlines()]
    assert got == [{**l, "gpu_session": "2026-12-05-s65", "gpu_session_as_run": "s65-h200"} for l in lines]
    assert meta["gpu_session"] == "2026-12-05-s65"
    assert meta["session_relabelled"] == {"from": "s65-h200", "to": "2026-12-05-s65"}
    # lines that already carry the label, or none, or two: nothing to relabel
    out2 = tmp_path / "o2"
    out2.mkdir()
    (out2 / "runs.jsonl").write_text(json.dumps({"run_id": "a", "outcome": "ok", "gpu_session": "A"}) + "\n"
                                     + json.dumps({"run_id": "b", "outcome": "ok", "gpu_session": "B"}) + "\n")
    with pytest.raises(LabError, match="carry one other label"):
        ingest(str(out2), "y", data_dir=str(data), relabel_session="2026-12-05-s65")
    for i, labels in enumerate(([None], ["2026-12-05-s65"], ["A", None])):
        o = tmp_path / f"o3{i}"
        o.mkdir()
        (o / "runs.jsonl").write_text("".join(json.dumps({"run_id": f"r{j}", "outcome": "ok", "gpu_session": lab}) + "\n"
                                              for j, lab in enumerate(labels)))
        with pytest.raises(LabError, match="carry one other label"):
            ingest(str(o), f"z{i}", data_dir=str(data), relabel_session="2026-12-05-s65")
    assert sorted(p.name for p in (data / "runs").iterdir()) == ["r.jsonl", "r.meta.json"]
