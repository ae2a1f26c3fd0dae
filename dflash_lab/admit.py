"""Admission gate: how many requests the engine's first step admits, set instead of left to arrival timing.

Installed by :mod:`dflash_lab.plugin` in the engine-core process when ``DFLASH_LAB_ADMIT=K/N``. The offline runner
(``LLM.generate``) hands its N requests to the engine core while that process already steps, so how many the first
(prefill) step admits varies from run to run of one seeded workload (1-7 of 28 in s42-s45's probes), and with it the
rest of the schedule. With the gate, vLLM 0.22.1's engine core

1. holds its first step until N requests have arrived (``EngineCoreProc._process_input_queue``: after it returns, the
   gate keeps taking requests from the engine's own input queue and handing them to ``_handle_client_request``, the
   path every request takes), for at most :data:`WAIT_S` seconds; then
2. lets its first scheduler step with waiting requests admit at most K of them (``Scheduler.schedule`` with
   ``max_num_running_reqs`` set to K for that one call, the bound vLLM checks before admitting each waiting request,
   v1/core/sched/scheduler.py:549), and every later step schedules as vLLM does.

It acts once per engine process: the first N requests. What happened is printed to the engine log (``admission
gate: ...``); the probe's first step line records how many requests that step held, which is what an analysis must
read, not the setting.
"""

from __future__ import annotations

import queue
import time

ENV = "DFLASH_LAB_ADMIT"
WAIT_S = 120.0


def parse(value: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N): the first step admits at most K of the first N requests, 1 <= K <= N."""
    from .errors import LabError

    try:
        k, n = (int(x) for x in str(value).split("/"))
    except ValueError:
        raise LabError(f"{ENV}={value!r}: expected K/N, two whole numbers (e.g. 7/28)") from None
    if not 1 <= k <= n:
        raise LabError(f"{ENV}={value!r}: needs 1 <= K <= N")
    return k, n


class Gate:
    """The gate's state: ``hold`` (until N requests arrived), then ``cap`` (the first step with waiting requests
    admits at most K), then ``done``."""

    def __init__(self, k: int, n: int, wait_s: float = WAIT_S, log=None, clock=time.monotonic):
        self.k, self.n, self.wait_s, self.clock = k, n, wait_s, clock
        self.state = "hold"
        self.log = log or (lambda msg: None)
        self.arrived = None
        self.admitted = None

    def hold(self, engine) -> None:
        """After the engine core's own input handling: until N requests are in the scheduler (or the wait ran out,
        or the engine stops), take each next request from its input queue and handle it as the engine would."""
        if self.state != "hold" or not engine.scheduler.get_num_unfinished_requests():
            return
        t0 = self.clock()
        while engine.scheduler.get_num_unfinished_requests() < self.n and engine.is_running():
            left = self.wait_s - (self.clock() - t0)
            if left <= 0:
                break
            try:
                req = engine.input_queue.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            engine._handle_client_request(*req)
        self.arrived = engine.scheduler.get_num_unfinished_requests()
        self.state = "cap"
        self.log(f"admission gate: {self.arrived} of {self.n} requests in the scheduler after "
                 f"{self.clock() - t0:.3f} s" + ("" if self.arrived >= self.n else " (the wait ran out)")
                 + f"; the first step admits at most {self.k}")

    def schedule(self, scheduler, orig):
        """``Scheduler.schedule`` through the gate: the first call with waiting requests after the hold runs with
        ``max_num_running_reqs`` = K, restored afterwards."""
        if self.state != "cap" or not len(scheduler.waiting):
            return orig(scheduler)
        before = len(scheduler.running)
        saved = scheduler.max_num_running_reqs
        scheduler.max_num_running_reqs = min(saved, before + self.k)
        try:
            out = orig(scheduler)
        finally:
            scheduler.max_num_running_reqs = saved
            self.state = "done"
        self.admitted = len(scheduler.running) - before
        self.log(f"admission gate: the first step admitted {self.admitted} request(s) "
                 f"({len(scheduler.waiting)} still waiting)")
        return out


def install(value: str, core_cls=None, scheduler_cls=None, log=None) -> str:
    """Patch vLLM 0.22.1's engine core and scheduler (or the classes given, for tests) with one :class:`Gate`."""
    k, n = parse(value)
    if core_cls is None:
        from vllm.v1.engine.core import EngineCoreProc as core_cls
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler as scheduler_cls
    if log is None:
        from .engine_state import log_once as log
    gate = Gate(k, n, log=log)
    orig_input, orig_schedule = core_cls._process_input_queue, scheduler_cls.schedule

    def _process_input_queue(self, *a, **kw):
        out = orig_input(self, *a, **kw)
        gate.hold(self)
        return out

    def schedule(self, *a, **kw):
        return gate.schedule(self, lambda s: orig_schedule(s, *a, **kw))

    core_cls._process_input_queue = _process_input_queue
    scheduler_cls.schedule = schedule
    return f"admission gate active: the first step admits at most {k} of the first {n} requests (waits {WAIT_S:.0f} s)"
