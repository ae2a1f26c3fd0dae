"""Replay a launch record through the bounds-instrumented kernel (stock or patched).

Every pointer argument is laid out with guard cells before and after its real data, filled
with a sentinel, so that an out-of-bounds read returns a recognisable value (and shows up
downstream, e.g. as a garbage position) and an out-of-bounds write lands in a guard where
it is detected, instead of touching unrelated memory. Accesses that would go farther than
the guard cells are reported but not performed (``instrument(contain=GUARD)``), so a record
with wild values cannot crash the replaying process.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import numpy as np

from . import atomic
from .errors import LabError
from .records import OUTPUTS, POINTER_DTYPES, Record

GUARD = 1024
KERNELS = ("stock", "patched")


def sentinel(param: str, dtype) -> int:
    """A value no real buffer holds: 0x3FFF0000 + the parameter's index (int32), shifted for int64."""
    i = list(POINTER_DTYPES).index(param)
    return (0x3FFF0000 + i) if np.dtype(dtype).itemsize == 4 else (0x3FFF0000 + i) << 16


@dataclass
class ReplayResult:
    kernel: str
    device: str
    violations: list
    overflowed: bool
    guard_writes: dict  # param -> number of guard cells overwritten
    outputs: dict  # output param -> array after the launch (real extent only)
    record: Record = field(repr=False, default=None)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.guard_writes

    def as_json(self) -> dict:
        return {
            "kernel": self.kernel,
            "device": self.device,
            "record": self.record.path if self.record else None,
            "ok": self.ok,
            "violations": [v.as_dict() for v in self.violations],
            "violations_truncated": self.overflowed,
            "guard_writes": self.guard_writes,
        }


def _pointer_params(kernel_params: list[str]) -> list[str]:
    return [p for p in kernel_params if p.endswith("_ptr")]


def kernel_for(name: str):
    """(KernelSource, extra-args function) for 'stock' or 'patched'."""
    from .kernels import vllm_kernel

    if name == "stock":
        return vllm_kernel(), (lambda rec, t: {})
    if name == "patched":
        from . import patch

        return patch.patched_kernel_source(), patch.replay_extra_args
    raise LabError(f"unknown kernel {name!r}: choose one of {', '.join(KERNELS)}")


@functools.lru_cache(maxsize=1)
def _code_digest() -> bytes:
    """The instrumenter's and this module's source: a change to either invalidates cached replays."""
    import hashlib

    from . import instrument

    return hashlib.sha256(open(instrument.__file__, "rb").read() + open(__file__, "rb").read()).digest()


