"""Notebook 06's computations and figures: step-time models fitted on the bench cells, their fit against
the measured steps, break-even acceptance per concurrency, and the two figures.

Everything here reads bench cells (``bench.cells`` of one GPU session's slice, ``bench.one_session``)
and returns tables or matplotlib figures; the notebook only chooses parameters, prints and saves.
"""

from __future__ import annotations

from . import bench

BASE = "no speculation"


def step_fits(cells_df, mode: str) -> dict:
    """Both step models (``bench.STEP_MODELS``) fitted on all slices, for ``mode`` and no speculation:
    ``{"mode", "spec_pts", "base_pts", "fits": {model name: {"spec": model, "base": model}}}``."""
    spec_pts, base_pts = bench.step_points(cells_df, mode), bench.step_points(cells_df, BASE)
    fits = {name: {"spec": fit([(p[0], p[1]) for p in spec_pts]), "base": fit([(p[0], p[1]) for p in base_pts])}
            for name, fit in bench.STEP_MODELS.items()}
    return {"mode": mode, "spec_pts": spec_pts, "base_pts": base_pts, "fits": fits}


def fit_table(sf: dict, mode: str):
    """Every measured cell's step time beside the straight line's fitted on all slices, and their ratio
    (``fitted / measured``)."""
    import pandas as pd

    m = sf["fits"]["line"]
    rows = [{"mode": name, "acceptance": p[2], "concurrency": p[3], "tokens per step": p[0], "step ms (measured)": p[1],
             "step ms (fitted line)": bench.step_ms(fitted, p[0])}
            for name, fitted, pts in ((mode, m["spec"], sf["spec_pts"]), (BASE, m["base"], sf["base_pts"])) for p in pts]
    t = pd.DataFrame(rows, columns=["mode", "acceptance", "concurrency", "tokens per step", "step ms (measured)",
                                    "step ms (fitted line)"])
    t["fitted / measured"] = t["step ms (fitted line)"] / t["step ms (measured)"]
    return t


def worst_fit(t) -> dict | None:
    """The row of ``fit_table`` whose fitted step time misses the measured one the most (relative)."""
    if not len(t):
        return None
    r = t.loc[(t["fitted / measured"] - 1).abs().idxmax()]
    return {"miss": abs(float(r["fitted / measured"]) - 1), "mode": r["mode"], "concurrency": int(r["concurrency"])}


def break_even_tables(cells_df, mode: str, model: dict, k: int = 15):
    """(measured, per concurrency): the break-even acceptance of each measured cell
    (``bench.break_even_measured``), and per concurrency the model's beside the measured cells' mean. The model
    runs at the requests that actually ran where requests waited (``bench.running_by_concurrency``)."""
    import pandas as pd

    bem = bench.break_even_measured(cells_df, mode)
    ran = bench.running_by_concurrency(cells_df, mode, k)
    concs = sorted(cells_df["concurrency"].unique())
    be = pd.DataFrame([{"concurrency": c, "requests running": ran.get(c, c),
                        "break-even acceptance length (model)": bench.break_even_acceptance(model["spec"], model["base"], c,
                                                                                           k, ran.get(c))}
                       for c in concs])
    if len(bem):
        be = be.merge(bem.groupby("concurrency", as_index=False)["break-even acceptance length"].mean().rename(
            columns={"break-even acceptance length": "break-even acceptance length (measured cells)"}), how="left")
    else:
        be["break-even acceptance length (measured cells)"] = float("nan")
    return bem, be


def same_tokens_table(floor_df, mode: str):
    """The same target tokens per step with and without speculation (``bench.floor_table`` rows): the DFlash
    step beside the plain step of as many tokens, and their ratio; empty where no token count is shared."""
    spec = floor_df[floor_df["mode"] == mode].groupby("tokens per step").agg(
        **{"DFlash concurrency": ("concurrency", "first"), "DFlash step ms": ("step ms (measured)", "mean")})
    plain = floor_df[floor_df["mode"] == BASE].groupby("tokens per step").agg(
        **{"plain concurrency": ("concurrency", "first"), "plain step ms": ("step ms (measured)", "mean")})
    same = spec.join(plain, how="inner")
    same["DFlash / plain"] = same["DFlash step ms"] / same["plain step ms"]
    return same


