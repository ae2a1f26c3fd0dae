"""What an engine that stopped making progress was doing when the runner gave up on its run (matrix key
``hang_snapshot: true``).

Why: s51's probed stock run at concurrency 24 stepped to step 295 and then stopped; no probe line, no vLLM stats line,
and at the 300 s timeout the runner killed it and recorded nothing but "run exceeded 300 s". Whether a kernel was
still running on the GPU (a kernel spinning on a bad value) or the host was waiting on something else cannot be told
from that line. With ``hang_snapshot`` the runner takes, before it kills a run that timed out (:func:`snapshot`):

1. **The GPU's state**: three ``nvidia-smi`` samples a second apart (utilization: the share of the last sample period
   in which a kernel ran; power; SM clock; memory used).
2. **Every engine process's Python stacks**: the vLLM plugin (every process vLLM starts, and the offline worker)
   registers :mod:`faulthandler` for ``SIGUSR1`` (:func:`install`), writing all threads' stacks to
   ``<folder>/stacks.<pid>.txt``; the runner sends the signal to each registered process of the engine's process group.
   faulthandler writes from its C signal handler, so a thread blocked inside a CUDA call still shows where it waits.
   Then, for each, what the kernel says of it in /proc (:func:`proc_state`): its state, whether SIGUSR1 is still
   pending, blocked (per thread), caught; each thread's state, wchan, syscall and kernel stack; for a process that
   wrote no stacks, that is what says why.
3. **A GPU core dump on demand** (engines with ``coredump`` on): the driver is started with
   ``CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1`` and a pipe per process (``CUDA_COREDUMP_PIPE``, ``dumppipe.<pid>`` in
   the engine's core folder); writing to the pipe makes the driver dump the GPU state of that process, kernels still
   running included. cuda-gdb reads it as it reads a crash's core (:func:`coredump.collect`); :func:`kernel_table`
   lists every kernel the dump holds, not only the focused one.

Everything goes into one text file beside the engine log (``<engine>.aN.hang.log``: ingest keeps ``.log`` files) and a
``hang`` object in the run's line. Nothing here runs unless the matrix asks for it.
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

ENV = "DFLASH_LAB_STACKS"
SIGNAL = signal.SIGUSR1
STACK_FILE = re.compile(r"^stacks\.(\d+)\.txt$")
PIPE_NAME = "dumppipe.%p"   # not "core...": coredump.cores() takes those names for dumps
PIPE_FILE = re.compile(r"^dumppipe\.(.+)$")   # (.+): the pid, or "%p" where a driver did not substitute it
GPU_QUERY = ("index", "utilization.gpu", "power.draw", "clocks.sm", "memory.used")

_installed: dict = {}


def env(stack_dir: str | os.PathLike, core_dir: str | os.PathLike | None = None) -> dict:
    """The engine environment for a hang snapshot: where each process registers its stacks file, and with ``core_dir``
    (core dumps on) the driver's user-triggered dump through one pipe per process in that folder."""
    out = {ENV: str(stack_dir)}
    if core_dir is not None:
        out.update(CUDA_ENABLE_USER_TRIGGERED_COREDUMP="1", CUDA_COREDUMP_PIPE=str(Path(core_dir) / PIPE_NAME))
    return out


WATCH_S = 1.0   # how often a registered process checks that SIGUSR1 still runs faulthandler's handler


def install(folder: str | os.PathLike, watch_s: float | None = WATCH_S, log=None) -> str:
    """In one process: write all threads' Python stacks to ``<folder>/stacks.<pid>.txt`` whenever ``SIGUSR1`` arrives.
    Idempotent per process; the file stays open (faulthandler writes to its descriptor from the signal handler).

    Triton's compiler sets its own ``SIGUSR1`` handler the first time it compiles in a process (s55, ``sigstages``
    on the H200), and an engine compiles long after this runs: with ``watch_s`` a daemon thread checks every
    ``watch_s`` seconds and puts faulthandler's handler back (:func:`restore_if_replaced`), telling ``log`` once per
    handler it replaced."""
    pid = os.getpid()
    if _installed.get("pid") == pid:
        return f"stack snapshot on SIGUSR1 already registered, {_installed['path']}"
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"stacks.{pid}.txt"
    f = open(path, "w")
    # a forked child inherits faulthandler's registration, for which register() only swaps the file and leaves the
    # handler as it finds it (s55: after Triton compiled, faulthandler.register again kept Triton's): set it anew
    faulthandler.unregister(SIGNAL)
    faulthandler.register(SIGNAL, file=f, all_threads=True, chain=False)
    h = handler_of(SIGNAL)
    _installed.clear()
    _installed.update(pid=pid, path=str(path), file=f, handler=h, action=_action_now(), restored=[])
    watching = ""
    if watch_s and _installed["action"] is not None:
        threading.Thread(target=_watch, args=(pid, watch_s, log), name="dflash-lab-sigusr1", daemon=True).start()
        watching = f", kept there (checked every {watch_s:g} s)"
    return f"stack snapshot on SIGUSR1 registered, {path}; handler {handler_text(h)}{watching}"


