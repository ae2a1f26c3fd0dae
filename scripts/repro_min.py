#!/usr/bin/env python3
"""Minimal reproducer for the vLLM 0.22.1 DFlash + FULL CUDA graph bug (needs only vLLM 0.22.1 and a GPU).

    python scripts/repro_min.py [--concurrency 4] [--tokens 48] [--no-reference] [--json OUT.json]
                                [--coredump-dir DIR] [--timeout-s 420] [--deadline-s S] [--models-dir DIR]
    python scripts/repro_min.py --resume WORKDIR [--deadline-s S] [--json OUT.json]   # run what an earlier run left out

What it builds: a tiny random Qwen3.5-MoE target (8 layers: 6 Gated-DeltaNet + 2 full attention,
layers 3 and 7) and a 1-layer DFlash draft whose attention shape differs from the target's, both
as config.json only (``load_format="dummy"``, no tokenizer). vLLM groups KV-cache layers by spec
with a group size set by the smallest spec (the draft's one layer), so the target's two attention
layers land in two KV-cache groups of the same spec: group "layer 3" builds the FlashAttention
metadata every step, group "layer 7" reuses it (``update_block_table``). Its FULL CUDA graphs were
captured reading *its own* builder's persistent FA3 ``scheduler_metadata``, which nothing
refreshes after capture.

The two config.json files go to a folder that is the same on every run (``--models-dir``, default
~/.cache/repro-min/models-<hash of the configs>), not into the run's temporary work folder: vLLM's
compile cache is keyed by the model path, so only a fixed path lets a later run on the host load the
compiled graphs of an earlier one (see ``default_models_dir``). run.json keeps both configs, and an
engine whose folder has gone (another host, a cleared cache) writes them there again.

Each engine runs in its own child process (a crashing engine cannot take the others with it),
one after the other, DFlash k=15, greedy, the same prompts:
  1. ``stock``: ``cudagraph_mode=FULL_AND_PIECEWISE``. A synchronous check in the worker compares,
     at every ``update_block_table`` call, the schedule the reusing group's FULL graphs read (its
     builder's buffer) with the step's schedule, and appends the first mismatches to a file at
     once, so they survive a crash of the engine;
  2. ``reference`` (unless ``--no-reference``): ``cudagraph_mode=PIECEWISE`` (never replays a FULL
     graph); greedy tokens and log-probabilities of stock and fixed are compared with it. It runs before
     the fixed engine because it is what attributes a stock crash to the FULL graphs;
  3. ``fixed``: the same engine as stock with the one-function fix applied in the worker before the
     first request (the reused schedule is copied into the group's own buffer), same check.
A child whose crash is written (CUDA error printed, core dump finished) and that has not exited 20 s later
is stopped. ``--deadline-s`` bounds all engines together: one that would start with too little time left is
recorded as not run and the verdict is still printed (for a host command with a hard time limit).

Last line: a one-line verdict, e.g.
  ``REPRODUCED: stock: group 7 (layer 7)'s FULL graphs would replay a stale FA3 schedule at 3 uniform-decode
  step(s) (first at call 2, 4 requests: 9 of 13 entries differ), then the engine crashed (...); fixed: ...``
REPRODUCED needs the mismatch at a step FULL graphs replay (every query K + 1 tokens), or an illegal-address
crash of stock where the PIECEWISE engine completed; INCONCLUSIVE when neither is shown but a mismatch of
unknown step kind or an unattributed crash is. The fixed engine's check holds by construction (the fix copies
the step's schedule into the buffer compared): the fix is credited by completing and matching the reference.
Exit 0 when the bug reproduced and the fix removed it; 2 on a setup error (the stock engine not starting
included: then the other engines are not run); 3 when incomplete (inconclusive, or an engine not run or not
started: run again with more time); 1 otherwise.
--rejudge WORKDIR judges again from the files the children wrote (when the parent died before its verdict).
--resume WORKDIR continues an earlier run in its work folder (printed at its start): an engine that completed or
crashed there stands on its files; one that was never started (e.g. left out by --deadline-s) or was stopped from
outside (a timeout, a signal) runs now, its old files set aside; then all three are judged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

TARGET_TEXT = dict(
    vocab_size=8192, hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=128, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=65536, linear_conv_kernel_dim=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
    moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
    full_attention_interval=4, mamba_ssm_dtype="float32", attn_output_gate=True, tie_word_embeddings=False,
    eos_token_id=2, pad_token_id=0, bos_token_id=None, dtype="bfloat16", model_type="qwen3_5_moe_text",
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_interleaved": True, "mrope_section": [6, 5, 5]},
)


def model_configs() -> tuple[dict, dict]:
    """config.json of the target and of the draft (dummy weights come from vLLM)."""
    t = TARGET_TEXT
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "text_config": t,
           "vision_config": {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                             "out_hidden_size": t["hidden_size"], "model_type": "qwen3_5_moe"},
           "image_token_id": t["vocab_size"] - 4, "video_token_id": t["vocab_size"] - 3,
           "vision_start_token_id": t["vocab_size"] - 2, "vision_end_token_id": t["vocab_size"] - 5,
           "tie_word_embeddings": False, "eos_token_id": 2, "dtype": "bfloat16"}
    # the draft's attention (4 KV heads of 64) differs from the target's (2 KV heads of 128)
    dcfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": t["vocab_size"],
            "hidden_size": t["hidden_size"], "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 512, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "max_position_embeddings": 65536, "rope_theta": 10000000.0,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "block_size": 16,
            "target_hidden_size": t["hidden_size"], "layer_types": ["full_attention"], "eos_token_id": 2,
            "dflash_config": {"mask_token_id": t["vocab_size"] - 1, "target_layer_ids": [1, 5]}}
    return cfg, dcfg


def write_models(root: str, configs: tuple[dict, dict] | None = None) -> tuple[str, str]:
    """Write the two config.json files (default: ``model_configs()``) under ``root``/target and ``root``/draft
    (atomically: several runs may share ``root``); return the two folders."""
    tdir, ddir = os.path.join(root, "target"), os.path.join(root, "draft")
    for d, c in zip((tdir, ddir), configs or model_configs()):
        os.makedirs(d, exist_ok=True)
        _write(os.path.join(d, "config.json"), c, indent=1)
    return tdir, ddir


def default_models_dir() -> str:
    """A folder that stays the same from run to run on one host: ~/.cache/repro-min/models-<hash of the configs>.

    Why not the run's temporary work folder: vLLM 0.22.1's compile-cache folder is named by a hash of the
    engine configuration that includes the model path (ModelConfig.compute_hash does not ignore ``model``;
    vllm/compilation/backends.py and the AOT cache in decorators.py both hash vllm_config.compute_hash()).
    A model in a new folder every run is therefore compiled again in every engine, however warm the host.
    Measured on an H200 (GPU session s23): each new folder got new cache folders, and every engine that
    compiled also re-ran six Triton autotuning passes of the GDN prefill kernels; a second run in a new
    folder started its engines in 148 and 162 s, two engines in a third folder had not started after 165 s.
    In the second run's folder the first engine that loaded the compiled graphs from the cache still
    autotuned (81 s), and the next one started in 38 s with no autotuning; why the first one did is not
    known, so a fixed folder is what lets a later run start from the cache, not a promise that every
    engine of the second run skips the autotuning."""
    digest = hashlib.sha256(json.dumps(model_configs(), sort_keys=True).encode()).hexdigest()[:12]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "repro-min", f"models-{digest}")


def models_of(workdir: str) -> tuple[str, str]:
    """The target and draft folders a run's engines load: run.json's ``models_dir`` (runs since s23), where the
    configs run.json holds are written again if the folder has gone; else, for a work folder of an earlier run
    (configs inside it), the work folder itself. Raises SystemExit with one message when neither exists."""
    path = os.path.join(workdir, "run.json")
    run = _read_json(path)
    if isinstance(run, dict) and run.get("models_dir"):
        root = run["models_dir"]
        t, d = os.path.join(root, "target"), os.path.join(root, "draft")
        have = [_read_json(os.path.join(x, "config.json")) for x in (t, d)]
        want = run.get("model_configs")
        if want and have != [want.get("target"), want.get("draft")]:
            if any(have):
                raise SystemExit(f"repro_min: {root} holds other configs than {path} records (give --models-dir)")
            try:
                write_models(root, (want["target"], want["draft"]))
            except (OSError, KeyError) as e:
                raise SystemExit(f"repro_min: cannot write the configs {path} records into {root}: {e}")
        elif not all(have):
            raise SystemExit(f"repro_min: {root} (run.json's models_dir) holds no configs, and run.json has none")
        return t, d
    if os.path.isfile(os.path.join(workdir, "target", "config.json")):
        return os.path.join(workdir, "target"), os.path.join(workdir, "draft")
    raise SystemExit(f"repro_min: {workdir}: no readable run.json naming the model folder, and no configs inside it")


# ---- run inside the engine's worker process (collective_rpc; cloudpickled, no outer state)

def _install(worker, fix: bool, checks_path: str):
    """Optionally apply the fix, then wrap update_block_table with the synchronous schedule check."""
    import json as _json

    import torch
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder as B

    if getattr(B.update_block_table, "_repro_checked", False):
        return True
    stock = B.update_block_table
    if fix:
        def fixed(self, metadata, blk_table, slot_mapping):
            new = stock(self, metadata, blk_table, slot_mapping)
            own, cur = getattr(self, "scheduler_metadata", None), new.scheduler_metadata
            if self.use_full_cuda_graph and own is not None and cur is not None and cur.data_ptr() != own.data_ptr():
                n = cur.shape[0]
                own[:n].copy_(cur)
                own[n:].zero_()
                new.scheduler_metadata = own[:n]
            return new
        inner = fixed
    else:
        inner = stock
    counts = {"calls": 0, "stale": 0}

    def checked(self, metadata, blk_table, slot_mapping):
        new = inner(self, metadata, blk_table, slot_mapping)
        own, src = getattr(self, "scheduler_metadata", None), getattr(metadata, "scheduler_metadata", None)
        if self.use_full_cuda_graph and own is not None and src is not None and src.data_ptr() != own.data_ptr():
            counts["calls"] += 1
            n = src.shape[0]
            if not torch.equal(own[:n], src):  # synchronises: the check is exact, at the call
                counts["stale"] += 1
                if counts["stale"] <= 5:
                    d = torch.nonzero(own[:n] != src).flatten()
                    i = int(d[0])
                    # the step's shape: FULL graphs replay only uniform decode steps (every request's query is
                    # k + 1 tokens); a prefill or mixed step runs attention outside the graphs, on the step's schedule
                    q = metadata.query_start_loc
                    lens = (q[1:] - q[:-1]).cpu()
                    lens = lens[lens > 0]
                    with open(checks_path, "a") as f:
                        f.write(_json.dumps({"call": counts["calls"], "gid": getattr(self, "_repro_gid", None),
                                             "entries_differ": int(d.numel()), "of": n,
                                             "first_index": i, "graph_reads": int(own[i]), "step_has": int(src[i]),
                                             "num_reqs": int(lens.numel()), "num_tokens": int(metadata.num_actual_tokens),
                                             "max_query_len": int(metadata.max_query_len),
                                             "uniform": bool(lens.numel() > 0 and (lens == lens[0]).all())})
                                + "\n")
                        f.flush()
        return new

    checked._repro_checked = True
    checked._counts = counts
    B.update_block_table = checked
    return True


def _counts(worker):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder as B

    return dict(getattr(B.update_block_table, "_counts", {}))


def _cache_dirs(worker):
    """Where this engine's worker keeps Triton's and Inductor's caches after start-up, and how many Triton
    autotuning results (``*.autotune.json``) each holds: s23 left open why the first engine to load compiled
    graphs from vLLM's cache still autotuned, and this records where each engine looked."""
    import os as _os

    home = _os.path.expanduser("~")
    dirs = {"TRITON_CACHE_DIR": _os.environ.get("TRITON_CACHE_DIR"),
            "TORCHINDUCTOR_CACHE_DIR": _os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
            "default_triton": _os.path.join(home, ".triton", "cache")}
    out = {}
    for name, d in dirs.items():
        n = None
        if d and _os.path.isdir(d):
            n = sum(f.endswith(".autotune.json") for _, _, fs in _os.walk(d) for f in fs)
        out[name] = {"path": d, "autotune_files": n}
    return out


