"""Name the kernel behind a CUDA fault: a GPU core dump per crashing engine, read with cuda-gdb.

The runner (matrix key ``coredump: true``) starts the engine with :func:`env` (no
``CUDA_LAUNCH_BLOCKING``, which changes timing), and after a crash waits for the dump to be
written (:func:`wait_for_core`, ~210 MB, 1-2 minutes), runs ``cuda-gdb`` in batch mode on it
(:func:`read_core`) and parses the summary into a ``fault`` object (:func:`parse_cuda_gdb`):

    {"kernel": "copy_and_expand_dflash_inputs_kernel", "exception": "Warp Out-of-range Address",
     "source": "utils.py:542", "frame_source": ".../vllm/v1/spec_decode/utils.py:551",
     "grid": [24, 1, 1], "block_dim": [128, 1, 1], "focus_block": [0, 0, 0],
     "focus_thread": [96, 0, 0], "pc": "0x7fb9016f2150", "core_file": ..., "core_bytes": ...}

The core files stay on the GPU host; the cuda-gdb text goes beside the engine log.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

FLAGS = ("skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,"
         "skip_local_memory,skip_constbank_memory")
CUDA_GDB_CANDIDATES = ("cuda-gdb", "/usr/local/cuda/bin/cuda-gdb")
GDB_COMMANDS = ("info cuda kernels", "bt", "x/4i $pc")


STALE_SLACK_S = 2.0   # file-time granularity and clock slack between the engine's start and its core


KEEP_RUNNING = "keep-running"   # matrix value ``coredump: keep-running``


def env(core_dir: str | os.PathLike, keep_running: bool = False) -> dict:
    """Environment that makes the CUDA driver write a core dump on a device exception.

    By default the driver then abort()s the process, and vLLM never writes its own dump of the crashing step (no
    engine log of a run with core dumps on holds one, through s19). ``keep_running`` adds the driver's
    ``skip_abort`` flag (CU_COREDUMP_SKIP_ABORT): the process goes on to see the CUDA error like a run without
    core dumps, so vLLM can still dump the step. First run on the GPU in s20 (matrices/threshold-tp1.yaml): all three
    crashes left both the core and vLLM's dump, and the engine log printed the failed device asserts too."""
    return {"CUDA_ENABLE_COREDUMP_ON_EXCEPTION": "1",
            "CUDA_COREDUMP_GENERATION_FLAGS": FLAGS + (",skip_abort" if keep_running else ""),
            "CUDA_COREDUMP_FILE": str(Path(core_dir) / "core.%p")}


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cores(core_dir: str | os.PathLike, since: float | None = None) -> list[Path]:
    """The core files in ``core_dir``, oldest first; with ``since`` (the engine's start, epoch seconds) only
    those written after it: an older core belongs to an earlier engine that used the same folder."""
    d = Path(core_dir)
    if not d.is_dir():
        return []
    # regular files only: a pipe or folder named core... is no dump
    found = sorted((p for p in d.iterdir() if p.name.startswith("core") and p.is_file()), key=lambda p: p.stat().st_mtime)
    return [p for p in found if since is None or p.stat().st_mtime >= since - STALE_SLACK_S]


def wait_for_core(core_dir, pgid: int | None, timeout_s: float, settle_s: float = 8.0,
                  sleep=time.sleep, clock=time.time, since: float | None = None) -> Path | None:
    """Wait until the engine's processes are gone (or timeout) and no core grows any more (with tensor
    parallelism every faulting rank writes its own); the newest core, or None."""
    t0 = clock()
    last, stable_since = None, None
    while clock() - t0 < timeout_s:
        alive = pgid is not None and _group_alive(pgid)
        found = cores(core_dir, since)
        size = tuple((p.name, p.stat().st_size) for p in found) or None
        if size != last:
            last, stable_since = size, clock()
        if not alive and (size is None or clock() - stable_since >= settle_s):
            break
        if alive and size is not None and clock() - stable_since >= 3 * settle_s:
            break  # a complete core, and an engine that hangs instead of exiting
        sleep(1.0)
    found = cores(core_dir, since)
    return found[-1] if found else None


def cuda_gdb() -> str | None:
    """The cuda-gdb to use: ``$DFLASH_LAB_CUDA_GDB`` if set, else the first one found."""
    for c in (os.environ.get("DFLASH_LAB_CUDA_GDB") or "",) + CUDA_GDB_CANDIDATES:
        if not c:
            continue
        p = shutil.which(c) or (c if os.path.isfile(c) and os.access(c, os.X_OK) else None)
        if p:
            return p
    return None


def read_core(core: Path, timeout_s: float = 180.0) -> tuple[str, str | None]:
    """(cuda-gdb's text, error or None)."""
    gdb = cuda_gdb()
    if gdb is None:
        return "", "cuda-gdb not found"
    cmd = [gdb, "-batch", "-ex", f"target cudacore {core}"]
    for c in GDB_COMMANDS:
        cmd += ["-ex", c]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "", f"cuda-gdb timed out after {timeout_s:.0f} s"
    return (r.stdout + r.stderr), (None if r.returncode == 0 else f"cuda-gdb exited with {r.returncode}")


