"""Reading recorded GPU results for the notebooks: run lines, crash signatures, engine dumps.

Everything here reads files under ``data/`` that GPU runs produced (see ``data/README.md``);
nothing is computed from assumptions. A corrupt or missing file is a LabError naming it.
"""

from __future__ import annotations

import functools
import glob
import json
import math
import numbers
import os
import re
from pathlib import Path

from .errors import LabError
from .patch import FIX_PARTS, FIX_PARTS_BEFORE_ROOT_CAUSE
from .runner import is_deadline_cut, oor_rows, read_lines, read_recorded, recorded_glob  # noqa: F401 (is_deadline_cut, recorded_glob: used by the notebooks)

SCHED_RE = re.compile(r"Dumping scheduler output for model execution: (.*)$")
STATS_RE = re.compile(r"Dumping scheduler stats: SchedulerStats\((.*)\)")


def diff_of(r) -> str | None:
    """The upstream diff a run line's engine ran as a diff (runner key ``vllm_diff``), else None (pandas: NaN)."""
    d = r.get("vllm_diff")
    return d if isinstance(d, str) and d else None


#: which fix part a file of the upstream diff carries (patches/vllm-0.22.1-dflash.diff's hunks, by the file they change)
DIFF_FILE_PARTS = {"vllm/v1/attention/backends/flash_attn.py": "fa3_schedule_refresh",
                   "vllm/v1/spec_decode/utils.py": "dflash_kernel_edits",
                   "vllm/v1/spec_decode/dflash.py": "dflash_kernel_edits",
                   "vllm/v1/core/sched/scheduler.py": "dflash_lookahead_k_plus_1"}


def as_fix(r: dict) -> dict:
    """A run line for the analysis: an engine started on vLLM with the upstream diff applied (runner key
    ``vllm_diff``; the plugin's fix off, so its line says ``fix: false``) had the fix, all three parts, as the diff's
    hunks: ``fix`` True, ``fix_parts`` all of them, and ``fix_via`` says how ("plugin" or "upstream diff"). Every
    table that separates stock from fixed runs then leaves the diff's runs out of stock. A diff made for a later
    release (a line with ``vllm_release``) is fixed too, with the parts of the files its overlay stamp names
    (:data:`DIFF_FILE_PARTS`; ``patches/vllm-0.26.0-part1.diff``: part 1 alone), ``fix_via`` naming the release."""
    r["plugin_fix"] = bool(r.get("fix"))             # what the line itself says: the plugin's fix on or off
    if diff_of(r):
        if r["plugin_fix"]:
            raise LabError(f"run {r.get('run_id')}: both the upstream diff and the plugin's fix (the runner refuses that)")
        rel = r.get("vllm_release")
        if isinstance(rel, str) and rel:
            # a diff made for a later release (patches/vllm-0.26.0-part1.diff: part 1 alone) is not 0.22.1's whole
            # diff: its parts come from what it changes, and no 0.22.1 table reads release lines
            st = r.get("vllm_diff_stamp") if isinstance(r.get("vllm_diff_stamp"), dict) else {}
            parts = sorted({DIFF_FILE_PARTS.get(f, "unknown") for f in st.get("files") or {}},
                           key=lambda p: (p not in FIX_PARTS, FIX_PARTS.index(p) if p in FIX_PARTS else 0))
            # (no stamp: "unknown", never the legacy reading of a missing fix_parts as parts 2 and 3)
            r.update(fix=True, fix_parts=parts or ["unknown"], fix_via=f"diff for {rel}")
        else:
            r.update(fix=True, fix_parts=list(FIX_PARTS), fix_via="upstream diff")
    elif r.get("fix"):
        r["fix_via"] = "plugin"
    return r


def fix_parts_of(r: dict) -> set:
    """The fix parts a run had: empty without the fix; lines written before part 1 existed (no ``fix_parts``,
    pandas: NaN) had parts 2 and 3."""
    if not r.get("fix"):
        return set()
    parts = r.get("fix_parts")
    if isinstance(parts, float) or parts is None:
        parts = FIX_PARTS_BEFORE_ROOT_CAUSE
    return set(parts)


def gpu_folder(r: dict, data_dir: str = "data") -> str:
    """The folder ``ingest`` wrote a run line's files to: ``data/gpu/<runs file stem>``."""
    return os.path.join(data_dir, "gpu", os.path.splitext(os.path.basename(str(r["file"])))[0])


