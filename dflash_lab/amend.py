"""Correct recorded run lines from the files recorded beside them, by stated rules, keeping what was recorded.

``python -m dflash_lab amend NAME [--data DATA]`` reads ``DATA/runs/NAME.jsonl`` and applies:

- **stale-core**: the line's ``fault`` leads with a core file that an earlier line (same host, by boot id)
  recorded as its own. Two calls of one matrix on one host reused engine tags and so core folders (fixed in the
  runner after s19), and the second call read the first call's cores too, oldest first. The line's own core (the
  one in ``fault.cores`` no earlier line claims) then leads; its fields are read again from the cuda-gdb text
  recorded in ``DATA/gpu/NAME/<engine tag>.coredump.log``, and the claimed cores are listed as ``stale_cores``.
  The line's ``wall_s`` timed the run until the earlier core was seen, not until its own crash: it becomes None.
  A core is claimed by an earlier line when that line (same host boot id, never an unknown one) recorded it as its
  fault's core or in its ``fault.cores`` (tensor parallelism: one core per faulting rank).
- **gdb-reread**: a fault field the recorded line left empty (None) that the current cuda-gdb parser reads from the
  line's own core's recorded text: the parser learnt to name device-side asserts (``Assertion failed.``, no CUDA
  exception line) after s19's first two asserts were recorded with no exception. Only empty fields are filled, in
  the fault and in each entry of ``fault.cores``.
- **client-view**: a crash line without the measurements of the worker's ``run_end`` for that run, while the
  events recorded in ``DATA/gpu/NAME/<engine tag>.events.jsonl`` hold it. The core file could appear before the
  worker's ``run_end``; the runner then wrote the crash line without what a server's clients saw (statuses, error
  bodies, requests completed). The run_end's fields are added, or replace the runner's (``wall_s``,
  ``requests_completed``, ``spec_decode_metrics``: the worker measured them, as on the ok path); ``outcome``,
  ``error``, ``fault`` and ``log_tail`` stay.

- **process-name**: a fault (or an entry of ``fault.cores``) whose ``process`` differs from the name the engine log
  recorded in ``DATA/gpu/NAME/<engine tag>.log`` gives its pid, read as :func:`coredump.processes` reads it now (a
  pid's last prefix). vLLM 0.22.1 prefixes a tensor-parallel worker "(Worker pid=N)" before its rank is set and
  "(Worker_TP0 pid=N)" after; the runner kept the first, so s27's TP=2 lines named both ranks 'Worker'.

- **build-ledger**: a line with attention taps recorded before the runner wrote ``probe_ledger`` gets it from the
  engine's probe log in ``DATA/gpu/NAME/<engine tag>.probe/``: true when its layout line lists
  ``builds_before_first_step`` (the ledger's), else false. The ledger changes the allocations around capture (s38's
  stale schedules held other padding than s37's), so runs with and without it are told apart.

- **unread-counters**: a server-mode line whose server was gone after its run (``server_alive`` false), recorded
  by a worker that did not say whether it read the counters (no ``spec_counters_read``, before s48's change). That
  worker put the counters read before the run in place of the ones it could not read from a server gone, so the line
  says 0 drafts, 0 accepted where nothing was measured: ``spec_decode_metrics`` becomes None and
  ``spec_counters_read`` false. s48's three stock server crashes were recorded so.

Every amended line gets an ``amended`` list entry: the rule, the recorded file the new values came from, the
values it replaced (``as_recorded``) and the fields it added (``added``). The file is rewritten atomically, keeping
its permissions (ingest leaves recorded files read-only), then ``NAME.meta.json`` gets an ``amendments`` entry
(date, rules, run ids); a run interrupted between the two is reconciled by the next one, which adds to the meta
every amended line it does not list yet. Running it again finds nothing to amend.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path

from . import atomic
from .coredump import parse_cuda_gdb, processes
from .errors import LabError
from .runner import read_lines, read_recorded, recorded_path, run_end_fields

KEEP_ON_CRASH = ("outcome", "error", "fault", "log_tail")
SECTION_RE = re.compile(r"^=== (\S+) \([^)]*\)\n", re.M)


def _tag(line: dict) -> str | None:
    log = line.get("log")
    return Path(log).name[:-len(".log")] if log and log.endswith(".log") else None


def gdb_sections(text: str) -> dict[str, str]:
    """The cuda-gdb text per core file of a recorded ``.coredump.log`` (several cores: '=== CORE (PROCESS)' headers;
    one core: the text alone, named by its 'Opening GPU coredump:' line)."""
    heads = list(SECTION_RE.finditer(text))
    if not heads:
        m = re.search(r"Opening GPU coredump: (\S+)", text)
        return {m.group(1): text} if m else {}
    return {h.group(1): text[h.end():heads[i + 1].start() if i + 1 < len(heads) else len(text)]
            for i, h in enumerate(heads)}


def _cores_of(fault: dict) -> set[str]:
    """Every core file a fault names: its lead and, with several, each in ``cores`` (same folder, named by pid)."""
    if not fault.get("core_file"):
        return set()
    folder = os.path.dirname(fault["core_file"])
    return {fault["core_file"]} | {f"{folder}/core.{c['pid']}" for c in fault.get("cores") or [] if c.get("pid") is not None}


def _claims(recorded: list[dict], before: str) -> set[tuple]:
    """(host boot id, core file) of every core recorded by a line that finished before ``before`` on a known host."""
    return {(l["host_boot_id"], c) for l in recorded if l.get("host_boot_id") and l.get("finished_at", "") < before
            for c in _cores_of(l.get("fault") or {})}


def _stale_core(line: dict, data: Path, name: str, path: Path, recorded: list[dict]) -> dict | None:
    fl = line.get("fault") or {}
    boot = line.get("host_boot_id")
    if not boot or not fl.get("core_file"):
        return None
    claimed = _claims(recorded, line.get("finished_at") or "")
    if (boot, fl["core_file"]) not in claimed:
        return None
    folder = os.path.dirname(fl["core_file"])
    own = [c for c in fl.get("cores") or []
           if c.get("pid") is not None and (boot, f"{folder}/core.{c['pid']}") not in claimed]
    if not own:
        raise LabError(f"{path}: {line['run_id']}: its fault's core {fl['core_file']} belongs to an earlier line, "
                       "and no other core of its own is recorded: cannot amend")
    tag = _tag(line)
    src = data / "gpu" / name / f"{tag}.coredump.log"
    if not src.is_file():
        raise LabError(f"{src}: missing (needed to read {line['run_id']}'s own core again)")
    sections = gdb_sections(src.read_text())
    lead = own[0]
    core = f"{folder}/core.{lead['pid']}"
    if core not in sections:
        raise LabError(f"{src}: no cuda-gdb text for {core}")
    new = dict(parse_cuda_gdb(sections[core]), core_file=core, core_bytes=lead.get("core_bytes"), pid=lead["pid"],
               process=lead.get("process"), wait_s=fl.get("wait_s"), gdb_log=fl.get("gdb_log"))
    if len(own) > 1:
        new["cores"] = own
    new["stale_cores"] = [f"{folder}/core.{c['pid']}" for c in fl.get("cores") or [] if c not in own]
    return {"rule": "stale-core", "source": str(src), "set": {"fault": new, "wall_s": None},
            "as_recorded": {"fault": fl, "wall_s": line.get("wall_s")}}


def _gdb_reread(line: dict, data: Path, name: str) -> dict | None:
    fl = line.get("fault") or {}
    tag = _tag(line)
    if not fl.get("core_file") or not tag:
        return None
    src = data / "gpu" / name / f"{tag}.coredump.log"
    if not src.is_file():
        return None
    sections = gdb_sections(src.read_text())
    if fl["core_file"] not in sections:
        return None
    fill = {k: v for k, v in parse_cuda_gdb(sections[fl["core_file"]]).items() if v is not None and fl.get(k) is None}
    folder = os.path.dirname(fl["core_file"])
    cores, changed = [], False
    for c in fl.get("cores") or []:
        text = sections.get(f"{folder}/core.{c.get('pid')}")
        fresh = parse_cuda_gdb(text) if text is not None else {}
        add = {k: fresh[k] for k in c if k in fresh and c[k] is None and fresh[k] is not None}
        changed = changed or bool(add)
        cores.append(dict(c, **add))
    if not fill and not changed:
        return None
    new = dict(fl, **fill)
    if changed:
        new["cores"] = cores
    return {"rule": "gdb-reread", "source": str(src), "set": {"fault": new}, "as_recorded": {"fault": fl}}


def _client_view(line: dict, data: Path, name: str) -> dict | None:
    if line.get("outcome") != "crash" or not _tag(line):
        return None
    # as stored: ingest keeps a JSONL file above 1 MiB xz-compressed (events.jsonl.xz)
    src = recorded_path(data / "gpu" / name / f"{_tag(line)}.events.jsonl")
    if src is None:
        return None
    end = None
    for raw in read_recorded(src).splitlines():
        try:
            ev = json.loads(raw)
        except ValueError:
            continue
        if ev.get("event") == "run_end" and ev.get("run") == line["run_id"]:
            end = ev
    if end is None:
        return None
    fields = {k: v for k, v in run_end_fields(end).items() if k not in KEEP_ON_CRASH}
    if all(k in line for k in fields):
        return None
    return {"rule": "client-view", "source": str(src), "set": fields,
            "as_recorded": {k: line.get(k) for k in fields if k in line}}


def _process_name(line: dict, data: Path, name: str) -> dict | None:
    fl = line.get("fault") or {}
    tag = _tag(line)
    if not tag or (fl.get("pid") is None and not fl.get("cores")):
        return None
    src = recorded_path(data / "gpu" / name / f"{tag}.log")   # stored .xz when large
    names = processes(src)
    if not names:
        return None

    def renamed(entry: dict) -> dict:
        known = names.get(entry.get("pid"))
        return dict(entry, process=known) if known and known != entry.get("process") else entry

    new = renamed(fl)
    if fl.get("cores"):
        new["cores"] = [renamed(c) for c in fl["cores"]]
    if new == fl:
        return None
    return {"rule": "process-name", "source": str(src), "set": {"fault": new}, "as_recorded": {"fault": fl}}


def _build_ledger(line: dict, data: Path, name: str) -> dict | None:
    """A tapped probe line recorded before the runner wrote ``probe_ledger``: whether the probe ran its build ledger,
    read off the engine's probe log (the ledger's layout line lists ``builds_before_first_step``; s36-s37's probe had
    no ledger, s38's had it on)."""
    if not line.get("probe_taps") or "probe_ledger" in line or not _tag(line):
        return None
    logs = sorted((data / "gpu" / name / f"{_tag(line)}.probe").glob("probe-*.jsonl*"))
    if not logs:
        return None
    from .runner import json_lines

    found = False
    for log in logs:
        for _, obj in json_lines(log):
            if obj.get("kind") == "layout":
                found = found or "builds_before_first_step" in obj
    return {"rule": "build-ledger", "source": ", ".join(str(x) for x in logs), "set": {"probe_ledger": found},
            "as_recorded": {}}


