"""Later vLLM releases read on the CPU (dflash_lab/upstream.py): the checks on the pinned 0.22.1's own code, on the
upstream diff's, on a runner that reuses only Mamba metadata; the wheel and index handling; the recorded lines."""

import hashlib
import json
import zipfile

import pytest

from conftest import ROOT, run_cli
from dflash_lab import patch, rootcause, upstream
from dflash_lab.errors import LabError
from dflash_lab.upstream import ABSENT, CONFIG, FA, OPT_IN, PRESENT, RUNNER_V1, RUNNER_V2, UNDECIDED, VERDICTS


@pytest.fixture(scope="module")
def pinned():
    return upstream.pinned_texts()


def test_the_pinned_release_has_the_precondition_on_its_own_code(pinned):
    r = upstream.check(pinned)
    assert r["verdict"] == PRESENT
    assert r["grouping"]["reusing attention groups"] == [{"gid": 7, "reuses": 6, "layers": [7, 15, 23, 31, 39]}]
    assert r["v1 runner"]["capture builds every group with its own builder"]
    assert r["v1 runner"]["run time reuses a same-spec group's metadata"]
    assert r["v1 runner"]["reuse key"] == "(kv_cache_spec, type(builder))"
    assert r["flash_attn builder"]["reusing group's graph reads the capture's schedule"] is True
    # 0.22.1's own rule sends this engine (a MoE target not on V2's list) to V1, the runner the GPU runs went through
    assert r["default runner"] == {"read": True, "rule": "architecture gate", "target listed": False, "default": "V1"}
    assert r["dflash input kernel"] == "vllm/v1/spec_decode/utils.py"
    # the same premises rootcause.premises reads, so the two cannot drift apart on 0.22.1
    prem = rootcause.premises()
    assert prem["run time reuses the first group's metadata for later groups of the same spec"]
    assert prem["each FlashAttention builder owns a persistent scheduler_metadata buffer"]


def test_the_upstream_diffs_flash_attn_removes_it(pinned):
    """The diff's update_block_table refreshes the schedule: the stale read is gone, so the verdict is not PRESENT."""
    r = upstream.check({**pinned, FA: patch.patched_source(FA)})
    assert r["flash_attn builder"]["reusing group's graph reads the capture's schedule"] is False
    assert r["verdict"] == ABSENT


# a V2-style runner loop, written for these tests: metadata reuse decided per group before the capture branch
V2_MAMBA_ONLY = """
def build(groups, for_cudagraph_capture):
    cached_metadata = {}
    for g in groups:
        reuse_key = None
        if g.builder.supports_update_block_table and isinstance(g.spec, MambaSpec):
            reuse_key = (g.spec, type(g.builder))
        if reuse_key in cached_metadata:
            m = g.builder.update_block_table(cached_metadata[reuse_key], g.bt, g.sm)
        elif for_cudagraph_capture:
            m = g.capture()
        else:
            m = g.build()
"""


def test_a_runner_that_reuses_only_mamba_metadata_has_no_precondition(pinned):
    r = upstream.check({**pinned, RUNNER_V1: None, RUNNER_V2: V2_MAMBA_ONLY})
    assert r["v1 runner"] == {"present": False}
    assert r["v2 runner"] == {"present": True, "reuses metadata": True, "reuse limited to Mamba": True,
                              "capture takes the reuse path too": True}
    assert r["verdict"] == ABSENT
    # the same loop reusing any builder's metadata: not decided from the source
    anyb = V2_MAMBA_ONLY.replace(" and isinstance(g.spec, MambaSpec)", "")
    assert upstream.check({**pinned, RUNNER_V1: None, RUNNER_V2: anyb})["verdict"] == UNDECIDED


def test_a_v1_runner_whose_capture_takes_the_reuse_path_has_no_precondition(pinned):
    """The reuse test moved before the capture branch (V2's order): capture and run time agree, so no stale read."""
    import re as re_

    text = pinned[RUNNER_V1]
    at = text.index("attn_metadata_i = builder.build_for_cudagraph_capture(")
    cap = re_.compile(r"( +)if for_cudagraph_capture:\n(.*?)\n\1elif \(\n(.*?)\n\1\):\n(.*?)\n\1else:", re_.S).search(
        text, text.rindex("\n", 0, text.rindex("if for_cudagraph_capture:", 0, at)) + 1)
    assert cap and cap.start() < at < cap.end(), "0.22.1's capture/reuse/build chain"
    ind = cap.group(1)
    swapped = (f"{ind}if (\n{cap.group(3)}\n{ind}):\n{cap.group(4)}\n{ind}elif for_cudagraph_capture:\n"
               f"{cap.group(2)}\n{ind}else:")
    r = upstream.check({**pinned, RUNNER_V1: text[:cap.start()] + swapped + text[cap.end():]})
    assert r["v1 runner"]["capture builds every group with its own builder"] is False and r["verdict"] == ABSENT
    # no capture branch at all beside the reuse: not read, so not decided
    nocap = text[:cap.start()] + f"{ind}if (\n{cap.group(3)}\n{ind}):\n{cap.group(4)}\n{ind}else:" + text[cap.end():]
    r = upstream.check({**pinned, RUNNER_V1: nocap})
    assert r["v1 runner"]["checked"] is False and r["verdict"] == UNDECIDED


