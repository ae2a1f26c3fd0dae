"""Files the library writes for people to read (rendered HTML, figures, records, amended run lines): replaced in one
rename, so a reader sees the old file or the whole new one, never half of either, and a failed write leaves no
temporary file behind.

Permissions: the replaced file's own (a read-only record stays read-only), else what a plain ``open()`` gives under
the process's umask. ``tempfile.mkstemp`` alone leaves 0600, which made the rendered report unreadable to anyone but
its writer (a web server, a colleague on a shared host).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (``/proc/self/status``): ``os.umask`` can only
    read it by setting it, and a file another thread creates in between (the launch hook writes records inside vLLM's
    engine process) would get the wrong mode."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _plain_mode() -> int:
    return 0o666 & ~_umask()


def replace_with(path, write, suffix: str = "") -> Path:
    """Call ``write(tmp)`` on a temporary path beside ``path`` (ending in ``suffix``: some writers pick the format
    by it), then rename it over ``path``. The folder is made if missing. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else _plain_mode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path, text: str) -> Path:
    """:func:`replace_with` for a text file (UTF-8)."""
    return replace_with(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
