"""dflash_lab.models: the published draft's shape (found in s69) beside the one every GPU run so far assumed."""

import json

import pytest

from dflash_lab import bench, kvgroups, models, vllm_sources
from dflash_lab.errors import LabError


def test_the_draft8_target_carries_the_published_shape_and_differs_from_the_runs_only_in_layers():
    pub = models.PUBLISHED_DRAFT
    d8, d5 = models.TARGETS["qwen36-35b-a3b-draft8"]["draft"], models.TARGETS["qwen36-35b-a3b"]["draft"]
    assert d8 == pub["shape"] and d8["layers"] == 8
    # its sliding-window layers: vLLM 0.22.1 builds a DFlash draft's layers without a per-layer window
    src = vllm_sources.read_source("vllm/model_executor/models/qwen3_dflash.py")
    assert "per_layer_sliding_window" not in src and "layer_types" not in src and "sliding" in pub["layer_types"]
    # ... and the engine's CacheConfig.sliding_window is the target's, set only when the target is all sliding window
    args = vllm_sources.read_source("vllm/engine/arg_utils.py")
    i = args.index("sliding_window: int | None = None")
    assert "is_interleaved" in args[i:i + 600] and "sliding_window = model_config.get_sliding_window()" in args[i:i + 600]
    assert {k for k in d5 if d5[k] != d8[k]} == {"layers"} and d5["layers"] == 5
    # the rest of the published config is what the dummy draft gets from the target (hidden size, vocabulary)
    assert pub["hidden_size"] == models.QWEN36_TEXT["hidden_size"] and pub["vocab_size"] == models.QWEN36_TEXT["vocab_size"]
    assert models.TARGETS["qwen36-35b-a3b-draft8"]["text"] is models.QWEN36_TEXT
    assert all(s["where"] and s["what"] for s in pub["sources"]) and len(pub["revision"]) == 40


def test_the_quoted_checkpoint_size_is_what_eight_layers_weigh():
    """A source quotes 905 MB for the checkpoint: 8 layers of this shape in bf16, without the LM head the draft shares
    with the target, weigh 904 MiB; 5 layers would weigh 580 MiB (bench.draft_params counts the LM head it reads)."""
    head = models.QWEN36_TEXT["vocab_size"] * models.QWEN36_TEXT["hidden_size"]
    mib = {n: (bench.draft_params(models.QWEN36_TEXT, dict(models.PUBLISHED_DRAFT["shape"], layers=n)) - head) * 2 / 2**20
           for n in (5, 8)}
    assert round(mib[8]) == 904 and round(mib[5]) == 580
    assert "904 MiB" in json.dumps(models.PUBLISHED_DRAFT) and "580 MiB" in json.dumps(models.PUBLISHED_DRAFT)


def test_the_published_draft_splits_the_targets_attention_as_the_runs_draft_does():
    """vLLM 0.22.1's own grouping (run on the CPU): with 8 draft layers the target's attention layers 7, 15, 23, 31, 39
    still form a group that reuses another group's metadata, at TP 1, 2 and 4 (the report's); with 10 they would not."""
    for tp in (1, 2, 4):
        r8 = kvgroups.metadata_reusers(kvgroups.groups(kvgroups.rank_layers(tp, draft_layers=8)))
        r5 = kvgroups.metadata_reusers(kvgroups.groups(kvgroups.rank_layers(tp, draft_layers=5)))
        assert (kvgroups.reusing_layers(kvgroups.rank_layers(tp, draft_layers=8))
                == kvgroups.reusing_layers(kvgroups.rank_layers(tp, draft_layers=5)) == [[7, 15, 23, 31, 39]]), tp
        assert [g["gid"] for g in r8] == [5] and [g["gid"] for g in r5] == [7]
    assert kvgroups.metadata_reusers(kvgroups.groups(kvgroups.hybrid_layers(draft_layers=10))) == []


