"""In-engine capture of every ``copy_and_expand_dflash_inputs_kernel`` launch (vLLM 0.22.1).

Installed by :mod:`dflash_lab.plugin` when ``DFLASH_LAB_HOOK=<folder>`` is set. The kernel
name that ``vllm.v1.spec_decode.dflash`` imported is replaced by a
:class:`~dflash_lab.engine_state.KernelProxy` that launches the real kernel (stock, or the
patched one when the fix is on) with the very arguments vLLM built, then hands them to a
:class:`LaunchMonitor`.

The monitor must not change the timing it observes (``CUDA_LAUNCH_BLOCKING=1`` hid the
crash in the report), so by default it only enqueues device-to-host copies into pinned
ring slots on the current stream and inspects a slot on the CPU when the ring comes back
round to it, several steps later. In each launch it checks:

- ``C2``: a request whose rejected count leaves no valid context token, so the kernel's
  unmasked ``last_pos`` load reads outside the request's own context (index
  ``ctx_start - 1``; ``-1`` for request 0);
- ``fault``: a slot below -1 or past the end of the draft layer's KV cache (a write there
  is an illegal address);
- ``C1``: a slot inside the cache but in a block the scheduler did not allocate to the
  request (``num_blocks_per_row`` of the worker's block table);
- ``negative_position``: a query or context position below zero.

``DFLASH_LAB_HOOK_SYNC=1`` inspects each launch right after it (synchronising: exact, but
changes timing); ``DFLASH_LAB_HOOK_FATAL=1`` additionally raises at the first ``fault`` or
``C2`` finding, so the engine stops with a Python traceback at the offending launch.

Files written in the folder (one set per process): ``stats-<pid>.json`` (counts,
refreshed every few launches and at exit), ``findings-<pid>.jsonl`` (one line per
finding), ``launch-<pid>-<n>.npz`` (launch records, :mod:`dflash_lab.records` format:
the first few clean ones, every launch with a finding up to a limit, and the last ring of
launches when the process exits), ``engine-<pid>.json`` (capture sizes, block sizes, KV
cache size as the engine resolved them).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time

import numpy as np

from .engine_state import KernelProxy, current_first_pass, fix_kernel_patched, track_first_pass
from .records import POINTER_DTYPES, Record, save_record

ENV_HOOK = "DFLASH_LAB_HOOK"
RING = 6
MAX_FINDING_RECORDS = 12
CLEAN_RECORDS = 3


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    return x


class LaunchMonitor:
    def __init__(self, outdir: str, sync: bool = False, fatal: bool = False):
        self.outdir = outdir
        os.makedirs(outdir, exist_ok=True)
        self.pid = os.getpid()
        self.sync = sync or fatal
        self.fatal = fatal
        self.n = 0
        self.ring: list[dict | None] = [None] * RING
        self.stats = {"pid": self.pid, "launches": 0, "verify_launches": 0, "checked": 0,
                      "findings": {"C1": 0, "C2": 0, "fault": 0, "negative_position": 0},
                      "first_finding_launch": None, "records": 0, "sync": self.sync,
                      "fix": None, "started": time.time()}
        self.clean_saved = 0
        self.finding_saved = 0
        self.engine_dumped = False
        self.lock = threading.Lock()
        atexit.register(self.close)

    # ------------------------------------------------------------------ capture
    def after_launch(self, grid, kw):
        import torch

        cad_prop = current_first_pass()
        cad, proposer = cad_prop if cad_prop else (None, None)
        if proposer is not None and not self.engine_dumped:
            self._dump_engine(proposer)
        self.stats["fix"] = fix_kernel_patched()  # which kernel made the recorded outputs
        b = int(grid[0])
        n_ctx = int(kw["total_input_tokens"])
        nq = int(kw["num_query_per_req"])
        stride = int(kw["block_table_stride"])
        has_rej = bool(kw["HAS_NUM_REJECTED"])
        tp = kw["target_positions_ptr"]
        tp = tp[0] if tp.dim() == 2 else tp
        bt = kw["block_table_ptr"]
        dev = {
            "next_token_ids_ptr": kw["next_token_ids_ptr"][:b],
            "target_positions_ptr": tp[:n_ctx],
            "out_input_ids_ptr": kw["out_input_ids_ptr"][: b * nq],
            "out_context_positions_ptr": kw["out_context_positions_ptr"][:n_ctx],
            "out_query_positions_ptr": kw["out_query_positions_ptr"][: b * nq],
            "out_context_slot_mapping_ptr": kw["out_context_slot_mapping_ptr"][:n_ctx],
            "out_query_slot_mapping_ptr": kw["out_query_slot_mapping_ptr"][: b * nq],
            "out_token_indices_ptr": kw["out_token_indices_ptr"],
            "block_table_ptr": bt[:b].reshape(-1),
            "query_start_loc_ptr": kw["query_start_loc_ptr"][: b + 1],
        }
        if has_rej:
            dev["num_rejected_tokens_ptr"] = kw["num_rejected_tokens_ptr"][:b]
        if cad is not None:
            dev["seq_lens"] = cad.seq_lens[:b]
        slot = self.n % RING
        prev = self.ring[slot]
        if prev is not None:
            self._process(prev)
        host = {}
        for name, t in dev.items():
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            host[name] = h
        event = torch.cuda.Event()
        event.record()
        alloc = None
        if proposer is not None:
            try:
                btab = _runner_of(proposer).input_batch.block_table[proposer.kv_cache_gid]
                alloc = btab.num_blocks_per_row[:b].copy()
            except Exception:  # noqa: BLE001 - diagnostic only
                alloc = None
        scalars = {k: _jsonable(kw[k]) for k in
                   ("block_table_stride", "parallel_drafting_token_id", "block_size", "num_query_per_req",
                    "num_speculative_tokens", "total_input_tokens", "BLOCK_SIZE")}
        scalars["HAS_NUM_REJECTED"] = has_rej
        entry = {"n": self.n, "grid": tuple(int(g) for g in grid), "host": host, "event": event,
                 "scalars": scalars, "alloc": alloc, "stride": stride, "time": time.time(),
                 "num_kv_slots": self.stats.get("num_kv_slots"), "processed": False,
                 "max_model_len": getattr(proposer, "max_model_len", None)}
        self.ring[slot] = entry
        self.n += 1
        self.stats["launches"] = self.n
        if has_rej:
            self.stats["verify_launches"] += 1
        if self.sync:
            torch.cuda.synchronize()
            self._process(entry)
        if self.n % 25 == 0:
            self._write_stats()

    # ------------------------------------------------------------------ checks
    def _process(self, e: dict, wait: bool = True) -> None:
        if e["processed"]:
            return
        try:
            if wait:
                e["event"].synchronize()
            elif not e["event"].query():
                return
        except Exception:  # noqa: BLE001 - a dead context: keep what the copies delivered
            e["copy_state"] = "unknown (CUDA error while waiting)"
        e["processed"] = True
        h = {k: v.numpy() for k, v in e["host"].items()}
        findings = check_launch(h, e["scalars"], e["grid"], e["alloc"], e["num_kv_slots"])
        self.stats["checked"] += 1
        for f in findings:
            self.stats["findings"][f["kind"]] += 1
        if findings:
            if self.stats["first_finding_launch"] is None:
                self.stats["first_finding_launch"] = e["n"]
            with open(os.path.join(self.outdir, f"findings-{self.pid}.jsonl"), "a") as fh:
                for f in findings:
                    fh.write(json.dumps({"launch": e["n"], "time": e["time"], **f}) + "\n")
            if self.finding_saved < MAX_FINDING_RECORDS:
                self.finding_saved += 1
                self._save(e, h, "finding")
            if self.fatal and any(f["kind"] in ("fault", "C2") for f in findings):
                self._write_stats()
                raise RuntimeError(f"dflash-lab bounds check failed at DFlash launch {e['n']}: {findings[0]}")
        elif e["scalars"]["HAS_NUM_REJECTED"] and self.clean_saved < CLEAN_RECORDS:
            self.clean_saved += 1
            self._save(e, h, "clean")

    def _save(self, e, h, why: str) -> None:
        rec = to_record(h, e["scalars"], e["grid"], e["alloc"], e["num_kv_slots"], e.get("max_model_len"))
        rec.meta["source"] = f"vLLM 0.22.1 engine, dflash-lab hook, pid {self.pid}, launch {e['n']} ({why})"
        rec.meta["why"] = why
        rec.meta["copy_state"] = e.get("copy_state", "complete")
        rec.meta["fix"] = self.stats["fix"]
        save_record(os.path.join(self.outdir, f"launch-{self.pid}-{e['n']:06d}-{why}.npz"), rec)
        self.stats["records"] += 1

    def _dump_engine(self, proposer) -> None:
        self.engine_dumped = True
        info = {"pid": self.pid}
        try:
            cc = proposer.vllm_config.compilation_config
            info.update(
                cudagraph_mode=str(cc.cudagraph_mode),
                cudagraph_capture_sizes=list(cc.cudagraph_capture_sizes or []),
                max_cudagraph_capture_size=cc.max_cudagraph_capture_size,
                drafter_block_size=proposer.block_size,
                drafter_kv_cache_gid=proposer.kv_cache_gid,
                max_query_tokens=proposer.max_query_tokens,
                max_num_tokens=proposer.max_num_tokens,
                num_speculative_tokens=proposer.num_speculative_tokens,
            )
            keys = proposer.cudagraph_dispatcher.cudagraph_keys
            info["drafter_graph_keys"] = {str(m): sorted(d.num_tokens for d in ks) for m, ks in keys.items()}
            runner = _runner_of(proposer)
            if runner is not None:
                rk = runner.cudagraph_dispatcher.cudagraph_keys
                info["target_graph_keys"] = {str(m): sorted(d.num_tokens for d in ks) for m, ks in rk.items()}
            layer = next(iter(proposer._draft_attn_layer_names))
            kv = cc.static_forward_context[layer].kv_cache
            kv = kv[0] if isinstance(kv, (list, tuple)) else kv
            info["draft_kv_cache_shape"] = list(kv.shape)
            # FlashAttention layout: (2, num_blocks, block_size, kv_heads, head_dim)
            if kv.dim() == 5 and kv.shape[2] == proposer.block_size:
                self.stats["num_kv_slots"] = int(kv.shape[1] * kv.shape[2])
            info["num_kv_slots"] = self.stats.get("num_kv_slots")
            kvc = runner.kv_cache_config
            info["kv_cache_groups"] = [
                {"block_size": g.kv_cache_spec.block_size, "spec": type(g.kv_cache_spec).__name__,
                 "layers": len(g.layer_names)} for g in kvc.kv_cache_groups]
            info["num_blocks"] = kvc.num_blocks
        except Exception as ex:  # noqa: BLE001 - diagnostic only
            info["error"] = f"{type(ex).__name__}: {ex}"
        with open(os.path.join(self.outdir, f"engine-{self.pid}.json"), "w") as fh:
            json.dump(info, fh, indent=1, default=str)

    def _write_stats(self) -> None:
        self.stats["updated"] = time.time()
        path = os.path.join(self.outdir, f"stats-{self.pid}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.stats, fh, indent=1, default=str)
        os.replace(tmp, path)

    def close(self) -> None:
        """At exit: check what is left in the ring and keep the last launches as records."""
        with self.lock:
            self.stats["closing"] = True
            self._write_stats()
            for e in sorted((e for e in self.ring if e is not None), key=lambda e: e["n"]):
                try:
                    self._process(e, wait=False)
                    if not e["processed"]:
                        e["copy_state"] = "incomplete"
                    h = {k: v.numpy() for k, v in e["host"].items()}
                    self._save(e, h, "last")
                except Exception:  # noqa: BLE001 - best effort at exit
                    pass
            self.ring = [None] * RING
            self._write_stats()


def check_launch(h: dict, scalars: dict, grid, alloc, num_kv_slots) -> list[dict]:
    """Findings for one launch, from host copies of its arguments and outputs (numpy)."""
    out = []
    b = int(grid[0])
    nq = int(scalars["num_query_per_req"])
    bs = int(scalars["block_size"])
    qsl = h["query_start_loc_ptr"]
    rej = h.get("num_rejected_tokens_ptr")
    qpos = h["out_query_positions_ptr"]
    qslot = h["out_query_slot_mapping_ptr"]
    cslot = h["out_context_slot_mapping_ptr"]
    cpos = h["out_context_positions_ptr"]
    for r in range(b):
        s, e = int(qsl[r]), int(qsl[r + 1])
        if rej is not None and e - int(rej[r]) - 1 < s:
            out.append({"kind": "C2", "req": r, "index": e - int(rej[r]) - 1, "ctx_start": s,
                        "num_ctx": e - s, "num_rejected": int(rej[r])})
        pos = qpos[r * nq : (r + 1) * nq]
        sl = qslot[r * nq : (r + 1) * nq]
        bad = sl < -1
        if num_kv_slots:
            bad |= sl >= num_kv_slots
        if bad.any():
            out.append({"kind": "fault", "req": r, "where": "query", "slots": sl[bad].tolist()[:8]})
        if (pos < 0).any():
            out.append({"kind": "negative_position", "req": r, "where": "query", "positions": pos[pos < 0].tolist()[:8]})
        if alloc is not None:
            blk = pos // bs
            outside = (sl >= 0) & (blk >= int(alloc[r]))
            if outside.any():
                out.append({"kind": "C1", "req": r, "positions": pos[outside].tolist(),
                            "allocated_blocks": int(alloc[r]), "slots": sl[outside].tolist()})
        cs = cslot[s:e]
        cbad = cs < -1
        if num_kv_slots:
            cbad |= cs >= num_kv_slots
        if cbad.any():
            out.append({"kind": "fault", "req": r, "where": "context", "slots": cs[cbad].tolist()[:8]})
        if (cpos[s:e] < 0).any():
            out.append({"kind": "negative_position", "req": r, "where": "context"})
    return out


def to_record(h: dict, scalars: dict, grid, alloc, num_kv_slots, max_model_len=None) -> Record:
    b = int(grid[0])
    arrays = {}
    for p, dt in POINTER_DTYPES.items():
        if p in h:
            arrays[p] = np.ascontiguousarray(h[p]).astype(dt, copy=False).reshape(-1)
        else:
            arrays[p] = None
    meta = {"extents": {"target_positions_ptr": int(scalars["total_input_tokens"]),
                        "next_token_ids_ptr": b, "query_start_loc_ptr": b + 1,
                        "num_rejected_tokens_ptr": b}}
    if alloc is not None:
        meta["allocated_blocks"] = [int(a) for a in alloc]
    if "seq_lens" in h:
        meta["seq_lens"] = [int(x) for x in h["seq_lens"]]
    if num_kv_slots:
        meta["num_kv_blocks"] = int(num_kv_slots) // int(scalars["block_size"])
    if max_model_len:
        meta["max_model_len"] = int(max_model_len)
    return Record(arrays=arrays, scalars=dict(scalars), grid=tuple(grid), meta=meta)


def _runner_of(proposer):
    return getattr(proposer, "_dflash_lab_runner", None)


def install(outdir: str) -> None:
    from vllm.v1.spec_decode import dflash as dflash_mod

    P = dflash_mod.DFlashProposer
    if not getattr(P.__init__, "_dflash_lab_hook", False):
        orig_init = P.__init__

        def __init__(self, vllm_config, device, runner=None, *a, **kw):
            orig_init(self, vllm_config, device, runner, *a, **kw)
            # vLLM 0.22.1's proposer does not keep the runner; the hook needs its block table
            self._dflash_lab_runner = runner

        __init__._dflash_lab_hook = True
        P.__init__ = __init__
    track_first_pass(P)
    proxy = KernelProxy.install(dflash_mod)
    if proxy.monitor is None:
        proxy.monitor = LaunchMonitor(
            outdir,
            sync=os.environ.get("DFLASH_LAB_HOOK_SYNC") == "1",
            fatal=os.environ.get("DFLASH_LAB_HOOK_FATAL") == "1",
        )
