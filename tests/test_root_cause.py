"""The root mechanism on vLLM 0.22.1's own code (CPU): stale FA3 schedules in FULL CUDA graphs.

Fails without the fix (dflash_lab.patch.refresh_graph_scheduler_metadata): the FULL graph of
the second attention group would keep reading what graph capture left in its builder's buffer.
"""

import pytest
import torch

from dflash_lab import kvgroups, patch, rootcause


def test_pinned_vllm_has_the_mechanism():
    p = rootcause.premises()
    where = p.pop("where")
    assert all(p.values()), p
    assert all(":" in v for v in where.values())


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


@pytest.mark.parametrize("tp", [2, 4])
def test_one_rank_of_tensor_parallelism_gets_the_same_groups(tp):
    """s27 crashed at TP=2: each rank's attention specs hold fewer KV heads (vLLM's QKVParallelLinear rule), but the
    grouping counts layers per spec, so the same attention layers reuse another group's metadata (TP=4: the report's)."""
    assert [kvgroups.kv_heads_per_rank(2, tp), kvgroups.kv_heads_per_rank(4, tp)] == {2: [1, 2], 4: [1, 1]}[tp]
    layers = kvgroups.rank_layers(tp, draft_layers=5)
    assert {layers["language_model.model.layers.3.self_attn.attn"], layers["model.layers.40.self_attn.attn"]} == {
        ("full_attention", 1, 256), ("full_attention", {2: 2, 4: 1}[tp], 128)}
    gs = kvgroups.groups(layers)
    assert [(g["spec"][0], len(g["layers"])) for g in gs] == [("mamba", 5)] * 6 + [("full_attention", 5)] * 3
    reusers = kvgroups.metadata_reusers(gs)
    assert [kvgroups.layer_index(x) for r in reusers for x in r["layers"]] == [7, 15, 23, 31, 39]


def test_kv_heads_per_rank_follows_vllm():
    from dflash_lab.errors import LabError
    from dflash_lab.vllm_sources import read_source

    # the rule is vLLM's: replicate one head per rank when the ranks outnumber the heads
    assert "if tp_size >= self.total_num_kv_heads:\n            self.num_kv_heads = 1" in read_source(
        "vllm/model_executor/layers/linear.py")
    assert kvgroups.kv_heads_per_rank(8, 2) == 4 and kvgroups.kv_heads_per_rank(2, 8) == 1
    with pytest.raises(LabError):
        kvgroups.kv_heads_per_rank(6, 4)


def test_stock_second_group_graph_replays_the_capture_schedule():
    r = rootcause.simulate(refresh=None)
    assert r["graph_reads"][6] == r["step"] and r["metadata_carries"][6] == r["step"]
    assert r["metadata_carries"][7] == r["step"]  # eager / PIECEWISE read the metadata object: right
    assert r["graph_reads"][7] != r["step"]  # the FULL graph of group 7 reads its own, stale buffer
    assert r["graph_reads"][7][:4] == rootcause.CAPTURE_SCHEDULE  # ... what graph capture left there


@pytest.mark.parametrize("steps", [1, 3])
def test_fixed_second_group_graph_reads_this_steps_schedule(steps):
    r = rootcause.simulate(refresh=patch.refresh_graph_scheduler_metadata, steps=steps)
    assert r["graph_reads"][7] == r["step"] and r["metadata_carries"][7] == r["step"]
    assert r["metadata_is_graph_buffer"][7]  # graph replay and eager execution read the same buffer
    assert r["block_table_7"] == 7 and r["slot_mapping_7"] == 700  # update_block_table's own job kept


def test_fix_leaves_builders_without_the_persistent_buffer_alone():
    class Eager:
        use_full_cuda_graph = False

    m = rootcause.Meta(torch.tensor([1, 2]), torch.zeros(1), torch.zeros(1))
    assert patch.refresh_graph_scheduler_metadata(Eager(), m) is m and m.scheduler_metadata.tolist() == [1, 2]
    m = rootcause.Meta(None, torch.zeros(1), torch.zeros(1))
    assert patch.refresh_graph_scheduler_metadata(rootcause.Builder(), m).scheduler_metadata is None


@pytest.mark.parametrize("steps", [1, 3])
def test_the_upstream_diffs_update_block_table_fixes_it_too(steps):
    """Hunk 1 of patches/vllm-0.22.1-dflash.diff is separate code from the plugin: its own
    update_block_table, compiled from flash_attn.py with the change applied, must do the same."""
    patched = patch.patched_source(rootcause.FA)
    assert patched != rootcause.read_source(rootcause.FA)
    r = rootcause.simulate(update=rootcause.patched_update_block_table(patched), steps=steps)
    assert r["graph_reads"][7] == r["step"] and r["metadata_carries"][7] == r["step"]
    assert r["block_table_7"] == 7 and r["slot_mapping_7"] == 700
    # (tests/test_patch.py checks that the committed diff is exactly patch.upstream_diff())