def test_build_writes_the_eight_layer_draft(tmp_path):
    paths = models.build("qwen36-35b-a3b-draft8", tmp_path)
    cfg = json.loads((tmp_path / "qwen36-35b-a3b-draft8" / "draft" / "config.json").read_text())
    assert paths["draft"] and cfg["num_hidden_layers"] == 8 and cfg["layer_types"] == ["full_attention"] * 8
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (4, 128, 6144)
    assert cfg["dflash_config"] == {"mask_token_id": 248070, "target_layer_ids": [1, 10, 19, 28, 37]}


def _draft8_lines(tmp_path, stock=("crash",) * 3, fix=("ok",) * 3, pw=("ok",) * 2, gid=5, buffer=None, layers=8,
                  fault="copy_and_expand_dflash_inputs_kernel", fix_session="2026-12-06-s70", attempts=False):
    """draft8-c32-tp1 in small: its stock engine (each run with a stored schedule snapshot), the fix and PIECEWISE.
    ``attempts``: each stock run its own engine start (a crash restarts it), .aN's snapshot holding query rows 128 + N - 1
    in the reusing group, as the runner stores one per start."""
    import pandas as pd

    from dflash_lab import fa3sched

    data = tmp_path / "data"
    stem = "2026-12-06_h200_draft8-c32-tp1"
    draft = dict(models.PUBLISHED_DRAFT["shape"], layers=layers)
    snap = data / "gpu" / stem / "d8-stock-snap-c32.a1.sched"
    snap.mkdir(parents=True)
    reuse = [f"language_model.model.layers.{i}.self_attn.attn" for i in (7, 15, 23, 31, 39)]
    first = [f"language_model.model.layers.{i}.self_attn.attn" for i in (3, 11, 19, 27, 35)]
    line = {"kind": "sched_snapshot", "pid": 1, "groups": [
        {"gid": gid - 1, "layers": first, "use_full_cuda_graph": True, "entries": 97, "buffer": [128, 32, 7]},
        {"gid": gid, "layers": reuse, "use_full_cuda_graph": True, "entries": 97,
         "buffer": list(buffer or fa3sched.STALE_S39)}]}
    (snap / "sched-1.jsonl").write_text(json.dumps(line) + "\n")
    if attempts:
        for n in range(2, len(stock) + 1):
            other = snap.parent / f"d8-stock-snap-c32.a{n}.sched"
            other.mkdir()
            groups = [dict(g) for g in line["groups"]]
            groups[1]["buffer"] = [128 + n - 1] + groups[1]["buffer"][1:]
            (other / f"sched-{n}.jsonl").write_text(json.dumps(dict(line, groups=groups)) + "\n")
    rows = []

    def add(engine, i, outcome, session="2026-12-06-s70", **kw):
        rows.append({"matrix": "draft8-c32-tp1", "file": f"{stem}.jsonl", "gpu_session": session,
                     "run_id": f"{engine}/c32/r{i}", "engine_id": engine, "started_at": f"{engine}{i}",
                     "concurrency": 32, "outcome": outcome, "crashed": outcome == "crash",
                     "requests_completed": 32 if outcome == "ok" else 5, "log": f"/tmp/x/{engine}.a1.log",
                     "target": {"name": "qwen36-35b-a3b-draft8"}, "draft": draft, **kw})

    for i, o in enumerate(stock):
        add("d8-stock-snap-c32", i, o, fault={"kernel": fault} if o == "crash" and fault else None,
            **({"log": f"/tmp/x/d8-stock-snap-c32.a{i + 1}.log"} if attempts else {}))
    for i, o in enumerate(fix):
        add("d8-fix-c32", i, o, session=fix_session)
    for i, o in enumerate(pw):
        add("d8-piecewise-c32", i, o)
    return pd.DataFrame(rows), str(data)


