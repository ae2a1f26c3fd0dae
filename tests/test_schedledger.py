"""The scheduler ledger (dflash_lab/schedledger.py): silent while the engine steps, one spin line with the steps that
led there once the scheduler has scheduled nothing for SPIN_S with requests running, and the guards it names read
against vLLM 0.22.1's own scheduler source."""

import json
import re
import types

import pytest

from dflash_lab import schedledger, vllm_sources
from dflash_lab.errors import LabError


class Req:
    def __init__(self, rid, prompt=100, max_tokens=512):
        self.request_id, self.num_prompt_tokens, self.max_tokens = rid, prompt, max_tokens
        self.num_computed_tokens, self.num_output_placeholders, self.async_tokens_to_discard = prompt, 0, 0
        self.output, self.spec_token_ids, self.status = [], [], types.SimpleNamespace(name="RUNNING")

    @property
    def num_tokens(self):
        return self.num_prompt_tokens + len(self.output)

    @property
    def num_tokens_with_spec(self):
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def num_output_tokens(self):
        return len(self.output)


class Sched:
    """A stand-in with the attributes the ledger reads; each test says what the next schedule returns."""
    max_model_len = 65536

    def __init__(self, reqs):
        self.requests = {r.request_id: r for r in reqs}
        self.running, self.waiting = list(reqs), []
        self.plan = {}

    def schedule(self):
        return types.SimpleNamespace(num_scheduled_tokens=dict(self.plan),
                                     total_num_scheduled_tokens=sum(self.plan.values()))

    def update_from_output(self, sched_out, model_out):
        for rid, toks in zip(model_out.req_ids, model_out.sampled_token_ids):
            r = self.requests[rid]
            r.output += toks
            r.num_output_placeholders -= len(toks)
        return {}


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def sched_cls():
    # a fresh class per test: install patches the class it is given
    return type("S", (Sched,), {})


def _install(cls, folder, spin_s=10.0):
    schedledger.install(str(folder), scheduler_cls=cls, spin_s=spin_s)
    led = cls.schedule._dflash_lab_ledger
    led.clock = Clock()
    return led


def _step(s, led, tokens_per_req, sampled, dt=0.25):
    s.plan = tokens_per_req
    out = s.schedule()
    for rid, n in tokens_per_req.items():
        s.requests[rid].num_output_placeholders += n
        s.requests[rid].num_computed_tokens += n
    led.clock.t += dt
    s.update_from_output(out, types.SimpleNamespace(req_ids=list(sampled), sampled_token_ids=list(sampled.values())))


def _lines(folder):
    files = list(folder.glob("ledger-*.jsonl"))
    return [json.loads(x) for f in files for x in f.read_text().splitlines()]


def test_a_stepping_engine_writes_nothing_and_a_spin_writes_the_steps_that_led_there(tmp_path, sched_cls):
    a, b = Req("a"), Req("b")
    s = sched_cls([a, b])
    led = _install(sched_cls, tmp_path)
    for _ in range(2):
        _step(s, led, {"a": 16, "b": 16}, {"a": [5, 6], "b": [7]})
    _step(s, led, {"a": 16, "b": 16}, {"a": [], "b": [7]})   # a row with no token: counted for a
    assert _lines(tmp_path) == []
    # b finishes; a is left 12 tokens short of max_tokens with 16 placeholders that no update will take back, which
    # the async max_tokens guard reads as a step in flight that reaches max_tokens
    s.running.remove(b)
    a.output, a.spec_token_ids = [1] * 500, [-1] * 15
    a.num_output_placeholders, a.num_computed_tokens = 16, 626
    s.plan = {}
    for _ in range(5):                 # 5 empty schedules, the last 8.4 s after the first: still below SPIN_S
        s.schedule()
        led.clock.t += 2.1
    assert _lines(tmp_path) == []
    s.schedule()                        # the sixth, 10.5 s into the spin: written
    (line,) = _lines(tmp_path)
    assert line["kind"] == "spin" and line["empty"] == 6 and line["running"] == 1 and line["s"] >= 10
    (req,) = line["requests"]
    assert req["id"] == "a" and req["placeholders"] == 16 and req["out"] == 500 and req["spec"] == 15
    assert req["guards"] == ["max_tokens guard"] and req["status"] == "RUNNING"
    assert req["empty_updates"] == 1 and req["empty_at"] == [3]
    evs = [e["ev"] for e in line["ring"]]
    assert evs == ["schedule", "update"] * 3 + ["schedule"]   # the empty schedule that began the spin closes the ring
    upd = line["ring"][-2]
    assert upd["sampled"] == {"a": [0, []], "b": [1, [7]]}
    assert upd["before"]["a"]["placeholders"] == upd["after"]["a"]["placeholders"] == 3 * 16 - 2 * 2
    # the spin doubles: one more line at 20 s, none in between; a scheduled token ends it
    for _ in range(4):
        led.clock.t += 2.0
        s.schedule()
    assert len(_lines(tmp_path)) == 1
    led.clock.t += 2.0
    s.schedule()
    assert [l["kind"] for l in _lines(tmp_path)] == ["spin", "spin_still"]
    assert "ring" not in _lines(tmp_path)[1]
    s.plan = {"a": 16}
    s.schedule()
    kinds = [l["kind"] for l in _lines(tmp_path)]
    assert kinds == ["spin", "spin_still", "spin_end"] and _lines(tmp_path)[2]["empty"] == 11


