"""FA3's split count for FULL CUDA graphs on one side of the speculative pair only.

vLLM 0.22.1's ``attention_config.flash_attn_max_num_splits_for_cuda_graph`` sets the upper bound on FA3's KV splits
for every FlashAttention builder at once: the target's attention groups and the drafter's. With it at 1 the crash
configuration completed (notebook 03), which leaves two readings: the target's schedule, or the drafter's. This
sets the bound for one side only, in the plugin (``DFLASH_LAB_FA_SPLITS=drafter:N`` or ``target:N``):

- a builder's side is read from its layers' indices: vLLM numbers draft (and MTP) layers after the target's
  (``model.layers.40``.. for a 40-layer target), so a layer at or past the target's ``num_hidden_layers`` is the
  drafter's; a builder holding both (never seen) is left alone and logged;
- only builders for which vLLM itself applies the bound are changed (``use_full_cuda_graph`` and ``aot_schedule`` at
  construction, ``flash_attn.py`` ``__init__``); ``build()`` then passes ``self.max_num_splits`` to FA3 at every step
  of at most the largest capture size. For the target's groups that is what their FULL graphs were captured with.
  The drafter's builders get the flag from the target's cudagraph mode too, but (read from the 0.22.1 source) the
  drafter builds its metadata with ``fast_build=True`` - no ahead-of-time schedule, ``scheduler_metadata=None`` -
  and runs attention outside FULL graphs: for it the bound is the ``num_splits`` FA3 gets (32 by default, 1 here).

Each changed builder is logged once with its layers and the old and new bound, so an engine log shows what ran.
"""

from __future__ import annotations

import os

from .errors import LabError

ENV = "DFLASH_LAB_FA_SPLITS"
SIDES = ("drafter", "target")


def parse(value: str) -> tuple[str, int]:
    """``"drafter:1"`` -> ("drafter", 1). LabError on anything else."""
    side, sep, n = str(value).partition(":")
    side = side.strip()
    if not sep or side not in SIDES:
        raise LabError(f"{ENV}={value!r}: expected SIDE:N with SIDE one of {list(SIDES)} (e.g. drafter:1)")
    try:
        k = int(n)
    except ValueError:
        raise LabError(f"{ENV}={value!r}: N must be an integer >= 1") from None
    if k < 1:
        raise LabError(f"{ENV}={value!r}: N must be an integer >= 1")
    return side, k


def side_of(layer_names, num_target_layers: int) -> str:
    """"drafter", "target" or "mixed" for a builder's attention layers (layer index vs the target's layer count)."""
    from .kvgroups import layer_index

    sides = {"drafter" if layer_index(n) >= num_target_layers else "target" for n in layer_names}
    return sides.pop() if len(sides) == 1 else "mixed"


def _num_target_layers(vllm_config) -> int:
    mc = vllm_config.model_config
    cfg = getattr(mc, "hf_text_config", None) or mc.hf_config
    return int(cfg.num_hidden_layers)


def install(value: str | None = None, builder_cls=None, log=None) -> str:
    """Wrap the FlashAttention builder's ``__init__`` so that builders of the chosen side get the bound.
    ``builder_cls`` and ``log`` are for tests (default: vLLM 0.22.1's FlashAttentionMetadataBuilder, log_once)."""
    side, n = parse(os.environ.get(ENV, "") if value is None else value)
    if builder_cls is None:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder as builder_cls
    if log is None:
        from .engine_state import log_once as log
    if getattr(builder_cls.__init__, "_dflash_lab_splits", None):
        return f"FA3 splits for FULL graphs: {side} builders bounded to {n} (already installed)"
    orig = builder_cls.__init__

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *a, **kw):
        orig(self, kv_cache_spec, layer_names, vllm_config, device, *a, **kw)
        names = list(layer_names)
        mine = side_of(names, _num_target_layers(vllm_config)) if names else "mixed"
        first = f"{names[0]}" + (f" .. ({len(names)} layers)" if len(names) > 1 else "") if names else "no layers"
        if mine == "mixed":
            log(f"FA3 splits: builder of {first} holds target and drafter layers: left alone")
        elif mine != side:
            return
        elif getattr(self, "use_full_cuda_graph", False) and getattr(self, "aot_schedule", False):
            old, self.max_num_splits = self.max_num_splits, n
            log(f"FA3 splits: {side} builder of {first}: max_num_splits {old} -> {n}")
        else:
            log(f"FA3 splits: {side} builder of {first}: vLLM sets no bound here (no FULL graphs or no FA3), unchanged")

    __init__._dflash_lab_splits = (side, n)
    builder_cls.__init__ = __init__
    return f"FA3 splits for FULL graphs: {side} builders bounded to {n}"