def test_draft8_predictions_hold_on_the_predicted_runs_and_each_can_fail(tmp_path):
    from dflash_lab import verification as V

    df, data = _draft8_lines(tmp_path)
    t = V.draft8_predictions(df, data_dir=data)
    judged = t[t["held"].notna()]
    assert judged["held"].all() and len(judged) == 3 * 4 + 3 * 2 + 2 * 2 + 3
    assert sorted(set(judged["prediction"].str.slice(0, 3))) == ["(0)", "(a)", "(b)", "(c)", "(d)", "(e)"]
    assert "group 5 holding [128, 0, 31, 0, 1, 0, 0, 0, 2]" in set(t["measured"])
    # one reading per stock run, after (b), never judged: s39's own schedule reads as s39's on both counts
    after = t[t["held"].isna()]
    assert list(after["prediction"].str.slice(0, 18)) == ["(b, after the run)"] * 3
    assert set(after["measured"]) == {"written [128, 1, 2] (as s39's [128, 1, 2]); padding [0, 31, 0, 0, 0, 0, 0, 0, 0] "
                                      "(as s39's)"}
    # the 5-layer grouping's number, another schedule, a cuBLAS kernel, a fix without a crashed control in its session,
    # a PIECEWISE crash, a 5-layer draft: each fails on its own
    for kw, tag in [(dict(gid=7), "(b)"), (dict(buffer=[128, 0, 31, 0, 2, 0, 0, 0, 3]), "(b)"),
                    (dict(fault="cublasLt_gemm_kernel"), "(c)"), (dict(fix_session="2026-12-07-s71"), "(d)"),
                    (dict(pw=("ok", "crash")), "(e)"), (dict(layers=5), "(0)"), (dict(stock=("crash", "crash", "ok")), "(a)(c)"),
                    (dict(pw=("ok",)), "(e)"), (dict(fault="triton_poi_fused_7"), "")]:
        d, dd = _draft8_lines(tmp_path / f"x{len(list(tmp_path.iterdir()))}", **kw)
        bad = V.draft8_predictions(d, data_dir=dd)
        failed = set(bad.loc[bad["held"].notna() & ~bad["held"].astype(bool), "prediction"].str.slice(0, 3))
        assert failed == {tag[i:i + 3] for i in range(0, len(tag), 3)}, (kw, failed)   # a completed run names no core
    # a start-up error or a deadline cut measures nothing: not judged, no snapshot needed, and the count falls short
    d, dd = _draft8_lines(tmp_path / "cut", stock=("crash", "crash", "startup_error"))
    cut = V.draft8_predictions(d, data_dir=dd)
    row = cut[cut["run"].str.endswith("d8-stock-snap-c32/c32/r2")]
    assert list(row["measured"]) == ["(8, 4, 128)", "start-up error"] and row["held"].iloc[1] is None
    assert not cut.loc[cut["prediction"] == "(a) runs measured of those planned", "held"].iloc[0]
    assert V.draft8_predictions(df.iloc[:0], data_dir=data).empty   # not run yet: nothing to judge


def test_draft8_snapshots_list_every_group_of_every_measured_stock_run(tmp_path):
    from dflash_lab import verification as V

    df, data = _draft8_lines(tmp_path, stock=("crash", "crash", "startup_error"))
    t = V.draft8_snapshots(df, data_dir=data)
    # two measured stock runs (one engine's snapshot each), two groups each; the start-up error and other engines are out
    assert list(t["group"]) == [4, 5, 4, 5]
    assert list(t["layers"]) == ["target 3, 11, 19, 27, 35", "target 7, 15, 23, 31, 39"] * 2
    assert list(t["buffer"])[:2] == ["[128, 32, 7]", "[128, 0, 31, 0, 1, 0, 0, 0, 2]"]
    assert V.draft8_snapshots(df.iloc[:0], data_dir=data).empty
    # one engine start per run: each run reads its own start's snapshot, not the first one's
    d3, dd3 = _draft8_lines(tmp_path / "starts", attempts=True)
    each = V.draft8_snapshots(d3, data_dir=dd3)
    assert list(each[each["group"] == 5]["buffer"].str.slice(0, 5)) == ["[128,", "[129,", "[130,"]
    import shutil
    shutil.rmtree(tmp_path / "data" / "gpu")
    with pytest.raises(LabError, match="no schedule snapshot stored"):
        V.draft8_snapshots(df, data_dir=data)