def test_empty_schedules_without_running_requests_are_no_spin(tmp_path, sched_cls):
    s = sched_cls([])
    led = _install(sched_cls, tmp_path, spin_s=1.0)
    for _ in range(50):
        s.schedule()
        led.clock.t += 1.0
    assert _lines(tmp_path) == []


def test_the_ledger_never_reaches_the_engine(tmp_path, sched_cls, capsys):
    class Bad(Req):
        @property
        def num_tokens_with_spec(self):
            raise RuntimeError("boom")

    r = Bad("x")
    s = sched_cls([r])
    blocker = tmp_path / "file"
    blocker.write_text("")
    led = _install(sched_cls, blocker / "sub", spin_s=0.5)   # a folder that cannot be made
    s.plan = {}
    for _ in range(3):
        assert s.schedule().total_num_scheduled_tokens == 0
        led.clock.t += 1.0
    assert "scheduler ledger: not written" in capsys.readouterr().err
    assert "with_spec" not in schedledger.request_state(r) and schedledger.request_state(r)["id"] == "x"
    s.running = 5          # not a list: on_schedule fails, the schedule still returns
    assert s.schedule().total_num_scheduled_tokens == 0
    assert "recording goes on" in capsys.readouterr().err


def test_install_twice_wraps_once(tmp_path, sched_cls):
    schedledger.install(str(tmp_path), scheduler_cls=sched_cls)
    first = sched_cls.schedule
    assert "already active" in schedledger.install(str(tmp_path), scheduler_cls=sched_cls)
    assert sched_cls.schedule is first


def test_guards_name_each_early_out():
    base = {"prompt": 100, "max_tokens": 512, "computed": 600, "placeholders": 16, "with_spec": 620}
    assert schedledger.guards(base, 65536) == []
    assert schedledger.guards({**base, "computed": 626}, 65536) == ["max_tokens guard"]
    assert schedledger.guards({**base, "placeholders": 0, "with_spec": 600}, 65536) == ["no new tokens"]
    assert schedledger.guards({**base, "computed": 65535}, 65536) == ["max_tokens guard", "no new tokens",
                                                                           "max_model_len"]
    assert schedledger.guards({"computed": 5}, None) == []   # counters missing: no guard claimed


