"""What vLLM 0.22.1's synthetic acceptance does per step, from its own code (run on the CPU, verbatim).

The benchmark imposes an acceptance length L with ``rejection_sample_method="synthetic"`` and
``synthetic_acceptance_length=L``. vLLM turns L into per-position unconditional acceptance rates
(``SpeculativeConfig._acceptance_length_to_rates``, "the minimum-variance schedule": the first floor(L - 1) drafts
always accepted, the next one with probability L - 1 - floor(L - 1), the rest never), then into conditional rates for
its early-terminating rejection loop (``unconditional_to_conditional_rates``). So a step of one request yields either
floor(L) or floor(L) + 1 tokens, and an integer L yields exactly L every step: the least spread a mean of L can have.
A real drafter's acceptance varies per step and per request, so the recorded cells say nothing about what that
spread (at the same mean) does to the speedup.

The two conversions are lifted from the pinned source text (:mod:`dflash_lab.vllm_code`), not retyped here; the
early-exit loop that turns conditional rates into tokens per step (:func:`tokens_per_step`) is modelled on the
rejection kernel's synthetic branch (``vllm/v1/sample/rejection_sampler.py``: a draft is accepted when a uniform
draw is below its position's conditional rate, whatever the token; the first rejection ends the request's step).
The engines' own logs give the other half of the check: vLLM prints the per-position acceptance rate it counted
(:func:`logged_rates`), which :func:`logs_against_schedule` compares with the schedule.
"""

from __future__ import annotations

import numbers
import re

from .errors import LabError
from .vllm_code import load_function

SPEC_CONFIG = "vllm/config/speculative.py"
SPEC_UTILS = "vllm/v1/spec_decode/utils.py"
_FN: dict = {}


def _vllm(name: str):
    if name not in _FN:
        if name == "rates":
            fn = load_function(SPEC_CONFIG, "_acceptance_length_to_rates", cls="SpeculativeConfig")
            _FN[name] = fn.__func__ if isinstance(fn, staticmethod) else fn
        else:
            _FN[name] = load_function(SPEC_UTILS, "unconditional_to_conditional_rates")
    return _FN[name]


def rates(length: float, k: int) -> list[float]:
    """vLLM's unconditional per-position acceptance rates for a synthetic acceptance ``length`` and ``k`` drafts.
    vLLM accepts lengths in [1, k + 1] (``_resolve_synthetic_acceptance_rates``); anything else is a LabError."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise LabError(f"k (drafts per step) must be a positive integer, got {k!r}")
    k = int(k)
    if isinstance(length, bool) or not isinstance(length, numbers.Real):
        raise LabError(f"synthetic acceptance length must be a number, got {length!r}")
    length = float(length)
    if not 1.0 <= length <= k + 1:
        raise LabError(f"synthetic acceptance length must be in [1, {k + 1}] for k={k} (vLLM's own check), got {length}")
    return list(_vllm("rates")(length, k))


def tokens_per_step(length: float, k: int) -> dict[int, float]:
    """{tokens one request gains in one step: probability} under vLLM's synthetic sampler: the accepted drafts plus
    the one token the target adds (the correction, or the bonus token when all k are accepted)."""
    cond = _vllm("conditional")(rates(length, k))
    out: dict[int, float] = {}
    reach = 1.0  # probability that the loop reaches position i (every earlier draft accepted)
    for i, c in enumerate(cond):
        if reach * (1.0 - c) > 0:
            out[i + 1] = out.get(i + 1, 0.0) + reach * (1.0 - c)
        reach *= c
        if reach == 0:
            break
    if reach > 0:
        out[k + 1] = out.get(k + 1, 0.0) + reach
    return dict(sorted(out.items()))


def _moments(d: dict[int, float]) -> tuple[float, float]:
    """Mean and standard deviation of a {tokens per step: probability} distribution."""
    mean = sum(t * p for t, p in d.items())
    return mean, sum(p * (t - mean) ** 2 for t, p in d.items()) ** 0.5


def schedule_table(lengths, k: int):
    """One row per synthetic acceptance: the tokens a request gains per step and their probabilities, the mean, the
    standard deviation, and the share of steps that reject every draft (1 token: the precondition of the crash states
    of notebooks 02 and 03, a row with no valid token), all from vLLM's code."""
    import pandas as pd

    rows = []
    for L in sorted({float(x) for x in lengths}):
        d = tokens_per_step(L, k)
        mean, sd = _moments(d)
        rows.append({"synthetic acceptance": L, "k": k,
                     "tokens per step (probability)": ", ".join(f"{t} ({p:.2f})" for t, p in d.items()),
                     "mean": mean, "std per step": sd, "steps rejecting every draft": d.get(1, 0.0)})
    return pd.DataFrame(rows)


