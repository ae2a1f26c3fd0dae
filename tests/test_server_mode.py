"""The server mode end to end on the CPU: the runner starts dflash_lab.worker, which starts
``python -m vllm.entrypoints.openai.api_server`` - here the stand-in in tests/fake_vllm - waits for
/health, sends each run's streamed chat requests, reads the spec-decode counters from /metrics and
writes one line per run; a server that dies mid-run or at start-up is recorded as such.
The server mode has not started on a GPU yet: this is what can be checked before it does."""

import json

import yaml

from conftest import ROOT, run_cli
from dflash_lab.runner import read_lines

FAKE = ROOT / "tests" / "fake_vllm"


def _run(tmp_path, engines, name="m", **top):
    m = {"name": name, "run_timeout_s": 30, "startup_timeout_s": 60, "models_dir": str(tmp_path / "models"),
         "defaults": {"target": "tiny-dense", "mode": "server", "acceptance": 1.86}, "engines": engines, **top}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(m))
    out, logs = tmp_path / f"{name}.jsonl", tmp_path / f"{name}-logs"
    r = run_cli("dflash_lab", "run", str(p), "--out", str(out), "--logs", str(logs), timeout=300,
                env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}:{FAKE}"})
    assert r.returncode == 0, r.stderr + r.stdout
    return read_lines(out), logs


def test_server_runs_measure_requests_and_spec_decode_counters(tmp_path):
    lines, logs = _run(tmp_path, [{"id": "srv", "runs": [{"concurrency": 3, "rounds": 2, "max_tokens": 20}]}])
    assert [(l["run_id"], l["outcome"]) for l in lines] == [("srv/c3/r0", "ok"), ("srv/c3/r1", "ok")]
    for l in lines:
        assert l["requests_completed"] == 3 and l["output_tokens"] == 60 and l["server_alive"] is True
        sm = l["serve_metrics"]
        assert sm["completed"] == 3 and sm["total_output_tokens"] == 60 and sm["output_throughput"] > 0
        # counters are read before and after each run: the run's own deltas (10 draft steps per request)
        sd = l["spec_decode_metrics"]
        assert (sd["num_drafts"], sd["num_draft_tokens"], sd["num_accepted"]) == (30, 450, 30)
        assert sd["acceptance_length"] == 2.0 and sd["per_position_rates"][:2] == [1.0, 0.0]
    log = (logs / "srv.a1.log").read_text()
    args = log.split("fake vllm api_server args: ", 1)[1].splitlines()[0]
    assert "--speculative-config" in args and "synthetic_acceptance_length" in args and "--api-key sk-local" in args


def test_a_server_dying_mid_run_is_a_crash_and_one_failing_at_start_up_is_named(tmp_path):
    lines, _ = _run(tmp_path, [
        {"id": "dies", "env": {"FAKE_SERVER": json.dumps({"die_after": 4})},
         "runs": [{"concurrency": 3, "rounds": 2, "max_tokens": 20}]},
        {"id": "nostart", "env": {"FAKE_SERVER": json.dumps({"startup": "exit"})},
         "runs": [{"concurrency": 1}]}], name="bad")
    by = {l["run_id"]: l for l in lines}
    assert by["dies/c3/r0"]["outcome"] == "ok"
    crash = by["dies/c3/r1"]
    assert crash["outcome"] == "crash" and crash["server_alive"] is False and crash["requests_failed"] >= 2
    assert sum(crash["request_errors"]["by_kind"].values()) == crash["requests_failed"]
    start = [l for l in lines if l["engine_id"] == "nostart"]
    assert start and all(l["outcome"] == "startup_error" for l in start)
    assert "server exited with code 1 during start-up" in start[0]["error"]


def _servers_alive(logs) -> list[str]:
    """Served-model names (unique per engine) of fake servers still running after the runner returned."""
    import re
    import subprocess

    names = set()
    for log in logs.glob("*.log"):
        names |= set(re.findall(r"--served-model-name (dflash-lab-\d+)", log.read_text()))
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    return sorted(n for n in names if n in ps)


