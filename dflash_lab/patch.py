"""The fix, applied to an unmodified vLLM 0.22.1 at run time (see :mod:`dflash_lab.plugin`).

Three parts, each small and reviewable; ``patches/vllm-0.22.1-dflash.diff`` is the same
change as an upstream diff.

1. **The root cause: stale FA3 scheduler metadata in FULL CUDA graphs**
   (``FlashAttentionMetadataBuilder.update_block_table``). A hybrid target with a DFlash draft
   has its full-attention layers split over two (or more) KV-cache groups of the same spec (the
   assumed 5-layer draft sets the group size to 5, the published draft's 8 layers to 8, and
   either way the target's 10 attention layers go into two groups: 3, 11, 19, 27, 35 and
   7, 15, 23, 31, 39; :func:`dflash_lab.kvgroups.reusing_layers`). Every step, vLLM builds the FlashAttention metadata for the first group
   and *reuses* it for the others through ``update_block_table`` (only the block table and slot
   mapping change), so the second group's builder never runs ``build()`` at run time. But the
   FULL CUDA graphs were captured with each group built by its own builder, and FA3's
   ahead-of-time scheduler metadata lives in a persistent buffer *per builder*: the graphs of
   the second group read the second builder's buffer, last written during graph capture. FA3
   then schedules this step's attention with stale per-request work counts and split counts:
   wrong outputs in every row from the first FULL step on, NaN when a freshly replayed graph's
   output buffer holds NaN, and the consumers of those values (the GDN kernel, the DFlash input
   kernel, an inductor index assert) fault later. Eager mode and PIECEWISE graphs read the
   metadata object itself and are right. The fix copies the reused scheduler metadata into the
   group's own persistent buffer and points the metadata at it, so the graph and the metadata
   agree. Measured: ``notebooks/03_reproduction`` (probe), ``notebooks/04_fix``.
2. **Kernel** (``copy_and_expand_dflash_inputs_kernel``), defence in depth: the stock kernel's
   text from the pinned wheel with three anchored edits (:data:`KERNEL_EDITS`):
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
3. **Scheduler**, defence in depth: DFlash's first pass writes K/V for 1 + k query tokens
   starting one past the last accepted token, i.e. up to position ``seq_len + k``, but vLLM
   0.22.1 allocates only ``k`` lookahead slots (``Scheduler.num_lookahead_tokens``) for it, one
   short when all k drafts are accepted. The fix allocates ``k + 1`` (upstream did the same
   later, vllm PR #42971).

Parts 2 and 3 alone do not stop the crash (5 of 5 runs crashed with them on the H200, the
fault moving into the GDN kernel): they close real out-of-bounds accesses of consumers, not
the source of the wrong values.
"""

from __future__ import annotations

from dataclasses import replace

from .engine_state import KernelProxy, current_first_pass, track_first_pass
from .errors import LabError
from .kernels import KernelSource, vllm_kernel


#: the parts ``apply()`` installs, recorded in every run line made with the fix (``fix_parts``);
#: lines of runs made before part 1 existed carry no ``fix_parts`` (see ``analysis.fix_label``)
FIX_PARTS = ("fa3_schedule_refresh", "dflash_kernel_edits", "dflash_lookahead_k_plus_1")
FIX_PARTS_BEFORE_ROOT_CAUSE = ("dflash_kernel_edits", "dflash_lookahead_k_plus_1")


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


def refresh_graph_scheduler_metadata(builder, metadata):
    """Part 1 of the fix: make FULL graphs of ``builder``'s group read this step's FA3 schedule.

    ``metadata`` is what ``update_block_table`` returns for ``builder``'s KV-cache group: a
    shallow copy of another group's metadata, whose ``scheduler_metadata`` points into *that*
    group's builder's persistent buffer. The FULL CUDA graphs of this group were captured
    reading ``builder.scheduler_metadata``; copy the schedule there (zeroing the tail, as
    ``build()`` does) and point the metadata at it, so graph replay and eager execution read
    the same, current values. A builder without the persistent buffer (no FULL graphs, or no
    FA3 ahead-of-time scheduling) is left alone.
    """
    own = getattr(builder, "scheduler_metadata", None)
    cur = getattr(metadata, "scheduler_metadata", None)
    if own is None or cur is None or not getattr(builder, "use_full_cuda_graph", False):
        return metadata
    if cur.data_ptr() == own.data_ptr():
        return metadata
    n = cur.shape[0]
    own[:n].copy_(cur)
    own[n:].zero_()
    metadata.scheduler_metadata = own[:n]
    return metadata


