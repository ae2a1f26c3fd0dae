"""vLLM 0.22.1's own ``AsyncScheduler`` on the CPU, driven by a stand-in model runner.

The scheduler, its request and KV-cache accounting and its configuration classes are vLLM's, imported from the pinned
distribution's sources (:mod:`vllm_sources`: an installed vLLM 0.22.1, else the sha256-checked wheel's Python files;
the files this module rests on are checked against the distribution's RECORD before the import). Only the model runner
is replaced: each scheduled row gets back ``1 + accept`` sampled tokens, a partial prefill chunk none, and chosen decode
rows come back empty (``[]``), which is what vLLM's runner returns for a row whose sampled ids are all invalid
(``RejectionSampler.parse_output`` drops ids at or above the vocabulary size: the out-of-vocabulary id a NaN row gets).

Two engine orders (vLLM 0.22.1, ``v1/engine/core.py``):
- ``overlapped``: ``step_with_batch_queue`` with a queue of two, as an async-scheduling engine runs: the step after
  ``n`` is scheduled before ``n``'s output is applied;
- ``serial``: schedule, run, apply, one step at a time (what the engine does when the worker has already finished).

What it measures is the scheduler's accounting of a row with no token: the async scheduler adds ``1 + k``
placeholders per scheduled step (``async_scheduler.py``), and ``update_from_output`` takes them back only for a row
with a token (``scheduler.py``); the ``max_tokens`` guard of ``schedule`` reads a placeholder as a step in flight.

Needs vLLM's Python dependencies (pyproject's ``cpu`` extra lists the ones its scheduler's import chain asks for),
not its compiled kernels: the import prints that ``vllm._C`` is missing, which the scheduler never uses.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache

from .errors import LabError
from .kinds import whole

#: the files of vLLM 0.22.1 whose code this module runs and reports on (checked against RECORD before the import)
SCHED_FILES = ("vllm/v1/core/sched/async_scheduler.py", "vllm/v1/core/sched/scheduler.py", "vllm/v1/request.py",
               "vllm/v1/engine/core.py", "vllm/v1/outputs.py")
ORDERS = ("overlapped", "serial")
RESULT = "dflash-lab asyncsched result: "   # the child's result line, apart from vLLM's own log lines
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192   # room for a prompt, its output and the computed tokens that leaked steps add
# a tiny Qwen3 config: the scheduler reads the model config's lengths, never weights
_TINY_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1024, "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


@lru_cache(maxsize=1)
def _import_vllm() -> str:
    """Make ``import vllm`` give vLLM 0.22.1's verified sources; returns where they come from."""
    from . import VLLM_VERSION, vllm_sources

    tree = vllm_sources.source_tree()
    for f in SCHED_FILES:
        vllm_sources.read_source(f)   # raises unless the file is the distribution's
    if tree.origin != "installed":
        if str(tree.root) not in sys.path:
            sys.path.insert(0, str(tree.root))
        # vLLM inspects a model class in a subprocess of its own (registry._run_in_subprocess) unless its modelinfo
        # cache (~/.cache/vllm/modelinfos) already has it: on a fresh machine that subprocess must find the sources too
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(tree.root) not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([str(tree.root)] + paths)
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise LabError(f"cannot import vLLM {VLLM_VERSION}'s scheduler on this machine ({e}); its Python dependencies "
                       "come with pyproject's cpu extra: pip install -e '.[cpu]'") from None
    from importlib import metadata

    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        version = None
    if version != VLLM_VERSION:
        raise LabError(f"import vllm found version {version!r}, not {VLLM_VERSION}")
    return f"{tree.origin}: {tree.root}"