def held_out_miss(misses: dict, use: str) -> float | None:
    """The ``use`` model's largest held-out miss (``bench.holdout_misses``), where no request waited if that
    was measured, else over all cells; None when the model was not checked."""
    m = misses.get(use) or {}
    worst = m.get("not queued") or m.get("all")
    return worst[0] if worst else None


def plot_speedup_heatmap(grid, mode: str):
    """``bench.speedup_grid`` as a heatmap: acceptance x concurrency, each cell's speedup written in."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(1.3 * grid.shape[1] + 2, 0.8 * grid.shape[0] + 1.6))
    vals = grid.to_numpy(dtype=float)
    im = ax.imshow(vals, cmap="RdYlGn", vmin=0, vmax=max(2.0, np.nanmax(vals)), aspect="auto")
    ax.set_xticks(range(grid.shape[1]), [str(x) for x in grid.columns])
    ax.set_yticks(range(grid.shape[0]), [str(x) for x in grid.index])
    for (i, j), v in np.ndenumerate(vals):
        ax.text(j, i, "crash / n.a." if np.isnan(v) else f"{v:.2f}x", ha="center", va="center", fontsize=8)
    ax.set(xlabel="concurrency", ylabel="synthetic acceptance length", title=f"{mode} / no speculation")
    fig.colorbar(im, ax=ax, label="speedup")
    return fig


def plot_step_model(cells_df, sf: dict, use: str, bem, held_miss=None, k: int = 15):
    """Left: step time against target tokens per step, measured cells with both fitted models, DFlash and no
    speculation in fixed colours. Right: speedup over no speculation against acceptance length per concurrency,
    one colour per concurrency: the measured cells (dots), the line through their mean break-even, and the
    ``use`` model extrapolated (dashed). ``held_miss``: the model's largest held-out miss (a fraction) or None."""
    import matplotlib.pyplot as plt
    import numpy as np

    line, joined = sf["fits"]["line"], sf["fits"]["measured steps"]
    model = sf["fits"][use]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, pts, key) in enumerate((("DFlash", sf["spec_pts"], "spec"), (BASE, sf["base_pts"], "base"))):
        if not pts:
            continue
        x = np.array([p[0] for p in pts]); y = np.array([p[1] for p in pts])
        a1.scatter(x, y, s=14, color=f"C{i}", label=f"{name} (cells)")
        xs = np.linspace(0, x.max() * 1.05, 50)
        a1.plot(xs, [bench.step_ms(line[key], v) for v in xs], lw=1, color=f"C{i}", label=f"{name}: straight line")
        a1.plot(joined[key]["tokens"], joined[key]["ms"], lw=1, ls=":", color=f"C{i}",
                label=f"{name}: joined measured step times")
    a1.set(xlabel="target tokens per step", ylabel="step time (ms)", title="step time, measured and fitted")
    a1.legend(fontsize=7)
    accs = sorted(cells_df["acceptance"].unique())
    ran = bench.running_by_concurrency(cells_df, sf["mode"], k)
    Ls = np.linspace(1, max(max(accs) * 1.2, 8.0), 60)
    for i, c in enumerate(sorted(cells_df["concurrency"].unique())):
        col = f"C{i}"
        mb = bem[(bem["concurrency"] == c)].dropna(subset=["break-even acceptance length"]) if len(bem) else bem
        if len(mb):   # from the measured cells: speedup = L / break-even (the assumption above)
            a2.plot(Ls, Ls / mb["break-even acceptance length"].mean(), color=col, lw=1.5, label=f"c={c} (measured cells)")
            a2.scatter(mb["acceptance length (measured)"], mb["speedup (measured)"], color=col, s=18, zorder=3)
        a2.plot(Ls, [bench.predict_speedup(model["spec"], model["base"], L, c, k, ran.get(c)) for L in Ls], color=col,
                lw=0.8, ls="--")
    a2.plot([], [], color="k", lw=0.8, ls="--", label=f"{bench.STEP_MODEL_NAMES[use]} (" + (
        f"missed one held-out acceptance by up to {held_miss:.0%} where no request waited)" if held_miss is not None
        else "unchecked)"))
    a2.axhline(1, color="k", lw=0.8)
    a2.set(xlabel="acceptance length", ylabel="speedup over no speculation",
           title="speedup over no speculation: measured (dots), extrapolated")
    a2.legend(fontsize=6)
    fig.tight_layout()
    return fig
