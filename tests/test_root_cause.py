"""The root mechanism on vLLM 0.22.1's own code (CPU): stale FA3 schedules in FULL CUDA graphs.

Pieces of vLLM run verbatim (dflash_lab.vllm_code): the KV-cache grouping of hybrid models,
``FlashAttentionMetadataBuilder.update_block_table``, and the block of ``build()`` that stores
FA3's ahead-of-time schedule in the builder's persistent buffer. What cannot run on a CPU (FA3
itself, graph capture) is modelled by the one fact the bug needs: a FULL graph captured for a
KV-cache group reads *its builder's* persistent ``scheduler_metadata`` buffer at replay.
"""

import copy
from dataclasses import dataclass

import pytest
import torch

from dflash_lab import kvgroups, patch
from dflash_lab.vllm_code import function_source, load_function, statement_source, wrap_statement
from dflash_lab.vllm_sources import read_source

FA = "vllm/v1/attention/backends/flash_attn.py"
RUNNER = "vllm/v1/worker/gpu_model_runner.py"


@dataclass
class Meta:  # the fields of FlashAttentionMetadata that update_block_table and the schedule touch
    scheduler_metadata: torch.Tensor | None
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


STOCK_UPDATE = load_function(FA, "update_block_table", cls="FlashAttentionMetadataBuilder",
                             namespace={"copy": copy})
PERSIST = wrap_statement(FA, "build", "FlashAttentionMetadataBuilder",
                         "if self.use_full_cuda_graph and scheduler_metadata is not None",
                         params="self, scheduler_metadata", result="scheduler_metadata")


class Builder:
    """A FlashAttention metadata builder with FULL graphs and FA3 AOT scheduling (vLLM's code)."""

    use_full_cuda_graph = True

    def __init__(self, fixed: bool):
        self.scheduler_metadata = torch.zeros(1 + 64 * 4, dtype=torch.int32)  # max_num_seqs 64
        self.fixed = fixed

    def build(self, schedule, gid):  # the schedule FA3's get_scheduler_metadata returned
        return Meta(PERSIST(self, schedule.clone()), torch.full((2, 4), gid), torch.arange(32) + 100 * gid)

    def update_block_table(self, metadata, blk_table, slot_mapping):
        new = STOCK_UPDATE(self, metadata, blk_table, slot_mapping)
        return patch.refresh_graph_scheduler_metadata(self, new) if self.fixed else new


def run_step(fixed: bool):
    """Capture each group's graph, then one run-time step; what each group's graph and eager path read."""
    b0, b1 = Builder(fixed), Builder(fixed)
    # graph capture (for_cudagraph_capture): every group's own builder builds
    for gid, b in ((6, b0), (7, b1)):
        b.build(torch.tensor([9, 9, 9, 1], dtype=torch.int32), gid)
    graph_reads = {6: b0.scheduler_metadata, 7: b1.scheduler_metadata}  # captured addresses
    # run time: group 6 builds, group 7 reuses its metadata (cache hit in _build_attn_group_metadata)
    step = torch.tensor([4, 2, 4, 2, 1, 1, 3, 0, 5], dtype=torch.int32)
    m6 = b0.build(step, 6)
    m7 = b1.update_block_table(m6, torch.full((2, 4), 7), torch.arange(32) + 700)
    n = step.shape[0]
    m7.captured_ptr = graph_reads[7].data_ptr()
    return step, {g: t[:n].clone() for g, t in graph_reads.items()}, {6: m6.scheduler_metadata, 7: m7.scheduler_metadata}, m7


def test_pinned_vllm_has_the_mechanism():
    """The premises, read from vLLM 0.22.1's sources (the test below models exactly these)."""
    text, _ = function_source(RUNNER, "_build_attention_metadata", cls="GPUModelRunner")
    capture = text.index("builder.build_for_cudagraph_capture(")  # capture: every group's own builder
    assert "if for_cudagraph_capture:" in text[capture - 120:capture]
    reuse = text.index("builder.update_block_table(")  # run time: later groups reuse the cached build
    assert "cache_key in cached_attn_metadata" in text[capture:reuse]
    assert "cached_attn_metadata[cache_key] = attn_metadata_i" in text[reuse:]
    cls_text, _ = statement_source(FA, "__init__", "FlashAttentionMetadataBuilder",
                                   "if self.use_full_cuda_graph and self.aot_schedule")
    assert "self.scheduler_metadata = torch.zeros(" in cls_text  # one persistent buffer per builder
    src = read_source(FA)
    cls = src[src.index("class FlashAttentionMetadataBuilder"):]
    assert "supports_update_block_table: bool = True" in cls[:cls.index("def __init__")]


def test_dflash_draft_splits_the_targets_attention_layers_into_two_groups():
    """vLLM's own grouping for the configuration the H200 runs used (6 GDN + 3 attention groups of 5)."""
    gs = kvgroups.groups(kvgroups.hybrid_layers(draft_layers=5))
    assert [(g["spec"][0], len(g["layers"])) for g in gs] == [("mamba", 5)] * 6 + [("full_attention", 5)] * 3
    reusers = kvgroups.metadata_reusers(gs)
    assert [(r["gid"], r["reuses_gid"]) for r in reusers] == [(7, 6)]
    assert [kvgroups.layer_index(x) for x in reusers[0]["layers"]] == [7, 15, 23, 31, 39]
    # without a DFlash draft (or with MTP, whose layer has the target's attention spec): one group
    assert kvgroups.metadata_reusers(kvgroups.groups(kvgroups.hybrid_layers())) == []
    assert kvgroups.metadata_reusers(kvgroups.groups(kvgroups.hybrid_layers(mtp_layers=1))) == []


def test_stock_second_group_graph_replays_the_capture_schedule():
    step, graph, eager, _ = run_step(fixed=False)
    assert torch.equal(graph[6], step) and torch.equal(eager[6], step)
    assert torch.equal(eager[7], step)  # eager / PIECEWISE read the metadata object: right
    assert not torch.equal(graph[7], step)  # the FULL graph of group 7 reads its own, stale buffer
    assert graph[7][:4].tolist() == [9, 9, 9, 1]  # ... what graph capture left there


@pytest.mark.parametrize("steps", [1, 3])
def test_fixed_second_group_graph_reads_this_steps_schedule(steps):
    for _ in range(steps):
        step, graph, eager, m7 = run_step(fixed=True)
    assert torch.equal(graph[7], step) and torch.equal(eager[7], step)
    assert eager[7].data_ptr() == m7.captured_ptr  # the metadata now points at the captured buffer
    assert m7.block_table[0, 0] == 7 and m7.slot_mapping[0] == 700  # update_block_table's own job kept


def test_fix_leaves_builders_without_the_persistent_buffer_alone():
    class Eager:
        use_full_cuda_graph = False

    m = Meta(torch.tensor([1, 2]), torch.zeros(1), torch.zeros(1))
    assert patch.refresh_graph_scheduler_metadata(Eager(), m) is m and m.scheduler_metadata.tolist() == [1, 2]
    b = Builder(fixed=True)
    m = Meta(None, torch.zeros(1), torch.zeros(1))
    assert patch.refresh_graph_scheduler_metadata(b, m).scheduler_metadata is None
