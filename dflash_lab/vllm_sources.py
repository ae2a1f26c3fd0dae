"""Exact source text of vLLM 0.22.1, from the pinned distribution, on any machine.

Where the text comes from, in order:

1. an installed ``vllm`` whose distribution version is exactly 0.22.1 (the GPU host);
2. otherwise the pinned x86-64 wheel from PyPI, fetched once into a cache, checked against
   its published sha256, and unpacked (Python sources and the dist-info only).

Every file handed out is checked against the ``RECORD`` of the distribution it came from
(the sha256 of each file), so a locally edited install or a damaged cache is an error,
never a silent fallback to other text. Nothing imports vLLM: this works on a CPU machine
that has no vLLM runtime at all.

Environment:
  DFLASH_LAB_CACHE       cache folder (default ~/.cache/dflash-lab)
  DFLASH_LAB_VLLM_WHEEL  a local copy of the pinned wheel (still sha256-checked)
  DFLASH_LAB_OFFLINE=1   never download; fail if the cache lacks the sources
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from . import VLLM_VERSION
from .errors import LabError

#: The pinned distribution: the x86-64 wheel of vLLM 0.22.1 as published on PyPI
#: (https://pypi.org/simple/vllm/ lists this sha256 for the file).
WHEEL_NAME = "vllm-0.22.1-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_URL = (
    "https://files.pythonhosted.org/packages/08/cd/"
    "c863370930b2043b7b7f67ff900c9e27c2265f3b3edd080d62c148d4bcb4/" + WHEEL_NAME
)
WHEEL_SHA256 = "cc50536c93827a577b2bc45f038b8b866c31ed220631008521a337c9b2558f4d"
WHEEL_SIZE = 261042548
DIST_INFO = f"vllm-{VLLM_VERSION}.dist-info"
_STAMP = "DFLASH_LAB_SOURCES.json"


@dataclass(frozen=True)
class SourceTree:
    """A folder holding ``vllm/...`` of the pinned version and its ``RECORD``."""

    root: Path
    origin: str  # "installed" or "wheel"
    record: dict  # relative path -> "sha256=<urlsafe b64>"
    wheel_sha256: str | None

    def provenance(self) -> dict:
        return {
            "vllm_version": VLLM_VERSION,
            "origin": self.origin,
            "root": str(self.root),
            "wheel": WHEEL_NAME if self.origin == "wheel" else None,
            "wheel_sha256": self.wheel_sha256,
        }


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_LAB_CACHE", Path.home() / ".cache" / "dflash-lab"))


def _read_record(text: str) -> dict:
    rows = csv.reader(io.StringIO(text))
    return {r[0]: r[1] for r in rows if len(r) >= 2 and r[1]}


def _record_digest(data: bytes) -> str:
    d = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(d).rstrip(b"=").decode()


def _installed_tree() -> SourceTree | None:
    try:
        dist = metadata.distribution("vllm")
    except metadata.PackageNotFoundError:
        return None
    if dist.version != VLLM_VERSION:
        print(
            f"dflash-lab: installed vllm is {dist.version}, not {VLLM_VERSION}; "
            "using the pinned wheel's sources instead",
            file=sys.stderr,
        )
        return None
    record_text = dist.read_text("RECORD")
    if not record_text:
        raise LabError(f"installed vllm {dist.version} has no RECORD: cannot verify its sources")
    root = Path(dist.locate_file(""))
    return SourceTree(root=root, origin="installed", record=_read_record(record_text), wheel_sha256=None)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(url: str, dest: Path, label: str = WHEEL_NAME) -> None:
    tmp = dest.with_suffix(".part")
    try:
        with urllib.request.urlopen(url, timeout=120) as r, open(tmp, "wb") as f:
            total = int(r.headers.get("Content-Length") or 0)
            done = 0
            last = -1
            while True:
                chunk = r.read(1 << 22)
                if not chunk:
                    break
                f.write(chunk)
                done += len(chunk)
                pct = int(100 * done / total) if total else -1
                if pct // 20 != last // 20:
                    print(f"dflash-lab: downloading {label}: {pct}%", file=sys.stderr)
                    last = pct
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise LabError(f"could not download {url}: {e}") from None
    tmp.replace(dest)


def _obtain_wheel(cdir: Path) -> Path:
    local = os.environ.get("DFLASH_LAB_VLLM_WHEEL")
    if local:
        path = Path(local)
        if not path.is_file():
            raise LabError(f"DFLASH_LAB_VLLM_WHEEL={local} is not a file")
    else:
        path = cdir / WHEEL_NAME
        if not path.is_file():
            if os.environ.get("DFLASH_LAB_OFFLINE") == "1":
                raise LabError(
                    f"vLLM {VLLM_VERSION} sources are not cached in {cdir} and DFLASH_LAB_OFFLINE=1"
                )
            cdir.mkdir(parents=True, exist_ok=True)
            _download(WHEEL_URL, path)
    digest = _sha256_file(path)
    if digest != WHEEL_SHA256:
        raise LabError(
            f"{path}: sha256 {digest} does not match the published {WHEEL_SHA256} of {WHEEL_NAME}"
        )
    return path


def _unpack_sources(wheel: Path, dest: Path) -> None:
    """Unpack vllm/**/*.py and the dist-info from the verified wheel, atomically."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest.parent))
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [
                n for n in z.namelist()
                if (n.startswith("vllm/") and n.endswith(".py")) or n.startswith(DIST_INFO + "/")
            ]
            for n in names:
                z.extract(n, tmp)
        (tmp / _STAMP).write_text(json.dumps({"wheel": WHEEL_NAME, "sha256": WHEEL_SHA256}))
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _wheel_tree() -> SourceTree:
    cdir = cache_dir()
    dest = cdir / f"vllm-{VLLM_VERSION}-src"
    stamp = dest / _STAMP
    ok = False
    if stamp.is_file():
        try:
            ok = json.loads(stamp.read_text()).get("sha256") == WHEEL_SHA256
        except ValueError:
            ok = False
    if not ok:
        wheel = _obtain_wheel(cdir)
        _unpack_sources(wheel, dest)
        if not os.environ.get("DFLASH_LAB_VLLM_WHEEL") and not os.environ.get("DFLASH_LAB_KEEP_WHEEL"):
            wheel.unlink(missing_ok=True)  # 261 MB; the verified sources are what we need
    record_path = dest / DIST_INFO / "RECORD"
    if not record_path.is_file():
        raise LabError(f"{dest}: the unpacked sources lack {DIST_INFO}/RECORD; delete the folder to refetch")
    return SourceTree(root=dest, origin="wheel", record=_read_record(record_path.read_text()),
                      wheel_sha256=WHEEL_SHA256)


