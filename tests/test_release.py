"""Engines on a later vLLM release (dflash_lab.release, the runner's key vllm_release): what the staging ships, the
engine-side check, the runner's environment and lines, and where ingest puts their lines."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_fake_matrix
from dflash_lab import release
from dflash_lab.errors import LabError
from dflash_lab.ingest import ingest
from dflash_lab.runner import load_matrix, read_lines, validate_matrix

META = """Metadata-Version: 2.4
Name: vllm
Version: 0.26.0
Requires-Dist: regex
Requires-Dist: torch==2.11.0
Requires-Dist: compressed-tensors==0.17.0
Requires-Dist: fastapi[standard]<0.137.0,>=0.133.0
Requires-Dist: pyzmq>=25.0.0
Requires-Dist: tokenspeed-mla==0.1.8; platform_system == "Linux"
Requires-Dist: only-on-mac==1.0; sys_platform == "darwin"
Requires-Dist: flashinfer-python==0.6.14
Requires-Dist: pytest==9.0; extra == "test"
Requires-Dist: Apache_TVM.FFI==0.1.10
"""
BASE = ["# 0.22.1's list", "compressed-tensors==0.15.0.1", "fastapi==0.165.0", "pyzmq==27.3.0", "", "lark==1.2.2",
        "flashinfer-python==0.6.11.post2", "apache-tvm-ffi==0.1.9", "pytest==8.0"]


def test_the_staging_list_keeps_accepted_pins_and_takes_the_releases_own_where_they_exclude_ours():
    pins, changed = release.release_wheels(BASE, META)
    assert pins == ["compressed-tensors==0.17.0", "fastapi<0.137.0,>=0.133.0", "pyzmq==27.3.0", "lark==1.2.2",
                    "flashinfer-python==0.6.14", "apache-tvm-ffi==0.1.10",
                    "pytest==8.0"]   # a requirement of an extra only is not the release's
    assert changed == ["compressed-tensors==0.15.0.1 -> compressed-tensors==0.17.0",
                       "fastapi==0.165.0 -> fastapi<0.137.0,>=0.133.0",
                       "flashinfer-python==0.6.11.post2 -> flashinfer-python==0.6.14",
                       "apache-tvm-ffi==0.1.9 -> apache-tvm-ffi==0.1.10"]
    reqs = release.requirements(META)
    assert "tokenspeed-mla" in reqs and "only-on-mac" not in reqs and "pytest" not in reqs


def test_a_release_that_needs_another_torch_than_the_hosts_cannot_be_staged():
    with pytest.raises(LabError, match=r"requires torch==2.13.0; the GPU host has torch 2.11.0"):
        release.release_wheels(BASE, META.replace("torch==2.11.0", "torch==2.13.0"))
    with pytest.raises(LabError, match="transformers"):
        release.release_wheels(BASE, META + "Requires-Dist: transformers<5.10,>=5.5.3\n")
    with pytest.raises(LabError, match="not a name==version pin"):
        release.release_wheels(["lark>=1"], META)
    with pytest.raises(LabError, match="unreadable requirement"):
        release.release_wheels(BASE, META + "Requires-Dist: ???\n")


@pytest.mark.parametrize("v", ["0.26", "v0.26.0", "0.26.0rc1", 26, None, "0.22.1"])
def test_a_release_is_named_by_its_exact_version_and_never_the_pinned_one(v):
    with pytest.raises(LabError, match="vllm_release"):
        release.check_version(v)


def _site(tmp_path, version, name="site"):
    site = tmp_path / name
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return site


def _check(site_on_path, value):
    code = "from dflash_lab import release; print(release.check_loaded())"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site_on_path), str(ROOT)]), DFLASH_LAB_VLLM_RELEASE=value)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_the_engine_side_check_stops_a_process_that_imported_another_vllm_or_another_folders(tmp_path):
    site = _site(tmp_path, "0.26.0")
    ok = _check(site, f"0.26.0={site}")
    assert ok.returncode == 0 and ok.stdout.strip() == f"vllm release 0.26.0 from {site}"
    wrong = _check(_site(tmp_path, "0.22.1", "old"), f"0.26.0={site}")
    assert wrong.returncode != 0 and "imported vllm 0.22.1" in wrong.stderr and "not 0.26.0" in wrong.stderr
    other = _check(_site(tmp_path, "0.26.0", "elsewhere"), f"0.26.0={site}")
    assert other.returncode != 0 and f"not from {site}" in other.stderr
    bad = _check(site, "0.26.0")
    assert bad.returncode != 0 and "expected VERSION=FOLDER" in bad.stderr


def test_the_plugin_runs_the_check_in_every_engine_process(tmp_path):
    """vLLM calls the plugin's register() in each process it starts: with the release variable set and the wrong vllm
    imported, register() raises, which vLLM does not catch (its load_general_plugins calls each plugin bare)."""
    code = "from dflash_lab import plugin; plugin.register()"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_site(tmp_path, "0.22.1", "old")), str(ROOT)]),
               DFLASH_LAB_VLLM_RELEASE=f"0.26.0={_site(tmp_path, '0.26.0')}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "not 0.26.0" in r.stderr


@pytest.mark.parametrize("eng,msg", [
    ({"vllm_release": "0.26.0"}, "with hook: those instrument"),
    ({"vllm_release": "0.26.0", "hook": False, "fix": True}, "with fix"),
    ({"vllm_release": "0.26.0", "hook": False, "probe": True}, "with probe"),
    ({"vllm_release": "0.26.0", "hook": False, "vllm_diff": "patches/vllm-0.26.0-part1.diff", "fix": True},
     "the diff is the fix"),
    ({"vllm_release": "0.26.0", "hook": False, "first_step_requests": 1}, "with first_step_requests"),
    ({"vllm_release": "0.26.0", "hook": False, "env": {"PYTHONPATH": "/x"}}, "leave it out of env"),
    ({"vllm_release": "0.26", "hook": False}, "release version such as"),
    ({"vllm_release": "0.22.1", "hook": False}, "leave vllm_release out"),
    ({"env": {"DFLASH_LAB_VLLM_RELEASE": "0.26.0=/x"}}, "which the runner sets from matrix keys"),
])
def test_bad_release_engines_are_refused(eng, msg):
    with pytest.raises(LabError, match=msg):
        validate_matrix({"engines": [{"id": "a", **eng, "runs": [{"concurrency": 1}]}]}, "m.yaml")


def test_the_committed_release_matrix_runs_the_crash_configuration_stock_on_0_26_0():
    m = load_matrix(str(ROOT / "matrices" / "release-0.26.0-c32-tp1.yaml"))
    (eng,) = m["engines"]
    e = eng["engine"]
    assert e["vllm_release"] == "0.26.0" and e["cudagraph_mode"] == "FULL_AND_PIECEWISE" and e["acceptance"] == 1.86
    assert not (e["hook"] or e["fix"] or e["probe"]) and e["coredump"]
    assert [r.concurrency for r in eng["runs"]] == [32, 32, 32]


def test_a_release_engines_path_leaves_out_every_folder_with_another_vllm(tmp_path):
    old = _site(tmp_path, "0.22.1", "vllm-site")
    plain = tmp_path / "plain"
    plain.mkdir()
    got = release.pythonpath("/r/0.26.0", os.pathsep.join([str(old), str(plain), ""]))
    assert got == os.pathsep.join(["/r/0.26.0", str(plain)])
    assert release.pythonpath("/r/0.26.0", None) == "/r/0.26.0"


def _run(tmp_path, engines, releases):
    return run_fake_matrix(tmp_path, engines, {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
                                               "DFLASH_LAB_RELEASES": str(releases)})


def test_the_runner_starts_a_release_engine_on_that_release_alone_and_its_lines_say_so(tmp_path):
    site = _site(tmp_path / "rel", "0.26.0", "0.26.0")
    lines, logs = _run(tmp_path, [{"id": "rel", "vllm_release": "0.26.0", "runs": [{"concurrency": 1}]},
                                  {"id": "plain", "runs": [{"concurrency": 1}]}], tmp_path / "rel")
    by = {l["run_id"]: l for l in lines}
    assert [l["outcome"] for l in lines] == ["ok", "ok"]
    # that folder first; the runner's entries without a vllm follow (here the checkout, for the stand-in worker)
    assert f"DFLASH_LAB_VLLM_RELEASE=0.26.0={site} PYTHONPATH={site}{os.pathsep}{ROOT}{os.pathsep}" in logs["rel"]
    assert "DFLASH_LAB_VLLM_RELEASE= " in logs["plain"]
    rel, plain = by["rel/c1/r0"], by["plain/c1/r0"]
    assert rel["vllm_release"] == rel["vllm_version"] == rel["engine_vllm_version"] == "0.26.0"
    assert rel["runner_vllm_version"] == plain["vllm_version"] and plain["vllm_release"] is None
    assert "runner_vllm_version" not in plain


def test_an_engine_whose_worker_imported_another_vllm_runs_nothing(tmp_path):
    """The plugin stops a process that imported another vllm; should it not have run, the worker's own report at ready
    does: the engine is ended and each of its runs gets a startup_error line, naming what it imported."""
    _site(tmp_path / "rel", "0.25.0", "0.26.0")   # the folder of 0.26.0 holds another release
    lines, _ = _run(tmp_path, [{"id": "rel", "vllm_release": "0.26.0", "runs": [{"concurrency": 1, "rounds": 2}]}],
                    tmp_path / "rel")
    assert [l["outcome"] for l in lines] == ["startup_error"] * 2
    assert lines[0]["error"] == "vllm_release 0.26.0: the engine's worker imported vllm '0.25.0'; its runs are not run"
    assert lines[0]["vllm_version"] == "0.25.0" and lines[0]["vllm_release"] == "0.26.0"


def test_a_release_not_staged_on_the_host_ends_its_engine_with_one_clear_line_per_run(tmp_path):
    lines, _ = _run(tmp_path, [{"id": "rel", "vllm_release": "0.26.0", "runs": [{"concurrency": 1, "rounds": 2}]}],
                    tmp_path / "none")
    assert [l["outcome"] for l in lines] == ["startup_error"] * 2
    assert lines[0]["vllm_version"] is None   # no engine ran: no vllm to name
    assert lines[0]["error"] == (f"vllm_release 0.26.0: not staged at {tmp_path / 'none' / '0.26.0'} "
                                 "(scripts/gpu/stage-release.sh, then scripts/gpu/setup-release.sh on the host)")


def _out(tmp_path, name, lines):
    out = tmp_path / name
    out.mkdir()
    (out / "runs.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    return out


def test_release_lines_are_recorded_apart_from_0_22_1s_and_never_mixed(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rel = {"run_id": "r", "outcome": "crash", "vllm_release": "0.26.0", "vllm_version": "0.26.0",
           "engine_vllm_version": "0.26.0"}
    plain = {"run_id": "p", "outcome": "crash", "vllm_release": None}
    with pytest.raises(LabError, match="go with --kind release"):
        ingest(str(_out(tmp_path, "o1", [plain, rel])), "a", data_dir=str(data))
    with pytest.raises(LabError, match="vllm_release engines only"):
        ingest(str(_out(tmp_path, "o2", [rel, plain])), "b", data_dir=str(data), kind="release")
    assert not (data / "runs").exists() and not (data / "upstream").exists()
    unproven = {**rel, "run_id": "u", "engine_vllm_version": None}
    with pytest.raises(LabError, match=r"did not report that release as its vllm: \['u'\]"):
        ingest(str(_out(tmp_path, "o4", [rel, unproven])), "d", data_dir=str(data), kind="release")
    ingest(str(_out(tmp_path, "o3", [rel])), "c", data_dir=str(data), kind="release")
    assert read_lines(data / "upstream" / "runs" / "c.jsonl") == [rel]
    assert (data / "upstream" / "runs" / "c.meta.json").exists() and not (data / "runs").exists()


def _line(**kw):
    base = {"run_id": "e/c32/r0", "matrix": "m", "outcome": "ok", "gpu_session": "2026-12-05-s65",
            "target": {"name": "qwen36-35b-a3b"}, "spec_method": "dflash", "num_speculative_tokens": 15,
            "cudagraph_mode": "FULL_AND_PIECEWISE", "enforce_eager": False, "tensor_parallel_size": 1,
            "mode": "offline", "concurrency": 32, "acceptance": 1.86, "max_tokens": 512, "max_num_seqs": 64,
            "max_model_len": 65536, "max_num_batched_tokens": 32768, "moe_backend": "triton",
            "async_scheduling": None, "prefix_caching": None, "hook": False, "fix": False, "probe": False,
            "vllm_release": None, "requests_completed": 32, "spec_decode_metrics": {"acceptance_length": 1.86},
            "temperature": 0.7, "ignore_eos": True, "engine_args": {}, "env": {}}
    return {**base, **kw}


def test_a_release_run_is_set_beside_the_0_22_1_controls_of_its_session_and_configuration_only(tmp_path):
    from dflash_lab import upstream

    (tmp_path / "up").mkdir()
    (tmp_path / "runs").mkdir()
    rel = [_line(vllm_release="0.26.0", matrix="rel"),
           _line(vllm_release="0.26.0", matrix="rel", outcome="crash", requests_completed=0,
                 fault={"kernel": "k_release"}, spec_decode_metrics=None),
           _line(vllm_release="0.26.0", matrix="rel", outcome="startup_error", requests_completed=0)]
    ctrl = [_line(matrix="ctl", outcome="crash", requests_completed=0, fault={"kernel": "k_stock"},
                  spec_decode_metrics=None),
            _line(matrix="other-session", gpu_session="2026-12-04-s64", outcome="crash"),
            _line(matrix="fixed", fix=True),
            _line(matrix="hooked", hook=True, outcome="crash"),
            _line(matrix="c16", concurrency=16)]
    (tmp_path / "up" / "a.jsonl").write_text("".join(json.dumps(l) + "\n" for l in rel))
    (tmp_path / "runs" / "b.jsonl").write_text("".join(json.dumps(l) + "\n" for l in ctrl))
    t = upstream.gpu_runs(str(tmp_path / "up" / "*.jsonl"), str(tmp_path / "runs" / "*.jsonl"))
    assert len(t) == 1
    row = t.iloc[0].to_dict()
    assert (row["vLLM"], row["runs"], row["crashed"], row["completed"], row["cores"]) == ("0.26.0", 2, 1, 1, "k_release")
    assert row["counted acceptance"] == "1.86-1.86" and row["requests completed"] == 32
    assert (row["0.22.1 controls (same session and configuration)"], row["0.22.1 crashed"], row["0.22.1 cores"]) == (
        1, 1, "k_stock")
    assert row["matrices"] == "ctl, rel"
    # another configuration of the release (greedy) is a row of its own; a control with engine arguments or an engine
    # variable of its own is not the same engine
    (tmp_path / "up" / "g.jsonl").write_text(json.dumps(_line(vllm_release="0.26.0", matrix="greedy", temperature=0.0)) + "\n")
    (tmp_path / "runs" / "e.jsonl").write_text(
        json.dumps(_line(matrix="split1", engine_args={"compilation_config": {"x": 1}}, outcome="crash")) + "\n"
        + json.dumps(_line(matrix="blocking", env={"CUDA_LAUNCH_BLOCKING": "1"}, outcome="crash")) + "\n")
    t = upstream.gpu_runs(str(tmp_path / "up" / "*.jsonl"), str(tmp_path / "runs" / "*.jsonl"))
    assert sorted(t["matrices"]) == ["ctl, rel", "greedy"]
    assert t.set_index("matrices").loc["ctl, rel", "0.22.1 controls (same session and configuration)"] == 1
    # the same configuration with a vllm_diff (the fix's part 1 ported) is another engine: its own row, no stock control
    (tmp_path / "up" / "d.jsonl").write_text(
        json.dumps(_line(vllm_release="0.26.0", matrix="part1", vllm_diff="patches/vllm-0.26.0-part1.diff")) + "\n")
    t = upstream.gpu_runs(str(tmp_path / "up" / "*.jsonl"), str(tmp_path / "runs" / "*.jsonl")).set_index("matrices")
    assert sorted(t.index) == ["ctl, rel", "greedy", "part1"]
    assert t.loc["part1", "0.22.1 controls (same session and configuration)"] == 0
    assert t.loc["part1", "configuration"].endswith(", with vllm-0.26.0-part1.diff")
    assert t.loc["part1", "diff"] == "vllm-0.26.0-part1.diff" and t.loc["ctl, rel", "diff"] == ""
    assert t.loc["ctl, rel", "runs"] == 2
    (tmp_path / "up" / "c.jsonl").write_text(json.dumps(_line()) + "\n")
    with pytest.raises(LabError, match="without vllm_release"):
        upstream.gpu_runs(str(tmp_path / "up" / "*.jsonl"), str(tmp_path / "runs" / "*.jsonl"))


def test_the_recorded_0_26_0_runs_and_their_control():
    """What notebook 04 and the findings page say of 0.26.0 (s65), from the committed lines."""
    from dflash_lab import upstream

    t = upstream.gpu_runs(str(ROOT / "data/upstream/runs/*.jsonl"), str(ROOT / "data/runs/*.jsonl"))
    row = t[t["vLLM"] == "0.26.0"].iloc[0]
    assert (row["runs"], row["crashed"], row["requests completed"]) == (6, 0, 192)
    assert row["0.22.1 crashed"] == row["0.22.1 controls (same session and configuration)"] == 1
    assert row["0.22.1 cores"] == "copy_and_expand_dflash_inputs_kernel"


def _acc6_lines(vllm, engine, graphs, counted, greedy_counted=(6.0, 6.0), **kw):
    matrix = "release-0.26.0-acc6-c8-tp1" if vllm else "release-control-0.22.1-acc6-c8-tp1"
    kw = {"attempt": 1, **kw}
    out = [_line(vllm_release=vllm, matrix=matrix, engine_id=engine, run_id=f"{engine}/c8/r{i}", round=i, concurrency=8,
                 acceptance=6.0, cudagraph_mode=graphs, spec_decode_metrics={"acceptance_length": c, "num_drafts": 807},
                 requests_completed=8, **kw)
           for i, c in enumerate(counted)]
    out += [_line(vllm_release=vllm, matrix=matrix, engine_id=engine, run_id=f"{engine}/c8/greedy-r{i}", round=i,
                  concurrency=8, acceptance=6.0, cudagraph_mode=graphs, temperature=0.0,
                  output_digests=[f"d{i}"] * 8, spec_decode_metrics={"acceptance_length": c, "num_drafts": 688},
                  requests_completed=8, **kw)
            for i, c in enumerate(greedy_counted)]
    return out


def _acc6_data(tmp_path, full_counted, pw_counted, ctl_counted, full_digests=None, full_logprob=-1.0):
    """The s66 matrices' lines in tmp_path (data/upstream/runs, data/runs) with the greedy runs' recorded outputs."""
    data = tmp_path / "data"
    (data / "upstream" / "runs").mkdir(parents=True)
    (data / "runs").mkdir()
    full = _acc6_lines("0.26.0", "r0260-full-acc6", "FULL_AND_PIECEWISE", full_counted)
    for r in full:
        if full_digests and r["temperature"] == 0:
            r["output_digests"] = full_digests
    pw = _acc6_lines("0.26.0", "r0260-piecewise-acc6", "PIECEWISE", pw_counted)
    ctl = _acc6_lines(None, "r0221-full-acc6", "FULL_AND_PIECEWISE", ctl_counted)
    for stem, lines, where in (("rel", full + pw, data / "upstream" / "runs"), ("ctl", ctl, data / "runs")):
        (where / f"{stem}.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
        for r in lines:
            if r["temperature"] == 0:
                lp = full_logprob if r["engine_id"] == "r0260-full-acc6" else -1.0
                d = data / "gpu" / stem / f"{r['engine_id']}.a1.outputs"
                d.mkdir(parents=True, exist_ok=True)
                (d / (r["run_id"].replace("/", "_") + ".json")).write_text(
                    json.dumps({"token_ids": [[1, 2]] * 8, "logprobs": [[-1.0, lp]] * 8}))
    return data


def _acc6(data):
    from dflash_lab import upstream

    p, t, agree = upstream.acc6_predictions(str(data / "upstream" / "runs" / "*.jsonl"), str(data / "runs" / "*.jsonl"),
                                            data_dir=str(data), matrices_dir=str(ROOT / "matrices"))
    return dict(zip(p["predicted"].str[:3] + " " + p["matrix"].str[8:12], p["held"])), p, t, agree


def test_the_acc6_predictions_are_judged_from_the_counters_and_the_recorded_outputs(tmp_path):
    """s66's matrices against their headers: (b) holds only when 0.26.0's FULL counts fall in the lossy range, (c) when
    its greedy runs differ from PIECEWISE's or carry a NaN log-probability, and a missing run leaves a prediction open."""
    lossy, exact = (5.107, 5.11, 5.12), (6.0, 6.0, 6.0)
    held, p, t, agree = _acc6(_acc6_data(tmp_path / "1", lossy, exact, lossy, full_logprob=float("nan")))
    assert list(held.values()) == [True] * 6, p.to_string()
    assert t.set_index("run").loc["r0260-full-acc6/c8/greedy-r0", "non-finite log-probabilities"] == 8
    assert list(agree["all identical"]) == [True, True]      # the tokens agree: (c) holds on the NaN alone
    # 0.26.0 counting the schedule exactly, its greedy outputs identical and finite: (b) and (c) fail, the rest hold
    held, p, _, _ = _acc6(_acc6_data(tmp_path / "2", exact, exact, lossy))
    # sorted: (a) 0.26.0, (a) control, (b) 0.26.0, (b) control, (c), (d)
    assert [held[k] for k in sorted(held)] == [True, True, False, True, False, True], p.to_string()
    # greedy tokens differing in one request are enough for (c); a PIECEWISE count below 6 fails (a)
    held, p, _, _ = _acc6(_acc6_data(tmp_path / "3", lossy, (6.0, 5.99, 6.0), lossy, full_digests=["x"] + ["d0"] * 7))
    assert not held["(a) 0.26"] and held["(c) 0.26"] is not False
    assert "7/8 requests identical to PIECEWISE" in p.set_index("predicted").filter(like="(c)", axis=0).iloc[0]["measured"]


