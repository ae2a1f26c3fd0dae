"""The admission gate (dflash_lab.admit) on stand-ins of vLLM's engine core and scheduler, and the vLLM 0.22.1 source
lines it relies on."""
import queue

import pytest

from dflash_lab import admit, vllm_sources
from dflash_lab.errors import LabError


class FakeScheduler:
    """vLLM's admission loop reduced to the bound the gate sets: admit waiting requests while running < the bound."""

    def __init__(self, max_num_seqs=64):
        self.waiting, self.running, self.max_num_running_reqs = [], [], max_num_seqs
        self.steps = []

    def get_num_unfinished_requests(self):
        return len(self.waiting) + len(self.running)

    def schedule(self):
        while self.waiting and len(self.running) < self.max_num_running_reqs:
            self.running.append(self.waiting.pop(0))
        self.steps.append(len(self.running))
        return len(self.running)


class FakeCore:
    """The engine core's input path: a queue the client fills, and the handler every request goes through. Its own
    input handling returns as soon as one request is in (as vLLM's does once it has work)."""

    def __init__(self, scheduler):
        self.scheduler, self.input_queue, self.running = scheduler, queue.Queue(), True

    def is_running(self):
        return self.running

    def _handle_client_request(self, kind, req):
        if kind == "ADD":
            self.scheduler.waiting.append(req)

    def _process_input_queue(self):
        if not self.scheduler.get_num_unfinished_requests():
            self._handle_client_request(*self.input_queue.get())


def _classes():
    # fresh subclasses per test: install patches the classes it is given
    return type("Core", (FakeCore,), {}), type("Sched", (FakeScheduler,), {})


def test_parse():
    assert admit.parse("7/28") == (7, 28)
    for bad in ("7", "a/b", "0/28", "29/28", "7/28/1"):
        with pytest.raises(LabError, match="DFLASH_LAB_ADMIT"):
            admit.parse(bad)


@pytest.mark.parametrize("k", [1, 3, 7, 28])
def test_the_first_step_admits_k_of_the_n_requests_and_the_next_step_the_rest(k):
    Core, Sched = _classes()
    said = []
    admit.install(f"{k}/28", Core, Sched, log=said.append)
    sched = Sched()
    core = Core(sched)
    for i in range(28):
        core.input_queue.put(("ADD", i))
    core._process_input_queue()                 # vLLM's own handling stops after the first request; the gate holds
    assert sched.get_num_unfinished_requests() == 28
    assert sched.schedule() == k and sched.max_num_running_reqs == 64   # the bound restored after the first step
    assert sched.schedule() == 28               # every later step schedules as vLLM does
    assert said[0].startswith("admission gate: 28 of 28 requests in the scheduler")
    assert said[1] == f"admission gate: the first step admitted {k} request(s) ({28 - k} still waiting)"


def test_without_the_gate_the_first_step_takes_what_had_arrived():
    """What the gate replaces: vLLM's own path steps as soon as one request is in."""
    sched = FakeScheduler()
    core = FakeCore(sched)
    for i in range(28):
        core.input_queue.put(("ADD", i))
    core._process_input_queue()
    assert sched.schedule() == 1


def test_a_short_arrival_is_reported_and_the_engine_goes_on():
    said = []
    sched = FakeScheduler()
    core = FakeCore(sched)
    for i in range(3):
        core.input_queue.put(("ADD", i))
    core._process_input_queue()
    # a fake clock: the wait runs out after 3 of the 5 requests arrived
    ticks = iter([0.0, 0.0, 1.0, 1.0, 1.0, 200.0, 200.0])
    g = admit.Gate(2, 5, wait_s=120, log=said.append, clock=lambda: next(ticks))
    g.hold(core)
    assert g.arrived == 3 and g.state == "cap" and said[-1].endswith(
        "(the wait ran out); the first step admits at most 2") and said[-1].startswith("admission gate: 3 of 5")
    assert g.schedule(sched, FakeScheduler.schedule) == 2 and g.state == "done" and g.admitted == 2
    assert g.schedule(sched, FakeScheduler.schedule) == 3


def test_the_gate_acts_once_and_not_before_a_request_arrived():
    g = admit.Gate(1, 2, log=lambda m: None)
    sched = FakeScheduler()
    core = FakeCore(sched)
    g.hold(core)                                  # no request yet: nothing to hold for
    assert g.state == "hold"
    assert g.schedule(sched, FakeScheduler.schedule) == 0
    sched.waiting += [1, 2]
    g.hold(core)
    assert g.schedule(sched, FakeScheduler.schedule) == 1
    sched.waiting += [3, 4, 5]
    g.hold(core)
    assert g.state == "done" and g.schedule(sched, FakeScheduler.schedule) == 5


def test_a_stopping_engine_is_not_held():
    g = admit.Gate(1, 10, log=lambda m: None)
    sched = FakeScheduler()
    core = FakeCore(sched)
    sched.waiting.append(0)
    core.running = False
    g.hold(core)                                  # returns at once, with what had arrived
    assert g.arrived == 1


def test_the_vllm_source_lines_the_gate_relies_on():
    core = vllm_sources.read_source("vllm/v1/engine/core.py")
    for text in ("    def _process_input_queue(self):", "            self._process_input_queue()",
                 "                req = self.input_queue.get(block=block)",
                 "                self._handle_client_request(*req)",
                 "    def _handle_client_request(\n        self, request_type: EngineCoreRequestType, request: Any\n"):
        assert text in core, text
    sched = vllm_sources.read_source("vllm/v1/core/sched/scheduler.py")
    assert vllm_sources.line_of("vllm/v1/core/sched/scheduler.py",
                                "if len(self.running) == self.max_num_running_reqs:") == 549
    assert "        self.max_num_running_reqs = self.scheduler_config.max_num_seqs" in sched
    assert "    def get_num_unfinished_requests(self) -> int:" in sched
    # the async scheduler keeps the base class's schedule (the one the gate patches)
    assert "def schedule(" not in vllm_sources.read_source("vllm/v1/core/sched/async_scheduler.py")