# a config rule written for these tests, in the shape of the later releases' (no architecture gate)
CONFIG_V2 = """
class VllmConfig:
    def use_v2_model_runner(self):
        if envs.VLLM_USE_V2_MODEL_RUNNER is not None:
            return envs.VLLM_USE_V2_MODEL_RUNNER
        return not self._get_v2_model_runner_unsupported_features()

    def _get_v2_model_runner_unsupported_features(self):
        unsupported = []
        if self.speculative_config.method not in ("eagle", "mtp", "dflash"):
            unsupported.append("that method")
        return unsupported
"""


def test_where_v2_is_the_default_the_v1_precondition_needs_the_environment_variable(pinned):
    r = upstream.check({**pinned, CONFIG: CONFIG_V2})
    assert r["default runner"]["default"] == "V2" and r["verdict"] == OPT_IN
    # DFlash not among V2's methods, or hybrid models excluded (0.22.1's own list): V1, the precondition by default
    no_dflash = CONFIG_V2.replace(', "dflash"', "")
    assert upstream.check({**pinned, CONFIG: no_dflash})["verdict"] == PRESENT
    hybrid = CONFIG_V2.replace("unsupported = []", "unsupported = []\n        if self.model_config.has_inner_state:\n"
                                                    "            unsupported.append('hybrid')")
    assert upstream.check({**pinned, CONFIG: hybrid})["default runner"]["default"] == "V1"
    # a rule not read: not decided
    assert upstream.check({**pinned, CONFIG: None})["verdict"] == UNDECIDED


def test_a_release_whose_grouping_cannot_run_is_not_decided(pinned):
    kv = {f: None for f in (upstream.KV_UTILS, upstream.KV_PLANNING)}
    r = upstream.check({**pinned, **kv})
    assert r["grouping"]["checked"] is False and r["verdict"] == UNDECIDED


def test_the_grouping_also_runs_with_the_published_drafts_shape_on_0_22_1s_own_code():
    """0.22.1's own grouping function (its kv_cache_utils.py, RECORD-checked): with the published draft's 8 layers of
    4 KV heads of 128 (models.PUBLISHED_DRAFT) the target's attention layers 7, 15, 23, 31, 39 still form a group that
    reuses another's metadata, in 7 groups where the 5-layer draft gives 9: the key holds an 8-layer run, not the
    5-layer one again; the 5-layer fields stay where the verdict and the findings read them."""
    from dflash_lab import kvgroups, models
    from dflash_lab.vllm_sources import read_source

    shape = models.PUBLISHED_DRAFT["shape"]
    assert upstream.PUBLISHED_SHAPE == {"layers": 8, "kv_heads": 4, "head_dim": 128}
    assert upstream.PUBLISHED_SHAPE == {k: shape[k] for k in ("layers", "kv_heads", "head_dim")}
    assert upstream.PUBLISHED_GROUPING == "published draft (8 layers)"
    g = upstream._grouping({upstream.KV_UTILS: read_source(upstream.KV_UTILS), upstream.KV_PLANNING: None})
    assert (g["checked"], g["file"], g["groups"]) == (True, upstream.KV_UTILS, 9)
    assert g["reusing attention groups"] == [{"gid": 7, "reuses": 6, "layers": [7, 15, 23, 31, 39]}]
    pub = g[upstream.PUBLISHED_GROUPING]
    assert pub == {"checked": True, "draft": {"layers": 8, "kv_heads": 4, "head_dim": 128}, "groups": 7,
                   "reusing attention groups": [{"gid": 5, "reuses": 4, "layers": [7, 15, 23, 31, 39]}]}
    # the same layers kvgroups gives for the published draft (tests/test_models' finding), by the same function
    assert [x["layers"] for x in pub["reusing attention groups"]] == kvgroups.reusing_layers(
        kvgroups.hybrid_layers(draft_layers=8, draft_attn=(4, 128)))
    # check() carries it inside its grouping, beside the 5-layer result it decides by
    assert upstream.check(upstream.pinned_texts())["grouping"] == g


