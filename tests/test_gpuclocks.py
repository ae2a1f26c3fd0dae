"""GPU clock samples (scripts/gpu/gpu-clocks.sh) read back per run: the sampler itself with a fake nvidia-smi, the
parser, the run windows, and ingest keeping the file."""

import json
import os
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

from dflash_lab import gpuclocks
from dflash_lab.errors import LabError
from dflash_lab.ingest import ingest

ROOT = Path(__file__).resolve().parents[1]
T0 = 1764590000.0


def _csv(path, rows):
    path.write_text("# epoch_s,index,sm_mhz,mem_mhz,power_w,temp_c,reasons (clocks_event_reasons.active)\n"
                    + "".join(f"{t}, {g}, {sm}, 3201, {p}, {temp}, {r}\n" for t, g, sm, p, temp, r in rows))
    return path


def test_summary_of_a_window_reads_every_gpu_and_names_the_reasons(tmp_path):
    f = _csv(tmp_path / "c.csv", [(T0, 0, 1980, 300.0, 40, "0x0000000000000001"),       # idle, before the run
                                  (T0 + 1, 0, 1980, 650.5, 55, "0x0000000000000000"),
                                  (T0 + 2, 0, 1755, 700.0, 61, "0x0000000000000004"),      # power cap
                                  (T0 + 2, 1, "[N/A]", "[N/A]", 58, "[N/A]"),
                                  (T0 + 9, 0, 1980, 300.0, 40, "0x0000000000000021")])     # after it
    s = gpuclocks.read(str(f))
    assert len(s) == 5 and s["sm_mhz"].isna().sum() == 1 and s["reasons"].isna().sum() == 1
    got = gpuclocks.summary(s, T0 + 0.5, T0 + 2.5)
    assert got == {"clock_samples": 3, "sm_mhz_mean": pytest.approx((1980 + 1755) / 2), "sm_mhz_min": 1755.0,
                   "mem_mhz_mean": 3201.0, "power_w_mean": pytest.approx((650.5 + 700) / 2), "temp_c_max": 61.0,
                   "clock_reasons": "sw power cap"}
    assert gpuclocks.summary(s, T0 + 3, T0 + 8) is None
    assert gpuclocks.reason_names(0x21 | 0x400) == ["sw thermal slowdown", "0x400"]


def test_a_line_nvidia_smi_could_not_fill_is_skipped_a_file_of_none_is_one_clear_error(tmp_path):
    f = tmp_path / "c.csv"
    f.write_text(f"{T0}, 0, 1980, 3201, 650, 55, 0x0\n{T0 + 1}, Unable to determine the device handle for GPU0\n")
    s = gpuclocks.read(str(f))
    assert len(s) == 1 and s.attrs["skipped"] == 1
    f.write_text(f"{T0}, 0, 1980\n{T0 + 1}, Unable to determine the device handle for GPU0\n")
    with pytest.raises(LabError, match=r"c.csv:1: not a GPU clock sample \(3 fields, expected 7\)"):
        gpuclocks.read(str(f))
    with pytest.raises(LabError, match="cannot read GPU clock samples"):
        gpuclocks.read(str(tmp_path / "missing.csv"))


def test_each_run_gets_the_samples_of_its_own_window(tmp_path):
    """Two runs of one call: finished_at (1 s resolution) minus wall_s; a call without a file gives no row."""
    (tmp_path / "gpu" / "b1").mkdir(parents=True)
    _csv(tmp_path / "gpu" / "b1" / "gpu_clocks.csv",
         [(T0 + i, 0, 1980 if i < 10 else 1500, 600, 50 + i, "0x0") for i in range(20)]
         + [(T0 + i, 1, 210, 70, 30, "0x1") for i in range(20)])   # a second GPU the TP=1 engine did not use
    iso = lambda t: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    base = {"gpu_session": "S", "mode": "m", "outcome": "ok", "warmup": False, "tensor_parallel_size": 1}
    runs = pd.DataFrame([dict(base, file="b1.jsonl", finished_at=iso(T0 + 8), wall_s=5.0),
                         # the worker's own span wins over finished_at - wall_s
                         dict(base, file="b1.jsonl", finished_at=iso(T0 + 19), wall_s=5.0, run_start_t=T0 + 14.5,
                              run_end_t=T0 + 17.5),
                         dict(base, file="b2.jsonl", finished_at=iso(T0 + 8), wall_s=5.0, gpu_session="T")])
    c = gpuclocks.for_runs(runs, str(tmp_path))
    assert list(c.index) == [0, 1]
    assert c.loc[0, "sm_mhz_mean"] == 1980 and c.loc[0, "clock_samples"] == 7      # t0+3 .. t0+9, GPU 0 only
    assert c.loc[1, "sm_mhz_mean"] == 1500 and c.loc[1, "clock_samples"] == 3 and c.loc[1, "temp_c_max"] == 67
    s = gpuclocks.by_session(runs, str(tmp_path))
    assert s.to_dict("records") == [{"gpu_session": "S", "mode": "m", "runs with samples": 2,
                                     "sm_mhz_mean": 1740.0, "sm_mhz_min": 1500.0, "power_w_mean": 600.0,
                                     "temp_c_max": 67.0, "clock_reasons": "none"}]
    # every GPU where the line does not say its tensor parallelism: the idle GPU drags the mean
    assert gpuclocks.for_runs(runs.drop(columns=["tensor_parallel_size"]).iloc[:1], str(tmp_path)).loc[0, "sm_mhz_min"] == 210
    assert gpuclocks.by_session(runs[runs["file"] == "b2.jsonl"], str(tmp_path)).empty


def test_the_sampler_writes_while_its_call_lives_and_stops_after(tmp_path):
    """scripts/gpu/gpu-clocks.sh with a fake nvidia-smi: samples every period while the watched process lives,
    ends on its own when it is gone, and its file reads back."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    smi = bin_ / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, 1980, 3201, 650.25, 55, 0x0000000000000000'\n"
                   "echo '1, 1965, 3201, 640.00, 57, 0x0000000000000004'\n")
    smi.chmod(0o755)
    watched = subprocess.Popen(["sleep", "1.5"])
    out = tmp_path / "gpu_clocks.csv"
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}")
    p = subprocess.Popen(["bash", str(ROOT / "scripts/gpu/gpu-clocks.sh"), str(out), str(watched.pid), "0.2"], env=env)
    watched.wait()
    assert p.wait(timeout=10) == 0
    s = gpuclocks.read(str(out))
    assert len(s) >= 4 and set(s["gpu"]) == {0, 1} and set(s["reasons"]) == {0, 4}
    assert s["t"].max() - s["t"].min() > 0.5 and abs(s["t"].max() - time.time()) < 60


def test_ingest_keeps_the_call_s_clock_samples(tmp_path):
    out = tmp_path / "OUT"
    out.mkdir()
    (out / "runs.jsonl").write_text(json.dumps({"run_id": "a", "outcome": "ok", "mode": "server", "gpu_session": "S"}) + "\n")
    _csv(out / "gpu_clocks.csv", [(T0, 0, 1980, 600, 50, "0x0")])
    data = tmp_path / "data"
    data.mkdir()
    meta = ingest(str(out), "b1", data_dir=str(data), kind="bench")
    assert "gpu_clocks.csv" in meta["files"] and len(gpuclocks.read(str(data / "gpu" / "b1" / "gpu_clocks.csv"))) == 1
