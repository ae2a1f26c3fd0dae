"""Whose handler answers SIGUSR1 (dflash_lab.hang.handler_of) and the stage-by-stage check (dflash_lab.sigstages),
on the CPU: real sigaction calls in this process, and the stage runner in child processes (it registers
faulthandler for SIGUSR1, which must not leak into the test process)."""

import ctypes
import faulthandler
import json
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from dflash_lab import hang, sigstages
from dflash_lab.errors import LabError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sigaction/dladdr layout: Linux only")

SIG = signal.SIGUSR2   # not SIGUSR1: the suite's own processes may have it registered


def test_handler_of_names_the_object_that_holds_the_handler():
    libc = ctypes.CDLL(None)
    saved = hang._Sigaction()
    assert libc.sigaction(int(SIG), None, ctypes.byref(saved)) == 0
    try:
        signal.signal(SIG, signal.SIG_DFL)
        assert hang.handler_of(SIG)["handler"] == "default"
        signal.signal(SIG, signal.SIG_IGN)
        assert hang.handler_of(SIG)["handler"] == "ignore"
        faulthandler.register(SIG, file=sys.stderr)
        fh = hang.handler_of(SIG)
        assert fh["handler"].startswith("0x") and "python" in (fh["object"] or "").lower()
        faulthandler.unregister(SIG)
        # a handler a C library set: Python's own table (signal.getsignal) does not see it, sigaction does
        act = hang._Sigaction()
        act.handler = ctypes.cast(libc.getpid, ctypes.c_void_p).value
        assert libc.sigaction(int(SIG), ctypes.byref(act), None) == 0
        c = hang.handler_of(SIG)
        assert "libc" in c["object"] and "getpid" in c["symbol"] and c["handler"] == hex(act.handler)
        assert c != fh and "libc" in hang.handler_text(c) and "getpid" in hang.handler_text(c)
    finally:
        libc.sigaction(int(SIG), ctypes.byref(saved), None)