def _patched_jit():
    if _state["kernel"] is None:
        from . import kernels

        _state["kernel"] = kernels.load(patched_kernel_source(), tag="patched")
    return _state["kernel"]


def selected_parts(value: str | None = None) -> tuple[str, ...]:
    """The parts ``DFLASH_LAB_FIX_PARTS`` names (comma-separated, in any order), or all of :data:`FIX_PARTS`
    when it is unset or empty. An unknown name is an error, not a silent no-op."""
    from .engine_state import ENV_FIX_PARTS, fix_part_names

    names = fix_part_names(value)
    if not names:
        return FIX_PARTS
    bad = sorted(set(names) - set(FIX_PARTS))
    if bad:
        raise LabError(f"{ENV_FIX_PARTS}={','.join(names)!r}: unknown part(s) {bad}; the parts are {list(FIX_PARTS)}")
    return tuple(p for p in FIX_PARTS if p in names)


def apply(parts: tuple[str, ...] | None = None) -> list[str]:
    """Install the fix (``parts``, default :func:`selected_parts`) into the running vLLM 0.22.1 process.
    Returns what was patched."""
    import vllm

    parts = selected_parts() if parts is None else parts

    if vllm.__version__ != "0.22.1":
        raise LabError(f"dflash-lab's fix is written for vLLM 0.22.1, this is {vllm.__version__}")
    from vllm.v1.attention.backends import flash_attn as fa_mod
    from vllm.v1.core.sched import scheduler as sched_mod
    from vllm.v1.spec_decode import dflash as dflash_mod

    done = []
    # 1. FA3 scheduler metadata of every KV-cache group that reuses another group's metadata
    B = fa_mod.FlashAttentionMetadataBuilder
    if "fa3_schedule_refresh" in parts and not getattr(B.update_block_table, "_dflash_lab", False):
        orig_update = B.update_block_table

        def update_block_table(self, metadata, blk_table, slot_mapping):
            return refresh_graph_scheduler_metadata(self, orig_update(self, metadata, blk_table, slot_mapping))

        update_block_table._dflash_lab = True
        B.update_block_table = update_block_table
    if "fa3_schedule_refresh" in parts:
        done.append("FlashAttention update_block_table: FULL graphs read their own group's current schedule")

    # 2. scheduler: k + 1 lookahead slots for DFlash
    Scheduler = sched_mod.Scheduler
    if "dflash_lookahead_k_plus_1" in parts and not getattr(Scheduler.__init__, "_dflash_lab", False):
        orig_init = Scheduler.__init__

        def __init__(self, *a, **kw):
            orig_init(self, *a, **kw)
            sc = self.vllm_config.speculative_config
            if sc is not None and sc.use_dflash():
                self.num_lookahead_tokens = dflash_lookahead(sc.num_speculative_tokens)

        __init__._dflash_lab = True
        Scheduler.__init__ = __init__
    if "dflash_lookahead_k_plus_1" in parts:
        done.append("scheduler: DFlash lookahead k+1")

    # 3. kernel: route the proposer's launch to the patched kernel with its extra arguments
    if "dflash_kernel_edits" in parts:
        track_first_pass(dflash_mod.DFlashProposer)
        KernelProxy.install(dflash_mod).launcher = launch_patched
        done.append("kernel: copy_and_expand_dflash_inputs_kernel patched")
    return done


def launch_patched(grid, kwargs: dict):
    """Launches the patched kernel instead of the stock one (the kernel proxy's launcher)."""
    cad, proposer = current_first_pass()
    extra = {
        "seq_lens_ptr": cad.seq_lens,
        "num_lookahead_tokens": dflash_lookahead(proposer.num_speculative_tokens),
        "max_model_len": proposer.max_model_len,
    }
    return _patched_jit()[grid](**kwargs, **extra)


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

