"""What vLLM 0.22.1's synthetic acceptance does per step, from its own code (run on the CPU, verbatim).

The benchmark imposes an acceptance length L with ``rejection_sample_method="synthetic"`` and
``synthetic_acceptance_length=L``. vLLM turns L into per-position unconditional acceptance rates
(``SpeculativeConfig._acceptance_length_to_rates``, "the minimum-variance schedule": the first floor(L - 1) drafts
always accepted, the next one with probability L - 1 - floor(L - 1), the rest never), then into conditional rates for
its early-terminating rejection loop (``unconditional_to_conditional_rates``). So a step of one request yields either
floor(L) or floor(L) + 1 tokens, and an integer L yields exactly L every step: the least spread a mean of L can have.
A real drafter's acceptance varies per step and per request, so the recorded cells say nothing about how that spread
changes the speedup (it changes when requests finish, not a request's own tokens per step).

Both functions are lifted from the pinned source text (:mod:`dflash_lab.vllm_code`), not retyped here.
"""

from __future__ import annotations

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
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise LabError(f"k (drafts per step) must be a positive integer, got {k!r}")
    try:
        length = float(length)
    except (TypeError, ValueError):
        raise LabError(f"synthetic acceptance length must be a number, got {length!r}") from None
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


def schedule_table(lengths, k: int):
    """One row per synthetic acceptance: the tokens a request gains per step and their probabilities, the mean, the
    standard deviation, and the share of steps that reject every draft (1 token: the state notebook 02 shows the DFlash
    input kernel mishandles, and the step at which notebook 03's crashes fault), all from vLLM's code."""
    import pandas as pd

    rows = []
    for L in sorted({float(x) for x in lengths}):
        d = tokens_per_step(L, k)
        mean = sum(t * p for t, p in d.items())
        var = sum(p * (t - mean) ** 2 for t, p in d.items())
        rows.append({"synthetic acceptance": L, "k": k,
                     "tokens per step (probability)": ", ".join(f"{t} ({p:.2f})" for t, p in d.items()),
                     "mean": mean, "std per step": var ** 0.5, "steps rejecting every draft": d.get(1, 0.0)})
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
        d = tokens_per_step(acc, int(k))
        rows.append(dict(zip(cols, (acc, int(k), mode, len(g), sum(t * p for t, p in d.items()),
                                    g["acceptance_length"].min(), g["acceptance_length"].max()))))
    return pd.DataFrame(rows, columns=cols)
