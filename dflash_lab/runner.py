"""The experiment runner: ``python -m dflash_lab run MATRIX.yaml --out data/runs/NAME.jsonl``.

A matrix lists engine configurations; each has runs (concurrency x rounds). Every engine
configuration runs in its own child process (:mod:`dflash_lab.worker`); its runs execute in
sequence inside it. For every run this process - and only this process - appends exactly
one JSON line to ``--out`` when the run ends, however it ends:

- ``ok``: all requests completed;
- ``crash``: the engine died or requests failed (with the CUDA error text and the last log
  lines); the runner then starts a fresh engine for the runs that remain;
- ``timeout``: the run exceeded ``run_timeout_s``; the engine is killed and restarted;
- ``startup_error``: the engine never became ready; every remaining run of that engine
  configuration gets this line.

A line is written with one ``write`` of a complete line followed by ``fsync``, so a dying
engine (or runner) can never leave a half line or take earlier lines with it. Runs the
runner did not reach before ``--deadline-s`` get no line; the summary at the end lists them.

Matrix (YAML)::

    name: repro-tp1
    models_dir: /tmp/lab-models
    defaults: {target: qwen36-35b-a3b, spec_method: dflash, num_speculative_tokens: 15, ...}
    engines:
      - id: dflash-graphs
        acceptance: 1.86            # synthetic acceptance length, a list of rates, or natural
        runs: [{concurrency: 16, max_tokens: 32, warmup: true},
               {concurrency: 16, rounds: 5}, {concurrency: 32, rounds: 5}]

A run entry's ``tag`` (a short lowercase name) goes into its runs' ids, ``ENGINE/cC/TAG-rR``: two entries of one engine
at the same concurrency (sampled and greedy runs of one engine start, say) need one, since a run id names one run (the
matrix is refused otherwise: ``--skip-done``, restarts and recorded outputs go by it).

Warm-up runs (``warmup: true`` in a run entry; id ``ENGINE/cC/wR``, measured runs ``ENGINE/cC/rR``) come
before an engine's measured entries and begin every engine start: the first, a restart after a crash
(the warm-ups that completed ok earlier in this call; one that crashed or timed out is not retried) and a
continuing call (``--skip-done`` never leaves them out). Their lines carry ``"warmup": true``; the bench
counts their outcome, not their metrics.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import admit, coredump, hang, provenance, release, splits, vllmdiff
from .errors import LabError
from .kinds import number as _number, whole as _whole
from .models import REPORT_PROMPT, describe
from .patch import FIX_PARTS

ENGINE_DEFAULTS = {
    "target": "qwen36-35b-a3b",
    "spec_method": "dflash",
    "num_speculative_tokens": 15,
    "cudagraph_mode": "FULL_AND_PIECEWISE",
    "cudagraph_capture_sizes": None,
    "enforce_eager": False,
    "drafter_enforce_eager": False,
    "async_scheduling": None,
    "prefix_caching": None,
    "tensor_parallel_size": 1,
    "moe_backend": "triton",
    "max_num_seqs": 64,
    "max_model_len": 65536,
    "max_num_batched_tokens": 32768,
    "gpu_memory_utilization": 0.9,
    "mode": "offline",
    "fix": False,
    "fix_parts": None,  # with fix: a subset of patch.FIX_PARTS (None: all of them)
    "fa_splits": None,  # "drafter:N" / "target:N": FA3's split bound for FULL graphs on one side only (splits.py)
    "hook": True,
    "hook_sync": False,
    "coredump": False,
    "control": False,  # a session's control: --skip-done leaves it out only for lines of the same GPU session
    # a name shared by engines whose runs measure something only side by side in one GPU session (a greedy pair of
    # fresh engines): the group's first engine starts only if all of the group's pending runs fit before the deadline
    # (each engine's start-up, warm-ups and every pending run at its run_estimate_s), and --skip-done leaves the
    # group's runs out only when every one of them is done. s73: a call with ~1100 s left would have started the fixed
    # engine of draft8-probe's greedy pair and cut its PIECEWISE partner, ~250 s that measured no pair.
    "together": None,
    "probe": False,
    "probe_taps": None,  # with probe: "1" attention-output taps; "sentinel" / "nan" / "zero": taps + that pre-fill
    "probe_fill_layers": None,  # with a pre-fill: only these layer numbers (probe.py DFLASH_LAB_PROBE_FILL_LAYERS)
    "probe_ledger": None,  # with probe_taps: false leaves the build ledger out (probe.py DFLASH_LAB_PROBE_LEDGER=0)
    # with probe: true replaces sampled ids >= the vocabulary size by token 0 right after sampling (probe.py
    # DFLASH_LAB_PROBE_OOR=1), "row0" / "others" in batch row 0 / the rows above it only: an intervention, recorded in
    # the run line
    "probe_oor": False,
    "sched_snapshot": False,  # the target groups' FA3 schedules when the first served step begins (schedsnap.py)
    # the engine core's scheduler counters when it schedules nothing for 10 s while requests run (schedledger.py)
    "sched_ledger": False,
    # the engine's first step admits at most this many requests, after all of the run's requests arrived (admit.py,
    # DFLASH_LAB_ADMIT=K/N): offline, one measured run per engine; None leaves admission to arrival timing
    "first_step_requests": None,
    # the upstream diff (e.g. patches/vllm-0.22.1-dflash.diff), applied as a diff to a copy of the installed vllm that
    # this engine imports instead (vllmdiff.py); the plugin then checks in every engine process that it did
    "vllm_diff": None,
    # a later vLLM release this engine runs on instead of 0.22.1 (e.g. "0.26.0"), staged on the host by
    # scripts/gpu/stage-release.sh: the engine's PYTHONPATH leads with that release's folder and keeps no other vllm,
    # the plugin checks in every engine process that the vllm it imported is that release, and the runner checks the
    # worker's own report at ready (release.py). The lines say vllm_version: what the engine imported.
    "vllm_release": None,
    "canary": False,
    # before a run that timed out is killed: the GPU's utilization, every engine process's Python stacks, and (with
    # coredump) a GPU core dump the runner asks the driver for (hang.py); recorded as the line's "hang"
    "hang_snapshot": False,
    "acceptance": "natural",
    "engine_args": {},
    "env": {},
    # seconds one run of this engine needs (a probed run at concurrency 32 takes minutes): no engine is started
    # unless its start-up estimate plus this much is left before the deadline (s20 lost 300 s to a probe run cut
    # 56 s in, a timeout line that measured nothing)
    "run_estimate_s": 0,
}
RUN_DEFAULTS = {"concurrency": 16, "rounds": 1, "max_tokens": 512, "temperature": 0.7,
                "ignore_eos": True, "stream": True, "record_outputs": False,
                # a warm-up run: before the measured runs of every engine start (restarts included), its line
                # flagged; the bench counts its outcome, not its metrics
                "warmup": False,
                # a name in the runs' ids (ENGINE/cC/TAG-rR), for two entries of one engine at one concurrency
                "tag": None}
SPEC_METHODS = ("dflash", "ngram", "mtp", "none")
OOR_PARTS = ("row0", "others")  # probe_oor values besides true: the replacement in batch row 0 / the rows above only


def oor_rows(value) -> str | None:
    """Which rows a run's ``probe_oor`` replaced: "all" (true), "row0" or "others"; None when it was off or unknown."""
    return "all" if value is True else value if value in OOR_PARTS else None