def _dims(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_cuda_gdb(text: str) -> dict:
    """The fault fields found in cuda-gdb's summary of a GPU core dump (missing ones are None)."""
    out = {"kernel": None, "exception": None, "source": None, "frame_source": None, "grid": None,
           "block_dim": None, "focus_block": None, "focus_thread": None, "pc": None}
    m = re.search(r"CUDA Exception: ([^\n]+)", text)
    if m:
        out["exception"] = m.group(1).strip()
    elif re.search(r"^Assertion failed\.", text, re.M):
        # a device-side assert (an inductor kernel's index bounds check, say): cuda-gdb names no CUDA exception
        out["exception"] = "Assertion failed (device-side assert)"
    m = re.search(r"triggered at PC (0x[0-9a-fA-F]+)\s+(\w+)(?:\s+\(([^)\s]+:\d+)\))?", text)
    if m:
        out["pc"], out["kernel"], out["source"] = m.group(1), m.group(2), m.group(3)
    m = re.search(r"#0\s+(?:0x[0-9a-fA-F]+ in )?(\w+)<<<\(([\d,\s]+)\),\(([\d,\s]+)\)>>>\s*\([^)]*\)"
                  r"(?:\s+at\s+(\S+):(\d+))?", text)
    if m:
        out["kernel"] = out["kernel"] or m.group(1)
        out["grid"], out["block_dim"] = _dims(m.group(2)), _dims(m.group(3))
        if m.group(4):
            out["frame_source"] = f"{m.group(4)}:{m.group(5)}"
    m = re.search(r"Current focus set to CUDA kernel \d+, grid \d+, block \(([\d,]+)\), thread \(([\d,]+)\)", text)
    if m:
        out["focus_block"], out["focus_thread"] = _dims(m.group(1)), _dims(m.group(2))
    return out


PROCESS_RE = re.compile(r"\((\w+) pid=(\d+)\)")   # vLLM's log prefix: "(Worker_TP1 pid=4242) ..."
MAX_CORES = 4


def processes(engine_log: str | os.PathLike | None) -> dict[int, str]:
    """{pid: vLLM process name} from an engine log's line prefixes (EngineCore, Worker_TP0, ...).

    A pid's last name wins: vLLM 0.22.1 prefixes a tensor-parallel worker "(Worker pid=N)" until its rank is set
    and "(Worker_TP0 pid=N)" after (s27's TP=2 logs); the first name named every rank 'Worker'."""
    if engine_log is None or not os.path.isfile(engine_log):
        return {}
    from .runner import read_recorded   # a recorded log may be stored .xz by ingest

    out = {}
    for line in read_recorded(engine_log, errors="replace").splitlines():
        for name, pid in PROCESS_RE.findall(line):
            out[int(pid)] = name
    return out


DUMP_STARTED = "Starting GPU coredump generation"   # what the CUDA driver prints to the process's stderr first


def dump_started(engine_log: str | os.PathLike | None) -> bool | None:
    """Whether the engine log holds the driver's line that it began writing a core dump; None without a log. s49's
    control at 24 logged it and left no core file: its processes were gone before the file appeared."""
    if engine_log is None or not os.path.isfile(engine_log):
        return None
    from .runner import read_recorded

    return DUMP_STARTED in read_recorded(engine_log, errors="replace")


def _pid_of(core: Path) -> int | None:
    m = re.search(r"(\d+)$", core.name)
    return int(m.group(1)) if m else None


MIN_GDB_S = 10.0   # what a core's reading gets at least, even past the runner's deadline


def collect(core_dir, pgid: int | None, log_path: str | os.PathLike | None, wait_s: float = 240.0,
            gdb_timeout_s: float = 180.0, engine_log: str | os.PathLike | None = None,
            since: float | None = None, deadline: float | None = None) -> dict:
    """Wait for the cores, read each (at most ``MAX_CORES``), return the ``fault`` object: the fields of the core
    finished first, and with more than one (tensor parallelism: each faulting rank dumps its own) a ``cores`` list,
    each core with its pid and the vLLM process that wrote it (from ``engine_log``). The cuda-gdb text goes to
    ``log_path``. ``deadline`` (epoch seconds, the runner's): each reading gets at most the time left before it, and
    at least ``MIN_GDB_S``, so that reading cores does not carry a runner far past its deadline."""
    t0 = time.time()
    fresh = set(cores(core_dir, since))
    stale = [str(p) for p in cores(core_dir) if p not in fresh]
    if wait_for_core(core_dir, pgid, wait_s, since=since) is None:
        started = dump_started(engine_log)
        return {"kernel": None, "error": f"no core file in {core_dir} after {time.time() - t0:.0f} s"
                + ("; the driver had logged that it started a dump" if started else ""),
                **({"dump_started": started} if started is not None else {}),
                **({"stale_cores": stale} if stale else {})}
    found = cores(core_dir, since)   # oldest first: the first finished dump leads
    names = processes(engine_log)
    texts, readings = [], []
    for core in found[:MAX_CORES]:
        left = gdb_timeout_s if deadline is None else deadline - time.time()
        text, err = read_core(core, max(MIN_GDB_S, min(gdb_timeout_s, left)))
        f = parse_cuda_gdb(text)
        pid = _pid_of(core)
        f.update(core_file=str(core), core_bytes=core.stat().st_size, pid=pid, process=names.get(pid))
        if err:
            f["error"] = err
        readings.append(f)
        texts.append(f"=== {core} ({names.get(pid) or 'process unknown'})\n{text}")
    fault = dict(readings[0], wait_s=round(time.time() - t0, 1))
    if stale:
        fault["stale_cores"] = stale   # left out: written before this engine started
    if len(found) > 1:
        fault["cores"] = [{k: r.get(k) for k in ("process", "pid", "kernel", "exception", "source", "core_bytes", "error")}
                          for r in readings]
        if len(found) > MAX_CORES:
            fault["cores_not_read"] = len(found) - MAX_CORES
    if log_path is not None:
        Path(log_path).write_text("\n".join(texts) if len(texts) > 1 else texts[0].split("\n", 1)[1])
        fault["gdb_log"] = str(log_path)
    return fault
