"""Launches of ``copy_and_expand_dflash_inputs_kernel`` built the way vLLM 0.22.1 builds them.

A :class:`Step` describes one drafter first pass: per request, how many tokens are already
in the KV cache (``num_computed``), how many context tokens this step feeds the drafter
(``num_scheduled``: 1 + k on a verify step, a prompt chunk on a prefill step) and, on
verify steps, how many of them were rejected (``num_rejected``, vLLM's
``num_draft + 1 - valid_count``). :func:`make_record` lays that out in buffers sized and
typed as vLLM's (``DFlashProposer`` and ``GPUModelRunner`` in 0.22.1), with a block table
whose rows cover exactly what the scheduler allocates (``num_computed + num_scheduled +
lookahead`` tokens, lookahead = k for DFlash in 0.22.1), so both out-of-bounds accesses
and slots outside a request's allocation can be checked on replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import LabError
from .records import Record


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


@dataclass
class Step:
    num_computed: list
    num_scheduled: list
    num_rejected: list | None = None  # None: first pass after prefill (HAS_NUM_REJECTED false)
    k: int = 15
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 32768
    max_model_len: int = 65536
    lookahead: int | None = None  # default: k, as vLLM 0.22.1's scheduler allocates for DFlash
    num_kv_blocks: int = 20000
    stale_rows: bool = False  # block-table entries past a row's allocation hold other requests' ids
    seed: int = 0
    label: str = ""
    mask_token_id: int = 248319

    def __post_init__(self):
        b = len(self.num_computed)
        if b == 0 or len(self.num_scheduled) != b:
            raise LabError("num_computed and num_scheduled must be non-empty lists of equal length")
        if self.num_rejected is not None and len(self.num_rejected) != b:
            raise LabError("num_rejected must have one entry per request")
        if b > self.max_num_seqs:
            raise LabError(f"{b} requests exceed max_num_seqs={self.max_num_seqs}")
        if sum(self.num_scheduled) > self.max_num_batched_tokens:
            raise LabError("the step schedules more tokens than max_num_batched_tokens")
        if min(self.num_scheduled) < 1 or min(self.num_computed) < 0:
            raise LabError("num_scheduled must be >= 1 and num_computed >= 0")
        if self.k < 1 or self.block_size < 1:
            raise LabError("k and block_size must be positive")

    @property
    def batch(self) -> int:
        return len(self.num_computed)

    @property
    def look(self) -> int:
        return self.k if self.lookahead is None else self.lookahead


def make_record(step: Step) -> Record:
    """Buffers exactly as vLLM 0.22.1 passes them to the kernel for ``step``."""
    rng = np.random.default_rng(step.seed)
    b, k, bs = step.batch, step.k, step.block_size
    nq = 1 + k
    max_query_tokens = step.max_num_seqs * nq
    n_ctx = int(sum(step.num_scheduled))
    max_blocks = cdiv(step.max_model_len, bs)

    qsl = np.zeros(step.max_num_seqs + 1, dtype=np.int32)
    qsl[1 : b + 1] = np.cumsum(step.num_scheduled)
    qsl[b + 1 :] = qsl[b]  # vLLM fills the tail with the last value
    positions = np.zeros(step.max_num_batched_tokens, dtype=np.int64)
    for i in range(b):
        positions[qsl[i] : qsl[i + 1]] = step.num_computed[i] + np.arange(step.num_scheduled[i])

    # Block table: allocation covers num_computed + num_scheduled + lookahead tokens.
    alloc = [min(cdiv(min(c + s + step.look, step.max_model_len), bs), max_blocks)
             for c, s in zip(step.num_computed, step.num_scheduled)]
    need = sum(alloc)
    if need >= step.num_kv_blocks:
        raise LabError(f"the step needs {need} KV blocks but num_kv_blocks={step.num_kv_blocks}")
    pool = rng.permutation(np.arange(1, step.num_kv_blocks, dtype=np.int32))  # block 0: null block
    table = np.zeros((step.max_num_seqs, max_blocks), dtype=np.int32)
    used = 0
    for i, n in enumerate(alloc):
        table[i, :n] = pool[used : used + n]
        used += n
        if step.stale_rows:
            # a previous tenant of this row held more blocks; vLLM does not clear them
            tail = min(max_blocks - n, 8)
            start = len(pool) - (i + 1) * 8
            table[i, n : n + tail] = pool[start : start + tail]
    rej = None
    if step.num_rejected is not None:
        rej = np.asarray(step.num_rejected, dtype=np.int32)
    max_ctx = max(step.num_scheduled)
    block = min(256, next_pow2(max_ctx + nq))
    arrays = {
        "next_token_ids_ptr": rng.integers(0, 1000, size=b, dtype=np.int32),
        "target_positions_ptr": positions,
        "out_input_ids_ptr": np.zeros(step.max_num_batched_tokens, dtype=np.int32),
        "out_context_positions_ptr": np.zeros(step.max_num_batched_tokens, dtype=np.int64),
        "out_query_positions_ptr": np.zeros(max_query_tokens, dtype=np.int64),
        "out_context_slot_mapping_ptr": np.zeros(step.max_num_batched_tokens, dtype=np.int64),
        "out_query_slot_mapping_ptr": np.zeros(max_query_tokens, dtype=np.int64),
        "out_token_indices_ptr": np.zeros(b * k, dtype=np.int32),
        "block_table_ptr": table.reshape(-1),
        "query_start_loc_ptr": qsl,
        "num_rejected_tokens_ptr": rej,
    }
    scalars = {
        "block_table_stride": max_blocks,
        "parallel_drafting_token_id": step.mask_token_id,
        "block_size": bs,
        "num_query_per_req": nq,
        "num_speculative_tokens": k,
        "total_input_tokens": n_ctx,
        "BLOCK_SIZE": block,
        "HAS_NUM_REJECTED": rej is not None,
    }
    seq_lens = [c + s for c, s in zip(step.num_computed, step.num_scheduled)]
    meta = {
        "extents": {"target_positions_ptr": n_ctx, "next_token_ids_ptr": b,
                    "query_start_loc_ptr": b + 1, "num_rejected_tokens_ptr": b,
                    "block_table_ptr": step.max_num_seqs * max_blocks},
        "allocated_blocks": alloc,
        "seq_lens": seq_lens,
        "num_lookahead_tokens": step.look,
        "max_model_len": step.max_model_len,
        "num_kv_blocks": step.num_kv_blocks,
        "source": "synthetic (dflash_lab.scenarios.make_record)",
        "label": step.label,
    }
    return Record(arrays=arrays, scalars=scalars, grid=(b, cdiv(max_ctx + nq, block)), meta=meta)


def verify_step(num_computed, accepted, **kw) -> Step:
    """A padded verify step: each request scheduled 1 + k tokens, ``accepted[i]`` drafts accepted.

    vLLM: valid_count = accepted + 1, num_rejected = k + 1 - valid_count = k - accepted.
    """
    k = kw.get("k", 15)
    acc = list(accepted)
    if any(a < 0 or a > k for a in acc):
        raise LabError(f"accepted drafts must lie in 0..{k}")
    return Step(num_computed=list(num_computed), num_scheduled=[1 + k] * len(acc),
                num_rejected=[k - a for a in acc], **kw)


@dataclass
class Scenario:
    name: str
    step: Step
    why: str
    expect_violation: bool = field(default=False)


def standard_scenarios() -> list[Scenario]:
    """The launches notebook 02 and the tests replay: realistic verify steps and the edge cases."""
    crash_b = [365, 518, 574, 365, 413, 432, 440]
    return [
        Scenario("crashB_7x16_mixed", verify_step(crash_b, [0, 1, 0, 2, 0, 0, 3], label="report crash B shape"),
                 "the report's crash B: 7 requests x 16 tokens, acceptance ~1.86"),
        Scenario("crashA_32x16_mixed",
                 verify_step([117 + i for i in range(32)], [(7 * i) % 16 for i in range(32)], label="report crash A shape"),
                 "the report's crash A: 32 requests x 16 tokens, short contexts"),
        Scenario("prefill_first_pass", Step(num_computed=[0, 0, 0], num_scheduled=[40, 37, 52], num_rejected=None),
                 "first drafter pass after prefill (no rejected tokens passed)"),
        Scenario("all_accepted_block_edge", verify_step([417, 100], [15, 15]),
                 "every draft accepted where seq_len + k crosses a block boundary: last query slot unallocated (C1)"),
        Scenario("all_accepted_block_edge_stale", verify_step([417, 100], [15, 15], stale_rows=True),
                 "same, block-table rows hold stale ids of earlier tenants: the slot is another request's (C1)"),
        Scenario("req0_all_rejected", Step(num_computed=[100, 200], num_scheduled=[16, 16], num_rejected=[16, 0]),
                 "request 0 discarded with all 16 context tokens rejected: reads target_positions[-1] (C2)",
                 expect_violation=True),
        Scenario("req1_all_rejected", Step(num_computed=[100, 200], num_scheduled=[16, 16], num_rejected=[0, 16]),
                 "request 1 all rejected: silently uses request 0's last position (C2, in bounds)"),
        Scenario("rejected_exceeds_ctx", Step(num_computed=[100, 200], num_scheduled=[16, 16], num_rejected=[20, 0]),
                 "num_rejected > num_ctx for request 0: reads before the tensor (C2)", expect_violation=True),
        Scenario("near_max_model_len", verify_step([65536 - 40, 100], [15, 3]),
                 "query positions close to (not past) max_model_len: stays inside the table"),
        Scenario("past_max_model_len", verify_step([65536 - 20, 100], [15, 3]),
                 "query positions run past max_model_len: stock clamps block_num to the table's last column "
                 "and writes into the request's last block"),
    ]
