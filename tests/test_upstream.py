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