def _groups(worker):
    """FlashAttention KV-cache groups with full-graph builders: gid and layer names."""
    out = []
    for gid, ags in enumerate(worker.model_runner.attn_groups):
        for ag in ags:
            b = ag.get_metadata_builder(0)
            if getattr(b, "scheduler_metadata", None) is not None and getattr(b, "use_full_cuda_graph", False):
                b._repro_gid = gid  # the check names the builder's group with it
                out.append({"gid": gid, "layers": list(ag.layer_names)})
    return out


# ---- child process: one engine

K = 15  # DFlash's speculative tokens: a decode step's query is K + 1 tokens per request


def engine(tdir, ddir, mode, concurrency):
    from vllm import LLM

    t0 = time.time()
    llm = LLM(model=tdir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=4096, max_num_seqs=max(8, concurrency), max_num_batched_tokens=4096,
              gpu_memory_utilization=0.3, language_model_only=True, gdn_prefill_backend="triton",
              moe_backend="triton", compilation_config={"cudagraph_mode": mode},
              speculative_config={"method": "dflash", "model": ddir, "num_speculative_tokens": K})
    return llm, round(time.time() - t0, 1)


def generate(llm, prompts, tokens):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = [next(iter(d.values())).logprob if d else None for d in (c.logprobs or [])]
        res.append({"tokens": list(c.token_ids), "logprobs": lps})
    return res