def test_a_failure_with_the_published_drafts_shape_only_is_recorded_under_its_key():
    """A grouping function that runs on 45 layers (target and 5-layer draft) but raises on 48: the 5-layer result as
    before (one group a layer: 9 target and 4 draft groups reuse), the published draft's key not checked, with why."""
    from dflash_lab import kvgroups

    fn = (f"def {kvgroups.GROUPING_FN}(kv_cache_spec):\n"
          "    if len(kv_cache_spec) > 45:\n        raise ValueError('more layers than 45')\n"
          "    return [[n] for n in kv_cache_spec]\n")
    g = upstream._grouping({upstream.KV_UTILS: fn})
    assert g["checked"] is True and g["groups"] == 45 and len(g["reusing attention groups"]) == 9 + 4
    assert g[upstream.PUBLISHED_GROUPING]["checked"] is False
    assert "ValueError: more layers than 45" in g[upstream.PUBLISHED_GROUPING]["why"]


def test_every_recorded_release_carries_the_grouping_with_the_published_draft():
    """data/upstream/releases.jsonl: each release's grouping holds the published draft's result (regenerated with it),
    an 8-layer run (its own group count and draft shape), beside the unchanged 5-layer fields."""
    rows = upstream.load(ROOT / "data" / "upstream" / "releases.jsonl")
    assert len(rows) == 14
    for r in rows:
        g = r["grouping"]
        assert g["checked"] and upstream.PUBLISHED_GROUPING in g, r["version"]
        pub = g[upstream.PUBLISHED_GROUPING]
        assert pub["checked"] and pub["draft"] == upstream.PUBLISHED_SHAPE, r["version"]
        assert isinstance(pub["groups"], int) and isinstance(pub["reusing attention groups"], list), r["version"]
        assert set(g) == {"checked", "file", "groups", "reusing attention groups", upstream.PUBLISHED_GROUPING}


def _index(*files):
    return {"files": [{"filename": n, "url": u, "hashes": {"sha256": h}, "yanked": y} for n, u, h, y in files]}


def test_the_wheel_entry_is_the_highest_build_tag_and_an_unknown_release_is_refused():
    idx = _index(("vllm-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl", "u0", "a", False),
                 ("vllm-0.23.0-2-cp38-abi3-manylinux_2_28_x86_64.whl", "u2", "b", False),
                 ("vllm-0.23.0-cp38-abi3-manylinux_2_28_aarch64.whl", "ua", "c", False),
                 ("vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl", "u4", "d", True),
                 ("vllm-0.22.1-cp38-abi3-manylinux_2_28_x86_64.whl", "u1", "e", False),
                 ("vllm-0.10.0-cp38-abi3-manylinux_2_28_x86_64.whl", "u9", "f", False))
    assert upstream.wheel_entry("0.23.0", idx)["url"] == "u2"
    with pytest.raises(LabError, match="vLLM 0.24.0: no x86-64 wheel"):   # yanked
        upstream.wheel_entry("0.24.0", idx)
    with pytest.raises(LabError, match="no x86-64 wheel"):
        upstream.wheel_entry("9.9.9", idx)
    assert upstream.releases_after(idx) == ["0.23.0"]


def _wheel(path, files):
    """A wheel of ``files`` ({name: text}) with a RECORD of their sha256; returns its sha256."""
    import base64

    rec = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
                  f"{len(t)}\n" for n, t in files.items())
    with zipfile.ZipFile(path, "w") as z:
        for n, t in files.items():
            z.writestr(n, t)
        z.writestr("vllm-0.99.0.dist-info/RECORD", rec)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_wheel_is_checked_against_the_index_and_its_record(tmp_path, pinned):
    w = tmp_path / "vllm-0.99.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    sha = _wheel(w, {FA: pinned[FA], RUNNER_V2: V2_MAMBA_ONLY})
    texts = upstream.read_wheel(w, sha, "0.99.0")
    assert texts[FA] == pinned[FA] and texts[RUNNER_V1] is None
    with pytest.raises(LabError, match="is not the index's"):
        upstream.read_wheel(w, "0" * 64, "0.99.0")
    # a file that differs from the wheel's own RECORD
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(w) as src, zipfile.ZipFile(bad, "w") as dst:
        for n in src.namelist():
            dst.writestr(n, src.read(n) + (b"# edited\n" if n == FA else b""))
    with pytest.raises(LabError, match="differs from the wheel's RECORD"):
        upstream.read_wheel(bad, hashlib.sha256(bad.read_bytes()).hexdigest(), "0.99.0")
    cut = tmp_path / "cut.whl"
    cut.write_bytes(w.read_bytes()[:1000])
    with pytest.raises(LabError, match="not a zip archive"):
        upstream.read_wheel(cut, hashlib.sha256(cut.read_bytes()).hexdigest(), "0.99.0")


