import json
import tarfile

import pytest

from dflash_lab.errors import LabError
from dflash_lab.ingest import ingest


def make_out(tmp_path, lines):
    out = tmp_path / "OUT"
    out.mkdir()
    (out / "runs.jsonl").write_text(lines)
    logs = tmp_path / "runlogs"
    (logs / "e.a1.hook").mkdir(parents=True)
    (logs / "e.a1.log").write_text("engine log\n")
    (logs / "e.a1.hook" / "stats-1.json").write_text("{}")
    with tarfile.open(out / "logs.tgz", "w:gz") as tf:
        tf.add(logs, arcname="runlogs")
    return out


def test_ingest_then_refuse_to_overwrite(tmp_path):
    out = make_out(tmp_path, json.dumps({"run_id": "a", "outcome": "ok"}) + "\n")
    data = tmp_path / "data"
    data.mkdir()
    meta = ingest(str(out), "s1", data_dir=str(data))
    assert meta["lines"] == 1 and (data / "runs" / "s1.jsonl").exists()
    assert (data / "gpu" / "s1" / "e.a1.hook" / "stats-1.json").exists()
    with pytest.raises(LabError, match="already exists"):
        ingest(str(out), "s1", data_dir=str(data))


def test_corrupt_runs_write_nothing(tmp_path):
    out = make_out(tmp_path, '{"run_id": "a", "outcome": "ok"}\nnot json\n')
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(LabError, match="runs.jsonl:2"):
        ingest(str(out), "s2", data_dir=str(data))
    assert not (data / "runs").exists() and not (data / "gpu").exists()
    assert list(data.iterdir()) == []