FA_OLD = (
    "        new_metadata = copy.copy(metadata)\n"
    "        new_metadata.block_table = blk_table\n"
    "        new_metadata.slot_mapping = slot_mapping\n"
    "        return new_metadata\n"
)
FA_NEW = (
    "        new_metadata = copy.copy(metadata)\n"
    "        new_metadata.block_table = blk_table\n"
    "        new_metadata.slot_mapping = slot_mapping\n"
    "        # The FULL CUDA graphs of this builder's KV-cache group were captured reading\n"
    "        # self.scheduler_metadata, but `metadata` was built by another group's builder:\n"
    "        # copy its FA3 schedule into our persistent buffer so graph replay sees it.\n"
    "        own = getattr(self, \"scheduler_metadata\", None)\n"
    "        cur = metadata.scheduler_metadata\n"
    "        if self.use_full_cuda_graph and own is not None and cur is not None:\n"
    "            n = cur.shape[0]\n"
    "            own[:n] = cur\n"
    "            own[n:] = 0\n"
    "            new_metadata.scheduler_metadata = own[:n]\n"
    "        return new_metadata\n"
)

RATIONALE = """\
dflash-lab: fix for vLLM 0.22.1's DFlash + FULL-CUDA-graph crash (against the vllm-0.22.1 wheel's sources).

Hunk 1, vllm/v1/attention/backends/flash_attn.py (FlashAttentionMetadataBuilder.update_block_table):
  the root cause. With a DFlash draft, the hybrid target's full-attention layers are split over two
  KV-cache groups of the same spec. At run time the second group reuses the first group's metadata
  through update_block_table, so its builder never rebuilds; its FULL CUDA graphs, captured with that
  builder's own persistent FA3 scheduler_metadata buffer, replay with the schedule written during
  capture. Evidence: notebooks/03_reproduction (step probe: every FULL step diverges from a no-graph
  reference pass of the same step; layers 0-7 write bit-identically, attention layer 3 and layer 7's own
  K/V included, and GDN layer 8 is the first to write differently: what differs is the output of
  attention layer 7, the second group's first layer; the first 480-token replay turns NaN:
  data/gpu/2026-11-30_h200_root-probe-tp1/), notebooks/04_fix (the mechanism on vLLM's own code).
Hunk 2, vllm/v1/spec_decode/utils.py (copy_and_expand_dflash_inputs_kernel):
  - last_pos is loaded only from the request's own context. With every context token rejected
    (a discarded request: valid_count 0), stock reads target_positions[ctx_start - 1]: the previous
    request's position, or target_positions[-1] for request 0 (out of bounds). Evidence:
    notebooks/02_kernel_bounds (data/records/req0_all_rejected.npz; the same violation compiled on the
    H200: data/gpu/2026-11-30_h200_repro-tp1/gpu_replay.jsonl) and launches recorded inside the real
    engine with all-rejected requests (data/gpu/2026-11-30_h200_isolate-tp1/*.hook/launch-*-00027[2-4]-last.npz).
  - block numbers are confined to the blocks allocated to the request (seq_len + lookahead), from
    both sides; tokens without a valid slot get -1, which the cache writes skip. Evidence: notebook 02
    (all_accepted_block_edge*, past_max_model_len), notebook 04 (replay parity).
Hunk 3, vllm/v1/spec_decode/dflash.py: pass seq_lens, the lookahead and max_model_len to the kernel.
Hunk 4, vllm/v1/core/sched/scheduler.py: DFlash needs k + 1 lookahead slots (notebook 02,
  all_accepted_block_edge: the last query slot of a fully accepted block lands outside the allocation).
Hunks 2-4 are defence in depth: alone they did not stop the crash (the recorded run with them crashed,
  1/1, the core dump then naming the GDN kernel: data/runs/2026-11-30_h200_root-coredump-tp1.jsonl).

Verified on one H200 as this diff (GPU session 2026-12-03-s47, data/runs/2026-12-03_h200_verify-diff-*-tp1.jsonl,
matrices/verify-diff-tp1.yaml, predictions written before the runs): the engine started on a copy of the vLLM
0.22.1 package with these hunks applied, each at its own line numbers, no fuzz (dflash_lab/vllmdiff.py), and
no plugin fix. Stock controls in the same session crashed at 32, 20 and 8 (cores: the DFlash input kernel
twice, the GDN kernel at 8); with the diff 10/10 runs at concurrency 32, then 3/3 at 8 and 3/3 at 20 completed
(one engine start), and
under the step probe at 8 all 279 FULL-graph steps were identical to the no-graph pass (largest difference 0).
On the OpenAI server, the report's path (GPU session 2026-12-03-s48, data/runs/2026-12-03_h200_verify-diff-
server-*-tp1.jsonl, matrices/verify-diff-server-tp1.yaml, predictions written before the runs): stock servers
in the same session crashed at 32, 8 and 20 (cores: the DFlash input kernel at 32 and 20, the GDN kernel at
8; clients saw HTTP 200, then an in-stream error); the diff's server completed 10/10 runs at 32, 3/3 at 8 and
3/3 at 20 (one server start), every request HTTP 200 with all 512 tokens; at synthetic acceptance 6.0 and
concurrency 8 it counted exactly 6.000 tokens per step in 3/3 runs where stock counted 5.11-5.12 (3/3).
Before that, the same change applied through the dflash_lab plugin:
GPU session 2026-11-30-s14 (data/runs/2026-11-30_h200_verify-fix-{a,b,c}-tp1.jsonl): the stock control
crashed at concurrency 32; with the change, 10/10 runs at concurrency 32 and 3/3 each at 16 and 64
completed; a step probe over 837 FULL-graph steps (1-32 requests) found the target's outputs identical
to a no-graph pass of the same step. GPU session 2026-11-30-s15 (verify-fix-d{1,2}): the stock control
crashed again at 32; with the change, greedy runs at 2 and 32 beside a PIECEWISE engine gave no garbage
output (128/130 requests token-identical; with dummy weights nearly every token is one repeated id, a
coarse check that stock also passed at 2), and throughput is at parity with PIECEWISE (1.05x on
medians of 4 warm runs, 0.92x-1.18x run by run). Hunk 1's own update_block_table is run on the CPU by
tests/test_root_cause.py. Hunk 1 alone (its plugin equivalent, no kernel edits, no k+1) at real size:
3/3 runs at concurrency 32 completed in GPU session 2026-11-30-s16, whose stock control crashed; under
the step probe (s17, s18) 986 FULL-graph steps at concurrency 2, 16 and 32 identical to the no-graph
pass (data/runs/2026-11-30_h200_discriminate2-*-tp1.jsonl). scripts/repro_min.py (vLLM only, a tiny
hybrid, hunk 1 as one function): reproduced and attributed in s18 and again in s23, the fixed engine's
greedy tokens and log-probabilities identical to a PIECEWISE engine's (data/gpu/2026-11-30_h200_repro-min-4,
data/gpu/2026-12-01_h200_repro-min-6). GPU session 2026-11-30-s22 (verify-fix-e{1,2}): stock controls
at 8 and 20 crashed; with the change 3/3 each at 8, 20, 24 and 28 completed (hunk 1 alone: 3/3 at 8
and at 20), where stock crashed in every run (plain runs: 8: 6/6, 20: 4/4, 24: 4/4, 28: 4/4 over s19-s22). On the
OpenAI server the plugin's change completed every run of issue 11's benchmark (GPU sessions s24-s34: 158
runs, warm-ups included, at concurrency 1-64, acceptance 1.86-6.0; a benchmark, not a crash test with its
own stock control). Not measured: TP > 1, real weights. Stock also crashed 3/3 at 64 (s20), in a later session than
the fix's 3/3 there, but completed at 16 (3/3 without the launch hook in s21), so the fix's 3/3 at 16 is no evidence.
"""


