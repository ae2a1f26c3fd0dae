"""Engine child process of the experiment runner: one engine configuration, its runs in sequence.

Started by :mod:`dflash_lab.runner` as ``python -m dflash_lab.worker SPEC.json EVENTS.jsonl``.
It starts vLLM (offline ``vllm.LLM`` or the OpenAI-compatible server), then executes the
runs listed in SPEC one after the other, appending an event line per milestone to EVENTS:
``ready`` (with start-up time), ``run_start``, ``run_end`` (with the run's measurements).
The parent alone writes result lines; if this process dies, the parent knows which run
was in flight from the last ``run_start``.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

from . import servebench


class Events:
    def __init__(self, path):
        self.path = path

    def emit(self, **ev):
        ev["t"] = time.time()
        with open(self.path, "a") as f:
            f.write(json.dumps(ev, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())


def engine_kwargs(spec: dict, paths: dict) -> dict:
    e = spec["engine"]
    kw = dict(
        model=paths["target"], tokenizer=paths["target"], dtype="bfloat16",
        max_model_len=e["max_model_len"], max_num_seqs=e["max_num_seqs"],
        max_num_batched_tokens=e["max_num_batched_tokens"],
        gpu_memory_utilization=e["gpu_memory_utilization"], enforce_eager=e["enforce_eager"],
        tensor_parallel_size=e["tensor_parallel_size"], load_format="dummy", seed=0,
        trust_remote_code=True, disable_log_stats=False,
    )
    if e["cudagraph_mode"] and not e["enforce_eager"]:
        kw["compilation_config"] = {"cudagraph_mode": e["cudagraph_mode"]}
    if e.get("cudagraph_capture_sizes"):
        kw.setdefault("compilation_config", {})["cudagraph_capture_sizes"] = e["cudagraph_capture_sizes"]
    if e["async_scheduling"] is not None:
        kw["async_scheduling"] = e["async_scheduling"]
    if e["prefix_caching"] is not None:
        kw["enable_prefix_caching"] = e["prefix_caching"]
    if paths["family"] == "hybrid":
        kw.update(language_model_only=True, gdn_prefill_backend="triton")
    if e["moe_backend"] and paths["family"] == "hybrid":
        kw["moe_backend"] = e["moe_backend"]
    spec_cfg = speculative_config(e, paths)
    if spec_cfg:
        kw["speculative_config"] = spec_cfg
    for key, val in (e.get("engine_args") or {}).items():  # extra vLLM engine arguments, merged
        if isinstance(val, dict) and isinstance(kw.get(key), dict):
            kw[key] = dict(kw[key], **val)
        else:
            kw[key] = val
    return kw


def speculative_config(e: dict, paths: dict) -> dict | None:
    method = e["spec_method"]
    if method == "none":
        return None
    cfg = {"method": method, "num_speculative_tokens": e["num_speculative_tokens"]}
    if method == "dflash":
        cfg["model"] = paths["draft"]
    elif method == "ngram":
        cfg.update(prompt_lookup_max=4, prompt_lookup_min=1)
    if e["drafter_enforce_eager"]:
        cfg["enforce_eager"] = True
    return cfg


def with_acceptance(spec_cfg: dict | None, acceptance) -> dict | None:
    if spec_cfg is None or acceptance in (None, "natural"):
        return spec_cfg
    cfg = dict(spec_cfg, rejection_sample_method="synthetic")
    if isinstance(acceptance, list):
        cfg["synthetic_acceptance_rates"] = acceptance
    else:
        cfg["synthetic_acceptance_length"] = float(acceptance)
    return cfg


# ----------------------------------------------------------------------------- metrics

def spec_metrics_from(metrics) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": None}
    for m in metrics:
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] = int(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = [int(v) for v in m.values]
    return out


def spec_metrics_from_prometheus(text: str) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": None}
    per = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"(vllm:spec_decode_num_\w+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if not m:
            continue
        name, labels, val = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "vllm:spec_decode_num_drafts":
            out["drafts"] += int(val)
        elif name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] += int(val)
        elif name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] += int(val)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                per[int(pos.group(1))] = per.get(int(pos.group(1)), 0) + int(val)
    if per:
        out["per_pos"] = [per[i] for i in sorted(per)]
    return out


def spec_delta(before: dict | None, after: dict | None) -> dict | None:
    """vLLM's spec-decode counters over one run: ``after`` minus ``before``; None when either was not read (a server
    that had exited or did not answer its metrics endpoint), never a made-up zero."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    res = {"num_drafts": d["drafts"], "num_draft_tokens": d["draft_tokens"], "num_accepted": d["accepted"],
           "acceptance_length": (1 + d["accepted"] / d["drafts"]) if d["drafts"] else None,
           "per_position_rates": None}
    if after["per_pos"] and d["drafts"]:
        b = before["per_pos"] or [0] * len(after["per_pos"])
        res["per_position_rates"] = [round((a - x) / d["drafts"], 4) for a, x in zip(after["per_pos"], b)]
    return res


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[i]


