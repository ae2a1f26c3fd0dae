"""A run that timed out: what the engine was doing before the runner killed it (hang.py, matrix key hang_snapshot)."""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import run_cli
from dflash_lab import hang
from dflash_lab.errors import LabError
from dflash_lab.runner import read_lines, validate_matrix
from test_coredump import _fake_gdb
from test_runner import matrix

# cuda-gdb's kernel table as the H200 printed it for a crash's core (vLLM 0.22.1, s16, discriminate2-a-tp1's
# stock-control.a1.coredump.log), with a second, hypothetical row: a dump can hold several kernels
TABLE = """Opening GPU coredump: /tmp/cudacore/discriminate2-tp1/stock-control.a1/core.864
#0  copy_and_expand_dflash_inputs_kernel<<<(24,1,1),(128,1,1)>>> () at /tmp/vllm-site/vllm/v1/spec_decode/utils.py:551
  Kernel Parent Dev Grid Status                             SMs Mask  GridDim  BlockDim Invocation                             
*      0      -   0 544545 Active 0x0100000000000000000000000000000000 (24,1,1) (128,1,1) copy_and_expand_dflash_inputs_kernel() 
       1      -   0 544546 Active 0x0000000000000000000000000000000001 (13,1,1) (256,1,1) triton_poi_fused_2() 
#0  copy_and_expand_dflash_inputs_kernel<<<(24,1,1),(128,1,1)>>> () at /tmp/vllm-site/vllm/v1/spec_decode/utils.py:551
"""

SLEEPER = """
import threading, time
from dflash_lab import plugin
plugin.register()
def side():
    time.sleep(120)
threading.Thread(target=side).start()
def engine_step():
    time.sleep(120)
print("ready", flush=True)
engine_step()
"""


