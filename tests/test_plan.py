"""A bench matrix's device time estimated from recorded bench lines (dflash_lab.plan)."""

import json

import pytest
import yaml

from conftest import run_cli
from dflash_lab import bench, plan
from dflash_lab.errors import LabError


def _line(engine, mode, conc, wall, acc, L=None, startup=100.0, warmup=False, outcome="ok", tokens=512, attempt=1):
    spec, cg, fix, eager = {"fixed": ("dflash", "FULL_AND_PIECEWISE", True, False),
                            "stock": ("dflash", "FULL_AND_PIECEWISE", False, False),
                            "nospec": ("none", "FULL_AND_PIECEWISE", False, False)}[mode]
    return {"run_id": f"{engine}/c{conc}/{'w' if warmup else 'r'}0", "mode": "server", "spec_method": spec,
            "num_speculative_tokens": 15, "cudagraph_mode": cg, "enforce_eager": eager, "fix": fix,
            "fix_parts": ["fa3_schedule_refresh", "dflash_kernel_edits", "dflash_lookahead_k_plus_1"] if fix else None,
            "concurrency": conc, "acceptance": acc, "outcome": outcome, "gpu_session": "S", "engine_id": engine,
            "attempt": attempt, "round": 0, "warmup": warmup, "max_tokens": tokens, "wall_s": wall,
            "startup_s": startup, "serve_metrics": {"output_throughput": 1.0} if outcome == "ok" else None,
            "spec_decode_metrics": {"acceptance_length": L} if spec != "none" and outcome == "ok" else None}


def _matrix(tmp_path, engines):
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump({"name": "m", "warmup_estimate_s": 6, "coredump_wait_s": 150,
                                 "defaults": {"target": "qwen36-35b-a3b", "mode": "server", "acceptance": 3.6},
                                 "engines": engines}))
    return str(p)