def test_the_command_records_every_release_or_leaves_the_record_as_it_was(tmp_path, pinned):
    good = tmp_path / "vllm-0.99.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    sha = _wheel(good, {**{k: v for k, v in pinned.items() if v is not None and k != RUNNER_V1},
                        RUNNER_V2: V2_MAMBA_ONLY})
    index = tmp_path / "index.json"
    index.write_text(json.dumps(_index((good.name, good.as_uri(), sha, False),
                                       ("vllm-0.99.1-cp38-abi3-manylinux_2_28_x86_64.whl", good.as_uri(), "0" * 64,
                                        False))))
    out = tmp_path / "releases.jsonl"
    env = {"DFLASH_LAB_PYPI_INDEX": index.as_uri()}
    r = run_cli("dflash_lab", "upstream-check", "0.99.0", "--out", str(out), env=env)
    assert r.returncode == 0, r.stderr
    assert "vLLM 0.99.0: precondition absent" in r.stdout
    (line,) = upstream.load(out)
    assert line["wheel_sha256"] == sha and line["files"][RUNNER_V1] is False
    assert line["command"] == f"python -m dflash_lab upstream-check 0.99.0 --out {out}"
    before = out.read_bytes()
    # a later release whose wheel does not match the index: one error line, exit 2, the record untouched
    r = run_cli("dflash_lab", "upstream-check", "0.99.0", "0.99.1", "--out", str(out), env=env)
    err = [x for x in r.stderr.splitlines() if x.startswith("dflash-lab: error:")]
    assert r.returncode == 2 and len(err) == 1 and "is not the index's" in err[0]
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([good.name, index.name, out.name])  # no temp file
    r = run_cli("dflash_lab", "upstream-check", "0.98.0", "--out", str(out), env=env)
    assert r.returncode == 2 and "vLLM 0.98.0: no x86-64 wheel" in r.stderr and out.read_bytes() == before


def test_the_recorded_releases_load_and_a_bad_line_is_named(tmp_path):
    rows = upstream.load(ROOT / "data" / "upstream" / "releases.jsonl")
    t = upstream.table(rows)
    assert list(t["vLLM"])[0] == "0.23.0" and set(t["verdict"]) <= set(VERDICTS)
    with pytest.raises(LabError, match="no such file"):
        upstream.load(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(LabError, match="bad.jsonl:2: not a JSON line"):
        upstream.load(bad)
    bad.write_text(json.dumps({**rows[0], "verdict": "fine"}) + "\n")
    with pytest.raises(LabError, match="bad.jsonl:1: not an upstream-check line"):
        upstream.load(bad)


def test_the_table_shows_the_published_drafts_split_and_what_each_release_does_with_a_mixed_draft():
    rows = {r["version"]: r for r in upstream.load(ROOT / "data" / "upstream" / "releases.jsonl")}
    t = upstream.table(list(rows.values())).set_index("vLLM")
    split, win = "with the published draft's 8 layers", "a draft mixing sliding and full layers"
    assert set(t[split]) == {"5 reuses 4 (layers 7, 15, 23, 31, 39)"}
    assert t.loc["0.23.0", win] == "ignored: all full attention" and t.loc["0.25.1", win] == "refused"
    assert t.loc["0.26.0", win].startswith("refused under V1 only, built under V2; the config gives it V2")
    assert t.loc["0.29.0", win].endswith("V1 refuses it at config validation")
    assert t.loc["0.34.0", win] == "built with its windows"
    # a record without the fields (or not checked) reads as such, never as a verdict
    r = dict(rows["0.26.0"], grouping={k: v for k, v in rows["0.26.0"]["grouping"].items()
                                       if k != upstream.PUBLISHED_GROUPING})
    r[upstream.DRAFT_WINDOWS] = {"checked": False, "why": "x"}
    t = upstream.table([r])
    assert t[split].iloc[0] == "not checked" and t[win].iloc[0] == "not read"
    r[upstream.DRAFT_WINDOWS] = {"checked": True, "mixed sliding and full layers": "something new", "config rule": {}}
    assert upstream.table([r])[win].iloc[0] == "unrecognised verdict"


def test_a_file_without_a_record_line_or_undecodable_is_an_error_not_an_absence(tmp_path, pinned):
    import base64

    w = tmp_path / "w.whl"
    sha = _wheel(w, {FA: pinned[FA]})
    # the runner file in the zip, but no RECORD line for it: refused, never read as "no V1 runner"
    bad = tmp_path / "norecord.whl"
    with zipfile.ZipFile(w) as src, zipfile.ZipFile(bad, "w") as dst:
        for n in src.namelist():
            dst.writestr(n, src.read(n))
        dst.writestr(RUNNER_V1, pinned[RUNNER_V1])
    with pytest.raises(LabError, match="is in the wheel but not in its RECORD"):
        upstream.read_wheel(bad, hashlib.sha256(bad.read_bytes()).hexdigest(), "0.99.0")
    raw = b"\xff\xfe not utf-8"
    digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(raw).digest()).rstrip(b"=").decode()
    nb = tmp_path / "bytes.whl"
    with zipfile.ZipFile(nb, "w") as z:
        z.writestr(FA, raw)
        z.writestr("vllm-0.99.0.dist-info/RECORD", f"{FA},{digest},{len(raw)}\n")
    with pytest.raises(LabError, match="cannot be read"):
        upstream.read_wheel(nb, hashlib.sha256(nb.read_bytes()).hexdigest(), "0.99.0")
    assert upstream.read_wheel(w, sha, "0.99.0")[upstream.DFLASH_KERNEL] is None