@lru_cache(maxsize=1)
def source_tree() -> SourceTree:
    """The verified vLLM 0.22.1 source tree (installed, or unpacked from the pinned wheel)."""
    return _installed_tree() or _wheel_tree()


def read_source(relpath: str) -> str:
    """Exact text of ``relpath`` (e.g. ``vllm/v1/spec_decode/utils.py``) in vLLM 0.22.1.

    Raises LabError if the file is not in the distribution or its sha256 differs from the
    distribution's RECORD.
    """
    tree = source_tree()
    expected = tree.record.get(relpath)
    if expected is None:
        raise LabError(f"{relpath} is not a file of vLLM {VLLM_VERSION} (not in its RECORD)")
    path = tree.root / relpath
    try:
        data = path.read_bytes()
    except OSError as e:
        raise LabError(f"cannot read {path}: {e}") from None
    if _record_digest(data) != expected:
        raise LabError(
            f"{path} differs from vLLM {VLLM_VERSION}'s RECORD ({tree.origin} copy modified?)"
        )
    return data.decode("utf-8")


def line_of(relpath: str, needle: str) -> int:
    """1-based line number of the first line of ``relpath`` containing ``needle``."""
    for i, line in enumerate(read_source(relpath).splitlines(), 1):
        if needle in line:
            return i
    raise LabError(f"{needle!r} not found in vLLM {VLLM_VERSION}'s {relpath}")