def _runs(tmp_path, lines):
    d = tmp_path / "bench"
    d.mkdir(exist_ok=True)
    (d / "b.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    return bench.load_bench(str(d / "*.jsonl"))


def test_runs_are_taken_at_their_acceptance_scaled_from_another_or_named_when_nothing_recorded(tmp_path):
    lines = [_line("f", "fixed", 1, 2.0, 3.6, L=3.6, startup=400), _line("f", "fixed", 4, 4.0, 1.86, L=1.8, startup=400),
             _line("f", "fixed", 1, 0.5, 3.6, L=3.6, startup=130, warmup=True, tokens=32, attempt=2),
             _line("n", "nospec", 8, 5.0, 1.86, startup=220)]
    m = _matrix(tmp_path, [
        {"id": "full-fixed", "fix": True, "runs": [{"concurrency": 1, "max_tokens": 32, "warmup": True},
                                                   {"concurrency": 8, "max_tokens": 32, "warmup": True},
                                                   {"concurrency": 1, "rounds": 2}, {"concurrency": 4},
                                                   {"concurrency": 16}]},
        {"id": "nospec", "spec_method": "none", "runs": [{"concurrency": 8, "rounds": 3}]}])
    est = plan.estimate(m, _runs(tmp_path, lines), budget_s=1000, staging_s=90)
    f, n = est["engines"]
    assert f["mode"] == "DFlash FULL (fixed)" and f["start-up s (recorded)"] == "130-400"
    assert f["warm-ups s"] == round(0.5 + 6)                   # recorded at 1, the matrix's estimate at 8
    assert f["runs s"] == round(2 * 2.0 + 4.0 * 1.8 / 3.6)    # c1 at 3.6 as recorded; c4 scaled from 1.86 by L
    assert f["runs scaled from another acceptance"] == 1 and f["runs with no record"] == 1
    assert n["runs s"] == 15 and n["runs scaled from another acceptance"] == 0   # no draft: the acceptance is a label
    assert est["unknown"] == ["full-fixed/c16/r0"]
    assert est["total_cold_s"] == pytest.approx(90 + 6.5 + 6.0 + 15 + 400 + 220)   # exact seconds, not the rows' rounded
    assert est["total_warm_s"] == pytest.approx(90 + 6.5 + 6.0 + 15 + 130 + 220)
    assert n["start-up s (recorded)"] == "220"
    assert est["fits_cold"] and est["fits_warm"]
    line = plan.summary_line(est, "m.yaml")
    assert "fits cold" in line and "1 run(s) with no record to estimate from: full-fixed/c16/r0" in line


def test_a_probed_engines_runs_are_named_not_estimated_from_plain_runs(tmp_path):
    """Bench lines are never probed; a probed run replays every FULL step without graphs and takes several times a
    plain run's time, so the plain runs recorded at its cell do not estimate it."""
    lines = [_line("f", "fixed", 32, 10.0, 3.6, L=3.6, startup=100)]
    m = _matrix(tmp_path, [{"id": "probed", "fix": True, "probe": True, "runs": [{"concurrency": 32}]},
                           {"id": "plain", "fix": True, "runs": [{"concurrency": 32}]}])
    est = plan.estimate(m, _runs(tmp_path, lines), budget_s=1000, staging_s=0)
    probed, plain = est["engines"]
    assert probed["runs s"] == 0 and probed["runs with no record"] == 1 and plain["runs s"] == 10
    assert est["unknown"] == ["probed/c32/r0"] and "1 run(s) with no record" in plan.summary_line(est, m)


def test_a_crash_prone_mode_adds_restarts_and_a_mode_never_started_is_one_clear_error(tmp_path):
    lines = [_line("s", "stock", 8, 3.0, 1.86, L=1.8, startup=80), _line("s", "stock", 8, 1.0, 1.86, outcome="crash", startup=200)]
    m = _matrix(tmp_path, [{"id": "full-stock", "coredump": "keep-running", "runs": [{"concurrency": 8, "rounds": 2}]}])
    est = plan.estimate(m, _runs(tmp_path, lines))
    # two planned runs at a concurrency that crashed 1 of 2 recorded runs: each adds half a restart + the dump wait
    assert est["engines"][0]["crash restarts s"] == round(2 * 0.5 * (80 + 150))
    # the matrix plans 3.6 and the crashes were recorded at 1.86 only: the summary says whose rate it borrowed
    assert est["crash_rates_elsewhere"] == ["full-stock at 3.6 (crashes recorded at 1.86)"]
    assert est["borrowed_crash_s"] == pytest.approx(2 * 0.5 * (80 + 150))
    assert ("crash restarts from another acceptance's crash rate: full-stock at 3.6 (crashes recorded at 1.86) "
            f"(without them: {est['total_cold_s'] - 230:.0f} s cold, {est['total_warm_s'] - 230:.0f} s warm)") in \
        plan.summary_line(est, "m.yaml")
    at_186 = _matrix(tmp_path, [{"id": "full-stock", "coredump": "keep-running", "acceptance": 1.86,
                                 "runs": [{"concurrency": 8, "rounds": 2}]}])
    est = plan.estimate(at_186, _runs(tmp_path, lines))
    assert est["crash_rates_elsewhere"] == [] and "another acceptance" not in plan.summary_line(est, "m.yaml")
    # once the planned acceptance has measured runs of its own at that concurrency (s30: stock at 3.6), their rate is
    # used: none crashed there, so no restart; 1 of 2 crashed, half a restart per run, from its own acceptance
    stock_m = _matrix(tmp_path, [{"id": "full-stock", "coredump": "keep-running", "runs": [{"concurrency": 8, "rounds": 2}]}])
    own = lines + [dict(_line("s", "stock", 8, 3.0, 3.6, L=3.6, startup=80), run_id="s/c8/r1")]
    est = plan.estimate(stock_m, _runs(tmp_path, own))
    assert est["engines"][0]["crash restarts s"] == 0 and est["crash_rates_elsewhere"] == []
    own_crash = own + [dict(_line("s", "stock", 8, 1.0, 3.6, outcome="crash", startup=200), run_id="s/c8/r2")]
    own_crash += [dict(_line("s", "stock", 8, 1.0, 1.86, outcome="crash", startup=200), run_id=f"s/c8/r{i}") for i in (3, 4)]
    est = plan.estimate(stock_m, _runs(tmp_path, own_crash))
    assert est["engines"][0]["crash restarts s"] == round(2 * 0.5 * (80 + 150)) and est["crash_rates_elsewhere"] == []
    # a warm-up alone at its acceptance is too short to give a rate: the other acceptance's is borrowed, and said
    warm = lines + [dict(_line("s", "stock", 8, 1.0, 3.6, L=3.6, startup=80, warmup=True, tokens=32), run_id="s/c8/w1")]
    est = plan.estimate(stock_m, _runs(tmp_path, warm))
    assert est["crash_rates_elsewhere"] == ["full-stock at 3.6 (crashes recorded at 1.86)"]
    m = _matrix(tmp_path, [{"id": "eager", "enforce_eager": True, "runs": [{"concurrency": 1}]}])
    with pytest.raises(LabError, match=r"no recorded start-up for \['DFlash eager'\]"):
        plan.estimate(m, _runs(tmp_path, lines))


def test_a_fresh_hosts_first_engine_start_is_added_once_to_the_warm_total(tmp_path):
    # session A starts fixed FULL first (300 s; its shortest recorded start is 100), session B no speculation (150,
    # its shortest): the first engine of a host costs the median of 200 and 0 beyond a warm start
    lines = [dict(_line("f", "fixed", 1, 2.0, 3.6, L=3.6, startup=300), gpu_session="A", run_start_t=10.0),
             dict(_line("n", "nospec", 1, 2.0, 3.6, startup=160), gpu_session="A", run_start_t=20.0),
             dict(_line("n", "nospec", 1, 2.0, 3.6, startup=150), gpu_session="B", run_start_t=30.0, run_id="n/c1/r1"),
             dict(_line("f", "fixed", 1, 2.0, 3.6, L=3.6, startup=100), gpu_session="B", run_start_t=40.0, run_id="f/c1/r1")]
    runs = _runs(tmp_path, lines)
    assert plan.first_start_penalty(runs) == (100.0, 2)
    m = _matrix(tmp_path, [{"id": "full-fixed", "fix": True, "runs": [{"concurrency": 1}]}])
    est = plan.estimate(m, runs, staging_s=90)
    assert est["total_warm_s"] == pytest.approx(90 + 2.0 + 100 + 100)   # run, shortest start, first-start penalty
    assert est["total_cold_s"] == pytest.approx(90 + 2.0 + 300)
    assert "a fresh host's first engine +100 s, the median over 2 recorded sessions" in plan.summary_line(est, "m.yaml")
    # lines without run start times cannot be ordered: nothing is added, and nothing said
    assert plan.first_start_penalty(_runs(tmp_path, [_line("f", "fixed", 1, 2.0, 3.6, L=3.6)])) == (0.0, 0)


def test_the_plan_command_on_the_recorded_data():
    r = run_cli("dflash_lab", "plan", "matrices/bench-acc3.6-s1-tp1.yaml")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("matrices/bench-acc3.6-s1-tp1.yaml: about ") and "full-fixed" in r.stdout
    assert "a fresh host's first engine +" in r.stdout   # the bench lines record their run start times
    r = run_cli("dflash_lab", "plan", "matrices/none.yaml")
    assert r.returncode == 2 and "no such matrix file" in r.stderr