def build_scheduler(k: int = 15, max_model_len: int = 4096, max_num_seqs: int = 64, num_blocks: int = 8192):
    """vLLM 0.22.1's scheduler class for async scheduling with ``k`` speculative tokens (``AsyncScheduler``; an
    error otherwise), on the CPU, with one full-attention KV-cache group of ``num_blocks`` blocks.
    Speculative method ``ngram_gpu``: 0.22.1 refuses plain ``ngram`` with async scheduling, and it needs no draft
    model on disk; the placeholder accounting does not depend on the method."""
    _import_vllm()
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    text = json.dumps(_TINY_CONFIG, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    folder = os.path.join(tempfile.gettempdir(), f"dflash-lab-tiny-qwen3-{digest}")
    os.makedirs(folder, exist_ok=True)
    cfg = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg):
        tmp = cfg + f".{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, cfg)
    model = ModelConfig(model=folder, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_model_len)
    sched_cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, max_model_len=max_model_len,
                                enable_chunked_prefill=True, async_scheduling=True, is_encoder_decoder=False)
    cache = CacheConfig(block_size=BLOCK_SIZE)
    config = VllmConfig(model_config=model, scheduler_config=sched_cfg, cache_config=cache,
                        speculative_config=SpeculativeConfig(method="ngram_gpu", num_speculative_tokens=k),
                        device_config=DeviceConfig(device="cpu"))   # no platform to detect on a CPU machine
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer0"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    cache.num_gpu_blocks = num_blocks
    cls = config.scheduler_config.get_scheduler_cls()
    if cls is not AsyncScheduler:
        raise LabError(f"vLLM chose {cls.__name__} for async scheduling, not AsyncScheduler")
    return cls(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
               block_size=BLOCK_SIZE, log_stats=False)


@dataclass
class Spec:
    """A run of the scheduler: ``requests`` of ``prompt`` tokens and ``max_tokens`` each (ids ``r0``, ``r1``, ...);
    each decode step accepts ``accept`` drafts (1 + accept tokens back); ``empty``: per request id, the output counts
    at which one decode row comes back with no token (the first row run while the request holds at least that many
    output tokens, once per count); ``order``: one of :data:`ORDERS`; at most ``steps`` engine steps."""
    requests: int = 3
    prompt: int = 49
    max_tokens: int = 512
    k: int = 15
    accept: int = 0
    empty: dict = field(default_factory=dict)
    order: str = "overlapped"
    steps: int = 2000

    def check(self) -> None:
        if self.order not in ORDERS:
            raise LabError(f"order {self.order!r}: one of {', '.join(ORDERS)}")
        for name, v, lo in (("requests", self.requests, 1), ("prompt", self.prompt, 1),
                            ("max_tokens", self.max_tokens, 2), ("k", self.k, 1), ("accept", self.accept, 0),
                            ("steps", self.steps, 1)):
            if not whole(v) or v < lo:
                raise LabError(f"{name} must be an integer >= {lo}, got {v!r}")
        if self.prompt + self.max_tokens > MAX_MODEL_LEN // 2:
            raise LabError(f"prompt + max_tokens must stay within {MAX_MODEL_LEN // 2} tokens (the rest is room for "
                           f"leaked steps): {self.prompt} + {self.max_tokens}")
        if self.accept > self.k:
            raise LabError(f"accept {self.accept} > k {self.k}: a step cannot accept more drafts than it has")
        ids = {f"r{i}" for i in range(self.requests)}
        for rid, counts in self.empty.items():
            if rid not in ids:
                raise LabError(f"empty rows for {rid!r}, which is not one of the run's requests ({sorted(ids)})")
            if any(not whole(c) or c < 0 or c >= self.max_tokens for c in counts):
                raise LabError(f"empty-row output counts of {rid} must lie in 0..{self.max_tokens - 1}: {counts!r}")


def _state(r, sched) -> dict:
    return {"request": r.request_id, "status": r.status.name, "running": r in sched.running,
            "output": len(r.output_token_ids), "computed": r.num_computed_tokens,
            "placeholders": r.num_output_placeholders}


def run(spec: Spec):
    """Drive the scheduler as :class:`Spec` says, in a child process (:func:`run_many`). Returns ``(events, final,
    summary)``: one row per update (engine step, the schedule it applies, each request's counters after it, whether its
    row came back empty); one row per request at the end (status, whether the scheduler still holds it in ``running``,
    output tokens, computed tokens, placeholders, empty rows given); and ``{"idle schedules": schedules that scheduled
    nothing while requests were unfinished, "unfinished": ..., "steps": ..., "vllm": where the sources came from}``."""
    return run_many([spec])[0]


