"""GPU clocks, power and temperature during each run, from the samples ``scripts/gpu/gpu-clocks.sh`` takes through
a device call (``gpu_clocks.csv``, kept by ``ingest`` beside the call's logs in ``data/gpu/<name>/``).

Why: the same mode at the same cell ran at 0.73-1.11x of itself between GPU sessions (notebook 05), as large as
the effects measured, and nothing else a session records can tell a slower host from a slower engine. A run's
window is the worker's own ``run_start_t`` to ``run_end_t`` (epoch seconds, in lines from the sampler's commit on);
for a line without them, ``finished_at - wall_s`` to ``finished_at`` + 1 s (``finished_at`` has 1 s resolution and
is written after the run, so that window is looser). Only the GPUs the engine used count: indices 0 to
``tensor_parallel_size`` - 1 (CUDA's default order matches nvidia-smi's on a host of identical GPUs). Sessions
before this sampler have no file: their runs get no row.
"""

from __future__ import annotations

import datetime as _dt
import math
import os

from .errors import LabError

# nvidia-smi's clock-event reason bits (nvmlClocksEventReasons); "gpu idle" is left out of a run's summary
REASONS = {0x1: "gpu idle", 0x2: "applications clocks setting", 0x4: "sw power cap", 0x8: "hw slowdown",
           0x10: "sync boost", 0x20: "sw thermal slowdown", 0x40: "hw thermal slowdown",
           0x80: "hw power brake slowdown", 0x100: "display clock setting"}
FILE = "gpu_clocks.csv"
SUMMARY = ("clock_samples", "sm_mhz_mean", "sm_mhz_min", "mem_mhz_mean", "power_w_mean", "temp_c_max", "clock_reasons")


def _num(x: str) -> float:
    x = x.strip()
    return float("nan") if x.startswith("[") or x in ("", "N/A") else float(x)


def read(path: str):
    """The samples of one ``gpu_clocks.csv`` as a DataFrame (t: UTC epoch seconds, gpu, sm_mhz, mem_mhz, power_w,
    temp_c, reasons: int bitmask or None). A value nvidia-smi could not read ("[N/A]") is NaN. nvidia-smi prints some
    failures on stdout (the sampler keeps them): such lines are skipped and counted in ``.attrs["skipped"]``; a file
    with no sample at all among its lines is a LabError naming file and first bad line."""
    import pandas as pd

    rows, skipped, first_bad = [], 0, None
    try:
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if not line.strip() or line.startswith("#"):
                    continue
                parts = [p.strip() for p in line.split(",")]
                try:
                    if len(parts) != 7:
                        raise ValueError(f"{len(parts)} fields, expected 7")
                    reasons = None if parts[6].startswith("[") else int(parts[6], 16)
                    rows.append((float(parts[0]), int(parts[1]), *(_num(p) for p in parts[2:6]), reasons))
                except ValueError as e:
                    skipped += 1
                    first_bad = first_bad or f"{path}:{i}: not a GPU clock sample ({e}): {line.strip()[:80]!r}"
    except OSError as e:
        raise LabError(f"{path}: cannot read GPU clock samples ({e.strerror})") from None
    if skipped and not rows:
        raise LabError(first_bad)
    df = pd.DataFrame(rows, columns=["t", "gpu", "sm_mhz", "mem_mhz", "power_w", "temp_c", "reasons"])
    df.attrs["skipped"] = skipped
    return df


def reason_names(mask: int) -> list[str]:
    """The named reason bits of ``mask`` ("gpu idle" left out), unknown bits as hex."""
    names = [n for b, n in REASONS.items() if mask & b and b != 0x1]
    rest = mask & ~sum(REASONS)
    return names + ([hex(rest)] if rest else [])