def _action_now(sig: int = SIGNAL):
    """The kernel's whole ``struct sigaction`` for ``sig`` now (handler, mask, flags); None off Linux or where
    sigaction failed (errno kept)."""
    if not sys.platform.startswith("linux"):
        return None
    a = _Sigaction()
    return a if _libc().sigaction(int(sig), None, ctypes.byref(a)) == 0 else None


def restore_if_replaced(log=None) -> dict | None:
    """Where another handler replaced faulthandler's since :func:`install` (:func:`handler_replaced`): set back, in
    one sigaction call, the exact action faulthandler set (no moment without a handler, in which SIGUSR1's default
    action would end the process; faulthandler's own registration, file included, was never undone). Returns the
    handler it replaced, after telling ``log`` the first time it meets that handler; None where nothing was replaced."""
    was = handler_replaced()
    if was is None or _installed.get("action") is None:
        return None
    if _libc().sigaction(int(SIGNAL), ctypes.byref(_installed["action"]), None) != 0:
        return None
    first = was not in _installed["restored"]
    if first:
        _installed["restored"].append(was)
        if log is not None:
            log(f"SIGUSR1 handler replaced since the stacks file was registered: {handler_text(was)}; "
                f"faulthandler's ({handler_text(_installed['handler'])}) set back")
    return was


def _watch(pid: int, period: float, log) -> None:
    # never the thread that takes the snapshot's SIGUSR1: the kernel then hands it to one of the engine's own threads,
    # and /proc's "blocked in every thread" keeps its meaning for them (the dump still lists this thread, which
    # summarize() leaves out)
    signal.pthread_sigmask(signal.SIG_BLOCK, {SIGNAL})
    while _installed.get("pid") == pid:   # a forked child has no copy of this thread (fork copies the caller only)
        time.sleep(period)
        restore_if_replaced(log)


# --- whose handler SIGUSR1 runs (s53-s54: the EngineCore wrote no stacks while /proc said SIGUSR1 was caught, not
# pending and not blocked in its main thread; a handler that replaced faulthandler's after install fits that, and
# /proc's SigCgt cannot say whose handler is set). sigaction(2) reads the kernel's disposition, which also holds a
# handler a C library set (Python's signal.getsignal knows only its own table); dladdr(3) names the object holding
# the handler's address.

class _Sigaction(ctypes.Structure):   # glibc's struct sigaction on Linux x86_64 and aarch64
    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * (1024 // (8 * ctypes.sizeof(ctypes.c_ulong)))),
                ("flags", ctypes.c_int), ("restorer", ctypes.c_void_p)]


class _DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                ("saddr", ctypes.c_void_p)]


SA_SIGINFO = 4


@functools.lru_cache(maxsize=1)
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "dladdr"):   # glibc < 2.34 keeps dladdr in libdl
        libc.dladdr = ctypes.CDLL("libdl.so.2").dladdr
    return libc


