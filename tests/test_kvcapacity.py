"""vLLM 0.22.1's KV-cache accounting for the hybrid target, against the engine logs the benchmark recorded (s24, s25):
why the DFlash engines ran 49 of 64 requests at once."""

import pandas as pd
import pytest

from dflash_lab import analysis, bench, kvcapacity as kv
from dflash_lab.errors import LabError

S25 = "data/gpu/2026-12-01_h200_bench-acc1.86-s1-{}-tp1/{}.a1.log"


def test_a_dflash_request_holds_one_plus_k_gdn_states_per_group():
    dflash, plain = kv.layout(k=15), kv.layout(k=0)
    assert (dflash.block_size, plain.block_size) == (1168, 1056)          # the blocks the logs set
    assert dflash.groups == {"gdn": 6, "attention": 2, "draft": 1} and plain.groups == {"gdn": 3, "attention": 1}
    assert kv.blocks_per_request(dflash, 561) == 6 * 16 + 3 and kv.blocks_per_request(plain, 561) == 3 + 1
    assert kv.blocks_per_request(dflash, 65536) == 6 * 16 + 3 * 57     # the worst case the pool is sized by
    # blocks differ in size (5 vs 10 layer pages): in bytes a DFlash request holds ~14x a plain one, not 99/4
    assert 13 < kv.bytes_per_request(dflash, 561) / kv.bytes_per_request(plain, 561) < 15
    assert abs(kv.bytes_per_request(dflash, 561) / 2**30 - 1.10) < 0.01
    # vLLM's group-size heuristic: the smallest bucket, the largest when close (gpt-oss-20b + eagle: 12 sw, 13 full)
    assert kv.group_size({"sw": 12, "full": 13}) == 13 and kv.group_size({"gdn": 30, "attention": 10, "draft": 5}) == 5


@pytest.mark.parametrize("call, name, k, pool, fits, peak", [
    (1, "full-fixed", 15, 4913, 49, 49), (2, "nospec", 0, 2780, 694, 64), (3, "eager", 15, 4884, 49, 32),
    (4, "eager", 15, 4884, 49, 49)])
def test_the_rules_predict_every_recorded_stats_line(call, name, k, pool, fits, peak):
    r = kv.check_log(open(S25.format(call, name)).read(), k, 49 + 512)
    assert r["block_size logged"] == r["block_size predicted"]
    assert (r["pool blocks"], r["fits"], r["peak running logged"]) == (pool, fits, peak)
    assert r["stats lines"] >= 4
    for line in r["lines"]:    # vLLM logs the usage to 0.1 %
        assert abs(line["logged %"] - line["predicted %"]) <= 0.05 + 1e-9, line


def test_without_the_speculative_states_the_rules_would_not_match_the_logs():
    """The k extra GDN blocks are what the logs show: a model without them predicts far less usage."""
    text = open(S25.format(1, "full-fixed")).read()
    r = kv.check_log(text, 15, 561)
    lay = kv.layout(k=15)
    plain_states = kv.Layout(**{**lay.__dict__, "k": 0})
    at49 = next(x for x in r["lines"] if x["running"] == 49)
    assert kv.usage_pct(plain_states, r["pool blocks"], 49, 561) < at49["logged %"] / 5