def _sleeper(tmp_path, folder):
    p = subprocess.Popen([sys.executable, "-c", SLEEPER], env={**os.environ, hang.ENV: str(folder)},
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_a_signalled_process_writes_every_threads_stack_and_keeps_running(tmp_path):
    folder = tmp_path / "stacks"
    p = _sleeper(tmp_path, folder)
    try:
        got = hang.signal_stacks(folder, p.pid)
        assert list(got) == [p.pid]
        threads = got[p.pid]["threads"]
        assert len(threads) == 2
        s = hang.summarize(threads)
        assert s["main"][0] == "<string>:9 engine_step" and s["others"] == ["<string>:6 side"]
        assert p.poll() is None   # a stack snapshot does not stop the engine
        again = hang.signal_stacks(folder, p.pid)   # a second signal: only what it added is read
        assert len(again[p.pid]["threads"]) == 2
    finally:
        os.killpg(p.pid, 9)
        p.wait()


def test_a_process_of_another_group_or_gone_is_not_signalled(tmp_path):
    folder = tmp_path / "stacks"
    p = _sleeper(tmp_path, folder)
    try:
        assert hang.signal_stacks(folder, os.getpgid(0)) == {}   # registered, but not of that engine's group
    finally:
        os.killpg(p.pid, 9)
        p.wait()
    assert hang.signal_stacks(folder, p.pid) == {}


def test_parse_stacks_reads_faulthandlers_format():
    text = ('Thread 0x00007f4af0b856c0 (most recent call first):\n'
            '  File "/x/threading.py", line 982 in run\n\n'
            'Current thread 0x00007f4af17c1b80 (most recent call first):\n'
            '  File "/v/vllm/v1/worker/gpu_model_runner.py", line 3105 in execute_model\n'
            '  File "/v/vllm/v1/engine/core.py", line 410 in step\n')
    t = hang.parse_stacks(text)
    assert [x["current"] for x in t] == [False, True]
    assert hang.summarize(t)["main"] == ["gpu_model_runner.py:3105 execute_model", "core.py:410 step"]


def test_kernel_table_lists_every_kernel_of_a_dump_once():
    ks = hang.kernel_table(TABLE)
    assert ks == [{"kernel": "copy_and_expand_dflash_inputs_kernel", "status": "Active", "grid": [24, 1, 1],
                   "block_dim": [128, 1, 1], "focus": True},
                  {"kernel": "triton_poi_fused_2", "status": "Active", "grid": [13, 1, 1], "block_dim": [256, 1, 1],
                   "focus": False}]
    assert hang.kernel_table("No CUDA kernels.\n") == []
    # a templated C++ kernel keeps its whole name (a hang inside FA3 would be one)
    row = ("*      0      -   0 7 Active 0x01 (132,1,1) (384,1,1) "
           "cutlass::device_kernel<flash::FlashAttnFwdSm90<int, (bool)1>>(flash::Params) \n")
    assert hang.kernel_table(row)[0]["kernel"] == "cutlass::device_kernel<flash::FlashAttnFwdSm90<int, (bool)1>>"


def test_no_dump_is_asked_for_when_the_deadline_leaves_too_little_time(tmp_path):
    d = tmp_path / "cores"
    d.mkdir()
    os.mkfifo(d / f"dumppipe.{os.getpid()}")
    h = hang.snapshot(None, d, None, tmp_path / "x.hang.log", core_wait_s=150, deadline=time.time() + 60)
    assert h["core"]["error"].startswith("not asked for") and not list(d.glob("core*"))
    assert hang.describe({"error": "OSError: boom"}).startswith("snapshot failed: OSError: boom")


def test_gpu_rows_keep_unreadable_values_as_none():
    assert hang._gpu_row("0, 100, 125.31, 1980, 120000") == {
        "index": 0, "utilization_pct": 100.0, "power_w": 125.31, "sm_mhz": 1980.0, "memory_mib": 120000.0}
    assert hang._gpu_row("0, [N/A], 81.1, 345, 0")["utilization_pct"] is None


def test_without_nvidia_smi_the_gpu_state_says_so(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert hang.gpu_state() == {"error": "nvidia-smi not found"}


def test_only_pipes_of_the_engines_vllm_processes_are_asked_for_a_dump(tmp_path):
    d = tmp_path / "cores"
    d.mkdir()
    me = os.getpid()
    for name in (f"dumppipe.{me}", "dumppipe.999999999"):
        os.mkfifo(d / name)
    (d / f"core.{me}").write_text("a dump")   # a regular file: no pipe
    assert list(hang.pipes(d, os.getpgid(0))) == [me]   # the dead pid's pipe is left out
    assert list(hang.pipes(d, os.getpgid(0), names={me: "EngineCore"})) == [me]
    assert list(hang.pipes(d, os.getpgid(0), names={12345: "EngineCore"})) == [me]   # none named has one: all
    # a pipe nobody reads: the request fails with the reason, nothing blocks
    assert "No such device or address" in hang.trigger(d / f"dumppipe.{me}")


def test_a_pipe_named_core_would_not_be_taken_for_a_dump(tmp_path):
    from dflash_lab import coredump

    os.mkfifo(tmp_path / "corepipe.1")
    assert coredump.cores(tmp_path) == []


@pytest.mark.parametrize("eng,msg", [
    ({"hang_snapshot": "yes"}, "hang_snapshot must be true or false"),
    ({"env": {"DFLASH_LAB_STACKS": "/x"}}, "which the runner sets from matrix keys"),
    ({"env": {"CUDA_COREDUMP_PIPE": "/x"}}, "which the runner sets from matrix keys"),
])
def test_bad_hang_settings_are_refused(eng, msg):
    with pytest.raises(LabError, match=msg):
        validate_matrix({"engines": [{"id": "a", "runs": [{}], **eng}]}, "m.yaml")


def test_a_timed_out_run_records_stacks_and_the_core_it_asked_for(tmp_path):
    """The runner with the fake engine (tests/fake_worker.py): its driver stand-in writes a core when its pipe is
    written to, the fake cuda-gdb prints TABLE for it. The line keeps the timeout and says what the engine was doing."""
    gdb = _fake_gdb(tmp_path, TABLE)
    logs = tmp_path / "logs"
    m = matrix(tmp_path, [
        {"id": "hung", "coredump": True, "hang_snapshot": True,
         "env": {"FAKE_PLAN": json.dumps({"hung/c2/r0": "hang"})}, "runs": [{"concurrency": 2, "rounds": 2}]},
        {"id": "plain", "env": {"FAKE_PLAN": json.dumps({"plain/c2/r0": "hang"})}, "runs": [{"concurrency": 2}]}],
        coredump_root=str(tmp_path / "cores"), run_timeout_s=3, coredump_wait_s=60)
    out = tmp_path / "runs.jsonl"
    r = run_cli("dflash_lab", "run", str(m), "--out", str(out), "--logs", str(logs),
                env={"DFLASH_LAB_CUDA_GDB": str(gdb)}, timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    lines = read_lines(out)
    assert [(l["run_id"], l["outcome"]) for l in lines] == [("hung/c2/r0", "timeout"), ("hung/c2/r1", "ok"),
                                                           ("plain/c2/r0", "timeout")]
    h = lines[0]["hang"]
    assert lines[0]["hang_snapshot"] is True and lines[0]["error"] == "run exceeded 3 s"
    assert 3 <= lines[0]["wall_s"] < 10   # the run's own time, not the snapshot's
    (pid, s), = h["stacks"].items()
    assert s["process"] == "worker" and any("main" in f for f in s["main"]) and s["threads"] >= 1
    assert h["core"]["triggered"] and h["core"]["core_file"].endswith(f"core.{pid}")
    assert [k["kernel"] for k in h["core"]["kernels"]] == ["copy_and_expand_dflash_inputs_kernel", "triton_poi_fused_2"]
    text = open(h["hang_log"]).read()
    assert f"=== stacks of pid {pid} (worker)" in text and "in main" in text
    assert "hang snapshot:" in r.stdout and "core: copy_and_expand_dflash_inputs_kernel Active" in r.stdout
    # the engine without the key: no snapshot, no stacks folder, no pipe
    assert "hang" not in lines[2] and lines[2]["hang_snapshot"] is False
    assert not list(logs.glob("plain.*.stacks"))


def test_a_run_cut_at_the_deadline_records_stacks_and_asks_for_no_dump(tmp_path):
    """A cold GPU host's first engine can leave its run less time than run_timeout_s: the runner's deadline cuts the
    run, which stays a deadline cut (not a timeout), and the snapshot still takes the GPU samples and the stacks. No
    dump is asked for past the deadline (one could take 150 s), and the line says so."""
    from dflash_lab.runner import DEADLINE_CUT
    logs = tmp_path / "logs"
    m = matrix(tmp_path, [
        {"id": "hung", "coredump": True, "hang_snapshot": True,
         "env": {"FAKE_PLAN": json.dumps({"hung/c2/r0": "hang"})}, "runs": [{"concurrency": 2, "rounds": 2}]}],
        coredump_root=str(tmp_path / "cores"), run_timeout_s=120, coredump_wait_s=60, startup_estimate_s=1)
    out = tmp_path / "runs.jsonl"
    t0 = time.time()
    r = run_cli("dflash_lab", "run", str(m), "--out", str(out), "--logs", str(logs), "--deadline-s", "36",
                timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    assert time.time() - t0 < 80   # no dump wait after the deadline
    lines = read_lines(out)
    assert [(l["run_id"], l["outcome"]) for l in lines] == [("hung/c2/r0", "timeout")]   # r1: not reached, no line
    assert lines[0]["error"] == DEADLINE_CUT
    h = lines[0]["hang"]
    (pid, s), = h["stacks"].items()
    assert s["process"] == "worker" and any("main" in f for f in s["main"])
    assert h["core"]["error"].startswith("not asked for") and "triggered" not in h["core"]
    assert not list((tmp_path / "cores").rglob("core.*"))
    assert f"=== stacks of pid {pid} (worker)" in open(h["hang_log"]).read()