def measured_against_schedule(runs_df):
    """Per synthetic acceptance, k (each run's own) and mode: the schedule's mean beside the measured runs' acceptance lengths (vLLM's
    own spec-decode counters, completed measured runs only, warm-ups aside), their lowest and highest, and how many
    runs. A mean outside the runs' range, or a spread where the schedule has none, would say the counters or the
    sampler are not what this module reads."""
    import pandas as pd

    r = runs_df[(runs_df["outcome"] == "ok") & ~runs_df["warmup"].fillna(False).astype(bool)
                & runs_df["acceptance_length"].notna()]
    cols = ["synthetic acceptance", "k", "mode", "runs", "schedule mean", "measured lowest", "measured highest"]
    rows = []
    for (acc, k, mode), g in r.groupby(["acceptance", "num_speculative_tokens", "mode"]):
        rows.append(dict(zip(cols, (acc, int(k), mode, len(g), _moments(tokens_per_step(acc, int(k)))[0],
                                    g["acceptance_length"].min(), g["acceptance_length"].max()))))
    return pd.DataFrame(rows, columns=cols)


_LOGGED = re.compile(r"Per-position acceptance rate: ([0-9., ]+?), Avg Draft acceptance rate")


def logged_rates(log_path: str) -> list[list[float]]:
    """The per-position acceptance rates vLLM's SpecDecoding stats lines printed in one engine log, one list per
    line (each line covers the interval since the previous one). A log that cannot be read is a LabError."""
    from .runner import read_recorded

    try:
        text = read_recorded(log_path, errors="replace")   # large logs are stored .xz by ingest
    except OSError as e:
        raise LabError(f"{log_path}: cannot read the engine log ({e.strerror})") from None
    return [[float(x) for x in m.group(1).split(",")] for m in map(_LOGGED.search, text.splitlines()) if m]


def logs_against_schedule(runs_df):
    """Per DFlash engine log kept with the bench lines: the schedule's unconditional rate per position against the
    rates vLLM counted and printed. ``exact positions``: those the schedule accepts always or never, and whether every
    stats line printed them as 1.000 and 0.000; ``fractional position``: the one with a rate in between (none at an
    integer length), with the range the lines printed. Lines cover warm-ups too; the schedule holds for every step."""
    import pandas as pd

    cols = ["gpu_session", "mode", "synthetic acceptance", "k", "engine log", "stats lines", "exact positions",
            "exact in every line", "fractional position", "schedule rate", "logged range"]
    spec = runs_df[(runs_df["mode"] != "no speculation")].dropna(subset=["engine_log"])
    rows = []
    for log, g in spec.groupby("engine_log", sort=True):
        first = g.iloc[0]
        k, acc = int(first["num_speculative_tokens"]), float(first["acceptance"])
        want = rates(acc, k)
        lines = logged_rates(log)
        bad = [ln for ln in lines if len(ln) != k]
        if bad:
            raise LabError(f"{log}: a stats line prints {len(bad[0])} positions, the runs say k={k}")
        exact = [i for i, r in enumerate(want) if r in (0.0, 1.0)]
        frac = [i for i in range(k) if i not in exact]
        ok = all(ln[i] == want[i] for ln in lines for i in exact)
        got = [ln[frac[0]] for ln in lines] if frac else []
        rows.append(dict(zip(cols, (
            first["gpu_session"], first["mode"], acc, k, "/".join(str(log).split("/")[-2:]), len(lines),
            f"{len(exact)} of {k}", ok if lines else None, frac[0] + 1 if frac else None,
            round(want[frac[0]], 3) if frac else None,
            (f"{min(got):.3f}-{max(got):.3f}" if got else ("no stats line" if not lines else None))))))
    out = pd.DataFrame(rows, columns=cols)
    out["fractional position"] = out["fractional position"].astype("Int64")
    return out


