"""Reading the step probe's logs: the recorded H200 run, and bad files."""

import math

import pytest

from dflash_lab import divergence as D
from dflash_lab.errors import LabError


@pytest.fixture(scope="module")
def stock():
    files = [f for f in D.probe_files() if "root-probe-tp1/stock-probe" in f]
    assert files, "the recorded stock probe run must be in data/"
    return D.load_probe(files[0])


def test_first_divergence_and_nan_onset_of_the_recorded_run(stock):
    fd = D.first_divergence(stock)
    assert fd["step"] == next(s["step"] for s in stock["steps"] if s["mode"] == "FULL")
    assert D.short(fd["last_layer_before"]) == "L7 attn" and D.short(fd["first_layer_written_differently"]) == "L8 gdn"
    assert fd["all_before_bit_identical"] and fd["layers_written_identically_before"] == 8
    nan = D.nan_onset(stock)
    assert nan["num_tokens"] == 480 and nan["rows_nonfinite_reference"] == 0 and nan["rows_nonfinite_graph"] == 480


def test_divergence_matrix_marks_graph_only_and_shared_nan(stock):
    steps, layers, vals = D.divergence_matrix(stock)
    assert len(layers) == 40 and vals.shape == (len(steps), 40)
    i = steps.index(D.nan_onset(stock)["step"])
    assert math.isinf(vals[i, 8]) and vals[i, :8].max() == 0.0
    assert any(math.isnan(v) for v in vals[-1])  # later steps: NaN in both passes


@pytest.mark.parametrize("text,msg", [('{"step": 1}\n{oops\n', r":2: not a JSON line"),
                                      ('{"step": 1}\n[1, 2]\n', r":2: not a JSON object"),
                                      ('{"kind": "engine"}\n', r":1: not a probe line")])
def test_bad_probe_file_names_its_line(tmp_path, text, msg):
    p = tmp_path / "probe-1.jsonl"
    p.write_text(text)
    with pytest.raises(LabError, match=msg):
        D.load_probe(str(p))


def test_missing_probe_file(tmp_path):
    with pytest.raises(LabError, match="no such file"):
        D.load_probe(str(tmp_path / "nope.jsonl"))


def test_shared_probes_reads_each_log_once_and_again_when_it_changes(tmp_path, monkeypatch):
    p = tmp_path / "s" / "e.probe" / "probe-1.jsonl"
    p.parent.mkdir(parents=True)
    p.write_text('{"step": 1, "mode": "FULL"}\n')
    reads = []
    real = D._read_probe
    monkeypatch.setattr(D, "_read_probe", lambda path: reads.append(path) or real(path))
    assert D.load_probe(str(p)) is not D.load_probe(str(p)) and len(reads) == 2  # outside a block: read each time
    with D.shared_probes():
        a = D.load_probe(str(p))
        with D.shared_probes():  # a block inside a block shares the outer one's logs
            assert D.load_probe(str(p)) is a
        assert D.load_probe(str(p)) is a and len(reads) == 3
        p.write_text('{"step": 1, "mode": "FULL"}\n{"step": 2, "mode": "FULL"}\n')  # rewritten: size differs
        b = D.load_probe(str(p))
        assert len(reads) == 4 and [s["step"] for s in b["steps"]] == [1, 2] and b["path"] == str(p)
        with pytest.raises(LabError, match="no such file"):
            D.load_probe(str(tmp_path / "nope.jsonl"))
    assert D._shared is None  # nothing kept once the block ends
    with pytest.raises(RuntimeError), D.shared_probes():
        D.load_probe(str(p))
        raise RuntimeError("a failing build")
    assert D._shared is None
    D.load_probe(str(p))
    assert len(reads) == 7  # the missing file was tried too


def _p(session, engine, pid=1):
    return {"session": session, "engine": engine, "steps": [], "path": f"data/gpu/{session}/{engine}.probe/probe-{pid}.jsonl"}


