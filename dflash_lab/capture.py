"""CUDA-graph capture sizes of vLLM 0.22.1 and what they mean for the DFlash drafter's buffers.

vLLM decides capture sizes in three places that need a GPU engine to run. This module
mirrors them here, in one place each, and ``tests/test_capture.py`` checks the mirror
against values recorded from a real vLLM 0.22.1 engine on an H200 (``data/capture/``):

- ``VllmConfig._set_cudagraph_sizes`` (``config/vllm.py``): the default list
  ``[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)`` under the ceiling
  ``min(max_num_seqs * (1 + k) * 2, 512)`` capped at ``max_num_batched_tokens``;
- ``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode`` (``config/compilation.py``):
  with FULL decode graphs and spec decoding, every size is rounded up to a multiple of
  ``1 + k`` and sizes above the ceiling are dropped;
- ``CudagraphDispatcher`` (``v1/cudagraph_dispatcher.py``): a batch of ``n`` tokens replays
  the smallest captured size ``>= n``, or runs eagerly when ``n`` exceeds the largest.

The DFlash drafter (``v1/spec_decode/dflash.py``) dispatches PIECEWISE keys only, over the
same sizes; its query batch is ``B * (1 + k)`` tokens for ``B`` requests, and its query
buffers (``positions``, ``_slot_mapping_buffer``) hold ``max_query_tokens = max_num_seqs *
(1 + k)`` elements, while the padded graph size may be larger.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import LabError
from .kinds import whole

MODES = ("FULL_AND_PIECEWISE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "NONE")


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class Knobs:
    """The engine arguments that decide capture sizes and drafter buffers."""

    max_num_seqs: int = 64
    num_speculative_tokens: int = 15
    max_num_batched_tokens: int = 32768
    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    cudagraph_capture_sizes: tuple | None = None  # explicit sizes (compilation_config)
    max_cudagraph_capture_size: int | None = None
    enforce_eager: bool = False

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not whole(v) or v < 1:
                raise LabError(f"{name} must be a positive integer, got {v!r}")
        k = self.num_speculative_tokens
        if not whole(k) or k < 0:
            raise LabError(f"num_speculative_tokens must be an integer >= 0, got {k!r}")
        if self.cudagraph_mode not in MODES:
            raise LabError(f"cudagraph_mode must be one of {', '.join(MODES)}, got {self.cudagraph_mode!r}")
        if self.cudagraph_capture_sizes is not None:
            sizes = self.cudagraph_capture_sizes
            if not sizes or any(not whole(s) or s < 1 for s in sizes):
                raise LabError(f"cudagraph_capture_sizes must be a non-empty list of positive integers, got {sizes!r}")
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(sizes))
        m = self.max_cudagraph_capture_size
        if m is not None and (not whole(m) or m < 1):
            raise LabError(f"max_cudagraph_capture_size must be a positive integer, got {m!r}")

    @property
    def query_len(self) -> int:
        return 1 + self.num_speculative_tokens

    @property
    def max_query_tokens(self) -> int:
        """DFlashProposer.max_query_tokens = max_batch_size * (1 + k)."""
        return self.max_num_seqs * self.query_len


def config_capture_sizes(kn: Knobs) -> tuple[list[int], int]:
    """Mirror of VllmConfig._set_cudagraph_sizes: (sizes, max size) before the engine adjusts them."""
    if kn.enforce_eager or kn.cudagraph_mode == "NONE":
        return [], 0
    max_size = kn.max_cudagraph_capture_size
    if max_size is None:
        max_size = min(kn.max_num_seqs * kn.query_len * 2, 512)
    max_tokens = kn.max_num_batched_tokens
    max_size = min(max_tokens, max_size)
    if kn.cudagraph_capture_sizes is not None:
        sizes = sorted(i for i in set(kn.cudagraph_capture_sizes) if i <= max_tokens)
    else:
        sizes = [i for i in (1, 2, 4) if i <= max_size]
        if max_size >= 8:
            sizes += list(range(8, min(max_size + 1, 256), 8))
        if max_size >= 256:
            sizes += list(range(256, max_size + 1, 16))
        if max_tokens <= max_size and max_tokens not in sizes:
            sizes.append(max_tokens)
        sizes = sorted(set(sizes))
    valid_max = sizes[-1] if sizes else 0
    if (kn.cudagraph_capture_sizes is not None and kn.max_cudagraph_capture_size is not None
            and kn.max_cudagraph_capture_size != valid_max):
        raise LabError(
            f"max_cudagraph_capture_size ({kn.max_cudagraph_capture_size}) is inconsistent with the "
            f"largest cudagraph_capture_sizes ({valid_max}); vLLM refuses this too")
    return sizes, valid_max


def has_full_decode(mode: str) -> bool:
    return mode in ("FULL_AND_PIECEWISE", "FULL", "FULL_DECODE_ONLY")


def engine_capture_sizes(kn: Knobs) -> tuple[list[int], int]:
    """Mirror of the engine's adjust_cudagraph_sizes_for_spec_decode (FA3/GDN: UNIFORM_BATCH support)."""
    sizes, max_size = config_capture_sizes(kn)
    m = kn.query_len
    if not (has_full_decode(kn.cudagraph_mode) and m > 1) or not sizes:
        return sizes, max_size
    rounded = sorted({round_up(s, m) for s in sizes if round_up(s, m) <= max_size})
    if not rounded and m <= max_size:
        rounded = [m]
    if not rounded:
        raise LabError(
            f"no valid cudagraph sizes after rounding to a multiple of {m}; vLLM raises here "
            f"(num_speculative_tokens={kn.num_speculative_tokens}, max capture size {max_size})")
    return rounded, rounded[-1]