def test_an_acc6_prediction_with_a_run_missing_is_not_decided(tmp_path):
    data = _acc6_data(tmp_path, (5.107, 5.11), (6.0, 6.0, 6.0), (5.107, 5.11, 5.12))
    held, p, _, _ = _acc6(data)
    assert held["(b) 0.26"] is None and held["(a) 0.26"] is True, p.to_string()
    assert held["(d) 0.26"] is None     # 9 of the 10 planned runs measured


def _greedy(tmp_path, stem, lines, outputs, where="runs"):
    """Greedy lines written as data/<where>/<stem>.jsonl with their recorded outputs: {run_id: (tokens, logprobs)}."""
    data = tmp_path / "data"
    (data / where).mkdir(parents=True, exist_ok=True)
    (data / where / f"{stem}.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    for l in lines:
        toks, lps = outputs[l["run_id"]]
        d = data / "gpu" / stem / f"{l['engine_id']}.a1.outputs"
        d.mkdir(parents=True, exist_ok=True)
        (d / (l["run_id"].replace("/", "_") + ".json")).write_text(json.dumps({"token_ids": toks, "logprobs": lps}))
    return data


def test_greedy_requests_are_judged_against_the_reference_paths_of_their_workload(tmp_path):
    """s67: a 0.26.0 FULL request off the reference output at step ends (every L-th token, the target's own sample) is
    counted there, off elsewhere it is not; NaN and infinite log-probabilities are counted; only completed stock
    PIECEWISE or eager runs of the same prompt, length and drafter stand as references (not a FULL run, another prompt,
    a sampled run, an instrumented or crashed PIECEWISE run, nor a PIECEWISE run of the judged run's own matrix),
    whatever their acceptance."""
    import pandas as pd

    from dflash_lab import analysis, upstream

    good = [201] + [7] * 12                                   # 13 tokens; at acceptance 6 steps end at 6 and 12
    alt = [201, 201] + [7] * 11                               # the engine's own near-tie between identical prompts
    g = dict(attempt=1, temperature=0.0, output_digests=["x"], acceptance=1.86, concurrency=2, prompt_tokens=49,
             max_tokens=13, weights="dummy", matrix="ref")
    pw = dict(engine_id="pw", cudagraph_mode="PIECEWISE")
    refs = [_line(run_id="pw/c2/r0", **pw, **g),
            _line(run_id="eager/c2/r0", engine_id="eager", cudagraph_mode=None, enforce_eager=True, **g),
            _line(run_id="full/c2/r0", engine_id="full", **g),                           # replays FULL graphs
            _line(run_id="pw/c2/p", **pw, **{**g, "prompt_tokens": 50}),                 # another prompt
            _line(run_id="pw/c2/k", **pw, **{**g, "num_speculative_tokens": 7}),         # another drafter
            _line(run_id="pw/c2/t", **pw, **{**g, "temperature": 0.7}),                  # sampled
            _line(run_id="pw/c2/h", **pw, **{**g, "probe": True}),                       # the lab inside the engine
            _line(run_id="pw/c2/x", **pw, **{**g, "outcome": "crash"}),
            _line(run_id="pw/c2/own", **pw, **{**g, "matrix": "rel"})]                   # the judged run's matrix
    lp = [[-1.0] * 13] * 2
    out = {r["run_id"]: ([[9] * 13] * 2, lp) for r in refs}
    out.update({"pw/c2/r0": ([good, alt], lp), "eager/c2/r0": ([good, good], lp)})
    _greedy(tmp_path, "ref", refs, out)
    step_end = [201] + [7] * 5 + [5] + [7] * 4 + [5, 5]       # off at 6, 11 and 12: 6 and 12 are step ends
    mid = [201, 7, 7, 8] + [7] * 9
    nan, inf = float("nan"), float("inf")
    run = dict(engine_id="r", vllm_release="0.26.0", **{**g, "acceptance": 6.0, "concurrency": 3, "matrix": "rel",
                                                        "spec_decode_metrics": {"acceptance_length": 6.0}})
    lossy = {**run, "spec_decode_metrics": {"acceptance_length": 5.5}}
    runs = [_line(run_id="r/c3/greedy-r0", **run), _line(run_id="r/c3/greedy-r1", **lossy)]
    toks = [alt, step_end, mid]
    lps = [[-1.0] * 13, [-1.25] + [-1.0] * 12, [-1.0] * 3 + [nan] * 9 + [inf]]
    data = _greedy(tmp_path, "rel", runs, {r["run_id"]: (toks, lps) for r in runs}, where="upstream/runs")
    pool = pd.concat([analysis.load_runs(str(data / "runs" / "*.jsonl")),
                      analysis.load_runs(str(data / "upstream" / "runs" / "*.jsonl"))], ignore_index=True)
    judged = analysis.load_runs(str(data / "upstream" / "runs" / "*.jsonl"))
    every = upstream.greedy_against_reference(judged, pool, data_dir=str(data))
    t = every[every["run"] == "r/c3/greedy-r0"].set_index("request")
    assert list(t["equals a reference output"]) == [True, False, False]
    assert list(t["tokens off the reference"]) == [0, 3, 1]
    assert t.loc[1, "first off"] == 6 and t.loc[1, "off at step ends"] == 2    # 6 and 12, not 11
    assert t.loc[2, "first off"] == 3 and t.loc[2, "off at step ends"] == 0
    assert list(t["non-finite log-probabilities"]) == [0, 0, 10] and t.loc[2, "first non-finite"] == 3
    assert (t["reference runs"] == 2).all() and (t["reference outputs"] == 2).all()
    assert set(t["reference graphs"]) == {"PIECEWISE, eager"} and set(t["reference acceptance"]) == {"1.86"}
    assert (t["reference outputs differ within the first"] == 2).all()      # good and alt differ at position 1
    # request 1 against request 0 (alt): their common prefix is position 0 alone, where they differ by 0.25
    assert t.loc[1, "max |dlogprob| vs request 0"] == pytest.approx(0.25)
    # a run whose counted acceptance is below its schedule lost tokens: its step ends are not where k*L puts them
    assert every[every["run"] == "r/c3/greedy-r1"]["off at step ends"].isna().all()
    s = upstream.reference_summary(every).set_index("run").loc["r/c3/greedy-r0"]
    assert (s["requests equal to a reference output"], s["tokens off the reference"], s["of them at step ends"],
            s["earliest off position"], s["non-finite log-probabilities"]) == ("1/3", 4, 2, 3, 10)
    assert s["max |dlogprob| vs request 0"] == pytest.approx(0.25)
    assert upstream.reference_summary(every.iloc[0:0]).empty
    # no reference of the same workload: said, not an empty table
    with pytest.raises(LabError, match="no greedy reference-path run"):
        upstream.greedy_against_reference(judged, pool[~pool["run_id"].isin(["pw/c2/r0", "eager/c2/r0"])],
                                          data_dir=str(data))


def test_0_26_0_full_greedy_requests_leave_the_reference_only_at_step_ends():
    """The recorded s67 runs: in each greedy run at acceptance 6 and concurrency 8, request 0 equals the reference
    output and the other 7 do not. On 0.26.0 every token off the reference is a step's last token (the target's own
    sample), with finite log-probabilities; on 0.22.1 the same 7 requests carry non-finite log-probabilities from the
    first or second step and are off elsewhere too."""
    import pandas as pd

    from dflash_lab import analysis, upstream

    d = upstream.release_frame([upstream.ACC6_RELEASE_MATRIX, upstream.ACC6_CONTROL_MATRIX],
                               str(ROOT / "data/upstream/runs/*.jsonl"), str(ROOT / "data/runs/*.jsonl"))
    pool = pd.concat([analysis.load_runs(str(ROOT / "data/runs/*.jsonl")),
                      analysis.load_runs(str(ROOT / "data/upstream/runs/*.jsonl"))], ignore_index=True)
    s = upstream.reference_summary(upstream.greedy_against_reference(d, pool, data_dir=str(ROOT / "data")))
    s = s[s["run"].str.contains("greedy-r[01]$") & s["graphs"].eq("FULL_AND_PIECEWISE")].set_index("run")
    new = s[s["vLLM"] == "0.26.0"]
    old = s[s["vLLM"] == "0.22.1"]
    assert len(new) == 2 and len(old) == 2
    assert (new["requests equal to a reference output"] == "1/8").all()
    assert (new["tokens off the reference"] == new["of them at step ends"]).all()
    assert (new["tokens off the reference"] > 500).all() and (new["non-finite log-probabilities"] == 0).all()
    # where requests 1-7 still agree with request 0's tokens, their log-probabilities already differ by about 0.3
    assert (new["max |dlogprob| vs request 0"] > 0.3).all()
    assert (old["requests equal to a reference output"] == "1/8").all()
    assert (old["non-finite log-probabilities"] > 3500).all()
    assert (old["tokens off the reference"] > old["of them at step ends"]).all()
    assert (s["earliest off position"] == 6).all()


def test_the_findings_say_when_the_greedy_runs_cannot_be_judged(tmp_path):
    """The findings page's release clause with s67's 0.26.0 lines but no reference-path run recorded: one sentence
    saying why, not a broken page; with no line of the matrices at all: nothing."""
    import shutil

    from dflash_lab import findings

    name = "2026-12-05_h200_release-0.26.0-acc6-c8-tp1"
    (tmp_path / "data" / "upstream" / "runs").mkdir(parents=True)
    shutil.copy(ROOT / "data" / "upstream" / "runs" / f"{name}.jsonl", tmp_path / "data" / "upstream" / "runs")
    shutil.copytree(ROOT / "data" / "gpu" / name, tmp_path / "data" / "gpu" / name)
    text = findings.release_greedy_clause(tmp_path)
    assert text.startswith(" The greedy runs of release-0.26.0-acc6-c8-tp1 could not be judged: ")
    assert "no greedy reference-path run" in text
    assert findings.release_greedy_clause(tmp_path / "nothing") == ""


def _release_with_diff(tmp_path):
    """A staged stand-in release 0.26.0 with a file, and a diff made for that file (not for 0.22.1's)."""
    import difflib

    site = _site(tmp_path / "rel", "0.26.0", "0.26.0")
    old = "".join(f"v{i} = {i}\n" for i in range(1, 20))
    (site / "vllm" / "a.py").write_text(old)
    new = old.replace("v5 = 5\n", "v5 = 'five'\n")
    d = tmp_path / "rel.diff"
    d.write_text("why\n" + "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "a/vllm/a.py",
                                                         "b/vllm/a.py")))
    (tmp_path / "tmp").mkdir()
    return site, d