def test_draft8_work_reads_each_measured_runs_counters(tmp_path):
    from dflash_lab import verification as V

    df, _ = _draft8_lines(tmp_path, pw=("ok", "startup_error"))
    df["output_tokens"] = [None, None, None, 16384, 16384, 16384, 16384, None]
    df["wall_s"] = 10.04
    df["spec_decode_metrics"] = [None] * 3 + [{"num_drafts": 8794, "acceptance_length": 1.86184}] * 4 + [None]
    t = V.draft8_work(df)
    assert len(t) == 7   # the start-up error measured nothing
    fix = t[t["engine"] == "d8-fix-c32"].iloc[0]
    assert (fix["requests completed"], fix["output tokens"], fix["drafts"], fix["mean acceptance length"],
            fix["wall s"]) == ("32 of 32", 16384, 8794, 1.862, 10.0)
    crash = t[t["engine"] == "d8-stock-snap-c32"].iloc[0]
    import pandas as pd
    assert crash["outcome"] == "crash" and pd.isna(crash["drafts"]) and crash["requests completed"] == "5 of 32"


def _draft8_fix_lines(stock="crash", fix_sampled=("ok",) * 10, fix_greedy=("ok",) * 3, pw=("ok",) * 3, acc=1.86,
                      drafts=8800, differ=(0, 1, 2), fault="copy_and_expand_dflash_inputs_kernel",
                      stock_session="2026-12-07-s72", layers=8, sampled_digests=False):
    """draft8-fix-c32-tp1 in small, run ids as the runner writes them (ENGINE/cC/rR, a tagged entry's ENGINE/cC/TAG-rR,
    rounds from 0 in each entry): a stock control, the fix (sampled, then greedy with digests), greedy PIECEWISE; in
    greedy pair i, ``differ[i]`` of the 32 requests carry another digest on the fix's side. ``sampled_digests``: the
    sampled fixed runs record digests too (all differing), which the temperature must keep out of the pairs."""
    import pandas as pd

    draft = dict(models.PUBLISHED_DRAFT["shape"], layers=layers)
    rows = []

    def add(engine, tag, i, outcome, session="2026-12-07-s72", **kw):
        rows.append({"matrix": "draft8-fix-c32-tp1", "file": "2026-12-07_h200_draft8-fix-c32-tp1.jsonl",
                     "gpu_session": session, "run_id": f"{engine}/c32/{tag}r{i}", "engine_id": engine,
                     "started_at": f"{engine}{tag}{i:02d}", "concurrency": 32, "round": i, "outcome": outcome,
                     "crashed": outcome == "crash", "requests_completed": 32 if outcome == "ok" else 3,
                     "target": {"name": "qwen36-35b-a3b-draft8"}, "draft": draft, "cudagraph_mode": "FULL_AND_PIECEWISE",
                     "fix": False, "temperature": 0.7, "output_digests": None, "spec_decode_metrics": None,
                     "output_tokens": 16384 if outcome == "ok" else None, **kw})

    add("d8f-stock-control-c32", "", 0, stock, session=stock_session,
        fault={"kernel": fault} if stock == "crash" else None)
    metrics = {"num_drafts": drafts, "acceptance_length": acc}
    for i, o in enumerate(fix_sampled):
        add("d8f-fix-c32", "", i, o, fix=True, spec_decode_metrics=metrics,
            output_digests=["s"] * 32 if sampled_digests else None)
    for i, o in enumerate(fix_greedy):
        n = differ[i] if i < len(differ) else 0
        add("d8f-fix-c32", "greedy-", i, o, fix=True, spec_decode_metrics=metrics, temperature=0.0,
            output_digests=["x"] * n + ["a"] * (32 - n))
    for i, o in enumerate(pw):
        add("d8f-piecewise-c32", "greedy-", i, o, cudagraph_mode="PIECEWISE", temperature=0.0,
            output_digests=["a"] * 32, spec_decode_metrics=metrics)
    return pd.DataFrame(rows)


