"""Launches recorded inside the real vLLM 0.22.1 engine on the H200, replayed on the CPU."""

import glob

import pytest

from dflash_lab import analysis, bounds
from dflash_lab.records import load_record
from dflash_lab.replay import replay

LAST = sorted(glob.glob("data/gpu/2026-11-30_h200_isolate-tp1/dflash-drafter-eager-acc1.86.a1.hook/launch-*-0002[67]?-last.npz"))


def test_records_exist():
    assert len(LAST) >= 5


@pytest.mark.parametrize("path", LAST[:5])
def test_cpu_replay_reproduces_the_engine_outputs(path):
    rec = load_record(path)
    if analysis.all_rejected_requests(rec) is None:
        pytest.skip("host copy taken after the fault")
    assert bounds.replay_matches_engine(rec, replay(rec, "stock"))


def test_all_rejected_requests_occur_in_the_real_engine():
    rec = load_record(next(p for p in LAST if "000272" in p))
    assert analysis.all_rejected_requests(rec) == [12, 13, 21]
