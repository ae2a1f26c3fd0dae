"""The upstream change as a diff: apply ``patches/vllm-0.22.1-dflash.diff`` to an installed vLLM, strictly.

The plugin's fix (:mod:`dflash_lab.patch`) changes vLLM from outside, at run time. A maintainer will merge the diff,
not the plugin, so the diff must run too: the runner's engine key ``vllm_diff`` starts that engine on a copy of the
installed ``vllm`` package with the diff applied (an *overlay*), put ahead of the original on ``PYTHONPATH``.

- :func:`parse` / :func:`apply_text`: a unified diff, applied without fuzz or offset: every hunk's context and removed
  lines must be exactly the file's lines at the hunk's own line numbers, else :class:`LabError` names the file and hunk.
  ``patch`` and ``git apply`` would accept a hunk that moved; a diff that no longer fits 0.22.1 exactly is refused.
- :func:`overlay`: builds ``<base>/dflash-lab-vllm-diff-<hash>/vllm`` once per host and diff: the package's files are
  hard links to the installed ones (no copy of its 2.5 GB; copied where links cannot be made), the diff's files are
  written anew, so the installed package is never changed. It is built in a scratch folder and renamed into place,
  so a diff that does not apply leaves nothing behind, and a finished overlay is reused only when its stamp names
  the same hunks and files.
- :func:`check_loaded`: in every engine process (the plugin, ``DFLASH_LAB_VLLM_DIFF=<overlay>``): the ``vllm``
  that process imported is the overlay's, and each file of the diff there has the stamp's hash. Anything else is an
  error, so no run line can claim the diff without having run it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .errors import LabError

ENV = "DFLASH_LAB_VLLM_DIFF"
STAMP = "DFLASH_LAB_VLLM_DIFF.json"
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: list[str] = field(default_factory=list)   # each with its ' ', '-' or '+' mark and its line end

    def old(self) -> list[str]:
        return [x[1:] for x in self.lines if x[0] in " -"]

    def new(self) -> list[str]:
        return [x[1:] for x in self.lines if x[0] in " +"]


def _lines(text: str) -> list[str]:
    """``text`` cut after each newline only (``str.splitlines`` also cuts at form feeds and other separators a
    source file may hold inside a string)."""
    parts = text.split("\n")
    out = [x + "\n" for x in parts[:-1]]
    return out + ([parts[-1]] if parts[-1] else [])


def _read(path) -> str:
    with open(path, newline="") as f:   # no newline translation: a CRLF file stays CRLF, and a hunk must match it
        return f.read()


def hunks_text(diff_text: str) -> str:
    """The diff from its first ``--- a/`` line on: the code change without the prose header above it. A file or hunk
    header of another form in the prose (``--- /dev/null``, a new file) is refused, not skipped."""
    m = re.search(r"^--- a/", diff_text, re.M)
    if m is None:
        raise LabError("the diff has no '--- a/' line: no file to change")
    for n, line in enumerate(_lines(diff_text[:m.start()]), 1):
        if line.startswith(("--- ", "+++ ", "@@ ")):
            raise LabError(f"diff line {n}: {line.rstrip()!r} before the first '--- a/' file header; only changes to "
                           "existing files (--- a/X, +++ b/X) are taken")
    return diff_text[m.start():]


def hunks_sha256(diff_text: str) -> str:
    return hashlib.sha256(hunks_text(diff_text).encode()).hexdigest()


def parse(diff_text: str) -> dict[str, list[Hunk]]:
    """``{relative path: hunks}`` of a unified diff (``--- a/X`` / ``+++ b/X`` pairs; X the same on both sides)."""
    lines = _lines(hunks_text(diff_text))
    files: dict[str, list[Hunk]] = {}
    i, cur = 0, None
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- a/"):
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            old, new = line[6:].rstrip("\n"), nxt[6:].rstrip("\n") if nxt.startswith("+++ b/") else None
            if new != old:
                raise LabError(f"diff line {i + 1}: '--- a/{old}' is not followed by '+++ b/{old}'")
            if old in files:
                raise LabError(f"diff line {i + 1}: {old} appears twice")
            if old.startswith("/") or ".." in old.split("/") or not old.startswith("vllm/"):
                raise LabError(f"diff line {i + 1}: {old}: only files inside the vllm package (vllm/...) are taken")
            cur = files[old] = []
            i += 2
            continue
        m = _HUNK.match(line)
        if m is None or cur is None:
            raise LabError(f"diff line {i + 1}: expected a hunk header or a file header, got {line.rstrip()!r}")
        h = Hunk(int(m[1]), int(m[2] if m[2] is not None else 1), int(m[3]), int(m[4] if m[4] is not None else 1))
        i += 1
        n_old = n_new = 0
        while n_old < h.old_len or n_new < h.new_len:
            if i >= len(lines) or not lines[i] or lines[i][0] not in " -+":
                raise LabError(f"{old}: hunk @@ -{h.old_start},{h.old_len} @@ ends early (diff line {i + 1})")
            mark = lines[i][0]
            n_old += mark in " -"
            n_new += mark in " +"
            h.lines.append(lines[i] if lines[i].endswith("\n") else lines[i] + "\n")
            i += 1
        if n_old != h.old_len or n_new != h.new_len:
            raise LabError(f"{old}: hunk @@ -{h.old_start},{h.old_len} +{h.new_start},{h.new_len} @@ counts "
                           f"{n_old} old and {n_new} new lines")
        cur.append(h)
    if not files or not all(files.values()):
        raise LabError("the diff changes no file (a file header without hunks, or none at all)")
    return files


def apply_text(rel: str, old_text: str, hunks: list[Hunk]) -> str:
    """``old_text`` with ``hunks`` applied at exactly their line numbers (no fuzz, no offset)."""
    src = _lines(old_text)
    out, pos = [], 0                                   # pos: index in src of the next line not yet copied
    for n, h in enumerate(hunks, 1):
        start = h.old_start - 1 if h.old_len else h.old_start
        if start < pos:
            raise LabError(f"{rel}: hunk {n} (line {h.old_start}) overlaps the hunk before it")
        want, have = h.old(), src[start:start + h.old_len]
        if have != want:
            bad = next((k for k, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
            raise LabError(f"{rel}: hunk {n} does not apply at line {h.old_start}: line {h.old_start + bad} is "
                           f"{(have[bad] if bad < len(have) else '<end of file>')!r}, the diff expects "
                           f"{(want[bad] if bad < len(want) else '<end of hunk>')!r}")
        out += src[pos:start] + h.new()
        pos = start + h.old_len
    return "".join(out + src[pos:])


def apply_tree(diff_text: str, read) -> dict[str, str]:
    """``{relative path: new text}`` for every file of the diff; ``read(rel)`` gives a file's current text."""
    return {rel: apply_text(rel, read(rel), hunks) for rel, hunks in parse(diff_text).items()}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def installed_package() -> Path:
    """The folder of the ``vllm`` package this interpreter would import (not importing it). When that is itself an
    overlay, the package it was made from."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise LabError("vllm is not importable here: the diff needs the installed vLLM 0.22.1 to apply to")
    pkg = Path(list(spec.submodule_search_locations)[0]).resolve()
    stamp = pkg.parent / STAMP
    if stamp.is_file():
        return Path(json.loads(stamp.read_text())["source"])
    return pkg


def _link_tree(src: Path, dst: Path) -> tuple[int, int]:
    """``dst`` as ``src`` without ``__pycache__``: files hard-linked, copied where a link cannot be made (another file
    system). Returns (linked, copied), which the stamp records. Nothing may ever write into a linked file in place:
    that would write into the installed package (the diff's files are unlinked and written anew)."""
    n = {"linked": 0, "copied": 0}

    def link(s, d):
        try:
            os.link(s, d)
            n["linked"] += 1
        except OSError:
            shutil.copy2(s, d)
            n["copied"] += 1
    shutil.copytree(src, dst, copy_function=link, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return n["linked"], n["copied"]


def overlay(diff_path: str | os.PathLike, package: str | os.PathLike | None = None,
            base: str | os.PathLike | None = None) -> dict:
    """The overlay for ``diff_path`` (built unless a matching one exists). Returns its stamp: ``path`` (the folder to
    put first on ``PYTHONPATH``), ``source`` (the installed package), ``diff`` (the path given), ``diff_sha256``,
    ``hunks_sha256`` and ``files`` (relative path -> sha256 of the patched text)."""
    diff_path = Path(diff_path)
    if not diff_path.is_file():
        raise LabError(f"{diff_path}: no such diff")
    text = diff_path.read_text()
    pkg = Path(package).resolve() if package else installed_package()
    if not (pkg / "__init__.py").is_file():
        raise LabError(f"{pkg}: not a vllm package folder")
    root = pkg.parent

    def read(rel):
        p = root / rel
        if not p.is_file():
            raise LabError(f"{rel}: the diff changes a file the installed vllm ({pkg}) does not have")
        return _read(p)

    new = apply_tree(text, read)                       # refuses a diff that does not apply: nothing is built
    files = {rel: _sha(t) for rel, t in sorted(new.items())}
    # the installed distribution's RECORD: a reinstalled vLLM at the same path gets an overlay of its own, not one
    # whose other files are links to the replaced package's
    records = sorted(root.glob("vllm-*.dist-info/RECORD"))
    installed = hashlib.sha256(b"".join(r.read_bytes() for r in records)).hexdigest() if records else None
    key = hashlib.sha256(json.dumps([str(pkg), installed, files], sort_keys=True).encode()).hexdigest()[:16]
    base = Path(base) if base else Path(tempfile.gettempdir())
    dest = base / f"dflash-lab-vllm-diff-{key}"
    stamp = {"path": str(dest), "source": str(pkg), "installed_record_sha256": installed, "diff": str(diff_path),
             "diff_sha256": _sha(text), "hunks_sha256": hunks_sha256(text), "files": files}

    def existing():
        old = json.loads((dest / STAMP).read_text())
        if old.get("files") == files and old.get("source") == str(pkg) and old.get("installed_record_sha256") == installed:
            return {**old, "diff": str(diff_path), "diff_sha256": stamp["diff_sha256"], "reused": True}
        raise LabError(f"{dest}: an overlay with other contents is already there; remove it")

    if (dest / STAMP).is_file():
        return existing()
    scratch = None
    try:
        base.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".vllm-diff-", dir=base))
        stamp["linked"], stamp["copied"] = _link_tree(pkg, scratch / "vllm")
        for rel, t in new.items():
            p = scratch / rel
            p.unlink()                                 # a hard link to the installed file: never write through it
            with open(p, "w", newline="") as f:
                f.write(t)
        (scratch / STAMP).write_text(json.dumps(stamp, indent=1))
        os.rename(scratch, dest)
        scratch = None
    except OSError as e:
        if (dest / STAMP).is_file():                   # another runner built the same overlay meanwhile
            return existing()
        raise LabError(f"cannot build the vllm overlay in {base}: {e}") from e
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return {**stamp, "reused": False}


