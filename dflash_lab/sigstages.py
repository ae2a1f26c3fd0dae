"""Whose handler answers ``SIGUSR1`` after each start-up stage an engine process goes through (GPU host; the CUDA
stages are skipped, and say so, where no GPU is visible).

Why: in s53 and s54 the hang snapshot's ``SIGUSR1`` reached the EngineCore (/proc: caught, not pending, not blocked
in its main thread) and no stacks were written, while the worker process, which never touches CUDA, wrote its
stacks each time. faulthandler writes from its C signal handler, so a registered faulthandler cannot stay silent;
another handler set after :func:`dflash_lab.hang.install` can. This module repeats, in one plain process, the
stages an EngineCore passes after the plugin registered faulthandler (CUDA, a CUDA graph, a Triton kernel,
torch.compile, an NCCL group, vLLM's compiled ops), reads the kernel's disposition of ``SIGUSR1`` after each
(:func:`dflash_lab.hang.handler_of`) and, last, sends ``SIGUSR1`` to a forked copy of the process and checks whether
the stacks file grew. With ``coredump_dir`` the process first takes the engine's core-dump environment (dumps on
exception, user-triggered dumps through a pipe), as the hang matrices start it.

One JSON line per stage, written as it ends (a crash mid-way leaves the stages before it, each line whole):
``{"stage", "ok", "note" | "error" | "skipped", "s", "handler": {...}, "sigcgt", "replaced"}``; the first line is
the provenance, the last the signal test.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

from . import hang
from .errors import LabError

SIGNAL_WAIT_S = 3.0


def _on_cuda(stage):
    """A stage that needs a GPU: called with torch where CUDA is visible; else None (recorded as skipped)."""
    def run():
        import torch

        return stage(torch) if torch.cuda.is_available() else None
    run.__name__ = stage.__name__
    return run


def _stage_torch():
    import torch

    return f"torch {torch.__version__}, CUDA visible: {torch.cuda.is_available()}"


@_on_cuda
def _stage_cuda(torch):
    x = torch.ones(1024, device="cuda")
    x.add_(1)
    torch.cuda.synchronize()
    return f"{torch.cuda.get_device_name(0)}, one elementwise kernel"


@_on_cuda
def _stage_graph(torch):
    x = torch.zeros(1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)
    g.replay()
    torch.cuda.synchronize()
    return "captured and replayed one CUDA graph"


@_on_cuda
def _stage_triton(torch):
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(p, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(p + i, tl.load(p + i, mask=i < n) + 1, mask=i < n)

    x = torch.zeros(1000, device="cuda")
    _add_one[(4,)](x, 1000, BLOCK=256)
    torch.cuda.synchronize()
    if float(x.sum()) != 1000.0:
        raise RuntimeError(f"the Triton kernel wrote {float(x.sum())}, not 1000")
    return f"triton {triton.__version__}: compiled and ran one kernel"


@_on_cuda
def _stage_compile(torch):

    def f(a, b):
        return torch.nn.functional.gelu(a @ b) + 1

    g = torch.compile(f)
    a = torch.randn(64, 64, device="cuda")
    if not torch.allclose(g(a, a), f(a, a), atol=1e-3, rtol=1e-3):
        raise RuntimeError("torch.compile's output differs from eager")
    return "torch.compile (inductor) of one small function"


@_on_cuda
def _stage_nccl(torch):
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    t = torch.ones(8, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}: group of one, one all_reduce"


def _stage_vllm():
    try:
        import vllm
    except ImportError as e:
        return f"skip: vllm not importable ({e})"
    import vllm._C  # noqa: F401  the compiled ops an engine loads
    from vllm.v1.engine import core  # noqa: F401

    return f"vllm {vllm.__version__}: vllm._C and vllm.v1.engine.core imported"


STAGES = [("import torch", _stage_torch), ("CUDA context and a kernel", _stage_cuda),
          ("CUDA graph capture and replay", _stage_graph), ("Triton kernel", _stage_triton),
          ("torch.compile", _stage_compile), ("NCCL group", _stage_nccl), ("vLLM ops and engine core", _stage_vllm)]


def _first_line(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.readline().strip() or None
    except OSError:
        return None


def _sigcgt() -> str | None:
    return hang.parse_status(Path("/proc/self/status").read_text()).get("SigCgt") if Path("/proc/self").exists() \
        else None


def signal_test(stacks: Path, wait_s: float = SIGNAL_WAIT_S) -> dict:
    """Send ``SIGUSR1`` to a forked copy of this process (handlers are inherited; the copy then sleeps and exits 0):
    whether the stacks file grew, and how the copy ended (a handler that ends the process shows as a signal)."""
    before = stacks.stat().st_size
    pid = os.fork()
    if pid == 0:   # the copy: no CUDA, no threads but this one
        try:
            os.kill(os.getpid(), hang.SIGNAL)
            time.sleep(wait_s)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    grown = stacks.stat().st_size - before
    ended = (f"exit {os.waitstatus_to_exitcode(status)}" if os.WIFEXITED(status)
             else f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"status {status}")
    return {"stage": "SIGUSR1 to a forked copy", "ok": grown > 0, "stacks_bytes": grown, "copy": ended}


def run(out: str | os.PathLike, coredump_dir: str | os.PathLike | None = None, stages=None,
        watch_s: float | None = None, fresh_triton_cache: bool = False) -> list[dict]:
    """Run the stages in this process, one line each to ``out`` (which must not exist yet); returns the lines.

    ``watch_s``: register as the plugin does since s55, with the thread that puts faulthandler's handler back
    (:func:`dflash_lab.hang.install`), and wait ``3 * watch_s`` after each stage for it; None: register as every
    engine did through s54 (no watcher). ``fresh_triton_cache``: an empty ``TRITON_CACHE_DIR``, so the Triton
    stage compiles (s55: with the kernel already in the cache, nothing replaced the handler)."""
    out = Path(out)
    if out.exists():
        raise LabError(f"{out}: exists; sigstages never overwrites a record")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="sigstages-"))
    env = {}
    if coredump_dir is not None:
        from . import coredump

        env = {**coredump.env(coredump_dir, keep_running=True), **hang.env(work, coredump_dir)}
        Path(coredump_dir).mkdir(parents=True, exist_ok=True)
    if fresh_triton_cache:
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="sigstages-triton-")
    os.environ.update(env)   # before anything loads the CUDA driver or Triton, as the runner starts an engine
    lines = []

    def put(line: dict) -> None:
        lines.append(line)
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")

    put({"stage": "provenance", "ok": True, "python": sys.version.split()[0], "platform": platform.platform(),
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "command": " ".join(sys.argv), "env": env, "watch_s": watch_s, "pid": os.getpid(), "host": socket.gethostname(),
         "driver": _first_line("/proc/driver/nvidia/version"), "git_commit": os.environ.get("DFLASH_LAB_COMMIT")
         or _first_line(".commit")})
    restored = []
    msg = hang.install(work, watch_s=watch_s, log=restored.append)
    first = hang.handler_of(hang.SIGNAL)
    put({"stage": "faulthandler registered", "ok": True, "note": msg, "handler": first, "sigcgt": _sigcgt(),
         "replaced": False})
    for name, fn in (stages or STAGES):
        t0 = time.time()
        line = {"stage": name}
        n = len(restored)   # before the stage: the watcher may set a handler back while the stage still runs (s56)
        try:
            note = fn()
            if note is None:
                line.update(ok=True, skipped="no CUDA device visible")
            elif note.startswith("skip: "):
                line.update(ok=True, skipped=note[6:])
            else:
                line.update(ok=True, note=note)
        except Exception as e:   # a stage that fails is recorded; the later ones still run
            line.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=4))
        line["s"] = round(time.time() - t0, 2)
        if watch_s:
            time.sleep(3 * watch_s)
            line["watcher"] = restored[n:]
        now = hang.handler_of(hang.SIGNAL)
        line.update(handler=now, sigcgt=_sigcgt(), replaced=now != first)
        put(line)
    put(signal_test(Path(hang._installed["path"])))
    return lines


def summary(lines: list[dict]) -> list[dict]:
    """One row per stage for a table: stage, outcome, SIGUSR1's handler in words, replaced since faulthandler's."""
    rows = []
    for ln in lines:
        if ln["stage"] == "provenance":
            continue
        outcome = (ln.get("error") or (f"skipped: {ln['skipped']}" if ln.get("skipped") else ln.get("note"))
                   or (f"stacks written ({ln['stacks_bytes']} bytes), copy {ln['copy']}" if ln.get("ok")
                       else f"no stacks written, copy {ln.get('copy')}"))
        rows.append({"stage": ln["stage"], "outcome": outcome,
                     "SIGUSR1 handler": hang.handler_text(ln["handler"]) if "handler" in ln else "",
                     "replaced": ln.get("replaced"), "set back by the watcher": "; ".join(ln.get("watcher", []))})
    return rows


def read(path: str | os.PathLike) -> list[dict]:
    """A recorded sigstages file; a missing file or a line that is not JSON is one clear error."""
    p = Path(path)
    if not p.is_file():
        raise LabError(f"{p}: no such sigstages record")
    out = []
    for i, text in enumerate(p.read_text().splitlines(), 1):
        try:
            out.append(json.loads(text))
        except json.JSONDecodeError as e:
            raise LabError(f"{p}:{i}: not a JSON line ({e.msg})") from None
    if not out or out[0].get("stage") != "provenance":
        raise LabError(f"{p}: the first line must be the provenance line")
    return out


def table(pattern: str = "data/gpu/*/sigstages*.jsonl"):
    """Every recorded sigstages line but the provenance, one row each: record (folder/file), stage, ok, outcome,
    handler (in words), object (the file holding the handler, path dropped), replaced, SigCgt, watcher."""
    import glob

    import pandas as pd

    rows = []
    for path in sorted(glob.glob(pattern)):
        lines = read(path)
        for ln, r in zip(lines[1:], summary(lines)):
            obj = (ln.get("handler") or {}).get("object")
            rows.append({"record": f"{Path(path).parent.name}/{Path(path).name}", "stage": r["stage"],
                         "ok": ln.get("ok"), "outcome": r["outcome"], "handler": r["SIGUSR1 handler"],
                         "object": Path(obj).name if obj else None, "replaced": r["replaced"],
                         "SigCgt": ln.get("sigcgt"), "watcher": r["set back by the watcher"]})
    return pd.DataFrame(rows, columns=["record", "stage", "ok", "outcome", "handler", "object", "replaced", "SigCgt",
                                       "watcher"])


PROC_HEAD = re.compile(r"^=== /proc of pid (\d+) \((.*)\)$")


def hang_log_sigcgt(path: str | os.PathLike) -> dict[str, str]:
    """{process name: SigCgt} of each process a hang log's /proc sections read (:func:`dflash_lab.hang.proc_text`)."""
    out, name = {}, None
    for line in Path(path).read_text(errors="replace").splitlines():
        m = PROC_HEAD.match(line)
        if m:
            name = m.group(2)
        elif name is not None and "SigCgt:" in line:
            out[name] = hang.parse_status(line.replace("  ", "\n")).get("SigCgt")
            name = None
    return out
