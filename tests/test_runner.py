"""Bookkeeping of the experiment runner with a fake engine process (no GPU, no vLLM)."""

import json
import re

import pytest
import yaml

from conftest import run_cli
from dflash_lab.errors import LabError
from dflash_lab.runner import read_lines, validate_matrix


def matrix(tmp_path, engines, **top):
    m = {"name": "t", "worker": "fake_worker", "run_timeout_s": 4, "startup_timeout_s": 4,
         "defaults": {"target": "tiny-dense"}, "engines": engines, **top}
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump(m))
    return p


def run(tmp_path, engines, extra=(), **top):
    out = tmp_path / "runs.jsonl"
    r = run_cli("dflash_lab", "run", str(matrix(tmp_path, engines, **top)), "--out", str(out), *extra, timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    return read_lines(out), r


def test_each_way_a_run_can_end_gives_exactly_one_line(tmp_path):
    plan = {"e1/c4/r1": "crash", "e1/c4/r3": "hang", "e1/c4/r4": "fail"}
    lines, r = run(tmp_path, [
        {"id": "e1", "env": {"FAKE_PLAN": json.dumps(plan)}, "runs": [{"concurrency": 4, "rounds": 6}]},
        {"id": "e2", "env": {"FAKE_STARTUP": "error"}, "runs": [{"concurrency": 2, "rounds": 2}]},
    ])
    got = [(l["run_id"], l["outcome"], l["attempt"]) for l in lines]
    assert got == [("e1/c4/r0", "ok", 1), ("e1/c4/r1", "crash", 1), ("e1/c4/r2", "ok", 2),
                   ("e1/c4/r3", "timeout", 2), ("e1/c4/r4", "crash", 3), ("e1/c4/r5", "ok", 4),
                   ("e2/c2/r0", "startup_error", 1), ("e2/c2/r1", "startup_error", 1)]
    crash = lines[1]
    assert crash["error"] == "CUDA error: an illegal memory access was encountered"
    assert any("illegal memory access" in l for l in crash["log_tail"])
    assert "fake start-up failure" in lines[-1]["error"]
    for l in lines:  # the fields every line must carry
        for k in ("target", "weights", "spec_method", "num_speculative_tokens", "cudagraph_mode", "enforce_eager",
                  "drafter_enforce_eager", "tensor_parallel_size", "moe_backend", "max_num_seqs", "concurrency",
                  "acceptance", "rounds", "requests_completed", "outcome", "error", "spec_decode_metrics", "wall_s",
                  "gpu", "driver", "vllm_version", "torch_version", "triton_version", "started_at", "command"):
            assert k in l, k
    for l in lines:   # a run that reached its end carries the worker's own span of it (gpuclocks' window)
        if l["outcome"] == "ok":
            assert l["run_start_t"] <= l["run_end_t"] and l["run_end_t"] - l["run_start_t"] <= l["wall_s"] + 1


def test_deadline_leaves_unreached_runs_without_a_line(tmp_path):
    lines, r = run(tmp_path, [{"id": "e1", "env": {"FAKE_PLAN": json.dumps({"e1/c1/r0": "hang"})},
                               "runs": [{"concurrency": 1, "rounds": 3}]}],
                   extra=("--deadline-s", "40"), run_timeout_s=200, startup_estimate_s=1)
    assert [l["outcome"] for l in lines] == ["timeout"]
    assert "not run before the deadline" in r.stdout


def test_an_engine_whose_run_cannot_finish_is_not_started(tmp_path):
    """run_estimate_s: the slow engine is left for a later call (no line, listed as not run); the next one runs."""
    lines, r = run(tmp_path, [{"id": "slow", "run_estimate_s": 3600, "runs": [{"concurrency": 1}]},
                              {"id": "quick", "runs": [{"concurrency": 1}]}],
                   extra=("--deadline-s", "120"), startup_estimate_s=1)
    assert [(l["run_id"], l["outcome"]) for l in lines] == [("quick/c1/r0", "ok")]
    assert "not run before the deadline: 1 run(s): slow/c1/r0" in r.stdout
    with pytest.raises(LabError, match="run_estimate_s"):
        validate_matrix({"engines": [{"id": "e", "run_estimate_s": -1, "runs": [{"concurrency": 1}]}]})


def test_a_group_starts_only_when_all_of_it_fits(tmp_path):
    """together: each engine of the pair fits the deadline alone (60 + 30 s of 120), both do not; neither starts, and
    the engine after them runs. The same pair with room for both runs both."""
    pair = [{"id": "fa", "together": "pair", "run_estimate_s": 60, "runs": [{"concurrency": 1}]},
            {"id": "fb", "together": "pair", "run_estimate_s": 60, "runs": [{"concurrency": 1}]},
            {"id": "after", "runs": [{"concurrency": 1}]}]
    lines, r = run(tmp_path, pair, extra=("--deadline-s", "120"), startup_estimate_s=1)
    assert [l["run_id"] for l in lines] == ["after/c1/r0"]
    assert "group 'pair'" in r.stdout and "fa/c1/r0, fb/c1/r0" in r.stdout.split("not run before the deadline")[1]
    (tmp_path / "runs.jsonl").unlink()
    lines, r = run(tmp_path, pair, extra=("--deadline-s", "400"), startup_estimate_s=1)
    assert [l["run_id"] for l in lines] == ["fa/c1/r0", "fb/c1/r0", "after/c1/r0"]
    for bad in ("", 3, True):
        with pytest.raises(LabError, match="together must be a group name"):
            validate_matrix({"engines": [{"id": "e", "together": bad, "runs": [{"concurrency": 1}]}]})


def test_skip_done_leaves_a_group_out_only_whole(tmp_path):
    """A pair half measured earlier runs again whole (its runs compare only side by side); one fully measured is
    left out."""
    engines = [{"id": "fa", "together": "pair", "runs": [{"concurrency": 2}]},
               {"id": "fb", "together": "pair", "runs": [{"concurrency": 2}]},
               {"id": "solo", "runs": [{"concurrency": 2}]}]
    prev = tmp_path / "prev.jsonl"
    prev.write_text("".join(json.dumps(l) + "\n" for l in [
        {"run_id": "fa/c2/r0", "outcome": "ok", "matrix": "t"}, {"run_id": "solo/c2/r0", "outcome": "ok", "matrix": "t"}]))
    lines, _ = run(tmp_path, engines, extra=("--skip-done", str(prev)))
    assert [l["run_id"] for l in lines] == ["fa/c2/r0", "fb/c2/r0"]
    with prev.open("a") as f:
        f.write(json.dumps({"run_id": "fb/c2/r0", "outcome": "ok", "matrix": "t"}) + "\n")
    (tmp_path / "runs.jsonl").unlink()
    lines, r = run(tmp_path, engines + [{"id": "more", "runs": [{"concurrency": 2}]}], extra=("--skip-done", str(prev)))
    assert [l["run_id"] for l in lines] == ["more/c2/r0"] and "3 run(s) already measured" in r.stdout


def test_an_engine_whose_warm_ups_cannot_fit_is_not_started(tmp_path):
    """warmup_estimate_s: an engine's start is budgeted with its warm-up sweep (s28: an eager engine started with
    ~220 s left, spent them on its start and six warm-ups, and measured one run). 6 warm-ups at 20 s do not fit 120 s;
    the engine without warm-ups runs."""
    sweep = [{"concurrency": c, "max_tokens": 8, "warmup": True} for c in (1, 2, 4, 8, 16, 32)]
    lines, r = run(tmp_path, [{"id": "swept", "runs": sweep + [{"concurrency": 1}]},
                              {"id": "plain", "runs": [{"concurrency": 1}]}],
                   extra=("--deadline-s", "120"), startup_estimate_s=1, warmup_estimate_s=20)
    assert [(l["run_id"], l["outcome"]) for l in lines] == [("plain/c1/r0", "ok")]
    assert "swept/c1/r0" in r.stdout.split("not run before the deadline")[1]
    for bad in (-1, "5", True):
        with pytest.raises(LabError, match="warmup_estimate_s must be a number >= 0"):
            validate_matrix({"warmup_estimate_s": bad, "engines": [{"id": "e", "runs": [{"concurrency": 1}]}]})


def test_existing_lines_survive_a_later_crash(tmp_path):
    out = tmp_path / "runs.jsonl"
    out.write_text(json.dumps({"run_id": "earlier", "outcome": "ok"}) + "\n")
    r = run_cli("dflash_lab", "run", str(matrix(tmp_path, [
        {"id": "e1", "env": {"FAKE_PLAN": json.dumps({"e1/c1/r0": "crash"})}, "runs": [{"concurrency": 1}]}])),
        "--out", str(out))
    assert r.returncode == 0
    lines = read_lines(out)
    assert lines[0]["run_id"] == "earlier" and lines[1]["outcome"] == "crash"


@pytest.mark.parametrize("bad,msg", [
    ({"engines": []}, "non-empty list"),
    ({"engines": [{"id": "a", "runs": [{"concurrency": 0}]}]}, "concurrency"),
    ({"engines": [{"id": "a", "spec_method": "magic", "runs": [{}]}]}, "spec_method"),
    ({"engines": [{"id": "a", "target": "gpt-9", "runs": [{}]}]}, "unknown target"),
    ({"engines": [{"id": "a", "runs": [{}]}, {"id": "a", "runs": [{}]}]}, "duplicate"),
    ({"engines": [{"id": "a", "colour": 1, "runs": [{}]}]}, "unknown key"),
    ({"engines": [{"id": "a", "fix": True, "fix_parts": ["fa3_refresh"], "runs": [{}]}]}, "fix_parts must be"),
    ({"engines": [{"id": "a", "fix_parts": ["fa3_schedule_refresh"], "runs": [{}]}]}, "fix_parts needs fix"),
    ({"engines": [{"id": "a", "fa_splits": "draft:1", "runs": [{}]}]}, "fa_splits: DFLASH_LAB_FA_SPLITS='draft:1'"),
    ({"engines": [{"id": "a", "fa_splits": "drafter:0", "runs": [{}]}]}, "N must be an integer >= 1"),
    # a misspelt top-level limit was a silent default (run_timeout_s 420) before
    ({"run_timeout": 900, "engines": [{"id": "a", "runs": [{}]}]}, r"unknown top-level key\(s\) \['run_timeout'\]"),
    ({"run_timeout_s": "900", "engines": [{"id": "a", "runs": [{}]}]}, "run_timeout_s must be a number > 0"),
    ({"startup_timeout_s": 0, "engines": [{"id": "a", "runs": [{}]}]}, "startup_timeout_s must be a number > 0"),
    ({"max_restarts": -1, "engines": [{"id": "a", "runs": [{}]}]}, "max_restarts must be a whole number >= 0"),
    ({"defaults": [1], "engines": [{"id": "a", "runs": [{}]}]}, "'defaults' must be a mapping"),
    ({"models_dir": "", "engines": [{"id": "a", "runs": [{}]}]}, "models_dir must be a non-empty string"),
    ({"coredump_wait_s": -1, "engines": [{"id": "a", "runs": [{}]}]}, "coredump_wait_s must be a number >= 0"),
    # a quoted "false" is truthy: it switched the fix on before
    ({"engines": [{"id": "a", "fix": "false", "runs": [{}]}]}, "engine a: fix must be true or false"),
    ({"defaults": {"probe": 1}, "engines": [{"id": "a", "runs": [{}]}]}, "engine a: probe must be true or false"),
    ({"engines": [{"id": "a", "tensor_parallel_size": "2", "runs": [{}]}]}, "tensor_parallel_size must be a whole number"),
    ({"engines": [{"id": "a", "gpu_memory_utilization": 90, "runs": [{}]}]}, r"gpu_memory_utilization must be a number in \(0, 1\]"),
    ({"engines": [{"id": "a", "cudagraph_capture_sizes": [16, 0], "runs": [{}]}]}, "cudagraph_capture_sizes must be"),
    ({"engines": [{"id": "a", "async_scheduling": "yes", "runs": [{}]}]}, "async_scheduling must be true or false"),
    ({"engines": [{"id": "a", "runs": [{"max_tokens": 0}]}]}, "max_tokens must be a whole number >= 1"),
    ({"engines": [{"id": "a", "runs": [{"temperature": "0.7"}]}]}, "temperature must be a number >= 0"),
    ({"engines": [{"id": "a", "runs": [{"stream": "true"}]}]}, "stream must be true or false"),
    # true is an int in Python: these ran as concurrency 1, one round, acceptance 1.0 before
    ({"engines": [{"id": "a", "runs": [{"concurrency": True}]}]}, "concurrency must be a positive integer"),
    ({"engines": [{"id": "a", "runs": [{"rounds": True}]}]}, "rounds must be a whole number >= 1"),
    ({"engines": [{"id": "a", "acceptance": True, "runs": [{}]}]}, "acceptance must be 'natural', a number"),
    ({"engines": [{"id": "a", "acceptance": [0.9, True], "runs": [{}]}]}, "acceptance must be 'natural', a number"),
    ({"engines": [{"id": "a", "acceptance": [], "runs": [{}]}]}, "acceptance must be 'natural', a number"),
])
def test_bad_matrix(bad, msg):
    with pytest.raises(LabError, match=msg):
        validate_matrix(bad)


def test_bad_matrix_cli_one_line(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("engines: [\n")
    r = run_cli("dflash_lab", "run", str(p), "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and r.stderr.strip().startswith("dflash-lab: error:") and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.jsonl").exists()


def test_corrupt_runs_file_is_named(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"outcome": "ok"}\n{"outcome": "ok"\n')
    with pytest.raises(LabError, match=r"r.jsonl:2: not a JSON line"):
        read_lines(p)


def test_mtp_under_a_models_dir_vllm_would_misread_is_refused():
    bad = {"models_dir": "/tmp/dflash-models",
           "engines": [{"id": "a", "spec_method": "mtp", "target": "qwen36-35b-a3b-mtp", "runs": [{}]}]}
    with pytest.raises(LabError, match="guesses the draft method"):
        validate_matrix(bad)
    bad["models_dir"] = "/tmp/lab-models"
    assert validate_matrix(bad)["engines"][0]["engine"]["spec_method"] == "mtp"


def test_a_canary_error_is_the_crash_signature():
    from dflash_lab.runner import crash_signature

    tail = ["(EngineCore pid=1) dflash_lab.probe.CanaryError: dflash-lab canary: step 1, attn.scheduler_metadata, "
            "row 1, value 0 (KV-cache group 7's FULL graphs read a stale FA3 schedule)",
            "RuntimeError: CUDA error: an illegal memory access was encountered", "EngineDeadError: EngineCore died"]
    assert crash_signature(tail).startswith("CanaryError: dflash-lab canary: step 1, attn.scheduler_metadata")
    assert crash_signature(tail[1:]) == "CUDA error: an illegal memory access was encountered"


def test_first_request_error_names_kind_status_and_text():
    from dflash_lab.runner import first_request_error

    s = {"failed": 3, "by_kind": {"http_error": 3}, "by_status": {"500": 3},
         "first_error": {"http_error": {"index": 0, "status": 500, "error": '{"error": "EngineDeadError"}'}}}
    assert first_request_error(s) == 'requests failed: 3 x, first http_error (HTTP 500): {"error": "EngineDeadError"}'
    assert first_request_error({"failed": 0, "first_error": {}}) is None and first_request_error(None) is None


def test_skip_done_continues_a_matrix_where_an_earlier_call_stopped(tmp_path):
    prev = tmp_path / "prev.jsonl"
    prev.write_text("".join(json.dumps(l) + "\n" for l in [
        {"run_id": "e1/c2/r0", "outcome": "ok", "matrix": "t"},
        {"run_id": "e1/c2/r1", "outcome": "timeout", "error": "runner deadline reached during the run", "matrix": "t"},
        {"run_id": "e2/c2/r0", "outcome": "crash", "matrix": "t"}]))
    lines, r = run(tmp_path, [{"id": "e1", "runs": [{"concurrency": 2, "rounds": 3}]},
                              {"id": "e2", "runs": [{"concurrency": 2, "rounds": 1}]}],
                   extra=("--skip-done", str(prev)))
    assert [l["run_id"] for l in lines] == ["e1/c2/r1", "e1/c2/r2"]  # the deadline-cut run is run again
    assert "2 run(s) already measured" in r.stdout
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"run_id": "x/c1/r0", "outcome": "ok", "matrix": "another"}) + "\n")
    bad = run_cli("dflash_lab", "run", str(matrix(tmp_path, [{"id": "e1", "runs": [{"concurrency": 2}]}])),
                  "--out", str(tmp_path / "o2.jsonl"), "--skip-done", str(other), timeout=120)
    assert bad.returncode != 0 and "from matrix 'another'" in bad.stderr