def test_pick_probe_by_key_or_unique_engine_never_by_prefix():
    probes = [_p("s-low", "stock-probe-low.a1"), _p("s-root", "stock-probe.a1"), _p("s-fix", "fix2-probe.a1")]
    assert D.pick_probe(probes, "s-root/stock-probe.a1")["session"] == "s-root"
    assert D.pick_probe(probes, "stock-probe.a1")["session"] == "s-root"   # the low-concurrency probe sorts first
    with pytest.raises(LabError, match="no probed engine 'stock-probe'.*s-low/stock-probe-low.a1"):
        D.pick_probe(probes, "stock-probe")
    with pytest.raises(LabError, match="names 2 probe files"):
        D.pick_probe(probes + [_p("s-again", "stock-probe.a1")], "stock-probe.a1")
    # one engine, a probe file per process (tensor parallelism): the path picks one
    tp = probes + [_p("s-root", "stock-probe.a1", pid=2)]
    with pytest.raises(LabError, match="probe-1.jsonl.*probe-2.jsonl"):
        D.pick_probe(tp, "s-root/stock-probe.a1")
    assert D.pick_probe(tp, "data/gpu/s-root/stock-probe.a1.probe/probe-2.jsonl")["path"].endswith("probe-2.jsonl")


def test_stock_diverges_at_low_concurrency_too():
    """s18's stock probe at concurrency 2 and 16 (beside part 1 alone's identical steps there): every FULL step
    of the target differs from the no-graph pass, first at GDN layer 8 (attention layer 7's output), as at 32."""
    low = [D.load_probe(f) for f in D.probe_files() if "/stock-probe-low.a1.probe/" in f]
    assert len(low) == 2
    for p in low:
        full = [s for s in p["steps"] if s["mode"] == "FULL"]
        assert full and all(s["diverge"]["diverged"] for s in full)
        assert D.short(D.first_divergence(p)["first_layer_written_differently"]) == "L8 gdn"
        assert D.nan_onset(p) is None


def test_zero_accepted_counts_at_8_reach_row_0_only_at_the_crash_step():
    """s22's stock probe at 8: after the NaN of its first FULL step, requests 1-7 get GDN accepted counts of 0 (a row
    with no valid token the step before) 33-45 times each, always in rows above 0, where the kernel's column -1 is the
    previous row's last slot; request 0 never does. The crash step is the first without request 0: request 7 moves to
    row 0 with a count of 0. At 12 no count is 0."""
    c8 = [D.load_probe(f) for f in D.probe_files() if "probe-c8-a-tp1/stock-probe-c8.a1.probe/" in f]
    c12 = [D.load_probe(f) for f in D.probe_files() if "/stock-probe-c12.a1.probe/" in f]
    assert len(c8) == 1 and len(c12) == 1
    z = D.zero_accepted(c8[0])
    per_request = z.groupby("request").size()
    assert sorted(per_request.index) == [1, 2, 3, 4, 5, 6, 7] and per_request.min() == 33 and per_request.max() == 45
    last = c8[0]["steps"][-1]
    assert z.loc[z["row"] == 0, ["step", "request"]].values.tolist() == [[last["step"], 7]]
    assert 0 not in last["reqs"] and all(0 in s["reqs"] for s in c8[0]["steps"][2:-1])
    assert z["step"].min() > D.nan_onset(c8[0])["step"]
    assert len(D.zero_accepted(c12[0])) == 0
    # synthetic: rows without GDN metadata or counts are skipped; a count of 0 is found in its row
    probe = {"steps": [{"step": 1, "mode": "FULL", "reqs": [4, 5], "gdn": {"gdn0": {"na": [1, 0]}}},
                       {"step": 2, "mode": "PIECEWISE", "reqs": [4]},
                       {"step": 3, "mode": "FULL", "reqs": [5], "gdn": {"gdn0": {"na": None}}}]}
    assert D.zero_accepted(probe).to_dict("records") == [{"step": 1, "mode": "FULL", "row": 1, "request": 5}]
    assert list(D.zero_accepted({"steps": []}).columns) == D.ZERO_ACCEPTED_COLUMNS


def _probe_rows(pattern):
    return [(f, D.load_probe(f)) for f in D.probe_files(pattern)]


