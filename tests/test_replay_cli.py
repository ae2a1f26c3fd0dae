"""python -m dflash_lab replay: exit codes, JSON, --out, and one-line errors on bad records."""

import json

import numpy as np

from conftest import run_cli

REC = "data/records/req0_all_rejected.npz"
CLEAN = "data/records/crashB_7x16_mixed.npz"


def one_line_error(r):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("dflash-lab: error:"), r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


def test_violation_exit_3_and_json(root):
    r = run_cli("dflash_lab", "replay", REC, "--json")
    assert r.returncode == 3, r.stderr
    d = json.loads(r.stdout)
    assert d["kernel"] == "stock" and d["ok"] is False
    assert {"param": "target_positions_ptr", "offset": -1, "extent": 32}.items() <= d["violations"][0].items()


def test_clean_exit_0_and_out(tmp_path):
    out = tmp_path / "o.npz"
    r = run_cli("dflash_lab", "replay", CLEAN, "--out", str(out))
    assert r.returncode == 0, r.stderr
    with np.load(out) as z:
        assert "out_query_slot_mapping_ptr" in z.files and z["out_query_positions_ptr"].dtype == np.int64


def test_patched_kernel_has_no_violation():
    r = run_cli("dflash_lab", "replay", REC, "--kernel", "patched", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["violations"] == []


def test_bad_inputs_get_one_line_and_exit_2(tmp_path, root):
    assert "no such file" in one_line_error(run_cli("dflash_lab", "replay", str(tmp_path / "none.npz")))
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"\x00garbage" * 100)
    assert "not a readable .npz" in one_line_error(run_cli("dflash_lab", "replay", str(junk)))
    # a text file or a record cut short: named as such, not as numpy's "pickled (object) data"
    text = tmp_path / "text.npz"
    text.write_text("garbage\n")
    cut = tmp_path / "cut.npz"
    cut.write_bytes((root / REC).read_bytes()[:200])
    for p in (text, cut):
        err = one_line_error(run_cli("dflash_lab", "replay", str(p)))
        assert "not a zip archive" in err and "pickle" not in err
    with np.load(root / REC) as z:
        d = {k: z[k] for k in z.files}
    miss = dict(d)
    del miss["block_size"]
    np.savez(tmp_path / "miss.npz", **miss)
    assert "missing parameter(s): block_size" in one_line_error(run_cli("dflash_lab", "replay", str(tmp_path / "miss.npz")))
    bad = dict(d, block_table_ptr=d["block_table_ptr"].reshape(64, -1))
    np.savez(tmp_path / "shape.npz", **bad)
    assert "must be a 1-D array" in one_line_error(run_cli("dflash_lab", "replay", str(tmp_path / "shape.npz")))
    bad = dict(d, target_positions_ptr=d["target_positions_ptr"].astype(np.int32))
    np.savez(tmp_path / "dtype.npz", **bad)
    assert "dtype int64" in one_line_error(run_cli("dflash_lab", "replay", str(tmp_path / "dtype.npz")))
    bad = dict(d, meta=np.asarray("{not json"))
    np.savez(tmp_path / "meta.npz", **bad)
    assert "meta is not valid JSON" in one_line_error(run_cli("dflash_lab", "replay", str(tmp_path / "meta.npz")))
    assert "unknown kernel" in one_line_error(run_cli("dflash_lab", "replay", REC, "--kernel", "nightly"))
    # nothing was written for a bad record
    out = tmp_path / "never.npz"
    one_line_error(run_cli("dflash_lab", "replay", str(junk), "--out", str(out)))
    assert not out.exists()


def test_prewarm_fills_the_replay_cache_in_parallel(tmp_path, monkeypatch):
    import shutil

    from dflash_lab import replay as R
    from dflash_lab.records import load_record
    from dflash_lab.vllm_sources import cache_dir

    src = cache_dir()
    monkeypatch.setenv("DFLASH_LAB_CACHE", str(tmp_path / "c"))
    (tmp_path / "c").mkdir()
    for sub in ("vllm-0.22.1-src", "generated"):  # the pinned sources, not the replay results
        if (src / sub).exists():
            shutil.copytree(src / sub, tmp_path / "c" / sub)
    paths = ["data/records/all_accepted_block_edge.npz", "data/records/crashA_32x16_mixed.npz"]
    assert R.prewarm(paths, workers=2) == 4
    cached = sorted((tmp_path / "c" / "replay").glob("*.npz"))
    assert len(cached) == 4
    assert R.prewarm(paths, workers=1) == 0  # one core: nothing to gain
    monkeypatch.setattr(R, "_replay", lambda *a: (_ for _ in ()).throw(AssertionError("not a cache hit")))
    R.replay(load_record(paths[0]), "patched")
