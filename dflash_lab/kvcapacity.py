"""How many requests vLLM 0.22.1 runs at once on the hybrid target, with and without DFlash (issue 11).

At concurrency 64 every DFlash engine of the benchmark ran at most 49 requests at once (vLLM's stats: 15 waiting,
KV cache 98.8% full) while no speculation ran all 64 at 9.2%, although each request holds only ~561 tokens. This
module redoes vLLM 0.22.1's block accounting for the hybrid target, so the recorded logs can be checked against it
(:func:`check_log`). The rules, as read in the pinned source (paths under ``vllm/``):

- **GDN (linear attention) state per layer**: a conv state of ``conv_dim x (conv_kernel - 1 + k)`` in bf16, with k
  the number of speculative tokens (``model_executor/layers/mamba/mamba_utils.py:223-227``, k from
  ``model_executor/models/qwen3_5.py:694``), and a temporal state of ``heads_v x head_k x head_v`` in fp32 (``mamba_ssm_dtype``,
  ``model_executor/models/config.py:536-550``).
- **Attention block size** is raised until an attention page holds a GDN state: ``16 * cdiv(gdn page,
  16 * bytes per token)`` (``platforms/interface.py:620-669``), the GDN page padded up to it; the log prints
  "Setting attention block size to N tokens".
- **Layers are grouped by KV spec** (GDN; the target's attention, 2 KV heads x 256; the draft's attention, 4 KV
  heads x 128, a spec of its own), every group holding as many layers as the smallest bucket, or the largest when it
  is less than 1.5 times the smallest (``v1/core/kv_cache_utils.py:1141-1152``); a block is one page per layer of a
  group (``:950``).
- **Blocks per request**: an attention group ``cdiv(tokens, block size)``; a GDN group, with prefix caching off (the
  default for this hybrid: ``config/model.py:1859``, ``engine/arg_utils.py:2369``) and so a GDN block size of
  ``max_model_len`` (``model_executor/models/config.py:350-394``), ``cdiv(tokens + max_model_len * k,
  max_model_len)`` = 1 + k blocks: speculative decoding keeps k extra states per request
  (``model_executor/layers/mamba/abstract.py:55``, ``v1/core/single_type_kv_cache_manager.py:961-966``).
- **The pool**: the log's "GPU KV cache size: N tokens" is ``int(blocks / worst-case blocks per request *
  max_model_len)`` (``v1/core/kv_cache_utils.py:885-894, 1726-1731``), from which the number of blocks follows;
  usage is ``used / (blocks - 1)``, one block being the null block (``v1/core/block_pool.py:500-508``).

So a DFlash k=15 request holds 6 GDN groups x 16 blocks + 3 attention blocks = 99 blocks of 5 layer pages each, about
1.1 GiB (its 30 GDN layers keep 16 states of 2.4 MB each), a plain request 3 x 1 + 1 = 4 blocks of 10 pages, about
83 MiB: some 14 times less. The group size, and so the block count, depends on the draft's layer count (the assumed
5-layer draft, ``dflash_lab.models``); the bytes hardly do. Modelled: TP=1, prefix caching off, FlashAttention's
16-token block alignment with vLLM's default block size (:func:`check_log` reads the first two from the log and says
"not modelled" otherwise). The numbers for other configurations (:func:`what_if`) are predictions from these rules,
not runs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .errors import LabError
from .models import TARGETS

ATTN_BLOCK_ALIGN = 16   # vLLM rounds the hybrid attention block size to a multiple of 16 tokens
BF16, FP32 = 2, 4


@dataclass(frozen=True)
class Layout:
    """The KV-cache layout vLLM 0.22.1 builds for one engine configuration."""
    k: int                    # speculative tokens (0: no speculation)
    max_model_len: int
    block_size: int           # attention block size, tokens
    page_bytes: int           # one layer's page (attention block, or a GDN state padded to it)
    group_size: int           # layers per KV-cache group
    groups: dict              # {"gdn": n, "attention": n, "draft": n}: groups per layer bucket


def gdn_state_bytes(text: dict, k: int) -> int:
    """One GDN layer's state: conv (bf16, conv_kernel - 1 + k columns) plus temporal (fp32)."""
    conv_dim = 2 * text["linear_num_key_heads"] * text["linear_key_head_dim"] + \
        text["linear_num_value_heads"] * text["linear_value_head_dim"]
    conv = conv_dim * (text["linear_conv_kernel_dim"] - 1 + k) * BF16
    ssm_bytes = FP32 if text.get("mamba_ssm_dtype", "float32") == "float32" else BF16
    temporal = text["linear_num_value_heads"] * text["linear_key_head_dim"] * text["linear_value_head_dim"] * ssm_bytes
    return conv + temporal