def padded_size(sizes: list[int], max_size: int, n: int) -> int | None:
    """CudagraphDispatcher: smallest captured size >= n, or None (eager) above the largest."""
    if not sizes or n > max_size:
        return None
    for s in sizes:
        if s >= n:
            return s
    return None


@dataclass(frozen=True)
class DrafterRow:
    batch: int
    query_tokens: int
    mode: str  # "graph", "padded", "eager"
    graph_size: int | None
    pad: int
    max_query_tokens: int
    over_buffer: int  # graph_size - max_query_tokens when the padded graph is larger than the buffers

    def as_dict(self) -> dict:
        return asdict(self)


def drafter_table(kn: Knobs) -> list[DrafterRow]:
    """For every batch size 1..max_num_seqs: what the DFlash drafter's first pass replays."""
    if kn.num_speculative_tokens < 1:
        raise LabError("the DFlash drafter needs num_speculative_tokens >= 1")
    sizes, max_size = engine_capture_sizes(kn)
    drafter_graphs = kn.cudagraph_mode in ("FULL_AND_PIECEWISE", "PIECEWISE", "FULL") and not kn.enforce_eager
    rows = []
    for b in range(1, kn.max_num_seqs + 1):
        q = b * kn.query_len
        g = padded_size(sizes, max_size, q) if drafter_graphs else None
        mode = "eager" if g is None else ("graph" if g == q else "padded")
        rows.append(DrafterRow(batch=b, query_tokens=q, mode=mode, graph_size=g,
                               pad=(g - q) if g else 0, max_query_tokens=kn.max_query_tokens,
                               over_buffer=max(0, (g or 0) - kn.max_query_tokens)))
    return rows


def buffer_table(kn: Knobs) -> list[dict]:
    """Each DFlash buffer's allocated length against the largest slice a drafter step takes."""
    rows = drafter_table(kn)
    worst_padded = max((r.graph_size or r.query_tokens) for r in rows)
    worst_ctx = kn.max_num_batched_tokens
    mq, mt = kn.max_query_tokens, kn.max_num_batched_tokens
    spec = [
        # name, allocated, largest slice used per step, what slices it
        ("positions (query)", mq, worst_padded, "self.positions[:num_input_tokens] (padded graph size)"),
        ("_slot_mapping_buffer (query)", mq, worst_padded, "_get_slot_mapping(num_input_tokens)"),
        ("input_ids", mt, worst_padded, "self.input_ids[:num_input_tokens]"),
        ("_context_positions_buffer", mt, worst_ctx, "[:num_context], num_context <= max_num_batched_tokens"),
        ("_context_slot_mapping_buffer", mt, worst_ctx, "[:num_context]"),
        ("token_indices_to_sample", None, None, "allocated per step: batch * k"),
    ]
    out = []
    for name, alloc, used, how in spec:
        out.append({"buffer": name, "allocated": alloc, "largest_slice": used, "sliced_by": how,
                    "short_by": (max(0, used - alloc) if alloc is not None else 0)})
    return out


def summary(kn: Knobs) -> dict:
    sizes, max_size = engine_capture_sizes(kn)
    rows = drafter_table(kn)
    return {
        "knobs": asdict(kn),
        "capture_sizes": sizes,
        "max_capture_size": max_size,
        "max_query_tokens": kn.max_query_tokens,
        "batches_graph": [r.batch for r in rows if r.mode == "graph"],
        "batches_padded": [r.batch for r in rows if r.mode == "padded"],
        "batches_eager": [r.batch for r in rows if r.mode == "eager"],
        "batches_over_buffer": [r.batch for r in rows if r.over_buffer > 0],
    }


def grid(seqs: list[int], ks: list[int], **kw) -> list[dict]:
    """Padding and buffer overrun counts over a (max_num_seqs x k) grid."""
    out = []
    for s in seqs:
        for k in ks:
            kn = Knobs(max_num_seqs=s, num_speculative_tokens=k, **kw)
            rows = drafter_table(kn)
            out.append({
                "max_num_seqs": s, "k": k,
                "padded": sum(r.mode == "padded" for r in rows),
                "over_buffer": sum(r.over_buffer > 0 for r in rows),
                "eager": sum(r.mode == "eager" for r in rows),
                "max_over": max(r.over_buffer for r in rows),
            })
    return out
