"""The root mechanism, replayed on vLLM 0.22.1's own Python code (CPU, no FA3, no graphs).

Two pieces of ``vllm/v1/attention/backends/flash_attn.py`` run verbatim
(:mod:`dflash_lab.vllm_code`): ``FlashAttentionMetadataBuilder.update_block_table`` and the block
of ``build()`` that stores FA3's ahead-of-time schedule in the builder's persistent buffer. What a
CPU cannot run (FA3's scheduler, graph capture) is modelled by the one fact the bug needs: a FULL
graph captured for a KV-cache group reads *its own builder's* ``scheduler_metadata`` buffer at
replay. :func:`premises` checks, on the pinned sources, that the runner captures every group with
its own builder and, at run time, hands later groups of the same spec the first group's metadata.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from .vllm_code import function_source, load_function, statement_source, wrap_statement
from .vllm_sources import line_of, read_source

FA = "vllm/v1/attention/backends/flash_attn.py"
RUNNER = "vllm/v1/worker/gpu_model_runner.py"
CAPTURE_SCHEDULE = [9, 9, 9, 1]  # what graph capture leaves in a builder's buffer (a stand-in)
STEP_SCHEDULE = [4, 2, 4, 2, 1, 1, 3, 0, 5]  # what FA3 schedules for this step (a stand-in)


@dataclass
class Meta:
    """The fields of FlashAttentionMetadata that update_block_table and the schedule touch."""

    scheduler_metadata: object
    block_table: object
    slot_mapping: object


_CODE: dict = {}


def vllm_pieces():
    """(update_block_table, persist) from the pinned sources, with their line numbers."""
    if not _CODE:
        _CODE["update"] = load_function(FA, "update_block_table", cls="FlashAttentionMetadataBuilder",
                                        namespace={"copy": copy})
        _CODE["persist"] = wrap_statement(FA, "build", "FlashAttentionMetadataBuilder",
                                          "if self.use_full_cuda_graph and scheduler_metadata is not None",
                                          params="self, scheduler_metadata", result="scheduler_metadata")
    return _CODE["update"], _CODE["persist"]


def premises() -> dict:
    """What the simulation assumes, each read from vLLM 0.22.1's sources (with file:line)."""
    runner, _ = function_source(RUNNER, "_build_attention_metadata", cls="GPUModelRunner")
    capture = runner.index("builder.build_for_cudagraph_capture(")
    reuse = runner.index("builder.update_block_table(")
    init, _ = statement_source(FA, "__init__", "FlashAttentionMetadataBuilder",
                               "if self.use_full_cuda_graph and self.aot_schedule")
    src = read_source(FA)
    cls = src[src.index("class FlashAttentionMetadataBuilder"):]
    return {
        "capture builds every group with its own builder":
            "if for_cudagraph_capture:" in runner[capture - 120:capture],
        "run time reuses the first group's metadata for later groups of the same spec":
            "cache_key in cached_attn_metadata" in runner[capture:reuse]
            and "cached_attn_metadata[cache_key] = attn_metadata_i" in runner[reuse:],
        "each FlashAttention builder owns a persistent scheduler_metadata buffer":
            "self.scheduler_metadata = torch.zeros(" in init,
        "FlashAttention builders support update_block_table":
            "supports_update_block_table: bool = True" in cls[: cls.index("def __init__")],
        "where": {
            "capture": f"{RUNNER}:{line_of(RUNNER, 'builder.build_for_cudagraph_capture(')}",
            "reuse": f"{RUNNER}:{line_of(RUNNER, 'attn_metadata_i = builder.update_block_table(')}",
            "buffer": f"{FA}:{line_of(FA, 'self.scheduler_metadata = torch.zeros(')}",
            "update_block_table": f"{FA}:{line_of(FA, 'def update_block_table(')}",
        },
    }


class Builder:
    """A FlashAttention metadata builder with FULL graphs and FA3 AOT scheduling, on vLLM's code."""

    use_full_cuda_graph = True

    def __init__(self, refresh=None, max_num_seqs: int = 64, update=None):
        import torch

        self.scheduler_metadata = torch.zeros(1 + max_num_seqs * 4, dtype=torch.int32)
        self.refresh = refresh  # the fix (patch.refresh_graph_scheduler_metadata) or None (stock)
        self.update = update    # another update_block_table (the upstream patch's), or None (0.22.1's)

    def build(self, schedule, gid: int) -> Meta:
        import torch

        _update, persist = vllm_pieces()
        return Meta(persist(self, schedule.clone()), torch.full((2, 4), gid), torch.arange(32) + 100 * gid)

    def update_block_table(self, metadata, blk_table, slot_mapping):
        update, _persist = vllm_pieces()
        new = (self.update or update)(self, metadata, blk_table, slot_mapping)
        return self.refresh(self, new) if self.refresh else new


def patched_update_block_table(fa_text: str):
    """``update_block_table`` compiled from another text of flash_attn.py (e.g. the upstream patch applied)."""
    return load_function(FA, "update_block_table", cls="FlashAttentionMetadataBuilder",
                         namespace={"copy": copy}, text=fa_text)


def simulate(refresh=None, steps: int = 1, update=None) -> dict:
    """Capture both attention groups' graphs, run ``steps`` steps; what each group's graph and eager path read.

    ``refresh`` is the plugin's fix (applied after vLLM's ``update_block_table``); ``update`` replaces
    ``update_block_table`` itself (:func:`patched_update_block_table` of the upstream diff's file).

    Group 6 builds at run time; group 7 reuses its metadata (as in the H200 runs: layers 3, 11, ...
    and 7, 15, ...). Returns, per group, the schedule its FULL graph reads and the one the metadata
    (eager / PIECEWISE execution) carries, next to the step's true schedule.
    """
    import torch

    b6, b7 = Builder(refresh, update=update), Builder(refresh, update=update)
    for gid, b in ((6, b6), (7, b7)):  # graph capture: every group built by its own builder
        b.build(torch.tensor(CAPTURE_SCHEDULE, dtype=torch.int32), gid)
    captured = {6: b6.scheduler_metadata, 7: b7.scheduler_metadata}  # the addresses the graphs hold
    step = torch.tensor(STEP_SCHEDULE, dtype=torch.int32)
    for _ in range(steps):
        m6 = b6.build(step, 6)
        m7 = b7.update_block_table(m6, torch.full((2, 4), 7), torch.arange(32) + 700)
    n = step.shape[0]
    return {
        "step": step.tolist(),
        "graph_reads": {g: t[:n].tolist() for g, t in captured.items()},
        "metadata_carries": {6: m6.scheduler_metadata.tolist(), 7: m7.scheduler_metadata.tolist()},
        "metadata_is_graph_buffer": {6: m6.scheduler_metadata.data_ptr() == captured[6].data_ptr(),
                                     7: m7.scheduler_metadata.data_ptr() == captured[7].data_ptr()},
        "block_table_7": int(m7.block_table[0, 0]), "slot_mapping_7": int(m7.slot_mapping[0]),
    }
