"""A run that timed out: what the engine was doing before the runner killed it (hang.py, matrix key hang_snapshot)."""

import json
import os
import signal
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
    _wait_asleep(p.pid)
    return p


def _wait_asleep(pid: int, timeout_s: float = 10.0) -> None:
    """Until every thread of ``pid`` sleeps (state S), at most ``timeout_s``: just past its "ready" line the main thread
    may not be in engine_step's sleep yet (on a loaded machine its stack read '<string>:10 <module>'). Without /proc,
    or once the time is up, it returns and the test's own assertions decide."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        states = hang.proc_state(pid).get("thread_states")   # none: no /proc, or the process is gone
        if states is None or set(states) == {"S"}:
            return
        time.sleep(0.05)


def test_a_signalled_process_writes_every_threads_stack_and_keeps_running(tmp_path):
    folder = tmp_path / "stacks"
    p = _sleeper(tmp_path, folder)
    try:
        got = hang.signal_stacks(folder, p.pid)
        assert list(got) == [p.pid]
        threads = got[p.pid]["threads"]
        # main, side, and the plugin's watcher that keeps faulthandler's handler in place (s55), which the summary
        # leaves out
        assert len(threads) == 3 and sum(hang._is_watcher(t) for t in threads) == 1
        s = hang.summarize(threads)
        assert s["main"][0] == "<string>:9 engine_step" and s["others"] == ["<string>:6 side"] and s["threads"] == 2
        assert p.poll() is None   # a stack snapshot does not stop the engine
        again = hang.signal_stacks(folder, p.pid)   # a second signal: only what it added is read
        assert len(again[p.pid]["threads"]) == 3
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


# --- /proc: why a process wrote no stacks ---------------------------------------------------------------------------

LINUX_PROC = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")

# a /proc/<pid>/status as Linux 6.x prints it (the fields around the signal masks trimmed); SIGUSR1 (10) is bit 9: 0x200
STATUS = """Name:\tVLLM::EngineCor
Umask:\t0022
State:\tS (sleeping)
Tgid:\t864
Pid:\t864
Threads:\t42
SigQ:\t1/1031036
SigPnd:\t0000000000000000
ShdPnd:\t0000000000000200
SigBlk:\t0000000000000000
SigIgn:\t0000000001001000
SigCgt:\t0000000180004a02
CapInh:\t0000000000000000
voluntary_ctxt_switches:\t1200
"""

# blocks SIGUSR1 in its main thread before any other thread starts (threads inherit the mask): the signal can reach
# no thread, stays pending, and faulthandler never writes
BLOCKER = """
import signal, threading, time
from dflash_lab import plugin
plugin.register()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
def side():
    time.sleep(120)
