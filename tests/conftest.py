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
