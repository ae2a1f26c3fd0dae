"""vLLM 0.22.1's own AsyncScheduler on the CPU (dflash_lab.asyncsched): what a decode row with no token does to its
request, against the state the GPU's scheduler ledger recorded in the stops at 24 (s56, s57)."""

import pytest

from dflash_lab import analysis, asyncsched as A, schedledger, verification as V
from dflash_lab.errors import LabError


def _run(**kw):
    spec = A.Spec(**kw)
    events, final, summary = A.run(spec)
    return events, final.set_index("request"), summary, spec


def test_without_an_empty_row_every_request_finishes():
    events, final, summary, spec = _run(requests=3, max_tokens=12)
    assert summary["unfinished"] == 0 and (final["status"] == "FINISHED_LENGTH_CAPPED").all()
    assert (final["output"] == 12).all() and (final["placeholders"] == 0).all() and not final["running"].any()
    assert A.stuck(final.reset_index(), summary, spec.max_tokens).empty
    assert summary["vllm"].startswith(("wheel: ", "installed: ")) and not events["empty row"].any()


def test_a_fresh_machine_without_vllms_modelinfo_cache(tmp_path, monkeypatch):
    """vLLM inspects the model class in a subprocess of its own when ``VLLM_CACHE_ROOT`` holds no modelinfo for it
    (a fresh machine, a fresh CI runner): that subprocess must import the same verified sources. Before the child put
    them on ``PYTHONPATH`` it failed there ("No module named 'vllm'"), hidden wherever an earlier run left the cache."""
    from dflash_lab import vllm_sources

    if vllm_sources.source_tree().origin == "installed":
        pytest.skip("vLLM is installed here: its own subprocess finds it without PYTHONPATH")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    _, final, summary, _ = _run(requests=1, prompt=8, max_tokens=4)
    assert summary["unfinished"] == 0 and (final["output"] == 4).all()
    assert list((tmp_path / "vllm-cache").rglob("*.json"))   # vLLM's subprocess ran and wrote its modelinfo


def test_an_empty_row_leaves_its_step_in_the_placeholders():
    """The step's 1 + k placeholders stay: at once (the update that returned nothing) and to the end."""
    events, final, summary, _ = _run(requests=3, max_tokens=12, empty={"r1": [3]})
    e = events[(events["request"] == "r1")]
    at = e.index[e["empty row"]][0]
    before = e.loc[:at - 1].iloc[-1] if len(e.loc[:at - 1]) else None
    assert before is not None and e.loc[at, "output"] == before["output"]   # no token came back
    assert summary["unfinished"] == 0 and final.loc["r1", "placeholders"] == 16 == 1 + 15
    assert (final.drop("r1")["placeholders"] == 0).all()


def test_the_last_step_empty_holds_the_request_forever():
    """Overlapped (the async engine's order): a request whose final step comes back empty rests one token short of
    max_tokens with the leaked placeholders, which the max_tokens guard reads as a step in flight: every later
    schedule skips it, and it stays running and unfinished."""
    events, final, summary, spec = _run(requests=3, max_tokens=12, empty={"r1": [11]}, steps=300)
    held = A.stuck(final.reset_index(), summary, spec.max_tokens)
    assert list(held["request"]) == ["r1"] and summary["unfinished"] == 1 and summary["steps"] == 300
    r1 = final.loc["r1"]
    # computed: the prompt, the 11 tokens less the last (not yet computed), and the empty step's 16, never taken back
    assert (r1["output"], r1["placeholders"], r1["computed"]) == (11, 16, spec.prompt + 11 - 1 + 16)
    last = events[events["request"] == "r1"]["step"].max()
    assert summary["idle schedules"] >= 300 - last - 2   # nothing scheduled after its last update


def test_the_order_decides_whether_an_early_empty_row_hangs():
    """The same early empty row: the overlapped order finishes the request (its next step is already in flight when
    the guard looks), the serial order leaves it held at max_tokens - 1."""
    _, over, s1, _ = _run(requests=2, max_tokens=12, empty={"r1": [3]})
    _, ser, s2, spec = _run(requests=2, max_tokens=12, empty={"r1": [3]}, order="serial", steps=300)
    assert s1["unfinished"] == 0 and over.loc["r1", "output"] == 12
    assert list(A.stuck(ser.reset_index(), s2, spec.max_tokens)["request"]) == ["r1"]
    assert ser.loc["r1", "placeholders"] == 16


def test_the_gpu_ledger_state_comes_back_on_the_cpu():
    """The stops at 24 (s57, probe-hang-ledger2-c24-tp1's two stopped runs): three requests of 49 prompt tokens held
    at 511 of 512 with 1, 1 and 4 updates that returned no token. vLLM's scheduler, given rows with no token at those
    counts (the last on each request's final step), ends in the ledger's state, request for request: output,
    computed tokens and placeholders."""
    df = analysis.load_runs()
    m2 = V.PROBE_HANG_LEDGER_MATRICES[1]
    runs = df[(df["matrix"] == m2) & (df["outcome"] == "timeout") & ~df.apply(analysis.is_deadline_cut, axis=1)]
    assert len(runs) == 2
    spins = [schedledger.spin_table(V.ledger_lines(r)) for _, r in runs.iterrows()]
    got = A.replay_spins(spins, [int(k) for k in runs["num_speculative_tokens"]])   # both in one child process
    assert len(got) == 2
    for t, (gpu, cpu, held) in zip(spins, got):
        assert held == len(t) == 3 and cpu == gpu, (cpu, gpu)
        assert gpu == [(1, 511, 575, 16), (1, 511, 575, 16), (4, 511, 623, 64)]
    with pytest.raises(LabError, match="2 spins and 1 values of k"):
        A.replay_spins(spins, [15])
    assert A.replay_spins([], []) == []
    # s56's ledger kept no count: nothing to replay, said so
    s56 = df[df["matrix"] == V.PROBE_HANG_LEDGER_MATRICES[0]].iloc[0]
    with pytest.raises(LabError, match="no count of updates with no token"):
        A.replay_spin(schedledger.spin_table(V.ledger_lines(s56)), 15)


def test_a_replay_whose_counts_differ_from_the_ledger_does_not_match():
    """The comparison can fail: one update with no token more for one request than the ledger recorded gives a
    scheduler state 16 placeholders away from the recorded one."""
    df = analysis.load_runs()
    r = df[(df["matrix"] == V.PROBE_HANG_LEDGER_MATRICES[1]) & (df["outcome"] == "timeout")
           & ~df.apply(analysis.is_deadline_cut, axis=1)].iloc[0]
    t = schedledger.spin_table(V.ledger_lines(r))
    t.loc[0, "updates with no token"] += 1
    _, cpu, held = A.replay_spin(t, 15)
    assert held == 3 and cpu != [(1, 511, 575, 16), (1, 511, 575, 16), (4, 511, 623, 64)]


@pytest.mark.parametrize("kw, msg", [
    ({"order": "sideways"}, "order 'sideways'"),
    ({"empty": {"r9": [3]}}, "not one of the run's requests"),
    ({"empty": {"r0": [12]}, "max_tokens": 12}, "must lie in 0..11"),
    ({"accept": 16}, "accept 16 > k 15"),
    ({"requests": 0}, "requests must be an integer >= 1"),
    ({"requests": True}, "requests must be an integer >= 1"),
    ({"empty": {"r0": [True]}}, "must lie in 0..511"),
    ({"max_tokens": 5000}, "must stay within"),
])
def test_a_wrong_spec_is_one_clear_error(kw, msg):
    with pytest.raises(LabError, match=msg):
        A.run(A.Spec(**kw))
