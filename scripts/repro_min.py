#!/usr/bin/env python3
"""Minimal reproducer for the vLLM 0.22.1 DFlash + FULL CUDA graph bug (needs only vLLM 0.22.1 and a GPU).

    python scripts/repro_min.py [--concurrency 4] [--tokens 48] [--no-reference] [--json OUT.json]

What it builds: a tiny random Qwen3.5-MoE target (8 layers: 6 Gated-DeltaNet + 2 full attention,
layers 3 and 7) and a 1-layer DFlash draft whose attention shape differs from the target's, both
as config.json only (``load_format="dummy"``, no tokenizer). vLLM groups KV-cache layers by spec
with a group size set by the smallest spec (the draft's one layer), so the target's two attention
layers land in two KV-cache groups of the same spec: group "layer 3" builds the FlashAttention
metadata every step, group "layer 7" reuses it (``update_block_table``). Its FULL CUDA graphs were
captured reading *its own* builder's persistent FA3 ``scheduler_metadata``, which nothing
refreshes after capture.

What it checks, in one engine (``cudagraph_mode=FULL_AND_PIECEWISE``, DFlash k=15, greedy):
  1. after a generation, the FA3 schedule the reusing group's FULL graphs read vs the schedule
     the step computed (the first group's buffer): ``stale`` if they differ;
  2. the same prompts again with the one-function fix applied in the worker (the reused schedule
     is copied into the group's own buffer): ``fresh`` expected;
  3. unless ``--no-reference``: a second engine with ``cudagraph_mode=PIECEWISE`` (never replays
     a FULL graph) as the reference; greedy tokens and their log-probabilities of stock FULL and
     fixed FULL are compared with it.

Last line: a one-line verdict, e.g.
  ``REPRODUCED: group of layer 7 replays a stale FA3 schedule (stock: 30 entries differ); ...``
Exit 0 when the bug reproduced and the fix removed it, 1 otherwise, 2 on a setup error.
"""

from __future__ import annotations

import argparse
import json
import os
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


def write_models(root: str) -> tuple[str, str]:
    """config.json of the target and of the draft (dummy weights come from vLLM)."""
    t = TARGET_TEXT
    tdir, ddir = os.path.join(root, "target"), os.path.join(root, "draft")
    os.makedirs(tdir, exist_ok=True)
    os.makedirs(ddir, exist_ok=True)
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
    for d, c in ((tdir, cfg), (ddir, dcfg)):
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f, indent=1)
    return tdir, ddir


# ---- run inside the worker process (collective_rpc): no closure over outer state

def _schedules(worker):
    """Per FlashAttention group: its layers, spec and the persistent FA3 schedule its FULL graphs read."""
    out = []
    runner = worker.model_runner
    for gid, ags in enumerate(runner.attn_groups):
        for ag in ags:
            b = ag.get_metadata_builder(0)
            buf = getattr(b, "scheduler_metadata", None)
            if buf is None or not getattr(b, "use_full_cuda_graph", False):
                continue
            out.append({"gid": gid, "layers": list(ag.layer_names), "spec": repr(ag.kv_cache_spec),
                        "schedule": buf.cpu().tolist()})
    return out


