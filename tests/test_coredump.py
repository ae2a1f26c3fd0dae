"""Naming the faulting kernel: cuda-gdb summaries parsed, and the runner's coredump option."""

import json
import os
import stat

from dflash_lab.coredump import parse_cuda_gdb, wait_for_core
from conftest import run_cli
from dflash_lab.runner import read_lines
from test_runner import matrix

# cuda-gdb's summaries of two GPU core dumps taken on the H200 (vLLM 0.22.1, 2026-11-30)
STOCK = """Opening GPU coredump: /tmp/cudacore/core.860
[Current focus set to CUDA kernel 0, grid 543435, block (0,0,0), thread (96,0,0), device 0, sm 128, warp 0, lane 0]

CUDA Exception: Warp Out-of-range Address
The exception was triggered at PC 0x7fb9016f2150  copy_and_expand_dflash_inputs_kernel  (utils.py:542)
#0  copy_and_expand_dflash_inputs_kernel<<<(24,1,1),(128,1,1)>>> () at /tmp/vllm-site/vllm/v1/spec_decode/utils.py:551
551	    bonus_token = tl.load(next_token_ids_ptr + req_idx)
"""
GDN = """Opening GPU coredump: /tmp/cudacore3/core.2097
[Current focus set to CUDA kernel 0, grid 365954, block (0,0,25), thread (32,0,0), device 0, sm 0, warp 0, lane 0]

CUDA Exception: Warp Illegal Address
The exception was triggered at PC 0x7f1b39f6ae00  fused_sigmoid_gating_delta_rule_update_kernel
#0  0x00007f1b39f6b130 in fused_sigmoid_gating_delta_rule_update_kernel<<<(1,4,768),(128,1,1)>>> ()
"""


def test_parse_stock_fault():
    f = parse_cuda_gdb(STOCK)
    assert f["kernel"] == "copy_and_expand_dflash_inputs_kernel"
    assert f["exception"] == "Warp Out-of-range Address"
    assert f["source"] == "utils.py:542"
    assert f["frame_source"] == "/tmp/vllm-site/vllm/v1/spec_decode/utils.py:551"
    assert f["grid"] == [24, 1, 1] and f["block_dim"] == [128, 1, 1]
    assert f["focus_block"] == [0, 0, 0] and f["focus_thread"] == [96, 0, 0]
    assert f["pc"] == "0x7fb9016f2150"


def test_parse_gdn_fault_without_source_line():
    f = parse_cuda_gdb(GDN)
    assert f["kernel"] == "fused_sigmoid_gating_delta_rule_update_kernel"
    assert f["exception"] == "Warp Illegal Address"
    assert f["source"] is None and f["frame_source"] is None
    assert f["grid"] == [1, 4, 768] and f["focus_block"] == [0, 0, 25]


def test_parse_garbage_gives_nones():
    f = parse_cuda_gdb("cuda-gdb: not a core file\n")
    assert set(f.values()) == {None}


def test_wait_returns_when_nothing_is_alive_and_no_core(tmp_path):
    assert wait_for_core(tmp_path, None, timeout_s=30) is None


def test_runner_waits_for_the_core_and_records_the_fault(tmp_path):
    gdb = tmp_path / "fake-cuda-gdb"
    fixture = tmp_path / "summary.txt"
    fixture.write_text(STOCK)
    # prints the summary only for a complete core file, as cuda-gdb only reads complete ones
    gdb.write_text("#!/bin/sh\ncore=$(echo \"$3\" | sed 's/target cudacore //')\n"
                   f"if tail -c 3 \"$core\" | grep -q END; then cat {fixture}; else echo truncated core; exit 1; fi\n")
    gdb.chmod(gdb.stat().st_mode | stat.S_IEXEC)
    plan = {"e1/c2/r0": "coredump"}
    m = matrix(tmp_path, [{"id": "e1", "coredump": True, "env": {"FAKE_PLAN": json.dumps(plan)},
                           "runs": [{"concurrency": 2, "rounds": 2}]}],
               coredump_root=str(tmp_path / "cores"), run_timeout_s=60)
    out = tmp_path / "runs.jsonl"
    r = run_cli("dflash_lab", "run", str(m), "--out", str(out), env={"DFLASH_LAB_CUDA_GDB": str(gdb)})
    assert r.returncode == 0, r.stderr + r.stdout
    lines = read_lines(out)
    assert [l["outcome"] for l in lines] == ["crash", "ok"]
    f = lines[0]["fault"]
    assert f["kernel"] == "copy_and_expand_dflash_inputs_kernel" and f["source"] == "utils.py:542"
    assert f["core_bytes"] == 4003 and "error" not in f
    assert os.path.exists(f["core_file"])  # the core stays on the host
    assert "fault" not in lines[1]