def _child(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


def test_stages_keep_faulthandler_and_the_forked_copy_writes_stacks(tmp_path):
    """The command as the GPU host runs it, here without CUDA: every CUDA stage says it was skipped (nothing
    simulated), the handler stays faulthandler's and SIGUSR1 makes the copy write stacks."""
    out = tmp_path / "s.jsonl"
    r = subprocess.run([sys.executable, "-m", "dflash_lab", "sigstages", "--out", str(out)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = sigstages.read(out)
    assert [ln["stage"] for ln in lines] == (["provenance", "faulthandler registered"]
                                             + [n for n, _ in sigstages.STAGES] + ["SIGUSR1 to a forked copy"])
    assert not any(ln.get("replaced") for ln in lines)
    last = lines[-1]
    assert last["ok"] and last["stacks_bytes"] > 0 and last["copy"] == "exit 0"
    rows = sigstages.summary(lines)
    assert rows[-1]["outcome"].startswith("stacks written")
    if "CUDA visible: False" in lines[2]["note"]:
        assert lines[3]["skipped"] == "no CUDA device visible"
    # the record is never overwritten
    again = subprocess.run([sys.executable, "-m", "dflash_lab", "sigstages", "--out", str(out)],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and "exists" in again.stderr and sigstages.read(out) == lines


def test_a_stage_that_replaces_the_handler_is_named_and_silences_the_stacks(tmp_path):
    """What s53-s54 saw in the EngineCore (caught, not pending, no stacks), made here on purpose: a later stage sets
    its own SIGUSR1 handler. The line of that stage says replaced, the copy writes no stacks; a failing stage is
    recorded and the stages after it still run."""
    r = _child("""
        import signal, sys
        from dflash_lab import sigstages
        def replace():
            signal.signal(signal.SIGUSR1, lambda *a: None)
            return "set a Python handler"
        def boom():
            raise ValueError("stage broke")
        lines = sigstages.run("s.jsonl", stages=[("fine", lambda: "nothing"), ("replace", replace), ("boom", boom)])
        """, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = sigstages.read(tmp_path / "s.jsonl")
    by = {ln["stage"]: ln for ln in lines}
    assert by["fine"]["replaced"] is False and by["replace"]["replaced"] is True
    assert by["boom"]["ok"] is False and "ValueError: stage broke" in by["boom"]["error"] and by["boom"]["replaced"]
    last = lines[-1]
    assert last["ok"] is False and last["stacks_bytes"] == 0 and last["copy"] == "exit 0"
    assert sigstages.summary(lines)[-1]["outcome"] == "no stacks written, copy exit 0"


def test_the_watcher_sets_faulthandlers_handler_back(tmp_path):
    """What the plugin now does in every engine process (s55: Triton's first compile replaces the handler, long after
    the plugin registered): a Python handler and a C one (set with sigaction, as libtriton does) are each replaced by
    faulthandler's exact action, told once each, and SIGUSR1 then writes stacks. Without the watcher the same
    replacement leaves the stacks file empty, as the EngineCore's was in s53-s54."""
    r = _child("""
        import ctypes, os, signal, time
        from pathlib import Path
        from dflash_lab import hang
        logged = []
        print(hang.install("stacks", watch_s=0.05, log=logged.append))
        installed = hang.handler_of()
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        time.sleep(0.4)
        assert hang.handler_of() == installed, hang.handler_of()
        libc = ctypes.CDLL(None)
        act = hang._Sigaction()
        act.handler = ctypes.cast(libc.getpid, ctypes.c_void_p).value
        assert libc.sigaction(int(signal.SIGUSR1), ctypes.byref(act), None) == 0
        time.sleep(0.4)
        assert hang.handler_of() == installed and len(logged) == 2, logged
        time.sleep(0.2)
        assert len(logged) == 2   # each replaced handler is told once
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        print(Path(hang._installed["path"]).stat().st_size)
        print(logged[0]); print(logged[1])
        """, tmp_path)
    assert r.returncode == 0, r.stderr
    msg, size, first, second = r.stdout.splitlines()
    assert "kept there (checked every 0.05 s)" in msg and int(size) > 0
    assert first.startswith("SIGUSR1 handler replaced") and ": ignore;" in first and "set back" in first
    assert "getpid" in second and "libc" in second
    r = _child("""
        import os, signal, time
        from pathlib import Path
        from dflash_lab import hang
        hang.install("stacks", watch_s=None)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        print(Path(hang._installed["path"]).stat().st_size)
        """, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0"]


def test_a_forked_child_registers_faulthandler_anew(tmp_path):
    """A child forked after its parent's handler was replaced inherits faulthandler's registration; faulthandler's
    register() then swaps only the file (s55: registering again after Triton's compile kept Triton's handler).
    install() sets the handler anew, so the child's stacks are written."""
    r = _child("""
        import os, signal, time
        from pathlib import Path
        from dflash_lab import hang
        hang.install("stacks", watch_s=None)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)   # the parent compiled Triton, say
        pid = os.fork()
        if pid == 0:
            hang.install("stacks", watch_s=None)
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.2)
            os._exit(0 if Path(hang._installed["path"]).stat().st_size > 0 else 1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), pid)
        """, tmp_path)
    assert r.returncode == 0, r.stderr
    code, pid = r.stdout.split()
    assert code == "0" and (tmp_path / "stacks" / f"stacks.{pid}.txt").stat().st_size > 0


def test_sigstages_with_the_watcher_reports_the_handler_it_set_back(tmp_path):
    r = _child("""
        import signal
        from dflash_lab import sigstages
        def replace():
            signal.signal(signal.SIGUSR1, lambda *a: None)
            return "set a Python handler"
        sigstages.run("s.jsonl", stages=[("replace", replace)], watch_s=0.05, fresh_triton_cache=True)
        """, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = sigstages.read(tmp_path / "s.jsonl")
    assert lines[0]["watch_s"] == 0.05 and "TRITON_CACHE_DIR" in lines[0]["env"]
    assert lines[2]["replaced"] is False and len(lines[2]["watcher"]) == 1 and lines[-1]["ok"]
    assert sigstages.summary(lines)[1]["set back by the watcher"].startswith("SIGUSR1 handler replaced")


def test_a_handler_set_back_while_its_stage_still_runs_is_reported_with_that_stage(tmp_path):
    """s56's watch record on the H200 showed faulthandler's handler after the Triton stage and an empty watcher list:
    the watcher had set libtriton's handler back during the 1.2 s compile, before the stage's count was taken."""
    r = _child("""
        import signal, time
        from dflash_lab import sigstages
        def replace():
            signal.signal(signal.SIGUSR1, lambda *a: None)
            time.sleep(0.4)
            return "set a Python handler, then went on for 0.4 s"
        sigstages.run("s.jsonl", stages=[("replace", replace)], watch_s=0.05)
        """, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = sigstages.read(tmp_path / "s.jsonl")
    assert lines[2]["replaced"] is False and len(lines[2]["watcher"]) == 1 and lines[-1]["ok"]


def test_read_refuses_a_missing_or_corrupt_record(tmp_path):
    with pytest.raises(LabError, match="no such sigstages record"):
        sigstages.read(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"stage": "provenance"}) + "\n{not json\n")
    with pytest.raises(LabError, match="bad.jsonl:2: not a JSON line"):
        sigstages.read(bad)
    headless = tmp_path / "headless.jsonl"
    headless.write_text(json.dumps({"stage": "import torch"}) + "\n")
    with pytest.raises(LabError, match="provenance"):
        sigstages.read(headless)


def test_the_recorded_s55_records_and_the_s54_masks():
    """The recorded H200 records (s55) as notebook 03 reads them, and the engine core's SigCgt from s54's hang logs."""
    import glob

    t = sigstages.table("data/gpu/2026-12-04_h200_sigstages-s55/sigstages*.jsonl")
    assert t["record"].str.split("/").str[-1].nunique() == 5
    tri = t[t["stage"] == "Triton kernel"]
    tri = tri.set_index(tri["record"].str.split("/").str[-1])
    assert list(tri.loc[["sigstages.jsonl", "sigstages-coredump.jsonl"], "object"]) == ["libtriton.so"] * 2
    assert tri.at["sigstages-reregister.jsonl", "object"] == "python3"   # the warm cache: nothing compiled
    masks = [sigstages.hang_log_sigcgt(f) for f in sorted(glob.glob("data/gpu/2026-12-04_h200_probe-hang-c24-[bc]-tp1/"
                                                                    "*.hang.log"))]   # s54's calls A and B
    assert [m["EngineCore"] for m in masks] == ["0000000141804e07"] * 2
    last = t[(t["stage"] == "vLLM ops and engine core")]
    assert set(last["SigCgt"]) == {"0000000141804e07"}
    assert sigstages.hang_log_sigcgt("data/gpu/2026-12-03_h200_probe-hang-c24-a-tp1/stock-probe-hang-c24.a1.hang.log") == {}


def test_the_recorded_s56_pair_with_and_without_the_watcher():
    """s56 (H200, cold Triton caches, no vLLM staged): without the watcher libtriton's handler took SIGUSR1 at the Triton
    stage and the forked copy wrote no stacks; with it, faulthandler's handler was in place after every stage and the
    copy wrote its stacks. The watcher's message is not in the record: it set the handler back while the Triton stage
    still ran, before the stage's count was taken (fixed since, test above). Inside two engines that day, the engine log
    has the message and the engine core's SigCgt is the s54 one."""
    t = sigstages.table("data/gpu/2026-12-04_h200_sigstages-s56/sigstages*.jsonl")
    rec = {k: g.set_index("stage") for k, g in t.groupby(t["record"].str.split("/").str[-1])}
    off, on = rec["sigstages-nowatch-fresh.jsonl"], rec["sigstages-watch-fresh.jsonl"]
    assert off.at["Triton kernel", "object"] == "libtriton.so" and bool(off.at["Triton kernel", "replaced"])
    assert off.at["SIGUSR1 to a forked copy", "outcome"] == "no stacks written, copy exit 0"
    staged = on.drop(index="SIGUSR1 to a forked copy")
    assert (staged["object"] == "python3").all() and not staged["replaced"].any() and (staged["watcher"] == "").all()
    assert on.at["SIGUSR1 to a forked copy", "outcome"].startswith("stacks written")
    for f in ("data/gpu/2026-12-04_h200_probe-hang-c24-d-tp1/stock-probe-hang-c24.a1",
              "data/gpu/2026-12-04_h200_probe-hang-ledger-c24-a-tp1/stock-probe-ledger-c24.a1"):
        assert sigstages.hang_log_sigcgt(f + ".hang.log")["EngineCore"] == "0000000141804e07"
        log = open(f + ".log").read()
        assert re.search(r"\(EngineCore pid=\d+\) dflash-lab \[\d+\]: SIGUSR1 handler replaced since the stacks file "
                         r"was registered: 0x[0-9a-f]+ in \S+/triton/_C/libtriton\.so; faulthandler's", log)