def handler_of(sig: int = SIGNAL) -> dict:
    """This process's disposition of ``sig`` as the kernel holds it: ``{"handler": "default" | "ignore" | "0x...",
    "object": the executable or shared object holding that address, "symbol": dladdr's nearest exported symbol (for a
    static function, such as faulthandler's, a neighbour's name: the object is the reliable part), "siginfo": whether
    SA_SIGINFO is set}``; ``{"error": ...}`` where sigaction cannot be called (not Linux)."""
    if not sys.platform.startswith("linux"):
        return {"error": f"sigaction is read on Linux only, not {sys.platform}"}
    old = _action_now(sig)
    if old is None:
        return {"error": f"sigaction({int(sig)}) failed: {os.strerror(ctypes.get_errno())}"}
    addr = old.handler or 0
    out = {"handler": {0: "default", 1: "ignore"}.get(addr, hex(addr)), "object": None, "symbol": None,
           "siginfo": bool(old.flags & SA_SIGINFO)}
    if addr > 1:
        info = _DlInfo()
        if _libc().dladdr(ctypes.c_void_p(addr), ctypes.byref(info)):
            out["object"] = info.fname.decode(errors="replace") if info.fname else None
            out["symbol"] = info.sname.decode(errors="replace") if info.sname else None
    return out


def handler_text(h: dict) -> str:
    """A few words of :func:`handler_of`: "0x7f.. in /usr/lib/libfoo.so (near foo_handler)", "default", ..."""
    if h.get("error"):
        return h["error"]
    if h["handler"] in ("default", "ignore"):
        return h["handler"]
    where = f" in {h['object']}" if h.get("object") else " in no loaded object"
    return f"{h['handler']}{where}" + (f" (near {h['symbol']})" if h.get("symbol") else "")


def handler_replaced() -> dict | None:
    """Where this process registered its stacks file and SIGUSR1's handler is no longer the one it had right after
    (another library set its own since): the handler now (:func:`handler_of`); None where unchanged or not
    registered here."""
    if not installed_here() or "handler" not in _installed:
        return None
    now = handler_of(SIGNAL)
    return None if now == _installed["handler"] else now


def installed_here() -> bool:
    """Whether this process (not a parent it was forked from) registered its stacks file."""
    return _installed.get("pid") == os.getpid()


def registered(folder: str | os.PathLike) -> dict[int, Path]:
    """{pid: stacks file} of the processes that registered in ``folder``."""
    d = Path(folder)
    if not d.is_dir():
        return {}
    out = {}
    for p in sorted(d.iterdir()):
        m = STACK_FILE.match(p.name)
        if m:
            out[int(m.group(1))] = p
    return out


def _in_group(pid: int, pgid: int | None) -> bool:
    try:
        return pgid is None or os.getpgid(pid) == pgid
    except ProcessLookupError:
        return False


FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)')
THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[([^\]]*)\])? \(most recent call first\):")


def parse_stacks(text: str) -> list[dict]:
    """The threads of one faulthandler dump: ``[{"thread": "0x...", "name": ..., "current": bool, "frames": [{"file",
    "line", "func"}, ...]}]``, frames most recent first, as faulthandler prints them (:func:`signal_stacks` passes
    only what one signal added to a process's file)."""
    threads, cur = [], None
    for line in text.splitlines():
        m = THREAD.match(line)
        if m:
            cur = {"thread": m.group(2), "name": m.group(3), "current": m.group(1) == "Current thread", "frames": []}
            threads.append(cur)
            continue
        m = FRAME.match(line)
        if m and cur is not None:
            cur["frames"].append({"file": m.group(1), "line": int(m.group(2)), "func": m.group(3)})
    return threads


def frame_text(f: dict) -> str:
    return f"{os.path.basename(f['file'])}:{f['line']} {f['func']}"


def _is_watcher(thread: dict) -> bool:
    return any(f["func"] == "_watch" and f["file"].endswith("hang.py") for f in thread["frames"])


def summarize(threads: list[dict], top: int = 8) -> dict:
    """A line-sized view of one process's dump: its thread count, the innermost ``top`` frames of its main thread (the
    last one faulthandler lists: it walks the threads newest first) as "file.py:line func", and each other thread's
    innermost frame. The stacks watcher's own thread (:func:`_watch`) is left out of both."""
    threads = [t for t in threads if not _is_watcher(t)]
    main = threads[-1] if threads else None
    return {"threads": len(threads),
            "main": [frame_text(f) for f in (main["frames"][:top] if main else [])],
            "others": [frame_text(t["frames"][0]) if t["frames"] else "no frames" for t in threads[:-1]]}