def hook_stats(hook_dir: str | None) -> dict | None:
    if not hook_dir or not os.path.isdir(hook_dir):
        return None
    tot = {"launches": 0, "verify_launches": 0, "findings": {}, "records": 0, "processes": 0}
    for f in os.listdir(hook_dir):
        if f.startswith("stats-") and f.endswith(".json"):
            try:
                s = json.load(open(os.path.join(hook_dir, f)))
            except (OSError, ValueError):
                continue
            tot["processes"] += 1
            tot["launches"] += s.get("launches", 0)
            tot["verify_launches"] += s.get("verify_launches", 0)
            tot["records"] += s.get("records", 0)
            for k, v in s.get("findings", {}).items():
                tot["findings"][k] = tot["findings"].get(k, 0) + v
    return tot


# ----------------------------------------------------------------------------- offline

def record_outputs(folder, run_id: str, token_ids: list[list[int]],
                   logprobs: list[list[float | None]] | None = None) -> list[str]:
    """Write a run's generated token ids (one list per request, in request order) and, when given, the
    log-probability the engine gave each sampled token, to ``folder/<run>.json``; return a short sha256
    of each request's token ids, for comparing engines run by run. Token ids alone are a coarse check
    with dummy weights (near-flat logits: greedy decoding repeats a token or two); the log-probabilities
    compare the target's numbers along the common prefix."""
    import hashlib

    digests = [hashlib.sha256(json.dumps(t).encode()).hexdigest()[:16] for t in token_ids]
    if folder:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, run_id.replace("/", "_") + ".json")
        rec = {"run": run_id, "token_ids": token_ids, "digests": digests}
        if logprobs is not None:
            rec["logprobs"] = logprobs
        with open(path + ".tmp", "w") as f:
            json.dump(rec, f)
        os.replace(path + ".tmp", path)
    return digests


def _vllm_version() -> str | None:
    """The vllm this worker imported (the engine's, which a vllm_release engine takes from its own folder)."""
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", None)


def sampled_logprobs(completion) -> list[float | None]:
    """The log-probability of each sampled token of one vLLM completion (``SamplingParams(logprobs=0)``)."""
    out = []
    for tok, d in zip(completion.token_ids, completion.logprobs or []):
        lp = d.get(tok) if d else None
        if lp is None and d:
            lp = next(iter(d.values()))
        out.append(float(lp.logprob) if lp is not None else None)
    return out


