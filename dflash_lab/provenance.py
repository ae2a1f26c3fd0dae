"""Provenance attached to every GPU result: machine, driver, versions, date, command."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def gpu_info() -> dict:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"gpu": None, "gpu_count": 0, "driver": None}
    names = [l.split(",")[0].strip() for l in out]
    return {"gpu": names[0] if names else None, "gpu_count": len(names),
            "driver": out[0].split(",")[1].strip() if out else None,
            "gpu_memory": out[0].split(",")[2].strip() if out else None}


def collect(command: list[str] | str | None = None) -> dict:
    cmd = command if command is not None else sys.argv
    if isinstance(cmd, list):
        cmd = shlex.join(cmd)
    info = {
        **gpu_info(),
        "vllm_version": _version("vllm"),
        "torch_version": _version("torch"),
        "triton_version": _version("triton"),
        "transformers_version": _version("transformers"),
        "dflash_lab_version": _version("dflash-lab"),
        "python": platform.python_version(),
        "host": platform.node(),
        "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": cmd,
        "git_commit": os.environ.get("DFLASH_LAB_COMMIT") or _git_commit(),
        "gpu_session": os.environ.get("DFLASH_LAB_GPU_SESSION") or None,
        "host_boot_id": _boot_id(),
    }
    return info


def _boot_id() -> str | None:
    """The kernel's boot id: two lines with different ids did not run on the same host boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