OUTCOMES = ("ok", "crash", "timeout", "startup_error")
CUDA_ERR = re.compile(r"(CUDA error:[^\n]*|cudaError\w+[^\n]*|illegal memory access[^\n]*|"
                      r"device-side assert[^\n]*|Xid[^\n]*|EngineDeadError[^\n]*|RuntimeError: cancelled)")
NVLINK_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_MODELS_DIR = "/tmp/lab-models"  # no 'dflash'/'eagle' in it: vLLM guesses draft methods from paths
COREDUMP_ROOT = "/tmp/cudacore"  # core files (~210 MB each) stay on the GPU host


@dataclass
class Run:
    id: str
    engine_id: str
    concurrency: int
    round: int
    rounds: int
    max_tokens: int
    temperature: float
    ignore_eos: bool
    stream: bool
    acceptance: object
    record_outputs: bool = False
    warmup: bool = False


def _check(cond, msg):
    if not cond:
        raise LabError(msg)


def load_matrix(path: str) -> dict:
    import yaml

    if not os.path.isfile(path):
        raise LabError(f"{path}: no such matrix file")
    try:
        m = yaml.safe_load(open(path))
    except yaml.YAMLError as e:
        raise LabError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return validate_matrix(m, path)


# the engine-side switches the runner sets from matrix keys (fix, fix_parts, hook, hook_sync, probe, probe_taps, ...):
# a matrix's env entry for one of them is refused (it would contradict the keys the line records)
KEYED_ENV = ("DFLASH_LAB_FIX", "DFLASH_LAB_FIX_PARTS", "DFLASH_LAB_HOOK", "DFLASH_LAB_HOOK_SYNC", "DFLASH_LAB_PROBE",
             "DFLASH_LAB_CANARY", "DFLASH_LAB_PROBE_TAPS", "DFLASH_LAB_PROBE_FILL_LAYERS", "DFLASH_LAB_PROBE_LEDGER",
             "DFLASH_LAB_PROBE_OOR", "DFLASH_LAB_SCHED_SNAPSHOT", "DFLASH_LAB_SCHED_LEDGER", splits.ENV, admit.ENV,
             vllmdiff.ENV, release.ENV, hang.ENV,
             "CUDA_ENABLE_USER_TRIGGERED_COREDUMP", "CUDA_COREDUMP_PIPE")
# every variable the engine-side code (plugin, hook, probe, schedsnap, splits) reads: none is inherited by an engine;
# those without a matrix key (the hook's fatal mode, the probe's reference-pass switch) reach it only as env entries
ENGINE_ENV = KEYED_ENV + ("DFLASH_LAB_HOOK_FATAL", "DFLASH_LAB_PROBE_REF")


# a matrix's top-level keys (docs/matrices.md): anything else is refused, so a misspelt limit (run_timeout: 600) is
# an error and not a silent default
MATRIX_KEYS = ("name", "models_dir", "defaults", "engines", "run_timeout_s", "startup_timeout_s", "max_restarts",
               "startup_estimate_s", "warmup_estimate_s", "prompt", "worker", "coredump_root", "coredump_wait_s")