def test_draft8_fix_predictions_hold_on_the_predicted_runs_and_each_can_fail():
    from dflash_lab import verification as V

    t = V.draft8_fix_predictions(_draft8_fix_lines())
    assert t["held"].all(), t[~t["held"].astype(bool)]
    tags = t["prediction"].str.split(" ").str[0]
    assert dict(tags.value_counts()) == {"(0)": 17, "(a)": 2, "(b)": 14, "(c)": 4, "(d)": 4, "(standard)": 1}
    pairs = t[t["prediction"].str.startswith("(d) the greedy")]
    assert list(pairs["measured"]) == ["32/32", "31/32", "30/32"]
    assert list(pairs["run"])[0] == "d8f-fix-c32/c32/greedy-r0 vs d8f-piecewise-c32/c32/greedy-r0"
    assert t.iloc[-1]["measured"] == "13 completed, 0 not completed"
    # sampled runs that recorded digests (temperature 0.7) never pair with the greedy PIECEWISE runs of their round
    assert t.equals(V.draft8_fix_predictions(_draft8_fix_lines(sampled_digests=True)))
    for kw, failed in [(dict(stock="ok"), {"(a)", "(standard)"}), (dict(fault="cublasLt_gemm_kernel"), {"(a)"}),
                       (dict(layers=5), {"(0)"}),
                       (dict(fix_sampled=("ok",) * 9 + ("crash",)), {"(b)", "(standard)"}),
                       (dict(fix_sampled=("ok",) * 10 + ("timeout",)), {"(b)", "(standard)"}),
                       (dict(acc=1.02), {"(b)"}), (dict(drafts=7000), {"(b)"}), (dict(differ=(0, 3, 0)), {"(d)"}),
                       (dict(pw=("ok", "ok", "crash")), {"(c)", "(d)"}),
                       (dict(stock_session="2026-12-08-s73"), {"(standard)"}),
                       (dict(fix_sampled=("ok",) * 6), {"(b)", "(standard)"})]:
        bad = V.draft8_fix_predictions(_draft8_fix_lines(**kw))
        got = set(bad.loc[~bad["held"].fillna(True).astype(bool), "prediction"].str.split(" ").str[0])
        assert got == failed, (kw, got)
    # a start-up error is listed, not judged, and the count falls short
    cut = V.draft8_fix_predictions(_draft8_fix_lines(pw=("ok", "ok", "startup_error")))
    assert cut["held"].isna().sum() == 1 and not cut[cut["run"] == "draft8-fix-c32-tp1/d8f-piecewise-c32"]["held"].iloc[0]
    assert V.draft8_fix_predictions(_draft8_fix_lines().iloc[:0]).empty   # not run yet: nothing to judge


def test_draft8_reading_after_the_run_tells_written_entries_from_padding():
    from dflash_lab import verification as V

    s70 = [128, 0, 31, 0, 1, 961132910, -1172882937, 981350886, 2, 959494760, 980073037, 976140736]
    assert V._one_request_reading(s70) == ("written [128, 1, 2] (as s39's [128, 1, 2]); padding [0, 31, 0, 0x3949b96e, "
                                           "-0x45e8c5f9, 0x3a7e39e6, 0x3930ba68, 0x3a6aba4d, 0x3a2eb9c0] (not as s39's)")
    assert V._one_request_reading([128, 0, 31, 0, 2, 0, 0, 0, 2]).startswith("written [128, 2, 2] (not as s39's")
    # a schedule of more than one request (entries past the 13th) is said to be none
    assert V._one_request_reading([128] * 20).startswith("not a 1-request schedule")