def group_size(buckets: dict) -> int:
    """Layers per KV-cache group: the smallest bucket, or the largest when it is less than 1.5 times the smallest."""
    lo, hi = min(buckets.values()), max(buckets.values())
    return hi if hi < lo * 1.5 else lo


def layout(target: str = "qwen36-35b-a3b", k: int = 0, max_model_len: int = 65536) -> Layout:
    """The layout of ``target`` with DFlash k (its draft's attention layers included) or, k = 0, no speculation."""
    if target not in TARGETS or TARGETS[target]["family"] != "hybrid":
        raise LabError(f"kvcapacity models the hybrid targets only, not {target!r}")
    if k and not TARGETS[target].get("draft"):
        raise LabError(f"target {target!r} has no DFlash draft to model k={k} with")
    if k < 0 or max_model_len < 1:
        raise LabError(f"k must be >= 0 and max_model_len >= 1 (got k={k}, max_model_len={max_model_len})")
    t = TARGETS[target]
    text = t["text"]
    n_attn = text["num_hidden_layers"] // text["full_attention_interval"]
    buckets = {"gdn": text["num_hidden_layers"] - n_attn, "attention": n_attn}
    per_token = {"attention": 2 * text["num_key_value_heads"] * text["head_dim"] * BF16}
    if k:
        d = t["draft"]
        buckets["draft"] = d["layers"]
        per_token["draft"] = 2 * d["kv_heads"] * d["head_dim"] * BF16
    if len(set(per_token.values())) > 1:
        raise LabError(f"attention specs with different bytes per token {per_token}: not modelled")
    tok_bytes = next(iter(per_token.values()))
    state = gdn_state_bytes(text, k)
    block = ATTN_BLOCK_ALIGN * math.ceil(state / (ATTN_BLOCK_ALIGN * tok_bytes))
    size = group_size(buckets)
    return Layout(k=k, max_model_len=max_model_len, block_size=block, page_bytes=block * tok_bytes, group_size=size,
                  groups={b: math.ceil(n / size) for b, n in buckets.items()})


def blocks_per_request(lay: Layout, tokens: int) -> int:
    """Blocks one request of ``tokens`` tokens holds (prefix caching off, vLLM's default for this target)."""
    attn = sum(n for b, n in lay.groups.items() if b != "gdn") * math.ceil(tokens / lay.block_size)
    gdn = lay.groups["gdn"] * math.ceil((tokens + lay.max_model_len * lay.k) / lay.max_model_len)
    return attn + gdn


def bytes_per_request(lay: Layout, tokens: int) -> int:
    """KV-cache bytes one request of ``tokens`` tokens holds (its blocks, one page per layer of a group each)."""
    return blocks_per_request(lay, tokens) * lay.page_bytes * lay.group_size


def pool_blocks(lay: Layout, kv_cache_tokens: int) -> int:
    """The engine's number of KV blocks, from the "GPU KV cache size: N tokens" it logged."""
    worst = blocks_per_request(lay, lay.max_model_len)
    return math.ceil(kv_cache_tokens * worst / lay.max_model_len - 1e-9)