def read_text(path: str) -> str:
    """A recorded text file, compressed (``.gz``, ``.xz``) or not, undecodable bytes replaced (engine logs hold
    whatever the processes printed); a corrupt compressed file is an error naming it."""
    return read_recorded(path, errors="replace")


def engine_log(r, data_dir: str = "data") -> str | None:
    """The stored engine log of a run line: ``data/gpu/<runs file stem>/<log name>`` (or its ``.xz`` / ``.gz``: ingest
    compresses large logs; read it with :func:`read_text`), else None."""
    from .runner import recorded_path

    log = r.get("log")
    if not isinstance(log, str) or not isinstance(r.get("file"), str):
        return None
    return recorded_path(os.path.join(gpu_folder(r, data_dir), os.path.basename(log)))


# a failed device-side assert as the CUDA runtime prints it to the process's stderr (one line per failing thread):
# "<kernel source>.py:53: unknown: block: [0,0,0], thread: [1,0,0] Assertion `index out of bounds: 0 <= tmp16 < 262144` failed."
ASSERT_RE = re.compile(r"([\w./-]+\.py):(\d+): \S+: block: \[(\d+),\d+,\d+\], thread: \[(\d+),\d+,\d+\] "
                       r"Assertion `([^`]*)` failed")


def device_asserts(text: str) -> list[dict]:
    """The device-side asserts an engine log printed: per (source file, line, message), how many threads and
    blocks failed it. The runtime prints them only while the process lives on after the fault (the CUDA driver's
    core dump with ``skip_abort``, matrix key ``coredump: keep-running``): a run whose process the driver ended
    prints none, whatever fired. An engine log holds one engine's runs, and a crash ends the engine, so the asserts
    of a log belong to its one crashed run (``fault_table`` reads them for crashed runs only)."""
    found: dict[tuple, dict] = {}
    for m in ASSERT_RE.finditer(text):
        src, line, block, _thread, msg = m.groups()
        key = (os.path.basename(src), int(line), msg)
        d = found.setdefault(key, {"source": f"{key[0]}:{key[1]}", "message": msg, "threads": 0, "blocks": set()})
        d["threads"] += 1
        d["blocks"].add(int(block))
    return [{**d, "blocks": len(d["blocks"])} for d in sorted(found.values(), key=lambda d: d["source"])]


def fix_label(r: dict) -> str | None:
    """Which fix a run had: None, 'fix 1' (kernel edits + lookahead), 'fix 2' (all three parts), 'part 1 only'
    (the FA3 schedule refresh alone) or another subset ('fix parts: ...')."""
    if not r.get("fix"):
        return None
    if diff_of(r):
        if isinstance(r.get("vllm_release"), str) and r.get("vllm_release"):
            return (f"diff for {r['vllm_release']} applied ({os.path.basename(diff_of(r))}: "
                    f"{', '.join(r['fix_parts'])})")
        return f"upstream diff applied ({os.path.basename(diff_of(r))})"
    parts = fix_parts_of(r)
    if parts == set(FIX_PARTS):
        return "fix 2: FA3 schedule refresh + kernel edits + k+1"
    if parts == set(FIX_PARTS_BEFORE_ROOT_CAUSE):
        return "fix 1: kernel edits + k+1 only"
    if parts == {"fa3_schedule_refresh"}:
        return "part 1 only: FA3 schedule refresh"
    return "fix parts: " + " + ".join(p for p in FIX_PARTS if p in parts)


