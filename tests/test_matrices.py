"""Every committed experiment matrix is valid for the runner (a typo must fail here, not on the GPU)."""

import glob
import re

import pytest

from dflash_lab.runner import load_matrix

MATRICES = sorted(glob.glob("matrices/*.yaml"))


def test_there_are_matrices():
    assert len(MATRICES) >= 10


def test_every_matrix_is_named_as_its_file():
    """The GPU scripts know a matrix by its file's name (runner folders, kept runs, detached.sh's THEN routing of
    SKIP_DONE files), the run lines by its name: the two must be one."""
    import os

    import yaml

    for path in MATRICES:
        with open(path) as f:
            assert yaml.safe_load(f).get("name") == os.path.basename(path)[:-len(".yaml")], path


# kept as it ran: its MTP engine is the failed attempt the runner now refuses (see issue 10's notes)
HISTORICAL = {"matrices/root-discriminate-tp1.yaml": "models_dir contains 'dflash'"}


def test_the_historical_matrix_is_refused_for_the_reason_it_failed():
    from dflash_lab.errors import LabError

    for path in HISTORICAL:
        with pytest.raises(LabError, match="contains 'dflash' or 'eagle'"):
            load_matrix(path)


@pytest.mark.parametrize("path", [m for m in MATRICES if m not in HISTORICAL])
def test_matrix_loads(path):
    m = load_matrix(path)
    assert m["engines"] and all(e["runs"] for e in m["engines"])
    if "/bench-" in path:  # the benchmark is the server workload, 3 repeats per cell
        # the s1/s2 slices hold every concurrency; s3-s5 complete cells short of repeats
        slice_ = re.search(r"-s[3-9]-", path) is None
        for e in m["engines"]:
            assert e["engine"]["mode"] == "server"
            per_cell = {}
            warm = [r for r in e["runs"] if r.warmup]
            if warm:  # a warm-up sweep, 32 tokens a run, at each measured concurrency (stock FULL's: where it completed, s26)
                # a completion matrix may warm up with a full-length request: in s32 a 32-token one left three Triton
                # JIT compiles to PIECEWISE's first measured run at 1 (s33's full-length one none); eager's stay short
                lengths = {32, 512} if not slice_ and e["id"] != "eager" else {32}
                assert {r.max_tokens for r in warm} <= lengths
                # at 1.86 stock FULL crashed at 8 in every engine start (s26); at 3.6 and 6.0 it has not run (at 8.8 it
                # completed at 16 and 32, s21), so those sweep and repeat 8
                stock_sweep = [1, 4, 16] if "acc1.86" in path else [1, 4, 8, 16]
                measured = e["runs"][len(warm):]
                # a slice sweeps all six; a completion matrix (bench-acc1.86-s3..s5) sweeps the concurrencies it measures
                sweep = [1, 4, 8, 16, 32, 64] if slice_ else sorted({r.concurrency for r in measured})
                assert [r.concurrency for r in warm] == (stock_sweep if e["id"] == "full-stock" and slice_ else sweep)
            else:  # bench-acc1.86-a, the record of s24's run: one warm-up run, unflagged
                assert (e["runs"][0].concurrency, e["runs"][0].max_tokens) == (2, 64)
                measured = e["runs"][1:]
            for r in measured:
                per_cell[r.concurrency] = per_cell.get(r.concurrency, 0) + 1
            if e["id"] != "full-stock":
                assert set(per_cell.values()) == {3} and (set(per_cell) == {1, 4, 8, 16, 32, 64} or not slice_)
            elif warm and slice_:  # where stock crashed every engine start (8 at 1.86, 32, 64), once: a crash costs a restart
                assert per_cell == {1: 3, 4: 3, 8: 1 if "acc1.86" in path else 3, 16: 3, 32: 1, 64: 1}
            elif warm:  # a completion matrix repeats stock only where it completed every run (16 at 1.86)
                assert per_cell == {16: 3}