def test_a_release_engine_can_run_a_diff_made_for_that_release(tmp_path):
    """s67: whether the stale schedule is the cause on 0.26.0 needs the fix's part 1 on 0.26.0, as a diff: the overlay is
    made from the release's own package (the diff must fit it exactly), put ahead of it on PYTHONPATH, and the line
    says both the release and the diff; a plain release engine beside it stays stock."""
    from dflash_lab import vllmdiff

    site, d = _release_with_diff(tmp_path)
    lines, logs = run_fake_matrix(tmp_path, [
        {"id": "reldiff", "vllm_release": "0.26.0", "vllm_diff": str(d), "runs": [{"concurrency": 1}]},
        {"id": "rel", "vllm_release": "0.26.0", "runs": [{"concurrency": 1}]}],
        {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "DFLASH_LAB_RELEASES": str(tmp_path / "rel"),
         "TMPDIR": str(tmp_path / "tmp")})
    by = {l["run_id"]: l for l in lines}
    assert [l["outcome"] for l in lines] == ["ok", "ok"]
    rd = by["reldiff/c1/r0"]
    st = rd["vllm_diff_stamp"]
    assert rd["vllm_release"] == rd["vllm_version"] == "0.26.0" and rd["vllm_diff"] == str(d)
    assert st["source"] == str((site / "vllm").resolve()) and list(st["files"]) == ["vllm/a.py"]
    assert (f"DFLASH_LAB_VLLM_DIFF={st['path']} PYTHONPATH={st['path']}{os.pathsep}{site}{os.pathsep}{ROOT}"
            in logs["reldiff"])
    assert f"DFLASH_LAB_VLLM_RELEASE=0.26.0={site} " in logs["reldiff"]
    assert by["rel/c1/r0"]["vllm_diff"] is None and "DFLASH_LAB_VLLM_DIFF= " in logs["rel"]
    # in the engine process both checks pass: the overlay's files as stamped, and a vllm of that release through it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([st["path"], str(site), str(ROOT)]),
               DFLASH_LAB_VLLM_RELEASE=f"0.26.0={site}", **{vllmdiff.ENV: st["path"]})
    code = "from dflash_lab import release, vllmdiff; print(release.check_loaded()); print(vllmdiff.check_loaded())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert f"vllm release 0.26.0 from {site}, through the overlay {st['path']} made from it" in r.stdout
    # an overlay made from another folder's vllm is not that release, whatever its version says
    other = _site(tmp_path / "elsewhere", "0.26.0", "x")
    (other / "vllm" / "a.py").write_text((site / "vllm" / "a.py").read_text())
    ov = vllmdiff.overlay(d, package=other / "vllm", base=tmp_path / "ov2")
    env.update(PYTHONPATH=os.pathsep.join([ov["path"], str(site), str(ROOT)]), **{vllmdiff.ENV: ov["path"]})
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and f"not from {site}" in r.stderr