def test_s35_stock_probe_at_8_replays_s22_and_the_fix_removes_its_nan():
    """s35 probed stock at 8 again (the session's own control) beside part 1 alone and fix 2: stock repeated s22 step
    for step (NaN on the first FULL step, the same crash step); both fixes wrote every FULL step bit-identical to the
    no-graph pass, without NaN."""
    s22 = _probe_rows("data/gpu/2026-11-30_h200_probe-c8-a-tp1/stock-probe-c8.a1.probe/probe-*")
    s35 = _probe_rows("data/gpu/2026-12-01_h200_probe-c8-fix-a-tp1/*.probe/probe-*")
    assert len(s22) == 1 and len(s35) == 3
    by_engine = {p["engine"]: p for _, p in s35}
    stock, old = by_engine["stock-probe-c8.a1"], s22[0][1]
    for p in (stock, old):
        nan = D.nan_onset(p)
        assert nan["step"] == 3 and nan["num_tokens"] == 128 and nan["rows_nonfinite_graph"] == 32
        assert nan["rows_nonfinite_reference"] == 0
    assert [s["step"] for s in stock["steps"]] == [s["step"] for s in old["steps"]]
    for name in ("part1-probe-c8.a1", "fix2-probe-c8.a1"):
        full = [s for s in by_engine[name]["steps"] if s["mode"] == "FULL"]
        assert len(full) > 250 and D.nan_onset(by_engine[name]) is None and D.first_divergence(by_engine[name]) is None
        assert all(s["diverge"]["outputs"]["hidden"]["max_abs"] == 0 for s in full)


def test_s35_stock_probes_at_64_turn_nan_on_their_first_full_replay():
    """At 64 the steps of 34-49 requests are above the 512-token largest graph: no FULL replay until step 280, which
    replays the 464/480-token graph and writes NaN in every row (reference pass finite), first at GDN layer 8, with the
    stale-schedule canary; fix 2 beside it has the same first FULL step and is bit-identical on all its FULL steps."""
    stock = _probe_rows("data/gpu/2026-12-01_h200_probe-c64-*/stock-probe-c64.a1.probe/probe-*")
    fixed = _probe_rows("data/gpu/2026-12-01_h200_probe-c64-*/fix2-probe-c64.a1.probe/probe-*")
    assert len(stock) == 2 and len(fixed) == 2
    for _, p in stock:
        full = [s for s in p["steps"] if s["mode"] == "FULL"]
        before = [s for s in p["steps"] if s["step"] < full[0]["step"]]
        assert full[0]["step"] == 280 and all(s["num_tokens"] > 512 for s in before if s["mode"] == "NONE")
        assert [s["mode"] for s in before].count("NONE") == 278
        nan = D.nan_onset(p)
        assert nan["step"] == 280 and nan["rows_nonfinite_graph"] == nan["num_tokens"] in (464, 480)
        assert nan["rows_nonfinite_reference"] == 0 and nan["first_layer_with_nonfinite_writes"].endswith("layers.8.linear_attn")
        assert "attn.scheduler_metadata" in {v["field"] for v in D.first_violations(p, 50) if v["step"] == 280}
    for _, p in fixed:
        full = [s for s in p["steps"] if s["mode"] == "FULL"]
        assert full[0]["step"] == 280 and len(full) == 280 and D.first_divergence(p) is None and D.nan_onset(p) is None


def test_s35_split_1_probe_completes_with_wrong_full_replays():
    """FA3 splits 1 on both sides under the probe at 32 (s35): completed, but every FULL step with more than one
    request diverged at GDN layer 8 (attention layer 7's output), and the canary named the stale schedule on each."""
    (path, p), = _probe_rows("data/gpu/2026-12-01_h200_discriminate2-n-tp1/splits1-probe.a1.probe/probe-*")
    full = [s for s in p["steps"] if s["mode"] == "FULL"]
    same = [s for s in full if not s["diverge"]["diverged"]]
    assert len(full) == 283 and len(same) == 2 and all(s["num_reqs"] == 1 for s in same)
    assert all(s["diverge"]["first_layer"].endswith("layers.8.linear_attn") for s in full if s not in same)
    assert D.nan_onset(p) is None
    assert {v["field"] for v in D.first_violations(p, 10**6)} == {"attn.scheduler_metadata"}