def signal_stacks(folder, pgid: int | None, wait_s: float = 5.0, sleep=time.sleep) -> dict[int, dict]:
    """Send ``SIGUSR1`` to every registered, living process of group ``pgid``; wait until each one's file has grown;
    ``{pid: {"text": ..., "threads": [...]}}`` (a process that wrote nothing: its text is "" and an ``error``)."""
    sent = {}
    for pid, path in registered(folder).items():
        if not _in_group(pid, pgid):
            continue
        try:
            size = path.stat().st_size
            os.kill(pid, SIGNAL)
        except (ProcessLookupError, PermissionError, FileNotFoundError):
            continue
        sent[pid] = (path, size)
    t0 = time.time()
    while sent and time.time() - t0 < wait_s:
        sleep(0.2)
        if all(p.stat().st_size > s for p, s in sent.values()):
            sleep(0.3)   # let the last thread's frames land
            break
    out = {}
    for pid, (path, size) in sent.items():
        text = path.read_text(errors="replace")[size:]
        out[pid] = {"text": text, "threads": parse_stacks(text)}
        if not text:
            out[pid]["error"] = f"no stacks written within {wait_s:.0f} s"
    return out


# --- what the kernel says of a process, from /proc (read after the signal's wait, for every process signalled) ------
#
# Why: on the H200 (s53's probe-hang-c24-a run, cut at the runner's deadline) the EngineCore wrote no stacks within
# 5 s while the worker answered. From the empty file alone one cannot tell a SIGUSR1 blocked in every thread (the
# kernel keeps it pending), a thread that took the signal while in uninterruptible sleep in the driver (D state: the
# handler runs only when it wakes), or a handler that replaced faulthandler's (caught, not pending, nothing written). /proc tells these apart without
# stopping or signalling the process: reading status, stat, wchan, syscall and stack files never pauses it.