def test_checking_one_release_again_keeps_the_others(tmp_path, pinned):
    w = tmp_path / "vllm-0.99.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    sha = _wheel(w, {k: v for k, v in pinned.items() if v is not None and k.startswith("vllm/") and k != RUNNER_V1})
    w2 = tmp_path / "vllm-0.99.1-cp38-abi3-manylinux_2_28_x86_64.whl"
    w2.write_bytes(w.read_bytes())
    idx = _index((w.name, w.as_uri(), sha, False), (w2.name, w2.as_uri(), sha, False))
    out = tmp_path / "r.jsonl"
    upstream.check_releases(["0.99.1", "0.99.0"], out, "c1", index=idx)
    upstream.check_releases(["0.99.0"], out, "c2", index=idx)
    rows = upstream.load(out)
    assert [(r["version"], r["command"]) for r in rows] == [("0.99.0", "c2"), ("0.99.1", "c1")]


def test_link_4_is_read_from_each_releases_recovered_token_kernel():
    """0.22.1's kernel lets a NaN row's recovered id reach the vocabulary size (the id its probes recorded); a kernel
    that masks the lanes past the vocabulary, or clamps the id, does not (vLLM PR #44744 does both)."""
    from dflash_lab import upstream
    from dflash_lab.vllm_sources import read_source

    pinned = upstream.check(upstream.pinned_texts())["recovered token"]
    assert pinned == {"present": True, "out-of-vocabulary lanes masked": False, "recovered id clamped": False,
                      "recovered id kept inside the vocabulary": False}
    text = read_source(upstream.SAMPLER)
    tile = "        score = prob * inv_q\n"
    store = "    tl.store(output_token_ids_ptr + token_idx, recovered_id)\n"
    assert text.count(tile) == 1 and text.count(store) == 1     # the lines the two edits below anchor on
    masked = text.replace(tile, tile + "        score = tl.where(vocab_mask, score, float(\"-inf\"))\n")
    clamped = text.replace(store, "    recovered_id = tl.minimum(recovered_id, vocab_size - 1)\n" + store)
    assert upstream._recovered(masked) == {**pinned, "out-of-vocabulary lanes masked": True,
                                           "recovered id kept inside the vocabulary": True}
    assert upstream._recovered(clamped) == {**pinned, "recovered id clamped": True,
                                            "recovered id kept inside the vocabulary": True}
    # the same words outside the kernel do not count
    assert upstream._recovered(text + "\ndef other():\n    recovered_id = tl.minimum(recovered_id, vocab_size - 1)\n") == pinned
    assert upstream._recovered(None) == {"present": False}
    # a kernel neither masked, clamped nor of 0.22.1's shape is not decided, not "yes"
    other = text.replace("score = prob * inv_q", "score = prob / q")
    assert upstream._recovered(other)["recovered id kept inside the vocabulary"] is None
    assert upstream._link4(upstream._recovered(other)) == "not decided"
    assert upstream._link4(None) == "not read" and upstream._link4({"present": False}) == "no V1 sampler kernel"
    assert upstream._link4(pinned) == "yes" and upstream._link4(upstream._recovered(clamped)) == "no (clamped)"


def test_the_torch_a_release_pins_is_read_from_its_metadata():
    from dflash_lab import upstream

    assert upstream.check(upstream.pinned_texts())[upstream.TORCH] == "==2.11.0"   # what the GPU host has
    meta = "Name: vllm\nRequires-Dist: torchaudio==2.11.0\nRequires-Dist: torch (>=9); extra == 'x'\nRequires-Dist: torch==2.13.0\n"
    assert upstream.torch_requirement(meta) == "==2.13.0"
    assert upstream.torch_requirement("Name: vllm\nRequires-Dist: torchvision==0.26.0\n") is None


# --- the draft's sliding windows (upstream.draft_windows): snippets written for these tests, in the shapes read ------

