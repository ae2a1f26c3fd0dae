"""Command line: ``python -m dflash_lab <command> ...``.

Commands:
  replay RECORD.npz [...] [--kernel stock|patched] [--out OUT.npz] [--json] [--device cpu|cuda]
      exit 0: no violation; 3: at least one violation; 2: bad input
  run MATRIX.yaml --out data/runs/NAME.jsonl [--deadline-s S] [--skip-done RUNS.jsonl ...]  (GPU host)
  capture [--max-num-seqs N] [--k K] [--max-num-batched-tokens T] [--cudagraph-mode M]
  record-capture-sizes --out data/capture/NAME.json                 (GPU host, vLLM's own config code)
  ingest FOLDER NAME [--matrix M] [--device-command C]                 (GPU output -> data/)
  amend NAME                                                           (recorded lines corrected, by rule)
  make-records DIR                                                  (standard synthetic launches)
  models TARGET DIR                                                 (write config + tokenizer)
  upstream-check [VERSION ...] --out data/upstream/releases.jsonl [--wheel-dir DIR]
      (later vLLM releases' own sources: is the crash's precondition still there? default: every release after 0.22.1)
  sigstages --out FILE.jsonl [--coredump-dir DIR] [--watch-s S] [--fresh-triton-cache]
      (GPU host: whose handler answers SIGUSR1, stage by stage)
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import LabError


def _replay(a) -> int:
    from .records import OUTPUTS, load_record, save_npz_atomic
    from .replay import KERNELS, replay

    if a.kernel not in KERNELS:
        raise LabError(f"unknown kernel {a.kernel!r}: choose one of {', '.join(KERNELS)}")
    if a.out and len(a.record) > 1:
        raise LabError("--out takes one record at a time")
    records = [load_record(r) for r in a.record]  # every input is checked before anything runs
    rc = 0
    for path, rec in zip(a.record, records):
        res = replay(rec, kernel=a.kernel, device=a.device)
        if a.out:
            save_npz_atomic(a.out, {p: res.outputs[p] for p in OUTPUTS if p in res.outputs})
        if a.json:
            print(json.dumps(res.as_json()), flush=True)
        else:
            print(f"{a.kernel} kernel on {path} ({a.device}): "
                  + ("no out-of-bounds access" if res.ok else f"{len(res.violations)} violation(s)"))
            for v in res.violations:
                print(f"  {v.op} of {v.param} at line {v.line}: offset {v.offset_min}"
                      + (f"..{v.offset_max}" if v.offset_max != v.offset_min else "")
                      + f" outside [0, {v.extent}) in program {tuple(v.program_id)} ({v.lanes} lane(s))")
            for p, n in res.guard_writes.items():
                print(f"  {n} write(s) landed in the guard cells around {p}")
        rc = rc if res.ok else 3
    return rc


def _run(a) -> int:
    from .runner import Runner, load_matrix

    m = load_matrix(a.matrix)
    r = Runner(m, a.out, deadline_s=a.deadline_s, log=lambda s: print(s, flush=True), logdir=a.logs)
    if a.skip_done:
        r.skip_done(a.skip_done)
    return r.run()


def _capture(a) -> int:
    from .capture import Knobs, summary

    kn = Knobs(max_num_seqs=a.max_num_seqs, num_speculative_tokens=a.k,
               max_num_batched_tokens=a.max_num_batched_tokens, cudagraph_mode=a.cudagraph_mode)
    print(json.dumps(summary(kn), indent=1))
    return 0


def _record_capture(a) -> int:
    from .vllm_probe import record_capture_sizes

    record_capture_sizes(a.out)
    return 0


def _make_records(a) -> int:
    import os

    from .records import save_record
    from .scenarios import make_record, standard_scenarios

    for sc in standard_scenarios():
        rec = make_record(sc.step)
        rec.meta.update(scenario=sc.name, why=sc.why)
        path = os.path.join(a.dir, f"{sc.name}.npz")
        save_record(path, rec)
        print(path)
    return 0


def _ingest(a) -> int:
    from .ingest import ingest

    meta = ingest(a.folder, a.name, data_dir=a.data, matrix=a.matrix, device_command=a.device_command,
                  gpu_session=a.gpu_session, kind=a.kind, relabel_session=a.relabel_session)
    print(json.dumps({k: meta[k] for k in ("name", "lines", "outcomes")}))
    return 0


def _ingest_repro(a) -> int:
    from .ingest import ingest_repro

    if len(a.call) != len(a.command):
        raise LabError(f"ingest-repro: {len(a.call)} --call but {len(a.command)} --command (one command per call)")
    prov = {}
    for kv in a.provenance or []:
        if "=" not in kv:
            raise LabError(f"--provenance {kv!r}: expected KEY=VALUE")
        k, v = kv.split("=", 1)
        prov[k] = v
    meta = ingest_repro(list(zip(a.call, a.command)), a.name, data_dir=a.data, gpu_session=a.gpu_session,
                        git_commit=a.git_commit, provenance=prov, what_happened=a.what_happened)
    print(json.dumps({k: meta[k] for k in ("name", "startup_s", "judged")}))
    return 0


def _amend(a) -> int:
    from .amend import amend

    print(json.dumps(amend(a.name, data_dir=a.data)))
    return 0


def _models(a) -> int:
    from .models import build

    print(json.dumps(build(a.target, a.dir)))
    return 0


def _sigstages(a) -> int:
    from . import sigstages

    lines = sigstages.run(a.out, coredump_dir=a.coredump_dir, watch_s=a.watch_s,
                          fresh_triton_cache=a.fresh_triton_cache)
    for r in sigstages.summary(lines):
        print(f"{r['stage']}: {r['outcome']}; SIGUSR1 handler {r['SIGUSR1 handler'] or '-'}"
              + (" (REPLACED since faulthandler registered)" if r["replaced"] else "")
              + (f" [watcher: {r['set back by the watcher']}]" if r["set back by the watcher"] else ""))
    return 0


def _plan(a) -> int:
    import pandas as pd

    from . import bench, plan

    runs = bench.load_bench(a.bench)
    for m in a.matrix:
        est = plan.estimate(m, runs, budget_s=a.budget_s, staging_s=a.staging_s)
        print(plan.summary_line(est, m))
        print(pd.DataFrame(est["engines"]).to_string(index=False))
    return 0


def _upstream_check(a) -> int:
    import shlex
    from pathlib import Path

    from . import upstream

    index = upstream.fetch_index()
    versions = a.versions or upstream.releases_after(index)
    if not versions:
        raise LabError("PyPI's index lists no vLLM release after 0.22.1")
    cmd = "python -m dflash_lab upstream-check " + shlex.join([*a.versions, "--out", a.out]
                                                               + (["--wheel-dir", a.wheel_dir] if a.wheel_dir else []))
    lines = upstream.check_releases(versions, Path(a.out), cmd, index=index,
                                    wheel_dir=Path(a.wheel_dir) if a.wheel_dir else None)
    for r in lines:
        print(f"vLLM {r['version']}: {r['verdict']}")
    print(f"wrote {len(lines)} line(s) to {a.out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_lab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("replay", help="replay a launch record through the instrumented kernel")
    p.add_argument("record", nargs="+")
    p.add_argument("--kernel", default="stock")
    p.add_argument("--out")
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.set_defaults(fn=_replay)
    p = sub.add_parser("run", help="run an experiment matrix on the GPU host")
    p.add_argument("matrix")
    p.add_argument("--out", required=True)
    p.add_argument("--deadline-s", type=float, default=None)
    p.add_argument("--logs", default=None, help="folder for engine logs and hook output (default OUT.logs)")
    p.add_argument("--skip-done", nargs="+", metavar="RUNS.jsonl",
                   help="runs.jsonl of earlier calls of this matrix: their measured runs are not run again")
    p.set_defaults(fn=_run)
    p = sub.add_parser("capture", help="capture sizes and DFlash drafter padding for one config")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--k", type=int, default=15)
    p.add_argument("--max-num-batched-tokens", type=int, default=32768)
    p.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE")
    p.set_defaults(fn=_capture)
    p = sub.add_parser("record-capture-sizes", help="(GPU host) record vLLM's own capture sizes")
    p.add_argument("--out", required=True)
    p.set_defaults(fn=_record_capture)
    p = sub.add_parser("make-records", help="write the standard synthetic launch records")
    p.add_argument("dir")
    p.set_defaults(fn=_make_records)
    p = sub.add_parser("ingest", help="bring a GPU session step's output into data/")
    p.add_argument("folder")
    p.add_argument("name")
    p.add_argument("--data", default="data")
    p.add_argument("--matrix")
    p.add_argument("--device-command")
    p.add_argument("--gpu-session", help="label of the GPU session (one lease) the lines came from")
    p.add_argument("--relabel-session", help="the lines carry another label than the project's DATE-sN: give them "
                                             "this one (each keeps the old as gpu_session_as_run)")
    p.add_argument("--kind", choices=("runs", "bench", "release"), default="runs",
                   help="bench: server-mode benchmark lines, into data/bench/; release: lines of engines that ran a "
                        "later vLLM release (vllm_release), into data/upstream/runs/")
    p.set_defaults(fn=_ingest)
    p = sub.add_parser("ingest-repro", help="bring one GPU run of scripts/repro_min.py (one or more calls) into data/gpu/")
    p.add_argument("name")
    p.add_argument("--call", action="append", required=True, help="a call's output folder, in order")
    p.add_argument("--command", action="append", required=True, help="that call's device command, in the same order")
    p.add_argument("--data", default="data")
    p.add_argument("--gpu-session", required=True)
    p.add_argument("--git-commit", help="the checkout's commit on the host")
    p.add_argument("--provenance", action="append", help="KEY=VALUE not in the files (e.g. driver=580.159.04)")
    p.add_argument("--what-happened", help="what the calls did, in words, for the record")
    p.set_defaults(fn=_ingest_repro)
    p = sub.add_parser("amend", help="correct recorded run lines from their recorded logs (rules in dflash_lab/amend.py)")
    p.add_argument("name", help="data/runs/NAME.jsonl")
    p.add_argument("--data", default="data")
    p.set_defaults(fn=_amend)
    p = sub.add_parser("plan", help="estimate a bench matrix's device time from the recorded bench lines")
    p.add_argument("matrix", nargs="+")
    p.add_argument("--bench", default="data/bench/*.jsonl", help="recorded bench lines to estimate from")
    p.add_argument("--budget-s", type=float, default=1800.0, help="a session's device time")
    p.add_argument("--staging-s", type=float, default=90.0, help="device time the vLLM staging calls take")
    p.set_defaults(fn=_plan)
    p = sub.add_parser("models", help="write a target/draft config folder")
    p.add_argument("target")
    p.add_argument("dir")
    p.set_defaults(fn=_models)
    p = sub.add_parser("sigstages", help="(GPU host) whose handler answers SIGUSR1 after each engine start-up stage")
    p.add_argument("--out", required=True, help="JSON lines, one per stage (must not exist)")
    p.add_argument("--coredump-dir", help="take the hang matrices' core-dump environment, dumps to this folder")
    p.add_argument("--watch-s", type=float, help="register with the watcher that sets faulthandler's handler back "
                   "(as the plugin does since s55), checking every S seconds; default: no watcher (through s54)")
    p.add_argument("--fresh-triton-cache", action="store_true",
                   help="an empty TRITON_CACHE_DIR, so the Triton stage compiles (a cached kernel replaced nothing)")
    p.set_defaults(fn=_sigstages)

    p = sub.add_parser("upstream-check", help="later vLLM releases' own sources: is the crash's precondition there?")
    p.add_argument("versions", nargs="*", help="releases to check (default: every release after 0.22.1)")
    p.add_argument("--out", required=True, help="JSON lines, one per release (replaced only once all succeeded)")
    p.add_argument("--wheel-dir", help="a folder of already downloaded wheels (still sha256-checked)")
    p.set_defaults(fn=_upstream_check)

    try:
        a = ap.parse_args(argv)
    except SystemExit as e:  # argparse already printed one usage line
        return 2 if e.code else 0
    try:
        return a.fn(a)
    except LabError as e:
        print(f"dflash-lab: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