PROC_FIELDS = ("State", "Threads", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
PROC_ROWS = 64        # threads listed in detail (the kernel stack of each in the hang log); all are counted
LINE_ROWS = 8         # of those, the ones the run's line keeps (no kernel stacks)


def _read(path: Path) -> str | None:
    """A /proc file's text, or None where it vanished (the thread or process exited) or may not be read (``stack``
    without root, ``syscall`` without ptrace rights)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None


def parse_status(text: str) -> dict[str, str]:
    """The fields of a ``/proc/<pid>/status`` (or ``task/<tid>/status``) text that say how a signal fares, as the
    kernel prints them (masks in hex)."""
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition(":")
        if sep and k in PROC_FIELDS:
            out[k] = v.strip()
    return out


def has_signal(mask: str | None, sig: int = SIGNAL) -> bool | None:
    """Whether signal ``sig`` is set in a hex mask of /proc's status (signal n is bit n-1: SIGUSR1 10 is 0x200);
    None for a mask not read."""
    if mask is None:
        return None
    try:
        return bool(int(mask, 16) >> (int(sig) - 1) & 1)
    except ValueError:
        return None


def signal_flags(status: dict[str, str], sig: int = SIGNAL) -> dict:
    """``{pending, blocked, ignored, caught}`` of ``sig`` from :func:`parse_status`'s fields: pending for the process
    (ShdPnd: where ``kill`` puts it) or for that thread (SigPnd); blocked in the thread whose status it is (the
    process's status is its main thread's); ignored and caught are the process's disposition (caught: some handler is
    set, faulthandler's or another's, which /proc cannot tell apart)."""
    pnd = [has_signal(status.get(k), sig) for k in ("ShdPnd", "SigPnd")]
    return {"pending": None if pnd == [None, None] else any(pnd),
            "blocked": has_signal(status.get("SigBlk"), sig),
            "ignored": has_signal(status.get("SigIgn"), sig),
            "caught": has_signal(status.get("SigCgt"), sig)}


def parse_stat(text: str) -> tuple[str | None, str | None]:
    """(comm, state letter) of a ``stat`` line. The comm sits in parentheses and may itself hold spaces and
    parentheses (a thread may name itself anything), so the state is the first field after the *last* ')'."""
    lo, hi = text.find("("), text.rfind(")")
    if hi < 0:
        return None, None
    rest = text[hi + 1:].split()
    return (text[lo + 1:hi] if 0 <= lo < hi else None), (rest[0] if rest else None)


def _int(x: str) -> int | None:
    try:
        return int(x)
    except ValueError:
        return None


def _tids(base: Path) -> list[int]:
    try:
        return sorted(int(n) for n in os.listdir(base / "task") if n.isdigit())
    except OSError:
        return []


def read_thread(task: Path, detail: bool = False, sig: int = SIGNAL) -> dict | None:
    """One thread of ``/proc/<pid>/task/<tid>``: ``{tid, comm, state, sig_blk, sigusr1_blocked}``, with ``detail``
    also its wchan (the kernel function it sleeps in), its syscall number ("running" where it runs; -1: blocked
    outside a syscall) and its kernel stack (as root only; left out otherwise). None where the thread has exited."""
    st = _read(task / "stat")
    if st is None:
        return None
    comm, state = parse_stat(st)
    c = _read(task / "comm")
    status = parse_status(_read(task / "status") or "")
    row = {"tid": int(task.name) if task.name.isdigit() else task.name,
           "comm": c.rstrip("\n") if c else comm, "state": state, "sig_blk": status.get("SigBlk"),
           "sigusr1_blocked": has_signal(status.get("SigBlk"), sig)}
    if detail:
        w = _read(task / "wchan")
        row["wchan"] = w.strip() if w and w.strip() not in ("", "0") else None
        sc = (_read(task / "syscall") or "").split()
        row["syscall"] = None if not sc else "running" if sc[0] == "running" else _int(sc[0])
        stack = _read(task / "stack")
        if stack is not None:
            row["stack"] = [ln.strip() for ln in stack.splitlines() if ln.strip()]
    return row


def proc_state(pid: int, root: str | os.PathLike = "/proc", max_threads: int = PROC_ROWS, sig: int = SIGNAL) -> dict:
    """What the kernel says of process ``pid`` (see the block's comment): ``{pid, state, threads, status: {field: text},
    sigusr1: {pending, blocked, ignored, caught}, thread_states: {letter: n}, threads_blocking_sigusr1, rows: [...]}``.
    ``rows``: :func:`read_thread` in detail for at most ``max_threads`` threads, the main thread first, then those not
    asleep in S (a D thread is the one to see), then by tid; the counts cover every thread. Never raises: a file or
    thread gone mid-read is skipped, a process gone gives ``{"pid", "error"}``. ``root``: a fake tree for tests."""
    base = Path(root) / str(pid)
    text = _read(base / "status")
    if text is None:
        return {"pid": pid, "error": f"{base}/status unreadable (the process exited?)"}
    status = parse_status(text)
    threads = [t for tid in _tids(base) if (t := read_thread(base / "task" / str(tid), sig=sig)) is not None]
    counts: dict[str, int] = {}
    for t in threads:
        counts[t["state"] or "?"] = counts.get(t["state"] or "?", 0) + 1
    order = sorted(threads, key=lambda t: (t["tid"] != pid, t["state"] == "S", t["tid"]))
    rows = []
    for t in order[:max_threads]:
        r = read_thread(base / "task" / str(t["tid"]), detail=True, sig=sig)
        rows.append(r if r is not None else dict(t, gone=True))
    n = status.get("Threads", "")
    return {"pid": pid, "state": (status.get("State") or "?").split()[0], "threads": int(n) if n.isdigit() else None,
            "status": status, "sigusr1": signal_flags(status, sig), "thread_states": dict(sorted(counts.items())),
            "threads_read": len(threads), "threads_blocking_sigusr1": sum(bool(t["sigusr1_blocked"]) for t in threads),
            "rows": rows}


def proc_summary(p: dict, rows: int = LINE_ROWS) -> dict:
    """The run line's part of :func:`proc_state`: no masks, no kernel stacks, the first ``rows`` threads."""
    if p.get("error"):
        return {"error": p["error"]}
    keep = ("tid", "comm", "state", "wchan", "syscall", "sigusr1_blocked")
    return {"state": p["state"], "threads": p["threads"], "sigusr1": p["sigusr1"], "thread_states": p["thread_states"],
            "threads_blocking_sigusr1": p["threads_blocking_sigusr1"],
            "rows": [{k: r.get(k) for k in keep} for r in p["rows"][:rows]]}