def prompts_for(concurrency: int) -> list[list[int]]:
    return [[11 + 7 * i + j for j in range(24 + 5 * i)] for i in range(concurrency)]


ROLES = {"stock": ("FULL_AND_PIECEWISE", False), "fixed": ("FULL_AND_PIECEWISE", True), "reference": ("PIECEWISE", False)}


def child(role: str, workdir: str, concurrency: int, tokens: int) -> int:
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function (our check)
    mode, fix = ROLES[role]
    tdir, ddir = models_of(workdir)
    checks = os.path.join(workdir, f"{role}.checks.jsonl")
    res = {"role": role, "mode": mode, "fix": fix}
    llm, res["startup_s"] = engine(tdir, ddir, mode, concurrency)
    try:
        res["caches"] = llm.collective_rpc(_cache_dirs)[0]
    except Exception as e:  # a diagnostic: never the reason an engine fails
        res["caches"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    _write(os.path.join(workdir, f"{role}.started.json"), res)
    if mode != "PIECEWISE":
        llm.collective_rpc(_install, args=(fix, checks))
        res["groups"] = llm.collective_rpc(_groups)[0]
    t0 = time.time()
    res["outputs"] = generate(llm, prompts_for(concurrency), tokens)
    res["generate_s"] = round(time.time() - t0, 1)
    if mode != "PIECEWISE":
        res["check_counts"] = llm.collective_rpc(_counts)[0]
    import torch

    res["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        import triton

        res["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    except ImportError:
        res["versions"] = {"torch": torch.__version__}
    _write(os.path.join(workdir, f"{role}.json"), res)
    return 0


# ---- parent process: no CUDA; runs the children and judges

def _write(path: str, obj, indent=None) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent)
    os.replace(tmp, path)


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_checks(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line cut by a dying process
    except OSError:
        pass
    return out


ERROR_PATTERNS = ("CUDA error: ", "AcceleratorError", "EngineDeadError", "RuntimeError: ", "Error: ")


def crash_reason(text: str) -> str | None:
    """The most specific error line of a child's output (CUDA errors first), or None."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    for pat in ERROR_PATTERNS:
        hit = [l for l in lines if pat in l]
        if hit:
            line = hit[0]
            return line[line.index(pat):][:200] if pat == "CUDA error: " else line[-200:]
    return None


def child_cmd(role: str, workdir: str, concurrency: int, tokens: int) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--child", role, "--workdir", workdir,
            "--concurrency", str(concurrency), "--tokens", str(tokens)]


# Without these the driver writes the whole device memory into the dump: 45 GB and more than four
# minutes on an H200 (measured 2026-11-30, the dump was still unfinished when its command timed out).
# Skipping memory contents keeps what names the fault (kernel, PC, grid, stack): a few hundred MB.
COREDUMP_FLAGS = ("skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,"
                  "skip_local_memory,skip_constbank_memory")


def coredump_env(folder: str | None) -> dict:
    """Environment that makes the CUDA driver write a light core dump on a GPU exception into ``folder``."""
    if not folder:
        return {}
    os.makedirs(folder, exist_ok=True)
    return {"CUDA_ENABLE_COREDUMP_ON_EXCEPTION": "1", "CUDA_COREDUMP_SHOW_PROGRESS": "1",
            "CUDA_COREDUMP_GENERATION_FLAGS": COREDUMP_FLAGS,
            "CUDA_COREDUMP_FILE": os.path.join(os.path.abspath(folder), "core_%h_%p.nvcudmp")}


def _demangle(name: str) -> str:
    try:
        r = subprocess.run(["c++filt"], input=name, capture_output=True, text=True, timeout=10)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return name


WRAPPERS = ("device_kernel",)  # launch wrappers around the kernel that does the work


def _kernel_name(symbol: str) -> str:
    """The kernel's own name from its symbol, without c++filt (so the verdict reads the same on any host):
    Triton kernels keep their Python name; in an Itanium-mangled C++ symbol, the first length-prefixed
    identifier that is neither a namespace nor a launch wrapper (``device_kernel``, ``enable_sm90_or_later``)."""
    if not symbol.startswith("_Z"):
        return symbol
    try:
        names = _mangled_names(symbol)
    except ValueError:  # a cut symbol
        names = []
    import re

    for n in names:
        if n not in WRAPPERS and not re.fullmatch(r"enable_sm\d+_or_later", n):
            return n
    return symbol[:120]


def _mangled_names(symbol: str) -> list[str]:
    """The entity names of an Itanium-mangled symbol, outermost first: each length-prefixed identifier that
    is not followed by another one (those are namespace or class qualifiers: 4vllm24reshape_and_cache_kernel
    is vllm::reshape_and_cache_kernel). Substitutions (S1_), template parameters (T_) and literal template
    arguments (Li64E) carry no name."""
    i, names = 2, []
    while i < len(symbol):
        c = symbol[i]
        if c in "ST" and i + 1 < len(symbol) and (symbol[i + 1].isdigit() or symbol[i + 1] == "_"):
            i = symbol.index("_", i + 1) + 1
        elif c == "L":
            i = symbol.index("E", i) + 1
        elif c.isdigit():
            j = i
            while j < len(symbol) and symbol[j].isdigit():
                j += 1
            n = int(symbol[i:j])
            name, i = symbol[j:j + n], j + n
            if i < len(symbol) and not symbol[i].isdigit():  # (a name at the very end: a cut symbol)
                names.append(name)
        else:
            i += 1
    return names


def fault_from_log(text: str) -> dict | None:
    """What the driver printed while writing a core dump (CUDA_COREDUMP_SHOW_PROGRESS): the exception and
    the faulting kernel (the innermost frame of the stack it prints), readable without cuda-gdb and even
    when the dump itself was never finished."""
    exc = kernel = pc = exc_pc = progress = None
    for line in text.splitlines():
        if "coredump:" not in line:
            continue
        body = line.split("coredump:", 1)[1].strip()
        if body.endswith("%...") and body[:-4].isdigit():
            progress = int(body[:-4])
        elif exc is None and body.startswith("Detected an exception of type "):
            exc = body[len("Detected an exception of type "):].strip()
        elif exc_pc is None and body.startswith("- PC "):
            exc_pc = body[len("- PC "):].strip()
        elif kernel is None and body.startswith("#0"):
            parts = body.split()  # "#0 <frame pc> <symbol>"
            pc = parts[1] if len(parts) >= 2 else None
            kernel = parts[2] if len(parts) >= 3 else None
    if exc is None and kernel is None:
        return None
    full = _demangle(kernel) if kernel else None
    short = _kernel_name(kernel) if kernel else None
    return {"exception": exc, "exception_pc": exc_pc, "frame0_pc": pc, "kernel": short, "kernel_symbol": kernel, "kernel_demangled": full,
            "dump_progress_pct": progress}  # the last "N%..." the driver printed while writing memory


# After a child's crash is fully written (the driver's core dump finished, or vLLM printed the CUDA error)
# the child gets this long to exit by itself; then it is stopped. Measured 2026-11-30 (s17): a stock child
# wrote its light core dump in 5 s and then hung for 57 s until its per-engine timeout killed it, which left
# the PIECEWISE reference no time inside a 10-minute command.
CRASH_GRACE_S = 20.0
MIN_ENGINE_S = 150  # the tiny hybrid's measured start-ups: 101.5-145.2 s (s15, s17); less cannot finish
RESERVE_S = 20      # of --deadline-s, kept for collecting the last engine's files and printing the verdict
DUMP_STARTED = "coredump: Starting GPU coredump generation"   # the driver's progress lines (CUDA_COREDUMP_SHOW_PROGRESS)
DUMP_DONE = "coredump: All done"


def crash_written(text: str) -> bool:
    """The child's crash is on record: a CUDA error, a dead engine, or a finished core dump. A core dump in progress
    (started, not finished) is not: stopping the child then would cut the dump."""
    if _dump_unfinished(text):
        return False
    # only the unmistakable signs (a plain "Error: " line can be a warning of a healthy engine)
    return any(p in text for p in (DUMP_DONE, "CUDA error: ", "AcceleratorError", "EngineDeadError"))


_RUNNING: list = []   # the child being waited for (run_role), for the signal handler


def _stop(proc) -> None:
    """Stop a child and everything it started (the engine core is a process of its own session)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        if proc.poll() is None:
            proc.kill()
    proc.wait()


def _on_signal(signum, frame):
    for proc in list(_RUNNING):
        _stop(proc)
    print(f"repro_min: stopped by signal {signum}; the children's files are in the work folder "
          "(continue with --resume, or judge them as they are with --rejudge)", file=sys.stderr, flush=True)
    sys.exit(128 + signum)


def run_role(role: str, workdir: str, concurrency: int, tokens: int, timeout_s: float,
             coredump_dir: str | None = None, grace_s: float = CRASH_GRACE_S) -> dict:
    """Run one engine in a child process; what it wrote survives its crash. A child whose crash is written
    and that has not exited ``grace_s`` later is stopped (rc "stopped"); one still running at ``timeout_s``
    is killed (rc "timeout")."""
    log_path = os.path.join(workdir, f"{role}.log")
    t0 = time.time()
    env = dict(os.environ, **coredump_env(coredump_dir and os.path.join(coredump_dir, role)))
    crashed_at = None
    with open(log_path, "w") as log:
        # its own session, so that stopping it reaches the engine core it starts; _RUNNING lets a signal to this
        # process (a host command's `timeout`, Ctrl-C) stop it too, instead of leaving an engine on the GPU
        proc = subprocess.Popen(child_cmd(role, workdir, concurrency, tokens), stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        _RUNNING.append(proc)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    pass
                now = time.time()
                if now - t0 >= timeout_s:
                    rc = "timeout"
                    break
                # a core dump that starts after the error line restarts the wait: the grace never cuts a dump
                crashed_at = (now if crashed_at is None else crashed_at) if crash_written(_read_text(log_path)) else None
                if crashed_at is not None and now - crashed_at >= grace_s:
                    rc = "stopped"
                    break
        finally:
            _stop(proc)   # also after a normal exit: an engine core left behind in its session
            _RUNNING.remove(proc)
    return collect_role(role, workdir, rc, round(time.time() - t0, 1), coredump_dir)


def _read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _dump_unfinished(text: str) -> bool:
    return DUMP_STARTED in text and DUMP_DONE not in text


def settled(rec: dict) -> bool:
    """An engine record that stands as it is: the engine completed, or it crashed (it started and its log holds
    the error). Anything else - never started, or stopped from outside (a timeout, a signal, the host command's
    limit) with a clean log - is run again by --resume."""
    return bool(rec.get("completed") or rec.get("crashed"))


def set_aside(workdir: str, role: str) -> str | None:
    """Move an unsettled engine's files into ``<role>.before-resume-N/`` before it runs again (its checks file is
    appended to, and its log would be overwritten). None when it left no file."""
    files = [role + x for x in (".log", ".started.json", ".checks.jsonl", ".json")
             if os.path.exists(os.path.join(workdir, role + x))]
    if not files:
        return None
    n = 1
    while os.path.exists(os.path.join(workdir, f"{role}.before-resume-{n}")):
        n += 1
    d = os.path.join(workdir, f"{role}.before-resume-{n}")
    os.mkdir(d)
    for f in files:
        os.rename(os.path.join(workdir, f), os.path.join(d, f))
    return d


def not_run(role: str, why: str) -> dict:
    """The record of an engine the parent did not start (its --deadline-s budget was spent)."""
    return {"role": role, "not_run": why, "completed": False, "engine_started": False, "crashed": False,
            "error": f"not run: {why}", "checks": [], "returncode": None, "wall_s": None}


def collect_role(role: str, workdir: str, rc, wall_s: float | None = None, coredump_dir: str | None = None) -> dict:
    """One child's result from the files it wrote (its log, started/result json, checks).

    ``rc``: the child's exit code, "timeout" when the parent killed it, None when unknown (``--rejudge``
    of a folder whose parent process was killed before it saw the child end)."""
    log_path = os.path.join(workdir, f"{role}.log")
    text = _read_text(log_path)
    res = _read_json(os.path.join(workdir, f"{role}.json")) or {"role": role}
    started = _read_json(os.path.join(workdir, f"{role}.started.json"))
    if started and "startup_s" not in res:
        res["startup_s"] = started["startup_s"]
    res["returncode"] = None if rc in ("timeout", "stopped") else rc
    if rc == "stopped":
        res["stopped_after_crash"] = True  # it had not exited CRASH_GRACE_S after its crash was written
    res["wall_s"] = wall_s
    # a result file is written only after generate() returned: it is the completion record
    res["completed"] = (rc == 0 or (rc is None and "outputs" in res)) and "outputs" in res
    fault = fault_from_log(text)
    if fault:
        res["fault"] = fault
    res["engine_started"] = started is not None
    why = None
    if not res["completed"]:
        why = crash_reason(text)
        if not why and fault:
            where = f" in {fault['kernel']}" if fault.get("kernel") else ""
            why = f"GPU exception {fault['exception']}{where} (from the core-dump log)"
        res["error"] = (why + (" - then timed out writing the core dump" if _dump_unfinished(text)
                               else " - then did not exit until the per-engine timeout") if why and rc == "timeout"
                        else why or ("timeout" if rc == "timeout" else f"exit code {rc}" if rc is not None
                                     else "no result file and no error in its log (killed?)"))
    else:
        res["error"] = None
    # a crash is an engine that started and left an error behind; a child killed by a timeout with a clean
    # log (e.g. a healthy engine the parent gave up on) is not one
    res["crashed"] = bool(res["engine_started"] and not res["completed"] and why)
    res["checks"] = _read_checks(os.path.join(workdir, f"{role}.checks.jsonl"))
    res["log"] = log_path
    if coredump_dir:
        d = os.path.join(coredump_dir, role)
        res["core_dumps"] = sorted(os.path.join(d, f) for f in os.listdir(d)) if os.path.isdir(d) else []
    return res


def compare(a, b):
    """(requests whose tokens differ, max |logprob difference| over the common prefix)."""
    differ, worst = 0, 0.0
    for x, y in zip(a, b):
        if x["tokens"] != y["tokens"]:
            differ += 1
        for (ta, la), (tb, lb) in zip(zip(x["tokens"], x["logprobs"]), zip(y["tokens"], y["logprobs"])):
            if ta != tb:
                break
            if la is not None and lb is not None:
                worst = max(worst, abs(la - lb))
    return differ, worst


def _group_label(res: dict, gid) -> str:
    """'group 7 (layer 7)' from the engine's recorded groups; the check names the builder's gid."""
    g = {x["gid"]: x for x in (res.get("groups") or [])}
    if gid is None or gid not in g:
        return "the reusing group"
    layers = [l.split("layers.")[1].split(".")[0] for l in g[gid]["layers"] if "layers." in l]
    return f"group {gid} (layer{'s' if len(layers) > 1 else ''} {', '.join(layers)})"


def step_kind(check: dict) -> str:
    """'full': a uniform decode step of K + 1 tokens per request, the steps FULL graphs replay; 'other': a
    prefill or mixed step (attention runs outside the graphs, on the step's own schedule); 'unknown': a
    check line written before the script recorded the step's shape."""
    if "uniform" not in check:
        return "unknown"
    return "full" if check["uniform"] and check.get("max_query_len") == K + 1 else "other"


def judge(stock: dict, fixed: dict, reference: dict | None, concurrency: int) -> tuple[dict, str]:
    """The verdict and its one-line text from the three children's results.

    REPRODUCED: the stock engine's reusing group held a schedule different from the step's at a step its
    FULL graphs replay (synchronous check), or it crashed with an illegal address where the PIECEWISE
    engine ran the same prompts to the end. INCONCLUSIVE: a mismatch only at steps of unknown kind, or a
    crash without a completed reference. NOT REPRODUCED otherwise. The fix is credited when its engine
    completed, its check saw no mismatch and its tokens equal the reference's (without a reference only
    under --no-reference). The fixed engine's check holds by construction (the fix copies the step's
    schedule into the buffer it compares): it shows the fix ran, not that it is right."""
    stale = stock.get("checks") or []
    kinds = [step_kind(c) for c in stale]
    stale_full = [c for c, k in zip(stale, kinds) if k == "full"]
    stale_unknown = [c for c, k in zip(stale, kinds) if k == "unknown"]
    stock_crashed = bool(stock.get("crashed", stock.get("engine_started") and not stock.get("completed")))
    # a crash of the stock FULL engine counts only when the engine without FULL graphs ran the same
    # prompts to the end: if PIECEWISE crashes too, the crash is not this bug (the stale schedule still is)
    ref_clean = reference is not None and bool(reference.get("completed"))
    illegal = bool(stock.get("error")) and "illegal" in stock["error"].lower()
    reproduced = bool(stale_full) or (stock_crashed and ref_clean and illegal)
    inconclusive = not reproduced and (bool(stale_unknown) or (stock_crashed and illegal and not ref_clean))
    fixed_stale = fixed.get("checks") or []
    cmp = {}
    if ref_clean:
        for name, r in (("stock", stock), ("fixed", fixed)):
            if r.get("completed"):
                cmp[name] = compare(r["outputs"], reference["outputs"])
    fixed_ok = bool(fixed.get("completed")) and not fixed_stale and (
        ("fixed" in cmp and cmp["fixed"][0] == 0) if reference is not None else True)
    v = {"reproduced": reproduced, "inconclusive": inconclusive, "fix_removes_it": fixed_ok,
         "stock_stale_checks": len(stale), "stock_stale_at_full_steps": len(stale_full),
         "stock_stale_of_unknown_kind": len(stale_unknown),
         "reference_crashed": reference is not None and bool(reference.get("engine_started"))
         and not reference.get("completed"),
         "stock_crashed": stock_crashed, "fixed_stale_checks": len(fixed_stale),
         "reference_compared": bool(cmp), "vs_reference": cmp}
    first = (stale_full or stale_unknown or stale or [{}])[0]
    grp = _group_label(stock if stock.get("groups") else fixed, first.get("gid"))
    if stale_full:
        c = stale_full[0]
        s = (f"stock: {grp}'s FULL graphs would replay a stale FA3 schedule at {len(stale_full)} uniform-decode "
             f"step(s) (first at call {c['call']}, {c['num_reqs']} requests: {c['entries_differ']} of {c['of']} entries differ)")
    elif stale_unknown:
        calls = ", ".join(str(c["call"]) for c in stale_unknown)
        s = (f"stock: {grp}'s graph buffer held a schedule different from the step's at checked call(s) {calls} "
             f"(group id and step kinds not recorded: call 1 is the prefill, where no FULL graph replays)")
    elif stale:
        s = (f"stock: {grp}'s graph buffer differed from the step's schedule only at {len(stale)} step(s) that replay no "
             "FULL graph")
    else:
        s = f"stock: no stale schedule seen ({(stock.get('check_counts') or {}).get('calls', 0)} checked calls)"
    if not stock.get("engine_started"):
        s += f"; the engine did not start ({stock.get('error')})"
    elif stock_crashed:
        s += f", then the engine crashed ({stock.get('error')})"
        if not ref_clean:
            s += ", not attributed: no completed PIECEWISE reference"
    elif not stock.get("completed"):
        s += f"; it did not complete ({stock.get('error')})"
    elif "stock" in cmp:
        s += f"; {cmp['stock'][0]}/{concurrency} requests differ from the PIECEWISE reference (max |dlogprob| {cmp['stock'][1]:.3g})"
    if fixed.get("completed"):
        n = (fixed.get("check_counts") or {}).get("calls", 0)
        f = ("fixed: completed, the schedule copied into the graphs' buffer at " + (f"all {n}" if not fixed_stale else
             f"{n - len(fixed_stale)} of {n}") + " calls")
        if "fixed" in cmp:
            f += f", {concurrency - cmp['fixed'][0]}/{concurrency} requests identical to the PIECEWISE reference (max |dlogprob| {cmp['fixed'][1]:.3g})"
        elif reference is not None:
            f += ", not compared with a reference"
    else:
        f = f"fixed: did not complete ({fixed.get('error')})"
    ref = "" if reference is None else ("; reference: " + ("completed" if reference.get("completed") else f"did not complete ({reference.get('error')})"))
    ups = [f"{r['role']} {r['startup_s']} s" for r in (stock, fixed, reference) if r and r.get("startup_s") is not None]
    word = "REPRODUCED" if reproduced else "INCONCLUSIVE" if inconclusive else "NOT REPRODUCED"
    line = word + ": " + s + "; " + f + ref + ("; start-up " + ", ".join(ups) if ups else "")
    return v, line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--no-reference", action="store_true", help="skip the PIECEWISE reference engine")
    ap.add_argument("--json", help="write the detailed result here")
    ap.add_argument("--timeout-s", type=float, default=420, help="per engine (start-up included)")
    ap.add_argument("--deadline-s", type=float,
                    help="for all engines together: an engine that would start with less than "
                         f"{MIN_ENGINE_S} s left is not run, and the verdict is printed before this runs out")
    ap.add_argument("--write-configs-only", metavar="DIR", help="write the two config.json files and stop")
    ap.add_argument("--models-dir", help="where the two config.json files go (default: a fixed folder under "
                                          "~/.cache/repro-min, so that a later run on the host can load vLLM's compiled graphs)")
    ap.add_argument("--coredump-dir", help="CUDA core dumps of a crashing engine go here (read them with cuda-gdb)")
    ap.add_argument("--rejudge", metavar="WORKDIR",
                    help="no engines: judge again from the files the children of an earlier run wrote in WORKDIR "
                         "(its repro-min-* folder), e.g. when that run's parent was killed before its verdict")
    ap.add_argument("--resume", metavar="WORKDIR",
                    help="continue an earlier run in its WORKDIR: engines that completed or crashed there stand on their "
                         "files; the others (never started, or stopped by a timeout or signal) run now; then judge all three")
    ap.add_argument("--child", choices=sorted(ROLES), help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.concurrency < 2 or a.tokens < 2:
        print("repro_min: --concurrency and --tokens must be >= 2", file=sys.stderr)
        return 2
    if a.write_configs_only:
        print(json.dumps(write_models(a.write_configs_only)))
        return 0
    if a.child:
        return child(a.child, a.workdir, a.concurrency, a.tokens)
    if a.timeout_s <= 0 or (a.deadline_s is not None and a.deadline_s <= 0):
        print("repro_min: --timeout-s and --deadline-s must be > 0", file=sys.stderr)
        return 2
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        print(f"repro_min: --json {a.json}: its folder does not exist", file=sys.stderr)
        return 2
    if a.rejudge and a.resume:
        print("repro_min: --rejudge and --resume exclude each other", file=sys.stderr)
        return 2
    if a.resume and not os.path.isdir(a.resume):
        print(f"repro_min: --resume {a.resume}: no such folder", file=sys.stderr)
        return 2
    if a.rejudge:
        return rejudge(a.rejudge, a.json, a.concurrency, a.tokens, a.no_reference, a.coredump_dir)
    try:
        from importlib.metadata import PackageNotFoundError, version

        have = version("vllm")
    except PackageNotFoundError:
        print("repro_min: vLLM is not installed", file=sys.stderr)
        return 2
    if have != "0.22.1":
        print(f"repro_min: written for vLLM 0.22.1, this is {have}", file=sys.stderr)
        return 2
    t0 = time.time()
    if a.resume:
        root = a.resume
        res = _read_json(os.path.join(root, "run.json"))
        if not isinstance(res, dict) or "concurrency" not in res or "tokens" not in res:
            print(f"repro_min: --resume {root}: no readable run.json there (give the work folder an earlier run "
                  "printed)", file=sys.stderr)
            return 2
        # the earlier run's own settings: its prompts, its reference choice, where its core dumps went
        a.concurrency, a.tokens = int(res["concurrency"]), int(res["tokens"])
        a.no_reference = a.no_reference or bool(res.get("no_reference"))
        a.coredump_dir = a.coredump_dir or res.get("coredump_dir")
        try:
            models_of(root)   # the engines to run need their configs: there, or written again from run.json
        except SystemExit as e:
            print(e, file=sys.stderr)
            return 2
        res["workdir"] = root
        res["resumed"] = list(res.get("resumed") or []) + [{
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}]
        _write(os.path.join(root, "run.json"), res)
    else:
        models = os.path.abspath(a.models_dir or default_models_dir())
        target_cfg, draft_cfg = model_configs()
        try:
            write_models(models, (target_cfg, draft_cfg))
        except OSError as e:
            print(f"repro_min: cannot write the model configs under {models}: {e} (give --models-dir)", file=sys.stderr)
            return 2
        root = tempfile.mkdtemp(prefix="repro-min-")   # only now: a failed start leaves no empty work folder
        res = {"vllm": have, "concurrency": a.concurrency, "tokens": a.tokens, "workdir": root, "models_dir": models,
               "model_configs": {"target": target_cfg, "draft": draft_cfg},
               "no_reference": a.no_reference, "coredump_dir": a.coredump_dir,
               "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        _write(os.path.join(root, "run.json"), res)  # what --rejudge needs if this process dies before its verdict
    print(f"repro_min: work folder {root} (--resume and --rejudge take it)", file=sys.stderr, flush=True)
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    # the reference before the fix: it is what attributes a stock crash to the FULL graphs, so when the
    # budget runs out it is the fixed engine that goes unrun
    for role in ("stock",) + (() if a.no_reference else ("reference",)) + ("fixed",):
        left = None if a.deadline_s is None else a.deadline_s - RESERVE_S - (time.time() - t0)
        earlier = None
        if a.resume:
            # an engine that completed or crashed in the earlier call: its files are its record (exit code unknown,
            # as for --rejudge); one that never started or was stopped from outside runs again
            earlier = collect_role(role, root, None, None, a.coredump_dir)
            if settled(earlier):
                res[role] = earlier
                print(f"repro_min: {role}: from the earlier run's files", file=sys.stderr, flush=True)
                continue
        if role != "stock" and not res["stock"].get("engine_started"):
            # nothing to compare with: the setup is broken, and the later engines would only use up the time
            res[role] = not_run(role, "the stock engine did not start")
        elif left is not None and left < MIN_ENGINE_S:
            res[role] = not_run(role, f"{max(0, round(left))} s of --deadline-s {a.deadline_s:g} left after a "
                                      f"{RESERVE_S} s reserve, an engine needs {MIN_ENGINE_S} s")
        else:
            moved = set_aside(root, role) if a.resume else None
            if moved:
                print(f"repro_min: {role}: the earlier run's engine neither completed nor crashed "
                      f"({earlier.get('error')}); its files moved to {moved}, running it again", file=sys.stderr, flush=True)
            res[role] = run_role(role, root, a.concurrency, a.tokens,
                                 a.timeout_s if left is None else min(a.timeout_s, left), a.coredump_dir)
        print(f"repro_min: {role}: " + ("completed" if res[role]["completed"] else f"failed ({res[role]['error']})")
              + f" in {res[role]['wall_s']} s", file=sys.stderr, flush=True)
        _write(os.path.join(root, "partial.json"), res)
    res["verdict"], line = judge(res["stock"], res["fixed"], res.get("reference"), a.concurrency)
    res["verdict_line"] = line
    res["wall_s"] = round(time.time() - t0, 1)
    if a.json:
        _write(a.json, res)
    print(line, flush=True)
    return exit_code(res)


def exit_code(res: dict) -> int:
    """0: reproduced and removed by the fix; 2: the stock engine did not start (a setup problem, no verdict on
    the bug); 3: incomplete - inconclusive, or an engine was not run or did not finish its start-up (run again
    with more time); 1: otherwise (not reproduced, or the fix not credited)."""
    v = res["verdict"]
    if not res["stock"].get("engine_started"):
        return 2
    if v["reproduced"] and v["fix_removes_it"]:
        return 0
    if v["inconclusive"] or any(r.get("not_run") or not r.get("engine_started")
                                for r in (res.get("reference"), res.get("fixed")) if r):
        return 3
    return 1


def rejudge(workdir: str, json_out: str | None, concurrency: int, tokens: int, no_reference: bool,
            coredump_dir: str | None) -> int:
    """The verdict of an earlier run from what its children wrote (exit codes unknown: a result file
    means the child finished its prompts; no result file and a started engine means it did not)."""
    if not os.path.isdir(workdir) or not any(
            os.path.exists(os.path.join(workdir, f"{r}.log")) for r in ROLES):
        print(f"repro_min: --rejudge {workdir}: no child logs there (expected stock.log, fixed.log, ...)", file=sys.stderr)
        return 2
    res = _read_json(os.path.join(workdir, "run.json")) or {
        "concurrency": concurrency, "tokens": tokens, "workdir": workdir,
        "note": "run.json missing: concurrency and tokens taken from this command's arguments"}
    res["rejudged_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    res["rejudge_command"] = " ".join([os.path.basename(sys.executable)] + sys.argv)
    roles = ("stock", "fixed") + (() if no_reference else ("reference",))
    for role in roles:
        res[role] = collect_role(role, workdir, None, None, coredump_dir)
    res["verdict"], line = judge(res["stock"], res["fixed"], res.get("reference"), int(res["concurrency"]))
    res["verdict_line"] = line
    if json_out:
        _write(json_out, res)
    print(line, flush=True)
    return exit_code(res)


if __name__ == "__main__":
    sys.exit(main())