def check_loaded(path: str | None = None) -> str:
    """In an engine process: the imported ``vllm`` is the overlay at ``path`` (default ``$DFLASH_LAB_VLLM_DIFF``)
    and each file of the diff there still has the stamp's hash. Returns the line to log; raises otherwise."""
    path = path or os.environ.get(ENV)
    if not path:
        raise LabError(f"{ENV} is not set: no overlay to check")
    stamp_file = Path(path) / STAMP
    if not stamp_file.is_file():
        raise LabError(f"{ENV}={path}: no overlay stamp ({STAMP}) there")
    stamp = json.loads(stamp_file.read_text())
    import vllm

    loaded = Path(vllm.__file__).resolve().parent
    if loaded != (Path(path) / "vllm").resolve():
        raise LabError(f"{ENV}={path}: this process imported vllm from {loaded}, not from the overlay "
                       "(PYTHONPATH must put the overlay first)")
    for rel, sha in stamp["files"].items():
        got = _sha(_read(Path(path) / rel))
        if got != sha:
            raise LabError(f"{ENV}={path}: {rel} has sha256 {got[:12]}, the stamp says {sha[:12]}")
    return (f"vLLM with the upstream diff (hunks sha256 {stamp['hunks_sha256'][:12]}): vllm imported from {loaded}, "
            f"{len(stamp['files'])} changed files as stamped")
