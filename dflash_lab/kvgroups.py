"""How vLLM 0.22.1 groups a hybrid model's layers into KV-cache groups, and which groups share metadata.

The grouping is vLLM's own ``_get_kv_cache_groups_uniform_page_size``
(``vllm/v1/core/kv_cache_utils.py``), run verbatim on the CPU (:mod:`dflash_lab.vllm_code`):
layers are bucketed by KV-cache spec; the group size is the smallest bucket (or the largest, if
no bucket exceeds 1.5x the smallest); each bucket is dealt round-robin into
``cdiv(len, group_size)`` groups.

Why it matters here: at run time vLLM builds the attention metadata once per (spec, builder
type) and hands it to every further group of that spec through ``update_block_table``
(``gpu_model_runner.py``, ``_build_attn_group_metadata``). A hybrid target whose full-attention
layers end up in two or more groups therefore has groups whose FlashAttention builder never
rebuilds at run time (:func:`metadata_reusers`). The DFlash draft's few layers, of their own
attention spec, set the group size and split the target's 10 attention layers in two.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from .errors import LabError

KV_UTILS = "vllm/v1/core/kv_cache_utils.py"
GROUPING_FN = "_get_kv_cache_groups_uniform_page_size"

#: KV-cache spec kinds: equal tuples are equal specs (vLLM's specs are frozen dataclasses)
MAMBA = ("mamba",)


def attention_spec(kv_heads: int, head_dim: int) -> tuple:
    return ("full_attention", kv_heads, head_dim)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_FN = {}


def vllm_grouping(relpath: str = KV_UTILS, text: str | None = None):
    """vLLM 0.22.1's grouping function (or the one in ``text``, another release's ``relpath``: not cached); its
    groups come back as lists of layer names."""
    if text is not None or "fn" not in _FN:
        from .vllm_code import load_function

        quiet = logging.getLogger("dflash_lab.vllm.kv_cache_utils")  # vLLM's padding notices: not ours to print
        quiet.setLevel(logging.ERROR)
        ns = {"defaultdict": defaultdict, "cdiv": _cdiv, "logger": quiet,
              "create_kv_cache_group_specs": lambda spec, grouped: [list(g) for g in grouped]}
        fn = load_function(relpath, GROUPING_FN, namespace=ns, text=text)
        if text is not None:
            return fn
        _FN["fn"] = fn
    return _FN["fn"]


def hybrid_layers(num_layers: int = 40, full_attention_interval: int = 4, target_attn=(2, 256),
                  draft_layers: int = 0, draft_attn=(4, 128), draft_prefix: str = "model.layers",
                  mtp_layers: int = 0) -> dict:
    """{layer name: spec} in the order vLLM lists them: target layers, then MTP, then draft layers.

    Defaults: the Qwen3.6-35B-A3B target (every 4th layer full attention, 2 KV heads of 256) and
    this project's assumed DFlash draft attention (4 KV heads of 128).
    """
    if num_layers < 1 or full_attention_interval < 1:
        raise LabError("num_layers and full_attention_interval must be >= 1")
    out = {}
    for i in range(num_layers):
        if (i + 1) % full_attention_interval == 0:
            out[f"language_model.model.layers.{i}.self_attn.attn"] = attention_spec(*target_attn)
        else:
            out[f"language_model.model.layers.{i}.linear_attn"] = MAMBA
    for j in range(mtp_layers):  # Qwen3.5 MTP layers: full attention of the target's shape
        out[f"mtp.layers.{num_layers + j}.self_attn.attn"] = attention_spec(*target_attn)
    for j in range(draft_layers):
        out[f"{draft_prefix}.{num_layers + j}.self_attn.attn"] = attention_spec(*draft_attn)
    return out


def kv_heads_per_rank(total_kv_heads: int, tp: int) -> int:
    """KV heads one tensor-parallel rank holds: vLLM 0.22.1's ``QKVParallelLinear`` rule
    (``vllm/model_executor/layers/linear.py``: with ``tp >= total`` each rank holds one replicated head, else
    ``total / tp``)."""
    if tp < 1 or total_kv_heads < 1:
        raise LabError("tensor parallelism and KV heads must be >= 1")
    if tp >= total_kv_heads:
        return 1
    if total_kv_heads % tp:
        raise LabError(f"{total_kv_heads} KV heads do not divide over {tp} ranks")
    return total_kv_heads // tp


def rank_layers(tp: int, target_attn=(2, 256), draft_attn=(4, 128), **kw) -> dict:
    """:func:`hybrid_layers` as one rank of tensor parallelism ``tp`` sees them: each attention spec with that rank's
    KV heads (the GDN layers stay one spec among themselves, whatever their per-rank size)."""
    return hybrid_layers(target_attn=(kv_heads_per_rank(target_attn[0], tp), target_attn[1]),
                         draft_attn=(kv_heads_per_rank(draft_attn[0], tp), draft_attn[1]), **kw)


def groups(layers: dict, grouping=None) -> list[dict]:
    """KV-cache groups: [{"gid", "spec", "layers"}] in vLLM's order (``grouping``: another release's function)."""
    grouped = (grouping or vllm_grouping())(layers)
    return [{"gid": g, "spec": layers[names[0]], "layers": names} for g, names in enumerate(grouped)]


def metadata_reusers(gs: list[dict]) -> list[dict]:
    """Attention groups that, at run time, get the metadata another group's builder built.

    The first group of each attention spec builds; every later group of the same spec reuses
    it through ``update_block_table``. Each entry names the reusing group and its builder.
    """
    first = {}
    out = []
    for g in gs:
        if g["spec"] == MAMBA:
            continue
        if g["spec"] in first:
            out.append({"gid": g["gid"], "reuses_gid": first[g["spec"]], "first_layer": g["layers"][0],
                        "layers": g["layers"]})
        else:
            first[g["spec"]] = g["gid"]
    return out


def reusing_layers(layers: dict) -> list[list[int]]:
    """The layer numbers of each attention group that reuses another group's metadata (:func:`metadata_reusers`), for
    the layers :func:`hybrid_layers` or :func:`rank_layers` gives."""
    return [[layer_index(x) for x in r["layers"]] for r in metadata_reusers(groups(layers))]


def layer_index(name: str) -> int:
    return int(name.split("layers.")[1].split(".")[0])