def test_a_diff_that_does_not_fit_the_release_ends_its_engine_with_one_clear_line_per_run(tmp_path):
    """0.22.1's diff on 0.26.0 moved by 140 lines in flash_attn.py: the strict applier refuses such a diff, so a
    release engine never runs a diff made for another vLLM."""
    site, d = _release_with_diff(tmp_path)
    (site / "vllm" / "a.py").write_text("v0 = 0\n" + (site / "vllm" / "a.py").read_text())   # the file moved by a line
    lines, logs = run_fake_matrix(tmp_path, [
        {"id": "reldiff", "vllm_release": "0.26.0", "vllm_diff": str(d), "runs": [{"concurrency": 1, "rounds": 2}]}],
        {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "DFLASH_LAB_RELEASES": str(tmp_path / "rel"),
         "TMPDIR": str(tmp_path / "tmp")})
    assert [l["outcome"] for l in lines] == ["startup_error"] * 2
    assert lines[0]["error"].startswith("vllm_diff: vllm/a.py: hunk 1 does not apply at line 2")
    assert "reldiff" not in logs                                       # no engine was started


def test_the_committed_0_26_0_part1_diff_is_0_22_1s_part1_moved(root):
    """patches/vllm-0.26.0-part1.diff is the flash_attn.py hunk of patches/vllm-0.22.1-dflash.diff, its lines unchanged,
    its place moved to 0.26.0's (read from the 0.26.0 wheel in s67; the overlay's strict applier checks the rest on the
    host): what it adds and removes is exactly 0.22.1's part 1."""
    from dflash_lab import vllmdiff

    old = vllmdiff.parse((root / "patches" / "vllm-0.22.1-dflash.diff").read_text())
    new = vllmdiff.parse((root / "patches" / "vllm-0.26.0-part1.diff").read_text())
    rel = "vllm/v1/attention/backends/flash_attn.py"
    assert list(new) == [rel] and len(new[rel]) == len(old[rel]) == 1
    (a,), (b,) = old[rel], new[rel]
    assert b.lines == a.lines and b.old_start == a.old_start + 140


