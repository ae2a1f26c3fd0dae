"""The README's summary states numbers in words: stock FULL_AND_PIECEWISE's crash counts per concurrency and path,
the workaround's (PIECEWISE) and --enforce-eager's at 32, and the fixed FULL engine's speed ranges. These tests hold
them to the records in data/runs and data/bench, so a new GPU run that changes one of them fails here until the README
says it (the rendered notebooks check theirs as claims). docs/evidence.md repeats the crash counts: they are held too."""

import re
from pathlib import Path

import pytest

from dflash_lab import analysis, crashstates

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


@pytest.fixture(scope="module")
def runs():
    return analysis.load_runs()


@pytest.fixture(scope="module")
def rates(runs):
    return crashstates.path_rates(runs).set_index("path")


def _sentence(start: str) -> str:
    i = README.index(start)
    return " ".join(README[i:README.index(".", i)].split())


def _recorded(row) -> dict:
    """concurrency -> (crashed, runs) for the cells of one path that ran."""
    out = {}
    for c, v in row.items():
        if isinstance(c, int) and v != "not run":
            m = re.match(r"(\d+)/(\d+)", v)
            out[c] = (int(m.group(1)), int(m.group(2)))
    return out


def test_offline_tp1_threshold_sentence_matches_the_records(rates):
    s = _sentence("Stock FULL_AND_PIECEWISE crashed every run at")
    crashed_part, completed_part = s.split(", and completed every run at")
    said = {int(c): (int(a), int(b)) for c, a, b in re.findall(r"(\d+) \((\d+)(?: of |/)(\d+)\)", crashed_part)}
    completed = [int(c) for c in re.findall(r"\d+", completed_part.split("(")[0])]
    rec = _recorded(rates.loc["offline, TP=1"])
    assert said and all(a == b for a, b in said.values()), s
    assert {c: rec.get(c) for c in said} == said
    assert all(rec[c][0] == 0 for c in completed), {c: rec[c] for c in completed}
    # every concurrency the records hold is in the sentence, one way or the other
    assert set(said) | set(completed) == set(rec)
    # "16: N of N offline, M of M on the server": runs that completed, of those recorded
    ok_off, n_off, ok_srv, n_srv = map(int, re.search(r"16: (\d+) of (\d+) offline, (\d+) of (\d+) on the server",
                                                      completed_part).groups())
    assert ok_off == n_off and rec[16] == (0, n_off)
    assert ok_srv == n_srv and _recorded(rates.loc["server, TP=1"])[16] == (0, n_srv)


def test_workaround_and_report_path_counts_match_the_records(runs, rates):
    df = runs
    ct = analysis.crash_table(df)
    pw = ct[ct["cell"].str.contains("dflash k=15, PIECEWISE", regex=False) & (ct["concurrency"] == 32)]
    eager = df[(df["spec_method"] == "dflash") & (df["enforce_eager"] == True)]   # noqa: E712 (a column)
    off = _recorded(rates.loc["offline, TP=1"])
    server = _recorded(rates.loc["server, TP=1"])
    tp2 = _recorded(rates.loc["offline, TP=2"])
    w = _sentence("- **Workaround today")
    m = re.search(r"default FULL_AND_PIECEWISE crashed (\d+) of (\d+) offline runs and (\d+) of (\d+)\s+on the OpenAI server", w)
    assert m, w
    assert off[32] == (int(m.group(1)), int(m.group(2))) and server[32] == (int(m.group(3)), int(m.group(4)))
    m = re.search(r"(\d+) of (\d+) runs crashed at concurrency 32, where", w)
    assert m and (int(pw["crashed"].sum()), int(pw["runs"].sum())) == (int(m.group(1)), int(m.group(2))), w
    m = re.search(r"`--enforce-eager` completed (\d+) of (\d+)", README)
    assert m and set(eager["concurrency"]) == {32} and eager["crashed"].sum() == 0 and len(eager) == int(m.group(2)) \
        == int(m.group(1))
    s = _sentence("The OpenAI server with the report's client shape")
    m = re.search(r"\((\d+) of (\d+) at 32, (\d+) of (\d+) at 16; s48", s)
    assert m, s
    # s19's and s21's server runs; s48's are counted apart in the same sentence ("s48: 1 of 1 at 32, 8 and 20")
    srv = analysis.stock_full(df)
    srv = srv[(srv["mode"] == "server") & (srv["tensor_parallel_size"] == 1)]
    early, s48 = srv[~srv["gpu_session"].str.endswith("-s48")], srv[srv["gpu_session"].str.endswith("-s48")]
    count = lambda d, c: (int(d.loc[d["concurrency"] == c, "crashed"].sum()), int((d["concurrency"] == c).sum()))  # noqa: E731
    assert count(early, 32) == (int(m.group(1)), int(m.group(2))) and count(early, 16) == (int(m.group(3)), int(m.group(4)))
    assert "s48: 1 of 1 at 32, 8 and 20" in s
    assert set(s48["concurrency"]) == {32, 8, 20} and all(count(s48, c) == (1, 1) for c in (32, 8, 20))
    t = _sentence("Offline with TP=2 on two H200s")
    m = re.search(r"at 16 too \((\d+) of (\d+),.*at 32 in (\d+) of (\d+) runs", t)
    assert m, t
    assert tp2[16] == (int(m.group(1)), int(m.group(2))) and tp2[32] == (int(m.group(3)), int(m.group(4)))