def test_every_rank_core_is_read_and_named_by_its_process(tmp_path):
    gdb = tmp_path / "fake-cuda-gdb"
    (tmp_path / "stock.txt").write_text(STOCK)
    (tmp_path / "gdn.txt").write_text(GDN)
    # rank 0's core reads as the DFlash kernel, rank 1's as the GDN kernel
    gdb.write_text("#!/bin/sh\ncore=$(echo \"$3\" | sed 's/target cudacore //')\n"
                   f"if head -c 5 \"$core\" | grep -q RANK1; then cat {tmp_path / 'gdn.txt'}; else cat {tmp_path / 'stock.txt'}; fi\n")
    gdb.chmod(gdb.stat().st_mode | stat.S_IEXEC)
    m = matrix(tmp_path, [{"id": "e1", "coredump": True, "env": {"FAKE_PLAN": json.dumps({"e1/c2/r0": "coredump-tp2"})},
                           "runs": [{"concurrency": 2, "rounds": 1}]}],
               coredump_root=str(tmp_path / "cores"), run_timeout_s=60)
    out = tmp_path / "runs.jsonl"
    r = run_cli("dflash_lab", "run", str(m), "--out", str(out), env={"DFLASH_LAB_CUDA_GDB": str(gdb)})
    assert r.returncode == 0, r.stderr + r.stdout
    f = read_lines(out)[0]["fault"]
    # the dump that finished first leads: rank 1's
    assert f["process"] == "Worker_TP1" and f["kernel"] == "fused_sigmoid_gating_delta_rule_update_kernel"
    assert [(c["process"], c["kernel"]) for c in f["cores"]] == [
        ("Worker_TP1", "fused_sigmoid_gating_delta_rule_update_kernel"),
        ("Worker_TP0", "copy_and_expand_dflash_inputs_kernel")]
    text = open(f["gdb_log"]).read()
    assert "(Worker_TP0)" in text and "(Worker_TP1)" in text


def _fake_gdb(tmp_path, text=STOCK):
    gdb = tmp_path / "fake-cuda-gdb"
    (tmp_path / "summary.txt").write_text(text)
    gdb.write_text("#!/bin/sh\ncore=$(echo \"$3\" | sed 's/target cudacore //')\n"
                   f"echo \"Opening GPU coredump: $core\"; cat {tmp_path / 'summary.txt'}\n")
    gdb.chmod(gdb.stat().st_mode | stat.S_IEXEC)
    return gdb


def test_a_later_invocation_never_reads_an_earlier_ones_cores(tmp_path):
    # s19: two calls of one matrix on one host reused engine tags, and the second call's crash lines led with the
    # first call's cores (a stale triton_poi_fused_2 named for a run whose own core was the DFlash input kernel)
    gdb = _fake_gdb(tmp_path)
    m = matrix(tmp_path, [{"id": "e1", "coredump": True, "env": {"FAKE_PLAN": json.dumps({"e1/c2/r0": "coredump"})},
                           "runs": [{"concurrency": 2, "rounds": 1}]}],
               coredump_root=str(tmp_path / "cores"), run_timeout_s=60)
    faults = []
    for call in ("a", "b"):
        out = tmp_path / f"runs-{call}.jsonl"
        r = run_cli("dflash_lab", "run", str(m), "--out", str(out), env={"DFLASH_LAB_CUDA_GDB": str(gdb)})
        assert r.returncode == 0, r.stderr + r.stdout
        faults.append(read_lines(out)[0]["fault"])
    a, b = faults
    assert a["core_file"] != b["core_file"]
    assert os.path.dirname(a["core_file"]) != os.path.dirname(b["core_file"])
    assert "cores" not in b and "stale_cores" not in b   # one core: its own
    assert os.path.exists(a["core_file"]) and os.path.exists(b["core_file"])   # both stay on the host


def test_cores_written_before_the_engine_started_are_left_out(tmp_path, monkeypatch):
    from dflash_lab import coredump
    gdb = _fake_gdb(tmp_path)
    monkeypatch.setenv("DFLASH_LAB_CUDA_GDB", str(gdb))
    d = tmp_path / "cores"
    d.mkdir()
    old, new = d / "core.111", d / "core.222"
    old.write_text("old")
    os.utime(old, (1_000_000, 1_000_000))
    new.write_text("new")
    since = os.stat(new).st_mtime - 1
    f = coredump.collect(d, None, tmp_path / "gdb.log", wait_s=5, since=since)
    assert f["core_file"] == str(new) and f["pid"] == 222
    assert f["stale_cores"] == [str(old)] and "cores" not in f
    # without `since` both are read and the older leads: the behaviour that misled s19
    g = coredump.collect(d, None, tmp_path / "gdb2.log", wait_s=5)
    assert g["pid"] == 111 and [c["pid"] for c in g["cores"]] == [111, 222]


def test_a_device_assert_is_named_as_one():
    text = ("Opening GPU coredump: /tmp/cudacore/core.2012\n"
            "[Current focus set to CUDA kernel 0, grid 75355, block (52,0,0), thread (0,0,0), device 0, sm 38, warp 0, lane 0]\n\n"
            "Assertion failed.\n#0  0x00007f83138524f0 in triton_poi_fused_2<<<(288,1,1),(128,1,1)>>> ()\n")
    f = parse_cuda_gdb(text)
    assert f["kernel"] == "triton_poi_fused_2" and f["grid"] == [288, 1, 1]
    assert f["exception"] == "Assertion failed (device-side assert)"