def _flat(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            out += _flat(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={v}")
    return out


def cell_label(r: dict) -> str:
    """A short human name for a run's engine configuration."""
    if r["spec_method"] == "none":
        spec = "no speculation"
    else:
        spec = f"{r['spec_method']} k={r['num_speculative_tokens']}"
    if r["enforce_eager"]:
        graphs = "--enforce-eager"
    else:
        graphs = r["cudagraph_mode"] or "graphs"
        if r.get("drafter_enforce_eager"):
            graphs += ", drafter eager"
    extra = []
    if r.get("fix"):
        extra.append(fix_label(r))
    engine_args = r.get("engine_args")
    if isinstance(engine_args, dict):
        extra += [a.replace("attention_config.", "") for a in _flat(engine_args)]
    if isinstance(r.get("fa_splits"), str) and r.get("fa_splits"):
        side, _, n = r["fa_splits"].partition(":")
        extra.append(f"FA3 splits {n} for the {side} only")
    sizes = r.get("cudagraph_capture_sizes")
    if isinstance(sizes, (list, tuple)) and sizes:
        extra.append(f"capture sizes {min(sizes)}..{max(sizes)} ({len(sizes)})")
    if r.get("probe") is True:
        extra.append("step probe")
    taps = r.get("probe_taps")
    if isinstance(taps, str) and taps:
        # a pre-fill changes what FA3's unwritten output rows hold: a different computation, not an observer
        fill = {"sentinel": "sentinel", "nan": "NaN", "zero": "zero"}.get(taps)
        layers = r.get("probe_fill_layers")
        where = f" in layers {', '.join(map(str, layers))}" if isinstance(layers, (list, tuple)) and layers else ""
        extra.append(f"attention taps, {fill} pre-fill{where}" if fill else "attention taps")
        if r.get("probe_ledger") == True:  # noqa: E712 (a DataFrame row may hold numpy booleans or NaN)
            # the ledger copies each FA buffer after every build: other allocations around capture (s38)
            extra.append("build ledger")
    oor = oor_rows(r.get("probe_oor"))
    if oor:
        # an intervention: the run's sampled ids were changed, so its outcome is not stock's
        extra.append("out-of-vocabulary sampled ids replaced by 0"
                     + {"row0": " in batch row 0 only", "others": " in rows above 0 only"}.get(oor, ""))
    k = r.get("first_step_requests")
    if isinstance(k, (int, float)) and k == k and k >= 1:  # (NaN in a DataFrame row without the key)
        # the admission gate (admit.py): the first step admitted at most k requests, after all had arrived
        extra.append(f"first step admits at most {int(k)}")
    if r.get("canary") is True:
        extra.append("canaries raise")
    if r.get("async_scheduling") is False:
        extra.append("async_scheduling off")
    if r.get("prefix_caching") is False:
        extra.append("prefix caching off")
    extra += instruments(r)
    return f"{spec}, {graphs}" + (f" ({', '.join(extra)})" if extra else "")


def instruments(r: dict) -> list[str]:
    """What else was attached to a run's engine: the launch hook, CUDA core dumps on exception, the hang snapshot's
    stack and dump listeners, extra environment (e.g. CUDA_LAUNCH_BLOCKING=1). A run with none of these is a plain run."""
    out = []
    if isinstance(r.get("hook_dir"), str) and r.get("hook_dir"):  # (a DataFrame row holds NaN when absent)
        out.append("launch hook")
    if r.get("sched_snapshot") == True:  # noqa: E712 - one host copy of the FA3 schedules after capture
        out.append("schedule snapshot")
    if r.get("sched_ledger") == True:  # noqa: E712 - the engine core's scheduler counters on a 10 s spin
        out.append("scheduler ledger")
    if r.get("coredump") is True:
        out.append("core dump on")
    elif r.get("coredump") == "keep-running":   # the driver's skip_abort: vLLM can still dump the crashing step
        out.append("core dump on (keep running)")
    if r.get("hang_snapshot") == True:  # noqa: E712 - faulthandler on SIGUSR1 and the driver's dump listener (hang.py)
        out.append("hang snapshot")
    env = r.get("env")
    if isinstance(env, dict):
        out += [f"{k}={v}" for k, v in sorted(env.items())]
    return out


# The synthetic acceptance length of the crash configuration: every stock crash recorded here ran at it (the report's
# crash B was at 1.86 too). Runs at another acceptance are a different workload, counted apart.
CRASH_ACCEPTANCE = 1.86
#: the target (with its draft) of the crash counts: every run up to s68 (the assumed 5-layer draft); runs of another
#: target, such as ``qwen36-35b-a3b-draft8`` (the published draft's shape), are counted apart, never merged into these
CRASH_TARGET = "qwen36-35b-a3b"


def acceptance_key(value):
    """A run's recorded ``acceptance`` as a hashable key: a number (NumPy scalars included) rounded to 6 places, a
    string ("natural") as is, a list of per-position rates as a tuple of such numbers, anything else (None, NaN) as
    "unknown". Two runs are at the same acceptance when their keys are equal."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return round(float(value), 6) if math.isfinite(float(value)) else "unknown"
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        keys = tuple(acceptance_key(v) for v in value)
        return keys if keys and all(isinstance(k, float) for k in keys) else "unknown"
    return "unknown"


def acceptance_label(key) -> str:
    """'8.8', 'natural', '[0.9, 0.5]' or 'unknown': an acceptance key as the tables print it."""
    if isinstance(key, float):
        return f"{key:g}"
    if isinstance(key, tuple):
        return "[" + ", ".join(f"{k:g}" for k in key) + "]"
    return str(key)


def same_acceptance(value, acceptance) -> bool:
    """Whether a run's recorded ``acceptance`` (a number, a list of per-position rates, or "natural") is ``acceptance``;
    an unknown value (None, NaN, bool) matches nothing."""
    k = acceptance_key(value)
    return k != "unknown" and k == acceptance_key(acceptance)


def at_acceptance(df, acceptance):
    """Boolean mask (a bool Series on ``df``'s index, empty frames included) of the runs at ``acceptance``."""
    import pandas as pd

    return pd.Series([same_acceptance(x, acceptance) for x in df["acceptance"]], index=df.index, dtype=bool)


def rows_where(df, keep):
    """The rows of ``df`` for which ``keep(row)`` holds; an empty frame stays an empty frame with its columns (indexing
    with an empty list would select no columns instead)."""
    import pandas as pd

    return df[pd.Series([bool(keep(r)) for _, r in df.iterrows()], index=df.index, dtype=bool)] if len(df) else df


def stock_full(df, acceptance=CRASH_ACCEPTANCE, target=CRASH_TARGET):
    """Stock DFlash runs with the target's FULL_AND_PIECEWISE graphs (the crash configuration; drafter
    graphs on or off): no fix, no engine-argument variant, vLLM's default capture sizes, no one-sided FA3 split
    bound, no probe or raising canary, at synthetic acceptance ``acceptance`` (None: any), of ``target`` (None: any;
    the default keeps the published draft's runs out of the assumed draft's counts). Launch hook,
    core dumps and extra environment may be attached: see the ``instruments`` column."""
    ea = df["engine_args"].apply(lambda x: not x if isinstance(x, dict) else True)
    sizes = (df["cudagraph_capture_sizes"].apply(lambda x: not isinstance(x, (list, tuple)) or not x)
             if "cudagraph_capture_sizes" in df else True)   # vLLM's default capture sizes only
    splits = (df["fa_splits"].apply(lambda x: not isinstance(x, str) or not x)
              if "fa_splits" in df else True)   # no one-sided FA3 split bound (plugin)
    # a frame without the column (hand-built test lines; the runner writes it on every line) is not filtered on it
    acc = True if acceptance is None or "acceptance" not in df else at_acceptance(df, acceptance)
    # a line that names no target (hand-built test lines; the runner names it on every line) is not filtered on it
    tgt = True if target is None or "target_name" not in df else (df["target_name"] == target) | df["target_name"].isna()
    return df[(df["spec_method"] == "dflash") & (df["cudagraph_mode"] == "FULL_AND_PIECEWISE")
              & (df["enforce_eager"] != True) & (df["fix"] != True) & (df["probe"] != True)
              & (df["canary"] != True) & ea & sizes & splits & acc & tgt]


def breakdown(runs) -> str:
    """'8/8 crashed: 1 plain, 4 launch hook, ...': crashed/runs of a set of runs, by instruments."""
    parts = [f"{int(g['crashed'].sum())}/{len(g)} {'plain' if k == 'none' else 'with ' + k}"
             for k, g in runs.groupby("instruments")]
    return f"{int(runs['crashed'].sum())}/{len(runs)} crashed ({'; '.join(parts)})"


def is_canary_stop(r) -> bool:
    """A run stopped on purpose by a raising canary (it named a wrong value): not a crash of the product."""
    return str(r.get("error") or "").startswith("CanaryError")


def is_crash(r) -> bool:
    """A run line's crash as every count here takes it: outcome "crash", not a canary's stop."""
    return r.get("outcome") == "crash" and not is_canary_stop(r)


def _meta(runs_file: str) -> dict:
    """What ``ingest`` wrote next to a runs file (empty when nothing was)."""
    meta = runs_file[: -len(".jsonl")] + ".meta.json" if runs_file.endswith(".jsonl") else None
    if not meta or not os.path.exists(meta):
        return {}
    try:
        with open(meta) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        raise LabError(f"{meta}: unreadable ({e})") from None


def matrix_env(matrix_path: str | None) -> dict:
    """{engine id: extra environment} of a committed matrix (lines written before the runner
    recorded ``env`` get theirs from the matrix that produced them; the meta names it)."""
    import yaml

    if not matrix_path or not os.path.isfile(matrix_path):
        return {}
    try:
        m = yaml.safe_load(open(matrix_path)) or {}
    except yaml.YAMLError as e:
        raise LabError(f"{matrix_path}: not valid YAML ({e})") from None
    base = dict((m.get("defaults") or {}).get("env") or {})
    return {e["id"]: {**base, **(e.get("env") or {})} for e in m.get("engines", []) if isinstance(e, dict) and "id" in e}


def session_key(label: str):
    """Natural order of GPU-session labels: 2026-11-30-s9 before 2026-11-30-s10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", str(label))]


def short_session(label: str) -> str:
    """A GPU-session label as the prose names it: '2026-11-30-s22' -> 's22'."""
    return str(label).rsplit("-", 1)[-1]


def recorded_lines(pattern: str, what: str = "run"):
    """(file, line number, line) of every recorded line matching ``pattern``, each line's
    ``gpu_session`` taken from its runs file's meta when the line lacks it, and its ``env`` from
    the matrix the meta names (lines before the runner recorded it)."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise LabError(f"no {what} files match {pattern}")
    for f in files:
        meta = _meta(f)
        envs = matrix_env(meta.get("matrix"))
        for i, r in enumerate(read_lines(f), 1):
            r = dict(r)
            r["gpu_session"] = r.get("gpu_session") or meta.get("gpu_session")
            if "env" not in r and r.get("engine_id") in envs:
                r["env"] = envs[r["engine_id"]]
            yield f, i, r


def engine_positions(df):
    """Each line's place among the runs of its engine start (0: the first run after start-up, which pays
    for warm-up), from the order the runner wrote them: per (file, engine id, attempt). Matrices with a
    warm-up sweep (run entries with ``warmup: true``) start each engine with several warm-up runs; their
    lines say so themselves (``"warmup": true``), position 0 being only the first of them."""
    return df.groupby(["file", "engine_id", "attempt"], dropna=False).cumcount()


#: targets whose runs every count, table and claim of the assumed draft's configuration keeps apart: the published
#: draft's shape (8 layers; ``models.PUBLISHED_DRAFT``), judged on its own (``verification.draft8_predictions``)
APART_TARGETS = ("qwen36-35b-a3b-draft8",)


def load_runs(pattern: str = "data/runs/*.jsonl", published_draft: bool = False):
    """All run lines matching ``pattern`` as a DataFrame (one row per run), with their file. The runs of
    :data:`APART_TARGETS` only with ``published_draft``: every analysis of the runs' own configuration (the assumed
    5-layer draft) reads the default, so that a new configuration's lines never merge into its counts."""
    import pandas as pd

    rows = []
    for f, _, r in recorded_lines(pattern):
        as_fix(r)
        r["file"] = os.path.basename(f)
        r["cell"] = cell_label(r)
        r["target_name"] = r["target"]["name"] if isinstance(r.get("target"), dict) else r.get("target")
        if r["target_name"] in APART_TARGETS and not published_draft:
            continue
        rows.append(r)
    df = pd.DataFrame(rows)
    df["position"] = engine_positions(df)
    df["stopped_by_canary"] = df.apply(is_canary_stop, axis=1)
    df["crashed"] = df.apply(is_crash, axis=1).astype(bool)
    df["instruments"] = df.apply(lambda r: ", ".join(instruments(r)) or "none", axis=1)
    return df


def crash_table(df):
    """Per (target, TP, acceptance, cell, concurrency): crashed runs / runs, with files.

    A run counts once its engine started; engines that never started are counted apart
    (``startup_errors``), and so are runs the runner's session deadline cut short (``cut_by_deadline``:
    they measured nothing, so they are neither crashes nor runs that survived) and runs a raising
    canary stopped on purpose (``stopped_by_canary``)."""
    df = df.assign(_cut=[is_deadline_cut(r) for _, r in df.iterrows()],
                   _stop=[is_canary_stop(r) for _, r in df.iterrows()])
    g = df.groupby(["target_name", "tensor_parallel_size", "acceptance", "cell", "concurrency"], dropna=False)
    out = g.agg(runs=("outcome", lambda s: int(((s != "startup_error") & ~df.loc[s.index, "_cut"]
                                                & ~df.loc[s.index, "_stop"]).sum())),
                crashed=("crashed", "sum"),
                cut_by_deadline=("_cut", "sum"),
                stopped_by_canary=("_stop", "sum"),
                timeouts=("outcome", lambda s: int(((s == "timeout") & ~df.loc[s.index, "_cut"]).sum())),
                startup_errors=("outcome", lambda s: int((s == "startup_error").sum())),
                files=("file", lambda s: ", ".join(sorted(set(s))))).reset_index()
    out["crashed / runs"] = out["crashed"].astype(int).astype(str) + " / " + out["runs"].astype(str)
    return out


def assert_text(asserts: list[dict]) -> str:
    """:func:`device_asserts` as one line: "message (source, N threads)" joined by "; " ("" for none)."""
    return "; ".join(f"{a['message']} ({a['source']}, {a['threads']} threads)" for a in asserts)


def log_asserts(path: str) -> list[dict]:
    """:func:`device_asserts` of a stored engine log, read once per file version (a notebook builds the fault table
    several times; an engine log is up to a few MB)."""
    st = os.stat(path)
    return [dict(a) for a in _log_asserts(os.path.abspath(path), st.st_mtime_ns, st.st_size)]


@functools.lru_cache(maxsize=256)
def _log_asserts(path: str, _mtime_ns: int, _size: int) -> tuple:
    return tuple(device_asserts(read_text(path)))


def fault_table(df, data_dir: str = "data"):
    """Crashed runs with the kernel their CUDA core dump names (runs without a dump: 'no core dump'), and the
    device-side asserts their engine log printed (:func:`device_asserts`)."""
    import pandas as pd

    rows = []
    for _, r in df[df["crashed"]].iterrows():
        f = r.get("fault") if isinstance(r.get("fault"), dict) else None
        log = engine_log(dict(r), data_dir)
        asserts = log_asserts(log) if log else []
        rows.append({"run": r["run_id"], "path": f"{r.get('mode') or 'offline'}, TP={r.get('tensor_parallel_size') or 1}",
                     "cell": r["cell"], "concurrency": r["concurrency"],
                     "faulting kernel": (f or {}).get("kernel") or ("no core dump" if f is None else "unread"),
                     "exception": (f or {}).get("exception"), "source": (f or {}).get("source"),
                     "grid": (f or {}).get("grid"), "focus block": (f or {}).get("focus_block"),
                     # the DFlash input kernel launches one program per request of the step (grid = (batch_size,
                     # blocks), vllm/v1/spec_decode/dflash.py:124): its grid says how many were still running
                     "requests in the step": ((f or {}).get("grid") or [None])[0]
                     if (f or {}).get("kernel") == "copy_and_expand_dflash_inputs_kernel" else None,
                     # which vLLM process dumped first, and every core (tensor parallelism: one per faulting rank)
                     "process": (f or {}).get("process"),
                     "cores": ("; ".join(f"{c.get('process') or c.get('pid')}: {c.get('kernel')}" for c in f["cores"])
                               if f and f.get("cores") else (1 if f and f.get("kernel") else 0)),
                     "device asserts (engine log)": assert_text(asserts) or ("" if log else "log not stored"),
                     "error line": r["error"], "file": r["file"],
                     # a line corrected after recording (dflash_lab.amend): the rules, the replaced values in the line
                     "amended": ", ".join(a["rule"] for a in r["amended"]) if isinstance(r.get("amended"), list) else ""})
    return pd.DataFrame(rows)


GDN_KERNEL = "fused_sigmoid_gating_delta_rule_update_kernel"
DFLASH_INPUT_KERNEL = "copy_and_expand_dflash_inputs_kernel"


def core_batch_row(fault, value_heads: int | None = None) -> dict | None:
    """The batch row of the block cuda-gdb focused in a core dump, and how many batch rows the faulting launch had, for
    the two kernels whose grid maps to requests directly (vLLM 0.22.1's source):

    - the DFlash input kernel: one program per request, ``req_idx = tl.program_id(0)``
      (v1/spec_decode/utils.py:498), grid ``(batch_size, blocks)``: row = block x, rows = grid x;
    - the GDN kernel: grid ``(NK, NV, N * HV)`` with ``i_n = i_nh // HV`` (fla/ops/fused_sigmoid_gating.py:62-63,
      241): row = block z // HV, rows = grid z / HV. ``value_heads``: HV, the target's GDN value heads per rank.
      ``i_n`` counts the launch's sequences (the spec-decode sequences of a step's decode part), not batch rows in
      general: it equals the batch row when every request of the step is a spec decode, as in the probed tails here
      (no prefill in the step, N = the step's requests).

    None for any other kernel, or a fault without a grid and focus block. cuda-gdb focuses one faulting block: other
    rows may have faulted too."""
    if not isinstance(fault, dict):
        return None
    grid, block, kernel = fault.get("grid"), fault.get("focus_block"), fault.get("kernel")
    if not grid or not block or len(grid) != 3 or len(block) != 3:
        return None
    if kernel == DFLASH_INPUT_KERNEL:
        return {"row": int(block[0]), "rows": int(grid[0])}
    if kernel == GDN_KERNEL:
        if not value_heads or value_heads < 1:
            raise LabError("the GDN kernel's batch row needs the target's GDN value heads per rank")
        if int(grid[2]) % value_heads:
            raise LabError(f"a GDN core's grid z ({grid[2]}) is not a multiple of {value_heads} value heads: "
                           "not the launch this reading assumes")
        return {"row": int(block[2]) // value_heads, "rows": int(grid[2]) // value_heads}
    return None


def compiled_kernel(name: str, data_dir: str = "data/gpu") -> dict | None:
    """A compiled (inductor) kernel recorded from a carried compile cache (``data/gpu/*compile-cache*/NAME.py`` and
    the folder's meta.json): its device asserts and the vLLM compile tags whose artifacts define it ('backbone' is the
    target, 'eagle_head' the drafter: vllm/v1/spec_decode/llm_base_proposer.py sets that tag for the draft model).
    None when not recorded."""
    for src in sorted(Path(data_dir).glob(f"*compile-cache*/{name}.py")):
        meta_path = src.parent / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        text = src.read_text()
        if f"def {name}(" not in text:
            raise LabError(f"{src}: does not define {name}")
        tags = sorted({k.rsplit("/", 1)[-1] for k, v in (meta.get("artifacts_defining_it") or {}).items() if v})
        return {"source": str(src), "device_asserts": re.findall(r'device_assert\([^\n]*"([^"]+)"\)', text),
                "defined_in": tags, "cache": meta.get("cache_sha256_and_pieces")}
    return None


def kernel_shape_diff(a: str, b: str, data_dir: str = "data/gpu") -> list[tuple[str, str]] | None:
    """Two recorded compiled kernels (:func:`compiled_kernel`) compared on their function bodies (from ``def`` on,
    the kernel name aside) with every integer literal masked: None when they differ in anything but integers (another
    kernel), else the (a, b) pairs of integer literals that differ, in order: e.g. the same fused kernel compiled for
    other head counts. A kernel not recorded raises."""
    bodies = []
    for name in (a, b):
        k = compiled_kernel(name, data_dir)
        if k is None:
            raise LabError(f"compiled kernel {name} is not recorded under {data_dir}/*compile-cache*/")
        text = Path(k["source"]).read_text()
        bodies.append(text[text.index(f"def {name}("):].replace(f"def {name}(", "def KERNEL(", 1))
    num = re.compile(r"(?<![\w.])\d+(?![\w.])")
    if num.sub("N", bodies[0]) != num.sub("N", bodies[1]):
        return None
    return [(x, y) for x, y in zip(num.findall(bodies[0]), num.findall(bodies[1])) if x != y]


def crash_signatures(df) -> list[dict]:
    """Distinct crash errors with the ERROR lines of one log that shows each."""
    out = {}
    for _, r in df[df["crashed"]].iterrows():
        key = r["error"] or "unknown"
        if key in out:
            out[key]["runs"].append(r["run_id"])
            continue
        tail = r.get("log_tail") or []
        excerpt = [l for l in tail if "ERROR" in l or "Error" in l or "error" in l][:12]
        out[key] = {"error": key, "runs": [r["run_id"]], "log_excerpt": excerpt, "file": r["file"]}
    return list(out.values())


def engine_dumps(data_dir: str = "data/gpu") -> list[dict]:
    """The engine configuration the launch hook recorded inside each real engine."""
    out = []
    for f in sorted(glob.glob(os.path.join(data_dir, "*", "*.hook", "engine-*.json"))):
        try:
            d = json.load(open(f))
        except ValueError as e:
            raise LabError(f"{f}: not valid JSON ({e})") from None
        d["file"] = os.path.relpath(f, data_dir)
        d["session"] = Path(f).parts[-3]
        out.append(d)
    return out


def scheduler_dumps(log_path: str) -> list[dict]:
    """vLLM's fatal-error dump (dump_input.py) of the step that crashed, parsed from an engine log."""
    out = []
    try:
        text = read_text(log_path)
    except OSError as e:
        raise LabError(f"{log_path}: {e}") from None
    for line in text.splitlines():
        m = SCHED_RE.search(line)
        if m:
            s = m.group(1)
            d = {"raw": s}
            for key in ("num_computed_tokens", "num_output_tokens"):
                mm = re.search(key + r"=\[([0-9, ]*)\]", s)
                if mm:
                    d[key] = [int(x) for x in mm.group(1).split(",") if x.strip()]
            mm = re.search(r"total_num_scheduled_tokens=(\d+)", s)
            if mm:
                d["total_num_scheduled_tokens"] = int(mm.group(1))
            mm = re.search(r"finished_req_ids=\[([^\]]*)\]", s)
            if mm:
                d["finished_req_ids"] = [x.strip().strip("'") for x in mm.group(1).split(",") if x.strip()]
            out.append(d)
        m = STATS_RE.search(line)
        if m and out:
            s = m.group(1)
            for key in ("num_running_reqs", "num_waiting_reqs"):
                mm = re.search(key + r"=(\d+)", s)
                if mm:
                    out[-1][key] = int(mm.group(1))
            mm = re.search(r"kv_cache_usage=([0-9.]+)", s)
            if mm:
                out[-1]["kv_cache_usage"] = float(mm.group(1))
    return out


def hook_records(data_dir: str = "data/gpu", which: str = "*") -> list[str]:
    return sorted(glob.glob(os.path.join(data_dir, "*", "*.hook", f"launch-*-{which}.npz")))


def all_rejected_requests(rec) -> list[int] | None:
    """Requests of a launch whose rejected count covers all their context tokens (C2), or None
    if the record's inputs are not self-consistent (host copies taken after a CUDA fault)."""
    import numpy as np

    qsl = rec.arrays["query_start_loc_ptr"][: rec.num_reqs + 1].astype(np.int64)
    rej = rec.arrays.get("num_rejected_tokens_ptr")
    if rej is None:
        return []
    n_ctx = np.diff(qsl)
    rej = rej[: rec.num_reqs].astype(np.int64)
    if (n_ctx < 0).any() or (rej < 0).any() or (rej > n_ctx).any() or qsl[0] != 0:
        return None
    return [int(i) for i in np.nonzero(rej >= n_ctx)[0]]


def hook_summary(data_dir: str = "data/gpu") -> list[dict]:
    """Per engine: launches checked while running (stats) and the C2 launches among the recorded ones."""
    from .records import load_record

    out = []
    for hook in sorted(glob.glob(os.path.join(data_dir, "*", "*.hook"))):
        stats = [json.load(open(f)) for f in glob.glob(os.path.join(hook, "stats-*.json"))]
        stats = [s for s in stats if s.get("launches")]
        if not stats:
            continue
        s = stats[0]
        c2, bad = [], 0
        for f in sorted(glob.glob(os.path.join(hook, "launch-*-last.npz"))):
            rec = load_record(f)
            reqs = all_rejected_requests(rec)
            n = int(os.path.basename(f).split("-")[2])
            if reqs is None:
                bad += 1
            elif reqs:
                c2.append(f"{n}: {reqs}")
        out.append({"engine": os.path.basename(hook).replace(".hook", ""), "launches": s["launches"],
                    "checked while running": s["checked"],
                    **{f"{k} (running)": v for k, v in s["findings"].items()},
                    "recorded last launches with all-rejected requests (launch: requests)": "; ".join(c2) or "none",
                    "inconsistent (post-fault) copies": bad})
    return out