def validate_matrix(m, where="matrix") -> dict:
    _check(isinstance(m, dict), f"{where}: the matrix must be a mapping")
    unknown = sorted(set(m) - set(MATRIX_KEYS), key=str)
    _check(not unknown, f"{where}: unknown top-level key(s) {unknown}; known: {', '.join(MATRIX_KEYS)}")
    _check(isinstance(m.get("engines"), list) and m["engines"], f"{where}: 'engines' must be a non-empty list")
    _check(isinstance(m.get("defaults", {}), dict), f"{where}: 'defaults' must be a mapping")
    for key in ("startup_estimate_s", "warmup_estimate_s"):
        v = m.get(key, 0)
        _check(_number(v) and v >= 0, f"{where}: {key} must be a number >= 0")
    for key in ("run_timeout_s", "startup_timeout_s"):
        v = m.get(key, 1)
        _check(_number(v) and v > 0, f"{where}: {key} must be a number > 0")
    v = m.get("coredump_wait_s", 0)   # 0: do not wait for a core file
    _check(_number(v) and v >= 0, f"{where}: coredump_wait_s must be a number >= 0")
    v = m.get("max_restarts", 0)
    _check(_whole(v) and v >= 0, f"{where}: max_restarts must be a whole number >= 0")
    for key in ("name", "models_dir", "prompt", "worker", "coredump_root"):
        _check(key not in m or (isinstance(m[key], str) and m[key]), f"{where}: {key} must be a non-empty string")
    defaults = dict(ENGINE_DEFAULTS)
    extra = set(m.get("defaults", {})) - set(ENGINE_DEFAULTS) - {"runs"}
    _check(not extra, f"{where}: unknown default(s): {sorted(extra)}")
    defaults.update({k: v for k, v in m.get("defaults", {}).items() if k != "runs"})
    engines, seen = [], set()
    for i, e in enumerate(m["engines"]):
        _check(isinstance(e, dict) and e.get("id"), f"{where}: engine #{i} needs an 'id'")
        _check(e["id"] not in seen, f"{where}: duplicate engine id {e['id']!r}")
        _check(re.fullmatch(r"[A-Za-z0-9_.-]+", e["id"]) is not None,
               f"{where}: engine id {e['id']!r} may hold only letters, digits, '.', '_' and '-'")
        seen.add(e["id"])
        unknown = set(e) - set(ENGINE_DEFAULTS) - {"id", "runs"}
        _check(not unknown, f"{where}: engine {e['id']}: unknown key(s) {sorted(unknown)}")
        eng = dict(defaults, **{k: v for k, v in e.items() if k != "runs"})
        describe(eng["target"])
        _check(eng["spec_method"] in SPEC_METHODS, f"{where}: engine {e['id']}: spec_method must be one of {SPEC_METHODS}")
        models_dir = str(m.get("models_dir", DEFAULT_MODELS_DIR)).lower()
        _check(eng["spec_method"] != "mtp" or not any(w in models_dir for w in ("dflash", "eagle")),
               f"{where}: engine {e['id']}: models_dir {m.get('models_dir', DEFAULT_MODELS_DIR)!r} contains "
               f"'dflash' or 'eagle', from which vLLM 0.22.1 guesses the draft method of an MTP run (its "
               f"draft path is the target's) and runs DFlash instead; choose a models_dir without those words")
        _check(eng["mode"] in ("offline", "server"), f"{where}: engine {e['id']}: mode must be offline or server")
        _check(eng["coredump"] in (True, False, coredump.KEEP_RUNNING),
               f"{where}: engine {e['id']}: coredump must be true, false or {coredump.KEEP_RUNNING!r}")
        _check(isinstance(eng["env"], dict) and all(isinstance(k, str) for k in eng["env"]),
               f"{where}: engine {e['id']}: env must be a mapping of variable names to values")
        keyed = sorted(set(eng["env"]) & set(KEYED_ENV))
        _check(not keyed, f"{where}: engine {e['id']}: env sets {keyed}, which the runner sets from matrix keys "
                          "(fix, fix_parts, hook, hook_sync, probe, canary, probe_taps, probe_fill_layers, probe_ledger, "
                          "probe_oor, sched_snapshot, sched_ledger, fa_splits, first_step_requests, vllm_diff, "
                          "vllm_release, hang_snapshot): use the key")
        # kinds: a quoted "false" is truthy and would switch the fix (or the hook, the probe...) on
        for key in ("enforce_eager", "drafter_enforce_eager", "fix", "hook", "hook_sync", "control", "probe", "canary",
                    "sched_snapshot", "sched_ledger", "hang_snapshot"):
            _check(isinstance(eng[key], bool), f"{where}: engine {e['id']}: {key} must be true or false")
        _check(eng["together"] is None or (isinstance(eng["together"], str) and eng["together"]),
               f"{where}: engine {e['id']}: together must be a group name (or left out)")
        for key in ("async_scheduling", "prefix_caching"):
            _check(eng[key] is None or isinstance(eng[key], bool),
                   f"{where}: engine {e['id']}: {key} must be true or false (or left out: vLLM's default)")
        for key in ("num_speculative_tokens", "tensor_parallel_size", "max_num_seqs", "max_model_len",
                    "max_num_batched_tokens"):
            _check(_whole(eng[key]) and eng[key] >= 1,
                   f"{where}: engine {e['id']}: {key} must be a whole number >= 1")
        g = eng["gpu_memory_utilization"]
        _check(_number(g) and 0 < g <= 1,
               f"{where}: engine {e['id']}: gpu_memory_utilization must be a number in (0, 1]")
        for key in ("cudagraph_mode", "moe_backend"):
            _check(eng[key] is None or (isinstance(eng[key], str) and eng[key]),
                   f"{where}: engine {e['id']}: {key} must be a name (or left out)")
        cs = eng["cudagraph_capture_sizes"]
        _check(cs is None or (isinstance(cs, list) and cs and all(_whole(x) and x >= 1 for x in cs)),
               f"{where}: engine {e['id']}: cudagraph_capture_sizes must be a non-empty list of whole numbers >= 1")
        _check(isinstance(eng["engine_args"], dict),
               f"{where}: engine {e['id']}: engine_args must be a mapping of vLLM engine arguments")
        _check(eng["probe_taps"] in (None, "1", "sentinel", "nan", "zero"),
               f"{where}: engine {e['id']}: probe_taps must be '1', 'sentinel', 'nan' or 'zero' (or left out)")
        fl = eng["probe_fill_layers"]
        _check(fl is None or (isinstance(fl, list) and fl and all(_whole(x) and x >= 0 for x in fl)),
               f"{where}: engine {e['id']}: probe_fill_layers must be a non-empty list of layer numbers")
        _check(fl is None or eng["probe_taps"] in ("sentinel", "nan", "zero"),
               f"{where}: engine {e['id']}: probe_fill_layers needs a pre-fill (probe_taps sentinel, nan or zero)")
        _check(eng["probe_ledger"] is None or isinstance(eng["probe_ledger"], bool),
               f"{where}: engine {e['id']}: probe_ledger must be true or false (or left out)")
        _check(eng["probe_ledger"] is None or eng["probe_taps"] is not None,
               f"{where}: engine {e['id']}: probe_ledger needs probe_taps (the ledger only runs with the taps)")
        _check(isinstance(eng["probe_oor"], bool) or eng["probe_oor"] in OOR_PARTS,
               f"{where}: engine {e['id']}: probe_oor must be true, false, 'row0' or 'others'")
        _check(not eng["probe_oor"] or eng["probe"],
               f"{where}: engine {e['id']}: probe_oor needs probe: true (the probe's sampler wrapper replaces the ids)")
        _check(eng["probe_taps"] is None or eng["probe"],
               f"{where}: engine {e['id']}: probe_taps needs probe: true (the taps are compared in its reference pass)")
        fp = eng["fix_parts"]
        _check(fp is None or (isinstance(fp, list) and fp and set(fp) <= set(FIX_PARTS)),
               f"{where}: engine {e['id']}: fix_parts must be a non-empty list of {list(FIX_PARTS)}")
        _check(fp is None or eng["fix"], f"{where}: engine {e['id']}: fix_parts needs fix: true")
        if eng["fa_splits"] is not None:
            try:
                splits.parse(eng["fa_splits"])
            except LabError as err:
                _check(False, f"{where}: engine {e['id']}: fa_splits: {err}")
        _check(_number(eng["run_estimate_s"]) and eng["run_estimate_s"] >= 0,
               f"{where}: engine {e['id']}: run_estimate_s must be a number >= 0")
        acc = eng["acceptance"]
        _check(acc == "natural" or _number(acc) or (isinstance(acc, list) and acc and all(_number(x) for x in acc)),
               f"{where}: engine {e['id']}: acceptance must be 'natural', a number or a list of rates")
        runs_spec = e.get("runs", m.get("defaults", {}).get("runs"))
        _check(isinstance(runs_spec, list) and runs_spec, f"{where}: engine {e['id']}: 'runs' must be a non-empty list")
        runs = []
        for w in runs_spec:
            _check(isinstance(w, dict), f"{where}: engine {e['id']}: each run entry must be a mapping")
            bad = set(w) - set(RUN_DEFAULTS)
            _check(not bad, f"{where}: engine {e['id']}: unknown run key(s) {sorted(bad)}")
            w = dict(RUN_DEFAULTS, **w)
            _check(_whole(w["concurrency"]) and w["concurrency"] >= 1,
                   f"{where}: engine {e['id']}: concurrency must be a positive integer")
            _check(_whole(w["rounds"]) and w["rounds"] >= 1,
                   f"{where}: engine {e['id']}: rounds must be a whole number >= 1")
            for key in ("warmup", "ignore_eos", "stream", "record_outputs"):
                _check(isinstance(w[key], bool), f"{where}: engine {e['id']}: {key} must be true or false")
            _check(_whole(w["max_tokens"]) and w["max_tokens"] >= 1,
                   f"{where}: engine {e['id']}: max_tokens must be a whole number >= 1")
            _check(_number(w["temperature"]) and w["temperature"] >= 0,
                   f"{where}: engine {e['id']}: temperature must be a number >= 0")
            # every engine start runs the warm-ups first (restarts included): a warm-up after a measured entry
            # would run there too, not where the matrix puts it
            _check(not (w["warmup"] and any(not r.warmup for r in runs)),
                   f"{where}: engine {e['id']}: a warm-up run entry (concurrency {w['concurrency']}) comes after a "
                   f"measured one; warm-up entries must come before the first measured entry")
            _check(w["tag"] is None or (isinstance(w["tag"], str) and re.fullmatch(r"[a-z][a-z0-9]{0,15}", w["tag"])),
                   f"{where}: engine {e['id']}: tag must be a short lowercase name (a letter, then letters or digits)")
            tag = f"{w['tag']}-" if w["tag"] else ""
            for r in range(w["rounds"]):
                rid = f"{e['id']}/c{w['concurrency']}/{tag}{'w' if w['warmup'] else 'r'}{r}"
                _check(all(x.id != rid for x in runs),
                       f"{where}: engine {e['id']}: two run entries give run id {rid!r} (give one of them a tag)")
                runs.append(Run(id=rid, engine_id=e["id"],
                                concurrency=w["concurrency"], round=r, rounds=w["rounds"],
                                max_tokens=w["max_tokens"], temperature=w["temperature"],
                                ignore_eos=w["ignore_eos"], stream=w["stream"], acceptance=acc,
                                record_outputs=bool(w["record_outputs"]), warmup=w["warmup"]))
        _check(any(not r.warmup for r in runs),
               f"{where}: engine {e['id']}: has warm-up runs only; it needs at least one measured run entry")
        vd = eng["vllm_diff"]
        if vd is not None:
            _check(isinstance(vd, str) and vd.endswith(".diff"),
                   f"{where}: engine {e['id']}: vllm_diff must be the path of a .diff file (or left out)")
            _check(Path(vd).is_file(), f"{where}: engine {e['id']}: vllm_diff {vd}: no such file (paths are relative "
                                       "to the checkout's root, where the runner starts)")
            # one change at a time: the plugin's fix on top of the diff would test neither
            _check(not eng["fix"], f"{where}: engine {e['id']}: vllm_diff and fix: true together; the diff is the fix")
            # the launch hook wraps the stock kernel's launch, whose arguments the diff changes
            _check(not eng["hook"], f"{where}: engine {e['id']}: vllm_diff needs hook: false (the hook records the "
                                    "stock kernel's launch arguments, which the diff changes)")
            _check("PYTHONPATH" not in eng["env"],
                   f"{where}: engine {e['id']}: vllm_diff sets PYTHONPATH itself; leave it out of env")
        vr = eng["vllm_release"]
        if vr is not None:
            try:
                release.check_version(vr)
            except LabError as err:
                raise LabError(f"{where}: engine {e['id']}: {err}") from None
            # what the lab adds to an engine reaches into 0.22.1's own modules: on another release it would test
            # neither (only the core dump and the hang snapshot, which read the process from outside, go with it)
            # (a vllm_diff is the exception: it is applied, strictly, to the release's own files, so a diff written
            # for 0.22.1 that does not fit the release ends the engine before it starts)
            tied = [k for k in ("fix", "hook", "probe", "canary", "sched_snapshot", "sched_ledger",
                                "fa_splits", "first_step_requests") if eng[k] not in (None, False)]
            _check(not tied, f"{where}: engine {e['id']}: vllm_release {vr} with {', '.join(tied)}: those instrument "
                             "vLLM 0.22.1's own modules; a release engine runs stock or with a vllm_diff made for it "
                             "(core dump and hang snapshot allowed)")
            _check("PYTHONPATH" not in eng["env"],
                   f"{where}: engine {e['id']}: vllm_release sets PYTHONPATH itself; leave it out of env")
        k = eng["first_step_requests"]
        if k is not None:
            _check(_whole(k) and k >= 1,
                   f"{where}: engine {e['id']}: first_step_requests must be a whole number >= 1 (or left out)")
            # the gate acts once per engine process, on its first N requests: one run, whose concurrency is N
            _check(len(runs) == 1 and not runs[0].warmup,
                   f"{where}: engine {e['id']}: first_step_requests needs exactly one run (one round, no warm-up): "
                   "the gate acts on the engine's first requests only")
            _check(k <= runs[0].concurrency, f"{where}: engine {e['id']}: first_step_requests ({k}) is more than the "
                                             f"run's concurrency ({runs[0].concurrency})")
            _check(eng["mode"] == "offline", f"{where}: engine {e['id']}: first_step_requests is for the offline "
                                             "runner only (the server's clients arrive on their own)")
            # each data-parallel engine core would wait for all N requests, of which it gets only its share
            _check(int(eng["engine_args"].get("data_parallel_size", 1) or 1) == 1,
                   f"{where}: engine {e['id']}: first_step_requests needs data_parallel_size 1 (one engine core)")
        engines.append({"id": e["id"], "engine": eng, "runs": runs})
    return {"name": m.get("name", Path(str(where)).stem), "models_dir": m.get("models_dir", DEFAULT_MODELS_DIR),
            "engines": engines, "run_timeout_s": float(m.get("run_timeout_s", 420)),
            "startup_timeout_s": float(m.get("startup_timeout_s", 900)),
            "max_restarts": int(m.get("max_restarts", 3)),
            "startup_estimate_s": float(m.get("startup_estimate_s", 60)), "prompt": m.get("prompt", REPORT_PROMPT),
            "warmup_estimate_s": float(m.get("warmup_estimate_s", 0)),
            "worker": m.get("worker", "dflash_lab.worker"),
            "coredump_root": m.get("coredump_root", COREDUMP_ROOT),
            "coredump_wait_s": float(m.get("coredump_wait_s", 240))}