def counted_against_schedule(runs_df, outcomes=("crash",)):
    """vLLM's spec-decode counters over each run with one of ``outcomes`` (crashed runs by default) against the
    schedule. vLLM counts a step's accepted drafts as the request's valid output tokens minus one, over the rows that
    came back with any token (``scheduler.py``: ``num_accepted = len(generated_token_ids) - 1``, skipped when the
    row is empty), and the synthetic sampler accepts a draft whatever its token. So a counted acceptance below the
    schedule's is rows that lost valid tokens after sampling (vLLM drops placeholder ids and ids at or above the
    vocabulary size), not rejections; ``standard errors`` puts the gap in units of the schedule's own spread over that many drafts.
    Takes the bench frame (``acceptance_length``, ``num_drafts``) or ``analysis.load_runs``' (``spec_decode_metrics``);
    runs whose counters were not read (an offline engine that died) are left out."""
    import pandas as pd

    cols = ["gpu_session", "run_id", "path", "concurrency", "warm-up", "synthetic acceptance", "k", "drafts counted",
            "schedule mean", "counted mean", "standard errors", "below the schedule"]
    rows = []
    for _, r in runs_df[runs_df["outcome"].isin(outcomes)].iterrows():
        sd = r.get("spec_decode_metrics")
        L, n = ((sd.get("acceptance_length"), sd.get("num_drafts")) if isinstance(sd, dict)
                else (r.get("acceptance_length"), r.get("num_drafts")))
        k, acc = r.get("num_speculative_tokens"), r.get("acceptance")
        if not all(isinstance(x, numbers.Real) and x == x for x in (L, n, k, acc)) or not n or not k:
            continue   # counters not read, or no synthetic schedule to compare with
        mean, sd_step = _moments(tokens_per_step(acc, int(k)))
        se = sd_step / float(n) ** 0.5
        z = (float(L) - mean) / se if se else None
        rows.append(dict(zip(cols, (r.get("gpu_session"), r["run_id"], r.get("mode"), int(r["concurrency"]),
                                    bool(r.get("warmup")) if r.get("warmup") == r.get("warmup") else False,
                                    float(acc), int(k), int(n), round(mean, 3), round(float(L), 3),
                                    round(z, 1) if z is not None else None, below(z, float(L), mean)))))
    return pd.DataFrame(rows, columns=cols)


# a counted mean this many of the schedule's standard errors below it is a loss, not sampling noise: above the widest
# gap of the control (the fixed FULL, PIECEWISE and eager runs at 1.86 and 3.6: 152 runs within 3.1 when it was set in
# s30; notebook 03 prints the control as it stands)
BELOW_SE = 4.0


def below(z, counted: float, schedule: float) -> bool:
    """Whether a run's counted acceptance lies below the schedule: by more than :data:`BELOW_SE` of its standard
    errors ``z`` where the schedule has a spread, and by anything at all at an integer acceptance, where it has none
    (every step gains exactly L tokens, so a counted 5.989 at 6.0 is lost tokens)."""
    if z is not None and z == z:
        return bool(z < -BELOW_SE)
    return bool(counted < schedule - 1e-9)


