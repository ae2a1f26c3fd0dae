"""discriminate: predictions from a run's configuration (never its outcome), what the engine log says ran, and
whether outcomes agree - including a control that did not draft, which must not count as agreeing."""

import json

import pytest

from dflash_lab import analysis, discriminate

DRAFT = {"layers": 5, "heads": 32, "kv_heads": 4, "head_dim": 128}

# lines in the form vLLM 0.22.1 logs them (from the engines' own logs in data/gpu)
FA3_LOG = """(EngineCore pid=864) INFO [core.py:112] Initializing a V1 LLM engine (v0.22.1) with config: compilation_config={'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>, 'x': 1}
(EngineCore pid=864) INFO [unquantized.py:212] Using TRITON Unquantized MoE backend out of potential backends: ['TRITON'].
(EngineCore pid=864) INFO [cuda.py:378] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLASHINFER', 'TRITON_ATTN', 'FLEX_ATTENTION'].
(EngineCore pid=864) INFO [cuda.py:378] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLEX_ATTENTION'].
Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  50%
Capturing CUDA graphs (decode, FULL):  50%
(EngineCore pid=864) INFO [core.py:302] init engine (profile, create kv cache, warmup model) took 190.71 s (compilation: 65.84 s)
"""
TRITON_LOG = FA3_LOG.replace(
    "Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLASHINFER', 'TRITON_ATTN', 'FLEX_ATTENTION'].",
    "Using AttentionBackendEnum.TRITON_ATTN backend.")
PIECEWISE_LOG = FA3_LOG.replace("FULL_AND_PIECEWISE: (2, 1)", "PIECEWISE: (1, 1)").replace(
    "Capturing CUDA graphs (decode, FULL):  50%\n", "")


def line(**kw):
    r = {"spec_method": "dflash", "num_speculative_tokens": 15, "draft": DRAFT, "cudagraph_mode": "FULL_AND_PIECEWISE",
         "enforce_eager": False, "fix": False, "fix_parts": None, "engine_args": {}, "concurrency": 32,
         "probe": False, "canary": False, "coredump": True, "env": {}, "hook_dir": None,
         "matrix": "discriminate2-tp1", "gpu_session": "s-test", "engine_id": "e", "attempt": 1, "round": 0,
         "outcome": "ok", "output_tokens": 16384,
         "spec_decode_metrics": {"num_drafts": 8800, "acceptance_length": 1.86}}
    r.update(kw)
    return r