def _apply_fix(worker):
    """The fix: FULL graphs of a group that reuses another group's metadata read the current schedule."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder as B

    if getattr(B.update_block_table, "_repro_fix", False):
        return True
    stock = B.update_block_table

    def update_block_table(self, metadata, blk_table, slot_mapping):
        new = stock(self, metadata, blk_table, slot_mapping)
        own, cur = getattr(self, "scheduler_metadata", None), new.scheduler_metadata
        if self.use_full_cuda_graph and own is not None and cur is not None and cur.data_ptr() != own.data_ptr():
            n = cur.shape[0]
            own[:n].copy_(cur)
            own[n:].zero_()
            new.scheduler_metadata = own[:n]
        return new

    update_block_table._repro_fix = True
    B.update_block_table = update_block_table
    return True


def stale_groups(schedules: list[dict]) -> list[dict]:
    """Groups whose graph-read schedule differs from the first group of the same spec (which builds)."""
    first, out = {}, []
    for s in schedules:
        if s["spec"] not in first:
            first[s["spec"]] = s
            continue
        ref = first[s["spec"]]["schedule"]
        diff = [i for i, (a, b) in enumerate(zip(ref, s["schedule"])) if a != b]
        out.append({"gid": s["gid"], "layers": s["layers"], "reuses_gid": first[s["spec"]]["gid"],
                    "entries_differ": len(diff), "first_diff": diff[:4]})
    return out


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


def engine(tdir, ddir, mode, concurrency):
    from vllm import LLM

    t0 = time.time()
    llm = LLM(model=tdir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=4096, max_num_seqs=max(8, concurrency), max_num_batched_tokens=4096,
              gpu_memory_utilization=0.3, language_model_only=True, gdn_prefill_backend="triton",
              moe_backend="triton", compilation_config={"cudagraph_mode": mode},
              speculative_config={"method": "dflash", "model": ddir, "num_speculative_tokens": 15})
    return llm, round(time.time() - t0, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--no-reference", action="store_true", help="skip the PIECEWISE reference engine")
    ap.add_argument("--json", help="write the detailed result here")
    ap.add_argument("--write-configs-only", metavar="DIR", help="write the two config.json files and stop")
    a = ap.parse_args(argv)
    if a.concurrency < 2 or a.tokens < 2:
        print("repro_min: --concurrency and --tokens must be >= 2", file=sys.stderr)
        return 2
    if a.write_configs_only:
        print(json.dumps(write_models(a.write_configs_only)))
        return 0
    try:
        import vllm
    except ImportError as e:
        print(f"repro_min: vLLM is not importable ({e})", file=sys.stderr)
        return 2
    if vllm.__version__ != "0.22.1":
        print(f"repro_min: written for vLLM 0.22.1, this is {vllm.__version__}", file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="repro-min-")
    tdir, ddir = write_models(root)
    prompts = [[11 + 7 * i + j for j in range(24 + 5 * i)] for i in range(a.concurrency)]
    res = {"vllm": vllm.__version__, "concurrency": a.concurrency, "tokens": a.tokens}

    llm, res["startup_full_s"] = engine(tdir, ddir, "FULL_AND_PIECEWISE", a.concurrency)
    res["stock"] = generate(llm, prompts, a.tokens)
    res["stale_stock"] = stale_groups(llm.collective_rpc(_schedules)[0])
    llm.collective_rpc(_apply_fix)
    res["fixed"] = generate(llm, prompts, a.tokens)
    res["stale_fixed"] = stale_groups(llm.collective_rpc(_schedules)[0])
    del llm
    import gc

    gc.collect()
    if not a.no_reference:
        ref, res["startup_piecewise_s"] = engine(tdir, ddir, "PIECEWISE", a.concurrency)
        res["reference"] = generate(ref, prompts, a.tokens)
        res["stock_vs_reference"] = compare(res["stock"], res["reference"])
        res["fixed_vs_reference"] = compare(res["fixed"], res["reference"])
    stale = [s for s in res["stale_stock"] if s["entries_differ"]]
    still = [s for s in res["stale_fixed"] if s["entries_differ"]]
    reproduced = bool(stale)
    fixed = not still and ("fixed_vs_reference" not in res or res["fixed_vs_reference"][0] == 0)
    res["verdict"] = {"reproduced": reproduced, "fix_removes_it": fixed}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)
    groups = ", ".join(f"group {s['gid']} (layers {[l.split('layers.')[1].split('.')[0] for l in s['layers']]}) "
                       f"{s['entries_differ']} entries" for s in stale) or "none"
    line = (("REPRODUCED" if reproduced else "NOT REPRODUCED")
            + f": FULL graphs replaying a stale FA3 schedule: stock {groups}; with the fix "
            + (f"{len(still)} group(s)" if still else "none"))
    if "stock_vs_reference" in res:
        sd, sw = res["stock_vs_reference"]
        fd, fw = res["fixed_vs_reference"]
        line += (f"; greedy vs PIECEWISE reference: stock {sd}/{a.concurrency} requests differ "
                 f"(max |dlogprob| {sw:.3g}), fixed {fd}/{a.concurrency} (max {fw:.3g})")
    line += f"; start-up {res['startup_full_s']} s" + (
        f" + {res['startup_piecewise_s']} s" if "startup_piecewise_s" in res else "")
    print(line, flush=True)
    return 0 if reproduced and fixed else 1


if __name__ == "__main__":
    sys.exit(main())
