import shutil

import pytest

from dflash_lab import vllm_sources
from dflash_lab.errors import LabError


def test_kernel_source_is_the_pinned_text():
    text = vllm_sources.read_source("vllm/v1/spec_decode/utils.py")
    assert "def copy_and_expand_dflash_inputs_kernel(" in text
    # the unmasked load the report points at, at the line it names
    assert vllm_sources.line_of("vllm/v1/spec_decode/utils.py", "last_pos = tl.load(target_positions_ptr") == 526
    prov = vllm_sources.source_tree().provenance()
    assert prov["vllm_version"] == "0.22.1"


def test_file_outside_the_distribution_is_an_error():
    with pytest.raises(LabError, match="not a file of vLLM 0.22.1"):
        vllm_sources.read_source("vllm/v1/spec_decode/no_such_file.py")


def test_modified_copy_is_detected(tmp_path, monkeypatch):
    tree = vllm_sources.source_tree()
    fake = tmp_path / "tree"
    shutil.copytree(tree.root / "vllm" / "v1" / "spec_decode", fake / "vllm" / "v1" / "spec_decode")
    p = fake / "vllm" / "v1" / "spec_decode" / "utils.py"
    p.write_text(p.read_text().replace("valid_ctx_end - 1", "valid_ctx_end - 2"))
    monkeypatch.setattr(vllm_sources, "source_tree",
                        lambda: vllm_sources.SourceTree(fake, "wheel", tree.record, tree.wheel_sha256))
    with pytest.raises(LabError, match="differs from vLLM 0.22.1's RECORD"):
        vllm_sources.read_source("vllm/v1/spec_decode/utils.py")


def test_wheel_with_wrong_checksum_is_refused(tmp_path, monkeypatch):
    bogus = tmp_path / vllm_sources.WHEEL_NAME
    bogus.write_bytes(b"not the wheel")
    monkeypatch.setenv("DFLASH_LAB_VLLM_WHEEL", str(bogus))
    with pytest.raises(LabError, match="does not match the published"):
        vllm_sources._obtain_wheel(tmp_path)


def test_offline_without_cache_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_LAB_VLLM_WHEEL", raising=False)
    monkeypatch.setenv("DFLASH_LAB_OFFLINE", "1")
    with pytest.raises(LabError, match="DFLASH_LAB_OFFLINE=1"):
        vllm_sources._obtain_wheel(tmp_path)
