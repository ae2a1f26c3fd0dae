"""Bring what a GPU session step returned (``$OUT``) into ``data/``, checked, never overwriting.

``python -m dflash_lab ingest FOLDER NAME [--matrix MATRIX.yaml] [--device-command CMD] [--gpu-session LABEL]
[--relabel-session LABEL] [--kind runs|bench|release]``

``--relabel-session``: the lines were run under a label that is not the project's ``DATE-sN``; each line gets that
label and keeps the one it was run with as ``gpu_session_as_run`` (the meta says so too); nothing else changes.

FOLDER is what one ``scripts/gpu/session.sh`` call (or the last ``scripts/gpu/detached.sh`` call of a batch, with
its ``runner.log``) wrote under ``$OUT``: ``runs.jsonl``,
``logs.tgz`` (engine logs and launch-hook output), optionally ``gpu_replay.jsonl`` and
``capture_sizes.json``. It becomes:

- ``data/runs/NAME.jsonl`` (``--kind bench``: ``data/bench/NAME.jsonl``, server-mode lines with a
  GPU session label only; ``--kind release``: ``data/upstream/runs/NAME.jsonl``, lines of engines that ran a later
  vLLM release, which no other kind takes): the run lines, byte for byte (every line validated first);
- ``data/runs/NAME.meta.json``: which matrix and device command produced them, and the GPU
  session (one lease of one host: ratios are only taken between lines of the same session);
- ``data/gpu/NAME/``: engine logs, the hook's statistics, findings and launch records,
  the resolved engine configuration (capture sizes), GPU replay results.

Everything is staged in a temporary folder and moved into place only when complete; an
existing NAME is refused, so nothing already recorded is lost or half-written.
"""

from __future__ import annotations

import filecmp
import lzma
import json
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

from .errors import LabError
from .runner import read_lines

KEEP_SUFFIXES = (".log", ".json", ".jsonl", ".npz")
SESSION_LABEL = re.compile(r"^\d{4}-\d{2}-\d{2}-s\d+$")   # a GPU session's label: its date and session number
# --kind: where the run lines go (bench: server-mode benchmark lines; release: lines of engines that ran a later vLLM
# release, runner key vllm_release)
KIND_DIRS = {"runs": "runs", "bench": "bench", "release": "upstream/runs"}
XZ_ABOVE = 1 << 20  # bytes: a JSONL log larger than this is stored xz-compressed
# bytes: an engine log (<engine>.aN.log) larger than this is stored xz-compressed too. A crash's device asserts repeat
# per thread (a NaN-filled run's log: 0.9-1.4 MB, 13 kB as xz): uncompressed, 20 such logs were 22 of the checkout's
# ~46 MB, which travels beside vLLM's parts in every device call (64 MiB each)
LOG_XZ_ABOVE = 100_000
ENGINE_LOG = re.compile(r"\.a\d+\.log$")


def compress_xz(src, dst) -> None:
    """``src`` (a file object or path) written to ``dst`` xz-compressed, ingest's one setting (deterministic: the same
    bytes give the same file, which :func:`_drop_already_recorded` compares)."""
    with lzma.open(dst, "wb", preset=9 | lzma.PRESET_EXTREME) as fdst:
        if isinstance(src, (str, os.PathLike)):
            with open(src, "rb") as fsrc:
                shutil.copyfileobj(fsrc, fdst)
        else:
            shutil.copyfileobj(src, fdst)


def _check_new(name: str, *dests: Path) -> None:
    """A record name of letters, digits, '-', '_' and '.', none of whose destinations exists yet."""
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise LabError(f"name {name!r} may hold only letters, digits, '-', '_' and '.'")
    for p in dests:
        if p.exists():
            raise LabError(f"{p} already exists: choose another name (recorded results are never overwritten)")


def _kept_members(tf: tarfile.TarFile, archive: Path, suffixes: tuple[str, ...]):
    """(member, its path) for the regular files of ``tf`` whose name ends in ``suffixes``; a member that would
    land outside the destination (``..``, an absolute path) stops the whole ingest."""
    for m in tf.getmembers():
        if not m.isfile() or not m.name.endswith(suffixes):
            continue
        rel = Path(m.name)
        if ".." in rel.parts or rel.is_absolute():
            raise LabError(f"{archive}: unsafe member {m.name}")
        yield m, rel