def test_every_bench_engine_log_is_checked():
    df = bench.load_bench()
    rows = pd.DataFrame(kv.engines(df))
    sized = [log for log in df["engine_log"].dropna().unique() if "GPU KV cache size" in analysis.read_text(log)]
    assert len(sized) >= 7 and len(rows) == len(sized)
    checked = rows[rows["not checked"] == ""]
    assert len(checked) >= 7
    assert (checked["block_size logged"] == checked["block_size predicted"]).all()
    with_lines = checked[checked["stats lines"] > 0]
    assert len(with_lines) >= 7
    assert (with_lines["largest difference (points)"] <= 0.05 + 1e-9).all()
    # engines that died before their first stats line (s26's stock FULL starts) are checked on the block size alone
    assert all(kv.matches(r) for r in checked.to_dict("records"))
    assert kv.matches({**checked.iloc[0].to_dict(), "largest difference (points)": float("nan")})
    assert not kv.matches({**checked.iloc[0].to_dict(), "largest difference (points)": float("nan"), "block_size logged": 1})
    assert not kv.matches({**checked.iloc[0].to_dict(), "largest difference (points)": 0.2})
    # never more running than fit; where requests waited, the engine ran exactly what the rules say fits
    assert (with_lines["peak running logged"] <= with_lines["fits"]).all()
    queued = checked.dropna(subset=["peak running while queued"])
    assert len(queued) >= 4 and (queued["peak running while queued"] == queued["fits"]).all()


def test_what_if_is_labelled_a_prediction_and_capped_by_max_num_seqs():
    rows = {r["k"]: r for r in kv.what_if(54.73, 561)}
    assert rows[15]["requests that fit"] == 49 and rows[15]["pool blocks"] == 4913   # the measured engine
    assert rows[11]["requests that fit"] >= 64 and rows[11]["run at once (max_num_seqs)"] == 64


def test_bad_input_is_one_clear_error():
    with pytest.raises(LabError, match="hybrid targets only"):
        kv.layout("tiny-dense", 15)
    with pytest.raises(LabError, match="GPU KV cache size"):
        kv.check_log("no such line", 15, 561)
    with pytest.raises(LabError, match="several attention blocks"):
        kv.check_log(open(S25.format(1, "full-fixed")).read(), 15, 1168 - 20)   # + 30 draft and lookahead slots
    with pytest.raises(LabError, match="no DFlash draft"):
        kv.layout("qwen36-35b-a3b-mtp", 1)
    text = open(S25.format(1, "full-fixed")).read()
    with pytest.raises(LabError, match="num_spec_tokens|k=15, not 7"):
        kv.check_log(text, 7, 561)
    with pytest.raises(LabError, match="not modelled: tensor_parallel_size=2"):
        kv.check_log(text.replace("tensor_parallel_size=1", "tensor_parallel_size=2"), 15, 561)
    with pytest.raises(LabError, match="prefix caching True"):
        kv.check_log(text.replace("enable_prefix_caching=False", "enable_prefix_caching=True"), 15, 561)


def test_a_log_the_model_does_not_cover_gets_a_row_saying_why(tmp_path):
    df = bench.load_bench()
    one = df[df["engine_log"].fillna("").str.endswith("acc1.86-s1-1-tp1/full-fixed.a1.log")].copy()
    assert kv.engines(one)[0]["not checked"] == ""
    one["prompt_tokens"] = float("nan")       # e.g. an engine whose every run crashed
    assert kv.engines(one)[0]["not checked"] == "no run of this engine measured its prompt length"
    tp2 = {one["engine_log"].iloc[0]: open(S25.format(1, "full-fixed")).read().replace("tensor_parallel_size=1", "tensor_parallel_size=2")}
    one["prompt_tokens"] = 49.0
    assert "not modelled" in kv.engines(one, read=tp2.get)[0]["not checked"]


def test_the_findings_speed_sentence_says_why_dflash_queues_only_as_far_as_the_logs_agree(monkeypatch):
    from dflash_lab import findings

    line = findings.bench_line()
    assert "a k=15 request of 561 tokens holds 1.10 GiB of KV cache against 82 MiB without speculation, so 49 fit at once" in line
    # a model that stopped matching a log is said so, not quoted
    real = kv.check_log
    for wrong in ({"block_size predicted": 1}, {"largest difference (points)": 0.3}):
        monkeypatch.setattr(kv, "check_log", lambda text, k, tokens, w=wrong, **a: {**real(text, k, tokens, **a), **w})
        line = findings.bench_line()
        assert "does not match every engine log" in line and "GiB of KV cache" not in line