def append_line(path: Path, obj: dict) -> None:
    line = json.dumps(obj, default=str, sort_keys=False) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _tail(path: Path, n=40) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return lines[-n:]


DEADLINE_CUT = "runner deadline reached during the run"


def is_deadline_cut(r) -> bool:
    """A run stopped by the runner's session deadline (not by the engine): it measured nothing."""
    return r.get("outcome") == "timeout" and DEADLINE_CUT in str(r.get("error") or "")


def first_request_error(summary) -> str | None:
    """'requests failed: <kind> (HTTP <status>): <text>' from a server run's failure summary."""
    first = (summary or {}).get("first_error") or {}
    if not first:
        return None
    kind, e = next(iter(first.items()))
    status = f" (HTTP {e['status']})" if e.get("status") is not None else ""
    text = f": {str(e.get('error'))[:300]}" if e.get("error") else ""
    return f"requests failed: {summary.get('failed')} x, first {kind}{status}{text}"


def crash_signature(log_lines: list[str]) -> str | None:
    for line in log_lines:  # a canary names the first wrong value: it outranks what followed it
        m = re.search(r"CanaryError: [^\n]*", line)
        if m:
            return m.group(0).strip()[:500]
    for line in log_lines:
        m = CUDA_ERR.search(line)
        if m and ("CUDA" in m.group(0) or "illegal" in m.group(0) or "cudaError" in m.group(0)):
            return m.group(0).strip()
    for line in reversed(log_lines):
        m = CUDA_ERR.search(line)
        if m:
            return m.group(0).strip()
    return None


def last_error_line(log_lines: list[str]) -> str | None:
    for line in reversed(log_lines):
        if re.search(r"\b\w*(Error|Exception)\b:", line):
            return line.strip()[:500]
    return None


