"""The fix, applied to an unmodified vLLM 0.22.1 at run time (see :mod:`dflash_lab.plugin`).

Two parts, each small and reviewable; ``patches/vllm-0.22.1-dflash.diff`` is the same
change as an upstream diff.

1. **Kernel** (``copy_and_expand_dflash_inputs_kernel``): the patched kernel is the stock
   kernel's text from the pinned wheel with three anchored edits (:data:`KERNEL_EDITS`):
   - the ``last_pos`` load is confined to the request's own context: when every context
     token of a request was rejected (or the count is garbage), the stock kernel reads
     ``target_positions[ctx_start - 1]``, i.e. the previous request's last position, or
     ``target_positions[-1]`` for request 0; the patched kernel uses the position just
     before the request's first context token, which is what "no token accepted" means;
   - block numbers are confined to the blocks the scheduler allocated to the request,
     from both sides (stock clamps only from above, to the table width);
   - any query or context token with no valid slot (negative position, position past the
     allocation or ``max_model_len``) gets slot -1, which vLLM's cache writes skip.
   The allocation bound needs ``seq_lens`` (already in the drafter's attention metadata),
   the scheduler's lookahead and ``max_model_len``: three new kernel arguments.
2. **Scheduler**: DFlash's first pass writes K/V for 1 + k query tokens starting one past
   the last accepted token, i.e. up to position ``seq_len + k``, but vLLM 0.22.1 allocates
   only ``k`` lookahead slots (``Scheduler.num_lookahead_tokens``) for it, one short when
   all k drafts are accepted. The fix allocates ``k + 1`` (upstream did the same later,
   vllm PR #42971).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

from .errors import LabError
from .kernels import KernelSource, vllm_kernel

ENV_FIX = "DFLASH_LAB_FIX"


def dflash_lookahead(k: int) -> int:
    """Lookahead slots the fixed scheduler allocates for DFlash: queries reach position seq_len + k."""
    return k + 1

#: (what, stock text, patched text) - applied in order, each anchor must occur exactly once.
KERNEL_EDITS = [
    (
        "new arguments: the request's seq_len, the scheduler's lookahead and max_model_len",
        "    num_rejected_tokens_ptr,  # [num_reqs] or null (0) when not padded\n",
        "    num_rejected_tokens_ptr,  # [num_reqs] or null (0) when not padded\n"
        "    seq_lens_ptr,  # [num_reqs] seq_len per request (dflash-lab)\n",
    ),
    (
        "new scalar arguments",
        "    total_input_tokens,  # tl.int32\n",
        "    total_input_tokens,  # tl.int32\n"
        "    num_lookahead_tokens,  # tl.int32 slots the scheduler allocates past seq_len (dflash-lab)\n"
        "    max_model_len,  # tl.int32 (dflash-lab)\n",
    ),
    (
        "last_pos confined to the request's own valid context",
        "    last_pos = tl.load(target_positions_ptr + valid_ctx_end - 1)\n",
        "    # dflash-lab: never read outside this request's own context tokens.\n"
        "    has_ctx = num_ctx > 0\n"
        "    valid_ctx_end = tl.minimum(tl.maximum(valid_ctx_end, ctx_start), ctx_end)\n"
        "    last_idx = tl.minimum(tl.maximum(valid_ctx_end - 1, ctx_start), total_input_tokens - 1)\n"
        "    last_loaded = tl.load(target_positions_ptr + last_idx)\n"
        "    # no valid context token: the last valid position precedes the first one\n"
        "    last_pos = tl.where(valid_ctx_end > ctx_start, last_loaded, last_loaded - 1)\n",
    ),
    (
        "block numbers confined to the allocated blocks; slot -1 where there is no valid slot",
        "    block_num = positions // block_size\n"
        "    # # Clamp block_number to avoid OOB when position is at max\n"
        "    block_num = tl.minimum(block_num, block_table_stride - 1)\n"
        "    block_id = tl.load(\n"
        "        block_table_ptr + req_idx * block_table_stride + block_num,\n"
        "        mask=in_bounds,\n"
        "        other=0,\n"
        "    ).to(tl.int64)\n"
        "    slot = block_id * block_size + (positions % block_size)\n",
        "    # dflash-lab: only positions inside the request's allocation get a slot.\n"
        "    seq_len = tl.load(seq_lens_ptr + req_idx)\n"
        "    alloc_tokens = tl.minimum(seq_len + num_lookahead_tokens, max_model_len)\n"
        "    alloc_blocks = tl.minimum((alloc_tokens + block_size - 1) // block_size, block_table_stride)\n"
        "    has_slot = in_bounds & has_ctx & (positions >= 0) & (positions < alloc_tokens)\n"
        "    block_num = positions // block_size\n"
        "    block_num = tl.minimum(tl.maximum(block_num, 0), tl.maximum(alloc_blocks - 1, 0))\n"
        "    block_id = tl.load(\n"
        "        block_table_ptr + req_idx * block_table_stride + block_num,\n"
        "        mask=has_slot,\n"
        "        other=0,\n"
        "    ).to(tl.int64)\n"
        "    slot = tl.where(has_slot, block_id * block_size + (positions % block_size), -1)\n",
    ),
]


def patch_text(stock: str) -> str:
    text = stock
    for what, old, new in KERNEL_EDITS:
        n = text.count(old)
        if n != 1:
            raise LabError(f"patch anchor for '{what}' found {n} times in the stock kernel (expected once)")
        text = text.replace(old, new)
    return text


def patched_kernel_source() -> KernelSource:
    stock = vllm_kernel()
    return replace(stock, text=patch_text(stock.text), origin=stock.origin + " (dflash-lab patched)")


def replay_extra_args(rec, device) -> dict:
    """Arguments the patched kernel needs beyond the record's: from the record's meta.

    seq_lens: ``meta.seq_lens`` or, failing that, one past each request's last context
    position. The lookahead is the fixed scheduler's (k + 1).
    """
    import numpy as np
    import torch

    b = rec.num_reqs
    seq = rec.meta.get("seq_lens")
    if seq is None:
        qsl = rec.arrays["query_start_loc_ptr"]
        pos = rec.arrays["target_positions_ptr"]
        seq = [int(pos[qsl[i + 1] - 1]) + 1 for i in range(b)]
    if len(seq) != b:
        raise LabError(f"{rec.path}: meta.seq_lens has {len(seq)} entries for {b} requests")
    k = int(rec.scalars["num_speculative_tokens"])
    max_model_len = int(rec.meta.get("max_model_len", rec.scalars["block_table_stride"] * rec.scalars["block_size"]))
    return {
        "seq_lens_ptr": torch.tensor(np.asarray(seq, dtype=np.int32), device=device),
        "num_lookahead_tokens": dflash_lookahead(k),
        "max_model_len": max_model_len,
    }


# --------------------------------------------------------------------------- engine side

_state = {"kernel": None}


def fix_enabled() -> bool:
    return os.environ.get(ENV_FIX, "0") not in ("", "0", "false", "False")


def _patched_jit():
    if _state["kernel"] is None:
        from . import kernels

        _state["kernel"] = kernels.load(patched_kernel_source(), tag="patched")
    return _state["kernel"]


def apply() -> list[str]:
    """Install the fix into the running vLLM 0.22.1 process. Returns what was patched."""
    import vllm

    if vllm.__version__ != "0.22.1":
        raise LabError(f"dflash-lab's fix is written for vLLM 0.22.1, this is {vllm.__version__}")
    from vllm.v1.core.sched import scheduler as sched_mod
    from vllm.v1.spec_decode import dflash as dflash_mod

    done = []
    # 1. scheduler: k + 1 lookahead slots for DFlash
    Scheduler = sched_mod.Scheduler
    if not getattr(Scheduler.__init__, "_dflash_lab", False):
        orig_init = Scheduler.__init__

        def __init__(self, *a, **kw):
            orig_init(self, *a, **kw)
            sc = self.vllm_config.speculative_config
            if sc is not None and sc.use_dflash():
                self.num_lookahead_tokens = dflash_lookahead(sc.num_speculative_tokens)

        __init__._dflash_lab = True
        Scheduler.__init__ = __init__
        done.append("scheduler: DFlash lookahead k+1")

    # 2. kernel: route the proposer's launch to the patched kernel with its extra arguments
    from .hook import KernelProxy, track_first_pass

    track_first_pass(dflash_mod.DFlashProposer)
    KernelProxy.install(dflash_mod)
    done.append("kernel: copy_and_expand_dflash_inputs_kernel patched")
    return done


def launch_patched(grid, kwargs: dict):
    """Called by the kernel proxy instead of the stock launch when the fix is on."""
    from .hook import current_first_pass

    cad, proposer = current_first_pass()
    extra = {
        "seq_lens_ptr": cad.seq_lens,
        "num_lookahead_tokens": dflash_lookahead(proposer.num_speculative_tokens),
        "max_model_len": proposer.max_model_len,
    }
    return _patched_jit()[grid](**kwargs, **extra)


def log_once(msg: str) -> None:
    print(f"dflash-lab [{os.getpid()}]: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- upstream diff

SCHED_OLD = (
    "            if speculative_config.use_eagle():\n"
    "                self.use_eagle = True\n"
    "                self.num_lookahead_tokens = self.num_spec_tokens\n"
)
SCHED_NEW = SCHED_OLD + (
    "                if speculative_config.use_dflash():\n"
    "                    # DFlash writes K/V for 1 + k query tokens after the last accepted\n"
    "                    # token, up to position seq_len + k: one slot more than k.\n"
    "                    self.num_lookahead_tokens = self.num_spec_tokens + 1\n"
)
CALL_OLD = "            total_input_tokens=num_context,\n"
CALL_NEW = (
    "            total_input_tokens=num_context,\n"
    "            seq_lens_ptr=cad.seq_lens,\n"
    "            num_lookahead_tokens=self.num_speculative_tokens + 1,\n"
    "            max_model_len=self.max_model_len,\n"
)

RATIONALE = """\
dflash-lab: fix for vLLM 0.22.1's DFlash input setup (against the vllm-0.22.1 wheel's sources).