def test_a_server_crash_line_keeps_what_the_clients_saw(tmp_path):
    # s19: the core file appeared before the worker's run_end, and the crash lines lost the clients' statuses and
    # error bodies (issue 12 asks for exactly those)
    gdb = _fake_gdb(tmp_path)
    m = matrix(tmp_path, [{"id": "e1", "coredump": True,
                           "env": {"FAKE_PLAN": json.dumps({"e1/c4/r0": "coredump-server"})},
                           "runs": [{"concurrency": 4, "rounds": 1}]}],
               coredump_root=str(tmp_path / "cores"), run_timeout_s=60)
    out = tmp_path / "runs.jsonl"
    r = run_cli("dflash_lab", "run", str(m), "--out", str(out), env={"DFLASH_LAB_CUDA_GDB": str(gdb)})
    assert r.returncode == 0, r.stderr + r.stdout
    (line,) = read_lines(out)
    assert line["outcome"] == "crash"
    assert line["fault"]["kernel"] == "copy_and_expand_dflash_inputs_kernel"
    assert line["requests_completed"] == 1 and line["http_statuses"] == [200] * 4
    assert line["request_errors"]["by_kind"] == {"stream_error_event": 3}
    assert line["wall_s"] == 3.0 and line["runner_wall_s"] < 3.0   # the clients' time, and when the runner saw the core


def test_keep_running_asks_the_driver_not_to_abort(tmp_path):
    from dflash_lab import analysis, coredump
    assert "skip_abort" not in coredump.env(tmp_path)["CUDA_COREDUMP_GENERATION_FLAGS"]
    assert coredump.env(tmp_path, keep_running=True)["CUDA_COREDUMP_GENERATION_FLAGS"] == coredump.FLAGS + ",skip_abort"
    m = matrix(tmp_path, [{"id": "e1", "coredump": "keep-running", "runs": [{"concurrency": 2, "rounds": 1}]}],
               coredump_root=str(tmp_path / "cores"), run_timeout_s=60)
    out = tmp_path / "runs.jsonl"
    r = run_cli("dflash_lab", "run", str(m), "--out", str(out))
    assert r.returncode == 0, r.stderr + r.stdout
    (line,) = read_lines(out)
    assert line["coredump"] == "keep-running" and "core dump on (keep running)" in analysis.instruments(line)
    log = open(line["log"]).read()
    assert "CUDA_COREDUMP_GENERATION_FLAGS=" + coredump.FLAGS + ",skip_abort" in log


def test_coredump_takes_true_false_or_keep_running(tmp_path):
    m = matrix(tmp_path, [{"id": "e1", "coredump": "yes", "runs": [{"concurrency": 2, "rounds": 1}]}],
               coredump_root=str(tmp_path / "cores"))
    r = run_cli("dflash_lab", "run", str(m), "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and "coredump must be true, false or 'keep-running'" in r.stderr


def test_a_missing_core_says_whether_the_driver_had_started_one(tmp_path):
    """s49: the control at 24 crashed, its engine log held the driver's 'Starting GPU coredump generation', and no core
    file appeared; the fault now records that the dump had started, and without the line that it had not."""
    from dflash_lab import coredump
    d = tmp_path / "cores"
    d.mkdir()
    log = tmp_path / "engine.log"
    log.write_text("x.py:97: unknown: block: [53,0,0], thread: [57,0,0] Assertion `index out of bounds` failed.\n"
                   "Starting GPU coredump generation, set the CUDA_COREDUMP_SHOW_PROGRESS environment variable to 1\n")
    f = coredump.collect(d, None, tmp_path / "gdb.log", wait_s=2, engine_log=log)
    assert f["kernel"] is None and f["dump_started"] is True
    assert f["error"].startswith(f"no core file in {d} after ") and f["error"].endswith("started a dump")
    log.write_text("no dump here\n")
    g = coredump.collect(d, None, tmp_path / "gdb.log", wait_s=2, engine_log=log)
    assert g["dump_started"] is False and "started a dump" not in g["error"]
    h = coredump.collect(d, None, tmp_path / "gdb.log", wait_s=2)
    assert "dump_started" not in h


def test_reading_cores_is_bounded_by_the_runners_deadline(tmp_path, monkeypatch):
    """A crash near the runner's deadline: each cuda-gdb reading gets the time left (at least MIN_GDB_S), not 180 s
    per core, so a runner that outlives the device calls (scripts/gpu/detached.sh) ends near its deadline."""
    import time

    from dflash_lab import coredump
    d = tmp_path / "cores"
    d.mkdir()
    (d / "core.1").write_text("x")
    got = []
    monkeypatch.setattr(coredump, "read_core", lambda core, timeout_s: got.append(timeout_s) or ("", None))
    coredump.collect(d, None, None, wait_s=1)
    coredump.collect(d, None, None, wait_s=1, deadline=time.time() - 100)
    coredump.collect(d, None, None, wait_s=1, deadline=time.time() + 50)
    assert got[0] == 180.0 and got[1] == coredump.MIN_GDB_S and 45 < got[2] <= 50