def run_many(specs: list, timeout_s: float = 900.0) -> list:
    """:func:`run` for several specs in one child Python process: vLLM is imported there, never in the caller, so
    a notebook or test process keeps whatever ``vllm`` it had (none, or a stand-in). One clear error when a spec is
    wrong (checked here first) or the child fails (its last output lines)."""
    import dataclasses
    import subprocess

    import pandas as pd

    for spec in specs:
        spec.check()
    payload = json.dumps([dataclasses.asdict(s) for s in specs])
    try:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        p = subprocess.run([sys.executable, "-m", "dflash_lab.asyncsched"], input=payload, capture_output=True,
                           text=True, timeout=timeout_s, cwd=here)
    except subprocess.TimeoutExpired:
        raise LabError(f"vLLM's scheduler on the CPU did not finish {len(specs)} run(s) within "
                       f"{timeout_s:.0f} s") from None
    if p.returncode != 0:
        tail = "\n".join((p.stderr or p.stdout or "").strip().splitlines()[-6:])
        raise LabError(f"vLLM's scheduler on the CPU failed (exit {p.returncode}): {tail}")
    try:
        got = json.loads(next(x for x in reversed(p.stdout.splitlines()) if x.startswith(RESULT))[len(RESULT):])
    except (ValueError, StopIteration):
        raise LabError("vLLM's scheduler on the CPU wrote no result line") from None
    return [(pd.DataFrame(g["events"]), pd.DataFrame(g["final"]), g["summary"]) for g in got]


def _run_here(spec: Spec) -> dict:
    """One run in this process (the child's side of :func:`run_many`), as JSON-ready records."""
    spec.check()
    origin = _import_vllm()
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
    from vllm.v1.request import Request

    sched = build_scheduler(k=spec.k, max_model_len=MAX_MODEL_LEN)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    reqs = [Request(request_id=f"r{i}", prompt_token_ids=[10 + i] * spec.prompt,
                    sampling_params=SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True),
                    pooling_params=None, block_hasher=hasher) for i in range(spec.requests)]
    for r in reqs:
        sched.add_request(r)
    pending = {rid: sorted(c) for rid, c in spec.empty.items()}
    given = collections.Counter()
    next_tok = [100]

    def model(out, partial):
        """The stand-in runner: the sampled tokens of one scheduled step, and the requests whose row was empty."""
        if out.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT, set()
        ids, sampled, empty = list(out.num_scheduled_tokens), [], set()
        for rid in ids:
            if partial[rid]:
                sampled.append([])   # a prefill chunk that does not end the prompt samples nothing
                continue
            req = sched.requests.get(rid)
            todo = pending.get(rid)
            decode = rid in out.scheduled_spec_decode_tokens
            if decode and req is not None and todo and len(req.output_token_ids) >= todo[0]:
                todo.pop(0)
                given[rid] += 1
                empty.add(rid)
                sampled.append([])
                continue
            n = 1 + min(spec.accept, len(out.scheduled_spec_decode_tokens.get(rid, ())))
            sampled.append(list(range(next_tok[0], next_tok[0] + n)))
            next_tok[0] += n
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled), empty

    queue = collections.deque()
    size = 2 if spec.order == "overlapped" else 1
    events, idle, scheduled, step = [], 0, 0, 0
    for step in range(1, spec.steps + 1):
        if sched.has_requests():
            out = sched.schedule()
            scheduled += 1
            partial = {rid: sched.requests[rid].is_prefill_chunk for rid in out.num_scheduled_tokens}
            if out.total_num_scheduled_tokens == 0:
                idle += 1
            queue.appendleft((out, partial, scheduled))
            if out.total_num_scheduled_tokens > 0 and len(queue) < size:
                continue   # the worker is busy with the step before: schedule the next one first
        elif not queue:
            break
        out, partial, n = queue.pop()
        mro, empty = model(out, partial)
        sched.update_from_output(out, mro)
        for r in reqs:
            if r.request_id in out.num_scheduled_tokens:
                events.append({"step": step, "schedule": n, **_state(r, sched), "empty row": r.request_id in empty})
        if not sched.has_requests() and not queue:
            break
    final = [{**_state(r, sched), "empty rows": given[r.request_id]} for r in reqs]
    return {"events": events, "final": final, "summary": {"idle schedules": idle, "steps": step, "vllm": origin,
                                                          "unfinished": sched.get_num_unfinished_requests()}}