def _unread_counters(line: dict, data: Path, name: str) -> dict | None:
    if (line.get("mode") != "server" or line.get("server_alive") is not False or "spec_counters_read" in line
            or not isinstance(line.get("spec_decode_metrics"), dict)):
        return None
    return {"rule": "unread-counters", "source": "dflash_lab/worker.py (serve_run before s48: a server gone after its "
                                                 "run had its counters from before the run put in place of after's)",
            "set": {"spec_decode_metrics": None, "spec_counters_read": False},
            "as_recorded": {"spec_decode_metrics": line["spec_decode_metrics"]}}


def amend(name: str, data_dir: str = "data") -> dict:
    data = Path(data_dir)
    path = data / "runs" / f"{name}.jsonl"
    meta_path = data / "runs" / f"{name}.meta.json"
    if not path.is_file():
        raise LabError(f"{path}: no such recorded run file")
    lines = read_lines(path)
    raw = [r for r in path.read_text().splitlines() if r.strip()]
    if len(raw) != len(lines):
        raise LabError(f"{path}: {len(raw)} text lines but {len(lines)} records")
    recorded = [l for f in sorted((data / "runs").glob("*.jsonl")) for l in read_lines(f)]
    changed = []
    for i, line in enumerate(lines):
        for make in (lambda: _stale_core(line, data, name, path, recorded), lambda: _gdb_reread(line, data, name),
                     lambda: _client_view(line, data, name), lambda: _process_name(line, data, name),
                     lambda: _build_ledger(line, data, name), lambda: _unread_counters(line, data, name)):
            rule = make()   # each rule sees the line as the rules before it left it
            if rule is None:
                continue
            added = sorted(k for k in rule["set"] if k not in line)
            line.update(rule["set"])
            line.setdefault("amended", []).append(
                {"rule": rule["rule"], "source": rule["source"], "as_recorded": rule["as_recorded"], "added": added})
            changed.append((line["run_id"], rule["rule"]))
            raw[i] = json.dumps(line)   # only amended lines are written anew; the others stay byte for byte
    result = {"name": name, "amended": [{"run_id": r, "rule": k} for r, k in changed]}
    if changed:
        atomic.write_text(path, "".join(r + "\n" for r in raw))
    # the meta lists every amendment the lines carry: this run's, and any an interrupted run left unlisted
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    listed = {(c["run_id"], c["rule"]) for a in meta.get("amendments", []) for c in a.get("changes", [])}
    carried = [{"run_id": l["run_id"], "rule": a["rule"]} for l in lines for a in l.get("amended", [])]
    missing = [c for c in carried if (c["run_id"], c["rule"]) not in listed]
    if missing:
        meta.setdefault("amendments", []).append({
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": f"python -m dflash_lab amend {name}", "changes": missing,
            "why": "see dflash_lab/amend.py: each rule, and each line's 'amended' entry with the values it replaced"})
        atomic.write_text(meta_path, json.dumps(meta, indent=1) + "\n")
    return result
