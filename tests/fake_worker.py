"""A stand-in for dflash_lab.worker in the runner's tests: no GPU, no vLLM.

Behaviour per run id comes from the FAKE_PLAN environment variable (JSON: run id ->
"ok" | "crash" | "hang" | "fail" | "coredump" | "coredump-tp2" | "coredump-server"), FAKE_STARTUP ("ok" | "error" |
"hang"), FAKE_RUN_S (seconds each run takes; 0).
As the dflash_lab plugin does in every process vLLM starts, it registers its stacks file for a hang snapshot (only that
part of the plugin: the rest would import vllm; tests/test_hang.py runs the plugin itself).
With ``CUDA_ENABLE_USER_TRIGGERED_COREDUMP`` set it stands in for the driver's listener: a thread creates the pipe
``$CUDA_COREDUMP_PIPE`` names and, when something is written to it, writes a core file as a dump would.
"coredump" crashes like a CUDA fault whose core file (at ``$CUDA_COREDUMP_FILE``) is written
by a child process for a few seconds after this process has died, as the driver does; "coredump-tp2" has two
such children print as vLLM's TP workers do and write one core each. "coredump-server" is a server whose engine
dumps a core while the clients are still being answered: the run's run_end (with what the clients saw) comes
after the core file has appeared.
"""

import json
import os
import sys
import time

from dflash_lab.worker import Events, _vllm_version


def _core_path(pid: int) -> str:
    return os.environ["CUDA_COREDUMP_FILE"].replace("%p", str(pid))


def _write_core(core: str, chunks: int, tag: str = "") -> None:
    """Write a core slowly (one chunk a second, "END" last: only then is it complete), then exit this child."""
    with open(core, "w") as f:
        for _ in range(chunks):
            f.write(tag + "x" * 1000)
            f.flush()
            time.sleep(1)
        f.write("END")
    os._exit(0)


def _fake_driver_pipe() -> None:
    """The stand-in for the CUDA driver's user-triggered dump listener (no GPU here): a FIFO, and a core on request."""
    import threading

    pipe = os.environ["CUDA_COREDUMP_PIPE"].replace("%p", str(os.getpid()))
    os.mkfifo(pipe)

    def listen():
        with open(pipe, "rb") as f:   # blocks until the runner opens it for writing
            f.read(1)
        with open(_core_path(os.getpid()), "w") as c:
            c.write("user-triggered " + "x" * 1000 + "END")

    threading.Thread(target=listen, daemon=True).start()


