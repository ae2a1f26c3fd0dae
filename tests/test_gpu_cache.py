"""scripts/gpu/cache.sh: the compile caches survive the trip host -> here -> next host, or are not used at all."""

import os
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("split") is None, reason="needs bash, split")


def sh(root, *args, **env):
    e = dict(os.environ, **{k: str(v) for k, v in env.items()})
    return subprocess.run(["bash", str(root / "scripts" / "gpu" / "cache.sh"), *args], capture_output=True, text=True,
                          env=e, timeout=120, cwd=env.get("CWD", root))


def test_round_trip_and_refusals(root, tmp_path):
    src, dst = tmp_path / "host1", tmp_path / "host2"
    (src / "home/.cache/vllm/torch_compile_cache/abc").mkdir(parents=True)
    (src / "home/.cache/vllm/torch_compile_cache/abc/graph.py").write_text("x = 1\n" * 5000)
    (src / "home/.triton/cache/k1").mkdir(parents=True)
    (src / "home/.triton/cache/k1/kernel.cubin").write_bytes(os.urandom(30000))
    env = dict(CACHE_ROOT=src, CACHE_DIRS="/home/.cache/vllm /home/.triton/cache /home/.cache/flashinfer",
               CACHE_PIECES=tmp_path / "pieces", CACHE_PIECE_BYTES=8000)
    r = sh(root, "save", **env)
    assert r.returncode == 0, r.stderr
    n = len([p for p in os.listdir(tmp_path / "pieces") if p.startswith("c")])
    assert n >= 3 and f"{n} piece(s)" in r.stdout
    assert sh(root, "get", "0", "5", OUT=tmp_path / "o", **env).returncode == 2  # 6 pieces: over a call's limit
    carried = tmp_path / "checkout" / ".gpu-cache"
    carried.mkdir(parents=True)
    for first in range(0, n, 5):
        out = tmp_path / f"out{first}"
        g = sh(root, "get", str(first), str(first + 4), OUT=out, **env)  # the last call may ask past the end
        assert g.returncode == 0, g.stderr
        for f in os.listdir(out):
            shutil.copy(out / f, carried / f)
    renv = dict(CACHE_ROOT=dst, CACHE_PARTS=tmp_path / "parts", CACHE_CARRIED=carried)
    # a missing piece: reported, not used, not an error for the session
    held = carried / "c01"
    held.rename(tmp_path / "held")
    assert sh(root, "put", **renv).returncode == 0
    r = sh(root, "restore", **renv)
    assert r.returncode == 0 and "incomplete" in r.stdout and not dst.exists()
    (tmp_path / "held").rename(held)
    assert sh(root, "put", **renv).returncode == 0
    r = sh(root, "restore", **renv)
    assert r.returncode == 0 and "restored" in r.stdout, r.stderr
    assert (dst / "home/.triton/cache/k1/kernel.cubin").read_bytes() == (src / "home/.triton/cache/k1/kernel.cubin").read_bytes()
    assert (dst / "home/.cache/vllm/torch_compile_cache/abc/graph.py").read_text().count("x = 1") == 5000
    # a stray piece of an older, larger set left in the carried folder is not joined: the count decides
    shutil.copy(carried / "c00", tmp_path / "parts" / f"c{n + 3:02d}")
    shutil.rmtree(dst)
    r = sh(root, "restore", **renv)
    assert "restored" in r.stdout and (dst / "home/.triton/cache/k1/kernel.cubin").exists()
    # a corrupt piece: not used
    (tmp_path / "parts" / "c01").write_bytes(b"garbage")
    shutil.rmtree(dst)
    r = sh(root, "restore", **renv)
    assert "corrupt" in r.stdout and not dst.exists()
    # nothing carried at all: the engines compile from scratch, quietly
    r = sh(root, "restore", CACHE_ROOT=dst, CACHE_PARTS=tmp_path / "none")
    assert r.returncode == 0 and "no carried compile cache" in r.stdout
    assert sh(root, "save", CACHE_ROOT=tmp_path / "empty", CACHE_DIRS="/nothing", CACHE_PIECES=tmp_path / "p2").returncode == 2