def test_engine_facts_read_the_log():
    f = discriminate.engine_facts(FA3_LOG)
    assert f == {"cudagraph_mode": "FULL_AND_PIECEWISE", "full_graphs_captured": True,
                 "target_attention": "FLASH_ATTN", "drafter_attention": "FLASH_ATTN", "split_bounds_changed": None}
    t = discriminate.engine_facts(TRITON_LOG)
    assert t["target_attention"] == "TRITON_ATTN" and t["drafter_attention"] == "FLASH_ATTN"
    p = discriminate.engine_facts(PIECEWISE_LOG)
    assert p["cudagraph_mode"] == "PIECEWISE" and p["full_graphs_captured"] is False
    # a log stored as its tail only (no start-up) says nothing rather than "no FULL graphs"
    assert discriminate.engine_facts("INFO Engine 000: Avg generation throughput")["full_graphs_captured"] is None
    # an engine that died during graph capture has not shown that it captures no FULL graphs
    died = FA3_LOG.split("Capturing CUDA graphs (decode")[0]
    f = discriminate.engine_facts(died)
    assert f["full_graphs_captured"] is None and f["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert discriminate.predict(line(), f)[0] == "crash"
    # the plugin's one-sided split bound, as its lines read in s18's drafter-splits1 logs
    sp = discriminate.engine_facts(FA3_LOG + (
        "(EngineCore pid=4206) dflash-lab [4206]: FA3 splits: drafter builder of model.layers.40.self_attn.attn .. "
        "(5 layers): max_num_splits 32 -> 1\n(EngineCore pid=4206) dflash-lab [4206]: FA3 splits: drafter builder of "
        "model.layers.40.self_attn.attn: max_num_splits 32 -> 1\n"))
    assert sp["split_bounds_changed"] == "drafter 32 -> 1"


def test_which_builders_reuse_metadata_is_read_from_vllm_source():
    assert discriminate.builder_reuses_metadata("FLASH_ATTN") is True
    assert discriminate.builder_reuses_metadata("TRITON_ATTN") is False
    assert discriminate.builder_reuses_metadata("SOMETHING_ELSE") is None
    assert discriminate.predict(line(engine_args={"attention_config": {"backend": "SOMETHING_ELSE"}}))[0] == "open"


@pytest.mark.parametrize("kw,expected", [
    ({}, "crash"),                                                             # the crash configuration
    ({"concurrency": 16}, "open"),                                             # divergence, no crash shown below 32
    ({"fix": True, "fix_parts": ["fa3_schedule_refresh"]}, "completes"),      # part 1 alone
    ({"fix": True, "fix_parts": ["dflash_kernel", "lookahead"]}, "crash"),    # fix 1: no part 1
    ({"fix": True}, "crash"),                                                  # fix 1 lines before fix_parts existed
    ({"cudagraph_mode": "FULL_DECODE_ONLY"}, "crash"),                         # FULL verify graphs still replay
    ({"cudagraph_mode": "PIECEWISE"}, "completes"),
    ({"enforce_eager": True}, "completes"),
    ({"engine_args": {"attention_config": {"backend": "TRITON_ATTN"}}}, "completes"),
    ({"engine_args": {"attention_config": {"flash_attn_max_num_splits_for_cuda_graph": 1}}}, "open"),
    ({"spec_method": "mtp", "draft": None}, "completes"),                     # one attention group (vLLM's grouping)
    ({"draft": dict(DRAFT, layers=10)}, "completes"),                          # a 10-layer draft does not split them
    ({"draft": dict(DRAFT, kv_heads=2, head_dim=256)}, "completes"),           # a draft of the target's shape neither
])
def test_predictions_come_from_the_configuration(kw, expected):
    assert discriminate.predict(line(**kw))[0] == expected


def test_the_engine_log_overrides_what_the_run_asked_for():
    asked_triton = line(engine_args={"attention_config": {"backend": "TRITON_ATTN"}})
    ran_fa3 = discriminate.engine_facts(FA3_LOG)
    assert discriminate.predict(asked_triton, ran_fa3)[0] == "crash"
    assert discriminate.predict(line(), discriminate.engine_facts(TRITON_LOG))[0] == "completes"
    assert discriminate.predict(line(), discriminate.engine_facts(PIECEWISE_LOG))[0] == "completes"


def _df(tmp_path, lines, logs):
    """Lines through the real loader (data/runs + data/gpu layout under tmp_path)."""
    runs = tmp_path / "data" / "runs"
    runs.mkdir(parents=True)
    f = runs / "x_discriminate.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in lines))
    gpu = tmp_path / "data" / "gpu" / "x_discriminate"
    gpu.mkdir(parents=True)
    for name, text in logs.items():
        (gpu / name).write_text(text)
    return analysis.load_runs(str(runs / "*.jsonl"))


def test_table_agreement_and_controls(tmp_path):
    lines = [
        line(engine_id="stock", outcome="crash", spec_decode_metrics=None, log="/h/stock.a1.log",
             fault={"kernel": "copy_and_expand_dflash_inputs_kernel"}),
        line(engine_id="p1", fix=True, fix_parts=["fa3_schedule_refresh"], log="/h/p1.a1.log"),
        line(engine_id="p1", fix=True, fix_parts=["fa3_schedule_refresh"], log="/h/p1.a1.log", round=1),
        # a "control" that completed but hardly drafted: not a control
        line(engine_id="tri", engine_args={"attention_config": {"backend": "TRITON_ATTN"}}, log="/h/tri.a1.log",
             spec_decode_metrics={"num_drafts": 20, "acceptance_length": 1.0}),
        # predicted to crash, completed: a disagreement
        line(engine_id="fdo", cudagraph_mode="FULL_DECODE_ONLY", log="/h/fdo.a1.log"),
        line(engine_id="mtp", spec_method="mtp", draft=None, outcome="startup_error", spec_decode_metrics=None),
        line(engine_id="other", matrix="verify-fix-tp1", outcome="crash"),      # not a discriminating matrix
    ]
    df = _df(tmp_path, lines, {"stock.a1.log": FA3_LOG, "p1.a1.log": FA3_LOG, "tri.a1.log": TRITON_LOG,
                               "fdo.a1.log": FA3_LOG.replace("FULL_AND_PIECEWISE: (2, 1)", "FULL_DECODE_ONLY: (2, 0)")})
    t = discriminate.table(df, data_dir=str(tmp_path / "data")).set_index("configuration")
    assert len(t) == 5
    stock = t.loc["dflash k=15, FULL_AND_PIECEWISE"]
    assert stock["stock control"] and stock["agrees"] == "yes" and stock["crashed / runs"] == "1 / 1"
    assert stock["faulting kernel (core dump)"] == "copy_and_expand_dflash_inputs_kernel"
    p1 = t.loc["dflash k=15, FULL_AND_PIECEWISE (part 1 only: FA3 schedule refresh)"]
    assert p1["agrees"] == "yes" and p1["runs"] == 2 and not p1["stock control"]
    assert p1["FULL decode graphs captured"] == "True" and p1["target attention (log)"] == "FLASH_ATTN"
    tri = t.loc["dflash k=15, FULL_AND_PIECEWISE (backend=TRITON_ATTN)"]
    assert tri["agrees"].startswith("not a control") and tri["target attention (log)"] == "TRITON_ATTN"
    assert t.loc["dflash k=15, FULL_DECODE_ONLY", "agrees"] == "no: 1 completed"
    mtp = t.loc["mtp k=15, FULL_AND_PIECEWISE"]
    assert mtp["runs"] == 0 and mtp["not measured"] == 1 and mtp["agrees"].startswith("- (no run")
    s = discriminate.session_summary(t.reset_index(), "s-test")
    assert s == {"session": "s-test", "rows": 5, "decided": 4, "agree": 2, "disagree": 1, "not_controls": 1,
                 "min_drafting_share": pytest.approx(20 * 1.0 / 16384, abs=1e-3),
                 "stock_control_crashed": 1, "stock_control_runs": 1}


def test_a_missing_log_is_said_not_guessed(tmp_path):
    df = _df(tmp_path, [line(engine_id="p1", fix=True, fix_parts=["fa3_schedule_refresh"], log="/h/gone.a1.log")], {})
    t = discriminate.table(df, data_dir=str(tmp_path / "data"))
    assert t.loc[0, "FULL decode graphs captured"] == "not in the stored log"
    assert t.loc[0, "prediction"] == "completes"


def test_findings_line_reports_outcomes_and_a_failed_prediction(tmp_path, monkeypatch):
    from dflash_lab import findings

    lines = [line(engine_id="stock", outcome="crash", spec_decode_metrics=None, log="/h/stock.a1.log"),
             line(engine_id="fdo", cudagraph_mode="FULL_DECODE_ONLY", log="/h/fdo.a1.log")]
    df = _df(tmp_path, lines, {"stock.a1.log": FA3_LOG, "fdo.a1.log": FA3_LOG})
    monkeypatch.chdir(tmp_path)
    text = findings._discriminating_line(df)
    assert "stock control crashed 1/1" in text and "FULL_DECODE_ONLY at concurrency 32: 0 / 1 crashed (predicted: crash)" in text
    assert "1 of 2 decided predictions held, 1 failed" in text
    # without a crashed stock control in the session there is nothing to report against
    df2 = _df(tmp_path / "b", [line(engine_id="p1", fix=True, fix_parts=["fa3_schedule_refresh"])], {})
    assert findings._discriminating_line(df2).startswith("Discriminating runs: none recorded")


def test_outcomes_that_are_neither_ok_nor_crash_are_disagreements(tmp_path):
    lines = [line(engine_id="stock", outcome="timeout", spec_decode_metrics=None, log="/h/stock.a1.log"),
             line(engine_id="p1", fix=True, fix_parts=["fa3_schedule_refresh"], outcome="timeout", log="/h/p1.a1.log")]
    df = _df(tmp_path, lines, {"stock.a1.log": FA3_LOG, "p1.a1.log": FA3_LOG})
    t = discriminate.table(df, data_dir=str(tmp_path / "data")).set_index("configuration")
    assert t.loc["dflash k=15, FULL_AND_PIECEWISE", "agrees"] == "no: 1 timeout"
    assert t.loc["dflash k=15, FULL_AND_PIECEWISE (part 1 only: FA3 schedule refresh)", "agrees"] == "no: 1 timeout"
    assert discriminate.session_summary(t.reset_index(), "s-test")["disagree"] == 2


def test_missing_drafting_evidence_is_not_agreement(tmp_path):
    r = line(engine_id="p1", fix=True, fix_parts=["fa3_schedule_refresh"], log="/h/p1.a1.log")
    del r["output_tokens"]
    other = line(engine_id="p1", fix=True, fix_parts=["fa3_schedule_refresh"], log="/h/p1.a1.log", round=1)
    df = _df(tmp_path, [r, other], {"p1.a1.log": FA3_LOG})   # the column exists, this line's value is NaN
    assert discriminate.drafting_share(df.iloc[0].to_dict()) is None
    t = discriminate.table(df, data_dir=str(tmp_path / "data"))
    assert t.loc[0, "agrees"].startswith("not a control")


def test_a_failed_start_before_a_run_does_not_shift_log_facts(tmp_path):
    lines = [line(engine_id="tri", engine_args={"attention_config": {"backend": "TRITON_ATTN"}}, outcome="startup_error",
                  spec_decode_metrics=None, log="/h/tri.a1.log"),
             line(engine_id="tri", engine_args={"attention_config": {"backend": "TRITON_ATTN"}}, attempt=2,
                  log="/h/tri.a2.log")]
    df = _df(tmp_path, lines, {"tri.a1.log": FA3_LOG, "tri.a2.log": TRITON_LOG})
    t = discriminate.table(df, data_dir=str(tmp_path / "data"))
    assert len(t) == 1 and t.loc[0, "prediction"] == "completes" and t.loc[0, "agrees"] == "yes"
    assert t.loc[0, "not measured"] == 1 and t.loc[0, "target attention (log)"] == "TRITON_ATTN"


def test_other_capture_sizes_are_their_own_configuration_not_the_stock_control(tmp_path):
    lines = [line(engine_id="stock", outcome="crash", spec_decode_metrics=None),
             line(engine_id="no512", cudagraph_capture_sizes=[16, 32, 480, 496])]
    df = _df(tmp_path, lines, {})
    t = discriminate.table(df, data_dir=str(tmp_path / "data")).set_index("configuration")
    assert len(t) == 2
    assert t.loc["dflash k=15, FULL_AND_PIECEWISE", "stock control"]
    v = t.loc["dflash k=15, FULL_AND_PIECEWISE (capture sizes 16..496 (4))"]
    assert not v["stock control"] and v["agrees"] == "no: 1 completed"
    assert len(analysis.stock_full(df)) == 1


def test_a_variant_is_summed_only_over_sessions_whose_stock_control_crashed(tmp_path):
    p1 = {"fix": True, "fix_parts": ["fa3_schedule_refresh"], "log": "/h/p1.a1.log"}
    lines = [
        line(gpu_session="s1", engine_id="stock", outcome="crash", spec_decode_metrics=None, log="/h/stock.a1.log",
             fault={"kernel": "copy_and_expand_dflash_inputs_kernel"}),
        line(gpu_session="s1", engine_id="p1", **p1),
        line(gpu_session="s1", engine_id="p1", round=1, **p1),
        # a later session: its own control completed, so its part-1 run cannot count
        line(gpu_session="s2", engine_id="stock", log="/h/stock.a1.log"),
        line(gpu_session="s2", engine_id="p1", **p1),
        # a third session with a crashed control: its part-1 run at 2 is another cell, at 32 it adds
        line(gpu_session="s3", engine_id="stock", outcome="crash", spec_decode_metrics=None, log="/h/stock.a1.log"),
        line(gpu_session="s3", engine_id="p1", **p1),
        line(gpu_session="s3", engine_id="p1", concurrency=2, **p1),
    ]
    df = _df(tmp_path, lines, {"stock.a1.log": FA3_LOG, "p1.a1.log": FA3_LOG})
    t = discriminate.table(df, data_dir=str(tmp_path / "data"))
    assert discriminate.controlled_sessions(t) == ["s1", "s3"]
    v = discriminate.variant(t, "dflash k=15, FULL_AND_PIECEWISE (part 1 only: FA3 schedule refresh)")
    assert v["sessions"] == ["s1", "s3"] and v["runs"] == 3 and v["crashed"] == 0 and v["all_agree"]
    assert v["min_drafts_per_run"] == 8800 and v["target_attention"] == ["FLASH_ATTN"]
    assert discriminate.variant(t, "dflash k=15, FULL_AND_PIECEWISE (part 1 only: FA3 schedule refresh)", 2)["runs"] == 1
    # a completed run at concurrency 2 agrees with any account (stock does not crash there): not a decided prediction
    assert discriminate.session_summary(t, "s3")["decided"] == 2
    assert not t[(t["gpu_session"] == "s3") & (t["concurrency"] == 2)]["discriminates"].iloc[0]
    stock = discriminate.variant(t, "dflash k=15, FULL_AND_PIECEWISE")
    assert stock["crashed"] == 2 and stock["faulting_kernels"] == ["copy_and_expand_dflash_inputs_kernel"]
    assert discriminate.variant(t, "nothing like it") == {**discriminate.variant(t, "nothing like it"), "runs": 0,
                                                          "all_agree": False}


def test_the_recorded_one_sided_split_bound(root):
    """s18 (data/runs): FA3 splits 1 for the drafter only crashed 3 of 3 at concurrency 32, as predicted, with the
    stock fault, and each engine log shows the plugin moved the drafter's builders from 32 splits to 1; the bound on
    both sides (s17) completed 3 of 3."""
    df = analysis.load_runs(str(root / "data" / "runs" / "*.jsonl"))
    t = discriminate.table(df, data_dir=str(root / "data"))
    d = discriminate.variant(t, "dflash k=15, FULL_AND_PIECEWISE (FA3 splits 1 for the drafter only)")
    assert (d["runs"], d["crashed"], d["predictions"], d["all_agree"]) == (3, 3, ["crash"], True)
    assert d["faulting_kernels"] == ["copy_and_expand_dflash_inputs_kernel"]
    assert d["split_bounds_changed"] == ["drafter 32 -> 1"]
    assert d["runs_with_split_bound_log"] == 3 and d["core_dumps"] == 3     # every run's own engine log and core dump
    both = discriminate.variant(t, "dflash k=15, FULL_AND_PIECEWISE (flash_attn_max_num_splits_for_cuda_graph=1)")
    assert (both["runs"], both["crashed"]) == (3, 0)
