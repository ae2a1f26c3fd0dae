"""What the target's FlashAttention builders' persistent FA3 schedules hold when the first served step begins.

``DFLASH_LAB_SCHED_SNAPSHOT=<folder>``: in each worker process, at the start of the first
``GPUModelRunner.execute_model`` call (CUDA graph capture is over by then, and in vLLM 0.22.1 the step's own builds
come inside that call), the ``scheduler_metadata`` buffer of the first metadata builder of every attention group of
the target (``runner.attn_groups``) is copied to the host once and written as one JSON line to
``<folder>/sched-<pid>.jsonl``, with the worker's device; the engine is left alone after that. The drafter's own
builders (``drafter.draft_attn_groups``) and further micro-batch builders are not recorded. For a group whose builder
is not rebuilt at run time (stock group 7) this is what its FULL graphs read on every later replay; a group built
every step (group 6) holds its next build from then on.

Why: a stale replay of group 7's FULL graphs reads the 1-request capture's schedule, whose 9 padding entries are memory
FA3 never writes (:data:`dflash_lab.fa3sched.PADDING_1`). The step probe recorded them as ``0, 31, 0, ...`` in s36
and s37 and as ``0x7FFF7FFF`` in s38, and which requests below 9 a replay leaves unwritten changed with them. Probed
engines allocate differently from the engines that crash unprobed; this records the padding of an engine that
runs with nothing else attached, at the cost of one host copy per builder after capture and no allocation before it.
"""

from __future__ import annotations

import json
import os
import sys
import threading

ENV = "DFLASH_LAB_SCHED_SNAPSHOT"

_STATE: dict = {}
_LOCK = threading.Lock()


def _trim(vals: list[int]) -> list[int]:
    """The buffer without its trailing zeros (vLLM zeroes everything after a schedule's entries)."""
    end = len(vals)
    while end and vals[end - 1] == 0:
        end -= 1
    return vals[:end]


def snapshot(runner) -> list[dict]:
    """Per KV-cache group and attention group whose builder keeps a persistent FA3 schedule: its layers, whether its
    FULL graphs read that buffer (``use_full_cuda_graph``), the buffer's length and its entries up to the last
    non-zero one."""
    out = []
    for gid, ags in enumerate(getattr(runner, "attn_groups", None) or []):
        for ag in ags:
            builder = ag.get_metadata_builder(0) if hasattr(ag, "get_metadata_builder") else ag.metadata_builders[0]
            buf = getattr(builder, "scheduler_metadata", None)
            if buf is None:
                continue
            vals = [int(x) for x in buf.detach().cpu().tolist()]
            out.append({"gid": gid, "layers": list(getattr(ag, "layer_names", []) or []),
                        "builder": type(builder).__name__,
                        "use_full_cuda_graph": bool(getattr(builder, "use_full_cuda_graph", False)),
                        "entries": len(vals), "buffer": _trim(vals)})
    return out


def write_once(runner, folder: str) -> str | None:
    """Write this process's snapshot line the first time it is called; later calls do nothing. Returns the path
    written, or None. A failure to read the buffers is written as the line's ``error``, never raised into vLLM."""
    with _LOCK:
        if _STATE.get("written"):
            return None
        _STATE["written"] = True
    path = os.path.join(folder, f"sched-{os.getpid()}.jsonl")
    line: dict = {"kind": "sched_snapshot", "pid": os.getpid(), "device": str(getattr(runner, "device", None))}
    try:
        line["groups"] = snapshot(runner)
    except Exception as e:  # noqa: BLE001 - an observer: say what failed, keep the engine running
        line["error"] = f"{type(e).__name__}: {e}"
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps(line) + "\n")
        os.replace(tmp, path)
    except OSError as e:   # a full disk must not end the engine: the missing file says it
        print(f"dflash-lab schedule snapshot: not written ({e})", file=sys.stderr, flush=True)
        return None
    return path


def install(folder: str) -> str:
    """Wrap ``GPUModelRunner.execute_model`` so that its first call writes the snapshot before running."""
    from vllm.v1.worker import gpu_model_runner as gmr

    R = gmr.GPUModelRunner
    if not getattr(R.execute_model, "_dflash_lab_snapshot", False):
        orig = R.execute_model

        def execute_model(self, *args, **kwargs):
            if not _STATE.get("written"):
                write_once(self, folder)
            return orig(self, *args, **kwargs)

        execute_model._dflash_lab_snapshot = True
        R.execute_model = execute_model
    return f"schedule snapshot active, writing to {folder}"


def _files(engine_base: str) -> list[str]:
    """The snapshot files the runner's folder ``<engine tag>.sched/`` holds, ``engine_base`` being the path up to
    the tag (stored compressed or not)."""
    import glob

    return sorted(glob.glob(engine_base + ".sched/sched-*.jsonl*"))


def files_of_run(r, data_dir: str = "data") -> list[str]:
    """The stored snapshot files of a run line's engine, in its GPU folder (``data/gpu/<runs file stem>/``; the tag is
    its engine log's name without ``.log``)."""
    from .analysis import gpu_folder

    log = r.get("log")
    if not isinstance(log, str) or not log.endswith(".log") or not isinstance(r.get("file"), str):
        return []
    return _files(os.path.join(gpu_folder(r, data_dir), os.path.basename(log)[: -len(".log")]))


def files_of_probe(probe_path: str) -> list[str]:
    """The snapshot files of the engine a probe log belongs to (``<engine tag>.probe/`` beside ``.sched/``)."""
    probe_dir = os.path.dirname(probe_path)
    return _files(probe_dir[: -len(".probe")] if probe_dir.endswith(".probe") else probe_dir)


def read(path: str) -> list[dict]:
    """The snapshot lines of one ``sched-<pid>.jsonl`` file (compressed or not); a line that is not one is an error
    naming it."""
    from .errors import LabError
    from .runner import json_lines

    out = []
    for i, obj in json_lines(path):
        if obj.get("kind") != "sched_snapshot" or not isinstance(obj.get("groups", []), list):
            raise LabError(f"{path}:{i}: not a schedule snapshot line")
        out.append(obj)
    return out