Hunk 1, vllm/v1/spec_decode/utils.py (copy_and_expand_dflash_inputs_kernel):
  - last_pos is loaded only from the request's own context. With every context token rejected
    (a discarded request: valid_count 0), stock reads target_positions[ctx_start - 1]: the previous
    request's position, or target_positions[-1] for request 0 (out of bounds). Evidence:
    notebooks/02_kernel_bounds (data/records/req0_all_rejected.npz; the same violation compiled on the
    H200: data/gpu/2026-11-30_h200_repro-tp1/gpu_replay.jsonl) and launches recorded inside the real
    engine with all-rejected requests (data/gpu/2026-11-30_h200_isolate-tp1/*.hook/launch-*-00027[2-4]-last.npz).
  - block numbers are confined to the blocks allocated to the request (seq_len + lookahead), from
    both sides; tokens without a valid slot get -1, which the cache writes skip. Evidence: notebook 02
    (all_accepted_block_edge*, past_max_model_len), notebook 04 (replay parity).
Hunk 2, vllm/v1/spec_decode/dflash.py: pass seq_lens, the lookahead and max_model_len to the kernel.
Hunk 3, vllm/v1/core/sched/scheduler.py: DFlash needs k + 1 lookahead slots (notebook 02,
  all_accepted_block_edge: the last query slot of a fully accepted block lands outside the allocation).

Not claimed: that this removes the cudaErrorIllegalAddress of the report. On the H200 that crash needs
the target's FULL CUDA graphs and does not need the drafter's graphs (notebooks/03_reproduction).
"""


def upstream_diff() -> str:
    import difflib

    from .vllm_sources import read_source

    out = [RATIONALE]
    edits = [("vllm/v1/spec_decode/utils.py", None),
             ("vllm/v1/spec_decode/dflash.py", (CALL_OLD, CALL_NEW)),
             ("vllm/v1/core/sched/scheduler.py", (SCHED_OLD, SCHED_NEW))]
    for rel, edit in edits:
        old = read_source(rel)
        if edit is None:
            stock = vllm_kernel().text
            new = old.replace(stock, patch_text(stock))
        else:
            if old.count(edit[0]) != 1:
                raise LabError(f"anchor not found exactly once in {rel}")
            new = old.replace(edit[0], edit[1])
        out += difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{rel}", f"b/{rel}", n=3)
    return "".join(out)