def test_a_hung_server_is_killed_and_the_next_engine_gets_its_own(tmp_path):
    lines, logs = _run(tmp_path, [
        {"id": "hangs", "env": {"FAKE_SERVER": json.dumps({"hang_after": 0})}, "runs": [{"concurrency": 1}]},
        {"id": "next", "runs": [{"concurrency": 2, "max_tokens": 10}]}], name="hang", run_timeout_s=6)
    by = {l["run_id"]: l for l in lines}
    assert by["hangs/c1/r0"]["outcome"] == "timeout"
    ok = by["next/c2/r0"]
    assert ok["outcome"] == "ok" and ok["requests_completed"] == 2 and ok["spec_decode_metrics"]["num_drafts"] == 10
    # every engine's server is gone once the runner is done: none holds the GPU or a port for the next call
    assert _servers_alive(logs) == []


def test_a_run_with_failed_requests_waits_for_the_exiting_server_to_be_seen_dead(monkeypatch):
    """A server that dropped its streams closes its sockets before its process ends: one look right after the
    requests may still see it alive (a crash line with server_alive true, seen once in a full test run). The run
    looks again for a while; a run whose requests all succeeded does not wait."""
    from dflash_lab import servebench, worker

    looks = []

    def alive():
        looks.append(1)
        return len(looks) < 3                  # seen alive twice, then gone

    def requests(failed):
        def run_requests(url, body, n, c, timeout):
            if failed:
                return [servebench.RequestResult(index=i, elapsed=0.5) for i in range(n)], 1.0
            return [servebench.RequestResult(index=i, status=200, success=True, ttft=0.1, latency=0.5, elapsed=0.5,
                                             output_tokens=4, done=True) for i in range(n)], 1.0
        return run_requests

    run = {"concurrency": 2, "max_tokens": 4, "temperature": 0.7, "stream": True, "ignore_eos": True}
    monkeypatch.setattr(servebench, "run_requests", requests(True))
    reads = iter([{"drafts": 10, "draft_tokens": 150, "accepted": 9, "per_pos": None},
                  {"drafts": 30, "draft_tokens": 450, "accepted": 27, "per_pos": None}])
    scrape = lambda: next(reads)  # noqa: E731
    out = worker.serve_run("http://x", "m", "p", run, alive, scrape)
    assert out["outcome"] == "crash" and out["server_alive"] is False and len(looks) == 3
    # the counters were read while the dying server still answered, before the wait: the run's own drafts
    assert out["spec_decode_metrics"]["num_drafts"] == 20 and out["spec_decode_metrics"]["num_accepted"] == 18
    looks.clear()
    monkeypatch.setattr(servebench, "run_requests", requests(False))
    counters = lambda: {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": None}  # noqa: E731
    out = worker.serve_run("http://x", "m", "p", run, lambda: looks.append(1) or True, counters)
    assert out["outcome"] == "ok" and out["server_alive"] is True and len(looks) == 2


def test_a_server_gone_or_silent_after_the_requests_records_no_counters(monkeypatch):
    """s48's three crash lines (before this) said 0 drafts: the runner had put the counters read before the run in place
    of the ones it could not read after. Counters not read are None, never a zero or a negative delta."""
    from dflash_lab import servebench, worker

    def failed(url, body, n, c, timeout):
        return [servebench.RequestResult(index=i, elapsed=0.5) for i in range(n)], 1.0

    monkeypatch.setattr(servebench, "run_requests", failed)
    run = {"concurrency": 2, "max_tokens": 4, "temperature": 0.7, "stream": True, "ignore_eos": True}
    before = {"drafts": 10, "draft_tokens": 150, "accepted": 9, "per_pos": None}
    out = worker.serve_run("http://x", "m", "p", run, lambda: False, lambda: before)       # gone at once
    assert out["outcome"] == "crash" and out["spec_decode_metrics"] is None
    reads = iter([before, None])                                                          # alive, but no answer
    looks = iter([True, False])
    out = worker.serve_run("http://x", "m", "p", run, lambda: next(looks), lambda: next(reads))
    assert out["outcome"] == "crash" and out["spec_decode_metrics"] is None
    assert worker.spec_delta(None, before) is None and worker.spec_delta(before, None) is None
