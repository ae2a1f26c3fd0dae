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
3. **A GPU core dump on demand** (engines with ``coredump`` on): the driver is started with
   ``CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1`` and a pipe per process (``CUDA_COREDUMP_PIPE``, ``dumppipe.<pid>`` in
   the engine's core folder); writing to the pipe makes the driver dump the GPU state of that process, kernels still
   running included. cuda-gdb reads it as it reads a crash's core (:func:`coredump.collect`); :func:`kernel_table`
   lists every kernel the dump holds, not only the focused one.

Everything goes into one text file beside the engine log (``<engine>.aN.hang.log``: ingest keeps ``.log`` files) and a
``hang`` object in the run's line. Nothing here runs unless the matrix asks for it.
"""

from __future__ import annotations

import faulthandler
import os
import re
import shutil
import signal
import stat
import subprocess
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


def install(folder: str | os.PathLike) -> str:
    """In one process: write all threads' Python stacks to ``<folder>/stacks.<pid>.txt`` whenever ``SIGUSR1`` arrives.
    Idempotent per process; the file stays open (faulthandler writes to its descriptor from the signal handler)."""
    pid = os.getpid()
    if _installed.get("pid") == pid:
        return f"stack snapshot on SIGUSR1 already registered, {_installed['path']}"
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"stacks.{pid}.txt"
    f = open(path, "w")
    faulthandler.register(SIGNAL, file=f, all_threads=True, chain=False)
    _installed.update(pid=pid, path=str(path), file=f)
    return f"stack snapshot on SIGUSR1 registered, {path}"


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


def summarize(threads: list[dict], top: int = 8) -> dict:
    """A line-sized view of one process's dump: its thread count, the innermost ``top`` frames of its main thread (the
    last one faulthandler lists: it walks the threads newest first) as "file.py:line func", and each other thread's
    innermost frame."""
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
    summary: ``{"gpu": ..., "stacks": {pid: {process, threads, main}}, "core": fault or {"error"}, "hang_log"}``.
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
        out["stacks"][str(pid)] = {"process": name, **summarize(s["threads"]),
                                   **({"error": s["error"]} if s.get("error") else {})}
        parts.append(f"=== stacks of pid {pid} ({name or 'process unknown'})\n{s['text']}")
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
    """One log line of a snapshot: GPU utilization, each process's innermost frame, the core's kernels."""
    bits = [f"snapshot failed: {h['error']}"] if h.get("error") else []
    util = [s.get("utilization_pct") for s in h.get("gpu", {}).get("samples", [])]
    bits.append("gpu util " + ("/".join("?" if u is None else f"{u:.0f}%" for u in util) if util
                               else h.get("gpu", {}).get("error", "not read")))
    for pid, s in h.get("stacks", {}).items():
        bits.append(f"{s.get('process') or pid}: {s['main'][0] if s.get('main') else s.get('error', 'no frames')}")
    core = h.get("core")
    if core:
        ks = core.get("kernels")
        bits.append("core: " + (", ".join(f"{k['kernel']} {k['status']}" for k in ks) if ks
                                else core.get("error") or f"no kernel in the dump ({core.get('kernel')})"))
    return "; ".join(bits)