def test_speed_ranges_match_the_glance_table():
    """The summary's fixed-FULL-over-no-speculation ranges are the findings page's glance table (runs that compiled a
    Triton kernel left out): each session's smallest and largest mean at concurrency 1-32 with that session named in
    the same bullet, and the range at 64 over every session."""
    from dflash_lab import bench

    t = bench.glance_table(bench.cells(bench.without_jit_runs(bench.load_bench("data/bench/*.jsonl"))))
    fixed = t[t["mode"] == "DFlash FULL (fixed)"]
    i = README.index("- **Speed**")
    bullet = " ".join(README[i:README.index("- **Open.**", i)].split())
    mean = lambda v: float(v.split("x")[0]) if isinstance(v, str) and v != "-" else None  # noqa: E731
    assert len(fixed) >= 2
    for _, r in fixed.iterrows():
        vals = [m for c in (1, 4, 8, 16, 32) if (m := mean(r[c])) is not None]
        sess = "s" + r["session"].rsplit("-s", 1)[1]
        assert f"{min(vals):.2f}-{max(vals):.2f}x" in bullet and re.search(rf"\b{sess}\b", bullet), (sess, vals)
    at64 = [m for v in fixed[64] if (m := mean(v)) is not None]
    assert f"({min(at64):.2f}-{max(at64):.2f}x)" in bullet


EVIDENCE = (Path(__file__).resolve().parents[1] / "docs" / "evidence.md").read_text()


def test_the_evidence_records_crash_counts_match_the_records_too(rates):
    """docs/evidence.md, the full prose record, repeats the summary's stock crash counts twice (its threshold paragraph
    and notebook 03's row of its table): a new run at one of those concurrencies fails here until both say it."""
    rec = _recorded(rates.loc["offline, TP=1"])
    text = " ".join(EVIDENCE.split())
    i = text.index("every stock run at 8 (")
    s = text[i:text.index(" crashed,", i)]
    said = {int(c): (int(a), int(b)) for c, a, b in re.findall(r"(\d+) \((\d+) of (\d+)\)", s)}
    assert len(said) >= 6 and all(a == b for a, b in said.values()), s
    assert {c: rec.get(c) for c in said} == said, s
    # every concurrency at which the records crashed every run is named (a new one must be said)
    assert set(said) == {c for c, (a, b) in rec.items() if a == b > 0}, s
    i = text.index("concurrency 32 crashed in ")
    row = text[i:text.index("(at 20 and 28 early", i)]
    m = re.match(r"concurrency 32 crashed in (\d+) of (\d+) stock", row)
    assert m and rec[32] == (int(m.group(1)), int(m.group(2))), row
    rest = {int(c): (int(a), int(b)) for c, a, b in re.findall(r"(?:,| and) (\d+) (\d+) of (\d+)", row)}
    assert set(rest) == set(said) - {32} and {c: rec[c] for c in rest} == rest, row


def test_the_speed_bullets_share_for_the_published_draft_is_the_models():
    """The Speed bullet's percentage for the published draft's extra layers is notebook 06's weight-floor model."""
    from dflash_lab import bench, models

    k5 = bench.weight_floor(models.QWEN36_TEXT, 16, models.TARGETS["qwen36-35b-a3b"]["draft"])
    k8 = bench.weight_floor(models.QWEN36_TEXT, 16, models.PUBLISHED_DRAFT["shape"])
    share = f"{(k8['ms'] - k5['ms']) / k5['ms']:.1%}"
    assert (f"the published draft's {models.PUBLISHED_DRAFT['shape']['layers']} layers add {share} to a concurrency-1 "
            "step's weight-traffic floor") in " ".join(README.split())
