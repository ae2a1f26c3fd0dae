"""Store the already recorded large engine logs the way ingest now stores new ones: ``<engine>.aN.log`` files above
``ingest.LOG_XZ_ABOVE`` bytes under ``data/gpu/`` become ``<engine>.aN.log.xz`` (ingest's xz setting).

Lossless and checked: each compressed file is decompressed and compared byte for byte with the log before the log is
removed, and each folder's ``meta.json`` (and the runs file's ``.meta.json`` beside it) gets the new name in
``files``. Run once, from the repository root: ``python scripts/compress_engine_logs.py [DATA]``; a second run finds
nothing to do. Readers go through ``runner.recorded_path`` / ``recorded_glob`` and ``read_recorded``.
"""

from __future__ import annotations

import json
import lzma
import os
import sys
from pathlib import Path

from dflash_lab.errors import LabError
from dflash_lab.ingest import ENGINE_LOG, LOG_XZ_ABOVE, compress_xz


def _rename_in_meta(meta: Path, old: str, new: str) -> None:
    if not meta.is_file():
        return
    m = json.loads(meta.read_text())
    files = m.get("files")
    if isinstance(files, list) and old in files:
        m["files"] = [new if f == old else f for f in files]
        tmp = meta.with_name(meta.name + ".tmp")
        end = "\n" if meta.read_text().endswith("\n") else ""   # as the file had it
        tmp.write_text(json.dumps(m, indent=1) + end)
        os.replace(tmp, meta)


def main(data: str = "data") -> int:
    done = 0
    for log in sorted(Path(data, "gpu").glob("*/*.log")):
        if not ENGINE_LOG.search(log.name) or log.stat().st_size <= LOG_XZ_ABOVE:
            continue
        xz = log.with_name(log.name + ".xz")
        if xz.exists():
            raise LabError(f"{xz}: already there beside {log}; nothing changed for it")
        tmp = xz.with_name(xz.name + ".tmp")
        compress_xz(log, tmp)
        with lzma.open(tmp) as f:
            if f.read() != log.read_bytes():
                tmp.unlink()
                raise LabError(f"{log}: the compressed copy does not decompress to it; left as it was")
        os.replace(tmp, xz)
        rel_old = log.name
        _rename_in_meta(log.parent / "meta.json", rel_old, rel_old + ".xz")
        _rename_in_meta(Path(data, "runs", log.parent.name + ".meta.json"), rel_old, rel_old + ".xz")
        _rename_in_meta(Path(data, "bench", log.parent.name + ".meta.json"), rel_old, rel_old + ".xz")
        before = log.stat().st_size
        log.unlink()
        print(f"{log} -> {xz.name}: {before} -> {xz.stat().st_size} bytes")
        done += 1
    print(f"{done} engine log(s) compressed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(*sys.argv[1:]))
    except LabError as e:
        print(f"compress_engine_logs: {e}", file=sys.stderr)
        sys.exit(2)