def run_offline(spec, paths, events):
    from vllm import LLM, SamplingParams

    kw = engine_kwargs(spec, paths)
    acc = spec["runs"][0]["acceptance"] if spec["runs"] else None
    if "speculative_config" in kw:
        kw["speculative_config"] = with_acceptance(kw["speculative_config"], acc)
    t0 = time.time()
    llm = LLM(**kw)
    events.emit(event="ready", startup_s=round(time.time() - t0, 1), engine_kwargs=kw, vllm_version=_vllm_version())
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": spec["prompt"]}],
                                   add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(text, add_special_tokens=False)

    def metrics():
        try:
            return spec_metrics_from(llm.get_metrics())
        except Exception as e:  # noqa: BLE001 - measurements must not end a run
            return {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": None, "error": str(e)}
    for run in spec["runs"]:
        events.emit(event="run_start", run=run["id"])
        before = metrics()
        sp = SamplingParams(max_tokens=run["max_tokens"], temperature=run["temperature"],
                            ignore_eos=run["ignore_eos"], **({"logprobs": 0} if run.get("record_outputs") else {}))
        prompts = [{"prompt_token_ids": list(prompt_ids)} for _ in range(run["concurrency"])]
        t1 = time.time()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.time() - t1
        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        after = metrics()
        ttft = []
        for o in outs:
            m = getattr(o, "metrics", None)
            ft = getattr(m, "first_token_latency", None) if m is not None else None
            if isinstance(ft, (int, float)):
                ttft.append(ft)
        extra = {}
        if run.get("record_outputs"):
            extra["output_digests"] = record_outputs(spec.get("outputs_dir"), run["id"],
                                                     [list(o.outputs[0].token_ids) for o in outs],
                                                     [sampled_logprobs(o.outputs[0]) for o in outs])
        events.emit(event="run_end", run=run["id"], outcome="ok", requests_completed=len(outs),
                    requests_failed=run["concurrency"] - len(outs), output_tokens=ntok, wall_s=round(wall, 3),
                    output_tok_s=round(ntok / wall, 1) if wall else None,
                    spec_decode_metrics=spec_delta(before, after), hook=hook_stats(spec.get("hook_dir")),
                    ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99), prompt_tokens=len(prompt_ids), **extra)
    try:  # a clean engine shutdown lets the hook in the engine process write its last records
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


# ----------------------------------------------------------------------------- server