def pool_blocks_from_memory(lay: Layout, available_bytes: float) -> int:
    """Blocks that ``available_bytes`` of KV-cache memory hold (one page per layer of a group per block)."""
    return int(available_bytes // (lay.page_bytes * lay.group_size))


def usage_pct(lay: Layout, blocks: int, running: int, tokens: int) -> float:
    """vLLM's logged "GPU KV cache usage" with ``running`` requests of ``tokens`` tokens each."""
    return 100.0 * running * blocks_per_request(lay, tokens) / (blocks - 1)


def max_running(lay: Layout, blocks: int, tokens: int) -> int:
    """How many requests of ``tokens`` tokens fit at once."""
    return (blocks - 1) // blocks_per_request(lay, tokens)


# ----------------------------------------------------------------------------- the engine logs

_BLOCK = re.compile(r"Setting attention block size to (\d+) tokens")
_SIZE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_AVAIL = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
_STATS = re.compile(r"Running: (\d+) reqs, Waiting: (\d+) reqs, GPU KV cache usage: ([\d.]+)%")
_CONFIG = {"k": re.compile(r"num_spec_tokens=(\d+)"), "max_model_len": re.compile(r"max_seq_len=(\d+)"),
           "tensor_parallel_size": re.compile(r"tensor_parallel_size=(\d+)"),
           "prefix_caching": re.compile(r"enable_prefix_caching=(True|False)")}


def log_facts(text: str) -> dict:
    """What an engine log says of its KV cache: attention block size, KV cache size in tokens, available memory,
    and every distinct (running, waiting, usage %) of its stats lines."""
    b, s, a = _BLOCK.search(text), _SIZE.search(text), _AVAIL.search(text)
    cfg = {key: rx.search(text) for key, rx in _CONFIG.items()}
    return {"k": int(cfg["k"].group(1)) if cfg["k"] else 0,   # no speculative config printed: no speculation
            "max_model_len": int(cfg["max_model_len"].group(1)) if cfg["max_model_len"] else None,
            "tensor_parallel_size": int(cfg["tensor_parallel_size"].group(1)) if cfg["tensor_parallel_size"] else None,
            "prefix_caching": (cfg["prefix_caching"].group(1) == "True") if cfg["prefix_caching"] else None,
            "block_size": int(b.group(1)) if b else None,
            "kv_cache_tokens": int(s.group(1).replace(",", "")) if s else None,
            "available_gib": float(a.group(1)) if a else None,
            "stats": sorted({(int(r), int(w), float(u)) for r, w, u in _STATS.findall(text)})}


def check_log(text: str, k: int, tokens: int, target: str = "qwen36-35b-a3b", max_model_len: int = 65536) -> dict:
    """The model against one engine log: the attention block size it set, and for every stats line with requests
    running the usage the rules predict (``tokens``: a request's largest length in the runs, prompt plus output;
    a shorter request holds the same blocks while both fit one attention block), with the largest difference.
    ``fits``: the requests that fit at once."""
    f = log_facts(text)
    if f["kv_cache_tokens"] is None:
        raise LabError("the engine log has no 'GPU KV cache size' line: nothing to check")
    for key, want in (("k", k), ("max_model_len", max_model_len)):
        if f[key] is not None and f[key] != want:
            raise LabError(f"the engine log has {key}={f[key]}, not {want}")
    if f["tensor_parallel_size"] not in (None, 1) or f["prefix_caching"]:
        raise LabError(f"not modelled: tensor_parallel_size={f['tensor_parallel_size']}, "
                       f"prefix caching {f['prefix_caching']} (kvcapacity models TP=1 without prefix caching)")
    lay = layout(target, k, max_model_len)
    if tokens + 2 * k > lay.block_size:   # vLLM allocates for the tokens, the drafts and the lookahead slots
        raise LabError(f"requests of {tokens} tokens (+{2 * k} draft and lookahead slots) span several attention "
                       f"blocks of {lay.block_size}: their usage changes during a run, not modelled")
    blocks = pool_blocks(lay, f["kv_cache_tokens"])
    lines = [{"running": r, "waiting": w, "logged %": u, "predicted %": round(usage_pct(lay, blocks, r, tokens), 2)}
             for r, w, u in f["stats"] if r > 0]
    return {"k": k, "block_size logged": f["block_size"], "block_size predicted": lay.block_size,
            "pool blocks": blocks, "blocks per request": blocks_per_request(lay, tokens),
            "MiB per request": round(bytes_per_request(lay, tokens) / 2**20, 1),
            "fits": max_running(lay, blocks, tokens), "peak running logged": max((x["running"] for x in lines), default=None),
            # requests seen waiting: the engine ran all it could, so this is what fitted
            "peak running while queued": max((x["running"] for x in lines if x["waiting"] > 0), default=None),
            "stats lines": len(lines),   # distinct (running, waiting, usage) lines with requests running
            "largest difference (points)": max((abs(x["logged %"] - x["predicted %"]) for x in lines), default=None),
            "lines": lines, "available_gib": f["available_gib"]}


LOG_ROUNDING_POINTS = 0.05   # vLLM logs the KV-cache usage to 0.1 %: a prediction within half of that matches


def matches(row: dict) -> bool:
    """Whether a checked engine (:func:`check_log`, :func:`engines` row) agrees with the rules: the attention block
    size it set, and every stats line's usage within the log's rounding."""
    diff = row["largest difference (points)"]
    # an engine that died before its first stats line (s26's stock FULL starts) has no usage to compare: its block
    # size still is
    no_lines = diff is None or (isinstance(diff, float) and math.isnan(diff))
    return (row["block_size logged"] in (None, row["block_size predicted"])
            and (no_lines or diff <= LOG_ROUNDING_POINTS + 1e-9))


def what_if(available_gib: float, tokens: int, ks=(15, 12, 11, 7), max_num_seqs: int = 64,
            target: str = "qwen36-35b-a3b", max_model_len: int = 65536) -> list[dict]:
    """Predicted requests that fit at once for DFlash with other k and the same KV-cache memory, and those that run
    (at most ``max_num_seqs``): a prediction from the rules above, never run; the memory left for the KV cache also
    moves a little with the configuration, and whether the DFlash draft accepts a k other than 15 is not checked."""
    rows = []
    for k in ks:
        lay = layout(target, k, max_model_len)
        blocks = pool_blocks_from_memory(lay, available_gib * 2**30)
        fit = max_running(lay, blocks, tokens)
        rows.append({"k": k, "blocks per request": blocks_per_request(lay, tokens), "pool blocks": blocks,
                     "requests that fit": fit, "run at once (max_num_seqs)": min(fit, max_num_seqs)})
    return rows


def engines(runs_df, read=None) -> list[dict]:
    """:func:`check_log` for every engine log of bench lines (``runs_df`` from :func:`dflash_lab.bench.load_bench`,
    with its ``engine_log``, ``prompt_tokens`` (a run's mean prompt) and ``max_tokens``): one row per log that
    printed its KV cache size, with k and max_model_len as the log printed them and the request length the
    largest run-mean prompt plus the largest max_tokens of its lines. A log the model does not cover (no prompt
    measured, other TP, prefix caching, longer requests) gets a row saying why in ``not checked``."""
    from . import analysis

    read = read or analysis.read_text
    rows = []
    for log, g in runs_df.dropna(subset=["engine_log"]).groupby("engine_log", sort=True):
        text = read(log)
        if not _SIZE.search(text):
            continue
        base = {"session": g["gpu_session"].iloc[0], "mode": g["mode"].iloc[0],
                "engine log": "/".join(log.replace("\\", "/").rsplit("/", 2)[-2:])}
        prompt, out = g["prompt_tokens"].max(), g["max_tokens"].max()
        if not (prompt == prompt and out == out):   # NaN: no run of this engine measured its prompt
            rows.append({**base, "not checked": "no run of this engine measured its prompt length"})
            continue
        f = log_facts(text)
        try:
            r = check_log(text, f["k"], int(prompt + out), max_model_len=f["max_model_len"] or 65536)
        except LabError as e:
            rows.append({**base, "k": f["k"], "not checked": str(e)})
            continue
        rows.append({**base, "request tokens": int(prompt + out), "not checked": "",
                     **{k: v for k, v in r.items() if k != "lines"}})
    return rows