def ingest(folder: str, name: str, data_dir: str = "data", matrix: str | None = None,
           device_command: str | None = None, gpu_session: str | None = None, kind: str = "runs",
           relabel_session: str | None = None) -> dict:
    src = Path(folder)
    if not src.is_dir():
        raise LabError(f"{folder}: no such folder")
    _check_new(name)
    runs_src = src / "runs.jsonl"
    lines = read_lines(runs_src) if runs_src.exists() else []
    if kind not in KIND_DIRS:
        raise LabError(f"kind {kind!r}: must be one of {', '.join(KIND_DIRS)}")
    # a later release's lines (runner key vllm_release) go apart from 0.22.1's: every analysis of data/runs/ and
    # data/bench/ is of 0.22.1, and a release line there would count as a 0.22.1 run
    mixed = [l.get("run_id") for l in lines if bool(l.get("vllm_release")) != (kind == "release")]
    if mixed:
        raise LabError(f"{runs_src}: " + ("--kind release takes lines of vllm_release engines only; not: "
                                          if kind == "release" else
                                          "lines of vllm_release engines (a later vLLM release) go with --kind release, "
                                          "into data/upstream/runs/: ") + str(mixed[:5]))
    if kind == "release":
        # a release line that ran must say its engine imported that release (runner: engine_vllm_version at ready)
        unproven = [l.get("run_id") for l in lines if l.get("outcome") != "startup_error"
                    and (l.get("engine_vllm_version") != l.get("vllm_release") or l.get("vllm_version") != l.get("vllm_release"))]
        if unproven:
            raise LabError(f"{runs_src}: release lines whose engine did not report that release as its vllm: {unproven[:5]}")
    if kind == "bench":
        bad = [l.get("run_id") for l in lines if l.get("mode") != "server"]
        if bad:
            raise LabError(f"{runs_src}: bench lines must come from server-mode runs; not: {bad[:5]}")
        if not gpu_session and not all(l.get("gpu_session") for l in lines):
            raise LabError("bench lines need a GPU session label (--gpu-session): ratios are taken within a session only")
    data = Path(data_dir)
    if not data.is_dir():
        raise LabError(f"{data_dir}: no such folder (ingest runs in the checkout's root, beside data/)")
    runs_dst = data / KIND_DIRS[kind] / f"{name}.jsonl"
    gpu_dst = data / "gpu" / name
    _check_new(name, runs_dst, gpu_dst)
    sessions = {l.get("gpu_session") for l in lines} - {None}
    relabelled = None
    if relabel_session is not None:
        # the label the GPU session's lines were run with is not the project's (a typo, another convention): each
        # line keeps it as gpu_session_as_run and says relabel_session; nothing else of the line changes
        if not SESSION_LABEL.match(relabel_session):
            raise LabError(f"--relabel-session {relabel_session!r}: a session label is DATE-sN (e.g. 2026-12-05-s65)")
        if len(sessions) != 1 or not all(l.get("gpu_session") for l in lines) or relabel_session in sessions:
            raise LabError(f"{runs_src}: --relabel-session needs every line to carry one other label; they say "
                           f"{sorted(sessions) or 'none'}")
        if gpu_session and gpu_session != relabel_session:
            raise LabError(f"--gpu-session {gpu_session!r} and --relabel-session {relabel_session!r} disagree")
        relabelled = {"from": sessions.pop(), "to": relabel_session}
        lines = [{**l, "gpu_session": relabel_session, "gpu_session_as_run": relabelled["from"]} for l in lines]
        sessions = {relabel_session}
    if gpu_session and sessions and sessions != {gpu_session}:
        raise LabError(f"{runs_src}: lines say GPU session {sorted(sessions)}, --gpu-session says {gpu_session!r}")
    gpu_session = gpu_session or (sessions.pop() if len(sessions) == 1 else None)
    if matrix and not Path(matrix).is_file():
        raise LabError(f"{matrix}: no such matrix file")
    stage = Path(tempfile.mkdtemp(prefix=".ingest-", dir=data))
    try:
        (stage / "gpu").mkdir()
        logs = src / "logs.tgz"
        kept = []
        if logs.exists():
            try:
                with tarfile.open(logs) as tf:
                    for m, rel in _kept_members(tf, logs, KEEP_SUFFIXES):
                        # runlogs/<engine>.aN.hook/<file> -> <engine>.aN.hook/<file>
                        if rel.parts[0] == "runlogs":
                            rel = Path(*rel.parts[1:])
                        if rel.suffix == ".json" and rel.parent == Path(".") and not rel.name.startswith("engine"):
                            continue  # the runner's temporary spec files
                        out = stage / "gpu" / rel
                        out.parent.mkdir(parents=True, exist_ok=True)
                        if ((m.name.endswith(".jsonl") and m.size > XZ_ABOVE)
                                or (ENGINE_LOG.search(m.name) and m.size > LOG_XZ_ABOVE)):
                            # large probe and engine logs: kept xz-compressed (lossless; the readers take .xz and the
                            # older .gz). xz, not gzip: a probe log repeats each step's layer table, which
                            # gzip's 32 KiB window cannot reach (s35's 9.5 MB c64 log: gzip -9 3.1 MB, xz 54 kB)
                            out = out.with_name(out.name + ".xz")
                            rel = Path(str(rel) + ".xz")
                            with tf.extractfile(m) as fsrc:
                                compress_xz(fsrc, out)
                        else:
                            with tf.extractfile(m) as fsrc, open(out, "wb") as fdst:
                                shutil.copyfileobj(fsrc, fdst)
                        kept.append(str(rel))
            except (tarfile.TarError, EOFError) as e:
                raise LabError(f"{logs}: not a readable tar.gz ({e})") from None
        kept, already = _drop_already_recorded(stage / "gpu", kept, data, gpu_session)
        for extra in ("gpu_replay.jsonl", "capture_sizes.json", "blocking_trace.txt", "setup.log",
                      "repro_min.json", "repro_min.log", "gpu_clocks.csv", "runner.log",   # runner.log: detached.sh
                      *sorted(p.name for p in src.glob("sigstages*.jsonl"))):   # python -m dflash_lab sigstages
            if (src / extra).exists():
                shutil.copy2(src / extra, stage / "gpu" / extra)
                kept.append(extra)
        meta = {
            "name": name,
            "matrix": matrix,
            "device_command": device_command,
            "gpu_session": gpu_session,
            "lines": len(lines),
            "outcomes": {o: sum(1 for l in lines if l["outcome"] == o) for o in sorted({l["outcome"] for l in lines})},
            "provenance": {k: lines[0].get(k) for k in ("gpu", "driver", "vllm_version", "torch_version",
                                                         "triton_version", "started_at", "command", "git_commit")}
            if lines else None,
            "files": sorted(kept),
        }
        if already:
            meta["already_recorded"] = already
        if relabelled:
            meta["session_relabelled"] = relabelled
        (stage / "meta.json").write_text(json.dumps(meta, indent=1))
        gpu_dst.parent.mkdir(parents=True, exist_ok=True)
        if lines:
            runs_dst.parent.mkdir(parents=True, exist_ok=True)
            if relabelled:
                (stage / "runs.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
            else:
                shutil.copy2(runs_src, stage / "runs.jsonl")
            os.replace(stage / "runs.jsonl", runs_dst)
        shutil.copy2(stage / "meta.json", stage / "gpu" / "meta.json")
        if lines:
            os.replace(stage / "meta.json", runs_dst.with_suffix(".meta.json"))
        os.replace(stage / "gpu", gpu_dst)
        return meta
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _drop_already_recorded(stage_gpu: Path, kept: list[str], data: Path, gpu_session: str | None):
    """Files of this output that another folder of the same GPU session already holds, byte for byte or, compressed,
    once decompressed (a host folder shared by a session's calls returns earlier calls' logs again): left out, and
    named in the meta."""
    if not gpu_session:
        return kept, []
    others = []
    for meta in sorted((data / "gpu").glob("*/meta.json")):
        try:
            if json.loads(meta.read_text()).get("gpu_session") == gpu_session:
                others.append(meta.parent)
        except (OSError, ValueError):
            continue
    out, already = [], []
    for rel in kept:
        mine = stage_gpu / rel
        twin = next(((o, how) for o in others if (o / rel).is_file() and (how := _same_content(mine, o / rel))), None)
        if twin is None:
            out.append(rel)
        else:
            mine.unlink()
            already.append(f"{rel} ({twin[1]} to {twin[0].name}/{rel})")
    return out, already


def _same_content(a: Path, b: Path) -> str | None:
    """How two recorded files hold the same content: "byte-identical", or, both compressed by ingest (``.xz`` /
    ``.gz``), "identical once decompressed" (another liblzma, or other settings, may write other bytes for the same
    log); None when they differ."""
    if filecmp.cmp(a, b, shallow=False):
        return "byte-identical"
    if a.suffix != b.suffix or a.suffix not in (".xz", ".gz"):
        return None
    import gzip
    import lzma

    opener = lzma.open if a.suffix == ".xz" else gzip.open
    try:
        with opener(a, "rb") as fa, opener(b, "rb") as fb:
            while True:
                x, y = fa.read(1 << 20), fb.read(1 << 20)
                if x != y:
                    return None
                if not x:
                    return "identical once decompressed"
    except (OSError, EOFError, lzma.LZMAError):
        return None   # one of them does not decompress: not the same recording


REPRO_FILES = ("repro_min.json", "repro_min.log", "repro_min.rejudged.json", "rejudge.log", "rc.txt",
               # what a device command may add beside them: the GPU and driver (nvidia-smi), when it started,
               # which work folder it used, and the Triton autotuning results it found in each cache folder after
               "gpu.txt", "started.txt", "workdir.txt", "autotune_counts.txt")
# a call holding only these judged an existing work folder again (--rejudge reads it and writes nothing there),
# so the snapshot an earlier call packed is still the work folder as it was left
JUDGE_ONLY = ("repro_min.rejudged.json", "rejudge.log")
REPRO_KEEP = (".log", ".json", ".jsonl")


def _judge_only(f: Path) -> bool:
    """A call that only judged an earlier work folder again: a --rejudge result, no engine run, no snapshot."""
    names = {p.name for p in f.iterdir()}
    # nothing else: a log of a child run by hand, say, means the work folder may have changed after the snapshot
    return bool(names & set(JUDGE_ONLY)) and names <= set(JUDGE_ONLY) | {"rc.txt"}


def ingest_repro(calls: list[tuple[str, str]], name: str, data_dir: str = "data", gpu_session: str | None = None,
                 git_commit: str | None = None, provenance: dict | None = None, what_happened: str | None = None) -> dict:
    """Bring one GPU run of ``scripts/repro_min.py`` into ``data/gpu/NAME/``: a run may take several device calls
    (a deadline, ``--resume``, a child run by hand, ``--rejudge``), given in order as (folder, device command).

    Each call's own files (REPRO_FILES) go to ``callN/``; the ``children*.tgz`` (the work folder as it was left)
    of the last call, or of the last before trailing calls that only ran ``--rejudge`` (JUDGE_ONLY files and
    ``rc.txt``, nothing else, and a rejudged JSON naming the snapshot's own work folder), is unpacked into
    ``children/``, logs and JSON only. ``verdict.txt`` is the verdict line of the
    last call that judged (``repro_min.rejudged.json`` before ``repro_min.json``). ``meta.json`` gets the
    provenance the files hold (GPU name and versions the engines recorded, the run's command and start) plus
    ``provenance`` given here (e.g. the driver) and each engine's start-up. Staged, then moved into place; an
    existing NAME is refused."""
    if not calls:
        raise LabError("ingest-repro: give at least one call (--call FOLDER --command CMD)")
    _check_new(name)
    folders = [Path(f) for f, _ in calls]
    for f in folders:
        if not f.is_dir():
            raise LabError(f"{f}: no such folder")
        if not any((f / x).exists() for x in REPRO_FILES) and not list(f.glob("children*.tgz")):
            raise LabError(f"{f}: holds no output of scripts/repro_min.py ({', '.join(REPRO_FILES)}, children*.tgz)")
    data = Path(data_dir)
    dst = data / "gpu" / name
    _check_new(name, dst)
    (data / "gpu").mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".ingest-", dir=data))
    try:
        out = stage / "gpu"
        out.mkdir()
        files, left_out, judged, verdict_line = [], [], None, None
        for i, f in enumerate(folders, 1):
            for x in REPRO_FILES:
                if (f / x).exists():
                    (out / f"call{i}").mkdir(exist_ok=True)
                    shutil.copy2(f / x, out / f"call{i}" / x)
                    files.append(f"call{i}/{x}")
            left_out += [f"call{i}/{p.name}" for p in sorted(f.iterdir())
                         if p.name not in REPRO_FILES and not p.name.startswith("children")]
            for x, how in (("repro_min.rejudged.json", "--rejudge"), ("repro_min.json", "the parent")):
                try:
                    line = json.loads((f / x).read_text()).get("verdict_line")
                except (OSError, ValueError, AttributeError):
                    continue
                if line:
                    verdict_line, judged = line, f"by scripts/repro_min.py on the GPU host ({how}, call {i})"
                    break
        tgzs = [(i, t) for i, f in enumerate(folders, 1) for t in sorted(f.glob("children*.tgz"))]
        # the last call that may have changed the work folder: trailing --rejudge-only calls did not
        packed = len(folders)
        while packed > 1 and _judge_only(folders[packed - 1]):
            packed -= 1
        last = [t for i, t in tgzs if i == packed]
        if tgzs and not last:
            raise LabError(f"{folders[packed - 1]}: the last call that may have changed the work folder (call {packed}) "
                           "has no children*.tgz (the work folder as it was left): give the calls in order, ending with "
                           "one that packed the work folder (only --rejudge calls may follow it)")
        if len(last) > 1:
            raise LabError(f"{folders[packed - 1]}: more than one children*.tgz ({', '.join(t.name for t in last)}): "
                           "which is the work folder as it was left is ambiguous")
        tgz = last[0] if last else None
        left_out += [f"call{i}/{t.name} (an earlier snapshot of the work folder)" for i, t in tgzs if t != tgz]
        if tgz is not None:
            try:
                with tarfile.open(tgz) as tf:
                    for m, rel in _kept_members(tf, tgz, REPRO_KEEP):
                        target = out / "children" / rel
                        target.parent.mkdir(parents=True, exist_ok=True)
                        with tf.extractfile(m) as fsrc, open(target, "wb") as fdst:
                            shutil.copyfileobj(fsrc, fdst)
                        files.append(str(Path("children") / rel))
            except (tarfile.TarError, EOFError) as e:
                raise LabError(f"{tgz}: not a readable tar.gz ({e})") from None
        ch = out / "children"

        def _json(p: Path):
            try:
                return json.loads(p.read_text())
            except (OSError, ValueError):
                return None

        run = _json(ch / "run.json") or next((j for f in folders for j in [_json(f / "repro_min.json")] if j), None) or {}
        for i in range(packed, len(folders)):   # trailing --rejudge calls must have judged the packed folder
            judged_dir = (_json(folders[i] / "repro_min.rejudged.json") or {}).get("workdir")
            if tgz is not None and judged_dir != run.get("workdir"):
                raise LabError(f"{folders[i]}: its --rejudge judged {judged_dir!r}, but the packed snapshot "
                               f"(call {packed}) is of {run.get('workdir')!r}: not the same work folder")
        results = [j for j in (_json(p) for p in sorted(ch.glob("*.json"))) if isinstance(j, dict) and j.get("role")]
        gpus = sorted({r["gpu"] for r in results if r.get("gpu")})
        versions = next((r["versions"] for r in results if r.get("versions")), {})
        startups = {}
        for p in sorted(ch.glob("*.started.json")):
            j = _json(p) or {}
            startups[p.name.split(".")[0]] = j.get("startup_s")
        if verdict_line:
            (out / "verdict.txt").write_text(verdict_line + "\n")
            files.append("verdict.txt")
        meta = {
            "name": name, "matrix": None, "gpu_session": gpu_session, "lines": 0, "outcomes": {},
            "device_command": " | ".join(f"call {i}: {c}" for i, (_, c) in enumerate(calls, 1)),
            "provenance": {"gpu": gpus[0] if len(gpus) == 1 else (gpus or None),
                           "vllm_version": run.get("vllm"), "torch_version": versions.get("torch"),
                           "triton_version": versions.get("triton"), "started_at": run.get("started_at"),
                           "command": run.get("command"), "git_commit": git_commit,
                           **(provenance or {})},
            "provenance_given": sorted(provenance or {}),   # these keys came from the command line, not the files
            "children_from": f"call{packed}/{tgz.name}" if tgz is not None else None,
            "startup_s": startups,
            "judged": judged,
            "files": sorted(files),
        }
        if left_out:
            meta["left_out"] = left_out
        if what_happened:
            meta["what_happened"] = what_happened
        (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(out, dst)
        return meta
    finally:
        shutil.rmtree(stage, ignore_errors=True)