def test_a_control_runs_again_in_a_new_gpu_session(tmp_path):
    # the earlier session measured the control and one variant; a new session skips the variant, not the control
    prev = tmp_path / "prev.jsonl"
    prev.write_text("".join(json.dumps(l) + "\n" for l in [
        {"run_id": "ctrl/c2/r0", "outcome": "crash", "matrix": "t", "gpu_session": "old"},
        {"run_id": "var/c2/r0", "outcome": "ok", "matrix": "t", "gpu_session": "old"}]))
    engines = [{"id": "ctrl", "control": True, "runs": [{"concurrency": 2}]},
               {"id": "var", "runs": [{"concurrency": 2, "rounds": 2}]}]
    out = tmp_path / "new.jsonl"
    r = run_cli("dflash_lab", "run", str(matrix(tmp_path, engines)), "--out", str(out), "--skip-done", str(prev),
                env={"DFLASH_LAB_GPU_SESSION": "new"}, timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    assert [l["run_id"] for l in read_lines(out)] == ["ctrl/c2/r0", "var/c2/r1"]
    # within the same session (a later call of it) the control is not run twice
    out2 = tmp_path / "same.jsonl"
    r = run_cli("dflash_lab", "run", str(matrix(tmp_path, engines)), "--out", str(out2), "--skip-done", str(prev),
                env={"DFLASH_LAB_GPU_SESSION": "old"}, timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    assert [l["run_id"] for l in read_lines(out2)] == ["var/c2/r1"]


def test_fix_parts_reach_the_engine_and_the_line(tmp_path):
    from dflash_lab import analysis

    logs = tmp_path / "logs"
    lines, _ = run(tmp_path, [
        {"id": "p1", "fix": True, "fix_parts": ["fa3_schedule_refresh"], "runs": [{"concurrency": 1}]},
        {"id": "all", "fix": True, "runs": [{"concurrency": 1}]},
        {"id": "stock", "runs": [{"concurrency": 1}]}], extra=("--logs", str(logs)))
    by = {l["engine_id"]: l for l in lines}
    assert by["p1"]["fix_parts"] == ["fa3_schedule_refresh"] and len(by["all"]["fix_parts"]) == 3
    assert by["stock"]["fix_parts"] is None
    assert analysis.fix_label(by["p1"]) == "part 1 only: FA3 schedule refresh"
    assert analysis.fix_label(by["all"]).startswith("fix 2")
    env = {p.name.split(".")[0]: p.read_text() for p in logs.glob("*.log")}
    assert "DFLASH_LAB_FIX=1 DFLASH_LAB_FIX_PARTS=fa3_schedule_refresh DFLASH_LAB_FA_SPLITS=\n" in env["p1"]
    assert "DFLASH_LAB_FIX=1 DFLASH_LAB_FIX_PARTS= " in env["all"] and "DFLASH_LAB_FIX= " in env["stock"]


def test_a_one_sided_split_bound_reaches_the_engine_and_the_line(tmp_path, monkeypatch):
    from dflash_lab import analysis

    logs = tmp_path / "logs"
    # an inherited variable must not leak into an engine that did not ask for it
    monkeypatch.setenv("DFLASH_LAB_FA_SPLITS", "target:4")
    lines, _ = run(tmp_path, [
        {"id": "ds", "fa_splits": "drafter:1", "runs": [{"concurrency": 1}]},
        {"id": "stock", "runs": [{"concurrency": 1}]}], extra=("--logs", str(logs)))
    by = {l["engine_id"]: l for l in lines}
    assert by["ds"]["fa_splits"] == "drafter:1" and by["stock"]["fa_splits"] is None
    assert "(FA3 splits 1 for the drafter only, launch hook)" in analysis.cell_label(by["ds"])
    env = {p.name.split(".")[0]: p.read_text() for p in logs.glob("*.log")}
    assert "DFLASH_LAB_FA_SPLITS=drafter:1\n" in env["ds"] and "DFLASH_LAB_FA_SPLITS=\n" in env["stock"]


def test_probe_taps_reach_only_the_engine_that_asked(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    monkeypatch.setenv("DFLASH_LAB_PROBE_TAPS", "1")  # inherited: must not leak
    monkeypatch.setenv("DFLASH_LAB_PROBE_FILL_LAYERS", "3")
    lines, _ = run(tmp_path, [
        {"id": "t", "probe": True, "probe_taps": "sentinel", "runs": [{"concurrency": 1}]},
        {"id": "n", "probe": True, "probe_taps": "nan", "probe_fill_layers": [7, 15], "runs": [{"concurrency": 1}]},
        {"id": "p", "probe": True, "runs": [{"concurrency": 1}]}], extra=("--logs", str(logs)))
    by = {l["engine_id"]: l for l in lines}
    assert by["t"]["probe_taps"] == "sentinel" and by["p"]["probe_taps"] is None
    assert by["n"]["probe_fill_layers"] == [7, 15] and by["t"]["probe_fill_layers"] is None
    from dflash_lab import analysis
    assert "(step probe, attention taps, NaN pre-fill in layers 7, 15" in analysis.cell_label(by["n"])
    env = {p.name.split(".")[0]: p.read_text() for p in logs.glob("*.log")}
    assert "DFLASH_LAB_PROBE_TAPS=sentinel DFLASH_LAB_PROBE_FILL_LAYERS=\n" in env["t"]
    assert "DFLASH_LAB_PROBE_TAPS=nan DFLASH_LAB_PROBE_FILL_LAYERS=7,15\n" in env["n"]
    assert "DFLASH_LAB_PROBE_TAPS= DFLASH_LAB_PROBE_FILL_LAYERS=\n" in env["p"]


def test_ledger_switch_and_schedule_snapshot_reach_only_the_engine_that_asked(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    monkeypatch.setenv("DFLASH_LAB_PROBE_LEDGER", "0")          # inherited: must not leak
    monkeypatch.setenv("DFLASH_LAB_SCHED_SNAPSHOT", "/elsewhere")
    lines, _ = run(tmp_path, [
        {"id": "off", "probe": True, "probe_taps": "sentinel", "probe_ledger": False, "runs": [{"concurrency": 1}]},
        {"id": "on", "probe": True, "probe_taps": "sentinel", "runs": [{"concurrency": 1}]},
        {"id": "snap", "sched_snapshot": True, "runs": [{"concurrency": 1}]},
        {"id": "plain", "runs": [{"concurrency": 1}]}], extra=("--logs", str(logs)))
    by = {l["engine_id"]: l for l in lines}
    assert by["off"]["probe_ledger"] is False and by["on"]["probe_ledger"] is True
    assert by["snap"]["probe_ledger"] is None   # no taps: no ledger to speak of
    assert by["snap"]["sched_snapshot"] is True and by["plain"]["sched_snapshot"] is False
    from dflash_lab import analysis
    assert "sentinel pre-fill, launch hook)" in analysis.cell_label(by["off"])   # no ledger: as in s36 and s37
    assert "sentinel pre-fill, build ledger" in analysis.cell_label(by["on"])
    assert "schedule snapshot" in analysis.cell_label(by["snap"]) and "snapshot" not in analysis.cell_label(by["plain"])
    env = {p.name.split(".")[0]: p.read_text() for p in logs.glob("*.log")}
    assert "DFLASH_LAB_PROBE_LEDGER=0 DFLASH_LAB_SCHED_SNAPSHOT=\n" in env["off"]
    assert f"DFLASH_LAB_PROBE_LEDGER= DFLASH_LAB_SCHED_SNAPSHOT={logs}/snap.a1.sched\n" in env["snap"]
    assert "DFLASH_LAB_PROBE_LEDGER= DFLASH_LAB_SCHED_SNAPSHOT=\n" in env["plain"]


def test_the_scheduler_ledger_reaches_only_the_engine_that_asked(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    monkeypatch.setenv("DFLASH_LAB_SCHED_LEDGER", "/elsewhere")   # inherited: must not leak
    lines, _ = run(tmp_path, [{"id": "led", "sched_ledger": True, "runs": [{"concurrency": 1}]},
                              {"id": "plain", "runs": [{"concurrency": 1}]}], extra=("--logs", str(logs)))
    by = {l["engine_id"]: l for l in lines}
    assert by["led"]["sched_ledger"] is True and by["plain"]["sched_ledger"] is False
    from dflash_lab import analysis
    assert "scheduler ledger" in analysis.cell_label(by["led"])
    assert "scheduler ledger" not in analysis.cell_label(by["plain"])
    env = {p.name.split(".")[0]: p.read_text() for p in logs.glob("*.log")}
    assert f"DFLASH_LAB_SCHED_LEDGER={logs}/led.a1.ledger\n" in env["led"]
    assert "DFLASH_LAB_SCHED_LEDGER=\n" in env["plain"]


def test_the_out_of_vocabulary_replacement_reaches_only_the_engine_that_asked(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    monkeypatch.setenv("DFLASH_LAB_PROBE_OOR", "1")             # inherited: must not leak
    lines, _ = run(tmp_path, [
        {"id": "oor", "probe": True, "probe_taps": "1", "probe_oor": True, "runs": [{"concurrency": 1}]},
        {"id": "taps", "probe": True, "probe_taps": "1", "runs": [{"concurrency": 1}]},
        {"id": "row0", "probe": True, "probe_taps": "1", "probe_oor": "row0", "runs": [{"concurrency": 1}]}],
        extra=("--logs", str(logs)))
    by = {l["engine_id"]: l for l in lines}
    assert by["oor"]["probe_oor"] is True and by["taps"]["probe_oor"] is False and by["row0"]["probe_oor"] == "row0"
    env = {p.name.split(".")[0]: p.read_text() for p in logs.glob("*.log")}
    assert "fake engine oor: DFLASH_LAB_PROBE_OOR=1\n" in env["oor"]
    assert "fake engine oor: DFLASH_LAB_PROBE_OOR=\n" in env["taps"]
    assert "fake engine oor: DFLASH_LAB_PROBE_OOR=row0\n" in env["row0"]
    from dflash_lab import analysis
    assert "replaced by 0 in batch row 0 only" in analysis.cell_label(by["row0"])
    assert "out-of-vocabulary sampled ids replaced by 0" in analysis.cell_label(by["oor"])
    assert "out-of-vocabulary" not in analysis.cell_label(by["taps"])


def test_the_admission_gate_reaches_only_the_engine_that_asked_with_its_runs_concurrency(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    monkeypatch.setenv("DFLASH_LAB_ADMIT", "1/1")                  # inherited: must not leak
    lines, _ = run(tmp_path, [
        {"id": "k1", "first_step_requests": 1, "runs": [{"concurrency": 3}]},
        {"id": "plain", "runs": [{"concurrency": 3}]}], extra=("--logs", str(logs)))
    by = {l["engine_id"]: l for l in lines}
    assert by["k1"]["first_step_requests"] == 1 and by["plain"]["first_step_requests"] is None   # recorded
    env = {p.name.split(".")[0]: p.read_text() for p in logs.glob("*.log")}
    assert "fake engine admit: DFLASH_LAB_ADMIT=1/3\n" in env["k1"]
    assert "fake engine admit: DFLASH_LAB_ADMIT=\n" in env["plain"]
    from dflash_lab import analysis
    assert "first step admits at most 1" in analysis.cell_label(by["k1"])
    assert "first step admits" not in analysis.cell_label(by["plain"])


@pytest.mark.parametrize("eng,msg", [
    ({"first_step_requests": 0, "runs": [{"concurrency": 4}]}, "first_step_requests must be a whole number >= 1"),
    ({"first_step_requests": True, "runs": [{"concurrency": 4}]}, "first_step_requests must be a whole number >= 1"),
    ({"first_step_requests": 5, "runs": [{"concurrency": 4}]}, r"first_step_requests \(5\) is more than the run's"),
    ({"first_step_requests": 1, "runs": [{"concurrency": 4, "rounds": 2}]}, "first_step_requests needs exactly one run"),
    ({"first_step_requests": 1, "runs": [{"concurrency": 4, "warmup": True}, {"concurrency": 4}]},
     "first_step_requests needs exactly one run"),
    ({"first_step_requests": 1, "mode": "server", "runs": [{"concurrency": 4}]}, "for the offline runner only"),
    ({"env": {"DFLASH_LAB_ADMIT": "1/4"}, "runs": [{"concurrency": 4}]}, "which the runner sets from matrix keys"),
    ({"first_step_requests": 1, "engine_args": {"data_parallel_size": 2}, "runs": [{"concurrency": 4}]},
     "needs data_parallel_size 1"),
])
def test_bad_admission_gates_are_refused(eng, msg):
    with pytest.raises(LabError, match=msg):
        validate_matrix({"engines": [{"id": "a", **eng}]}, "m.yaml")


def test_no_engine_switch_is_inherited_and_env_entries_reach_the_engine(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    for k in ("DFLASH_LAB_HOOK_SYNC", "DFLASH_LAB_HOOK_FATAL", "DFLASH_LAB_PROBE_REF"):
        monkeypatch.setenv(k, "1")                                  # the runner's own environment: must not leak
    lines, _ = run(tmp_path, [
        {"id": "plain", "runs": [{"concurrency": 1}]},
        {"id": "fatal", "env": {"DFLASH_LAB_HOOK_FATAL": "1"}, "runs": [{"concurrency": 1}]}], extra=("--logs", str(logs)))
    env = {p.name.split(".")[0]: p.read_text() for p in logs.glob("*.log")}
    assert "DFLASH_LAB_HOOK_SYNC= DFLASH_LAB_HOOK_FATAL= DFLASH_LAB_PROBE_REF=\n" in env["plain"]
    assert "DFLASH_LAB_HOOK_SYNC= DFLASH_LAB_HOOK_FATAL=1 DFLASH_LAB_PROBE_REF=\n" in env["fatal"]
    assert {l["engine_id"]: l["env"] for l in lines}["fatal"] == {"DFLASH_LAB_HOOK_FATAL": "1"}   # recorded


def test_every_variable_the_engine_side_reads_is_controlled_by_the_runner(root):
    """A switch the plugin, hook, probe, snapshot or split code reads, missing from runner.ENGINE_ENV, would be
    inherited by every engine from whatever environment started the runner, unrecorded."""
    from dflash_lab import runner as R

    read = set()
    for mod in ("plugin", "engine_state", "hook", "patch", "probe", "schedsnap", "splits", "admit", "vllmdiff", "hang"):
        read |= set(re.findall(r"DFLASH_LAB_[A-Z_]+", (root / "dflash_lab" / f"{mod}.py").read_text()))
    assert read, "no variable found: the scan is broken"
    assert read <= set(R.ENGINE_ENV), sorted(read - set(R.ENGINE_ENV))


@pytest.mark.parametrize("eng,msg", [
    ({"probe": True, "probe_ledger": False}, "probe_ledger needs probe_taps"),
    ({"env": {"DFLASH_LAB_FIX": "1"}}, "which the runner sets from matrix keys"),
    ({"env": {"DFLASH_LAB_SCHED_SNAPSHOT": "/x"}}, "which the runner sets from matrix keys"),
    ({"env": ["CUDA_LAUNCH_BLOCKING=1"]}, "env must be a mapping"),
    ({"probe": True, "probe_taps": "1", "probe_ledger": "no"}, "probe_ledger must be true or false"),
    ({"probe": True, "probe_taps": "1", "probe_ledger": 1}, "probe_ledger must be true or false"),
    ({"sched_snapshot": "yes"}, "sched_snapshot must be true or false"),
    ({"sched_ledger": 1}, "sched_ledger must be true or false"),
    ({"env": {"DFLASH_LAB_SCHED_LEDGER": "/x"}}, "which the runner sets from matrix keys"),
    ({"probe_oor": True}, "probe_oor needs probe: true"),
    ({"probe": True, "probe_oor": "yes"}, "probe_oor must be true, false, 'row0' or 'others'"),
    ({"probe_taps": "sentinel"}, "probe_taps needs probe: true"),
    ({"probe": True, "probe_taps": 1}, "probe_taps must be '1', 'sentinel', 'nan' or 'zero'"),
    ({"probe": True, "probe_taps": "1", "probe_fill_layers": [7]}, "probe_fill_layers needs a pre-fill"),
    ({"probe": True, "probe_taps": "nan", "probe_fill_layers": []}, "must be a non-empty list of layer numbers"),
])
def test_bad_probe_taps_are_refused(eng, msg):
    with pytest.raises(LabError, match=msg):
        validate_matrix({"engines": [{"id": "a", "runs": [{}], **eng}]}, "m.yaml")


@pytest.mark.parametrize("runs,msg", [
    ([{"concurrency": 1, "warmup": "yes"}], "engine a: warmup must be true or false"),
    ([{"concurrency": 1}, {"concurrency": 4, "warmup": True}],
     r"engine a: a warm-up run entry \(concurrency 4\) comes after a measured one"),
    ([{"concurrency": 1, "warmup": True}, {"concurrency": 4, "warmup": True}], "engine a: has warm-up runs only"),
])
def test_bad_warm_up_entries_are_refused_naming_matrix_and_engine(runs, msg):
    with pytest.raises(LabError, match=msg) as e:
        validate_matrix({"engines": [{"id": "a", "runs": runs}]}, "m.yaml")
    assert str(e.value).startswith("m.yaml: engine a: ")


def test_warm_ups_have_ids_of_their_own_and_say_so_in_their_line(tmp_path):
    m = validate_matrix({"engines": [{"id": "e", "runs": [{"concurrency": 4, "max_tokens": 32, "warmup": True},
                                                          {"concurrency": 4, "rounds": 2}]}]})
    assert [(r.id, r.warmup, r.max_tokens) for r in m["engines"][0]["runs"]] == [
        ("e/c4/w0", True, 32), ("e/c4/r0", False, 512), ("e/c4/r1", False, 512)]
    lines, _ = run(tmp_path, [{"id": "e1", "runs": [{"concurrency": 1, "warmup": True}, {"concurrency": 2, "warmup": True},
                                                    {"concurrency": 1, "rounds": 2}]}])
    assert [(l["run_id"], l["warmup"], l["outcome"]) for l in lines] == [
        ("e1/c1/w0", True, "ok"), ("e1/c2/w0", True, "ok"), ("e1/c1/r0", False, "ok"), ("e1/c1/r1", False, "ok")]


def test_skip_done_keeps_the_warm_ups_and_drops_an_engine_measured_in_full(tmp_path):
    prev = tmp_path / "prev.jsonl"
    prev.write_text("".join(json.dumps(dict(l, matrix="t", outcome="ok")) + "\n" for l in [
        {"run_id": "e1/c1/w0", "warmup": True}, {"run_id": "e1/c1/r0"}, {"run_id": "e1/c1/r1"},
        {"run_id": "e2/c1/w0", "warmup": True}, {"run_id": "e2/c1/r0"}]))
    warm = {"concurrency": 1, "max_tokens": 32, "warmup": True}
    lines, r = run(tmp_path, [{"id": "e1", "runs": [warm, {"concurrency": 1, "rounds": 3}]},
                              {"id": "e2", "runs": [warm, {"concurrency": 1}]}], extra=("--skip-done", str(prev)))
    # e1 starts with its warm-up again before its last measured run; e2 has nothing left to measure: not started
    assert [(l["run_id"], l["warmup"]) for l in lines] == [("e1/c1/w0", True), ("e1/c1/r2", False)]
    assert "3 run(s) already measured" in r.stdout and "e2" not in r.stdout


def test_a_restarted_engine_runs_the_warm_ups_that_completed_first(tmp_path):
    """A measured run's crash restarts the engine: it runs again the warm-ups that completed earlier in the call,
    not one that crashed (stock FULL's c32 warm-up would crash every restart)."""
    plan = {"e1/c2/w0": "crash", "e1/c1/r1": "crash"}
    warm = [{"concurrency": c, "max_tokens": 32, "warmup": True} for c in (1, 2, 4)]
    lines, r = run(tmp_path, [{"id": "e1", "env": {"FAKE_PLAN": json.dumps(plan)},
                               "runs": warm + [{"concurrency": 1, "rounds": 3}]}])
    got = [(l["attempt"], l["run_id"], l["outcome"]) for l in lines]
    assert got == [(1, "e1/c1/w0", "ok"), (1, "e1/c2/w0", "crash"),
                   (2, "e1/c1/w0", "ok"), (2, "e1/c4/w0", "ok"), (2, "e1/c1/r0", "ok"), (2, "e1/c1/r1", "crash"),
                   (3, "e1/c1/w0", "ok"), (3, "e1/c4/w0", "ok"), (3, "e1/c1/r2", "ok")]
    assert all(l["warmup"] == ("/w" in l["run_id"]) for l in lines)
    assert "not run before the deadline" not in r.stdout


def test_docs_matrices_names_every_key_the_runner_has_and_no_other():
    """docs/matrices.md is the matrix reference: each of its three tables lists exactly the runner's keys of that
    level (a key added to the runner without its line, or a line left for a removed key, fails here), and its
    example is a matrix the runner accepts."""
    from pathlib import Path

    from dflash_lab.runner import ENGINE_DEFAULTS, MATRIX_KEYS, RUN_DEFAULTS

    text = (Path(__file__).resolve().parents[1] / "docs" / "matrices.md").read_text()
    tables = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        title = part.splitlines()[0].strip()
        tables[title] = re.findall(r"^\| `([a-z_]+)` \|", part, flags=re.M)
    assert sorted(tables) == ["Engine keys", "Run keys", "Top-level keys"]
    for title, keys in (("Top-level keys", MATRIX_KEYS), ("Engine keys", ENGINE_DEFAULTS), ("Run keys", RUN_DEFAULTS)):
        got = tables[title]
        assert len(got) == len(set(got)), f"{title}: a key listed twice"
        assert set(got) == set(keys), f"{title}: missing {sorted(set(keys) - set(got))}, extra {sorted(set(got) - set(keys))}"
    # a scalar default is written as the runner has it (true/false, the number, the name)
    for title, defaults in (("Engine keys", ENGINE_DEFAULTS), ("Run keys", RUN_DEFAULTS)):
        part = text[text.index(f"## {title}"):]
        cells = dict(re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", part, flags=re.M))
        for key, v in defaults.items():
            if isinstance(v, (bool, int, float, str)):
                want = str(v).lower() if isinstance(v, bool) else str(v)
                assert cells[key].strip().strip("`") == want, f"{title}: {key}: docs say {cells[key]!r}, runner {v!r}"
    example = re.search(r"```yaml\n(.*?)```", text, flags=re.S).group(1)
    m = validate_matrix(yaml.safe_load(example), "docs/matrices.md")
    assert m["engines"][0]["engine"]["first_step_requests"] == 4


def test_two_entries_at_one_concurrency_need_a_tag(tmp_path):
    """A run id names one run (--skip-done, restarts and recorded outputs go by it): two entries of one engine at the
    same concurrency would give two runs one id, so the matrix is refused until one entry has a tag, which then names
    its runs apart. s66's first draft of a matrix with sampled and greedy runs at 8 gave ENGINE/c8/r0 twice."""
    sampled = {"concurrency": 8, "rounds": 2}
    greedy = {"concurrency": 8, "rounds": 2, "temperature": 0.0, "record_outputs": True}
    with pytest.raises(LabError, match=r"two run entries give run id 'e1/c8/r0' \(give one of them a tag\)"):
        validate_matrix(yaml.safe_load(matrix(tmp_path, [{"id": "e1", "runs": [sampled, greedy]}]).read_text()), "m")
    with pytest.raises(LabError, match="tag must be a short lowercase name"):
        validate_matrix(yaml.safe_load(matrix(tmp_path, [{"id": "e1", "runs": [sampled, dict(greedy, tag="Greedy")]}])
                                       .read_text()), "m")
    lines, _ = run(tmp_path, [{"id": "e1", "runs": [sampled, dict(greedy, tag="greedy")]}])
    assert [(l["run_id"], l["temperature"], l["round"]) for l in lines] == [
        ("e1/c8/r0", 0.7, 0), ("e1/c8/r1", 0.7, 1), ("e1/c8/greedy-r0", 0.0, 0), ("e1/c8/greedy-r1", 0.0, 1)]