def _yes(v: bool | None, yes: str, no: str) -> str:
    return "?" if v is None else (yes if v else no)


def proc_text(p: dict, name: str | None = None) -> str:
    """The hang log's section of :func:`proc_state`: the process's signal fields, then each thread listed with its
    kernel stack."""
    head = f"=== /proc of pid {p.get('pid')} ({name or 'process unknown'})"
    if p.get("error"):
        return f"{head}\nerror: {p['error']}"
    st, u = p["status"], p["sigusr1"]
    lines = [head, "  ".join(f"{k}: {st[k]}" for k in PROC_FIELDS if k in st),
             f"SIGUSR1: {_yes(u['pending'], 'pending', 'not pending')}, "
             f"{_yes(u['blocked'], 'blocked', 'not blocked')} in the main thread, "
             f"blocked in {p['threads_blocking_sigusr1']} of {p['threads_read']} threads, "
             f"{_yes(u['caught'], 'caught', 'not caught')}, {_yes(u['ignored'], 'ignored', 'not ignored')}",
             "thread states: " + ", ".join(f"{n} {k}" for k, n in p["thread_states"].items())]
    for r in p["rows"]:
        lines.append(f"--- tid {r['tid']} [{r.get('comm')}] state {r.get('state')} wchan {r.get('wchan') or '-'} "
                     f"syscall {r.get('syscall') if r.get('syscall') is not None else '-'} SigBlk {r.get('sig_blk')}"
                     + (" (SIGUSR1 blocked)" if r.get("sigusr1_blocked") else "")
                     + (" (exited while read)" if r.get("gone") else ""))
        lines += [f"    {s}" for s in r.get("stack", [])]
    if p["threads_read"] > len(p["rows"]):
        lines.append(f"({p['threads_read'] - len(p['rows'])} more threads not listed)")
    return "\n".join(lines)


def proc_phrase(p: dict) -> str:
    """A few words of :func:`proc_summary` for :func:`describe`: "state S, SIGUSR1 caught, not blocked, pending;
    threads: 40 S, 2 D"."""
    if p.get("error"):
        return p["error"]
    u, n, total = p["sigusr1"], p["threads_blocking_sigusr1"], sum(p["thread_states"].values())
    if not total:   # no thread read: the main thread's mask is all there is
        blocked = _yes(u["blocked"], "blocked in the main thread", "not blocked in the main thread")
    else:
        blocked = ("not blocked" if not n else f"blocked in all {n} threads" if n >= total
                   else f"blocked in {n}/{total} threads")
    disp = "ignored" if u["ignored"] else _yes(u["caught"], "caught", "not caught")
    return (f"state {p['state']}, SIGUSR1 {disp}, {blocked}, {_yes(u['pending'], 'pending', 'not pending')}; threads: "
            + ", ".join(f"{v} {k}" for k, v in sorted(p["thread_states"].items(), key=lambda kv: -kv[1])))