DW_REGISTRY = """_SPECULATIVE_DECODING_MODELS = {
    "DFlashDraftModel": ("qwen3_dflash", "DFlashQwen3ForCausalLM"),
}
"""

DW_IGNORES = '''
class DFlashQwen3Attention(nn.Module):
    def __init__(self, num_heads, head_dim, cache_config=None, prefix=""):
        self.attn = Attention(num_heads, head_dim, cache_config=cache_config, prefix=f"{prefix}.attn")


class DFlashQwen3ForCausalLM(nn.Module):
    pass
'''

# {MIXED}: the block inside `if layer_types is not None:` after num_sliding is counted
DW_READS = '''
_SLIDING_ATTENTION = "sliding_attention"


def _resolve_layer_attention(config, layer_idx):
    dflash_config = getattr(config, "dflash_config", None) or {}
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        num_sliding = sum(lt == _SLIDING_ATTENTION for lt in layer_types)
{MIXED}
    if layer_types is None:
        is_sliding = False
    else:
        is_sliding = layer_types[layer_idx] == _SLIDING_ATTENTION
    sliding_window = None
    if is_sliding:
        sliding_window = dflash_config.get(
            "swa_window_size", getattr(config, "sliding_window", None)
        )
        if sliding_window is None:
            raise ValueError("a sliding layer needs a window size")
    return sliding_window, False


class DFlashQwen3Attention(nn.Module):
    def __init__(self, num_heads, head_dim, sliding_window=None, prefix=""):
        self.attn = Attention(num_heads, head_dim, per_layer_sliding_window=sliding_window, prefix=f"{prefix}.attn")


class DFlashQwen3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx, prefix=""):
        sliding_window, causal = _resolve_layer_attention(config, layer_idx)
        self.self_attn = DFlashQwen3Attention(config.num_attention_heads, config.head_dim,
                                              sliding_window=sliding_window, prefix=prefix)


class DFlashQwen3ForCausalLM(nn.Module):
    pass
'''
DW_REFUSED = '''        any_sliding = num_sliding > 0
        all_sliding = num_sliding == len(layer_types)
        if any_sliding and not all_sliding:
            raise NotImplementedError("mixed layers are " "not supported")'''
DW_REFUSED_V1 = '''        if (
            0 < num_sliding < len(layer_types)
            and not get_current_vllm_config().use_v2_model_runner
        ):
            raise NotImplementedError("relaunch with VLLM_USE_V2_MODEL_RUNNER=1.")'''
DW_BUILT = "        pass"

# {FORCE} and {V1}: the rule's use in use_v2_model_runner and in the V1 runner's unsupported features
DW_CONFIG = '''
class VllmConfig:
    @property
    def use_v2_model_runner(self) -> bool:
        use_v2_model_runner = envs.VLLM_USE_V2_MODEL_RUNNER
        if use_v2_model_runner is not None:
            return use_v2_model_runner
{FORCE}
        return False

    def _dflash_needs_multi_kv_group(self) -> bool:
        spec = self.speculative_config
        if spec is None or spec.method != "dflash":
            return False
        draft_config = spec.draft_model_config
        layer_types = getattr(draft_config.hf_config, "layer_types", None) or []
        num_sliding = sum(lt == "sliding_attention" for lt in layer_types)
        return 0 < num_sliding < len(layer_types)

    def _get_v1_model_runner_unsupported_features(self) -> list[str]:
        unsupported: list[str] = []
{V1}
        return unsupported

    def _validate_v1_model_runner(self) -> None:
        unsupported = self._get_v1_model_runner_unsupported_features()
        if unsupported:
            raise ValueError(
                f"Model Runner V1 does not support: {', '.join(unsupported)}"
            )
'''
DW_FORCE = "        if self._dflash_needs_multi_kv_group():\n            return True"
DW_V1 = ('        if self._dflash_needs_multi_kv_group():\n'
         '            unsupported.append("mixed sliding/full dflash drafts")')


def _dw(model, config=None, registry=DW_REGISTRY):
    from dflash_lab.upstream import DFLASH_MODEL, REGISTRY

    return upstream.draft_windows({REGISTRY: registry, DFLASH_MODEL: model, CONFIG: config})


