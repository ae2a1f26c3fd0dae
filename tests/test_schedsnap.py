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
