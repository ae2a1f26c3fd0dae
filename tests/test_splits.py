"""splits: FA3's split bound for FULL graphs on one side of the speculative pair (DFLASH_LAB_FA_SPLITS).

The wrapper is exercised on a stand-in builder; that the stand-in has vLLM 0.22.1's shape (constructor arguments,
where the bound is set and read) is checked on the pinned source itself."""

import ast

import pytest

from dflash_lab import discriminate, splits
from dflash_lab.errors import LabError
from dflash_lab.vllm_sources import read_source

FA = "vllm/v1/attention/backends/flash_attn.py"


def _builder_class():
    tree = ast.parse(read_source(FA))
    return next(c for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "FlashAttentionMetadataBuilder")


def test_vllm_sets_the_bound_for_full_graphs_in_init_and_reads_it_in_build():
    cls = _builder_class()
    init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    assert [a.arg for a in init.args.args] == ["self", "kv_cache_spec", "layer_names", "vllm_config", "device"]
    # self.max_num_splits = <attention_config's bound> inside `if self.use_full_cuda_graph and self.aot_schedule:`
    guarded = [n for n in ast.walk(init) if isinstance(n, ast.If) and "use_full_cuda_graph" in ast.unparse(n.test)
               and "aot_schedule" in ast.unparse(n.test)]
    assert any("self.max_num_splits = self.attention_config.flash_attn_max_num_splits_for_cuda_graph"
               in ast.unparse(n) for n in guarded)
    build = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "build")
    assert "max_num_splits = self.max_num_splits" in ast.unparse(build)


class FakeConfig:
    class model_config:
        class hf_text_config:
            num_hidden_layers = 40


class FakeBuilder:
    """vLLM 0.22.1's constructor arguments and the three attributes the wrapper reads or sets."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, full=True, aot=True):
        self.use_full_cuda_graph, self.aot_schedule = full, aot
        self.max_num_splits = 32 if (full and aot) else 0


TARGET = [f"language_model.model.layers.{i}.self_attn.attn" for i in (7, 15, 23, 31, 39)]
DRAFT = [f"model.layers.{i}.self_attn.attn" for i in range(40, 45)]


def test_parse_and_side():
    assert splits.parse("drafter:1") == ("drafter", 1) and splits.parse("target: 2") == ("target", 2)
    for bad in ("drafter", "draft:1", "drafter:x", "target:0", ""):
        with pytest.raises(LabError, match="DFLASH_LAB_FA_SPLITS"):
            splits.parse(bad)
    assert splits.side_of(DRAFT, 40) == "drafter" and splits.side_of(TARGET, 40) == "target"
    assert splits.side_of(TARGET + DRAFT, 40) == "mixed"
    assert splits.side_of(["mtp.layers.40.self_attn.attn"], 40) == "drafter"


def test_only_the_chosen_sides_full_graph_builders_change():
    logged = []

    class B(FakeBuilder):
        pass

    what = splits.install("drafter:1", builder_cls=B, log=logged.append)
    assert what == "FA3 splits for FULL graphs: drafter builders bounded to 1"
    d, t = B(None, DRAFT, FakeConfig, "cuda"), B(None, TARGET, FakeConfig, "cuda")
    assert d.max_num_splits == 1 and t.max_num_splits == 32
    eager = B(None, DRAFT, FakeConfig, "cuda", full=False)
    assert eager.max_num_splits == 0   # no FULL-graph schedule: vLLM's own 0 (FA3's heuristics) stays
    mixed = B(None, TARGET + DRAFT, FakeConfig, "cuda")
    assert mixed.max_num_splits == 32
    assert logged == ["FA3 splits: drafter builder of model.layers.40.self_attn.attn .. (5 layers): max_num_splits "
                      "32 -> 1",
                      "FA3 splits: drafter builder of model.layers.40.self_attn.attn .. (5 layers): vLLM sets no bound "
                      "here (no FULL graphs or no FA3), unchanged",
                      "FA3 splits: builder of language_model.model.layers.7.self_attn.attn .. (10 layers) holds target "
                      "and drafter layers: left alone"]
    # installing twice does not wrap twice
    assert splits.install("drafter:1", builder_cls=B, log=logged.append).endswith("(already installed)")
    assert B(None, DRAFT, FakeConfig, "cuda").max_num_splits == 1

    class C(FakeBuilder):
        pass

    splits.install("target:1", builder_cls=C, log=logged.append)
    assert C(None, TARGET, FakeConfig, "cuda").max_num_splits == 1 and C(None, DRAFT, FakeConfig, "cuda").max_num_splits == 32


def test_predictions_with_a_one_sided_bound():
    from test_discriminate import line

    # the drafter's bound leaves the target's reusing group as it is: the crash is still predicted
    assert discriminate.predict(line(fa_splits="drafter:1"))[0] == "crash"
    # the target's bound at 1 is the split-1 question for the target alone: open, as for both sides
    assert discriminate.predict(line(fa_splits="target:1"))[0] == "open"
    assert discriminate.predict(line(fa_splits="target:4"))[0] == "crash"