def test_0_22_1s_own_dflash_draft_ignores_layer_types(pinned):
    """0.22.1's qwen3_dflash.py, read as tests/test_models.py reads it (vllm_sources.read_source, RECORD-checked): no
    line names layer_types or a window, so every draft layer is built as full attention; its VllmConfig has no rule for
    a mixed draft. The same file with a per-layer window passed to its Attention is no longer read as ignoring them."""
    from dflash_lab.upstream import DFLASH_MODEL, DRAFT_WINDOWS, REGISTRY, WIN_IGNORED
    from dflash_lab.vllm_sources import read_source

    src = read_source("vllm/model_executor/models/qwen3_dflash.py")
    assert pinned[DFLASH_MODEL] == src and "per_layer_sliding_window" not in src and "layer_types" not in src
    r = upstream.check(pinned)[DRAFT_WINDOWS]
    assert r["checked"] is True and r["mixed sliding and full layers"] == WIN_IGNORED
    assert (r["reads layer_types"], r["per-layer sliding window"], r["refusal"]) == (False, False, None)
    assert r["draft architecture"] == "DFlashDraftModel: qwen3_dflash.DFlashQwen3ForCausalLM"
    assert r["config rule"] == {"checked": True, "rules": [upstream.CFG_NONE], "quotes": []}
    files = [q["file"] for q in r["quotes"]]
    assert files == [REGISTRY, DFLASH_MODEL] and r["quotes"][1]["text"].startswith("self.attn = Attention(")
    assert src.splitlines()[int(r["quotes"][1]["lines"].split("-")[0]) - 1].strip() == "self.attn = Attention("
    at = '            prefix=f"{prefix}.attn",\n'
    windowed = src.replace(at, "            per_layer_sliding_window=sliding_window,\n" + at)
    assert windowed != src
    assert upstream.draft_windows({**pinned, DFLASH_MODEL: windowed})["checked"] is False


def test_each_recognized_draft_window_pattern_gets_its_verdict():
    from dflash_lab.upstream import WIN_BUILT, WIN_IGNORED, WIN_REFUSED, WIN_REFUSED_V1

    r = _dw(DW_IGNORES)
    assert r["checked"] and r["mixed sliding and full layers"] == WIN_IGNORED and not r["reads layer_types"]
    assert r["config rule"] == {"checked": False, "why": f"no {CONFIG}"}   # not read: said so, beside the verdict

    r = _dw(DW_READS.replace("{MIXED}", DW_REFUSED))
    assert r["checked"] and r["mixed sliding and full layers"] == WIN_REFUSED
    assert r["refusal"] == {"exception": "NotImplementedError", "message": "mixed layers are not supported",
                            "only if": None, "runner": None}
    assert r["a sliding layer's window"]["else"] == {"exception": "ValueError",
                                                    "message": "a sliding layer needs a window size"}
    assert any(q["text"].startswith("if any_sliding and not all_sliding: raise NotImplementedError(")
               for q in r["quotes"])

    r = _dw(DW_READS.replace("{MIXED}", DW_REFUSED_V1))
    assert r["checked"] and r["mixed sliding and full layers"] == WIN_REFUSED_V1
    assert r["refusal"] == {"exception": "NotImplementedError", "message": "relaunch with VLLM_USE_V2_MODEL_RUNNER=1.",
                            "only if": "not get_current_vllm_config().use_v2_model_runner", "runner": "V1"}

    r = _dw(DW_READS.replace("{MIXED}", DW_BUILT))
    assert r["checked"] and r["mixed sliding and full layers"] == WIN_BUILT and r["refusal"] is None
    assert r["reads layer_types"] and r["per-layer sliding window"]
    lines = DW_READS.replace("{MIXED}", DW_BUILT).splitlines()
    for q in r["quotes"][1:]:      # each quote is the file's own text at its line numbers
        a, _, b = q["lines"].partition("-")
        assert q["text"] == " ".join(x.strip() for x in lines[int(a) - 1:int(b or a)])


def test_a_draft_window_source_not_recognized_is_not_checked_rather_than_guessed():
    # the mixed test behind a condition that is not the V1 runner's
    odd = DW_REFUSED_V1.replace("not get_current_vllm_config().use_v2_model_runner", "envs.SOMETHING")
    r = _dw(DW_READS.replace("{MIXED}", odd))
    assert r["checked"] is False and "not the mixed-layer test recognized" in r["why"]
    # a message that is not a literal
    r = _dw(DW_READS.replace("{MIXED}", DW_REFUSED.replace('"mixed layers are " "not supported"', "msg")))
    assert r["checked"] is False and "a raise of _resolve_layer_attention not recognized" in r["why"]
    # layer_types named, but no window reaches the Attention layer
    r = _dw(DW_IGNORES.replace("pass", 'layer_types = getattr(config, "layer_types", None)'))
    assert r["checked"] is False and "without per_layer_sliding_window" in r["why"]
    # the draft's architecture built by another file; or not in the registry
    r = _dw(DW_IGNORES, registry=DW_REGISTRY.replace('"qwen3_dflash"', '"other_dflash"'))
    assert r["checked"] is False and "built by other_dflash" in r["why"]
    assert _dw(DW_IGNORES, registry="_MODELS = {}\n")["checked"] is False
    # the window taken from somewhere else than dflash_config / the config's sliding_window
    r = _dw(DW_READS.replace("{MIXED}", DW_BUILT).replace('"swa_window_size"', '"window"'))
    assert r["checked"] is False and "window under is_sliding: False" in r["why"]