def _oor_probe():
    """Synthetic: step 2 samples id 100 (= the vocabulary size) for request 5 in row 1; step 3's accepted count is 0
    there; request 5 then moves into row 0 at step 4."""
    return {"steps": [{"step": 2, "mode": "FULL", "reqs": [4, 5], "gdn": {"gdn0": {"na": [1, 1]}}},
                      {"step": 3, "mode": "FULL", "reqs": [4, 5], "gdn": {"gdn0": {"na": [2, 0]}}},
                      {"step": 4, "mode": "FULL", "reqs": [5], "gdn": {"gdn0": {"na": [0]}}}],
            "samples": {2: {"step": 2, "reqs": [4, 5], "first_token": [7, 100]},
                        3: {"step": 3, "reqs": [4, 5], "first_token": [7, 3]}}}


def test_out_of_vocabulary_ids_link_to_the_next_steps_accepted_count_of_0():
    p = _oor_probe()
    assert D.out_of_vocab_ids(p, 100).values.tolist() == [[2, 1, 5, 100]]
    assert D.out_of_vocab_ids(p, 101).empty                       # 100 is a valid id of a 101-token vocabulary
    # step 3: {5} both ways; step 4: a count of 0 with no out-of-vocabulary id the step before: unlinked
    assert D.oor_links(p, 100) == {"linked": 1, "unlinked": [4]}
    p["samples"][3]["first_token"] = [7, 100]
    assert D.oor_links(p, 100) == {"linked": 2, "unlinked": []}
    del p["samples"][3]                                           # no sample line before step 4: not checked
    assert D.oor_links(p, 100) == {"linked": 1, "unlinked": []}


def test_row0_without_a_token_is_the_first_moved_in_count_of_0_or_own_out_of_vocabulary_id():
    p = _oor_probe()
    assert D.row0_without_token(p, 100) == {"step": 4, "how": "moved"}
    p["samples"][3]["first_token"] = [100, 3]                     # row 0's own id at step 3 comes first
    assert D.row0_without_token(p, 100) == {"step": 3, "how": "sampled"}
    assert D.row0_without_token({"steps": p["steps"][:1], "samples": {}}, 100) is None
    p["steps"][1]["gdn"]["gdn0"]["na"] = [0, 0]                   # both at step 3: the count of 0 is read first
    assert D.row0_without_token(p, 100) == {"step": 3, "how": "moved"}
    assert set(D.ROW0_HOW) == {"moved", "sampled"}


def test_row0_changes_name_each_newcomer_and_its_accepted_count():
    p = _oor_probe()
    assert D.row0_changes(p) == [{"step": 4, "left": 4, "came": 5, "accepted": 0, "returned": False}]
    p["steps"].append({"step": 5, "mode": "FULL", "reqs": [], "gdn": {}})          # an empty step is skipped
    p["steps"].append({"step": 6, "mode": "FULL", "reqs": [6, 5], "gdn": {"gdn0": {"na": [3, 1]}}})
    p["steps"].append({"step": 7, "mode": "FULL", "reqs": [7, 5]})                   # no GDN metadata recorded
    assert D.row0_changes(p)[1:] == [{"step": 6, "left": 5, "came": 6, "accepted": 3, "returned": True},
                                     {"step": 7, "left": 6, "came": 7, "accepted": None, "returned": False}]
    assert D.row0_changes({"steps": [], "samples": {}}) == []


def test_row0_replaced_steps_are_those_where_row0s_only_token_was_replaced():
    p = {"steps": [], "samples": {
        3: {"valid": [1, 2], "oor_replaced": 1},      # row 0's one token replaced
        4: {"valid": [2, 1], "oor_replaced": 1},      # row 0 kept two tokens: the replaced id was not its only one
        5: {"valid": [1, 1], "oor_replaced": 0},      # nothing replaced
        6: {"valid": [1], "oor_replaced": None},      # the replacement was off
        7: {"valid": [], "oor_replaced": 2}}}
    assert D.row0_replaced_steps(p) == [3]


def test_every_recorded_crash_came_at_its_first_row0_step():
    """The recorded probes (s13-s43): where row 0 first held a request with no valid token is the crash step."""
    c8 = [D.load_probe(f) for f in D.probe_files() if "probe-c8-a-tp1/stock-probe-c8.a1.probe/" in f][0]
    assert D.row0_without_token(c8, 248320) == {"step": c8["steps"][-1]["step"], "how": "moved"}
    c12 = [D.load_probe(f) for f in D.probe_files() if "/stock-probe-c12.a1.probe/" in f][0]
    assert D.row0_without_token(c12, 248320) is None and D.out_of_vocab_ids(c12, 248320).empty
