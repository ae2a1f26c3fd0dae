"""scripts/gpu/detached.sh: one runner for a whole matrix that outlives the device calls (a call lasts at most 10
minutes, a cold engine start 7), with each call returning everything so far."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import pytest
import yaml

from dflash_lab.errors import LabError
from dflash_lab.ingest import ingest
from dflash_lab.runner import read_lines

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("setsid") is None,
                                reason="needs bash and setsid")


def matrix(tmp_path, name="det-t"):
    m = {"name": name, "worker": "fake_worker", "run_timeout_s": 30, "startup_timeout_s": 30,
         "defaults": {"target": "tiny-dense"},
         "engines": [{"id": "e1", "runs": [{"concurrency": 2, "rounds": 2}]},
                     {"id": "e2", "runs": [{"concurrency": 4}]}]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(m))
    return path


def host_env(root, tmp_path, out, **env):
    """A GPU host's environment for the scripts, in tmp_path: no setup, the fake engine on the checkout's path, the
    runner folders and kept runs under tmp_path, this interpreter as python3."""
    return {**os.environ, "OUT": str(out), "DETACHED_ROOT": str(tmp_path / "det"), "DFLASH_LAB_HOST_SETUP": "",
            "HOST_RUNS": str(tmp_path / "kept"), "DFLASH_LAB_HOST_PYTHONPATH": f"{root}:{root / 'tests'}",
            "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "TRITON_INTERPRET": "1", **env}


def det(root, tmp_path, out, *args, **env):
    return subprocess.run(["bash", str(root / "scripts" / "gpu" / "detached.sh"), *args], capture_output=True,
                          text=True, env=host_env(root, tmp_path, out, DFLASH_LAB_GPU_SESSION="test-session", **env),
                          cwd=root, timeout=180)


def runner_pid(tmp_path, name="det-t"):
    return int((tmp_path / "det" / name / "pid").read_text())


def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_the_runner_outlives_its_call_and_the_last_call_returns_the_whole_matrix(root, tmp_path):
    m = matrix(tmp_path)
    try:
        r = det(root, tmp_path, tmp_path / "o1", "start", str(m), "300", "0", FAKE_RUN_S="2")
        assert r.returncode == 0, r.stderr + r.stdout
        pid = runner_pid(tmp_path)
        assert alive(pid), "the call has returned; its runner must run on"
        assert os.getsid(pid) == pid   # in its own session: the device tool ends every other process of a call
        assert (tmp_path / "o1" / "status").read_text().startswith("running")
        again = det(root, tmp_path, tmp_path / "o1b", "start", str(m), "300", "0")
        assert again.returncode == 2 and "already running" in again.stderr
        r = det(root, tmp_path, tmp_path / "o2", "wait", str(m), "150")
        assert r.returncode == 0, r.stderr + r.stdout
        assert (tmp_path / "o2" / "status").read_text().strip() == "ended rc=0"
        lines = read_lines(tmp_path / "o2" / "runs.jsonl")
        assert [l["run_id"] for l in lines] == ["e1/c2/r0", "e1/c2/r1", "e2/c4/r0"]
        assert {l["outcome"] for l in lines} == {"ok"} and {l["gpu_session"] for l in lines} == {"test-session"}
        with tarfile.open(tmp_path / "o2" / "logs.tgz") as tf:
            assert any(n.endswith("e1.a1.log") for n in tf.getnames()), tf.getnames()
        assert "runner deadline" in r.stdout or "line(s)" in r.stdout
        # the last call's folder is what gets ingested, with the runner's own output
        with pytest.raises(LabError, match="no such folder"):
            ingest(str(tmp_path / "o2"), "det-t-a", data_dir=str(tmp_path / "data"))
        (tmp_path / "data").mkdir()
        meta = ingest(str(tmp_path / "o2"), "det-t-a", data_dir=str(tmp_path / "data"))
        assert meta["lines"] == 3 and "runner.log" in meta["files"]
        # the runner kept its runs on the host at its end: a new start with SKIP_HOST=1 leaves them all out
        r = det(root, tmp_path, tmp_path / "o3", "start", str(m), "300", "120", SKIP_HOST="1")
        assert r.returncode == 0, r.stderr + r.stdout
        assert (tmp_path / "o3" / "status").read_text().strip() == "ended rc=0"
        assert "3 run(s) already measured" in (tmp_path / "o3" / "runner.log").read_text()
        assert not (tmp_path / "o3" / "runs.jsonl").exists() or not read_lines(tmp_path / "o3" / "runs.jsonl")
        assert len(list((tmp_path / "det").glob("det-t.*"))) == 1   # the first runner's folder, kept beside
    finally:
        _kill_runners(tmp_path)


def test_a_copy_never_ends_in_half_a_line_and_a_dead_runner_says_so(root, tmp_path):
    d = tmp_path / "det" / "det-t"
    d.mkdir(parents=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (d / "pid").write_text(f"{gone.pid}\n")
    (d / "t0").write_text(f"{int(time.time())}\n")
    whole = json.dumps({"run_id": "e1/c2/r0", "outcome": "ok"}) + "\n"
    (d / "runs.jsonl").write_text(whole + '{"run_id": "e1/c2/r1", "outc')
    r = det(root, tmp_path, tmp_path / "o", "wait", str(tmp_path / "det-t.yaml"), "30")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "o" / "runs.jsonl").read_text() == whole
    assert "without an exit status" in (tmp_path / "o" / "status").read_text()
    (d / "rc").write_text("1\n")
    det(root, tmp_path, tmp_path / "o", "wait", str(tmp_path / "det-t.yaml"), "30")
    assert (tmp_path / "o" / "status").read_text().strip() == "ended rc=1"


@pytest.mark.parametrize("args,msg", [(("wait", "m.yaml", "5"), "no runner of m was started"),
                                      (("start", "nope.yaml", "300", "5"), "no such matrix"),
                                      (("start", "m.yaml", "soon", "5"), "not a whole number"),
                                      (("wait", "m.yaml"), "not a whole number"),
                                      (("stop", "m.yaml"), "usage"),
                                      (("wait", "a b.yaml", "5"), "bad matrix name")])
def test_bad_calls_say_what_is_wrong(root, tmp_path, args, msg):
    r = det(root, tmp_path, tmp_path / "o", *args)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert not (tmp_path / "det").exists()


def test_session_sh_shares_the_host_steps_and_a_second_call_continues(root, tmp_path):
    """session.sh, the one-call runner, sources the same environment and skip list and packs its logs the same way."""
    m = matrix(tmp_path, "sess-t")

    def call(out, **env):
        e = host_env(root, tmp_path, out, **env)
        r = subprocess.run(["bash", str(root / "scripts" / "gpu" / "session.sh"), str(m), "200"], capture_output=True,
                           text=True, env=e, cwd=root, timeout=180)
        assert r.returncode == 0, r.stderr + r.stdout
        return r

    call(tmp_path / "o1")
    assert [l["run_id"] for l in read_lines(tmp_path / "o1" / "runs.jsonl")] == ["e1/c2/r0", "e1/c2/r1", "e2/c4/r0"]
    with tarfile.open(tmp_path / "o1" / "logs.tgz") as tf:
        assert any(n.endswith("e2.a1.log") for n in tf.getnames()), tf.getnames()
    r = call(tmp_path / "o2", SKIP_HOST="1")
    assert "3 run(s) already measured" in r.stdout
    assert not (tmp_path / "o2" / "runs.jsonl").exists() or not read_lines(tmp_path / "o2" / "runs.jsonl")


def _kill_runners(tmp_path):
    for p in (tmp_path / "det").glob("*/pid"):
        try:
            os.killpg(int(p.read_text()), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError):
            pass


def _ppid(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_start_returns_by_its_wait_with_setup_counted_and_the_runner_outside_its_tree(root, tmp_path):
    setup = tmp_path / "setup.sh"
    setup.write_text("sleep 5\necho set up\n")
    m = matrix(tmp_path)
    try:
        # WAIT 12 s: the runner starts ~5 s in (after setup), so a loaded machine still finds the call waiting when
        # the runner's pid appears (with 6 s, a 2-core machine busy elsewhere saw the call return first)
        e = host_env(root, tmp_path, tmp_path / "o1", DFLASH_LAB_HOST_SETUP=str(setup), FAKE_RUN_S="25")
        t0 = time.time()
        call = subprocess.Popen(["bash", str(root / "scripts" / "gpu" / "detached.sh"), "start", str(m), "300", "12"],
                                env=e, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        pid_file = tmp_path / "det" / "det-t" / "pid"
        while not pid_file.exists() and time.time() - t0 < 30:
            time.sleep(0.1)
        pid = runner_pid(tmp_path)
        assert call.poll() is None and _ppid(pid) != call.pid   # the call still waits; the runner is not its child
        out, err = call.communicate(timeout=60)
        took = time.time() - t0
        assert call.returncode == 0, err + out
        assert took < 12 + 3.5, f"WAIT counts from the call's start, setup (5 s) included: took {took:.1f} s"
        assert alive(pid) and "running" in (tmp_path / "o1" / "status").read_text()
        assert (tmp_path / "o1" / "setup.log").read_text().strip() == "set up"
        # one GPU, one runner: another matrix's start and session.sh both refuse while it runs
        other = det(root, tmp_path, tmp_path / "o2", "start", str(matrix(tmp_path, "det-u")), "300", "5")
        assert other.returncode == 2 and "already running on this host" in other.stderr
        r = subprocess.run(["bash", str(root / "scripts" / "gpu" / "session.sh"), str(m), "100"], capture_output=True,
                           text=True, cwd=root, timeout=60, env=dict(e, OUT=str(tmp_path / "o3"), DFLASH_LAB_HOST_SETUP=""))
        assert r.returncode == 2 and "a runner is running on this host" in r.stderr
        assert not (tmp_path / "o3" / "runs.jsonl").exists()
    finally:
        _kill_runners(tmp_path)


def test_a_wait_cut_at_its_limit_still_returned_what_it_had(root, tmp_path):
    """The device tool cuts a call at its time limit and returns $OUT as it is: the wait call's periodic snapshot has
    the runs measured so far there, each file whole."""
    m = matrix(tmp_path)
    try:
        assert det(root, tmp_path, tmp_path / "o1", "start", str(m), "300", "0", FAKE_RUN_S="4").returncode == 0
        e = host_env(root, tmp_path, tmp_path / "o2", DETACHED_SNAPSHOT_S="1")
        call = subprocess.Popen(["bash", str(root / "scripts" / "gpu" / "detached.sh"), "wait", str(m), "300"], env=e,
                                cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        runs = tmp_path / "o2" / "runs.jsonl"
        t0 = time.time()
        while time.time() - t0 < 60 and not (runs.exists() and runs.read_text().count("\n") >= 1):
            time.sleep(0.2)
        assert alive(runner_pid(tmp_path)), "the snapshot must come while the runner still runs"
        os.killpg(call.pid, signal.SIGKILL)   # as a call cut at its limit
        call.wait()
        lines = read_lines(runs)
        assert lines and lines[0]["run_id"] == "e1/c2/r0" and runs.read_text().endswith("\n")
        assert (tmp_path / "o2" / "status").read_text().startswith(("running", "ended"))
    finally:
        _kill_runners(tmp_path)


def chain_matrix(tmp_path, name, engine, runs=1, **top):
    m = {"name": name, "worker": "fake_worker", "run_timeout_s": 60, "startup_timeout_s": 30, **top,
         "defaults": {"target": "tiny-dense"},
         "engines": [{"id": engine, "runs": [{"concurrency": 2, "rounds": runs}]}]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(m))
    return path


def test_a_chain_runs_its_matrices_in_turn_each_in_its_own_folder_and_skip_list(root, tmp_path):
    """THEN: one start runs a release's stock matrix and then its part-1 matrix on one host (the README's plan), with
    no deadline worked out between them; each wait returns the matrix it names, whole."""
    a = chain_matrix(tmp_path, "chain-a", "full", runs=2)
    b = chain_matrix(tmp_path, "chain-b", "part1", runs=2)
    # an earlier call of chain-b measured its first run: SKIP_DONE's file goes to chain-b (chain-a's runner would
    # refuse a line of another matrix)
    earlier = tmp_path / "b-earlier.jsonl"
    earlier.write_text(json.dumps({"matrix": "chain-b", "run_id": "part1/c2/r0", "outcome": "ok"}) + "\n")
    try:
        r = det(root, tmp_path, tmp_path / "o1", "start", str(a), "300", "0", FAKE_RUN_S="3",
                THEN=str(b), SKIP_DONE=str(earlier))
        assert r.returncode == 0, r.stderr + r.stdout
        assert "runner of chain-a chain-b started" in r.stdout
        pid = runner_pid(tmp_path, "chain-a")
        assert runner_pid(tmp_path, "chain-b") == pid and os.getsid(pid) == pid   # one process runs both, in turn
        q = det(root, tmp_path, tmp_path / "oq", "wait", str(b), "0")
        assert q.returncode == 0 and "queued" in (tmp_path / "oq" / "status").read_text()
        assert "chain-a" in (tmp_path / "oq" / "status").read_text()
        # another start refuses while the chain runs, whichever matrix it names
        again = det(root, tmp_path, tmp_path / "o1b", "start", str(b), "300", "0")
        assert again.returncode == 2 and "already running" in again.stderr
        ra = det(root, tmp_path, tmp_path / "o2", "wait", str(a), "150")
        assert ra.returncode == 0 and (tmp_path / "o2" / "status").read_text().strip() == "ended rc=0"
        assert [l["run_id"] for l in read_lines(tmp_path / "o2" / "runs.jsonl")] == ["full/c2/r0", "full/c2/r1"]
        rb = det(root, tmp_path, tmp_path / "o3", "wait", str(b), "150")
        assert rb.returncode == 0 and (tmp_path / "o3" / "status").read_text().strip() == "ended rc=0"
        lines_b = read_lines(tmp_path / "o3" / "runs.jsonl")
        assert [l["run_id"] for l in lines_b] == ["part1/c2/r1"]   # r0 left out through SKIP_DONE
        assert {l["matrix"] for l in lines_b} == {"chain-b"} and {l["gpu_session"] for l in lines_b} == {"test-session"}
        assert "1 run(s) already measured" in (tmp_path / "o3" / "runner.log").read_text()
        with tarfile.open(tmp_path / "o3" / "logs.tgz") as tf:
            assert any("part1.a1" in n for n in tf.getnames()) and not any("full.a1" in n for n in tf.getnames())
        # each ended matrix kept its own runs on the host for SKIP_HOST
        kept = sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "kept").glob("*.jsonl"))
        assert kept == ["chain-a", "chain-b"]
    finally:
        _kill_runners(tmp_path)


def test_a_chain_shares_one_deadline(root, tmp_path):
    """The later matrix gets what is left of the start's DEADLINE_S, not a deadline of its own: with 45 s for the
    runners and chain-a taking ~20 s, chain-b's engine (start estimate 1 s + 30 s margin) is not started."""
    a = chain_matrix(tmp_path, "chain-a", "full", startup_estimate_s=1)
    b = chain_matrix(tmp_path, "chain-b", "part1", startup_estimate_s=1)
    try:
        r = det(root, tmp_path, tmp_path / "o1", "start", str(a), "70", "150", FAKE_RUN_S="20", THEN=str(b))
        assert r.returncode == 0, r.stderr + r.stdout
        assert [l["run_id"] for l in read_lines(tmp_path / "o1" / "runs.jsonl")] == ["full/c2/r0"]
        rb = det(root, tmp_path, tmp_path / "o2", "wait", str(b), "60")
        assert (tmp_path / "o2" / "status").read_text().strip() == "ended rc=0", rb.stdout + rb.stderr
        log = (tmp_path / "o2" / "runner.log").read_text()
        assert "not run before the deadline: 1 run(s): part1/c2/r0" in log or "turn came after the deadline" in log, log
        assert not (tmp_path / "o2" / "runs.jsonl").exists()
    finally:
        _kill_runners(tmp_path)