def stuck(final, summary, max_tokens: int):
    """The requests a run left held: still in the scheduler's ``running`` list, unfinished, at ``max_tokens - 1``
    output tokens, after schedules that scheduled nothing."""
    f = final[final["running"] & (final["status"] == "RUNNING") & (final["output"] == max_tokens - 1)]
    return f if summary["idle schedules"] > 0 else f.iloc[0:0]


REPLAY_KEY = ["empty rows", "output", "computed", "placeholders"]


def _replay_spec(t, k: int):
    """The :class:`Spec` that replays one ledger spin (:func:`replay_spin`) and the ledger's side of the comparison."""
    if t is None or not len(t):
        raise LabError("no spin to replay")
    if t["updates with no token"].isna().any():
        raise LabError("the spin line has no count of updates with no token (a ledger from before s57)")
    prompts, tops = set(t["prompt"].astype(int)), set(t["max_tokens"].astype(int))
    if len(prompts) != 1 or len(tops) != 1:
        raise LabError(f"held requests with prompts {sorted(prompts)} and max_tokens {sorted(tops)}: one of each "
                       "expected")
    mt = tops.pop()
    empty = {f"r{i}": [mt // 5 * (j + 1) for j in range(int(n) - 1)] + [mt - 1]
             for i, n in enumerate(t["updates with no token"])}
    gpu = t.rename(columns={"updates with no token": "empty rows", "output tokens": "output"})[REPLAY_KEY]
    return (Spec(requests=len(t), prompt=prompts.pop(), max_tokens=mt, k=k, empty=empty),
            sorted(map(tuple, gpu.astype(int).values.tolist())))


def replay_spins(spins, ks) -> list:
    """:func:`replay_spin` for several spins (``ks``: each one's k), in one child process (:func:`run_many`)."""
    if len(spins) != len(ks):
        raise LabError(f"{len(spins)} spins and {len(ks)} values of k")
    if not len(spins):
        return []
    prepared = [_replay_spec(t, k) for t, k in zip(spins, ks)]
    out = []
    for (spec, gpu), (_, fin, summary) in zip(prepared, run_many([p[0] for p in prepared])):
        out.append((gpu, sorted(map(tuple, fin[REPLAY_KEY].values.tolist())), len(stuck(fin, summary, spec.max_tokens))))
    return out


def replay_spin(t, k: int):
    """A ledger spin's held requests (:func:`schedledger.spin_table`: prompt, ``max_tokens``, updates that returned no
    token) replayed through the scheduler: one request per row, its empty rows spread over its output (at fifths of
    ``max_tokens``) with the last on its final step (output ``max_tokens - 1``). Returns ``(gpu, cpu, held)``: the
    ledger's and the scheduler's ``(empty rows, output, computed, placeholders)`` per request, each sorted, and how many
    requests the scheduler left held (:func:`stuck`). An error for a spin without the counts (s56's ledger) or with
    requests of different prompts or ``max_tokens``."""
    return replay_spins([t], [k])[0]


def _main() -> int:
    """The child of :func:`run_many`: a JSON list of specs on stdin, one JSON line of results on stdout (vLLM's own
    log lines go to stderr)."""
    try:
        specs = [Spec(**d) for d in json.load(sys.stdin)]
        out = [_run_here(s) for s in specs]
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write("\n" + RESULT + json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