def lossy_counts(concurrency: int, lossy: int, length: float, max_tokens: int, lost: int = 1) -> dict:
    """What vLLM's counters read for one run at an integer synthetic acceptance ``length`` if ``lossy`` of the
    ``concurrency`` requests lose ``lost`` of their tokens in every step and the others none: each request's first
    token comes from its prefill, every later step gains ``length`` tokens (``length - lost`` for a lossy one) until
    ``max_tokens``, and vLLM counts a step's valid tokens minus one over every step (:func:`counted_against_schedule`).
    Lossy requests take more steps, so they weigh more than ``lossy / concurrency``. Returns the drafts counted
    (request-steps) and the counted mean acceptance length."""
    import math

    if length != int(length) or not 0 <= lossy <= concurrency or not 0 <= lost < length or max_tokens < 2:
        raise LabError(f"lossy_counts needs an integer acceptance, 0 <= lossy <= concurrency and lost < length; got "
                       f"length={length}, lossy={lossy}, concurrency={concurrency}, lost={lost}, max_tokens={max_tokens}")
    length = int(length)
    steps = {t: math.ceil((max_tokens - 1) / t) for t in (length, length - lost)}
    drafts = (concurrency - lossy) * steps[length] + lossy * steps[length - lost]
    accepted = (concurrency - lossy) * steps[length] * (length - 1) + lossy * steps[length - lost] * (length - lost - 1)
    return {"drafts counted": drafts, "counted mean": 1 + accepted / drafts}


def counters_by_cell(runs_df, outcomes=("ok",)):
    """:func:`counted_against_schedule` per GPU session, mode, acceptance and concurrency (warm-ups aside): how many
    runs counted below the schedule (:func:`below`; ``runs below``, and ``below the schedule`` as "k of n"), the counted means' range, the tokens a request-step lost on
    average (schedule mean minus the runs' mean counted acceptance: vLLM counts valid tokens, so a shortfall is tokens
    dropped after the sampler accepted them; at a non-integer acceptance it carries the schedule's sampling noise and
    can be negative) and the standard errors' range (none at an integer acceptance)."""
    import pandas as pd

    cols = ["gpu_session", "path", "synthetic acceptance", "concurrency", "runs", "runs below", "below the schedule",
            "counted mean", "schedule mean", "tokens lost per request-step", "standard errors"]
    t = counted_against_schedule(runs_df, outcomes)
    t = t[~t["warm-up"].astype(bool)]
    if t.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    for (sess, path, acc, c), g in t.groupby(["gpu_session", "path", "synthetic acceptance", "concurrency"], sort=True,
                                             dropna=False):
        lo, hi = g["counted mean"].min(), g["counted mean"].max()
        z = g["standard errors"].dropna()
        n_below = int(g["below the schedule"].sum())
        rows.append(dict(zip(cols, (sess, path, acc, int(c), len(g), n_below, f"{n_below} of {len(g)}",
                                    f"{lo:.3f}" if lo == hi else f"{lo:.3f}-{hi:.3f}", g["schedule mean"].iloc[0],
                                    round(g["schedule mean"].iloc[0] - g["counted mean"].mean(), 3),
                                    (f"{z.min():+.1f} to {z.max():+.1f}" if len(z) else "none (integer)")))))
    return pd.DataFrame(rows, columns=cols)


