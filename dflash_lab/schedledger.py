"""Scheduler ledger: what the engine core's scheduler holds when it keeps scheduling nothing while requests run.

``DFLASH_LAB_SCHED_LEDGER=<folder>``: in the engine-core process, vLLM 0.22.1's ``Scheduler.schedule`` and
``Scheduler.update_from_output`` (``AsyncScheduler`` overrides neither) are wrapped. In memory, a ring keeps the last
:data:`RING` scheduler events: each schedule that scheduled a token (the running requests' counters) and each update
(how many tokens each scheduled request got back, its counters before and after). Nothing is written while the engine
steps. When the scheduler has scheduled no token for :data:`SPIN_S` seconds on end while requests are running, one
``spin`` line goes to ``<folder>/ledger-<pid>.jsonl``: the running requests' counters, which of the schedule's early
outs holds for each (:func:`guards`), how many updates returned no token for each while it was scheduled
(``empty_updates``, counted over the whole run), and the ring, i.e. the steps that led there. While the spin lasts,
a ``spin_still`` line follows each time its length doubles; ``spin_end`` when a token is scheduled again.

Why: s53, s54 and s56's probed runs at concurrency 24 stopped stepping after step 295 with requests left. In s56 the
engine core's stacks (the hang snapshot's watcher, s55) showed its main thread in the step path
(``step_with_batch_queue`` -> ``execute_model``) and /proc showed it in ``hrtimer_nanosleep``, with the GPU idle: read
against vLLM 0.22.1's ``EngineCore._process_engine_step``, which sleeps 1 ms after a step that executed nothing while
the scheduler has requests, that is a loop scheduling nothing. This records what the scheduler held in that loop.

The ledger is an observer: a failure to read a field is recorded as that field's absence, a failure to write is
printed to stderr once, and nothing is raised into vLLM.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

ENV = "DFLASH_LAB_SCHED_LEDGER"
SPIN_S = 10.0       # no token scheduled this long with requests running: written (a probed step takes 0.2-2.3 s)
RING = 16           # scheduler events kept in memory and written with a spin
MAX_LINES = 200     # per process: a ledger never grows without bound
MAX_REQS = 64       # running requests written per event (max_num_seqs of every matrix so far)

# Request counters read from vllm.v1.request.Request (0.22.1), as the ledger names them
FIELDS = {"status": "status", "prompt": "num_prompt_tokens", "max_tokens": "max_tokens",
          "computed": "num_computed_tokens", "tokens": "num_tokens", "with_spec": "num_tokens_with_spec",
          "out": "num_output_tokens", "placeholders": "num_output_placeholders", "discard": "async_tokens_to_discard"}


def request_state(r) -> dict:
    """One request's scheduling counters (:data:`FIELDS`, plus ``id`` and ``spec``, the number of spec token ids it
    holds); a counter that cannot be read is left out."""
    s: dict = {}
    try:
        s["id"] = str(getattr(r, "request_id"))
    except Exception:  # noqa: BLE001 - an observer
        pass
    for name, attr in FIELDS.items():
        try:
            v = getattr(r, attr)
            s[name] = str(getattr(v, "name", v)) if name == "status" else int(v)
        except Exception:  # noqa: BLE001
            continue
    try:
        s["spec"] = len(r.spec_token_ids)
    except Exception:  # noqa: BLE001
        pass
    return s


def guards(s: dict, max_model_len: int | None) -> list[str]:
    """Which of vLLM 0.22.1's early outs in ``Scheduler.schedule``'s loop over running requests hold for a request's
    counters (v1/core/sched/scheduler.py, the RUNNING loop; tests check that the source still reads so):

    - ``"max_tokens guard"``: ``num_output_placeholders > 0`` and ``num_computed_tokens + 2 - num_output_placeholders
      >= num_prompt_tokens + max_tokens`` (async scheduling: the step in flight is sure to reach ``max_tokens``);
    - ``"no new tokens"``: ``num_tokens_with_spec + num_output_placeholders - num_computed_tokens <= 0``;
    - ``"max_model_len"``: ``max_model_len - 1 - num_computed_tokens <= 0``.

    A request with none of them would be scheduled (the token budget and the encoder aside). A counter missing from the
    state leaves its guard out."""
    out = []
    g = s.get
    if None not in (g("placeholders"), g("computed"), g("prompt"), g("max_tokens")):
        if s["placeholders"] > 0 and s["computed"] + 2 - s["placeholders"] >= s["prompt"] + s["max_tokens"]:
            out.append("max_tokens guard")
    if None not in (g("with_spec"), g("placeholders"), g("computed")):
        if s["with_spec"] + s["placeholders"] - s["computed"] <= 0:
            out.append("no new tokens")
    if max_model_len is not None and g("computed") is not None and max_model_len - 1 - s["computed"] <= 0:
        out.append("max_model_len")
    return out


def _sampled(model_out) -> dict:
    """Per request id of a ``ModelRunnerOutput``: [number of sampled ids, the first 4]."""
    out = {}
    ids = getattr(model_out, "req_ids", None) or []
    toks = getattr(model_out, "sampled_token_ids", None)
    if toks is None:
        return out
    for i, rid in enumerate(ids):
        try:
            t = [int(x) for x in toks[i]]
        except Exception:  # noqa: BLE001
            continue
        out[str(rid)] = [len(t), t[:4]]
    return out


class Ledger:
    """The ring and the spin detector of one scheduler (one engine-core process)."""

    def __init__(self, path: str, spin_s: float = SPIN_S, clock=time.monotonic, wall=time.time):
        self.path, self.spin_s, self.clock, self.wall = path, spin_s, clock, wall
        self.ring: collections.deque = collections.deque(maxlen=RING)
        self.n = 0                     # schedule calls
        self.lines = 0
        self.spin: dict | None = None  # {"t0", "wall0", "empty", "written", "next_s"}
        self.max_model_len = None
        # per request id: the updates that returned no token for it although it was scheduled (the schedule counter
        # n at each, the last 8 kept). Such an update leaves the step's 1 + k placeholders and computed tokens in place
        # (vLLM 0.22.1's update_from_output adjusts both only when the row holds a token)
        self.empty_updates: dict = {}
        self._failed = False
        self._lock = threading.Lock()

    # -- what the wrappers call ------------------------------------------------------------------------------------
    def on_schedule(self, scheduler, out) -> None:
        with self._lock:
            self.n += 1
            if self.max_model_len is None:
                self.max_model_len = getattr(scheduler, "max_model_len", None)
            tokens = int(getattr(out, "total_num_scheduled_tokens", 0) or 0)
            running = list(getattr(scheduler, "running", []) or [])
            now = self.clock()
            if tokens > 0 or not running:
                if self.spin is not None and self.spin["written"]:
                    self._write({"kind": "spin_end", "empty": self.spin["empty"],
                                 "s": round(now - self.spin["t0"], 3)})
                self.spin = None
                if tokens > 0:
                    self.ring.append(self._event("schedule", scheduler, out, running, tokens))
                return
            if self.spin is None:
                self.spin = {"t0": now, "wall0": self.wall(), "empty": 0, "written": False, "next_s": self.spin_s}
                self.ring.append(self._event("schedule", scheduler, out, running, tokens))
            sp = self.spin
            sp["empty"] += 1
            dur = now - sp["t0"]
            if dur >= sp["next_s"]:
                states = [request_state(r) for r in running[:MAX_REQS]]
                for s in states:
                    s["guards"] = guards(s, self.max_model_len)
                    e = self.empty_updates.get(s.get("id"))
                    s["empty_updates"], s["empty_at"] = (e["count"], e["at"]) if e else (0, [])
                line = {"kind": "spin_still" if sp["written"] else "spin", "since_wall": round(sp["wall0"], 3),
                        "s": round(dur, 3), "empty": sp["empty"], "running": len(running),
                        "waiting": _len(getattr(scheduler, "waiting", None)), "max_model_len": self.max_model_len,
                        "requests": states}
                if not sp["written"]:
                    line["ring"] = list(self.ring)
                self._write(line)
                sp["written"] = True
                sp["next_s"] = 2 * sp["next_s"]

    def on_update(self, scheduler, sched_out, model_out, before: dict) -> None:
        with self._lock:
            if not int(getattr(sched_out, "total_num_scheduled_tokens", 0) or 0):
                return   # the empty steps of a spin: counted by on_schedule
            sampled = _sampled(model_out)
            for rid in before:
                if rid in sampled and sampled[rid][0] == 0:
                    e = self.empty_updates.setdefault(rid, {"count": 0, "at": []})
                    e["count"] += 1
                    e["at"] = (e["at"] + [self.n])[-8:]
            reqs = getattr(scheduler, "requests", {}) or {}
            after = {}
            for rid in before:
                r = reqs.get(rid)
                after[rid] = request_state(r) if r is not None else {"gone": True}
            self.ring.append({"ev": "update", "n": self.n, "t": round(self.wall(), 3), "sampled": sampled,
                              "before": before, "after": after})

    # -- helpers -----------------------------------------------------------------------------------------------------
    def _event(self, ev, scheduler, out, running, tokens) -> dict:
        sched = getattr(out, "num_scheduled_tokens", None) or {}
        return {"ev": ev, "n": self.n, "t": round(self.wall(), 3), "tokens": tokens,
                "scheduled": {str(k): int(v) for k, v in list(sched.items())[:MAX_REQS]},
                "running": [request_state(r) for r in running[:MAX_REQS]],
                "waiting": _len(getattr(scheduler, "waiting", None))}

    def _write(self, line: dict) -> None:
        if self.lines >= MAX_LINES or self._failed:
            return
        line = {"pid": os.getpid(), "t": round(self.wall(), 3), **line}
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            data = (json.dumps(line) + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, data)   # one write per line: a reader never sees half a line from a live process
                os.fsync(fd)
            finally:
                os.close(fd)
            self.lines += 1
        except OSError as e:
            self._failed = True
            print(f"dflash-lab scheduler ledger: not written ({e})", file=sys.stderr, flush=True)


def _len(x) -> int | None:
    try:
        return len(x)
    except Exception:  # noqa: BLE001
        return None


def before_states(scheduler, sched_out) -> dict:
    """The counters of the requests a scheduler output scheduled, read before ``update_from_output`` changes them."""
    reqs = getattr(scheduler, "requests", {}) or {}
    out = {}
    for rid in list((getattr(sched_out, "num_scheduled_tokens", None) or {}).keys())[:MAX_REQS]:
        r = reqs.get(rid)
        if r is not None:
            out[str(rid)] = request_state(r)
    return out


def install(folder: str, scheduler_cls=None, spin_s: float = SPIN_S) -> str:
    """Wrap ``Scheduler.schedule`` and ``Scheduler.update_from_output`` (vLLM 0.22.1's, or the class given, for tests)
    with one :class:`Ledger` writing to ``<folder>/ledger-<pid>.jsonl``. Wrapping twice is a no-op."""
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler as scheduler_cls
    path = os.path.join(folder, f"ledger-{os.getpid()}.jsonl")
    if getattr(scheduler_cls.schedule, "_dflash_lab_ledger", None) is not None:
        return f"scheduler ledger already active, writing to {scheduler_cls.schedule._dflash_lab_ledger.path}"
    ledger = Ledger(path, spin_s=spin_s)
    orig_schedule, orig_update = scheduler_cls.schedule, scheduler_cls.update_from_output

    def schedule(self, *a, **kw):
        out = orig_schedule(self, *a, **kw)
        try:
            ledger.on_schedule(self, out)
        except Exception as e:  # noqa: BLE001 - an observer never ends the engine
            _complain(e)
        return out

    def update_from_output(self, scheduler_output, model_runner_output, *a, **kw):
        try:
            before = before_states(self, scheduler_output)
        except Exception as e:  # noqa: BLE001
            before = {}
            _complain(e)
        res = orig_update(self, scheduler_output, model_runner_output, *a, **kw)
        try:
            ledger.on_update(self, scheduler_output, model_runner_output, before)
        except Exception as e:  # noqa: BLE001
            _complain(e)
        return res

    schedule._dflash_lab_ledger = ledger
    scheduler_cls.schedule = schedule
    scheduler_cls.update_from_output = update_from_output
    return (f"scheduler ledger active: a spin of {spin_s:g} s scheduling nothing with requests running is written "
            f"to {path}")


_complained: set = set()


def _complain(e: Exception) -> None:
    key = type(e).__name__
    if key not in _complained:
        _complained.add(key)
        print(f"dflash-lab scheduler ledger: {key}: {e} (recording goes on)", file=sys.stderr, flush=True)


# -- reading a recorded ledger -----------------------------------------------------------------------------------------
def read(path: str) -> list[dict]:
    """The lines of one ``ledger-<pid>.jsonl`` (plain, .xz or .gz). A line that is not a ledger line is an error naming
    the file and line."""
    from .errors import LabError
    from .runner import read_recorded

    try:
        text = read_recorded(path)
    except OSError as e:
        raise LabError(f"{path}: cannot read the scheduler ledger ({e})") from None
    out = []
    for i, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            d = json.loads(raw)
        except ValueError:
            raise LabError(f"{path}:{i}: not a JSON line (a corrupt or cut scheduler ledger)") from None
        if not isinstance(d, dict) or d.get("kind") not in ("spin", "spin_still", "spin_end"):
            raise LabError(f"{path}:{i}: not a scheduler ledger line (kind spin, spin_still or spin_end)")
        out.append(d)
    return out


def spin_table(lines: list[dict]):
    """The first spin of a ledger, one row per running request: its counters, the early outs that hold
    (:func:`guards`, recomputed from the counters), and whether its output is short of ``max_tokens``."""
    import pandas as pd

    spins = [d for d in lines if d.get("kind") == "spin"]
    if not spins:
        return pd.DataFrame()
    sp = spins[0]
    rows = []
    for s in sp.get("requests") or []:
        g = guards(s, sp.get("max_model_len"))
        rows.append({"request": s.get("id"), "status": s.get("status"), "prompt": s.get("prompt"),
                     "max_tokens": s.get("max_tokens"), "output tokens": s.get("out"), "computed": s.get("computed"),
                     "placeholders": s.get("placeholders"), "tokens with spec": s.get("with_spec"),
                     "spec ids": s.get("spec"), "early outs": ", ".join(g) or "none",
                     "updates with no token": s.get("empty_updates"), "no-token updates at": s.get("empty_at"),
                     "output short of max_tokens": (None if s.get("out") is None or s.get("max_tokens") is None
                                                    else s["out"] < s["max_tokens"]),
                     "spin s": sp.get("s"), "empty schedules": sp.get("empty")})
    return pd.DataFrame(rows)


def last_updates(lines: list[dict], request: str, n: int = 4) -> list[dict]:
    """The last ``n`` updates of one request in the first spin's ring: tokens sampled and its counters before and
    after (``{"gone": True}`` once the scheduler no longer holds it), oldest first."""
    spins = [d for d in lines if d.get("kind") == "spin"]
    if not spins:
        return []
    out = []
    for ev in spins[0].get("ring") or []:
        if ev.get("ev") == "update" and request in (ev.get("before") or {}):
            out.append({"n": ev.get("n"), "t": ev.get("t"), "sampled": (ev.get("sampled") or {}).get(request),
                        "before": ev["before"][request], "after": (ev.get("after") or {}).get(request)})
    return out[-n:]
