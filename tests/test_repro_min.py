"""scripts/repro_min.py on the CPU: its model configs set up the bug's precondition (vLLM's own grouping)."""

import json
import subprocess
import sys

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
    assert line.startswith("REPRODUCED: stock: group 3 (layer 7)'s FULL graphs read a stale FA3 schedule (first at call 1")
    assert "then the engine crashed (CUDA error: an illegal memory access" in line
    assert "fixed: schedule current at all 40 checked calls, completed, 2/2 requests identical" in line


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
    assert rm._kernel_name("_ZN7cutlass13device_kernelIN5flash") == "_ZN7cutlass13device_kernelIN5flash"  # cut symbol
    triton = "[t] coredump: Detected an exception of type E (1)\n[t] coredump:   #0\t0x1\tcopy_and_expand_dflash_inputs_kernel\n"
    assert rm.fault_from_log(triton)["kernel"] == "copy_and_expand_dflash_inputs_kernel"
    assert rm.fault_from_log("no dump here\n") is None


def test_rejudge_gives_the_verdict_a_killed_parent_never_printed(root, tmp_path):
    out = tmp_path / "v.json"
    r = subprocess.run([sys.executable, str(root / "scripts" / "repro_min.py"), "--rejudge", str(root.joinpath(*REPRO2)),
                        "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert line == (root.joinpath(*REPRO2).parent / "verdict.txt").read_text().strip()
    assert line.startswith("REPRODUCED: stock: group 7 (layer 7)'s FULL graphs read a stale FA3 schedule (first at call 1")
    assert "then the engine crashed (GPU exception CUDBG_EXCEPTION_WARP_ILLEGAL_ADDRESS (14) in FlashAttnFwdSm90 (from the core-dump log)" in line
    assert "fixed: schedule current at all 49 checked calls, completed" in line
    v = json.load(open(out))
    assert v["stock"]["fault"]["exception"].startswith("CUDBG") and not v["reference"]["engine_started"]
    bad = subprocess.run([sys.executable, str(root / "scripts" / "repro_min.py"), "--rejudge", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no child logs there" in bad.stderr
