"""schedsnap: each FA builder's persistent FA3 schedule, written once when the first served step begins."""

import json
import sys
import types

import pytest
import torch

from dflash_lab import schedsnap as S
from dflash_lab.errors import LabError

PAD = 0x7FFF7FFF


class Builder:
    def __init__(self, buf, full=True):
        self.scheduler_metadata = buf
        self.use_full_cuda_graph = full


class Group:
    def __init__(self, layers, builder):
        self.layer_names = layers
        self._b = builder

    def get_metadata_builder(self, i):
        return self._b


def runner():
    stale = torch.zeros(25, dtype=torch.int32)
    stale[:13] = torch.tensor([128, PAD, PAD, PAD, 1, PAD, PAD, PAD, 2, PAD, PAD, PAD, 0])
    fresh = torch.zeros(25, dtype=torch.int32)
    fresh[:4] = torch.tensor([128, 128, 0, 0])
    no_fa = types.SimpleNamespace(layer_names=["m.layers.0.linear_attn"],
                                  get_metadata_builder=lambda i: types.SimpleNamespace())
    return types.SimpleNamespace(attn_groups=[[no_fa], [Group(["m.layers.3.attn"], Builder(fresh))],
                                              [Group(["m.layers.7.attn"], Builder(stale))]])


def test_snapshot_lists_every_persistent_schedule_trimmed_of_its_zeros():
    snap = S.snapshot(runner())
    assert [g["gid"] for g in snap] == [1, 2]           # group 0 keeps no FA3 schedule
    assert snap[0]["buffer"] == [128, 128] and snap[0]["entries"] == 25 and snap[0]["use_full_cuda_graph"]
    assert snap[1]["buffer"][:13] == [128, PAD, PAD, PAD, 1, PAD, PAD, PAD, 2, PAD, PAD, PAD] and len(snap[1]["buffer"]) == 12
    assert snap[1]["layers"] == ["m.layers.7.attn"] and snap[1]["builder"] == "Builder"


def test_write_once_writes_one_line_per_process_and_reads_back(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "_STATE", {})
    path = S.write_once(runner(), str(tmp_path / "snap"))
    assert path and S.write_once(runner(), str(tmp_path / "snap")) is None      # later steps: nothing
    lines = S.read(path)
    assert len(lines) == 1 and [g["gid"] for g in lines[0]["groups"]] == [1, 2]
    # a failure to read the buffers is recorded, not raised into the engine
    monkeypatch.setattr(S, "_STATE", {})
    bad = types.SimpleNamespace(attn_groups=[[Group(["x"], Builder(object()))]])
    p2 = S.write_once(bad, str(tmp_path / "bad"))
    assert "error" in json.loads(open(p2).read()) and S.read(p2)[0]["error"].startswith("AttributeError")


def test_read_refuses_what_is_not_a_snapshot(tmp_path):
    p = tmp_path / "sched-1.jsonl"
    p.write_text(json.dumps({"kind": "layout"}) + "\n")
    with pytest.raises(LabError, match="not a schedule snapshot line"):
        S.read(str(p))
    with pytest.raises(LabError, match="no such file"):
        S.read(str(tmp_path / "missing.jsonl"))