class Runner:
    def __init__(self, matrix: dict, out: str, deadline_s: float | None = None, command=None, log=print,
                 logdir: str | None = None):
        self.m = matrix
        self.out = Path(out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.logdir = Path(logdir) if logdir else Path(str(self.out) + ".logs")
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.deadline = time.time() + deadline_s if deadline_s else None
        self.prov = provenance.collect(command)
        self.log = log
        self.not_run: list[str] = []
        self.outcomes: dict[str, str] = {}  # run id -> outcome of its latest line in this call
        self.written = 0
        self.startup_s: dict[str, float] = {}
        self.overlays: dict[str, dict] = {}   # vllm_diff path -> its overlay's stamp (built once per call)
        # core dumps of this invocation go to a folder of their own: a later call of the same matrix on the same
        # host reuses engine tags (stock-c24-c28.a1, ...), and s19's second call read the first call's cores as its own
        self.core_root = Path(matrix.get("coredump_root", COREDUMP_ROOT)) / matrix["name"] / (
            time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{os.getpid()}")

    def time_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.time()

    def line(self, eng: dict, run: Run, outcome: str, attempt: int, **fields) -> dict:
        e = eng["engine"]
        tgt = describe(e["target"])
        obj = {
            "run_id": run.id, "matrix": self.m["name"], "engine_id": eng["id"], "attempt": attempt,
            "target": {"name": tgt["name"], "architecture": tgt["architecture"]},
            "weights": "dummy",
            "draft": (tgt["draft_assumption"] if e["spec_method"] == "dflash" else None),
            "spec_method": e["spec_method"],
            "num_speculative_tokens": e["num_speculative_tokens"] if e["spec_method"] != "none" else 0,
            "cudagraph_mode": None if e["enforce_eager"] else e["cudagraph_mode"],
            "enforce_eager": e["enforce_eager"], "drafter_enforce_eager": e["drafter_enforce_eager"],
            "async_scheduling": e["async_scheduling"], "prefix_caching": e["prefix_caching"],
            "tensor_parallel_size": e["tensor_parallel_size"], "moe_backend": e["moe_backend"],
            "max_num_seqs": e["max_num_seqs"], "max_model_len": e["max_model_len"],
            "max_num_batched_tokens": e["max_num_batched_tokens"], "mode": e["mode"], "fix": e["fix"],
            "fix_parts": ([p for p in FIX_PARTS if p in (e["fix_parts"] or FIX_PARTS)] if e["fix"] else None),
            "fa_splits": e["fa_splits"], "engine_args": e["engine_args"], "cudagraph_capture_sizes": e["cudagraph_capture_sizes"],
            "probe": e["probe"], "probe_taps": e["probe_taps"], "probe_fill_layers": e["probe_fill_layers"],
            # the ledger runs with the taps unless turned off: the line says which it was
            "probe_ledger": (e["probe_ledger"] is not False) if e["probe_taps"] else None,
            "probe_oor": e["probe_oor"],
            "sched_snapshot": e["sched_snapshot"], "sched_ledger": e["sched_ledger"],
            "first_step_requests": e["first_step_requests"],
            "hang_snapshot": e["hang_snapshot"],
            "vllm_diff": e["vllm_diff"], "vllm_release": e["vllm_release"],
            "canary": e["canary"], "coredump": e["coredump"], "env": e["env"],
            "concurrency": run.concurrency, "max_tokens": run.max_tokens, "temperature": run.temperature,
            "ignore_eos": run.ignore_eos, "acceptance": run.acceptance, "round": run.round,
            "rounds": run.rounds, "warmup": run.warmup, "outcome": outcome, "error": None, "requests_completed": 0,
            "engine_steps": None, "spec_decode_metrics": None, "wall_s": None,
        }
        obj.update(fields)
        obj.update({k: self.prov.get(k) for k in ("gpu", "gpu_count", "driver", "vllm_version", "torch_version",
                                                  "triton_version", "started_at", "command", "git_commit",
                                                  "gpu_session", "host_boot_id")})
        if e["vllm_release"]:
            # the engine ran the release (the plugin checked it in every engine process, the runner the worker's own
            # import at ready); the runner itself ran on 0.22.1. An engine that never became ready ran no vllm to name.
            obj["runner_vllm_version"] = obj["vllm_version"]
            obj["vllm_version"] = obj.get("engine_vllm_version")
        obj["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        assert outcome in OUTCOMES
        append_line(self.out, obj)
        self.written += 1
        self.outcomes[run.id] = outcome
        self.log(f"[{time.strftime('%H:%M:%S')}] {run.id}: {outcome}"
                 + (f" ({obj['error']})" if obj.get("error") else "")
                 + (f" {obj.get('output_tok_s')} tok/s" if obj.get("output_tok_s") else ""))
        return obj

    def skip_done(self, files) -> int:
        """Leave out the runs that earlier calls of the same matrix already measured (lines in ``files``
        with an outcome other than a deadline cut): a matrix larger than one device command continues in
        the next one. Returns how many runs were left out. An engine marked ``control: true`` (e.g. the stock
        control that must crash in the same GPU session as the variants) is left out only for lines of this
        GPU session: continuing the matrix in a new session runs its control again. Warm-up runs are never left
        out (every engine start begins with them); an engine whose measured runs are all done is left out,
        warm-ups included."""
        done, done_here = set(), set()
        session = self.prov.get("gpu_session")
        for f in files:
            for r in read_lines(f):
                if r.get("matrix") not in (None, self.m["name"]):
                    raise LabError(f"{f}: line {r.get('run_id')} is from matrix {r.get('matrix')!r}, not {self.m['name']!r}")
                if r.get("outcome") in ("ok", "crash", "timeout") and not is_deadline_cut(r):
                    done.add(r["run_id"])
                    if r.get("gpu_session") == session:
                        done_here.add(r["run_id"])
        # a group (together) is left out whole or not at all: its runs measure only side by side in one session
        skips = {eng["id"]: done_here if eng["engine"]["control"] else done for eng in self.m["engines"]}
        groups: dict[str, bool] = {}
        for eng in self.m["engines"]:
            g = eng["engine"]["together"]
            if g:
                groups[g] = groups.get(g, True) and all(r.warmup or r.id in skips[eng["id"]] for r in eng["runs"])
        n = 0
        for eng in self.m["engines"]:
            skip = set() if groups.get(eng["engine"]["together"]) is False else skips[eng["id"]]
            keep = [r for r in eng["runs"] if r.warmup or r.id not in skip]
            n += len(eng["runs"]) - len(keep)
            eng["runs"] = keep
        self.m["engines"] = [e for e in self.m["engines"] if any(not r.warmup for r in e["runs"])]
        if n:
            self.log(f"{n} run(s) already measured in {', '.join(map(str, files))}: left out")
        return n

    def run(self) -> int:
        started, refused = set(), set()   # groups (together) begun in this call, and groups that did not fit
        for i, eng in enumerate(self.m["engines"]):
            g = eng["engine"]["together"]
            if g and g not in started:
                need = sum(self._engine_need(e) for e in self.m["engines"][i:] if e["engine"]["together"] == g)
                if g in refused or self.time_left() < need:
                    if g not in refused:
                        self.log(f"group {g!r}: its runs need ~{need:.0f} s, {max(self.time_left(), 0):.0f} s left "
                                 "before the deadline: none of its engines is started")
                    refused.add(g)
                    self._not_reached(eng["runs"])
                    continue
                started.add(g)
            self.run_engine(eng)
        if self.not_run:
            self.log(f"not run before the deadline: {len(self.not_run)} run(s): {', '.join(self.not_run)}")
        self.log(f"{self.written} line(s) written to {self.out}")
        return 0

    def _not_reached(self, runs) -> None:
        """List ``runs`` as not run, save those that already have a line in this call (warm-ups an engine restart
        would have run again)."""
        self.not_run += [r.id for r in runs if r.id not in self.outcomes]

    def _engine_need(self, eng: dict, n_warm: int | None = None, n_runs: int | None = None) -> float:
        """Seconds an engine start needs for ``n_warm`` warm-ups and ``n_runs`` measured runs (by default all of the
        engine's own): its start-up (as measured in this call, else the matrix's estimate), the warm-ups and runs at
        their estimates, and a 30 s margin."""
        if n_warm is None:
            n_warm = sum(r.warmup for r in eng["runs"])
        if n_runs is None:
            n_runs = sum(not r.warmup for r in eng["runs"])
        return (self.startup_s.get(eng["id"], self.m["startup_estimate_s"]) + 30
                + n_warm * self.m["warmup_estimate_s"] + n_runs * eng["engine"]["run_estimate_s"])

    def run_engine(self, eng: dict) -> None:
        warmups = [r for r in eng["runs"] if r.warmup]
        pending = list(eng["runs"])  # the runs without a line yet, in the matrix's order
        attempt = 0
        while pending:
            # every engine start begins with the warm-ups: a restart runs again those that completed ok in this call
            # (one that crashed or timed out keeps its line and is not retried: stock FULL's c32 warm-up would crash
            # every restart); the warm-ups still pending follow them, in the matrix's order
            ids = {r.id for r in pending}
            again = [w for w in warmups if w.id not in ids and self.outcomes.get(w.id) == "ok"]
            # an engine starts only if its start, its warm-ups and one measured run fit what is left of the call
            # (s28: an eager engine started with ~220 s left, spent them on its start and sweep, and measured one run)
            if self.time_left() < self._engine_need(eng, len(again) + sum(r.warmup for r in pending), 1):
                self._not_reached(pending)
                return
            if attempt > self.m["max_restarts"]:
                self.log(f"{eng['id']}: {attempt} engine starts used up; {len(pending)} run(s) not run")
                self._not_reached(pending)
                return
            attempt += 1
            pending = self.one_engine(eng, again + pending, attempt)

    def one_engine(self, eng: dict, pending: list, attempt: int) -> list:
        e = eng["engine"]
        tag = f"{eng['id']}.a{attempt}"
        log_path = self.logdir / f"{tag}.log"
        hook_dir = str(self.logdir / f"{tag}.hook") if e["hook"] and e["spec_method"] == "dflash" else None
        spec = {"engine": e, "models_dir": self.m["models_dir"], "prompt": self.m["prompt"],
                "hook_dir": hook_dir, "outputs_dir": str(self.logdir / f"{tag}.outputs"),
                "runs": [r.__dict__ for r in pending]}
        fd, spec_path = tempfile.mkstemp(prefix=f"{tag}.", suffix=".json", dir=self.logdir)
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f)
        events_path = self.logdir / f"{tag}.events.jsonl"
        events_path.write_text("")
        # no engine-side switch is inherited from the runner's own environment: each engine gets what its matrix
        # keys (KEYED_ENV) and its env entries (the others of ENGINE_ENV, recorded in its line) say, nothing else
        env = {k: v for k, v in os.environ.items() if k not in ENGINE_ENV}
        env.update(PYTHONUNBUFFERED="1", **NVLINK_OFF, **{k: str(v) for k, v in e["env"].items()})
        core_dir = None
        if e["coredump"]:
            core_dir = self.core_root / tag
            core_dir.mkdir(parents=True, exist_ok=True)
            env.update(coredump.env(core_dir, keep_running=e["coredump"] == coredump.KEEP_RUNNING))
        if e["probe"]:
            env["DFLASH_LAB_PROBE"] = str(self.logdir / f"{tag}.probe")
            if e["probe_taps"]:
                env["DFLASH_LAB_PROBE_TAPS"] = e["probe_taps"]
            if e["probe_fill_layers"]:
                env["DFLASH_LAB_PROBE_FILL_LAYERS"] = ",".join(str(x) for x in e["probe_fill_layers"])
            if e["probe_ledger"] is not None:
                env["DFLASH_LAB_PROBE_LEDGER"] = "1" if e["probe_ledger"] else "0"
            if e["probe_oor"]:
                env["DFLASH_LAB_PROBE_OOR"] = "1" if e["probe_oor"] is True else e["probe_oor"]
        if e["sched_snapshot"]:
            env["DFLASH_LAB_SCHED_SNAPSHOT"] = str(self.logdir / f"{tag}.sched")
        if e["sched_ledger"]:
            env["DFLASH_LAB_SCHED_LEDGER"] = str(self.logdir / f"{tag}.ledger")
        stacks_dir = None
        if e["hang_snapshot"]:
            stacks_dir = self.logdir / f"{tag}.stacks"
            env.update(hang.env(stacks_dir, core_dir))
        if e["first_step_requests"]:
            # validate_matrix allows it only on an engine with one measured run: N is that run's concurrency
            env[admit.ENV] = f"{e['first_step_requests']}/{eng['runs'][0].concurrency}"
        rsite = release.site(e["vllm_release"]) if e["vllm_release"] else None
        if rsite is not None and not (rsite / "vllm" / "__init__.py").is_file():
            err = (f"vllm_release {e['vllm_release']}: not staged at {rsite} (scripts/gpu/stage-release.sh, then "
                   "scripts/gpu/setup-release.sh on the host)")
            self.log(f"{tag}: {err}")
            for r in pending:
                self.line(eng, r, "startup_error", attempt, error=err)
            return []
        diff_stamp = None
        if e["vllm_diff"]:
            # on a release engine the diff applies to that release's package (it must fit it exactly), else to the
            # vllm this interpreter would import (0.22.1)
            okey = (e["vllm_diff"], str(rsite) if rsite else None)
            try:
                ov = self.overlays.get(okey)
                ov = {**ov, "reused": True} if ov else vllmdiff.overlay(
                    e["vllm_diff"], package=(rsite / "vllm") if rsite else None)
            except LabError as err:
                # the diff does not apply (or no vllm to apply it to): every run of this engine says so, none runs
                self.log(f"{tag}: vllm_diff: {err}")
                for r in pending:
                    self.line(eng, r, "startup_error", attempt, error=f"vllm_diff: {err}")
                return []
            self.overlays[okey] = ov
            diff_stamp = {k: ov.get(k) for k in ("diff_sha256", "hunks_sha256", "files", "path", "source",
                                                 "installed_record_sha256")}
        if rsite is not None:
            # the release's folder first; no entry of the runner's that holds another vllm
            env["PYTHONPATH"] = release.pythonpath(rsite, env.get("PYTHONPATH"))
            env[release.ENV] = f"{e['vllm_release']}={rsite}"
            self.log(f"{tag}: vllm_release {e['vllm_release']} from {rsite}")
        if diff_stamp:
            # the overlay ahead of everything (on a release engine, ahead of the release it was made from)
            env["PYTHONPATH"] = os.pathsep.join(x for x in (ov["path"], env.get("PYTHONPATH")) if x)
            env[vllmdiff.ENV] = ov["path"]
            self.log(f"{tag}: vllm_diff {e['vllm_diff']} ({'reused' if ov['reused'] else 'built'} overlay {ov['path']}"
                     + (f" of {ov['source']}" if rsite is not None else "")
                     + (f"; {ov.get('linked')} files linked, {ov.get('copied')} copied" if not ov["reused"] else "") + ")")
        if e["canary"]:
            env["DFLASH_LAB_CANARY"] = "1"
        if e["fix"]:
            env["DFLASH_LAB_FIX"] = "1"
            if e["fix_parts"]:
                env["DFLASH_LAB_FIX_PARTS"] = ",".join(e["fix_parts"])
        if e["fa_splits"]:
            env[splits.ENV] = e["fa_splits"]
        if hook_dir:
            env["DFLASH_LAB_HOOK"] = hook_dir
            if e["hook_sync"]:
                env["DFLASH_LAB_HOOK_SYNC"] = "1"
        cmd = [sys.executable, "-m", self.m["worker"], spec_path, str(events_path)]
        n_warm = sum(r.warmup for r in pending)
        self.log(f"[{time.strftime('%H:%M:%S')}] {tag}: starting engine ({len(pending)} run(s) to go"
                 + (f", {n_warm} of them warm-ups)" if n_warm else ")"))
        t0 = time.time()
        with open(log_path, "w") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        reader = _EventReader(events_path)
        extra = {"log": str(log_path), "hook_dir": hook_dir}
        if diff_stamp:
            extra["vllm_diff_stamp"] = diff_stamp
        if e["probe"]:
            extra["probe_dir"] = env["DFLASH_LAB_PROBE"]

        def fault():
            """The core dump's reading, once the crashed engine has written it (coredump engines only)."""
            if core_dir is None:
                return {}
            wait = max(0.0, min(self.m["coredump_wait_s"], self.time_left() - 30))
            f = coredump.collect(core_dir, proc.pid, self.logdir / f"{tag}.coredump.log", wait_s=wait,
                                 engine_log=log_path, since=t0, deadline=self.deadline)
            self.log(f"{tag}: fault {f.get('kernel')} ({f.get('exception')}, {f.get('source')})"
                     + (f" in {f['process']}" if f.get("process") else "")
                     + (f"; {len(f['cores'])} cores: " + ", ".join(f"{c.get('process') or c.get('pid')}: {c.get('kernel')}"
                                                                  for c in f["cores"]) if f.get("cores") else "")
                     + (f" [{f['error']}]" if f.get("error") else ""))
            return {"fault": f}

        def snapshot():
            """What the engine was doing when its run timed out or was cut at the deadline (hang_snapshot engines),
            before it is killed: the core dump only while enough time is left before the deadline (hang.snapshot; a
            dump takes ~25-150 s)."""
            try:
                h = hang.snapshot(stacks_dir, core_dir, proc.pid, self.logdir / f"{tag}.hang.log", engine_log=log_path,
                                  core_wait_s=self.m["coredump_wait_s"],
                                  deadline=self.deadline)
            except Exception as err:   # the run's timeout line and the kill come first; the snapshot is extra
                h = {"error": f"{type(err).__name__}: {err}"}
            self.log(f"{tag}: hang snapshot: {hang.describe(h)}")
            return h

        def crash_line(run, since: float, fallback) -> None:
            """The crash line of a run whose engine died: after its core dump (if any) is read, and the engine is gone.
            What the worker measured of the run before it ended (a server's clients: statuses, error bodies, the
            requests that completed) is kept: the core can appear before the worker's run_end, which s19's server
            crash lines lost that way."""
            wall = round(time.time() - since, 3)
            found = fault()
            kill()  # engine children that outlived the worker, or an engine hung after its dump
            # wall_s: the worker's own measure when it sent one (as on the ok path: a server's clients timed the run),
            # else the runner's, from the run's start to the crash being seen; the runner's is kept beside it
            fields = {"wall_s": wall, "runner_wall_s": wall}
            ev = reader.next()
            while ev is not None:
                if ev["event"] == "run_end" and ev.get("run") == run.id:
                    fields.update(run_end_fields(ev))
                elif ev["event"] == "error":
                    extra["error_event"] = ev["error"]
                ev = reader.next()
            tail = _tail(log_path)
            err = crash_signature(tail) or extra.get("error_event") or fallback(tail)
            self.line(eng, run, "crash", attempt, **{**fields, **extra, **found, "error": err, "log_tail": tail})

        def kill():
            """SIGKILL to the engine's whole process group (the worker is its leader; a server it started
            and the engine-core processes belong to it), also when the worker itself has already exited."""
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()

        # ---- start-up
        ready = None
        while ready is None:
            ev = reader.next()
            while ev is not None and ready is None:
                if ev["event"] == "ready":
                    ready = ev
                elif ev["event"] == "error":
                    extra["error_event"] = ev["error"]
                ev = reader.next() if ready is None else None
            if ready is not None:
                break
            if self.time_left() < 0 and proc.poll() is None:
                kill()
                self.log(f"{tag}: runner deadline reached {time.time() - t0:.0f} s into start-up; "
                         f"{len(pending)} run(s) not run")
                self._not_reached(pending)
                return []
            if proc.poll() is not None or time.time() - t0 > self.m["startup_timeout_s"]:
                why = ("exited with code %s" % proc.returncode) if proc.poll() is not None else "start-up timed out"
                kill()
                tail = _tail(log_path)
                err = extra.get("error_event") or crash_signature(tail) or last_error_line(tail) or "no error text"
                for r in pending:
                    self.line(eng, r, "startup_error", attempt, error=f"engine {why}: {err}", log_tail=tail, **extra)
                return []
            time.sleep(1)
        self.startup_s[eng["id"]] = ready.get("startup_s") or (time.time() - t0)
        extra["startup_s"] = ready.get("startup_s")
        extra["engine_vllm_version"] = ready.get("vllm_version")   # as the worker imported it
        if e["vllm_release"] and extra["engine_vllm_version"] != e["vllm_release"]:
            # the plugin's check did not stop it (not loaded?): nothing this engine runs would be of the release
            err = (f"vllm_release {e['vllm_release']}: the engine's worker imported vllm "
                   f"{extra['engine_vllm_version']!r}; its runs are not run")
            self.log(f"{tag}: {err}")
            kill()
            for r in pending:
                self.line(eng, r, "startup_error", attempt, error=err, **extra)
            return []
        # ---- runs
        remaining = list(pending)
        while remaining:
            run = remaining[0]
            started = None
            t_run = time.time()
            while True:
                done = None
                ev = reader.next()
                while ev is not None and done is None:
                    if ev["event"] == "run_start" and ev["run"] == run.id:
                        started = ev
                    elif ev["event"] == "run_end" and ev["run"] == run.id:
                        done = ev
                    elif ev["event"] == "error":
                        extra["error_event"] = ev["error"]
                    ev = reader.next() if done is None else None
                if done is not None:
                    fields = run_end_fields(done)
                    # the run's own span on the worker's clock (epoch s): gpuclocks takes each run's samples from it
                    fields.update(run_start_t=started.get("t") if started else None, run_end_t=done.get("t"))
                    if done["outcome"] != "ok":
                        time.sleep(3)
                        fields.update(fault())
                        tail = _tail(log_path)
                        fields["error"] = (crash_signature(tail) or extra.get("error_event")
                                           or first_request_error(fields.get("request_errors")) or "requests failed")
                        fields["log_tail"] = tail
                    self.line(eng, run, done["outcome"], attempt, **extra, **fields)
                    remaining.pop(0)
                    if done["outcome"] != "ok":
                        kill()
                        return remaining
                    break
                if proc.poll() is not None:
                    time.sleep(0.5)   # the worker's last events (crash_line reads them)
                    crash_line(run, started["t"] if started else t_run,
                               lambda tail: last_error_line(tail) or f"engine exited with code {proc.returncode}")
                    remaining.pop(0)
                    return remaining
                if core_dir is not None and coredump.cores(core_dir, t0) and self.time_left() > 0:
                    # the driver is writing a core dump: the engine crashed; wait for the dump
                    crash_line(run, started["t"] if started else t_run, lambda tail: "CUDA exception (core dump written)")
                    remaining.pop(0)
                    return remaining
                if time.time() - t_run > self.m["run_timeout_s"] or self.time_left() < 0:
                    # judged before the snapshot, whose dump may take the time left: a run that timed out stays one.
                    # A run cut at the deadline gets the snapshot too (a cold host's first run is cut before its
                    # timeout): GPU samples and stacks, a few seconds; hang.snapshot asks for no dump past the deadline
                    wall_run, cut = round(time.time() - t_run, 3), self.time_left() < 0
                    extra_hang = {"hang": snapshot()} if e["hang_snapshot"] else {}
                    kill()
                    tail = _tail(log_path)
                    self.line(eng, run, "timeout", attempt,
                              error=f"run exceeded {self.m['run_timeout_s']:.0f} s" if not cut else DEADLINE_CUT,
                              log_tail=tail, wall_s=wall_run, **extra, **extra_hang)
                    remaining.pop(0)
                    if self.time_left() < 0:
                        self._not_reached(remaining)
                        return []
                    return remaining
                time.sleep(0.5)
        # all runs done: let the engine exit on its own, then make sure it and every process of its group
        # (a server, engine-core children) is gone before the next engine wants the GPU
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pass
        kill()
        return []


def run_end_fields(ev: dict) -> dict:
    """The measurements of a worker's run_end event (everything but the event's own bookkeeping and outcome)."""
    return {k: v for k, v in ev.items() if k not in ("event", "run", "t", "outcome")}


class _EventReader:
    """Reads the child's event file incrementally; events stay queued until taken."""

    def __init__(self, path: Path):
        self.path = path
        self.pos = 0
        self.buf = ""
        self.queue: list[dict] = []

    def _fill(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self.pos)
                data = f.read()
                self.pos = f.tell()
        except OSError:
            return
        self.buf += data
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            if line.strip():
                try:
                    self.queue.append(json.loads(line))
                except ValueError:
                    pass

    def next(self) -> dict | None:
        """The next event, or None if none has arrived yet."""
        if not self.queue:
            self._fill()
        return self.queue.pop(0) if self.queue else None


COMPRESSED = (".xz", ".gz")   # what ingest may have stored a recorded file as: the same name plus one of these


def recorded_path(path: str | os.PathLike) -> str | None:
    """A recorded file as stored: ``path`` itself, or ``path`` plus ``.xz`` / ``.gz`` when ingest kept it compressed
    (large engine and probe logs); None when none of them is a file. Read it with :func:`read_recorded`."""
    found = [p for p in (str(path),) + tuple(str(path) + c for c in COMPRESSED) if os.path.isfile(p)]
    if len(found) > 1:
        raise LabError(f"{path}: recorded twice ({', '.join(found)})")
    return found[0] if found else None


def recorded_glob(pattern: str) -> list[tuple[str, str]]:
    """``(name, stored path)`` of each recorded file matching ``pattern`` as it was written on the GPU host: a file
    matching ``pattern`` or, compressed by ingest, ``pattern`` plus ``.xz`` / ``.gz``; ``name`` is its path without the
    compression suffix. Sorted by name; a name stored twice is an error (one recording, one file)."""
    import glob as _glob

    out: dict[str, str] = {}
    for suffix in ("",) + COMPRESSED:
        for p in _glob.glob(pattern + suffix):
            name = p[: -len(suffix)] if suffix else p
            if suffix == "" and p.endswith(COMPRESSED):
                continue   # a pattern ending in * matched a compressed file: counted under its own suffix
            if name in out:
                raise LabError(f"{name}: recorded twice ({out[name]} and {p})")
            out[name] = p
    return sorted(out.items())


def read_recorded(path: str | os.PathLike, errors: str = "strict") -> str:
    """A recorded text file, ``.gz`` read as gzip and ``.xz`` as xz (ingest compresses large logs); a compressed file
    that does not decompress, or (``errors="strict"``) text that is not UTF-8, is an error naming it. A missing file
    raises ``FileNotFoundError``."""
    p = Path(path)
    if p.suffix not in (".gz", ".xz"):
        try:
            return p.read_text(errors=errors)
        except UnicodeDecodeError as e:
            raise LabError(f"{path}: not UTF-8 text ({e})") from None
    import gzip
    import lzma

    kind, unpack = ("gzip", gzip.decompress) if p.suffix == ".gz" else ("xz", lzma.decompress)
    data = p.read_bytes()
    try:
        return unpack(data).decode(errors=errors)
    except (OSError, EOFError, UnicodeDecodeError, lzma.LZMAError) as e:
        raise LabError(f"{path}: not a readable {kind} file ({e})") from None


def json_lines(path: str | os.PathLike):
    """(line number, object) of each non-blank line of a JSONL file (compressed or not: :func:`read_recorded`);
    a bad line is an error naming it."""
    if not Path(path).is_file():
        raise LabError(f"{path}: no such file")
    text = read_recorded(path)
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise LabError(f"{path}:{i}: not a JSON line ({e})") from None
        if not isinstance(obj, dict):
            raise LabError(f"{path}:{i}: not a JSON object")
        yield i, obj


def read_lines(path: str | os.PathLike) -> list[dict]:
    """Read a runs/bench JSONL file; a line that is not a run record is an error naming its line."""
    out = []
    for i, obj in json_lines(path):
        if "outcome" not in obj:
            raise LabError(f"{path}:{i}: not a run record (no 'outcome')")
        if obj["outcome"] not in OUTCOMES:
            raise LabError(f"{path}:{i}: unknown outcome {obj['outcome']!r}")
        out.append(obj)
    return out