def test_draft8_recorded_runs_are_judged_as_notebook_03_says(root):
    """s70's stock run and s71's whole matrix: (0), (a), (c), (d), (e) held on every run, (b) on none as written
    (s39's written entries, another padding, the same in every engine), and every planned run was measured."""
    from dflash_lab import analysis
    from dflash_lab import verification as V

    t = V.draft8_predictions(analysis.load_runs(str(root / "data" / "runs" / "*.jsonl"), published_draft=True),
                             data_dir=str(root / "data"))
    runs = t[t["run"].str.count("/") > 1]
    held = {k: set(g["held"].map(repr)) for k, g in runs.groupby(runs["prediction"].str.slice(0, 3))}
    assert held == {"(0)": {"True"}, "(a)": {"True"}, "(b)": {"False"}, "(b,": {"None"}, "(c)": {"True"},
                    "(d)": {"True"}, "(e)": {"True"}}
    assert set(runs[runs["prediction"].str.startswith("(c)")]["measured"]) == {"copy_and_expand_dflash_inputs_kernel"}
    after = set(runs[runs["prediction"].str.startswith("(b, after")]["measured"])
    assert len(after) == 1 and next(iter(after)).startswith("written [128, 1, 2] (as s39's")
    counts = t[t["prediction"].str.contains("runs measured")]
    assert list(counts["measured"]) == ["4", "3", "2"] and counts["held"].all()


def test_draft8_predictions_read_the_draft_where_the_runner_writes_it(root, tmp_path):
    """The runner's own lines (fake engine) for the matrix as committed: (0) reads their draft, the fix and PIECEWISE
    rows judge them, and the stock run without a stored snapshot is refused by name."""
    import os
    import subprocess
    import sys

    import pandas as pd
    import pytest
    import yaml

    from dflash_lab import verification as V
    from dflash_lab.errors import LabError
    from dflash_lab.runner import read_lines

    m = yaml.safe_load((root / "matrices" / "draft8-c32-tp1.yaml").read_text())
    m.update(worker="fake_worker", models_dir=str(tmp_path / "models"), run_timeout_s=30, startup_timeout_s=30,
             coredump_wait_s=1)
    for e in m["engines"]:
        e["runs"] = [{"concurrency": 2, "rounds": 1}]
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(m))
    env = {**os.environ, "PYTHONPATH": f"{root}:{root / 'tests'}", "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "dflash_lab", "run", str(tmp_path / "m.yaml"), "--out",
                        str(tmp_path / "runs.jsonl"), "--logs", str(tmp_path / "logs")], capture_output=True, text=True,
                       env=env, cwd=root, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    df = pd.DataFrame([dict(x, file="2026-12-06_h200_draft8-c32-tp1.jsonl", crashed=x["outcome"] == "crash")
                       for x in read_lines(tmp_path / "runs.jsonl")])
    with pytest.raises(LabError, match="d8-stock-snap-c32/c2/r0: no schedule snapshot stored"):
        V.draft8_predictions(df, data_dir=str(tmp_path / "data"))
    t = V.draft8_predictions(df[df["engine_id"] != "d8-stock-snap-c32"], data_dir=str(tmp_path / "data"))
    assert list(t["prediction"].str.slice(0, 3)) == ["(0)", "(d)", "(0)", "(e)", "(a)", "(d)", "(e)"]
    assert t.iloc[0]["measured"] == "(8, 4, 128)" and t.iloc[0]["held"] and t.iloc[3]["held"]
    assert not t.iloc[1]["held"]   # the fix's row: no crashed stock engine in its session
    assert list(t["measured"].iloc[4:]) == ["0", "1", "1"] and not t["held"].iloc[4:].any()   # 1 run each, not 3/3/2


def test_draft8_predictions_refuse_what_they_cannot_check(tmp_path):
    import shutil

    import pytest

    from dflash_lab import verification as V
    from dflash_lab.errors import LabError

    df, data = _draft8_lines(tmp_path)
    shutil.rmtree(tmp_path / "data" / "gpu" / "2026-12-06_h200_draft8-c32-tp1" / "d8-stock-snap-c32.a1.sched")
    with pytest.raises(LabError, match="no schedule snapshot stored"):
        V.draft8_predictions(df, data_dir=data)
    df, data = _draft8_lines(tmp_path / "b")
    df.loc[0, "engine_id"] = "other"
    with pytest.raises(LabError, match="is not one of draft8-c32-tp1's"):
        V.draft8_predictions(df, data_dir=data)