def test_install_wraps_execute_model_once(tmp_path, monkeypatch):
    calls = []

    class GPUModelRunner:
        attn_groups = runner().attn_groups

        def execute_model(self, x):
            calls.append(x)
            return x

    mod = types.ModuleType("vllm.v1.worker.gpu_model_runner")
    mod.GPUModelRunner = GPUModelRunner
    for name in ("vllm", "vllm.v1", "vllm.v1.worker"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", mod)
    monkeypatch.setattr(sys.modules["vllm.v1.worker"], "gpu_model_runner", mod, raising=False)
    monkeypatch.setattr(S, "_STATE", {})
    S.install(str(tmp_path / "s"))
    S.install(str(tmp_path / "s"))                       # idempotent: one wrapper
    r = GPUModelRunner()
    assert r.execute_model(1) == 1 and r.execute_model(2) == 2 and calls == [1, 2]
    files = list((tmp_path / "s").glob("sched-*.jsonl"))
    assert len(files) == 1 and len(S.read(str(files[0]))) == 1


def test_snapshot_table_reads_the_padding_of_a_one_request_schedule(tmp_path, monkeypatch):
    from dflash_lab import fa3sched

    monkeypatch.setattr(S, "_STATE", {})
    path = S.write_once(runner(), str(tmp_path / "snap"))
    t = fa3sched.snapshot_table([path]).set_index("group")
    assert list(t.index) == [1, 2]
    assert t.loc[2, "entries 1-3, 5-7, 9-11"] == [PAD] * 9 and t.loc[2, "error"] is None
    # group 1's buffer ends after 2 entries: too short to be read as a 1-request schedule
    assert t.loc[1, "entries 1-3, 5-7, 9-11"] is None and t.loc[1, "head"] == [128, 128]


def test_padding_checks_on_a_sentinel_probe_and_its_snapshot(tmp_path, monkeypatch):
    from dflash_lab import fa3sched as F
    from tests.test_fa3sched import STALE38, probe, tap

    eng = tmp_path / "e.a1.probe"
    eng.mkdir()
    p = probe({2: {"m.layers.7.attn": tap([4, 5, 6, 7])}, 3: {"m.layers.7.attn": tap([4, 5, 6, 7])}}, stale=STALE38[:25])
    p["path"] = str(eng / "probe-1.jsonl")
    monkeypatch.setattr(S, "_STATE", {})
    snap = S.write_once(runner(), str(tmp_path / "e.a1.sched"))   # group 2 there holds STALE38's schedule
    assert S.files_of_probe(p["path"]) == [snap]
    # the fake runner numbers the stale group 2; the probe numbers it 7: renumber the snapshot to match
    line = json.loads(open(snap).read())
    for g in line["groups"]:
        g["gid"] = {1: 6, 2: 7}[g["gid"]]
    open(snap, "w").write(json.dumps(line) + "\n")
    ok = F.padding_checks(p, [snap], F.PADDING_S38, [4, 5, 6, 7])
    assert all(ok.values()), ok
    wrong = F.padding_checks(p, [snap], F.PADDING_S37, [1, 2, 3, 4, 5, 6, 7])
    assert not wrong["padding as expected on every stale read"]
    assert not wrong["requests left unwritten at 8 as expected on every such step"]
    assert not F.padding_checks(p, [], F.PADDING_S38, [4, 5, 6, 7])["snapshot equals every stale read"]


def test_an_unwritable_folder_does_not_reach_the_engine(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(S, "_STATE", {})
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert S.write_once(runner(), str(blocker / "snap")) is None
    assert "schedule snapshot: not written" in capsys.readouterr().err


def test_files_of_run_finds_the_engine_snapshot_from_its_run_line(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "_STATE", {})
    folder = tmp_path / "gpu" / "s9" / "e.a1.sched"
    S.write_once(runner(), str(folder))
    r = {"file": "s9.jsonl", "log": "/tmp/runlogs/e.a1.log"}
    assert S.files_of_run(r, str(tmp_path)) == [str(next(folder.glob("sched-*.jsonl")))]
    assert S.files_of_run({"file": "s9.jsonl", "log": None}, str(tmp_path)) == []


def _snapshot_file(folder, buffer7):
    """A stored snapshot (data/gpu/<stem>/<tag>.sched/) whose group 7 holds ``buffer7``."""
    folder.mkdir(parents=True)
    line = {"kind": "sched_snapshot", "pid": 1, "device": "cuda:0",
            "groups": [{"gid": 6, "layers": ["m.layers.3.attn"], "builder": "B", "use_full_cuda_graph": True,
                        "entries": 25, "buffer": [128, 128]},
                       {"gid": 7, "layers": ["m.layers.7.attn"], "builder": "B", "use_full_cuda_graph": True,
                        "entries": 25, "buffer": S._trim(list(buffer7))}]}
    (folder / "sched-1.jsonl").write_text(json.dumps(line) + "\n")


def _padding_matrix(tmp_path, ledger=False, stale=None, unprobed_buffer=None, crashed=True):
    """probe-padding-tp1 in small: one probed sentinel engine at 8 (its stale group 7 schedule ``stale``, requests
    1-7 left unwritten on its FULL steps) and one untapped engine at 32, each with its stored snapshot."""
    import pandas as pd

    from tests.test_fa3sched import STALE, probe, tap

    stale = list(stale or STALE)
    data = tmp_path / "data"
    stem = "2026-12-02_h200_probe-padding-a-tp1"
    _snapshot_file(data / "gpu" / stem / "sent.a1.sched", stale)
    _snapshot_file(data / "gpu" / stem / "snap.a1.sched", unprobed_buffer or STALE)
    p = probe({2: {"m.layers.7.attn": tap(list(range(1, 8)))}, 3: {"m.layers.7.attn": tap(list(range(1, 8)))}},
              stale=stale[:25])
    p.update(session=stem, engine="sent.a1", path=str(data / "gpu" / stem / "sent.a1.probe" / "probe-1.jsonl"))
    base = {"matrix": "probe-padding-tp1", "file": f"{stem}.jsonl", "gpu_session": "s39", "attempt": 1}
    df = pd.DataFrame([
        dict(base, run_id="sent/c8/r0", engine_id="sent", started_at="t1", finished_at="t1", concurrency=8, probe=True,
             probe_ledger=ledger, crashed=False, outcome="ok", log="/tmp/x/sent.a1.log"),
        dict(base, run_id="snap/c32/r0", engine_id="snap", started_at="t2", finished_at="t2", concurrency=32, probe=False,
             probe_ledger=None, crashed=crashed, outcome="crash" if crashed else "ok", log="/tmp/x/snap.a1.log")])
    probes = pd.DataFrame([{"session": stem, "engine": "sent.a1", "path": p["path"]}])
    return df, probes, {p["path"]: p}, str(data)


def test_padding_test_checks_the_matrix_predictions_run_by_run(tmp_path):
    from dflash_lab import verification as V

    df, probes, logs, data = _padding_matrix(tmp_path)
    t = V.padding_test(df, probes, logs.__getitem__, data_dir=data)
    decided = t[t["held"].notna()]
    assert list(decided["prediction"].str.slice(0, 3)) == ["(a)", "(a)", "(a)", "(c)", "(d)"]
    assert decided["held"].all()
    pad = t[t["prediction"].str.startswith("(d) group 7's padding")]
    assert list(pad["measured"]) == ["[0, 31, 0, 0, 0, 0, 0, 0, 0]"] and pad["held"].isna().all()
    # the same probe, its line saying the ledger ran: (b)'s padding and requests, which this probe did not read
    df2, probes, logs, data = _padding_matrix(tmp_path / "b", ledger=True)
    t2 = V.padding_test(df2, probes, logs.__getitem__, data_dir=data).set_index("prediction")
    assert not t2.loc["(b) group 7's stale schedule: padding on every read", "held"]
    assert not t2.loc["(b) requests left unwritten at 8, every FULL step of 8", "held"]
    assert t2.loc["(b) completes", "held"] and t2.loc["(c) snapshot equals every stale read", "held"]
    # an untapped engine that completed: (d) does not hold
    df3, probes, logs, data = _padding_matrix(tmp_path / "c", crashed=False)
    t3 = V.padding_test(df3, probes, logs.__getitem__, data_dir=data).set_index("prediction")
    assert not t3.loc["(d) untapped stock crashes", "held"]


def test_padding_test_refuses_a_run_without_its_measurement(tmp_path):
    import shutil

    from dflash_lab import verification as V

    df, probes, logs, data = _padding_matrix(tmp_path)
    shutil.rmtree(tmp_path / "data" / "gpu" / "2026-12-02_h200_probe-padding-a-tp1" / "snap.a1.sched")
    with pytest.raises(LabError, match="no schedule snapshot stored"):
        V.padding_test(df, probes, logs.__getitem__, data_dir=data)
    df, probes, logs, data = _padding_matrix(tmp_path / "b")
    with pytest.raises(LabError, match="0 probe logs"):
        V.padding_test(df, probes.iloc[:0], logs.__getitem__, data_dir=data)
    df.loc[0, "probe_ledger"] = None
    with pytest.raises(LabError, match="build ledger"):
        V.padding_test(df, probes, logs.__getitem__, data_dir=data)


def test_stale_padding_table_and_the_ledger_of_a_probe(tmp_path):
    import pandas as pd

    from dflash_lab import verification as V
    from tests.test_fa3sched import STALE38

    df, probes, logs, data = _padding_matrix(tmp_path)
    assert V._ledger(df.iloc[:1]) is False and V._ledger(df.iloc[1:]) is None
    both = pd.concat([df.iloc[:1], df.iloc[:1].assign(probe_ledger=True)])
    assert V._ledger(both) is None                   # lines that disagree say nothing
    df38, _, logs38, _ = _padding_matrix(tmp_path / "b", ledger=True, stale=STALE38)
    path38 = next(iter(logs38))
    rows = pd.DataFrame([{"path": p, "fix": "stock", "configuration": "dflash (step probe, attention taps)",
                          "gpu_session": s, "build ledger": led}
                         for p, s, led in ((next(iter(logs)), "s39", False), (path38, "s38", True))])
    t = V.stale_padding_table(rows, {**logs, **logs38}.__getitem__)
    assert list(zip(t["gpu_session"], t["build ledger"], t["padding"], t["stale reads"])) == [
        ("s39", False, (0, 31, 0, 0, 0, 0, 0, 0, 0), 2), ("s38", True, (0x7FFF7FFF,) * 9, 2)]
    import numpy as np

    assert V.ledger_label(True) == "ledger on" and V.ledger_label(float("nan")) == "ledger unknown"
    assert V.ledger_label(np.bool_(False)) == "ledger off" and V.ledger_label(None) == "ledger unknown"
    assert V.ledger_label(pd.Series([True, False])[0]) == "ledger on"   # a bool column's own values


def test_the_findings_clause_says_the_crashing_engines_padding_only_when_the_data_does(tmp_path):
    """Its conclusions (the padding followed the ledger; the unprobed engines hold the ledger-off padding) are read
    from the checks, never printed on their own: without a ledger-on run, or with another padding in the unprobed
    engine, they are not said."""
    from dflash_lab import findings
    from tests.test_fa3sched import STALE38

    df, probes, logs, data = _padding_matrix(tmp_path)
    text = findings._padding_clause(df, probes, logs.__getitem__, data_dir=data)
    assert "held the padding [0, 31, 0, 0, 0, 0, 0, 0, 0] in each" in text and "5 of 5 checks held" in text
    assert "followed the ledger setting" not in text          # no ledger-on run: nothing to compare with
    df2, probes2, logs2, data2 = _padding_matrix(tmp_path / "x", unprobed_buffer=STALE38)
    text2 = findings._padding_clause(df2, probes2, logs2.__getitem__, data_dir=data2)
    assert "held the padding" not in text2 and "0x7fff7fff" in text2


def _snapcore_matrix(tmp_path, faults=("copy_and_expand_dflash_inputs_kernel", "fused_sigmoid_gating_delta_rule_update_kernel"),
                     buffers=None, outcomes=("crash", "crash"), concurrencies=(32, 8)):
    """snap-coredump-tp1 in small: two untapped engines with the schedule snapshot and core dumps, one run each."""
    import pandas as pd

    from tests.test_fa3sched import STALE

    data = tmp_path / "data"
    stem = "2026-12-02_h200_snap-coredump-a-tp1"
    rows = []
    for i, (fault, c, out) in enumerate(zip(faults, concurrencies, outcomes)):
        eng = f"core{i}"
        _snapshot_file(data / "gpu" / stem / f"{eng}.a1.sched", (buffers or {}).get(i, STALE))
        rows.append({"matrix": "snap-coredump-tp1", "file": f"{stem}.jsonl", "gpu_session": "2026-12-02-s40",
                     "attempt": 1, "run_id": f"{eng}/c{c}/r0", "engine_id": eng, "started_at": f"t{i}", "concurrency": c,
                     "probe": False, "crashed": out == "crash", "outcome": out, "log": f"/tmp/x/{eng}.a1.log",
                     "fault": {"kernel": fault} if fault else None})
    return pd.DataFrame(rows), str(data)


def test_snapcore_test_checks_each_prediction_and_can_fail(tmp_path):
    from dflash_lab import findings
    from dflash_lab import verification as V
    from tests.test_fa3sched import STALE38

    df, data = _snapcore_matrix(tmp_path)
    t = V.snapcore_test(df, data_dir=data)
    assert list(t["prediction"].str.slice(0, 3)) == ["(e)", "(f)", "(g)"] * 2 and t["held"].all()
    assert list(t["measured"])[1] == "[128, 0, 31, 0, 1, 0, 0, 0, 2]"
    text = findings._snapcore_clause(df, data_dir=data)
    assert "6 of 6 checks held" in text and "at 32 copy_and_expand_dflash_inputs_kernel 1 of 1" in text
    assert "at 8 fused_sigmoid_gating_delta_rule_update_kernel 1 of 1" in text
    # a cuBLAS kernel at 32, no core at 8, another padding at 32, a completion at 8: each prediction fails on its own
    df2, data2 = _snapcore_matrix(tmp_path / "b", faults=("cublasLt_gemm_kernel", None), buffers={0: STALE38},
                                  outcomes=("crash", "ok"))
    t2 = V.snapcore_test(df2, data_dir=data2).set_index(["run", "prediction"])["held"]
    run32, run8 = sorted({r for r, _ in t2.index}, key=lambda r: "c8" in r)
    assert t2[(run32, "(e) untapped stock crashes")] and not t2[(run32, "(g) the core's faulting kernel")]
    assert not t2[(run32, "(f) group 7's schedule at the first served step (snapshot)")]
    assert not t2[(run8, "(e) untapped stock crashes")] and not t2[(run8, "(g) the core's faulting kernel")]
    assert V.snapcore_test(df2, data_dir=data2).set_index("run").loc[run8, "measured"].tolist()[2] == "no crash"
    text2 = findings._snapcore_clause(df2, data_dir=data2)
    assert "not held:" in text2 and "the cores named" not in text2


def test_snapcore_test_refuses_what_it_cannot_check(tmp_path):
    import shutil

    from dflash_lab import verification as V

    df, data = _snapcore_matrix(tmp_path)
    shutil.rmtree(tmp_path / "data" / "gpu" / "2026-12-02_h200_snap-coredump-a-tp1" / "core1.a1.sched")
    with pytest.raises(LabError, match="no schedule snapshot stored"):
        V.snapcore_test(df, data_dir=data)
    df, data = _snapcore_matrix(tmp_path / "b", concurrencies=(32, 16))
    with pytest.raises(LabError, match="predicts a kernel at 8 and 32 only"):
        V.snapcore_test(df, data_dir=data)
    assert len(V.snapcore_test(df.iloc[:0], data_dir=data)) == 0


def test_ledger_order_says_alternating_only_when_it_was():
    import pandas as pd

    from dflash_lab import verification as V

    def runs(sess, ledgers):
        return [{"matrix": "probe-padding-tp1", "probe": True, "gpu_session": sess, "probe_ledger": led,
                 "finished_at": f"2026-12-02T0{i}:00:00"} for i, led in enumerate(ledgers)]

    df = pd.DataFrame(runs("a", [False, True, False]) + runs("b", [True, True, False]) + runs("c", [False, False])
                      + [{"matrix": "probe-padding-tp1", "probe": False, "gpu_session": "a", "probe_ledger": None,
                          "finished_at": "2026-12-02T01:30:00"}])
    o = V.ledger_order(df)
    assert o["a"] == {"order": [False, True, False], "alternates": True}      # the unprobed run is not in the order
    assert not o["b"]["alternates"] and not o["c"]["alternates"]              # a repeat, or one setting only
    assert V.ledger_order(df.iloc[:0]) == {}
    bad = df.copy()
    bad.loc[0, "probe_ledger"] = None                                          # unknown is refused, not read as off
    with pytest.raises(LabError, match="build ledger"):
        V.ledger_order(bad)
