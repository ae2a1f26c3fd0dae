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


def env(core_dir: str | os.PathLike) -> dict:
    """Environment that makes the CUDA driver write a core dump on a device exception."""
    return {"CUDA_ENABLE_COREDUMP_ON_EXCEPTION": "1", "CUDA_COREDUMP_GENERATION_FLAGS": FLAGS,
            "CUDA_COREDUMP_FILE": str(Path(core_dir) / "core.%p")}


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cores(core_dir: str | os.PathLike) -> list[Path]:
    d = Path(core_dir)
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if p.name.startswith("core")), key=lambda p: p.stat().st_mtime)


def wait_for_core(core_dir, pgid: int | None, timeout_s: float, settle_s: float = 8.0,
                  sleep=time.sleep, clock=time.time) -> Path | None:
    """Wait until the engine's processes are gone (or timeout) and the newest core stops growing."""
    t0 = clock()
    last, stable_since = None, None
    while clock() - t0 < timeout_s:
        alive = pgid is not None and _group_alive(pgid)
        found = cores(core_dir)
        size = (found[-1], found[-1].stat().st_size) if found else None
        if size != last:
            last, stable_since = size, clock()
        if not alive and (size is None or clock() - stable_since >= settle_s):
            break
        if alive and size is not None and clock() - stable_since >= 3 * settle_s:
            break  # a complete core, and an engine that hangs instead of exiting
        sleep(1.0)
    found = cores(core_dir)
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


def collect(core_dir, pgid: int | None, log_path: str | os.PathLike | None, wait_s: float = 240.0,
            gdb_timeout_s: float = 180.0) -> dict:
    """Wait for the core, read it, return the ``fault`` object; the cuda-gdb text goes to ``log_path``."""
    t0 = time.time()
    core = wait_for_core(core_dir, pgid, wait_s)
    if core is None:
        return {"kernel": None, "error": f"no core file in {core_dir} after {time.time() - t0:.0f} s"}
    text, err = read_core(core, gdb_timeout_s)
    fault = parse_cuda_gdb(text)
    fault.update(core_file=str(core), core_bytes=core.stat().st_size, wait_s=round(time.time() - t0, 1))
    if err:
        fault["error"] = err
    if log_path is not None:
        Path(log_path).write_text(text)
        fault["gdb_log"] = str(log_path)
    return fault
