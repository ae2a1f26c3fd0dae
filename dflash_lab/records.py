"""Launch records of ``copy_and_expand_dflash_inputs_kernel``: format, validation, atomic save.

A record is an ``.npz`` file with one entry per kernel parameter, named exactly as in the
kernel's signature in vLLM 0.22.1:

- pointer parameters: 1-D arrays holding the allocation the pointer points into, from the
  pointer onward, with the dtype vLLM uses (``block_table_ptr`` flattened row-major);
  ``num_rejected_tokens_ptr`` is a 0-d ``0`` when vLLM passes none (``HAS_NUM_REJECTED``
  false);
- scalar and constexpr parameters: 0-d arrays;
- ``grid``: 1-D integer array (the launch grid);
- optional ``meta``: a JSON string. Keys the project reads: ``extents`` (per pointer
  parameter, the number of elements the kernel may legitimately touch when smaller than
  the array, e.g. ``target_positions_ptr`` -> ``total_input_tokens``), ``allocated_blocks``
  (per request, how many block-table entries the scheduler allocated: slots outside them
  are checked separately), ``num_kv_blocks`` (blocks in the KV cache), ``source``
  (provenance: how the record was made).
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field

import numpy as np

from . import atomic
from .errors import LabError

POINTER_DTYPES = {
    "next_token_ids_ptr": np.int32,
    "target_positions_ptr": np.int64,
    "out_input_ids_ptr": np.int32,
    "out_context_positions_ptr": np.int64,
    "out_query_positions_ptr": np.int64,
    "out_context_slot_mapping_ptr": np.int64,
    "out_query_slot_mapping_ptr": np.int64,
    "out_token_indices_ptr": np.int32,
    "block_table_ptr": np.int32,
    "query_start_loc_ptr": np.int32,
    "num_rejected_tokens_ptr": np.int32,
}
SCALARS = [
    "block_table_stride", "parallel_drafting_token_id", "block_size", "num_query_per_req",
    "num_speculative_tokens", "total_input_tokens", "BLOCK_SIZE", "HAS_NUM_REJECTED",
]
PARAMS = list(POINTER_DTYPES) + SCALARS
OUTPUTS = [p for p in POINTER_DTYPES if p.startswith("out_")]


@dataclass
class Record:
    arrays: dict  # pointer params -> 1-D arrays (num_rejected may be None)
    scalars: dict  # scalar params -> int/bool
    grid: tuple
    meta: dict = field(default_factory=dict)
    path: str | None = None

    @property
    def has_num_rejected(self) -> bool:
        return bool(self.scalars["HAS_NUM_REJECTED"])

    def extent(self, param: str) -> int:
        ext = self.meta.get("extents", {}).get(param)
        arr = self.arrays.get(param)
        n = 0 if arr is None else len(arr)
        return n if ext is None else min(int(ext), n)

    @property
    def num_reqs(self) -> int:
        return int(self.grid[0])

    def block_table(self) -> np.ndarray:
        stride = int(self.scalars["block_table_stride"])
        bt = self.arrays["block_table_ptr"]
        return bt[: (len(bt) // stride) * stride].reshape(-1, stride)


def _bad(path, msg) -> LabError:
    return LabError(f"{path}: {msg}")


def load_record(path: str | os.PathLike) -> Record:
    """Read and validate a launch record; any problem is one LabError line."""
    path = str(path)
    if not os.path.isfile(path):
        raise _bad(path, "no such file")
    if not zipfile.is_zipfile(path):   # np.load would try it as a pickle and blame "pickled (object) data"
        raise _bad(path, "not a readable .npz launch record (not a zip archive: truncated, or another kind of file)")
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise _bad(path, f"not a readable .npz launch record ({type(e).__name__}: {e})") from None
    missing = [p for p in PARAMS + ["grid"] if p not in data]
    if missing:
        raise _bad(path, f"missing parameter(s): {', '.join(missing)}")
    unknown = sorted(set(data) - set(PARAMS) - {"grid", "meta"})
    if unknown:
        raise _bad(path, f"unexpected entries: {', '.join(unknown)}")
    scalars = {}
    for p in SCALARS:
        a = data[p]
        if a.ndim != 0 or a.dtype.kind not in "iub":
            raise _bad(path, f"{p} must be a 0-d integer, got shape {a.shape} dtype {a.dtype}")
        scalars[p] = int(a)
    arrays = {}
    for p, dt in POINTER_DTYPES.items():
        a = data[p]
        if p == "num_rejected_tokens_ptr" and not scalars["HAS_NUM_REJECTED"]:
            if a.ndim != 0 or int(a) != 0:
                raise _bad(path, f"{p} must be a 0-d 0 when HAS_NUM_REJECTED is false")
            arrays[p] = None
            continue
        if a.ndim != 1:
            raise _bad(path, f"{p} must be a 1-D array, got shape {a.shape}")
        if a.dtype != np.dtype(dt):
            raise _bad(path, f"{p} must have dtype {np.dtype(dt).name} as in vLLM, got {a.dtype}")
        if len(a) == 0:
            raise _bad(path, f"{p} is empty")
        arrays[p] = a
    grid = data["grid"]
    if grid.ndim != 1 or not 1 <= len(grid) <= 3 or grid.dtype.kind not in "iu" or (grid <= 0).any():
        raise _bad(path, f"grid must be 1 to 3 positive integers, got {grid!r}")
    if scalars["block_table_stride"] <= 0 or scalars["block_size"] <= 0:
        raise _bad(path, "block_table_stride and block_size must be positive")
    if scalars["BLOCK_SIZE"] <= 0 or scalars["BLOCK_SIZE"] & (scalars["BLOCK_SIZE"] - 1):
        raise _bad(path, "BLOCK_SIZE must be a power of two")
    meta = {}
    if "meta" in data:
        try:
            meta = json.loads(str(data["meta"]))
        except ValueError as e:
            raise _bad(path, f"meta is not valid JSON ({e})") from None
        if not isinstance(meta, dict):
            raise _bad(path, "meta must be a JSON object")
    return Record(arrays=arrays, scalars=scalars, grid=tuple(int(g) for g in grid), meta=meta, path=path)


def to_npz_dict(rec: Record) -> dict:
    out = {}
    for p, dt in POINTER_DTYPES.items():
        a = rec.arrays.get(p)
        out[p] = np.asarray(0, dtype=np.int32) if a is None else np.asarray(a, dtype=dt)
    for p in SCALARS:
        out[p] = np.asarray(int(rec.scalars[p]), dtype=np.int64)
    out["grid"] = np.asarray(rec.grid, dtype=np.int64)
    if rec.meta:
        out["meta"] = np.asarray(json.dumps(rec.meta, sort_keys=True))
    return out


def save_npz_atomic(path: str | os.PathLike, arrays: dict) -> None:
    """Write an .npz so that ``path`` is either the old file or the complete new one."""
    atomic.replace_with(path, lambda tmp: np.savez_compressed(tmp, **arrays), suffix=".npz")


def save_record(path: str | os.PathLike, rec: Record) -> None:
    save_npz_atomic(path, to_npz_dict(rec))