def test_the_config_rules_for_a_mixed_draft_are_read():
    from dflash_lab.upstream import CFG_FORCES_V2, CFG_NONE, CFG_V1_REFUSES, _mixed_draft_config

    forced = _mixed_draft_config(DW_CONFIG.replace("{FORCE}", DW_FORCE).replace("{V1}", ""))
    assert forced["checked"] and forced["rules"] == [CFG_FORCES_V2] and "V1 refusal" not in forced
    assert forced["quotes"][-1]["text"] == "if self._dflash_needs_multi_kv_group(): return True"
    v1 = _mixed_draft_config(DW_CONFIG.replace("{FORCE}", "").replace("{V1}", DW_V1))
    assert v1["checked"] and v1["rules"] == [CFG_V1_REFUSES]
    assert v1["V1 refusal"] == {"exception": "ValueError",
                                "message": "Model Runner V1 does not support: mixed sliding/full dflash drafts"}
    assert _mixed_draft_config("class VllmConfig:\n    pass\n") == {"checked": True, "rules": [CFG_NONE], "quotes": []}
    # the forcing placed before the environment's override: not recognized
    early = DW_CONFIG.replace("{FORCE}", "").replace("{V1}", "").replace(
        "        use_v2_model_runner = envs", DW_FORCE + "\n        use_v2_model_runner = envs")
    assert _mixed_draft_config(early)["checked"] is False
    # the rule used elsewhere, or DFlash and sliding named without it: not recognized
    other = DW_CONFIG.replace("{FORCE}", "").replace("{V1}", "").replace(
        "        return unsupported", "        x = self._dflash_needs_multi_kv_group()\n        return unsupported")
    assert _mixed_draft_config(other)["checked"] is False
    # the forcing's shape in another function than use_v2_model_runner forces nothing
    elsewhere = DW_CONFIG.replace("{FORCE}", "").replace("{V1}", DW_FORCE)
    assert _mixed_draft_config(elsewhere)["checked"] is False
    assert _mixed_draft_config("# a DFlash draft with sliding layers\n")["checked"] is False
    # in draft_windows' record beside the model's verdict
    r = _dw(DW_READS.replace("{MIXED}", DW_REFUSED_V1), DW_CONFIG.replace("{FORCE}", DW_FORCE).replace("{V1}", ""))
    assert r["config rule"]["rules"] == [CFG_FORCES_V2]


def test_every_recorded_release_says_what_it_does_with_the_drafts_sliding_windows():
    """data/upstream/releases.jsonl (regenerated with the field): each release's own qwen3_dflash.py and VllmConfig,
    as read by draft_windows: 0.23.0-0.24.0 ignore layer_types; 0.25.x refuse a mixed draft outright; 0.26.0-0.33.0
    refuse it under the V1 runner only, their config forcing V2 for it (0.26.0-0.28.0) or having V1 refuse it
    (0.29.0-0.33.0); 0.34.0 builds its windows."""
    from dflash_lab.upstream import (CFG_FORCES_V2, CFG_NONE, CFG_V1_REFUSES, DRAFT_WINDOWS, WIN_BUILT, WIN_IGNORED,
                                     WIN_REFUSED, WIN_REFUSED_V1)

    rows = upstream.load(ROOT / "data" / "upstream" / "releases.jsonl")
    got = {r["version"]: (r[DRAFT_WINDOWS]["mixed sliding and full layers"], r[DRAFT_WINDOWS]["config rule"]["rules"])
           for r in rows if DRAFT_WINDOWS in r and r[DRAFT_WINDOWS]["checked"]}
    want = {**{v: (WIN_IGNORED, [CFG_NONE]) for v in ("0.23.0", "0.24.0")},
            **{v: (WIN_REFUSED, [CFG_NONE]) for v in ("0.25.0", "0.25.1")},
            **{v: (WIN_REFUSED_V1, [CFG_FORCES_V2]) for v in ("0.26.0", "0.27.0", "0.27.1", "0.28.0")},
            **{v: (WIN_REFUSED_V1, [CFG_V1_REFUSES]) for v in ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")},
            "0.34.0": (WIN_BUILT, [CFG_NONE])}
    assert got == want
    for r in rows:
        assert r["files"][upstream.DFLASH_MODEL] and r["files"][upstream.REGISTRY], r["version"]
        ref = r[DRAFT_WINDOWS]["refusal"]
        if ref:
            assert ref["exception"] == "NotImplementedError" and "mixed sliding/full attention" in ref["message"]