def test_the_part1_predictions_are_judged_against_the_reference_paths(tmp_path):
    """The s67 matrix for the next session: its four predictions from fabricated runs of the planned engine. A greedy
    request off the reference or a NaN log-probability fails (b); a count below 6 fails (c); a crash fails (d); a run
    without a measured line leaves (b)-(d) open; a startup_error, or an overlay stamp that is not the committed diff on
    the release, fails (a)."""
    import shutil

    from dflash_lab import upstream, vllmdiff

    good = [201] + [7] * 12
    g = dict(attempt=1, output_digests=["x"], acceptance=6.0, concurrency=8, prompt_tokens=49, max_tokens=13,
             weights="dummy")
    ref = [_line(run_id="pw/c2/r0", engine_id="pw", cudagraph_mode="PIECEWISE", matrix="ref",
                 **{**g, "temperature": 0.0, "acceptance": 1.86})]
    _greedy(tmp_path, "ref", ref, {"pw/c2/r0": ([good] * 2, [[-1.0] * 13] * 2)})
    stamp = {"hunks_sha256": vllmdiff.hunks_sha256((ROOT / "patches" / "vllm-0.26.0-part1.diff").read_text()),
             "source": "/tmp/vllm-releases/0.26.0/vllm"}
    eng = dict(engine_id="r0260-part1-acc6", vllm_release="0.26.0", matrix=upstream.PART1_RELEASE_MATRIX,
               vllm_diff="patches/vllm-0.26.0-part1.diff", vllm_diff_stamp=stamp,
               spec_decode_metrics={"acceptance_length": 6.0}, **g)

    def judge(greedy_tokens, sampled=3, greedy=2, lp=-1.0, **last):
        data_dir = tmp_path / f"d{len(list(tmp_path.iterdir()))}"        # a fresh copy of the reference per case
        shutil.copytree(tmp_path / "data", data_dir / "data")
        lines = [_line(run_id=f"r0260-part1-acc6/c8/r{i}", temperature=0.7, **{**eng, "output_digests": None})
                 for i in range(sampled)]
        lines += [_line(run_id=f"r0260-part1-acc6/c8/greedy-r{i}", temperature=0.0, **eng) for i in range(greedy)]
        lines[-1].update(last)
        lps = [[lp] * 13] * len(greedy_tokens)
        data = _greedy(data_dir, "part1", lines, {l["run_id"]: (greedy_tokens, lps) for l in lines},
                       where="upstream/runs")
        p, s = upstream.part1_predictions(str(data / "upstream" / "runs" / "*.jsonl"), str(data / "runs" / "*.jsonl"),
                                          data_dir=str(data), matrices_dir=str(ROOT / "matrices"))
        return list(p["held"]), p, s

    held, p, s = judge([good] * 8)
    assert held == [True, True, True, True], p.to_string()
    assert list(s["requests equal to a reference output"]) == ["8/8", "8/8"]
    held, p, _ = judge([good] * 7 + [[201] + [7] * 5 + [5] + [7] * 6])
    assert held == [True, False, True, True] and "7/8 requests equal" in p.iloc[1]["measured"]
    held, p, _ = judge([good] * 7)                                    # a request missing from the record
    assert held[1] is False and "7/7 requests equal" in p.iloc[1]["measured"]
    assert judge([good] * 8, lp=float("nan"))[0] == [True, False, True, True]
    assert judge([good] * 8, spec_decode_metrics={"acceptance_length": 5.5})[0] == [True, True, False, True]
    assert judge([good] * 8, outcome="crash")[0][3] is False
    held, p, _ = judge([good] * 8, vllm_diff_stamp={**stamp, "hunks_sha256": "0" * 64})
    assert held[0] is False and "not the committed diff on the release" in p.iloc[0]["measured"]
    assert judge([good] * 8, vllm_diff_stamp={**stamp, "source": "/tmp/vllm-site/vllm"})[0][0] is False
    held, _, _ = judge([good] * 8, greedy=1)
    assert held == [True, None, None, None]
    # an engine whose diff did not apply: (a) fails, the rest is open
    data = tmp_path / "err" / "data"
    (data / "upstream" / "runs").mkdir(parents=True)
    err = [_line(run_id=f"r0260-part1-acc6/c8/r{i}", outcome="startup_error", requests_completed=0,
                 error="vllm_diff: vllm/v1/attention/backends/flash_attn.py: hunk 1 does not apply", **eng)
           for i in range(5)]
    (data / "upstream" / "runs" / "e.jsonl").write_text("".join(json.dumps(l) + "\n" for l in err))
    p, s = upstream.part1_predictions(str(data / "upstream" / "runs" / "*.jsonl"), str(data / "runs" / "*.jsonl"),
                                      data_dir=str(data), matrices_dir=str(ROOT / "matrices"))
    assert list(p["held"]) == [False, None, None, None] and "hunk 1 does not apply" in p.iloc[0]["measured"]
    assert s.empty