def _cache_key(rec: Record, ks, kernel: str) -> str:
    """Content hash of everything a CPU replay's result depends on."""
    import hashlib
    import json

    h = hashlib.sha256()
    h.update(f"{kernel}|{GUARD}|{ks.text}|{sorted(ks.constants.items())}".encode())
    h.update(_code_digest())
    for p in sorted(rec.arrays):
        a = rec.arrays[p]
        h.update(p.encode())
        if a is not None:
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(np.ascontiguousarray(a).tobytes())
    h.update(json.dumps({"scalars": {k: int(v) for k, v in rec.scalars.items()}, "grid": list(map(int, rec.grid)),
                         "meta": rec.meta}, sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]


def _cache_load(path, rec: Record, kernel: str):
    import json

    from .instrument import Violation

    try:
        with np.load(path, allow_pickle=False) as z:
            info = json.loads(str(z["info"]))
            outputs = {k[4:]: z[k].copy() for k in z.files if k.startswith("out:")}
    except (OSError, ValueError, KeyError):
        return None  # a damaged cache entry is recomputed
    viol = [Violation(**{**v, "program_id": tuple(v["program_id"])}) for v in info["violations"]]
    return ReplayResult(kernel=kernel, device="cpu", violations=viol, overflowed=info["overflowed"],
                        guard_writes=info["guard_writes"], outputs=outputs, record=rec)


def _cache_save(path, res: ReplayResult) -> None:
    import dataclasses
    import json

    info = {"violations": [dataclasses.asdict(v) for v in res.violations], "overflowed": res.overflowed,
            "guard_writes": res.guard_writes}
    atomic.replace_with(path, lambda tmp: np.savez(tmp, info=np.array(json.dumps(info)),
                                                   **{f"out:{k}": v for k, v in res.outputs.items()}), suffix=".npz")


def replay(rec: Record, kernel: str = "stock", device: str = "cpu") -> ReplayResult:
    """Run ``rec`` through the instrumented ``kernel``.

    CPU replays are deterministic functions of the record's content, the kernel text and the
    instrumenter: their results are cached by that content hash under ``<cache>/replay/``
    (``DFLASH_LAB_REPLAY_CACHE=0`` turns the cache off).
    """
    ks_extra = kernel_for(kernel)
    if device == "cpu" and os.environ.get("DFLASH_LAB_REPLAY_CACHE", "1") != "0":
        from .vllm_sources import cache_dir

        path = cache_dir() / "replay" / f"{_cache_key(rec, ks_extra[0], kernel)}.npz"
        if path.is_file():
            hit = _cache_load(path, rec, kernel)
            if hit is not None:
                return hit
        res = _replay(rec, kernel, device, ks_extra)
        _cache_save(path, res)
        return res
    return _replay(rec, kernel, device, ks_extra)


def _warm_one(job) -> bool:
    path, kernel = job
    from .records import load_record

    replay(load_record(path), kernel)
    return True


def prewarm(paths, kernels=("stock", "patched"), workers: int | None = None) -> int:
    """Fill the replay cache for every (record, kernel) in parallel processes, one per CPU core
    (interpreted replays are CPU-bound and independent); later :func:`replay` calls are cache hits.
    Does nothing with the cache off or one core. Returns the number of jobs run."""
    if os.environ.get("DFLASH_LAB_REPLAY_CACHE", "1") == "0":
        return 0
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    jobs = [(str(p), k) for p in paths for k in kernels]
    if workers < 2 or len(jobs) < 2:
        return 0
    import concurrent.futures as cf
    import multiprocessing as mp

    os.environ.setdefault("TRITON_INTERPRET", "1")
    with cf.ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=mp.get_context("spawn")) as ex:
        list(ex.map(_warm_one, jobs, chunksize=max(1, len(jobs) // (4 * workers))))
    return len(jobs)


def _replay(rec: Record, kernel: str, device: str, ks_extra) -> ReplayResult:
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise LabError("replay on the CPU needs TRITON_INTERPRET=1 (Triton's interpreter)")
    import torch

    from .instrument import instrument

    if device == "cuda" and not torch.cuda.is_available():
        raise LabError("--device cuda asked for, but no GPU is visible")
    ks, extra = ks_extra
    pointers = _pointer_params(ks.params)
    ins = instrument(ks, pointers, contain=GUARD)
    dev = torch.device(device)

    bufs, views, extents = {}, {}, {}
    args = {}
    for p, dt in POINTER_DTYPES.items():
        a = rec.arrays.get(p)
        if a is None:
            args[p] = 0
            continue
        buf = np.full(GUARD + len(a) + GUARD, sentinel(p, dt), dtype=dt)
        buf[GUARD : GUARD + len(a)] = a
        t = torch.from_numpy(buf).to(dev)
        bufs[p] = t
        views[p] = t[GUARD : GUARD + len(a)]
        args[p] = views[p]
        extents[p] = rec.extent(p)
    args.update(rec.scalars)
    args["HAS_NUM_REJECTED"] = bool(rec.scalars["HAS_NUM_REJECTED"])
    for name, val in extra(rec, dev).items():
        args[name] = val
        if isinstance(val, torch.Tensor):
            extents[name] = val.numel()
    missing = set(ks.params) - set(args)
    if missing:
        raise LabError(f"the {kernel} kernel needs arguments the record cannot supply: {sorted(missing)}")
    violations, overflowed = ins.run(rec.grid, args, extents=extents)
    if device == "cuda":
        torch.cuda.synchronize()
    guard_writes = {}
    for p, t in bufs.items():
        host = t.cpu().numpy()
        s = sentinel(p, host.dtype)
        n = int((host[:GUARD] != s).sum() + (host[GUARD + len(rec.arrays[p]) :] != s).sum())
        if n:
            guard_writes[p] = n
    outputs = {p: views[p].cpu().numpy().copy() for p in OUTPUTS if p in views}
    return ReplayResult(kernel=kernel, device=device, violations=violations, overflowed=overflowed,
                        guard_writes=guard_writes, outputs=outputs, record=rec)


def query_slots(rec: Record, outputs: dict) -> list[dict]:
    """Per request: query positions and slots the launch produced, checked against the allocation.

    For each request: the positions and slots of its 1 + k query tokens; which slots fall
    outside the KV cache, which are negative other than -1 (the padding slot vLLM's cache
    writes skip), and which lie outside the blocks allocated to the request (C1 in
    background.md: in bounds for the kernel, but another request's or nobody's memory).
    """
    nq = int(rec.scalars["num_query_per_req"])
    bs = int(rec.scalars["block_size"])
    table = rec.block_table()
    alloc = rec.meta.get("allocated_blocks")
    nkv = rec.meta.get("num_kv_blocks")
    out = []
    for i in range(rec.num_reqs):
        pos = outputs["out_query_positions_ptr"][i * nq : (i + 1) * nq]
        slots = outputs["out_query_slot_mapping_ptr"][i * nq : (i + 1) * nq]
        row = table[i] if i < len(table) else np.array([], dtype=np.int32)
        own = set()
        if alloc is not None:
            for b in row[: alloc[i]]:
                own.update(range(int(b) * bs, int(b) * bs + bs))
        info = {
            "req": i,
            "positions": pos.tolist(),
            "slots": slots.tolist(),
            "negative": [int(s) for s in slots if s < -1],
            "outside_cache": [int(s) for s in slots if nkv is not None and s >= nkv * bs],
            "outside_allocation": [int(s) for s in slots if alloc is not None and s >= 0 and int(s) not in own],
        }
        out.append(info)
    return out