def server_cli(kw: dict, port: int, name: str) -> list[str]:
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--port", str(port),
            "--host", "127.0.0.1", "--served-model-name", name, "--api-key", "sk-local"]
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if k == "disable_log_stats":
            continue
        if isinstance(v, bool):
            if v:
                args.append(flag)
            elif k in ("enable_prefix_caching", "async_scheduling"):
                args.append("--no-" + k.replace("_", "-"))
        elif isinstance(v, dict):
            args += [flag, json.dumps(v)]
        else:
            args += [flag, str(v)]
    return args


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_ready(base: str, name: str) -> bool:
    """/health answers 200 and /v1/models lists ``name``: this engine's server, not another one's."""
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            if r.status != 200:
                return False
        req = urllib.request.Request(base + "/v1/models", headers={"Authorization": "Bearer sk-local"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return any(m.get("id") == name for m in json.loads(r.read().decode()).get("data", []))
    except (OSError, ValueError, http.client.HTTPException):
        return False


SETTLE_S = 5.0  # how long a run whose requests failed waits for the server process to be seen exiting


def serve_run(base: str, name: str, prompt: str, run: dict, alive, scrape, hook_dir=None,
              timeout: float = 300.0) -> dict:
    """One server-mode run: ``run["concurrency"]`` concurrent chat requests, measured by
    :mod:`dflash_lab.servebench`; returns the ``run_end`` fields, ``outcome`` included.

    ``alive()`` says whether the server process still runs; ``scrape()`` reads its spec-decode
    counters (None when the server does not answer). They are read right after the requests, while the server still
    runs (an API server outlives its dead engine core for a moment: s19's crash lines have them), before any wait for
    it to exit; a server already gone has none to read, and the line's ``spec_decode_metrics`` is then None. Outcome: ``ok`` when every request completed (status 200, a full stream, no
    in-stream error) and the server is alive, else ``crash``. ``serve_metrics`` holds the
    run's metrics under ``vllm bench serve``'s names, ``request_errors`` how requests failed.
    """
    before = scrape()
    body = {"model": name, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": run["max_tokens"], "temperature": run["temperature"],
            "stream": run["stream"], "ignore_eos": run["ignore_eos"]}
    if run["stream"]:
        body["stream_options"] = {"include_usage": True}
    n = run["concurrency"]
    results, wall = servebench.run_requests(base + "/v1/chat/completions", body, n, n, timeout=timeout)
    after = scrape() if alive() else None
    dead = not alive()
    if not dead and any(not r.success for r in results):
        # a server that dropped its streams may still be exiting: its sockets close before its process has ended,
        # so one look right after the requests can see it alive (a flaky "alive" crash line before this wait)
        deadline = time.monotonic() + SETTLE_S
        while not dead and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = not alive()
    ok = [r for r in results if r.success]
    ntok = sum(servebench.output_len(r) for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [(r.latency - r.ttft) / (servebench.output_len(r) - 1) for r in ok
            if r.ttft is not None and servebench.output_len(r) > 1]
    outcome = "ok" if len(ok) == n and not dead else "crash"
    return dict(outcome=outcome, requests_completed=len(ok), requests_failed=n - len(ok),
                http_statuses=[r.status if r.status is not None else 0 for r in results],
                output_tokens=ntok, wall_s=round(wall, 3),
                output_tok_s=round(ntok / wall, 1) if wall else None,
                request_throughput=round(len(ok) / wall, 3) if wall else None,
                ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99),
                tpot_p50_s=pct(tpot, 50), tpot_p99_s=pct(tpot, 99),
                serve_metrics=servebench.calculate_metrics(results, wall),
                request_errors=servebench.summarize_failures(results),
                spec_decode_metrics=spec_delta(before, after), hook=hook_stats(hook_dir),
                spec_counters_read=before is not None and after is not None, server_alive=not dead)


def run_server(spec, paths, events):
    kw = engine_kwargs(spec, paths)
    acc = spec["runs"][0]["acceptance"] if spec["runs"] else None
    if "speculative_config" in kw:
        kw["speculative_config"] = with_acceptance(kw["speculative_config"], acc)
    # a port and a model name of this engine alone: a server left over from an earlier engine (it would
    # hold the GPU and, with SO_REUSEPORT, share a fixed port) can never pass this one's readiness check
    port = int(spec.get("port") or free_port())
    name = f"dflash-lab-{os.getpid()}"
    cmd = server_cli(kw, port, name)
    t0 = time.time()
    # the server stays in the worker's process group: when the runner kills the group (timeout, deadline,
    # crash, or after the last run) the server and its engine processes go with it
    proc = subprocess.Popen(cmd, stdout=sys.stdout, stderr=sys.stderr)

    def stop(*_):
        """Ask the server to shut down (it stops its engine), then make sure it is gone."""
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    signal.signal(signal.SIGTERM, lambda *a: (stop(), sys.exit(143)))
    base = f"http://127.0.0.1:{port}"
    while not server_ready(base, name):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} during start-up")
        time.sleep(2)
    events.emit(event="ready", startup_s=round(time.time() - t0, 1), engine_kwargs=kw, server_cmd=cmd,
                vllm_version=_vllm_version())

    def scrape():
        try:
            with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
                return spec_metrics_from_prometheus(r.read().decode())
        except (OSError, http.client.HTTPException, ValueError):  # a server dying mid-answer too: not read
            return None

    try:
        for run in spec["runs"]:
            events.emit(event="run_start", run=run["id"])
            fields = serve_run(base, name, spec["prompt"], run, lambda: proc.poll() is None, scrape,
                               hook_dir=spec.get("hook_dir"))
            outcome = fields["outcome"]
            events.emit(event="run_end", run=run["id"], **fields)
            if outcome == "crash":
                time.sleep(5)  # let the server write its last log lines
                if os.environ.get("CUDA_ENABLE_COREDUMP_ON_EXCEPTION") == "1":
                    try:  # a GPU core dump is being written: let the server finish and exit by itself
                        proc.wait(timeout=240)
                    except subprocess.TimeoutExpired:
                        pass
                stop()
                sys.exit(3)
    finally:
        stop()


def main(argv=None):
    argv = argv if argv is not None else sys.argv[1:]
    spec = json.load(open(argv[0]))
    events = Events(argv[1])
    from .models import build

    paths = build(spec["engine"]["target"], spec["models_dir"])
    try:
        if spec["engine"]["mode"] == "server":
            run_server(spec, paths, events)
        else:
            run_offline(spec, paths, events)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the parent classifies from the text
        text = f"{type(e).__name__}: {e}"
        events.emit(event="error", error=text[:4000])
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    sys.stdout.flush()
    os._exit(0)  # do not wait for engine teardown; every run is reported


if __name__ == "__main__":
    main()