def test_a_release_diff_line_is_fixed_with_the_parts_its_stamp_names(tmp_path):
    """analysis.as_fix marked every vllm_diff line as 0.22.1's whole fix; a line of patches/vllm-0.26.0-part1.diff on
    0.26.0 had part 1 alone, which its overlay stamp's files say. The findings page says such a row has no stock
    control, rather than that its session lacked one."""
    from dflash_lab import analysis, findings

    st = {"files": {"vllm/v1/attention/backends/flash_attn.py": "x"}}
    r = analysis.as_fix({"vllm_diff": "patches/vllm-0.26.0-part1.diff", "vllm_release": "0.26.0", "vllm_diff_stamp": st})
    assert r["fix"] and r["fix_parts"] == ["fa3_schedule_refresh"] and r["fix_via"] == "diff for 0.26.0"
    assert analysis.fix_label(r) == "diff for 0.26.0 applied (vllm-0.26.0-part1.diff: fa3_schedule_refresh)"
    assert analysis.as_fix({"vllm_diff": "x.diff", "vllm_release": "0.26.0"})["fix_parts"] == ["unknown"]
    whole = analysis.as_fix({"vllm_diff": "patches/vllm-0.22.1-dflash.diff"})
    assert whole["fix_parts"] == list(analysis.FIX_PARTS) and whole["fix_via"] == "upstream diff"
    (tmp_path / "data" / "upstream" / "runs").mkdir(parents=True)
    (tmp_path / "data" / "upstream" / "runs" / "p.jsonl").write_text(json.dumps(_line(
        vllm_release="0.26.0", matrix="part1", engine_id="p", attempt=1, vllm_diff="patches/vllm-0.26.0-part1.diff"))
        + "\n")
    text = findings.release_runs_clause(tmp_path)
    assert "with vllm-0.26.0-part1.diff; session s65) (an engine with a diff: no stock 0.22.1 engine is its control)" in text