def test_the_guards_are_vllm_0_22_1s_own():
    """The three early outs, the 1 ms sleep the hang stacks showed, and the counters the ledger reads, as the pinned
    source writes them: a different vLLM fails here, not silently in the ledger's table."""
    def flat(t):
        return re.sub(r"\s+", " ", t)

    sched = flat(vllm_sources.read_source("vllm/v1/core/sched/scheduler.py"))
    assert ("request.num_output_placeholders > 0 # This is (num_computed_tokens + 1) - (num_output_placeholders - 1)."
            in sched)
    assert ("and request.num_computed_tokens + 2 - request.num_output_placeholders >= request.num_prompt_tokens "
            "+ request.max_tokens ): " in sched)
    assert ("num_new_tokens = ( request.num_tokens_with_spec + request.num_output_placeholders "
            "- request.num_computed_tokens )" in sched)
    assert "num_new_tokens, self.max_model_len - 1 - request.num_computed_tokens )" in sched
    assert "if num_new_tokens == 0: # The request cannot be scheduled" in sched
    core = flat(vllm_sources.read_source("vllm/v1/engine/core.py"))
    assert "if not model_executed and self.scheduler.has_requests(): time.sleep(0.001)" in core
    asy = vllm_sources.read_source("vllm/v1/core/sched/async_scheduler.py")
    assert "def schedule(" not in asy and "def update_from_output(" not in asy   # wrapping Scheduler covers both
    # a scheduled request whose row holds no token keeps the step's placeholders and computed tokens: both are adjusted
    # only for a row with a token (the count empty_updates keeps)
    assert ("if scheduled_spec_token_ids and generated_token_ids: num_draft_tokens = len(scheduled_spec_token_ids)"
            in sched)
    assert "if request.num_output_placeholders > 0: request.num_output_placeholders -= num_rejected" in sched
    assert ("if new_token_ids: new_token_ids, stopped = self._update_request_with_output( request, new_token_ids )"
            in sched)
    assert "request.num_output_placeholders -= len(new_token_ids)" in asy
    assert "request.num_output_placeholders += 1 + cur_num_spec_tokens" in asy
    req = vllm_sources.read_source("vllm/v1/request.py")
    for attr in schedledger.FIELDS.values():
        assert re.search(rf"(self\.{attr}\b|def {attr}\b)", req), attr


def test_read_and_the_spin_table(tmp_path):
    p = tmp_path / "ledger-1.jsonl"
    ring = [{"ev": "update", "n": 7, "t": 1.0, "sampled": {"a": [2, [1, 2]]},
             "before": {"a": {"placeholders": 18}}, "after": {"a": {"placeholders": 16}}}]
    spin = {"pid": 1, "t": 2.0, "kind": "spin", "s": 10.2, "empty": 900, "running": 1, "max_model_len": 65536,
            "requests": [{"id": "a", "status": "RUNNING", "prompt": 100, "max_tokens": 512, "computed": 626,
                          "placeholders": 16, "with_spec": 630, "out": 500, "spec": 15}], "ring": ring}
    p.write_text(json.dumps(spin) + "\n" + json.dumps({"pid": 1, "t": 3.0, "kind": "spin_end", "empty": 950}) + "\n")
    lines = schedledger.read(str(p))
    t = schedledger.spin_table(lines)
    row = t.iloc[0]
    assert row["early outs"] == "max_tokens guard" and bool(row["output short of max_tokens"]) is True
    assert row["updates with no token"] is None   # a line written before s56's count: not claimed as 0
    assert row["no-token updates at"] is None
    spin["requests"][0].update(empty_updates=1, empty_at=[41])
    p.write_text(json.dumps(spin) + "\n")
    row = schedledger.spin_table(schedledger.read(str(p))).iloc[0]
    assert row["updates with no token"] == 1 and row["no-token updates at"] == [41]
    assert schedledger.last_updates(lines, "a") == [{"n": 7, "t": 1.0, "sampled": [2, [1, 2]],
                                                     "before": {"placeholders": 18}, "after": {"placeholders": 16}}]
    assert schedledger.spin_table([]).empty and schedledger.last_updates([], "a") == []


@pytest.mark.parametrize("text,msg", [("{not json\n", "ledger-1.jsonl:1: not a JSON line"),
                                      ('{"kind": "sched_snapshot"}\n', "not a scheduler ledger line")])
def test_read_refuses_what_is_not_a_ledger(tmp_path, text, msg):
    p = tmp_path / "ledger-1.jsonl"
    p.write_text(text)
    with pytest.raises(LabError, match=msg):
        schedledger.read(str(p))
    with pytest.raises(LabError, match="cannot read the scheduler ledger"):
        schedledger.read(str(tmp_path / "missing.jsonl"))