def upstream_diff() -> str:
    import difflib

    from .vllm_sources import read_source

    out = [RATIONALE]
    for rel in UPSTREAM_FILES:
        old = read_source(rel)
        new = patched_source(rel)
        out += difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{rel}", f"b/{rel}", n=3)
    return "".join(out)


UPSTREAM_FILES = ("vllm/v1/attention/backends/flash_attn.py", "vllm/v1/spec_decode/utils.py",
                  "vllm/v1/spec_decode/dflash.py", "vllm/v1/core/sched/scheduler.py")


def patched_source(rel: str) -> str:
    """The text of one vLLM 0.22.1 file with the upstream change applied (what the diff turns it into)."""
    from .vllm_sources import read_source

    old = read_source(rel)
    if rel == "vllm/v1/spec_decode/utils.py":
        stock = vllm_kernel().text
        return old.replace(stock, patch_text(stock))
    edit = {"vllm/v1/attention/backends/flash_attn.py": (FA_OLD, FA_NEW),
            "vllm/v1/spec_decode/dflash.py": (CALL_OLD, CALL_NEW),
            "vllm/v1/core/sched/scheduler.py": (SCHED_OLD, SCHED_NEW)}.get(rel)
    if edit is None:
        raise LabError(f"{rel}: not a file of the upstream change")
    if old.count(edit[0]) != 1:
        raise LabError(f"anchor not found exactly once in {rel}")
    return old.replace(edit[0], edit[1])