def main():
    from dflash_lab import hang

    if os.environ.get(hang.ENV):
        hang.install(os.environ[hang.ENV])
    if os.environ.get("CUDA_ENABLE_USER_TRIGGERED_COREDUMP") == "1":
        _fake_driver_pipe()
    spec = json.load(open(sys.argv[1]))
    ev = Events(sys.argv[2])
    plan = json.loads(os.environ.get("FAKE_PLAN", "{}"))
    startup = os.environ.get("FAKE_STARTUP", "ok")
    print("fake engine starting", flush=True)
    print("fake engine env: " + " ".join(f"{k}={os.environ.get(k, '')}" for k in ("DFLASH_LAB_FIX", "DFLASH_LAB_FIX_PARTS", "DFLASH_LAB_FA_SPLITS")),
          flush=True)
    print(f"fake engine probe: DFLASH_LAB_PROBE_TAPS={os.environ.get('DFLASH_LAB_PROBE_TAPS', '')} "
          f"DFLASH_LAB_PROBE_FILL_LAYERS={os.environ.get('DFLASH_LAB_PROBE_FILL_LAYERS', '')}", flush=True)
    print(f"fake engine ledger/snapshot: DFLASH_LAB_PROBE_LEDGER={os.environ.get('DFLASH_LAB_PROBE_LEDGER', '')} "
          f"DFLASH_LAB_SCHED_SNAPSHOT={os.environ.get('DFLASH_LAB_SCHED_SNAPSHOT', '')}", flush=True)
    print(f"fake engine scheduler ledger: DFLASH_LAB_SCHED_LEDGER={os.environ.get('DFLASH_LAB_SCHED_LEDGER', '')}",
          flush=True)
    print(f"fake engine oor: DFLASH_LAB_PROBE_OOR={os.environ.get('DFLASH_LAB_PROBE_OOR', '')}", flush=True)
    print(f"fake engine admit: DFLASH_LAB_ADMIT={os.environ.get('DFLASH_LAB_ADMIT', '')}", flush=True)
    print(f"fake engine vllm_diff: DFLASH_LAB_VLLM_DIFF={os.environ.get('DFLASH_LAB_VLLM_DIFF', '')} "
          f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}", flush=True)
    print(f"fake engine vllm_release: DFLASH_LAB_VLLM_RELEASE={os.environ.get('DFLASH_LAB_VLLM_RELEASE', '')} "
          f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}", flush=True)
    print("fake engine switches: " + " ".join(f"{k}={os.environ.get(k, '')}" for k in (
        "DFLASH_LAB_HOOK_SYNC", "DFLASH_LAB_HOOK_FATAL", "DFLASH_LAB_PROBE_REF")), flush=True)
    print(f"fake engine core dumps: CUDA_COREDUMP_GENERATION_FLAGS={os.environ.get('CUDA_COREDUMP_GENERATION_FLAGS', '')}",
          flush=True)
    if startup == "error":
        print("RuntimeError: fake start-up failure", file=sys.stderr, flush=True)
        sys.exit(1)
    if startup == "hang":
        time.sleep(3600)
    ev.emit(event="ready", startup_s=0.1, vllm_version=_vllm_version())   # the vllm on its path, as the worker reports it
    for run in spec["runs"]:
        ev.emit(event="run_start", run=run["id"])
        what = plan.get(run["id"], "ok")
        if what == "crash":
            print("[rank0]: CUDA error: an illegal memory access was encountered", file=sys.stderr, flush=True)
            os._exit(1)
        if what == "hang":
            time.sleep(3600)
        if what == "coredump-server":
            if os.fork() == 0:   # the engine core, dumping
                _write_core(_core_path(os.getpid()), 6)
            # the clients get their in-stream errors while the dump is written: the runner (polling every 0.5 s)
            # sees the core file well before this run_end, as on the H200 in s19
            time.sleep(3.0)
            n = run["concurrency"]
            ev.emit(event="run_end", run=run["id"], outcome="crash", requests_completed=1, output_tokens=5,
                    wall_s=3.0, http_statuses=[200] * n, server_alive=True,
                    request_errors={"failed": n - 1, "by_kind": {"stream_error_event": n - 1}, "by_status": {"200": n - 1},
                                    "first_error": {"stream_error_event": {"status": 200, "error": "EngineCore encountered an issue"}}})
            os._exit(0)
        if what in ("coredump", "coredump-tp2"):
            if what == "coredump":
                core = _core_path(os.getpid())   # named by the crashing process, as the driver does
                if os.fork() == 0:  # the "engine core" process, same process group, still writing
                    _write_core(core, 4)
            else:
                # two "ranks": each prints with vLLM's log prefix; rank 1's dump finishes first, rank 0's later
                for rank, (chunks, tag) in enumerate(((5, "RANK0"), (2, "RANK1"))):
                    if os.fork() == 0:
                        # vLLM 0.22.1 names a worker "Worker" until its rank is set, then "Worker_TP<rank>" (s27 log)
                        print(f"(Worker pid={os.getpid()}) INFO world_size=2 rank={rank}", flush=True)
                        print(f"(Worker_TP{rank} pid={os.getpid()}) INFO loading weights", flush=True)
                        _write_core(_core_path(os.getpid()), chunks, tag)
            print("[rank0]: CUDA error: an illegal memory access was encountered", file=sys.stderr, flush=True)
            os._exit(1)
        time.sleep(float(os.environ.get("FAKE_RUN_S", "0")))   # a run that takes this long
        ev.emit(event="run_end", run=run["id"], outcome="ok" if what == "ok" else "crash",
                requests_completed=run["concurrency"] if what == "ok" else 0, output_tokens=10, wall_s=0.01)
    os._exit(0)


if __name__ == "__main__":
    main()
