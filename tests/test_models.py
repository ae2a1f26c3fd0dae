"""dflash_lab.models: the published draft's shape (found in s69) beside the one every GPU run so far assumed."""

import json

from dflash_lab import bench, kvgroups, models


def test_the_draft8_target_carries_the_published_shape_and_differs_from_the_runs_only_in_layers():
    pub = models.PUBLISHED_DRAFT
    d8, d5 = models.TARGETS["qwen36-35b-a3b-draft8"]["draft"], models.TARGETS["qwen36-35b-a3b"]["draft"]
    assert d8 == pub["shape"] and d8["layers"] == 8 == len(pub["layer_types"])
    assert {k for k in d5 if d5[k] != d8[k]} == {"layers"} and d5["layers"] == 5
    # the rest of the published config is what the dummy draft gets from the target (hidden size, vocabulary)
    assert pub["hidden_size"] == models.QWEN36_TEXT["hidden_size"] and pub["vocab_size"] == models.QWEN36_TEXT["vocab_size"]
    assert models.TARGETS["qwen36-35b-a3b-draft8"]["text"] is models.QWEN36_TEXT
    assert all(s["where"] and s["what"] for s in pub["sources"]) and len(pub["revision"]) == 40


def test_the_quoted_checkpoint_size_is_what_eight_layers_weigh():
    """A source quotes 905 MB for the checkpoint: 8 layers of this shape in bf16, without the LM head the draft shares
    with the target, weigh 904 MiB; 5 layers would weigh 580 MiB (bench.draft_params counts the LM head it reads)."""
    head = models.QWEN36_TEXT["vocab_size"] * models.QWEN36_TEXT["hidden_size"]
    mib = {n: (bench.draft_params(models.QWEN36_TEXT, dict(models.PUBLISHED_DRAFT["shape"], layers=n)) - head) * 2 / 2**20
           for n in (5, 8)}
    assert round(mib[8]) == 904 and round(mib[5]) == 580
    assert "904 MiB" in json.dumps(models.PUBLISHED_DRAFT) and "580 MiB" in json.dumps(models.PUBLISHED_DRAFT)


def test_the_published_draft_splits_the_targets_attention_as_the_runs_draft_does():
    """vLLM 0.22.1's own grouping (run on the CPU): with 8 draft layers the target's attention layers 7, 15, 23, 31, 39
    still form a group that reuses another group's metadata, at TP 1, 2 and 4 (the report's); with 10 they would not."""
    for tp in (1, 2, 4):
        r8 = kvgroups.metadata_reusers(kvgroups.groups(kvgroups.rank_layers(tp, draft_layers=8)))
        r5 = kvgroups.metadata_reusers(kvgroups.groups(kvgroups.rank_layers(tp, draft_layers=5)))
        lay = lambda r: [[kvgroups.layer_index(x) for x in g["layers"]] for g in r]   # noqa: E731
        assert lay(r8) == lay(r5) == [[7, 15, 23, 31, 39]], tp
        assert [g["gid"] for g in r8] == [5] and [g["gid"] for g in r5] == [7]
    assert kvgroups.metadata_reusers(kvgroups.groups(kvgroups.hybrid_layers(draft_layers=10))) == []


def test_build_writes_the_eight_layer_draft(tmp_path):
    paths = models.build("qwen36-35b-a3b-draft8", tmp_path)
    cfg = json.loads((tmp_path / "qwen36-35b-a3b-draft8" / "draft" / "config.json").read_text())
    assert paths["draft"] and cfg["num_hidden_layers"] == 8 and cfg["layer_types"] == ["full_attention"] * 8
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (4, 128, 6144)
    assert cfg["dflash_config"] == {"mask_token_id": 248070, "target_layer_ids": [1, 10, 19, 28, 37]}