def test_greedy_full_runs_pair_with_the_piecewise_run_of_their_own_session_and_round_only(tmp_path):
    """s68: upstream.session_agreement sets the part-1 engine's greedy runs beside 0.26.0 PIECEWISE of the same session,
    round by round (token ids from the digests, log-probabilities along each request's common prefix, each engine's
    own spread between requests); s67's stock FULL runs, whose session ran no PIECEWISE engine, get no row: runs of
    two sessions are never paired."""
    from dflash_lab import upstream

    good, flip = [201] + [7] * 12, [201] + [7] * 5 + [5] + [7] * 6
    g = dict(attempt=1, acceptance=6.0, concurrency=8, prompt_tokens=49, max_tokens=13, weights="dummy",
             temperature=0.0, vllm_release="0.26.0", spec_decode_metrics={"acceptance_length": 6.0})
    lp = [-12.0] * 13

    def run(engine, matrix, session, rnd, graphs, toks, lps, **kw):
        return (_line(run_id=f"{engine}/c8/greedy-r{rnd}", engine_id=engine, matrix=matrix, gpu_session=session,
                      cudagraph_mode=graphs, output_digests=[str(t) for t in toks], round=rnd, **g, **kw), (toks, lps))

    s68, s67 = "2026-12-05-s68", "2026-12-05-s67"
    part1 = dict(vllm_diff="patches/vllm-0.26.0-part1.diff")
    runs = [run("pw", upstream.ACC6_RELEASE_MATRIX, s68, 0, "PIECEWISE", [good] * 8,
                [lp] + [[v + 0.002 for v in lp]] * 7),
            run("pw", upstream.ACC6_RELEASE_MATRIX, s68, 1, "PIECEWISE", [good] * 8, [lp] * 8),
            run("full", upstream.ACC6_RELEASE_MATRIX, s67, 0, "FULL_AND_PIECEWISE", [good] + [flip] * 7, [lp] * 8),
            run("p1", upstream.PART1_RELEASE_MATRIX, s68, 0, "FULL_AND_PIECEWISE", [good] * 8,
                [[v + 0.001 for v in lp]] * 8, **part1),
            run("p1", upstream.PART1_RELEASE_MATRIX, s68, 1, "FULL_AND_PIECEWISE", [good] * 7 + [flip],
                [lp] * 7 + [[v - 0.5 for v in lp]], **part1)]
    by_stem = {}
    for (line, out) in runs:
        by_stem.setdefault(line["matrix"], []).append((line, out))
    for stem, items in by_stem.items():
        data = _greedy(tmp_path, stem, [l for l, _ in items], {l["run_id"]: o for l, o in items}, where="upstream/runs")
    t = upstream.session_agreement([upstream.ACC6_RELEASE_MATRIX, upstream.PART1_RELEASE_MATRIX],
                                   str(data / "upstream" / "runs" / "*.jsonl"), str(data / "runs" / "*.jsonl"),
                                   data_dir=str(data))
    assert list(t["run"]) == ["p1/c8/greedy-r0", "p1/c8/greedy-r1"], t.to_string()
    assert list(t["reference run"]) == ["pw/c8/greedy-r0", "pw/c8/greedy-r1"]
    assert list(t["identical requests"]) == ["8/8", "7/8"] and set(t["GPU session"]) == {s68}
    r0, r1 = t.iloc[0], t.iloc[1]
    assert abs(r0["max |dlogprob| vs reference"] - 0.001) < 1e-9          # part 1 sits 0.001 off both kinds of request
    assert abs(r0["max |dlogprob| within the reference run"] - 0.002) < 1e-9
    assert r0["max |dlogprob| within the FULL run"] < 1e-9 and r0["positions compared"] == 8 * 13
    # the flipped request is compared up to its first different token only (position 6), at 0.5 off
    assert abs(r1["max |dlogprob| vs reference"] - 0.5) < 1e-9 and r1["positions compared"] == 7 * 13 + 6
    # without the PIECEWISE engine's session, nothing pairs
    only = upstream.session_agreement([upstream.PART1_RELEASE_MATRIX], str(data / "upstream" / "runs" / "*.jsonl"),
                                      str(data / "runs" / "*.jsonl"), data_dir=str(data))
    assert only.empty