def test_load_runs_keeps_the_published_drafts_lines_apart_unless_asked(root, tmp_path):
    """Every table of the runs' own configuration reads analysis.load_runs' default, so a draft8 line never joins their
    counts (a review found seven places that would have merged it); notebook 03's draft8 section asks for it."""
    from dflash_lab import analysis

    src = sorted((root / "data" / "runs").glob("*.jsonl"))[0]
    line = json.loads(src.read_text().splitlines()[0])
    d8 = dict(line, run_id="d8-stock-snap-c32/c32/r0", matrix="draft8-c32-tp1",
              target=dict(line["target"], name="qwen36-35b-a3b-draft8"), draft=models.PUBLISHED_DRAFT["shape"])
    (tmp_path / "a.jsonl").write_text(json.dumps(line) + "\n" + json.dumps(d8) + "\n")
    pattern = str(tmp_path / "*.jsonl")
    assert list(analysis.load_runs(pattern)["run_id"]) == [line["run_id"]]
    assert list(analysis.load_runs(pattern, published_draft=True)["run_id"]) == [line["run_id"], d8["run_id"]]


def _draft8_probe_lines(stock="crash", fix="ok", greedy=("ok",) * 3, pw=("ok",) * 3, drafts=(8800, 8800),
                        differ=(0, 1, 2), layers=8):
    """draft8-probe-c32-tp1 in small, run ids as the runner writes them: stock and the fix probed (one run each, 0.7),
    then the greedy pair's engines (3 rounds each, digests); ``drafts``: the fix's and PIECEWISE's draft counts."""
    import pandas as pd

    draft = dict(models.PUBLISHED_DRAFT["shape"], layers=layers)
    rows = []

    def add(engine, tag, i, outcome, **kw):
        rows.append({"matrix": "draft8-probe-c32-tp1", "file": "2026-12-08_h200_draft8-probe-c32-tp1.jsonl",
                     "gpu_session": "2026-12-08-s73", "run_id": f"{engine}/c32/{tag}r{i}", "engine_id": engine,
                     "attempt": 1, "concurrency": 32, "round": i, "outcome": outcome, "crashed": outcome == "crash",
                     "requests_completed": 32 if outcome == "ok" else 3, "target": {"name": "qwen36-35b-a3b-draft8"},
                     "draft": draft, "cudagraph_mode": "FULL_AND_PIECEWISE", "fix": False, "temperature": 0.7,
                     "output_digests": None, "spec_decode_metrics": None, **kw})

    add("d8p-stock-probe-c32", "", 0, stock, probe=True)
    add("d8p-fix-probe-c32", "", 0, fix, probe=True, fix=True)
    for i, o in enumerate(greedy):
        n = differ[i] if i < len(differ) else 0
        add("d8p-fix-greedy-c32", "greedy-", i, o, fix=True, temperature=0.0, output_digests=["x"] * n + ["a"] * (32 - n),
            spec_decode_metrics={"num_drafts": drafts[0]})
    for i, o in enumerate(pw):
        add("d8p-piecewise-greedy-c32", "greedy-", i, o, cudagraph_mode="PIECEWISE", temperature=0.0,
            output_digests=["a"] * 32, spec_decode_metrics={"num_drafts": drafts[1]})
    return pd.DataFrame(rows)


def _draft8_probes(stock_layers=("L7 attn", "L8 gdn"), stock_first=3, stock_nan=273.0, fix_div=0, fix_max=0.0,
                   fix_full=283, fix_err=0, missing=()):
    """verification.probe_table's rows for the two probed engines (only the columns the judge reads)."""
    import pandas as pd

    rows = [{"session": "2026-12-08_h200_draft8-probe-c32-tp1", "engine": "d8p-stock-probe-c32.a1", "FULL steps": 274,
             "FULL steps diverging": 274, "FULL steps ended by an error": 0, "first FULL step": 3,
             "first diverging step": float(stock_first), "last layer written identically": stock_layers[0],
             "first layer written differently": stock_layers[1], "first NaN step": stock_nan, "max |output diff|": 5.6},
            {"session": "2026-12-08_h200_draft8-probe-c32-tp1", "engine": "d8p-fix-probe-c32.a1", "FULL steps": fix_full,
             "FULL steps diverging": fix_div, "FULL steps ended by an error": fix_err, "first FULL step": 3,
             "first diverging step": float("nan"), "last layer written identically": None,
             "first layer written differently": None, "first NaN step": float("nan"), "max |output diff|": fix_max}]
    return pd.DataFrame([r for r in rows if r["engine"].split(".")[0] not in missing])