def gpu_state(samples: int = 3, interval_s: float = 1.0, sleep=time.sleep, run=subprocess.run) -> dict:
    """``samples`` nvidia-smi readings of every GPU (``{"samples": [{index, utilization_pct, power_w, sm_mhz,
    memory_mib, t}, ...]}``), or ``{"error": ...}`` where nvidia-smi is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"error": "nvidia-smi not found"}
    out = []
    for i in range(samples):
        if i:
            sleep(interval_s)
        try:
            r = run([smi, f"--query-gpu={','.join(GPU_QUERY)}", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=20)
        except subprocess.TimeoutExpired:
            return {"samples": out, "error": "nvidia-smi timed out"}
        if r.returncode != 0:
            return {"samples": out, "error": f"nvidia-smi exited with {r.returncode}: {(r.stdout + r.stderr).strip()[:200]}"}
        t = round(time.time(), 2)
        for line in r.stdout.strip().splitlines():
            out.append(dict(_gpu_row(line), t=t))
    return {"samples": out}


def _num(x: str):
    x = x.strip()
    try:
        return float(x)
    except ValueError:
        return None


def _gpu_row(line: str) -> dict:
    """One ``nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader,nounits`` line; a value it could not read
    ("[N/A]") is None."""
    parts = [p.strip() for p in line.split(",")]
    parts += [""] * (len(GPU_QUERY) - len(parts))
    idx, util, power, sm, mem = parts[:len(GPU_QUERY)]
    return {"index": int(idx) if idx.isdigit() else None, "utilization_pct": _num(util), "power_w": _num(power),
            "sm_mhz": _num(sm), "memory_mib": _num(mem)}


def pipes(core_dir, pgid: int | None, names: dict[int, str] | None = None) -> dict:
    """{pid (or the pipe's name where the driver put no pid in it): the driver's dump pipe} in ``core_dir``, of the
    living processes of group ``pgid``; with ``names`` (:func:`coredump.processes` of the engine log) only the vLLM
    processes it names (the engine core, TP workers: where the kernels run), unless none of them has a pipe."""
    d = Path(core_dir)
    if not d.is_dir():
        return {}
    out = {}
    for p in sorted(d.iterdir()):
        m = PIPE_FILE.match(p.name)
        try:
            if not m or not stat.S_ISFIFO(p.stat().st_mode):
                continue
        except OSError:   # removed by the driver as its process exited
            continue
        key = int(m.group(1)) if m.group(1).isdigit() else p.name
        if isinstance(key, int) and not _in_group(key, pgid):
            continue
        out[key] = p
    named = {k: v for k, v in out.items() if names and k in names}
    return named or out


def trigger(pipe: Path) -> str | None:
    """Ask the driver for a core dump by writing to its pipe; None on success, else why not (no reader: the
    process is gone or its driver thread does not listen)."""
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        return f"{pipe.name}: {e.strerror or e}"
    try:
        os.write(fd, b"\0" * 4096)
    except OSError as e:
        return f"{pipe.name}: {e.strerror or e}"
    finally:
        os.close(fd)
    return None


# the invocation column runs to the end of the line: a templated C++ kernel (cutlass::device_kernel<...>(Params)) too
KERNEL_ROW = re.compile(r"^[*\s]\s*(\d+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\w+)\s+(0x[0-9a-fA-F]+)\s+\(([\d,]+)\)\s+"
                        r"\(([\d,]+)\)\s+(\S.*?)\s*$", re.M)


def kernel_table(text: str) -> list[dict]:
    """The kernels of cuda-gdb's ``info cuda kernels`` table in ``text``: ``[{"kernel", "status", "grid",
    "block_dim", "focus"}]`` (``focus``: the row cuda-gdb marked with ``*``), once each per (kernel id, dev, grid)."""
    out, seen = [], set()
    for m in KERNEL_ROW.finditer(text):
        key = (m.group(1), m.group(3), m.group(4))
        if key in seen:
            continue
        seen.add(key)
        out.append({"kernel": re.sub(r"\([^()]*\)$", "", m.group(9)), "status": m.group(5),
                    "grid": [int(x) for x in m.group(7).split(",")],
                    "block_dim": [int(x) for x in m.group(8).split(",")],
                    "focus": m.group(0).startswith("*")})
    return out


MIN_DUMP_WAIT_S = 50.0   # a hung process's core counts as finished after 24 s without growth; dumps took 25-150 s


def snapshot(stack_dir, core_dir, pgid: int | None, hang_log: str | os.PathLike, engine_log=None,
             core_wait_s: float = 0.0, deadline: float | None = None) -> dict:
    """Everything :mod:`hang` takes of a run that timed out, in the order that disturbs least (GPU samples, then
    stacks, then the core dump, which stops the GPU to write it). The texts go to ``hang_log``; the line gets the
    summary: ``{"gpu": ..., "stacks": {pid: {process, threads, main, proc}}, "core": fault or {"error"}, "hang_log"}``
    (``proc``: :func:`proc_summary`, read from /proc after the signal for every process, whether it answered or not; the
    hang log gets :func:`proc_text`, kernel stacks included, after each process's stacks).
    ``core_wait_s`` 0 or no core folder skips the dump. With ``deadline`` (epoch seconds: the runner's) the dump's wait and
    cuda-gdb's time are cut to what is left once the samples and stacks are taken, and the dump is skipped when less
    than ``MIN_DUMP_WAIT_S`` would be left for it (a shorter wait could hand cuda-gdb a core still being written)."""
    from . import coredump

    t0 = time.time()
    names = coredump.processes(engine_log)
    parts = []
    out: dict = {"gpu": gpu_state()}
    parts.append("=== nvidia-smi " + ",".join(GPU_QUERY) + "\n"
                 + "\n".join(str(s) for s in out["gpu"].get("samples", []))
                 + (f"\nerror: {out['gpu']['error']}" if out["gpu"].get("error") else ""))
    stacks = signal_stacks(stack_dir, pgid) if stack_dir else {}
    out["stacks"] = {}
    for pid, s in stacks.items():
        name = names.get(pid) or ("worker" if pid == pgid else None)
        proc = proc_state(pid)   # every process, before the dump stops the GPU: cheap, and a D thread matters anyway
        out["stacks"][str(pid)] = {"process": name, **summarize(s["threads"]),
                                   **({"error": s["error"]} if s.get("error") else {}), "proc": proc_summary(proc)}
        parts.append(f"=== stacks of pid {pid} ({name or 'process unknown'})\n{s['text']}")
        parts.append(proc_text(proc, name))
    if not stacks:
        out["stacks_error"] = "no registered process of the engine was alive" if stack_dir else "no stack folder"
    if core_dir is not None and core_wait_s > 0:
        gdb_s = 180.0
        if deadline is not None:
            left = deadline - time.time() - 15
            gdb_s = max(20.0, min(180.0, left / 3))
            core_wait_s = min(core_wait_s, left - gdb_s)
        found = pipes(core_dir, pgid, names) if core_wait_s >= MIN_DUMP_WAIT_S else {}
        if core_wait_s < MIN_DUMP_WAIT_S:
            out["core"] = {"error": f"not asked for: {max(core_wait_s, 0):.0f} s left for a dump (at least "
                                    f"{MIN_DUMP_WAIT_S:.0f} s needed)"}
        elif not found:
            out["core"] = {"error": f"no dump pipe of a living engine process in {core_dir}"}
        else:
            since = time.time()
            errors = {str(pid): e for pid, p in found.items() if (e := trigger(p))}
            if len(errors) == len(found):
                out["core"] = {"error": "no pipe took the request: " + "; ".join(errors.values())}
            else:
                gdb_log = Path(str(hang_log).removesuffix(".log") + ".core.log")
                f = coredump.collect(core_dir, pgid, gdb_log, wait_s=core_wait_s, gdb_timeout_s=gdb_s,
                                     engine_log=engine_log, since=since)
                if f.get("gdb_log") and os.path.isfile(f["gdb_log"]):
                    f["kernels"] = kernel_table(Path(f["gdb_log"]).read_text(errors="replace"))
                out["core"] = dict(f, triggered=sorted(str(p) for p in found), **({"trigger_errors": errors} if errors else {}))
    Path(hang_log).write_text("\n\n".join(parts) + "\n")
    out["hang_log"] = str(hang_log)
    out["snapshot_s"] = round(time.time() - t0, 1)
    return out


def describe(h: dict) -> str:
    """One log line of a snapshot: GPU utilization, each process's innermost frame (or, where it wrote none, why not
    as far as /proc tells: :func:`proc_phrase`; for one that answered, its threads in D state if any), the core's
    kernels."""
    bits = [f"snapshot failed: {h['error']}"] if h.get("error") else []
    util = [s.get("utilization_pct") for s in h.get("gpu", {}).get("samples", [])]
    bits.append("gpu util " + ("/".join("?" if u is None else f"{u:.0f}%" for u in util) if util
                               else h.get("gpu", {}).get("error", "not read")))
    for pid, s in h.get("stacks", {}).items():
        proc = s.get("proc") or {}
        if s.get("main"):
            d = proc.get("thread_states", {}).get("D")
            bits.append(f"{s.get('process') or pid}: {s['main'][0]}" + (f" ({d} threads in D state)" if d else ""))
        else:
            bits.append(f"{s.get('process') or pid}: {s.get('error', 'no frames')}"
                        + (f" ({proc_phrase(proc)})" if proc else ""))
    core = h.get("core")
    if core:
        ks = core.get("kernels")
        bits.append("core: " + (", ".join(f"{k['kernel']} {k['status']}" for k in ks) if ks
                                else core.get("error") or f"no kernel in the dump ({core.get('kernel')})"))
    return "; ".join(bits)
