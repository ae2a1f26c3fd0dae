import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(autouse=True)
def _in_the_project_root(monkeypatch):
    """Every test starts in the project root, as `make test` runs them: tests that read the recorded data by its
    relative path (data/...) then pass from any working folder. A test may still change into its own folder."""
    monkeypatch.chdir(ROOT)


def run_cli(*args, env=None, cwd=ROOT, timeout=600):
    import subprocess

    e = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", TRITON_INTERPRET="1")
    if env:
        e.update(env)
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=e, cwd=cwd,
                          timeout=timeout)


def run_fake_matrix(tmp_path, engines, env):
    """Run a matrix of ``engines`` through ``python -m dflash_lab run`` with the stand-in worker (tests/fake_worker.py):
    (its run lines, {engine tag: engine log}). ``env``: the run's extra environment (PYTHONPATH included)."""
    import yaml

    from dflash_lab.runner import read_lines

    m = {"name": "t", "worker": "fake_worker", "run_timeout_s": 4, "startup_timeout_s": 4,
         "defaults": {"target": "tiny-dense", "hook": False}, "engines": engines}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(m))
    out, logs = tmp_path / "runs.jsonl", tmp_path / "logs"
    r = run_cli("dflash_lab", "run", str(tmp_path / "m.yaml"), "--out", str(out), "--logs", str(logs), timeout=300,
                env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    return read_lines(out), {p.name.split(".")[0]: p.read_text() for p in logs.glob("*.log")}