def test_a_chain_matrix_whose_turn_comes_after_the_deadline_is_not_started_and_says_so(root, tmp_path):
    """chain-a's run outlasts the whole deadline (the runner cuts it there), so chain-b's turn comes after it: no runner
    is started for chain-b (a deadline below 1 s would reach the runner as none at all), and its status says why, not
    the 'ended rc=0' of a matrix that ran."""
    a = chain_matrix(tmp_path, "chain-a", "full", startup_estimate_s=1)
    b = chain_matrix(tmp_path, "chain-b", "part1", startup_estimate_s=1)
    try:
        r = det(root, tmp_path, tmp_path / "o1", "start", str(a), "60", "0", FAKE_RUN_S="100", THEN=str(b))
        assert r.returncode == 0, r.stderr + r.stdout
        assert "chain-a: runner" in r.stdout and "chain-b: runner" not in r.stdout   # the call reports on MATRIX
        rb = det(root, tmp_path, tmp_path / "o2", "wait", str(b), "150")
        assert rb.returncode == 0, rb.stderr
        assert (tmp_path / "o2" / "status").read_text().strip() == \
            "not started (its turn in the chain came after the deadline)", rb.stdout
        assert "not started: its turn came after the deadline" in (tmp_path / "o2" / "runner.log").read_text()
        assert not (tmp_path / "o2" / "runs.jsonl").exists()
        lines_a = read_lines(tmp_path / "det" / "chain-a" / "runs.jsonl")
        assert [l["run_id"] for l in lines_a] == ["full/c2/r0"] and lines_a[0]["outcome"] != "ok"
    finally:
        _kill_runners(tmp_path)


@pytest.mark.parametrize("then,skip,msg", [("{a}", "", "chain-a twice in one chain"),
                                           ("{tmp}/nope.yaml", "", "no such matrix"),
                                           ("{b}", "{other}", "no matrix of the chain"),
                                           ("{b}", "{tmp}/gone.jsonl", "not a runs file")])
def test_bad_chains_say_what_is_wrong_and_start_nothing(root, tmp_path, then, skip, msg):
    a = chain_matrix(tmp_path, "chain-a", "full")
    b = chain_matrix(tmp_path, "chain-b", "part1")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"matrix": "chain-c", "run_id": "x/c2/r0", "outcome": "ok"}) + "\n")
    fill = dict(a=a, b=b, tmp=tmp_path, other=other)
    r = det(root, tmp_path, tmp_path / "o", "start", str(a), "300", "0", THEN=then.format(**fill),
            SKIP_DONE=skip.format(**fill))
    assert r.returncode == 2 and msg in r.stderr, r.stderr + r.stdout
    assert not list((tmp_path / "det").glob("*/pid"))