def test_draft8_probe_predictions_hold_on_the_predicted_runs_and_each_can_fail():
    from dflash_lab import verification as V

    t = V.draft8_probe_predictions(_draft8_probe_lines(), _draft8_probes())
    assert t["held"].all(), t[~t["held"].astype(bool)]
    tags = t["prediction"].str.split(" ").str[0]
    assert dict(tags.value_counts()) == {"(0)": 8, "(a)": 2, "(b)": 2, "(c)": 6 + 6 + 3}
    # stock completing but its probe recording NaN still holds (a); completing without NaN does not
    assert V.draft8_probe_predictions(_draft8_probe_lines(stock="ok"), _draft8_probes())["held"].all()
    for lines, probes, failed in [
            (dict(stock="ok"), dict(stock_nan=float("nan")), {"(a)"}),
            ({}, dict(stock_layers=("L15 attn", "L16 gdn")), {"(a)"}),
            ({}, dict(stock_first=40), {"(a)"}),
            ({}, dict(missing=("d8p-stock-probe-c32",)), {"(a)"}),
            (dict(layers=5), {}, {"(0)"}),
            (dict(fix="crash"), {}, {"(b)"}), ({}, dict(fix_div=1), {"(b)"}), ({}, dict(fix_max=0.0039), {"(b)"}),
            ({}, dict(fix_full=150), {"(b)"}), ({}, dict(fix_err=1), {"(b)"}),
            (dict(drafts=(8800, 8802)), {}, {"(c)"}), (dict(differ=(0, 3, 0)), {}, {"(c)"}),
            (dict(pw=("ok", "ok", "crash")), {}, {"(c)"}), (dict(greedy=("ok", "ok")), {}, {"(c)"})]:
        bad = V.draft8_probe_predictions(_draft8_probe_lines(**lines), _draft8_probes(**probes))
        got = set(bad.loc[~bad["held"].fillna(True).astype(bool), "prediction"].str.split(" ").str[0])
        assert got == failed, (lines, probes, got)
    cut = V.draft8_probe_predictions(_draft8_probe_lines(fix="startup_error"), _draft8_probes())
    assert cut["held"].isna().sum() == 1
    assert not cut[cut["run"] == "draft8-probe-c32-tp1/d8p-fix-probe-c32"]["held"].iloc[0]
    assert V.draft8_probe_predictions(_draft8_probe_lines().iloc[:0]).empty   # not run yet: nothing to judge


def test_a_published_draft_probe_log_stays_out_of_the_default_probe_table(tmp_path, monkeypatch):
    import json

    from dflash_lab import analysis, verification as V

    monkeypatch.chdir(tmp_path)
    stem = "2099-01-01_h200_x-tp1"
    (tmp_path / "data" / "runs").mkdir(parents=True)
    line = {"run_id": "e/c32/r0", "engine_id": "e", "attempt": 1, "outcome": "ok", "target": {"name": "qwen36-35b-a3b-draft8"}}
    (tmp_path / "data" / "runs" / f"{stem}.jsonl").write_text(json.dumps(line) + "\n")
    log = tmp_path / "data" / "gpu" / stem / "e.a1.probe" / "probe-1.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text("")
    assert V._apart_probe(str(log.relative_to(tmp_path)), "e.a1")
    assert not V._apart_probe(str(log.relative_to(tmp_path)), "other.a1")
    (tmp_path / "data" / "runs" / f"{stem}.jsonl").write_text(json.dumps(dict(line, target={"name": "qwen36-35b-a3b"})) + "\n")
    assert not V._apart_probe(str(log.relative_to(tmp_path)), "e.a1")
    assert analysis.APART_TARGETS == ("qwen36-35b-a3b-draft8",)