threading.Thread(target=side).start()
print("ready", flush=True)
time.sleep(120)
"""


def test_status_masks_say_whether_sigusr1_is_pending_blocked_ignored_caught():
    st = hang.parse_status(STATUS)
    assert st["State"] == "S (sleeping)" and st["Threads"] == "42" and st["SigQ"] == "1/1031036"
    assert "Name" not in st and "CapInh" not in st
    # pending for the process (ShdPnd: where kill puts it), not blocked, caught (0x...4a02 has 0x200), not ignored
    assert hang.signal_flags(st) == {"pending": True, "blocked": False, "ignored": False, "caught": True}
    # bit 9 off everywhere but SigBlk and SigPnd (a thread-directed pending signal), SigIgn with only the neighbours
    # 8 (0x100, SIGKILL 9) and 10 (0x400, SIGSEGV 11) set
    other = dict(st, SigPnd="0000000000000200", ShdPnd="0000000000000000", SigBlk="fffffffe7ffbfeff",
                 SigIgn="0000000000000500", SigCgt="0000000180004802")
    assert hang.signal_flags(other) == {"pending": True, "blocked": True, "ignored": False, "caught": False}
    assert hang.signal_flags(dict(other, SigPnd="0000000000000000", SigBlk="0000000000000100")) == {
        "pending": False, "blocked": False, "ignored": False, "caught": False}
    assert hang.has_signal("0000000000000200", 10) and not hang.has_signal("0000000000000200", 9)
    assert hang.signal_flags({}) == {"pending": None, "blocked": None, "ignored": None, "caught": None}
    assert hang.has_signal("zz") is None


@LINUX_PROC
def test_a_live_process_blocking_sigusr1_shows_it_blocked_then_pending(tmp_path):
    code = ("import signal, time\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        s = hang.proc_state(p.pid)
        main = s["rows"][0]
        assert main["tid"] == p.pid and main["sigusr1_blocked"] is True and int(main["sig_blk"], 16) & 0x200
        assert s["sigusr1"]["blocked"] is True and s["sigusr1"]["pending"] is False
        assert s["threads_blocking_sigusr1"] == s["threads_read"] == s["threads"] == 1
        os.kill(p.pid, signal.SIGUSR1)   # blocked: the default action (terminate) waits, pending
        t0 = time.time()
        while not ((s := hang.proc_state(p.pid))["sigusr1"]["pending"] and s["state"] == "S") and time.time() - t0 < 5:
            time.sleep(0.05)   # (just past its print it may still be running: R)
        assert s["sigusr1"] == {"pending": True, "blocked": True, "ignored": False, "caught": False}
        assert s["state"] == "S" and p.poll() is None
    finally:
        p.kill()
        p.wait()
    assert hang.proc_state(p.pid) == {"pid": p.pid, "error": f"/proc/{p.pid}/status unreadable (the process exited?)"}


def _task(root, pid, tid, comm, state, sig_blk="0000000000000000", stack=None, syscall="202 0x1 0x2 0x3"):
    d = root / str(pid) / "task" / str(tid)
    d.mkdir(parents=True)
    (d / "stat").write_text(f"{tid} ({comm}) {state} 1 864 864 0 -1 4194560 99 0 0 0 5 3 0 0 20 0 42 0\n")
    (d / "comm").write_text(comm + "\n")
    (d / "status").write_text(f"Name:\t{comm}\nState:\t{state} (x)\nSigPnd:\t0000000000000000\nSigBlk:\t{sig_blk}\n")
    (d / "wchan").write_text("futex_wait_queue" if state == "S" else "uvm_spin_loop")
    (d / "syscall").write_text(syscall + "\n")
    if stack is not None:
        (d / "stack").write_text(stack)
    return d


def test_a_fake_proc_tree_with_odd_names_and_vanished_files_reads_without_raising(tmp_path, monkeypatch):
    root = tmp_path / "proc"
    (root / "864").mkdir(parents=True)
    (root / "864" / "status").write_text(STATUS)
    _task(root, 864, 864, "VLLM::EngineCor", "S", stack="[<0>] futex_wait_queue+0x6b/0xa0\n[<0>] do_syscall_64\n")
    _task(root, 864, 870, "evil) (name x", "D", sig_blk="0000000000000200", syscall="running")   # no stack file
    _task(root, 864, 871, "python3", "S", syscall="not a number")
    (root / "864" / "task" / "872").mkdir()   # a thread that exited while the tree was listed: its files are gone
    (root / "864" / "task" / "873").write_text("")   # a name that is no directory: every read fails
    assert hang.parse_stat("870 (evil) (name x) D 1 864 864 0\n") == ("evil) (name x", "D")
    assert hang.parse_stat("garbage") == (None, None)

    s = hang.proc_state(864, root=root)
    assert s["state"] == "S" and s["threads"] == 42 and s["threads_read"] == 3
    assert s["thread_states"] == {"D": 1, "S": 2} and s["threads_blocking_sigusr1"] == 1
    assert s["sigusr1"] == {"pending": True, "blocked": False, "ignored": False, "caught": True}
    assert [r["tid"] for r in s["rows"]] == [864, 870, 871]   # the main thread first, then the D thread
    main, odd, plain = s["rows"]
    assert main["stack"] == ["[<0>] futex_wait_queue+0x6b/0xa0", "[<0>] do_syscall_64"] and main["syscall"] == 202
    assert odd == {"tid": 870, "comm": "evil) (name x", "state": "D", "sig_blk": "0000000000000200",
                   "sigusr1_blocked": True, "wchan": "uvm_spin_loop", "syscall": "running"}   # no "stack" key
    assert plain["syscall"] is None
    assert [r["tid"] for r in hang.proc_state(864, root=root, max_threads=2)["rows"]] == [864, 870]

    text = hang.proc_text(s, "EngineCore")
    assert text.startswith("=== /proc of pid 864 (EngineCore)\nState: S (sleeping)  Threads: 42")
    assert "--- tid 870 [evil) (name x] state D wchan uvm_spin_loop syscall running" in text
    assert "    [<0>] futex_wait_queue+0x6b/0xa0" in text and "blocked in 1 of 3 threads" in text

    line = hang.proc_summary(s, rows=2)
    assert set(line) == {"state", "threads", "sigusr1", "thread_states", "threads_blocking_sigusr1", "rows"}
    assert [r["tid"] for r in line["rows"]] == [864, 870] and "stack" not in line["rows"][0]
    h = {"gpu": {"error": "nvidia-smi not found"},
         "stacks": {"864": {"process": "EngineCore", "threads": 0, "main": [], "others": [],
                            "error": "no stacks written within 5 s", "proc": line},
                    "900": {"process": "worker", "threads": 1, "main": ["core.py:410 step"], "others": [],
                            "proc": dict(line, thread_states={"S": 3, "D": 2})}}}
    assert hang.describe(h) == ("gpu util nvidia-smi not found; EngineCore: no stacks written within 5 s (state S, "
                                "SIGUSR1 caught, blocked in 1/3 threads, pending; threads: 2 S, 1 D); "
                                "worker: core.py:410 step (2 threads in D state)")

    # a thread that exits between the count and its detailed read stays a row, marked gone; a process gone: its error
    real = hang.read_thread
    monkeypatch.setattr(hang, "read_thread", lambda task, detail=False, sig=hang.SIGNAL:
                        None if detail and task.name == "871" else real(task, detail, sig))
    assert hang.proc_state(864, root=root)["rows"][2]["gone"] is True
    gone = hang.proc_state(999, root=root)
    assert "error" in gone and hang.proc_summary(gone) == {"error": gone["error"]}
    assert hang.proc_text(gone).endswith("error: " + gone["error"])


@LINUX_PROC
def test_a_process_blocking_sigusr1_everywhere_gets_no_stacks_and_the_snapshot_says_why(tmp_path):
    """Beside a process that answers: the one blocking SIGUSR1 in every thread writes nothing within 5 s, and its
    entry (and the log line) says the signal is caught, blocked in all its threads and still pending."""
    folder = tmp_path / "stacks"
    ok = _sleeper(tmp_path, folder)
    p = subprocess.Popen([sys.executable, "-c", BLOCKER], env={**os.environ, hang.ENV: str(folder)},
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        h = hang.snapshot(folder, None, None, tmp_path / "x.hang.log")
        s, a = h["stacks"][str(p.pid)], h["stacks"][str(ok.pid)]
        assert s["error"] == "no stacks written within 5 s" and s["threads"] == 0
        assert s["proc"]["sigusr1"] == {"pending": True, "blocked": True, "ignored": False, "caught": True}
        # main, side and the watcher, which blocks SIGUSR1 in itself so that it never takes the snapshot's signal
        assert s["proc"]["threads"] == s["proc"]["threads_blocking_sigusr1"] == 3
        assert all(r["sigusr1_blocked"] for r in s["proc"]["rows"])
        # the one that answered: its stacks, and nothing blocked or pending
        assert a["main"][0] == "<string>:9 engine_step" and a["proc"]["threads_blocking_sigusr1"] == 1   # the watcher
        assert a["proc"]["sigusr1"] == {"pending": False, "blocked": False, "ignored": False, "caught": True}
        line = hang.describe(h)
        assert (f"{p.pid}: no stacks written within 5 s (state S, SIGUSR1 caught, blocked in all 3 threads, pending; "
                "threads: 3 S)") in line
        assert f"{ok.pid}: <string>:9 engine_step" in line
        text = open(h["hang_log"]).read()
        assert f"=== /proc of pid {p.pid} (process unknown)" in text and "(SIGUSR1 blocked)" in text
        assert text.index(f"=== stacks of pid {p.pid}") < text.index(f"=== /proc of pid {p.pid}")
        assert p.poll() is None and ok.poll() is None
    finally:
        for q in (p, ok):
            os.killpg(q.pid, 9)
            q.wait()