def test_the_findings_name_the_stale_schedule_as_0_26_0s_cause_only_beside_a_same_session_stock_control(tmp_path):
    """s68: the findings page's part-1 sentence reports the pre-registered verdicts. It concludes that the stale schedule
    makes 0.26.0's tokens wrong only when all four held, the part-1 runs paired with 0.26.0 PIECEWISE of their session,
    and stock FULL left the reference output in that same session; with stock FULL's wrong tokens from another session
    (s68's case: s67) it says what would decide it; a flipped greedy request (prediction (b) failing) gets the verdicts
    and no conclusion."""
    from dflash_lab import findings, upstream, vllmdiff

    good, flip = [201] + [7] * 12, [201] + [7] * 5 + [5] + [7] * 6
    g = dict(attempt=1, acceptance=6.0, concurrency=8, prompt_tokens=49, max_tokens=13, weights="dummy",
             vllm_release="0.26.0", gpu_session="2026-12-05-s68", spec_decode_metrics={"acceptance_length": 6.0})
    stamp = {"hunks_sha256": vllmdiff.hunks_sha256((ROOT / "patches" / "vllm-0.26.0-part1.diff").read_text()),
             "source": "/tmp/vllm-releases/0.26.0/vllm"}
    eng = dict(engine_id="p1", matrix=upstream.PART1_RELEASE_MATRIX, vllm_diff="patches/vllm-0.26.0-part1.diff",
               vllm_diff_stamp=stamp, **g)

    def clause(last_request, stock_wrong, piecewise, stock_right=frozenset()):
        base = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        ref = [_line(run_id="pw/c2/r0", engine_id="pw", cudagraph_mode="PIECEWISE", matrix="ref", output_digests=["a"] * 2,
                     **{**g, "temperature": 0.0, "acceptance": 1.86, "vllm_release": None, "gpu_session": "2026-11-30-s15"})]
        data = _greedy(base, "ref", ref, {"pw/c2/r0": ([good] * 2, [[-1.0] * 13] * 2)})
        outs = {}
        lines = [_line(run_id=f"p1/c8/r{i}", temperature=0.7, round=i, **{**eng, "output_digests": None})
                 for i in range(3)]
        for i in range(2):
            toks = [good] * 7 + [last_request if i == 1 else good]
            lines.append(_line(run_id=f"p1/c8/greedy-r{i}", temperature=0.0, round=i,
                               output_digests=[str(t) for t in toks], **eng))
            outs[lines[-1]["run_id"]] = (toks, [[-1.0] * 13] * 8)
        outs.update({l["run_id"]: ([], []) for l in lines[:3]})
        _greedy(base, "part1", lines, outs, where="upstream/runs")
        if piecewise:
            pw = [_line(run_id=f"r0260-piecewise-acc6/c8/greedy-r{i}", engine_id="r0260-piecewise-acc6", round=i,
                        matrix=upstream.ACC6_RELEASE_MATRIX, cudagraph_mode="PIECEWISE", temperature=0.0,
                        output_digests=[str(good)] * 8, **g) for i in range(2)]
            _greedy(base, "acc6", pw, {l["run_id"]: ([good] * 8, [[-1.0] * 13] * 8) for l in pw}, where="upstream/runs")
        return findings._release_part1_clause(str(data / "upstream" / "runs" / "*.jsonl"), str(data / "runs" / "*.jsonl"),
                                              str(data), stock_wrong, stock_right)

    apart = clause(good, {"s67"}, True)
    assert "gave the reference output in 16 of 16 requests of its 2 greedy runs (all four predictions written before " \
           "its runs held); against 0.26.0 PIECEWISE of the same session, round by round, 16 of 16 requests had " \
           "identical tokens" in apart
    assert apart.endswith("stock FULL's wrong tokens were measured in session s67, on another host: it is decided when "
                          "stock FULL and part 1 run in one session.")
    beside = clause(good, {"s67", "s68"}, True)
    assert beside.endswith(". In session s68 stock FULL left the reference output beside it: part 1 changes nothing but "
                           "the schedule the FULL graph reads, so at this shape the stale schedule is what makes 0.26.0's "
                           "target tokens wrong.")
    unpaired = clause(good, {"s68"}, False)                        # no PIECEWISE run of its session: not concluded
    assert "against 0.26.0 PIECEWISE" not in unpaired and "is what makes" not in unpaired
    assert unpaired.endswith("In session s68 stock FULL left the reference output beside it, but no 0.26.0 PIECEWISE "
                             "run of that session pairs with part 1's runs: not concluded.")
    # the README's next session: stock FULL beside part 1 gives the reference output itself, so nothing is tested
    recur = clause(good, {"s67"}, True, {"s68"})
    assert recur.endswith(". In session s68 stock FULL gave the reference output too, so that session did not test the "
                          "cause: stock FULL's wrong tokens (session s67) did not recur beside part 1.")
    assert "is what makes" not in recur and "predicts" not in recur
    # no stock FULL run with wrong tokens anywhere: nothing for part 1 to be set against, and no session named
    none = clause(good, set(), True, {"s68"})
    assert none.endswith(". No stock FULL greedy run has left the reference output, so part 1 has no wrong tokens to "
                         "be set against.") and "none" not in none.replace("No stock", "")
    bad = clause(flip, {"s68"}, True)
    assert "15 of 16 requests" in bad and "(b) failed" in bad and "(a) held" in bad
    assert "15 of 16 requests had identical tokens" in bad
    assert "is what makes" not in bad and "predicts" not in bad and bad.endswith(").")
    assert findings._release_part1_clause(str(tmp_path / "none" / "*.jsonl"), str(tmp_path / "none2" / "*.jsonl"),
                                          str(tmp_path), {"s67"}) == " No run has tested the stale schedule as the " \
                                                                     "cause on 0.26.0."


@pytest.mark.parametrize("change", [{"host_boot_id": "another-host"}, {"acceptance": 3.6}, {"max_tokens": 12}])
def test_a_piecewise_run_of_another_host_or_workload_is_no_partner(tmp_path, change):
    """upstream.session_agreement pairs within one session only on one host and one workload: a PIECEWISE run of the
    same session label but another host (a host lost mid-session), another synthetic acceptance or another length
    gives the part-1 run no row."""
    from dflash_lab import upstream

    good = [201] + [7] * 12
    g = dict(attempt=1, acceptance=6.0, concurrency=8, prompt_tokens=49, max_tokens=13, weights="dummy", round=0,
             temperature=0.0, vllm_release="0.26.0", gpu_session="2026-12-05-s68", host_boot_id="h1",
             output_digests=[str(good)] * 8)
    p1 = _line(run_id="p1/c8/greedy-r0", engine_id="p1", matrix=upstream.PART1_RELEASE_MATRIX, **g)
    pw = _line(run_id="pw/c8/greedy-r0", engine_id="pw", matrix=upstream.ACC6_RELEASE_MATRIX,
               cudagraph_mode="PIECEWISE", **g)
    outs = ([good] * 8, [[-1.0] * 13] * 8)
    data = _greedy(tmp_path, "part1", [p1], {p1["run_id"]: outs}, where="upstream/runs")
    _greedy(tmp_path, "acc6", [pw], {pw["run_id"]: outs}, where="upstream/runs")
    args = ([upstream.ACC6_RELEASE_MATRIX, upstream.PART1_RELEASE_MATRIX], str(data / "upstream" / "runs" / "*.jsonl"),
            str(data / "runs" / "*.jsonl"))
    assert list(upstream.session_agreement(*args, data_dir=str(data))["identical requests"]) == ["8/8"]
    _greedy(tmp_path, "acc6", [{**pw, **change}], {pw["run_id"]: outs}, where="upstream/runs")
    assert upstream.session_agreement(*args, data_dir=str(data)).empty
