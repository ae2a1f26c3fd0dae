"""Model folders for the GPU runs: config.json (+ a small real tokenizer), weights made by vLLM.

Every target and draft here is loaded with ``load_format="dummy"``: vLLM builds the exact
architecture from ``config.json`` and fills it with random weights, so memory, shapes,
kernels, CUDA graphs and step times are those of the architecture, while acceptance comes
from vLLM's synthetic rejection sampler (``rejection_sample_method="synthetic"``).

Targets:

- ``qwen36-35b-a3b``: the Qwen3.6-35B-A3B architecture (Qwen3_5MoeForConditionalGeneration:
  40 layers, 3 Gated-DeltaNet : 1 full attention, 256 experts top-8, M-RoPE,
  ``mamba_ssm_dtype=float32`` as in the published Qwen3.5/3.6 MoE configs);
- ``tiny-hybrid``: the same family at toy size (8 layers, hidden 256, 16 experts);
- ``tiny-dense``: a 4-layer Qwen3 (no GDN, no MoE, no M-RoPE).

Drafts: a DFlash draft (``DFlashDraftModel``, block size 16) at each target's hidden size.
Every GPU run up to s68 used ``qwen36-35b-a3b``'s assumed draft: 5 Qwen3 layers, 32 heads, 4 KV heads, head_dim
128, intermediate 6144, target layers 1/10/19/28/37, mask token 248070 (recorded in every result line). Found in s69:
public material quotes the published draft's config (:data:`PUBLISHED_DRAFT`) with the same shape but 8 layers, some
of them sliding-window layers, which vLLM 0.22.1 builds as full attention; ``qwen36-35b-a3b-draft8`` is the target
with that draft.

The tokenizer is a byte-level BPE trained on the spot with the ``tokenizers`` library
(offline), with a ChatML-style chat template, so the OpenAI-compatible server and the
offline engine see real text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import LabError

REPORT_PROMPT = ("Prove 1^3+2^3+...+n^3=(n(n+1)/2)^2 with two methods, verify cases, "
                 "discuss generalizations. Be exhaustive.")

TOKENIZER_VOCAB = 4096
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN36_TEXT = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, hidden_act="silu", rms_norm_eps=1e-6,
    max_position_embeddings=262144, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=256,
    num_experts_per_tok=8, full_attention_interval=4, mamba_ssm_dtype="float32",
    attn_output_gate=True, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
)
TINY_HYBRID_TEXT = dict(
    QWEN36_TEXT, vocab_size=8192, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=128, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_num_key_heads=4, linear_num_value_heads=8, moe_intermediate_size=128,
    shared_expert_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
    max_position_embeddings=65536,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_interleaved": True, "mrope_section": [6, 5, 5]},
)

#: The published Qwen3.6-35B-A3B-DFlash draft, as public material quotes its ``config.json``: not read from the Hugging
#: Face hub (no route to it from this project's machines), found with the project's search tool on 2026-12-05 (s69).
#: ``shape`` is in the form of :data:`TARGETS`' drafts; ``not_copied`` is what the dummy draft leaves out.
PUBLISHED_DRAFT = {
    "model": "z-lab/Qwen3.6-35B-A3B-DFlash",
    "revision": "42d3b34d588423cdae7ba8f53a8cf7789346a719",
    "shape": dict(layers=8, heads=32, kv_heads=4, head_dim=128, inter=6144,
                  target_layer_ids=[1, 10, 19, 28, 37], mask_token_id=248070),
    "hidden_size": 2048, "vocab_size": 248320, "block_size": 16,
    # its attention kinds: sliding windows that vLLM 0.22.1 does not apply to a DFlash draft
    "layer_types": "sliding-window layers interleaved with full attention (z-lab/dflash#126: a z-lab maintainer on the "
                   "Qwen3.6 drafters; ikawrakow/ik_llama.cpp#2021: every layer but the last); #761 quotes 8 "
                   "full_attention layers after speculators' conversion. vLLM 0.22.1's qwen3_dflash.py passes no "
                   "per-layer sliding window to its Attention layers, and CacheConfig.sliding_window comes from the "
                   "target (set only for a target that is all sliding window; None for this one), so 0.22.1 builds "
                   "all 8 as full attention, as the dummy draft declares them. A release that applies the draft's "
                   "windows would group its layers otherwise (not computed here); which later releases ignore, refuse "
                   "or build a draft mixing sliding and full layers, read from each one's own source: the 'draft "
                   "sliding windows' field of data/upstream/releases.jsonl (upstream.draft_windows)",
    "not_copied": "its sliding windows (above), its RoPE (yarn, factor 64 over 4096 original positions, theta 1e7) and "
                  "262144 positions: the dummy draft declares full attention, default RoPE at theta 1e7 and 65536 "
                  "positions, as the 5-layer one did",
    "sources": [
        {"where": "https://github.com/vllm-project/speculators/issues/761",
         "what": "its description links the unconverted config at huggingface.co/z-lab/Qwen3.6-35B-A3B-DFlash/blob/"
                 "42d3b34d588423cdae7ba8f53a8cf7789346a719/config.json; a comment of 2026-07-09 quotes the config after "
                 "speculators' conversion: transformer_layer_config num_hidden_layers 8 (8 x full_attention), "
                 "num_attention_heads 32, num_key_value_heads 4, head_dim 128, hidden_size 2048, intermediate_size "
                 "6144, vocab_size 248320, block_size 16, mask_token_id 248070, aux_hidden_state_layer_ids "
                 "[2, 11, 20, 29, 38] (the conversion adds 1 to the target layer ids)"},
        {"where": "public code and notes found by the same search (their repositories not named by the index)",
         "what": "a Rust DFlash loader's test pinned to that revision asserts num_hidden_layers 8, hidden 2048, "
                 "intermediate 6144, 32 heads, 4 KV heads, head_dim 128, vocab 248320, block 16, mask 248070, "
                 "target_layer_ids [1, 10, 19, 28, 37]; an MLX benchmark note calls the draft an 8-layer dense "
                 "drafter of 905 MB with those target layers (8 layers of this shape weigh 904 MiB in bf16 without the "
                 "LM head it shares with the target, 948 MB; 5 layers would weigh 580 MiB: the size fits 8 layers, "
                 "if the note's MB are MiB); a GGUF conversion note gives block_count 8, 4 KV heads of key length "
                 "128"},
        {"where": "https://github.com/z-lab/dflash/issues/68",
         "what": "the draft was first released as a preview on 2026-04-17, 'still under training': earlier revisions "
                 "may have had another shape, and which revision the report ran is not known"},
    ],
}

TARGETS = {
    "qwen36-35b-a3b-mtp": {"family": "hybrid", "text": dict(QWEN36_TEXT, mtp_num_hidden_layers=1),
                           # vLLM 0.22.1 reads n_predict (mtp_num_hidden_layers) from the top-level config
                           "top_level": {"mtp_num_hidden_layers": 1},
                           "summary": "Qwen3.6-35B-A3B architecture with its one MTP layer (the draft of "
                                      "spec_method mtp): 40 layers (30 GDN + 10 full attn), hidden 2048, "
                                      "256 experts top-8, M-RoPE, mamba_ssm_dtype fp32",
                           "draft": None},
    "qwen36-35b-a3b": {"family": "hybrid", "text": QWEN36_TEXT,
                       "summary": "Qwen3.6-35B-A3B architecture: 40 layers (30 GDN + 10 full attn), "
                                  "hidden 2048, 256 experts top-8, M-RoPE, mamba_ssm_dtype fp32",
                       "draft": dict(layers=5, heads=32, kv_heads=4, head_dim=128, inter=6144,
                                     target_layer_ids=[1, 10, 19, 28, 37], mask_token_id=248070)},
    "qwen36-35b-a3b-draft8": {"family": "hybrid", "text": QWEN36_TEXT,
                              "summary": "Qwen3.6-35B-A3B architecture: 40 layers (30 GDN + 10 full attn), hidden 2048, "
                                         "256 experts top-8, M-RoPE, mamba_ssm_dtype fp32; with the published "
                                         "draft's shape (8 layers, PUBLISHED_DRAFT)",
                              "draft": dict(PUBLISHED_DRAFT["shape"])},
    "tiny-hybrid": {"family": "hybrid", "text": TINY_HYBRID_TEXT,
                    "summary": "tiny Qwen3.5-MoE: 8 layers (6 GDN + 2 full attn), hidden 256, 16 experts top-4, "
                               "M-RoPE, mamba_ssm_dtype fp32",
                    "draft": dict(layers=1, heads=4, kv_heads=2, head_dim=128, inter=512,
                                  target_layer_ids=[1, 5], mask_token_id=8191)},
    "tiny-dense": {"family": "dense",
                   "text": dict(vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                num_key_value_heads=4, head_dim=64, intermediate_size=1024,
                                max_position_embeddings=65536, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                tie_word_embeddings=False, hidden_act="silu"),
                   "summary": "tiny Qwen3 dense: 4 layers, hidden 512",
                   "draft": dict(layers=1, heads=8, kv_heads=4, head_dim=64, inter=1024,
                                 target_layer_ids=[0, 2], mask_token_id=8191)},
}


def describe(target: str) -> dict:
    if target not in TARGETS:
        raise LabError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
    t = TARGETS[target]
    return {"name": target, "architecture": t["summary"], "draft_assumption": t["draft"]}


def _train_tokenizer(out: Path, eos_id_holder: dict) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [REPORT_PROMPT] * 4 + [
        "The sum of the first n cubes equals the square of the n-th triangular number. "
        "Proof by induction: the base case n = 1 holds; assume it for n and add (n+1)^3. "
        "A second proof arranges the cubes as nested squares. Verify n = 2, 3, 4, 5. "
        "Generalizations: Faulhaber's formula, Bernoulli numbers, sums of k-th powers."
    ] * 8
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(out / "tokenizer.json"))
    eos_id_holder["eos"] = tok.token_to_id("<|im_end|>")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 262144,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False}, indent=1))


def build(target: str, root: str | os.PathLike) -> dict:
    """Write ``root/<target>/target`` and ``root/<target>/draft`` (config + tokenizer). Returns paths."""
    t = TARGETS.get(target)
    if t is None:
        raise LabError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
    base = Path(root) / target
    tdir, ddir = base / "target", base / "draft"
    tdir.mkdir(parents=True, exist_ok=True)
    holder: dict = {}
    _train_tokenizer(tdir, holder)
    eos = holder["eos"]
    text = dict(t["text"], eos_token_id=eos, pad_token_id=0, bos_token_id=None, dtype="bfloat16")
    if t["family"] == "hybrid":
        cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
               "text_config": dict(text, model_type="qwen3_5_moe_text"),
               "vision_config": {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                                 "out_hidden_size": text["hidden_size"], "model_type": "qwen3_5_moe"},
               "image_token_id": text["vocab_size"] - 4, "video_token_id": text["vocab_size"] - 3,
               "vision_start_token_id": text["vocab_size"] - 2, "vision_end_token_id": text["vocab_size"] - 5,
               "tie_word_embeddings": False, "eos_token_id": eos, "dtype": "bfloat16",
               **t.get("top_level", {})}
    else:
        cfg = dict(text, architectures=["Qwen3ForCausalLM"], model_type="qwen3", torch_dtype="bfloat16")
    (tdir / "config.json").write_text(json.dumps(cfg, indent=1))
    (tdir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    d = t["draft"]
    if d is None:  # no separate draft (MTP: the target's own layer drafts)
        return {"target": str(tdir), "draft": None, "family": t["family"]}
    ddir.mkdir(parents=True, exist_ok=True)
    hidden = text["hidden_size"]
    dcfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": text["vocab_size"],
            "hidden_size": hidden, "num_hidden_layers": d["layers"], "num_attention_heads": d["heads"],
            "num_key_value_heads": d["kv_heads"], "head_dim": d["head_dim"], "intermediate_size": d["inter"],
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": text["max_position_embeddings"],
            "rope_theta": 10000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "block_size": 16,
            "target_hidden_size": hidden, "layer_types": ["full_attention"] * d["layers"],
            "eos_token_id": eos,
            "dflash_config": {"mask_token_id": d["mask_token_id"], "target_layer_ids": d["target_layer_ids"]}}
    (ddir / "config.json").write_text(json.dumps(dcfg, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (ddir / f).write_text((tdir / f).read_text())
    return {"target": str(tdir), "draft": str(ddir), "family": t["family"]}