def summary(samples, start: float, end: float, gpus=None) -> dict | None:
    """The samples with ``start <= t <= end`` of the GPUs ``gpus`` (all when None): mean and lowest SM clock, mean
    memory clock, mean power, hottest temperature, and every reason bit seen; None when no sample falls there."""
    s = samples[(samples["t"] >= start) & (samples["t"] <= end)]
    if gpus is not None:
        s = s[s["gpu"].isin(list(gpus))]
    if s.empty:
        return None
    mask = 0
    for r in s["reasons"].dropna():
        mask |= int(r)
    mean = lambda col: float(s[col].mean()) if s[col].notna().any() else None
    return {"clock_samples": int(len(s)), "sm_mhz_mean": mean("sm_mhz"),
            "sm_mhz_min": float(s["sm_mhz"].min()) if s["sm_mhz"].notna().any() else None,
            "mem_mhz_mean": mean("mem_mhz"), "power_w_mean": mean("power_w"),
            "temp_c_max": float(s["temp_c"].max()) if s["temp_c"].notna().any() else None,
            "clock_reasons": ", ".join(reason_names(mask)) or "none"}


def window(r) -> tuple[float, float] | None:
    """A run line's (start, end) in UTC epoch seconds: the worker's ``run_start_t``/``run_end_t`` where the line has
    them, else from ``finished_at`` and ``wall_s`` (see the module's docstring); None without either."""
    a, b = r.get("run_start_t"), r.get("run_end_t")
    if a is not None and b is not None and a == a and b == b:
        return float(a), float(b)
    fin, wall = r.get("finished_at"), r.get("wall_s")
    if not fin or wall is None or (isinstance(wall, float) and math.isnan(wall)):
        return None
    try:
        end = _dt.datetime.strptime(str(fin), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.timezone.utc).timestamp()
    except ValueError:
        return None
    return end - float(wall), end + 1.0


def for_runs(runs_df, data_dir: str = "data"):
    """:func:`summary` of every run of ``runs_df`` (lines with ``file``, ``finished_at``, ``wall_s``) whose call
    recorded ``gpu_clocks.csv``, one row per run (indexed like ``runs_df``; columns :data:`SUMMARY`); runs without
    samples are left out (an empty frame when no call recorded any)."""
    import pandas as pd

    from . import analysis

    out, cache = {}, {}
    for idx, r in runs_df.iterrows():
        path = os.path.join(analysis.gpu_folder(r, data_dir), FILE)
        if path not in cache:
            cache[path] = read(path) if os.path.isfile(path) else None
        w = window(r)
        if cache[path] is None or w is None:
            continue
        tp = r.get("tensor_parallel_size")
        s = summary(cache[path], *w, gpus=range(int(tp)) if tp == tp and tp else None)
        if s:
            out[idx] = s
    return pd.DataFrame.from_dict(out, orient="index", columns=list(SUMMARY))


def by_session(runs_df, data_dir: str = "data"):
    """Per (GPU session, mode): the measured runs' clocks (:func:`for_runs`), summed up: runs with samples, mean SM
    clock (mean of the runs' means), the lowest SM clock seen, mean power, the hottest temperature and every reason
    seen. Empty when no session recorded samples."""
    import pandas as pd

    measured = runs_df[(runs_df["outcome"] == "ok") & ~runs_df["warmup"].astype(bool)]
    c = for_runs(measured, data_dir)
    if c.empty:
        return pd.DataFrame(columns=["gpu_session", "mode", "runs with samples", "sm_mhz_mean", "sm_mhz_min",
                                     "power_w_mean", "temp_c_max", "clock_reasons"])
    j = measured.loc[c.index, ["gpu_session", "mode"]].join(c)
    rows = []
    for (s, m), g in j.groupby(["gpu_session", "mode"], sort=True):
        reasons = sorted({x for v in g["clock_reasons"] for x in v.split(", ") if x and x != "none"})
        rows.append({"gpu_session": s, "mode": m, "runs with samples": len(g), "sm_mhz_mean": g["sm_mhz_mean"].mean(),
                     "sm_mhz_min": g["sm_mhz_min"].min(), "power_w_mean": g["power_w_mean"].mean(),
                     "temp_c_max": g["temp_c_max"].max(), "clock_reasons": ", ".join(reasons) or "none"})
    return pd.DataFrame(rows)
