"""scripts/repro_min.py on the CPU: its model configs set up the bug's precondition (vLLM's own grouping)."""

import json
import subprocess
import sys

import pytest

from dflash_lab import kvgroups


def test_repro_configs_split_the_target_attention_over_two_groups(tmp_path, root):
    r = subprocess.run([sys.executable, str(root / "scripts" / "repro_min.py"), "--write-configs-only", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    t = json.load(open(tmp_path / "target" / "config.json"))["text_config"]
    d = json.load(open(tmp_path / "draft" / "config.json"))
    layers = kvgroups.hybrid_layers(num_layers=t["num_hidden_layers"], full_attention_interval=t["full_attention_interval"],
                                    target_attn=(t["num_key_value_heads"], t["head_dim"]),
                                    draft_layers=d["num_hidden_layers"],
                                    draft_attn=(d["num_key_value_heads"], d["head_dim"]))
    reusers = kvgroups.metadata_reusers(kvgroups.groups(layers))
    assert [[kvgroups.layer_index(x) for x in g["layers"]] for g in reusers] == [[7]]
    assert max(d["dflash_config"]["target_layer_ids"]) < t["num_hidden_layers"]


def test_repro_refuses_bad_arguments(root):
    r = subprocess.run([sys.executable, str(root / "scripts" / "repro_min.py"), "--concurrency", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "must be >= 2" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _load(root):
    import importlib.util

    spec = importlib.util.spec_from_file_location("repro_min", root / "scripts" / "repro_min.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_crash_reason_on_the_recorded_gpu_log(root):
    rm = _load(root)
    text = (root / "data" / "gpu" / "2026-11-30_h200_repro-min-first" / "repro_min.log").read_text(errors="replace")
    assert rm.crash_reason(text) == "CUDA error: an illegal memory access was encountered"
    assert rm.crash_reason("all good\n") is None


# Fake children: real subprocesses that behave like the engines did (or should), so the parent's
# handling of a crashing child, of partial files and of the verdict is exercised for real.
OUT = [{"tokens": [5, 6, 7], "logprobs": [-0.1, -0.2, -0.3]}, {"tokens": [8, 9, 1], "logprobs": [-0.5, -0.1, -0.2]}]
STOCK_CRASH = f"""
import json, os, sys
w = sys.argv[1]
json.dump({{"startup_s": 12.5}}, open(os.path.join(w, "stock.started.json"), "w"))
open(os.path.join(w, "stock.checks.jsonl"), "a").write(json.dumps({{"call": 1, "entries_differ": 30, "of": 33,
    "first_index": 1, "graph_reads": 0, "step_has": 4}}) + "\\n" + '{{"call": 2, "entr')
print("(EngineCore pid=1) ERROR torch.AcceleratorError: CUDA error: an illegal memory access was encountered")
sys.exit(1)
"""


def _done(role, stale=0, out=OUT):
    return f"""
import json, os, sys
w = sys.argv[1]
json.dump({{"startup_s": 10.0}}, open(os.path.join(w, "{role}.started.json"), "w"))
if {stale}:
    open(os.path.join(w, "{role}.checks.jsonl"), "a").write(json.dumps({{"call": 3, "entries_differ": 2, "of": 33,
        "first_index": 5, "graph_reads": 1, "step_has": 2}}) + "\\n")
json.dump({{"role": "{role}", "startup_s": 10.0, "outputs": {out!r}, "check_counts": {{"calls": 40, "stale": {stale}}},
           "groups": [{{"gid": 2, "layers": ["language_model.model.layers.3.self_attn.attn"]}},
                      {{"gid": 3, "layers": ["language_model.model.layers.7.self_attn.attn"]}}]}},
          open(os.path.join(w, "{role}.json"), "w"))
"""


def _run(rm, tmp_path, monkeypatch, scripts):
    monkeypatch.setattr(rm, "child_cmd", lambda role, w, c, t: [sys.executable, "-c", scripts[role], w])
    return {role: rm.run_role(role, str(tmp_path), 2, 3, 60) for role in scripts}


def test_a_crashing_stock_child_still_gives_a_verdict(root, tmp_path, monkeypatch):
    rm = _load(root)
    r = _run(rm, tmp_path, monkeypatch, {"stock": STOCK_CRASH, "fixed": _done("fixed"), "reference": _done("reference")})
    assert not r["stock"]["completed"] and r["stock"]["engine_started"] and r["stock"]["startup_s"] == 12.5
    assert r["stock"]["error"] == "CUDA error: an illegal memory access was encountered"
    assert len(r["stock"]["checks"]) == 1  # the line cut by the dying process is dropped
    v, line = rm.judge(r["stock"], r["fixed"], r["reference"], 2)
    assert v["reproduced"] and v["stock_crashed"] and v["fix_removes_it"]
    # the fake check line records no step kind (as the s15 run's): the crash, with PIECEWISE clean, decides
    assert line.startswith("REPRODUCED: stock: the reusing group's graph buffer held a schedule different from the "
                           "step's at checked call(s) 1 (group id and step kinds not recorded")
    assert "then the engine crashed (CUDA error: an illegal memory access" in line and "not attributed" not in line
    assert "fixed: completed, the schedule copied into the graphs' buffer at all 40 calls, 2/2 requests identical" in line


def test_the_fix_is_not_credited_when_its_check_or_outputs_disagree(root, tmp_path, monkeypatch):
    rm = _load(root)
    other = [dict(OUT[0]), {"tokens": [8, 9, 2], "logprobs": [-0.5, -0.1, -0.9]}]
    r = _run(rm, tmp_path, monkeypatch, {"stock": STOCK_CRASH, "fixed": _done("fixed", stale=1), "reference": _done("reference")})
    assert not rm.judge(r["stock"], r["fixed"], r["reference"], 2)[0]["fix_removes_it"]
    (tmp_path / "b").mkdir()
    r2 = _run(rm, tmp_path / "b", monkeypatch, {"fixed": _done("fixed", out=other), "reference": _done("reference")})
    v, line = rm.judge(r["stock"], r2["fixed"], r2["reference"], 2)
    assert not v["fix_removes_it"] and "1/2 requests identical" in line


def test_no_stale_schedule_and_no_crash_is_not_reproduced(root, tmp_path, monkeypatch):
    rm = _load(root)
    r = _run(rm, tmp_path, monkeypatch, {"stock": _done("stock"), "fixed": _done("fixed")})
    v, line = rm.judge(r["stock"], r["fixed"], None, 2)
    assert not v["reproduced"] and line.startswith("NOT REPRODUCED: stock: no stale schedule seen (40 checked calls)")


def test_coredump_env_and_listing(root, tmp_path, monkeypatch):
    rm = _load(root)
    env = rm.coredump_env(str(tmp_path / "cores"))
    assert env["CUDA_ENABLE_COREDUMP_ON_EXCEPTION"] == "1" and env["CUDA_COREDUMP_FILE"].startswith(str(tmp_path))
    assert rm.coredump_env(None) == {}
    dump = ("import os, sys; d = os.path.dirname(os.environ['CUDA_COREDUMP_FILE']); "
            "open(os.path.join(d, 'core_h_1.nvcudmp'), 'w').write('x'); sys.exit(1)")
    monkeypatch.setattr(rm, "child_cmd", lambda role, w, c, t: [sys.executable, "-c", dump])
    r = rm.run_role("stock", str(tmp_path), 2, 3, 60, coredump_dir=str(tmp_path / "cores"))
    assert [p.rsplit("/", 2)[-2:] for p in r["core_dumps"]] == [["stock", "core_h_1.nvcudmp"]]


def test_a_crash_is_not_this_bug_when_piecewise_crashes_too(root, tmp_path, monkeypatch):
    rm = _load(root)
    def crash(role):
        return (f"import json, os, sys; json.dump({{'startup_s': 9.0}}, open(os.path.join(sys.argv[1], '{role}.started.json'), 'w')); "
                "print('CUDA error: an illegal memory access was encountered'); sys.exit(1)")
    crash_no_checks, ref_crash = crash("stock"), crash("reference")
    r = _run(rm, tmp_path, monkeypatch, {"stock": crash_no_checks, "fixed": _done("fixed"), "reference": ref_crash})
    assert r["stock"]["checks"] == [] and not r["reference"]["completed"]
    v, line = rm.judge(r["stock"], r["fixed"], r["reference"], 2)
    assert not v["reproduced"] and v["reference_crashed"] and "reference: did not complete" in line
    (tmp_path / "b").mkdir()
    r2 = _run(rm, tmp_path / "b", monkeypatch, {"stock": crash_no_checks, "reference": _done("reference")})
    assert rm.judge(r2["stock"], r["fixed"], r2["reference"], 2)[0]["reproduced"]


def test_coredumps_leave_device_memory_out(root, tmp_path):
    # the s15 stock child's dump with memory contents: 45 GB, unfinished after four minutes
    flags = _load(root).coredump_env(str(tmp_path))["CUDA_COREDUMP_GENERATION_FLAGS"].split(",")
    assert {"skip_global_memory", "skip_shared_memory", "skip_local_memory"} <= set(flags)


REPRO2 = ("data", "gpu", "2026-11-30_h200_repro-min-2", "children")


def test_the_faulting_kernel_is_read_from_the_drivers_core_dump_output(root):
    rm = _load(root)
    f = rm.fault_from_log((root.joinpath(*REPRO2) / "stock.log").read_text(errors="replace"))
    assert f["exception"].startswith("CUDBG_EXCEPTION_WARP_ILLEGAL_ADDRESS") and f["dump_progress_pct"] == 90
    assert f["kernel_symbol"].startswith("_ZN7cutlass13device_kernel") and f["kernel"] == "FlashAttnFwdSm90"
    assert f["frame0_pc"] == "0x7fc60d2476e0" and f["exception_pc"] == "0x7fc60d2470d0"
    assert rm._kernel_name("_ZN7cutlass13device_kernelIN5flash") == "_ZN7cutlass13device_kernelIN5flash"  # cut symbol
    # namespaces are qualifiers, not the kernel's name
    assert rm._kernel_name("_ZN4vllm24reshape_and_cache_kernelIfLb1EEEvPKT_") == "reshape_and_cache_kernel"
    assert rm._kernel_name("_ZN3cub11EmptyKernelIvEEvv") == "EmptyKernel"
    assert rm._kernel_name("_ZN12_GLOBAL__N_16myfuncEv") == "myfunc" and rm._kernel_name("_Z9my_kernelPf") == "my_kernel"
    nameless = "[t] coredump: Detected an exception of type E (1)\n"
    assert rm.fault_from_log(nameless)["kernel"] is None
    triton = "[t] coredump: Detected an exception of type E (1)\n[t] coredump:   #0\t0x1\tcopy_and_expand_dflash_inputs_kernel\n"
    assert rm.fault_from_log(triton)["kernel"] == "copy_and_expand_dflash_inputs_kernel"
    assert rm.fault_from_log("no dump here\n") is None


def test_rejudge_gives_the_verdict_a_killed_parent_never_printed(root, tmp_path):
    out = tmp_path / "v.json"
    r = subprocess.run([sys.executable, str(root / "scripts" / "repro_min.py"), "--rejudge", str(root.joinpath(*REPRO2)),
                        "--json", str(out)], capture_output=True, text=True, timeout=120)
    # the s15 run: mismatches at calls of unrecorded kind, a crash without a completed reference: inconclusive (3)
    assert r.returncode == 3, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert line == (root.joinpath(*REPRO2).parent / "verdict.txt").read_text().strip()
    assert line.startswith("INCONCLUSIVE: stock: the reusing group's graph buffer held a schedule different from the "
                           "step's at checked call(s) 1, 2, 3")
    assert ("then the engine crashed (GPU exception CUDBG_EXCEPTION_WARP_ILLEGAL_ADDRESS (14) in FlashAttnFwdSm90 "
            "(from the core-dump log)), not attributed: no completed PIECEWISE reference") in line
    assert "fixed: completed, the schedule copied into the graphs' buffer at all 49 calls, not compared with a reference" in line
    v = json.load(open(out))
    assert v["stock"]["fault"]["exception"].startswith("CUDBG") and not v["reference"]["engine_started"]
    assert v["stock"]["crashed"] and not v["reference"]["crashed"] and not v["verdict"]["fix_removes_it"]
    bad = subprocess.run([sys.executable, str(root / "scripts" / "repro_min.py"), "--rejudge", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no child logs there" in bad.stderr


def _check(call, uniform, mql, gid=3, reqs=4):
    return {"call": call, "gid": gid, "entries_differ": 5, "of": 13, "first_index": 0, "graph_reads": 32,
            "step_has": 48, "num_reqs": reqs, "num_tokens": reqs * mql, "max_query_len": mql, "uniform": uniform}


def test_only_a_mismatch_at_a_step_full_graphs_replay_reproduces(root):
    rm = _load(root)
    groups = [{"gid": 2, "layers": ["language_model.model.layers.3.self_attn.attn"]},
              {"gid": 3, "layers": ["language_model.model.layers.7.self_attn.attn"]}]
    done = {"completed": True, "engine_started": True, "outputs": OUT, "check_counts": {"calls": 9}, "groups": groups}
    ref = {"completed": True, "engine_started": True, "outputs": OUT}
    # the prefill (uneven queries) and a mixed step: attention outside the graphs reads the step's schedule
    other = dict(done, checks=[_check(1, False, 39), _check(2, True, 1)])
    v, line = rm.judge(other, dict(done), ref, 2)
    assert not v["reproduced"] and not v["inconclusive"]
    assert line.startswith("NOT REPRODUCED: stock: group 3 (layer 7)'s graph buffer differed from the step's schedule "
                           "only at 2 step(s) that replay no FULL graph")
    full = dict(done, checks=[_check(1, False, 39), _check(3, True, rm.K + 1)])
    v, line = rm.judge(full, dict(done), ref, 2)
    assert v["reproduced"] and v["fix_removes_it"] and v["stock_stale_at_full_steps"] == 1
    assert line.startswith("REPRODUCED: stock: group 3 (layer 7)'s FULL graphs would replay a stale FA3 schedule at 1 "
                           "uniform-decode step(s) (first at call 3, 4 requests")
    # no reference: the fix is not credited on completion alone unless the run chose --no-reference
    assert not rm.judge(full, dict(done), {"completed": False, "engine_started": False, "error": "x"}, 2)[0]["fix_removes_it"]
    assert rm.judge(full, dict(done), None, 2)[0]["fix_removes_it"]


def test_a_child_killed_with_a_clean_log_is_not_a_crash(root, tmp_path):
    rm = _load(root)
    (tmp_path / "stock.started.json").write_text('{"startup_s": 3.0}')
    (tmp_path / "stock.log").write_text("INFO engine ready\n")
    r = rm.collect_role("stock", str(tmp_path), "timeout")
    assert r["engine_started"] and not r["completed"] and not r["crashed"] and r["error"] == "timeout"
    r = rm.collect_role("stock", str(tmp_path), None)
    assert not r["crashed"] and "killed?" in r["error"]


REPRO3 = ("data", "gpu", "2026-11-30_h200_repro-min-3", "children")

# a child that crashes, finishes its core dump and then hangs (as the s17 stock child did for 57 s)
HANG_AFTER_DUMP = """
import json, os, sys, time
w = sys.argv[1]
json.dump({"startup_s": 1.0}, open(os.path.join(w, "stock.started.json"), "w"))
print("[t] coredump: Starting GPU coredump generation", flush=True)
print("[t] coredump: Detected an exception of type CUDBG_EXCEPTION_WARP_ILLEGAL_ADDRESS (14)", flush=True)
time.sleep(float(os.environ.get("DUMP_S", "0")))
print("[t] coredump: All done (took 01s)", flush=True)
time.sleep(600)
"""


def test_a_crashed_child_that_hangs_is_stopped_after_the_grace(root, tmp_path, monkeypatch):
    rm = _load(root)
    monkeypatch.setattr(rm, "child_cmd", lambda role, w, c, t: [sys.executable, "-c", HANG_AFTER_DUMP, w])
    t0 = __import__("time").time()
    r = rm.run_role("stock", str(tmp_path), 2, 3, 60, grace_s=1.0)
    assert __import__("time").time() - t0 < 20  # not the 60 s timeout
    assert r["stopped_after_crash"] and r["crashed"] and r["returncode"] is None
    assert r["error"] == "GPU exception CUDBG_EXCEPTION_WARP_ILLEGAL_ADDRESS (14) (from the core-dump log)"


def test_a_core_dump_in_progress_is_not_cut(root, tmp_path, monkeypatch):
    rm = _load(root)
    # a dump still being written is not a written crash: the child is left alone until the dump is done
    assert not rm.crash_written("[t] coredump: Starting GPU coredump generation\nCUDA error: an illegal memory access\n")
    assert rm.crash_written("[t] coredump: Starting GPU coredump generation\n[t] coredump: All done (took 05s)\n")
    assert rm.crash_written("(EngineCore pid=1) ERROR CUDA error: an illegal memory access was encountered\n")
    assert not rm.crash_written("WARNING ImportError: optional module missing\nINFO engine ready\n")
    monkeypatch.setenv("DUMP_S", "3")
    monkeypatch.setattr(rm, "child_cmd", lambda role, w, c, t: [sys.executable, "-c", HANG_AFTER_DUMP, w])
    r = rm.run_role("stock", str(tmp_path), 2, 3, 60, grace_s=0.5)
    assert r["stopped_after_crash"] and r["wall_s"] >= 3  # waited for the dump, then the grace
    assert "All done" in (tmp_path / "stock.log").read_text()
    # a child still writing its dump at the per-engine timeout says so
    (tmp_path / "b").mkdir()
    monkeypatch.setenv("DUMP_S", "30")
    r = rm.run_role("stock", str(tmp_path / "b"), 2, 3, 2, grace_s=0.5)
    assert r["error"].endswith("then timed out writing the core dump")


def test_the_s17_run_is_reproduced_but_not_attributed(root, tmp_path):
    out = tmp_path / "v.json"
    r = subprocess.run([sys.executable, str(root / "scripts" / "repro_min.py"), "--rejudge", str(root.joinpath(*REPRO3)),
                        "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr   # incomplete: the reference never started
    line = r.stdout.strip().splitlines()[-1]
    assert line == (root.joinpath(*REPRO3).parent / "verdict.txt").read_text().strip()
    # call 3: 4 requests x (K + 1) tokens, a step FULL graphs replay
    assert line.startswith("REPRODUCED: stock: group 7 (layer 7)'s FULL graphs would replay a stale FA3 schedule at 1 "
                           "uniform-decode step(s) (first at call 3, 4 requests: 9 of 13 entries differ)")
    assert "not attributed: no completed PIECEWISE reference" in line


def test_the_deadline_leaves_engines_unrun_and_still_gives_a_verdict(root, tmp_path, monkeypatch):
    rm = _load(root)
    calls = []

    def fake_run_role(role, w, c, t, timeout_s, coredump_dir=None):
        calls.append((role, timeout_s))
        __import__("time").sleep(0.3)
        return {"role": role, "completed": True, "engine_started": True, "outputs": OUT, "checks": [],
                "check_counts": {"calls": 5}, "error": None, "wall_s": 0.3}

    monkeypatch.setattr(rm, "run_role", fake_run_role)
    monkeypatch.setattr(rm, "write_models", lambda d, configs=None: None)
    monkeypatch.setattr(rm, "MIN_ENGINE_S", 0.5)
    monkeypatch.setattr(rm, "RESERVE_S", 0.0)
    import importlib.metadata as md
    monkeypatch.setattr(md, "version", lambda name: "0.22.1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(__import__("tempfile"), "tempdir", str(tmp_path))  # tempfile caches its folder
    out = tmp_path / "v.json"
    rc = rm.main(["--deadline-s", "1.0", "--json", str(out)])
    v = json.load(open(out))
    # stock ran (0.3 s), the reference ran with what was left, the fixed engine did not start
    assert [c[0] for c in calls] == ["stock", "reference"] and calls[1][1] < 0.8
    assert v["fixed"]["not_run"].startswith("0 s of --deadline-s 1 left") and rc == 3
    assert "fixed: did not complete (not run: " in v["verdict_line"]
    assert rm.main(["--deadline-s", "0"]) == 2


def test_recorded_reproducer_runs_are_listed_by_session(tmp_path):
    from dflash_lab import findings

    def run(name, session, verdict=None, meta_text=None):
        d = tmp_path / "data" / "gpu" / name
        d.mkdir(parents=True)
        (d / "meta.json").write_text(meta_text if meta_text is not None else json.dumps(
            {"gpu_session": session, "verdict_by": "scripts/repro_min.py --rejudge"}))
        if verdict:
            (d / "verdict.txt").write_text(verdict + "\n")

    run("x_repro-min-b", "2026-11-30-s10", "REPRODUCED: stock: ...")
    run("x_repro-min-a", "2026-11-30-s9", "INCONCLUSIVE: stock: ...")
    run("x_repro-min-first", "2026-11-30-s8")                       # no verdict recorded
    run("x_repro-min-c", None, "NOT REPRODUCED: x", meta_text="{corrupt")  # unreadable meta: listed, no session
    t = findings.repro_min_runs(tmp_path)
    assert list(t["gpu_session"].fillna("-")) == ["-", "2026-11-30-s8", "2026-11-30-s9", "2026-11-30-s10"]
    assert list(t["verdict"].fillna("-")) == ["NOT REPRODUCED", "-", "INCONCLUSIVE", "REPRODUCED"]
    assert t["judged"].iloc[-1].startswith("on the CPU")
    # a run judged some other way says so in its meta.json, and that is what is shown
    run("x_repro-min-d", "2026-11-30-s11", "REPRODUCED: y",
        meta_text=json.dumps({"gpu_session": "2026-11-30-s11", "verdict_by": "--rejudge", "judged": "on the GPU host"}))
    assert findings.repro_min_runs(tmp_path)["judged"].iloc[-1] == "on the GPU host"
    # the latest session's verdict (s10 sorts after s9: natural order)
    assert "data/gpu/x_repro-min-d (session 2026-11-30-s11), on the GPU host: REPRODUCED: y" in findings._repro_min_label(tmp_path)
    empty = tmp_path / "e"
    empty.mkdir()
    assert "no GPU verdict recorded yet" in findings._repro_min_label(empty)
    # each engine's start-up as its child recorded it; an engine that never finished starting, or a corrupt file, has none
    ch = tmp_path / "data" / "gpu" / "x_repro-min-d" / "children"
    ch.mkdir()
    (ch / "stock.started.json").write_text(json.dumps({"startup_s": 147.9}))
    (ch / "fixed.started.json").write_text(json.dumps({"startup_s": 37.8}))
    (ch / "reference.started.json").write_text("{cut")
    t = findings.repro_min_runs(tmp_path)
    assert t["start-up s"].iloc[-1] == "stock 147.9, fixed 37.8" and t["start-up s"].iloc[:-1].isna().all()
    # under the 2 minutes, and whether the engine's own log says its graphs came from the cache
    (ch / "fixed.log").write_text("INFO [backends.py:292] Directly load the compiled graph(s) for compile range\n")
    (ch / "stock.log").write_text("INFO [backends.py:393] Compiling a graph for compile range (1, 4096)\n")
    s, all_under = findings.repro_min_startups(tmp_path)
    assert s[["role", "startup_s", "under limit", "graphs from cache"]].values.tolist() == [
        ["stock", 147.9, False, False], ["fixed", 37.8, True, True]] and all_under == []
    (ch / "stock.started.json").write_text(json.dumps({"startup_s": "slow"}))   # not a number: no start-up
    (ch / "reference.started.json").write_text(json.dumps({"startup_s": 50}))
    assert findings.repro_min_startups(tmp_path)[0]["role"].tolist() == ["reference", "fixed"]
    (ch / "stock.started.json").write_text(json.dumps({"startup_s": 99.0}))
    assert findings.repro_min_startups(tmp_path)[1] == ["data/gpu/x_repro-min-d"]
    # autotuning passes are counted only where the device command printed them (else zero would mean nothing)
    assert findings.repro_min_startups(tmp_path)[0]["autotuning passes"].isna().all()
    meta = tmp_path / "data" / "gpu" / "x_repro-min-d" / "meta.json"
    m = json.loads(meta.read_text())
    meta.write_text(json.dumps({**m, "device_command": "call 1: export TRITON_PRINT_AUTOTUNING=1; python3 ..."}))
    (ch / "stock.log").write_text("Triton autotuning for function chunk_fwd_kernel_o finished after 9.1s\n" * 6)
    # and the worker's Triton cache: inside vLLM's compile cache (a compiling engine), unset (Triton's default), or
    # not recorded (runs before s24, a corrupt file)
    caches = lambda p: {"TRITON_CACHE_DIR": {"path": p, "autotune_files": 6}}
    (ch / "stock.started.json").write_text(json.dumps({"startup_s": 99.0, "caches": caches(
        "/root/.cache/vllm/torch_compile_cache/torch_aot_compile/99/inductor_cache/triton/0")}))
    (ch / "fixed.started.json").write_text(json.dumps({"startup_s": 37.8, "caches": caches(None)}))
    s = findings.repro_min_startups(tmp_path)[0].set_index("role")
    assert s.loc["stock", "autotuning passes"] == 6 and s.loc["fixed", "autotuning passes"] == 0
    assert [s.loc[r, "Triton cache"] for r in ("stock", "fixed")] == ["compile cache", "~/.triton/cache"]
    assert s["Triton cache"].isna()["reference"]
    (ch / "fixed.started.json").write_text(json.dumps({"startup_s": 37.8, "caches": {"TRITON_CACHE_DIR": "odd"}}))
    assert findings.repro_min_startups(tmp_path)[0].set_index("role")["Triton cache"].isna()["fixed"]  # unreadable: unknown


def test_a_stock_engine_that_does_not_start_stops_the_run(root, tmp_path, monkeypatch):
    rm = _load(root)
    calls = []

    def fake_run_role(role, w, c, t, timeout_s, coredump_dir=None):
        calls.append(role)
        return {"role": role, "completed": False, "engine_started": False, "checks": [], "crashed": False,
                "error": "ValueError: bad config", "wall_s": 1.0}

    monkeypatch.setattr(rm, "run_role", fake_run_role)
    monkeypatch.setattr(rm, "write_models", lambda d, configs=None: None)
    import importlib.metadata as md
    monkeypatch.setattr(md, "version", lambda name: "0.22.1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(__import__("tempfile"), "tempdir", str(tmp_path))  # tempfile caches its folder
    out = tmp_path / "v.json"
    assert rm.main(["--json", str(out)]) == 2 and calls == ["stock"]
    v = json.load(open(out))
    assert v["reference"]["not_run"] == v["fixed"]["not_run"] == "the stock engine did not start"
    assert "the engine did not start (ValueError: bad config)" in v["verdict_line"]


def test_a_signal_to_the_parent_stops_the_running_engine(root, tmp_path):
    # the host command's `timeout` signals the parent only; the engine runs in its own session
    pidfile = tmp_path / "child.pid"
    driver = f"""
import importlib.util, signal, sys
spec = importlib.util.spec_from_file_location("repro_min", {str(root / "scripts" / "repro_min.py")!r})
rm = importlib.util.module_from_spec(spec); spec.loader.exec_module(rm)
rm.child_cmd = lambda role, w, c, t: [sys.executable, "-c",
    "import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(600)"]
signal.signal(signal.SIGTERM, rm._on_signal)
rm.run_role("stock", {str(tmp_path)!r}, 2, 3, 600)
"""
    import os
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-c", driver], stderr=subprocess.PIPE, text=True)
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.05)
    child = int(pidfile.read_text())
    p.send_signal(signal.SIGTERM)
    err = p.communicate(timeout=30)[1]
    assert p.returncode == 128 + signal.SIGTERM and "stopped by signal" in err
    time.sleep(0.2)
    try:
        os.kill(child, 0)
        alive = open(f"/proc/{child}/stat").read().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        alive = False
    assert not alive


REPRO4 = ("data", "gpu", "2026-11-30_h200_repro-min-4", "children")


def _fake_engines(rm, rec, calls):
    """run_role stood in for by the files a real child wrote on the GPU (copied from ``rec``)."""
    import shutil

    def fake_run_role(role, workdir, c, t, timeout_s, coredump_dir=None):
        calls.append((role, c, t))
        for f in rec.glob(f"{role}.*"):
            shutil.copy(f, workdir)
        return rm.collect_role(role, workdir, 0, 131.0, coredump_dir)

    return fake_run_role


def _vllm_0221(monkeypatch):
    import importlib.metadata as md
    monkeypatch.setattr(md, "version", lambda name: "0.22.1")


def test_resume_runs_only_what_the_earlier_run_left_out(root, tmp_path, monkeypatch):
    """s18: the parent's --deadline-s left the fixed engine out (stock crashed, the reference completed). --resume
    on that folder runs the fixed engine alone and judges all three: here the fixed child is stood in for by the
    files the real one wrote on the GPU, and the verdict is the recorded one."""
    import shutil

    rm = _load(root)
    rec = root.joinpath(*REPRO4)
    w = tmp_path / "w"
    shutil.copytree(rec, w)
    for f in w.glob("fixed.*"):
        f.unlink()
    cores = tmp_path / "cores" / "stock"
    cores.mkdir(parents=True)
    (cores / "core_vm_2104.nvcudmp").write_text("")
    run = json.loads((w / "run.json").read_text())
    (w / "run.json").write_text(json.dumps({**run, "coredump_dir": str(tmp_path / "cores")}))
    calls = []
    monkeypatch.setattr(rm, "run_role", _fake_engines(rm, rec, calls))
    _vllm_0221(monkeypatch)
    out = tmp_path / "v.json"
    # the earlier run's prompts and core-dump folder win over this command's arguments
    rc = rm.main(["--resume", str(w), "--deadline-s", "400", "--json", str(out), "--concurrency", "7", "--tokens", "9"])
    assert calls == [("fixed", 4, 48)]
    v = json.load(open(out))
    assert rc == 0 and v["verdict"]["reproduced"] and v["verdict"]["fix_removes_it"]
    assert v["verdict_line"] == (rec.parent / "verdict.txt").read_text().strip()
    assert v["started_at"] == "2026-11-30T15:03:16Z" and v["workdir"] == str(w)   # the earlier run's start is kept
    # the engines that stood: exit code unknown (None), their core dumps found where the earlier run put them
    assert v["stock"]["returncode"] is None and v["reference"]["returncode"] is None
    assert v["stock"]["core_dumps"] == [str(cores / "core_vm_2104.nvcudmp")]
    assert len(json.loads((w / "run.json").read_text())["resumed"]) == 1
    # a second resume has nothing left to run
    calls.clear()
    assert rm.main(["--resume", str(w)]) == 0 and calls == []
    assert len(json.loads((w / "run.json").read_text())["resumed"]) == 2


def test_resume_runs_again_an_engine_stopped_from_outside(root, tmp_path, monkeypatch):
    """s17: the host command's time limit killed the PIECEWISE reference before it generated (a clean log, no
    result). --resume runs it again, with its old files set aside, and keeps stock's crash and fixed's completion."""
    import shutil

    rm = _load(root)
    w = tmp_path / "w"
    shutil.copytree(root.joinpath(*REPRO3), w)
    calls = []
    monkeypatch.setattr(rm, "run_role", _fake_engines(rm, root.joinpath(*REPRO4), calls))
    _vllm_0221(monkeypatch)
    # too little time left for an engine: the reference is recorded as not run, and the run stays incomplete
    monkeypatch.setattr(rm, "MIN_ENGINE_S", 1000)
    assert rm.main(["--resume", str(w), "--deadline-s", "100"]) == 3 and calls == []
    assert (w / "reference.log").exists() and not list(w.glob("*.before-resume-*"))   # not run: nothing moved
    monkeypatch.setattr(rm, "MIN_ENGINE_S", 150)
    out = tmp_path / "v.json"
    rc = rm.main(["--resume", str(w), "--json", str(out)])
    assert calls == [("reference", 4, 48)]
    old = w / "reference.before-resume-1" / "reference.log"
    assert old.read_text() == root.joinpath(*REPRO3, "reference.log").read_text()
    v = json.load(open(out))
    assert v["reference"]["completed"] and v["stock"]["crashed"] and v["fixed"]["completed"]
    assert "not attributed" not in v["verdict_line"] and "reference: completed" in v["verdict_line"]
    assert rc == 0


def test_resume_needs_an_earlier_runs_folder(root, tmp_path, monkeypatch, capsys):
    rm = _load(root)
    _vllm_0221(monkeypatch)
    assert rm.main(["--resume", str(tmp_path / "nope")]) == 2
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / "run.json").write_text("{corrupt")
    assert rm.main(["--resume", str(tmp_path)]) == 2
    assert "no readable run.json" in capsys.readouterr().err
    assert rm.main(["--resume", str(tmp_path), "--rejudge", str(tmp_path)]) == 2


def test_the_models_folder_is_the_same_on_every_run_and_the_children_load_it(root, tmp_path, monkeypatch, capsys):
    """s23: vLLM keys its compile cache by the model path, so the configs live in one folder per config content,
    not in each run's temporary work folder; run.json keeps them, so a work folder stays usable without that folder."""
    import shutil

    rm = _load(root)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    d = rm.default_models_dir()
    assert d == rm.default_models_dir() and d.startswith(str(tmp_path / "cache" / "repro-min" / "models-"))
    monkeypatch.setitem(rm.TARGET_TEXT, "num_hidden_layers", 12)
    assert rm.default_models_dir() != d          # other configs, another folder: never a stale config
    monkeypatch.setitem(rm.TARGET_TEXT, "num_hidden_layers", 8)
    calls = []

    def fake_run_role(role, w, c, t, timeout_s, coredump_dir=None):
        calls.append(rm.models_of(w))
        return {"role": role, "completed": True, "engine_started": True, "outputs": OUT, "checks": [],
                "check_counts": {"calls": 5}, "error": None, "wall_s": 0.1}

    monkeypatch.setattr(rm, "run_role", fake_run_role)
    _vllm_0221(monkeypatch)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(__import__("tempfile"), "tempdir", str(work))
    rm.main(["--no-reference", "--json", str(tmp_path / "a.json")])
    rm.main(["--no-reference", "--json", str(tmp_path / "b.json")])
    a, b = (json.load(open(tmp_path / f)) for f in ("a.json", "b.json"))
    assert a["workdir"] != b["workdir"] and a["models_dir"] == b["models_dir"] == d
    assert calls == [(f"{d}/target", f"{d}/draft")] * 4   # stock and fixed of both runs load the one folder
    assert json.load(open(f"{d}/target/config.json"))["text_config"]["num_hidden_layers"] == 8
    # run.json keeps the configs: with the folder gone (another host, a cleared cache) a child writes them again
    shutil.rmtree(d)
    assert rm.models_of(a["workdir"]) == (f"{d}/target", f"{d}/draft")
    assert json.load(open(f"{d}/draft/config.json")) == rm.model_configs()[1]
    # a folder holding other configs is refused, not used
    cfg = json.load(open(f"{d}/target/config.json"))
    cfg["text_config"]["num_hidden_layers"] = 9
    json.dump(cfg, open(f"{d}/target/config.json", "w"))
    with pytest.raises(SystemExit, match="holds other configs"):
        rm.models_of(a["workdir"])
    # a work folder of the runs before s23 (configs inside it, no models_dir in run.json) still resolves
    old = root.joinpath(*REPRO4)
    assert rm.models_of(str(old)) == (str(old / "target"), str(old / "draft"))
    with pytest.raises(SystemExit, match="no readable run.json"):
        rm.models_of(str(tmp_path / "cache"))
    # --models-dir wins; an unwritable one is one clear error, and no empty work folder is left behind
    rm.main(["--no-reference", "--models-dir", str(tmp_path / "m"), "--json", str(tmp_path / "c.json")])
    assert json.load(open(tmp_path / "c.json"))["models_dir"] == str(tmp_path / "m")
    (tmp_path / "file").write_text("")
    before = sorted(p.name for p in work.iterdir())
    capsys.readouterr()
    assert rm.main(["--models-dir", str(tmp_path / "file" / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("repro_min: cannot write the model configs under")
    assert sorted(p.name for p in work.iterdir()) == before


def test_vllm_keys_its_compile_cache_by_the_model_path():
    """The premise of the fixed models folder, on vLLM 0.22.1's own source: the compile-cache folder's hash takes
    vllm_config.compute_hash(), which takes model_config.compute_hash(), which does not ignore ``model``; the AOT
    compile cache (the path the s23 logs show) hashes vllm_config.compute_hash() too."""
    import ast

    from dflash_lab.vllm_sources import read_source

    tree = ast.parse(read_source("vllm/config/model.py"))
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ModelConfig")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "compute_hash")
    ignored = next(ast.literal_eval(n.value) for n in ast.walk(fn)
                   if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "ignored_factors")
    assert "model" in fields and "model" not in ignored and "seed" in ignored
    assert "vllm_factors.append(self.model_config.compute_hash())" in read_source("vllm/config/vllm.py")
    backends = read_source("vllm/compilation/backends.py")
    assert "config_hash = vllm_config.compute_hash()" in backends
    assert "factors = [env_hash, config_hash, code_hash, compiler_hash]" in backends
    caching = read_source("vllm/compilation/caching.py")
    assert "config_hash = vllm_config.compute_hash()" in caching and "factors.append(config_hash)" in caching


def test_each_engine_records_where_its_autotuning_cache_is(root, tmp_path, monkeypatch):
    """The open question of s23 (why a first cache-loading engine autotuned again) gets data: the worker's
    Triton/Inductor cache folders and how many autotuning results each holds."""
    rm = _load(root)
    trit, ind, home = tmp_path / "t", tmp_path / "i", tmp_path / "home"
    (trit / "ab").mkdir(parents=True)
    (trit / "ab" / "chunk_fwd_kernel_o.autotune.json").write_text("{}")
    (trit / "ab" / "kernel.cubin").write_text("")
    (home / ".triton" / "cache" / "cd").mkdir(parents=True)
    for n in ("a", "b"):
        (home / ".triton" / "cache" / "cd" / f"{n}.autotune.json").write_text("{}")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(trit))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(ind))       # set but not there: no count, not an error
    monkeypatch.setenv("HOME", str(home))
    got = rm._cache_dirs(None)
    assert got["TRITON_CACHE_DIR"] == {"path": str(trit), "autotune_files": 1}
    assert got["TORCHINDUCTOR_CACHE_DIR"] == {"path": str(ind), "autotune_files": None}
    assert got["default_triton"] == {"path": str(home / ".triton" / "cache"), "autotune_files": 2}
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert rm._cache_dirs(None)["TRITON_CACHE_DIR"] == {"path": None, "autotune_files": None}