def plot_counted_gap(runs_df, modes=None):
    """vLLM's counted acceptance minus the schedule's mean, one point per DFlash run (completed measured runs filled,
    32-token warm-ups hollow, crashed runs an x), one panel per synthetic acceptance, x the concurrency (each mode
    nudged sideways so the points do not hide each other). The shaded band is :data:`BELOW_SE` of the schedule's
    standard errors for a run of the median size at that acceptance (none at an integer acceptance, where the schedule
    has no spread). Raises ``LabError`` when no run has counters to compare."""
    import math

    import matplotlib.pyplot as plt
    import pandas as pd

    from .nbutil import legend_all

    t = pd.concat([counted_against_schedule(runs_df, ("ok",)).assign(crashed=False),
                   counted_against_schedule(runs_df, ("crash",)).assign(crashed=True)], ignore_index=True)
    if t.empty:
        raise LabError("no DFlash run with vLLM's acceptance counters and a synthetic acceptance to plot")
    t = t.assign(gap=t["counted mean"] - t["schedule mean"])
    order = [m for m in (modes or sorted(set(t["path"]))) if m in set(t["path"])]
    accs = sorted(t["synthetic acceptance"].unique())
    fig, axes = plt.subplots(1, len(accs), figsize=(5.2 * len(accs), 4), squeeze=False, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, acc in zip(axes[0], accs):
        a = t[t["synthetic acceptance"] == acc]
        k = int(a["k"].iloc[0])
        _, sd = _moments(tokens_per_step(float(acc), k))
        if sd > 0:
            band = BELOW_SE * sd / math.sqrt(float(a["drafts counted"].median()))
            ax.axhspan(-band, band, color="0.85", zorder=0, label=f"+-{BELOW_SE:g} standard errors (median run)")
        ax.axhline(0, color="0.4", lw=0.8)
        for i, m in enumerate(order):
            g = a[a["path"] == m]
            nudge = 2 ** ((i - (len(order) - 1) / 2) * 0.06)
            col = colors[i % len(colors)]
            for kind, sel, style in (("measured", ~g["warm-up"] & ~g["crashed"], dict(marker="o", color=col)),
                                     ("warm-up", g["warm-up"] & ~g["crashed"], dict(marker="o", mfc="none", color=col)),
                                     ("crashed", g["crashed"], dict(marker="x", color=col, mew=2))):
                pts = g[sel]
                if len(pts):
                    ax.plot(pts["concurrency"] * nudge, pts["gap"], ls="none", ms=5,
                            label=m if kind == "measured" else None, **style)
        concs = sorted(a["concurrency"].unique())
        ax.set(xscale="log", xlabel="concurrency", title=f"synthetic acceptance {acc:g}")
        ax.set_xticks(concs, labels=[str(x) for x in concs])
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("counted - schedule (tokens per request-step)")
    legend_all(axes[0], fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def stock_prediction(runs_df, planned, k: int = 15):
    """The prediction the schedule makes for stock FULL, written down before the runs that test it: per acceptance at
    which stock FULL is planned or recorded, the share of steps that reject every draft (the precondition of the crash
    states, notebook 05), what that predicts, and what the recorded stock runs did (crashed / runs that finished or
    crashed, warm-ups included, deadline cuts left out). The prediction is about crashes only: the last column says
    how many completed stock runs (warm-ups included) vLLM's counters put below the schedule (:func:`below`), i.e.
    lost tokens without crashing. ``planned``: :func:`dflash_lab.bench.planned_cells`."""
    import pandas as pd

    from .crashstates import BENCH_STOCK

    stock = runs_df[(runs_df["mode"] == BENCH_STOCK) & runs_df["outcome"].isin(["ok", "crash"])]
    counted = counted_against_schedule(stock, outcomes=("ok",))   # warm-ups included, as in the crash count
    accs = sorted(set(planned.loc[planned["mode"] == BENCH_STOCK, "acceptance"]) | set(stock["acceptance"]))
    concs = lambda d: ", ".join(str(int(c)) for c in sorted(set(d["concurrency"])))
    rows = []
    for acc in accs:
        share = tokens_per_step(acc, k).get(1, 0.0)
        g = stock[stock["acceptance"] == acc]
        crashed = g[g["crashed"].astype(bool)]
        done = counted[counted["synthetic acceptance"] == acc]
        low = done[done["below the schedule"]]
        rows.append({"synthetic acceptance": acc, "steps rejecting every draft": round(share, 3),
                     "prediction": "no crash (no step rejects every draft)" if share == 0
                     else "crash possible (the precondition occurs)",
                     "stock runs": f"{len(crashed)}/{len(g)} crashed" if len(g) else "not run yet",
                     "crashed at": concs(crashed) or "-",
                     "prediction holds": (None if not len(g) else (len(crashed) == 0) if share == 0 else None),
                     "completed runs counting below the schedule": (
                         f"{len(low)} of {len(done)}" + (f" (at {concs(low)})" if len(low) else "")) if len(done) else "-"})
    return pd.DataFrame(rows)
