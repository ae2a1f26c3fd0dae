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


def run_cli(*args, env=None, cwd=ROOT, timeout=600):
    import subprocess

    e = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", TRITON_INTERPRET="1")
    if env:
        e.update(env)
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=e, cwd=cwd,
                          timeout=timeout)
