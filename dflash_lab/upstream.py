"""Later vLLM releases, read on the CPU: does the crash's precondition outlive 0.22.1?

A maintainer's first question after a root cause: is it still there? The GPU runs are all on the pinned 0.22.1.
This module reads each later release's own source text, from its published x86-64 wheel (sha256 checked against
PyPI's index, every file checked against the wheel's ``RECORD``), and asks of it what :mod:`dflash_lab.rootcause`
and :mod:`dflash_lab.kvgroups` ask of 0.22.1:

- **grouping**: vLLM's own grouping function of that release, run on the target (Qwen3.6-35B-A3B's 40 layers) with
  the 5-layer DFlash draft: are the target's attention layers split into groups of one spec, so that a later group
  reuses the first one's metadata? The same again with the published draft's shape (8 layers,
  :data:`PUBLISHED_GROUPING`), since the 5 layers are the GPU runs' assumption (:mod:`dflash_lab.models`); the
  verdict reads the 5-layer result, the draft every GPU run up to s69 had (s70 ran one with 8).
- **V1 runner** (``vllm/v1/worker/gpu_model_runner.py``, ``_build_attention_metadata``): FULL-graph capture builds
  every group with its own builder, and at run time a later group of the same (spec, builder type) gets the first
  group's metadata through ``update_block_table``, for any builder that supports it;
- **FlashAttention builder**: it supports ``update_block_table`` and owns a persistent ``scheduler_metadata`` buffer;
- **the stale read**: that release's ``update_block_table``, executed verbatim in :func:`rootcause.simulate`'s two
  groups: does the reusing group's captured graph still read the capture's schedule, not the step's?
- **V2 runner** (``vllm/v1/worker/gpu/attn_utils.py``): is its metadata reuse restricted to Mamba groups (so every
  attention group builds its own), and does capture take the same reuse path as run time?

- **default runner**: which runner this engine gets by default, by the rule of that release's
  ``VllmConfig.use_v2_model_runner``, read, not executed (:func:`_default_runner`); and whether the DFlash input kernel
  the recorded cores name is still defined anywhere in the package.
- **draft sliding windows** (``vllm/model_executor/models/qwen3_dflash.py``, the file the model registry builds
  ``DFlashDraftModel`` from, and ``VllmConfig``'s rules): does the DFlash draft read its config's ``layer_types`` into
  per-layer sliding windows at all, and what does the release do with a draft mixing sliding and full layers, as the
  published draft may (``models.PUBLISHED_DRAFT["layer_types"]``): build it as full attention, refuse it (the
  exception and its message), refuse it under the V1 runner only, or build its windows (:func:`draft_windows`, with
  the quoted lines it rests on). Not a verdict input: the verdict is for the runs' full-attention draft.

What this is not: a run. The grouping is the inner grouping function only (which path ``get_kv_cache_groups`` takes
for this engine, e.g. a later release's packed groups, is not evaluated); only ``update_block_table`` is that
release's in the simulation (``build()`` is 0.22.1's); whether another change keeps the stale schedule from being
read, and whether a release crashes, only a GPU run of it can say. The results are recorded
(``data/upstream/releases.jsonl``, with provenance) by ``python -m dflash_lab upstream-check``, since each wheel is
250-340 MB; :func:`check` runs on the pinned 0.22.1 in the tests and when notebook 04 renders.
"""

from __future__ import annotations

import copy
import json
import os
import re
import tempfile
import time
import urllib.request
import zipfile
import zlib
from pathlib import Path

from . import atomic
from .errors import LabError
from .models import PUBLISHED_DRAFT as _PUBLISHED

INDEX_URL = "https://pypi.org/simple/vllm/"
PINNED = "0.22.1"
RUNNER_V1 = "vllm/v1/worker/gpu_model_runner.py"
RUNNER_V2 = "vllm/v1/worker/gpu/attn_utils.py"
FA = "vllm/v1/attention/backends/flash_attn.py"
KV_UTILS = "vllm/v1/core/kv_cache_utils.py"
KV_PLANNING = "vllm/v1/core/kv_cache_planning.py"   # where the grouping function lives in later releases
CONFIG = "vllm/config/vllm.py"                       # VllmConfig.use_v2_model_runner: which runner by default
SAMPLER = "vllm/v1/sample/rejection_sampler.py"      # the V1 rejection sampler: link 4 (NaN logits -> id vocab_size)
DFLASH_MODEL = "vllm/model_executor/models/qwen3_dflash.py"   # the DFlash draft model: its layers' attention kinds
REGISTRY = "vllm/model_executor/models/registry.py"  # which file builds the draft's architecture (DFlashDraftModel)
TORCH = "torch requirement"                          # the wheel's Requires-Dist for torch (METADATA)
FILES = (RUNNER_V1, RUNNER_V2, FA, KV_UTILS, KV_PLANNING, CONFIG, SAMPLER, DFLASH_MODEL, REGISTRY)
#: the target's architecture (dflash_lab.models' config), what the default-runner rule looks up
TARGET_ARCH = "Qwen3_5MoeForConditionalGeneration"
#: the DFlash input kernel the recorded cores name most (0.22.1's vllm/v1/spec_decode/utils.py)
DFLASH_KERNEL = "def copy_and_expand_dflash_inputs_kernel("
FA_BUILDER = "FlashAttentionMetadataBuilder"
#: the verdicts, one per release
PRESENT = "precondition present, in the runner this engine gets by default (V1)"
OPT_IN = "precondition present in the V1 runner only, which is not this engine's default (VLLM_USE_V2_MODEL_RUNNER=0)"
ABSENT = "precondition absent"
UNDECIDED = "not decided from the source"
VERDICTS = (PRESENT, OPT_IN, ABSENT, UNDECIDED)


def version_key(v: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def wheel_entry(version: str, index: dict) -> dict:
    """The x86-64 manylinux wheel of ``version`` in PyPI's simple index (JSON form), the highest build tag where
    several were uploaded (pip's choice); LabError when the release has none."""
    pat = re.compile(rf"^vllm-{re.escape(version)}(-(\d+))?-cp38-abi3-manylinux_[0-9_]+_x86_64\.whl$")
    found = [(int(m.group(2) or 0), f) for f in index.get("files", [])
             if (m := pat.match(f.get("filename", ""))) and not f.get("yanked")]
    if not found:
        raise LabError(f"vLLM {version}: no x86-64 wheel in PyPI's index (is {version!r} a vLLM release?)")
    f = max(found, key=lambda x: x[0])[1]
    sha = f.get("hashes", {}).get("sha256")
    if not sha:
        raise LabError(f"vLLM {version}: the index gives no sha256 for {f['filename']}")
    return {"filename": f["filename"], "url": f["url"], "sha256": sha, "size": f.get("size")}


def releases_after(index: dict, after: str = PINNED) -> list[str]:
    """Every final release with an x86-64 wheel after ``after``, oldest first."""
    pat = re.compile(r"^vllm-(\d+\.\d+\.\d+)(-\d+)?-cp38-abi3-manylinux_[0-9_]+_x86_64\.whl$")
    vs = {m.group(1) for f in index.get("files", []) if (m := pat.match(f.get("filename", ""))) and not f.get("yanked")}
    return sorted((v for v in vs if version_key(v) > version_key(after)), key=version_key)


def fetch_index(url: str | None = None) -> dict:
    """PyPI's simple index of vLLM, JSON form (``DFLASH_LAB_PYPI_INDEX``: another address, e.g. a file:// copy)."""
    url = url or os.environ.get("DFLASH_LAB_PYPI_INDEX") or INDEX_URL
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    except (OSError, ValueError) as e:
        raise LabError(f"could not read PyPI's index {url}: {e}") from None


def read_wheel(path: Path, sha256: str, version: str) -> dict:
    """{file: text or None (not in this release)} for :data:`FILES`, from a wheel whose sha256 must be ``sha256``;
    each file checked against the wheel's own RECORD (the checks :mod:`dflash_lab.vllm_sources` makes of 0.22.1)."""
    from .vllm_sources import _read_record, _record_digest, _sha256_file

    digest = _sha256_file(path)
    if digest != sha256:
        raise LabError(f"{path}: sha256 {digest} is not the index's {sha256} for vLLM {version}")
    try:
        with zipfile.ZipFile(path) as z:
            rec_name = next((n for n in z.namelist() if n.endswith(".dist-info/RECORD")), None)
            if rec_name is None:
                raise LabError(f"{path}: no RECORD in the wheel")
            record = _read_record(z.read(rec_name).decode())
            names = set(z.namelist())
            out = {}
            for name in FILES:
                if name not in names:
                    out[name] = None                 # not in this release
                    continue
                if name not in record:
                    raise LabError(f"{path}: {name} is in the wheel but not in its RECORD (no hash to check it by)")
                data = z.read(name)
                if _record_digest(data) != record[name]:
                    raise LabError(f"{path}: {name} differs from the wheel's RECORD")
                out[name] = data.decode("utf-8")
            # the torch the release pins (its METADATA, RECORD-checked): which releases the GPU host's torch can run
            meta = next((n for n in names if n.endswith(".dist-info/METADATA") and n.startswith("vllm-")), None)
            out[TORCH] = None
            if meta is not None:
                data = z.read(meta)
                if meta not in record or _record_digest(data) != record[meta]:
                    raise LabError(f"{path}: {meta} differs from the wheel's RECORD")
                out[TORCH] = torch_requirement(data.decode("utf-8"))
            # where the DFlash input kernel is defined, if anywhere (every Python file of the package, RECORD-checked)
            out[DFLASH_KERNEL] = None
            for name in sorted(n for n in names if n.startswith("vllm/") and n.endswith(".py")):
                data = z.read(name)
                if DFLASH_KERNEL.encode() in data:
                    if name not in record or _record_digest(data) != record[name]:
                        raise LabError(f"{path}: {name} differs from the wheel's RECORD")
                    out[DFLASH_KERNEL] = name
                    break
    except zipfile.BadZipFile:
        raise LabError(f"{path}: not a zip archive (a wheel cut short?)") from None
    except (KeyError, UnicodeDecodeError, zlib.error, EOFError) as e:
        raise LabError(f"{path}: a file of the wheel cannot be read ({type(e).__name__}: {e})") from None
    return out


def torch_requirement(metadata_text: str) -> str | None:
    """The ``torch`` specifier a wheel's METADATA requires (e.g. ``==2.11.0``), else None."""
    for line in metadata_text.splitlines():
        m = re.match(r"^Requires-Dist:\s*torch\s*(\(?[=<>!~][^;]*?)\)?\s*(;.*)?$", line)
        if m and "extra" not in (m.group(2) or ""):   # a requirement of an extra only is not the release's
            return m.group(1).strip().strip("()").replace(" ", "")
    return None


def download(entry: dict, dest_dir: Path) -> Path:
    from .vllm_sources import _download

    dest = Path(dest_dir) / entry["filename"]
    _download(entry["url"], dest, label=entry["filename"])
    return dest


# --- the checks, on one release's text ----------------------------------------------------------------------------

def _function(text: str | None, name: str, cls: str | None):
    from .vllm_code import function_source

    if text is None:
        return None
    try:
        return function_source("", name, cls, text=text)[0]
    except LabError:
        return None


class _Spec(tuple):
    """A KV-cache spec stand-in (:mod:`dflash_lab.kvgroups`' tuples) with the ``merge`` later releases' grouping
    calls (from 0.27.0: buckets whose specs merge share groups). It merges only equal specs: vLLM's
    ``FullAttentionSpec.merge`` asserts every compared field equal to the first spec's, and the target's and the
    draft's attention specs differ in KV heads and head size; ``KVCacheSpec.merge`` (Mamba) asserts equality."""

    @classmethod
    def merge(cls, specs):
        if not all(x == specs[0] for x in specs[1:]):
            raise AssertionError("specs differ")
        return specs[0]


#: the published DFlash draft's shape (:data:`dflash_lab.models.PUBLISHED_DRAFT`): its layers and attention
PUBLISHED_SHAPE = {k: _PUBLISHED["shape"][k] for k in ("layers", "kv_heads", "head_dim")}
#: the key in a release's ``grouping`` under which the grouping with the published draft's shape is recorded
PUBLISHED_GROUPING = f"published draft ({PUBLISHED_SHAPE['layers']} layers)"


def _reusing(gs: list[dict]) -> list[dict]:
    from . import kvgroups

    return [{"gid": r["gid"], "reuses": r["reuses_gid"], "layers": [kvgroups.layer_index(x) for x in r["layers"]]}
            for r in kvgroups.metadata_reusers(gs)]


def _grouping(texts: dict) -> dict:
    """That release's grouping function on the target with the 5-layer DFlash draft: the reusing attention groups.

    The 5 layers are the draft every GPU run up to s69 had (an assumed shape); the published draft has 8 layers of the same
    attention, and the draft's layer count decides how vLLM cuts the target's attention layers into groups (0.22.1
    would not split them with 10 draft layers). So each release's function also runs with the published draft's shape
    (:data:`PUBLISHED_SHAPE`), recorded under :data:`PUBLISHED_GROUPING` with its own ``groups`` and ``reusing
    attention groups`` (``checked`` False, with why, where only that run fails). The 5-layer fields stay at the top,
    as before (the verdict, :func:`table` and the findings read them). Both draft shapes are built as full attention,
    as 0.22.1 builds the published draft's sliding-window layers (``models.PUBLISHED_DRAFT["layer_types"]``): a
    release that applies the draft's windows would group it otherwise, which this does not compute (which releases
    apply them, or refuse such a draft: :func:`draft_windows`, the record's :data:`DRAFT_WINDOWS`)."""
    from . import kvgroups

    where = [f for f in (KV_UTILS, KV_PLANNING) if texts.get(f) and f"def {kvgroups.GROUPING_FN}(" in texts[f]]
    if not where:
        return {"checked": False, "why": f"no {kvgroups.GROUPING_FN} in {KV_UTILS} or {KV_PLANNING}"}

    def run(**draft):
        layers = {k: _Spec(v) for k, v in kvgroups.hybrid_layers(**draft).items()}
        return kvgroups.groups(layers, kvgroups.vllm_grouping(where[0], texts[where[0]]))

    def failed(e):
        return f"{kvgroups.GROUPING_FN} did not run as 0.22.1's does: {type(e).__name__}: {e}"

    try:
        gs = run(draft_layers=5)
    except Exception as e:  # noqa: BLE001 - another release's function may need names 0.22.1's did not
        return {"checked": False, "file": where[0], "why": failed(e)}
    try:
        gp = run(draft_layers=PUBLISHED_SHAPE["layers"],
                 draft_attn=(PUBLISHED_SHAPE["kv_heads"], PUBLISHED_SHAPE["head_dim"]))
        published = {"checked": True, "draft": dict(PUBLISHED_SHAPE), "groups": len(gp),
                     "reusing attention groups": _reusing(gp)}
    except Exception as e:  # noqa: BLE001 - as above
        published = {"checked": False, "draft": dict(PUBLISHED_SHAPE), "why": failed(e)}
    return {"checked": True, "file": where[0], "groups": len(gs), "reusing attention groups": _reusing(gs),
            PUBLISHED_GROUPING: published}


def _chain_with(src: str, needle: str) -> list[tuple[str, str]] | None:
    """The if/elif chain of ``src`` (a function's text) one of whose branches' bodies contains ``needle``, as
    [(test, body)] in order (the final else's test ""); None when there is no such chain."""
    import ast

    tree = ast.parse(src)
    elifs = {id(n.orelse[0]) for n in ast.walk(tree) if isinstance(n, ast.If) and len(n.orelse) == 1
             and isinstance(n.orelse[0], ast.If)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or id(node) in elifs:
            continue
        chain, n = [], node
        while True:
            chain.append((ast.get_source_segment(src, n.test) or "",
                          "\n".join(ast.get_source_segment(src, b) or "" for b in n.body)))
            if len(n.orelse) == 1 and isinstance(n.orelse[0], ast.If):
                n = n.orelse[0]
                continue
            if n.orelse:
                chain.append(("", "\n".join(ast.get_source_segment(src, b) or "" for b in n.orelse)))
            break
        if any(needle in body for _, body in chain):
            return chain
    return None


def _branch(chain, pred) -> int | None:
    return next((i for i, (test, body) in enumerate(chain) if pred(test, body)), None)


def _v1(runner_text: str | None) -> dict:
    """The V1 runner's ``_build_attention_metadata``: the if/elif chain that picks capture, reuse or build per group."""
    if runner_text is None:
        return {"present": False}
    fn = _function(runner_text, "_build_attention_metadata", "GPUModelRunner")
    if fn is None:
        return {"present": True, "checked": False, "why": "no GPUModelRunner._build_attention_metadata"}
    chain = _chain_with(fn, "update_block_table(")
    key = re.search(r"cache_key = (.+)", fn)
    if chain is None or key is None or "cached_attn_metadata[cache_key] = " not in fn:
        return {"present": True, "checked": False, "why": "its capture/reuse/build choice is not the one 0.22.1 makes"}
    cap = _branch(chain, lambda t, b: t.strip() == "for_cudagraph_capture")
    reuse = _branch(chain, lambda t, b: "update_block_table(" in b)
    if cap is None:
        return {"present": True, "checked": False, "why": "no capture branch beside the reuse"}
    return {
        "present": True, "checked": True,
        "capture builds every group with its own builder": cap < reuse,
        "run time reuses a same-spec group's metadata": "cache_key in cached_attn_metadata" in chain[reuse][0],
        "reuse key": key.group(1).strip(),
        "reuse limited to Mamba": "Mamba" in key.group(1) or "Mamba" in chain[reuse][0],
    }


def _fa(fa_text: str | None) -> dict:
    from . import rootcause
    from .vllm_code import load_function

    if fa_text is None:
        return {"checked": False, "why": f"no {FA}"}
    m = re.search(rf"class {FA_BUILDER}\b.*?(?=\nclass |\Z)", fa_text, re.S)
    if not m:
        return {"checked": False, "why": f"no {FA_BUILDER}"}
    cls = m.group(0)
    out = {"checked": True,
           "supports update_block_table": bool(re.search(r"supports_update_block_table(: bool)? = True", cls)),
           "persistent scheduler_metadata buffer": "self.scheduler_metadata = torch.zeros(" in cls}
    try:
        update = load_function(FA, "update_block_table", cls=FA_BUILDER, namespace={"copy": copy}, text=fa_text)
        r = rootcause.simulate(update=update)
        out["reusing group's graph reads the capture's schedule"] = r["graph_reads"][7] != r["step"]
    except Exception as e:  # noqa: BLE001 - a changed method may need names 0.22.1's did not
        out["reusing group's graph reads the capture's schedule"] = None
        out["why not simulated"] = f"{type(e).__name__}: {e}"
    return out


def _v2(text: str | None) -> dict:
    """The V2 runner's metadata reuse (the function of ``attn_utils.py`` that calls ``update_block_table``): for which
    groups, and whether capture goes through it too (the reuse test before the capture branch: capture and run time
    then hand a group the same metadata). ``None`` where its code is not read the way 0.31.0-0.34.0's is."""
    import ast

    if text is None:
        return {"present": False}
    fns = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)
           and "update_block_table(" in (ast.get_source_segment(text, n) or "")]
    if not fns:
        return {"present": True, "reuses metadata": False}
    src = ast.get_source_segment(text, fns[0])
    chain = _chain_with(src, "update_block_table(")
    # the condition that gives a group a reuse key: an `if` whose body sets reuse_key to something
    keyed = [ast.get_source_segment(src, n.test) or "" for n in ast.walk(ast.parse(src)) if isinstance(n, ast.If)
             and any(isinstance(b, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "reuse_key" for t in b.targets)
                     and not (isinstance(b.value, ast.Constant) and b.value.value is None) for b in n.body)]
    if chain is None or len(keyed) != 1:
        return {"present": True, "reuses metadata": True, "reuse limited to Mamba": None,
                "capture takes the reuse path too": None}
    reuse = _branch(chain, lambda t, b: "update_block_table(" in b)
    cap = _branch(chain, lambda t, b: t.strip() == "for_cudagraph_capture")
    return {"present": True, "reuses metadata": True, "reuse limited to Mamba": "MambaSpec" in keyed[0],
            "capture takes the reuse path too": cap is not None and reuse < cap}


def _default_runner(text: str | None) -> dict:
    """Which model runner this engine gets by default, by the rule of that release's ``VllmConfig.use_v2_model_runner``
    as read (not executed): with the architecture gate (``_is_default_v2_model_runner_model``, 0.22.1-0.28.0) a target
    whose architecture is not on the module's ``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES`` gets V1; without it (from
    0.29.0) V2, unless a feature its ``_get_v2_model_runner_unsupported_features`` lists applies: V1 where that list
    excludes hybrid models (``has_inner_state``) or does not accept DFlash among its speculative methods, else V2 (its
    other entries, e.g. context or sequence parallelism or stock torch.compile, are not this engine's: TP=1, vLLM's
    own compile). The rules before the gate that force V2 for other drafts (DSpark, a DFlash draft mixing sliding and
    full attention, DFlash2) are not this engine's: its draft is 5 full-attention DFlash layers."""
    import ast

    if text is None:
        return {"read": False, "why": f"no {CONFIG}"}
    fn = _function(text, "use_v2_model_runner", "VllmConfig")
    if fn is None:
        return {"read": False, "why": "no VllmConfig.use_v2_model_runner"}
    if "self._is_default_v2_model_runner_model()" in fn:
        archs = None
        for node in ast.parse(text).body:
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES"
                                                     for t in node.targets)):
                v = node.value
                try:
                    archs = sorted(ast.literal_eval(v.args[0] if isinstance(v, ast.Call) and v.args else v))
                except (ValueError, TypeError, SyntaxError):
                    archs = None
        if archs is None:
            return {"read": False, "why": "the architecture gate's list is not a literal"}
        return {"read": True, "rule": "architecture gate", "target listed": TARGET_ARCH in archs,
                "default": "V1" if TARGET_ARCH not in archs else None}
    sup = _function(text, "_get_v2_model_runner_unsupported_features", "VllmConfig")
    if sup is None:
        return {"read": False, "why": "no VllmConfig._get_v2_model_runner_unsupported_features"}
    hybrid_out = "has_inner_state" in sup                      # 0.22.1's "hybrid/mamba models" entry
    methods = re.search(r"speculative_config\.method not in \(([^)]*)\)", sup)
    if hybrid_out:
        default = "V1"
    elif methods is None:
        default = None
    else:
        default = "V2" if '"dflash"' in methods.group(1) else "V1"
    return {"read": True, "rule": "V2 unless an unsupported feature applies", "hybrid models unsupported": hybrid_out,
            "dflash accepted by V2": bool(methods) and '"dflash"' in methods.group(1), "default": default}


def _recovered(text: str | None) -> dict:
    """Link 4 of notebook 03's chain in a release's V1 rejection sampler, read (not executed): can its
    ``sample_recovered_tokens_kernel`` return an id at or above the vocabulary size? In 0.22.1 it can: the vocabulary
    (248320) is not a multiple of the kernel's 8192-wide tile, the last tile's lanes past it score 0, and on a row of
    NaN or zero probabilities one of them wins the tiled argmax. NaN logits so gave a row no valid token, which the GDN
    and DFlash input kernels then misread (s43-s45). vLLM PR #44744 masks those lanes to -inf and clamps the id below
    the vocabulary size. Not a verdict input: a release whose kernel keeps the id inside the vocabulary still has the
    stale schedule where the precondition is present; the wrong outputs then no longer end in a fault this way."""
    fn = _function(text, "sample_recovered_tokens_kernel", None)
    if fn is None:
        return {"present": False}
    masked = bool(re.search(r"tl\.where\(\s*vocab_mask\s*,\s*score\s*,\s*float\(\s*[\"']-inf[\"']\s*\)\s*\)", fn))
    clamped = bool(re.search(r"tl\.minimum\(\s*recovered_id\s*,\s*vocab_size\s*-\s*1\s*\)", fn))
    # 0.22.1's shape: the tile's scores reduced as they are, the winner's id stored as it is; "yes" only on that, and
    # None (not decided) for a kernel neither masked, clamped nor of that shape
    shape = all(x in fn for x in ("score = prob * inv_q", "tl.max(score, axis=0, return_indices=True)",
                                  "recovered_id = v + local_id"))
    kept = True if masked or clamped else (False if shape else None)
    return {"present": True, "out-of-vocabulary lanes masked": masked, "recovered id clamped": clamped,
            "recovered id kept inside the vocabulary": kept}


# --- the draft's sliding windows ----------------------------------------------------------------------------------

#: the key of a release's record under which :func:`draft_windows` says what it does with the draft's ``layer_types``
DRAFT_WINDOWS = "draft sliding windows"
#: the architecture the dummy DFlash drafts' ``config.json`` names (:func:`models.build`); which one the published
#: draft's names is not recorded in ``models.PUBLISHED_DRAFT``
DRAFT_ARCH = "DFlashDraftModel"
#: what a release does with a DFlash draft whose ``layer_types`` mix sliding_attention and full_attention layers
WIN_IGNORED = "ignores layer_types: every draft layer is built as full attention"
WIN_REFUSED = "refuses a draft mixing sliding and full layers"
WIN_REFUSED_V1 = "refuses a draft mixing sliding and full layers under the V1 runner only; under V2 builds its windows"
WIN_BUILT = "builds a draft mixing sliding and full layers with its sliding windows"
WIN_VERDICTS = (WIN_IGNORED, WIN_REFUSED, WIN_REFUSED_V1, WIN_BUILT)
#: what :func:`_mixed_draft_config` finds in ``VllmConfig`` (config/vllm.py) for such a draft
CFG_NONE = "no rule for such a draft"
CFG_FORCES_V2 = "forces the V2 runner for such a draft unless VLLM_USE_V2_MODEL_RUNNER is set"
CFG_V1_REFUSES = "the V1 runner refuses such a draft when the config is validated"
_SLIDING = "sliding_attention"
_V1_ONLY = "not get_current_vllm_config().use_v2_model_runner"   # the one runner condition recognized


def _same(node, template: str) -> bool:
    """``node`` is the statement or expression ``template`` (compared as syntax trees: spacing, line breaks,
    quotes and redundant parentheses aside)."""
    import ast

    try:
        t = ast.parse(template).body[0]
    except SyntaxError:
        return False
    if isinstance(node, ast.expr) and isinstance(t, ast.Expr):
        t = t.value
    return ast.dump(node) == ast.dump(t)


def _quote(file: str, text: str, first: int, last: int | None = None) -> dict:
    """Lines ``first``-``last`` of ``text``, each stripped, joined by one space: what a verdict rests on."""
    last = last or first
    return {"file": file, "lines": str(first) if last == first else f"{first}-{last}",
            "text": " ".join(x.strip() for x in text.splitlines()[first - 1:last])}


def _callee(call) -> str | None:
    import ast

    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _parents(tree) -> dict:
    import ast

    return {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}


def _guards(node, top, parents) -> list | None:
    """The ``if`` tests (as source) that lead from ``top`` down to ``node``, outermost first; None where the path
    passes an ``else``, a loop, a ``try`` or anything else but the body of an ``if``."""
    import ast

    out, child = [], node
    while True:
        p = parents.get(id(child))
        if p is None:
            return None
        if p is top:
            return out[::-1]
        if isinstance(p, ast.If) and any(child is b for b in p.body):
            out.append(ast.unparse(p.test))
        elif not isinstance(p, ast.If) or child is not p.test:
            return None
        child = p


def _conjuncts(test: str) -> list[str]:
    import ast

    e = ast.parse(test, mode="eval").body
    if isinstance(e, ast.BoolOp) and isinstance(e.op, ast.And):
        return [ast.unparse(v) for v in e.values]
    return [ast.unparse(e)]


def _raised(node) -> tuple[str, str] | None:
    """(exception, message) of ``raise E("a literal message")``, else None."""
    import ast

    e = node.exc
    if (isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and len(e.args) == 1 and not e.keywords
            and isinstance(e.args[0], ast.Constant) and isinstance(e.args[0].value, str)):
        return e.func.id, e.args[0].value
    return None


def _draft_builder(text: str | None):
    """(module, class, quote) the model registry maps :data:`DRAFT_ARCH` to; a str (why not) otherwise."""
    import ast

    if text is None:
        return f"no {REGISTRY}"
    found = []
    for n in ast.walk(ast.parse(text)):
        if isinstance(n, ast.Dict):
            for k, v in zip(n.keys, n.values):
                if isinstance(k, ast.Constant) and k.value == DRAFT_ARCH:
                    try:
                        val = ast.literal_eval(v)
                    except ValueError:
                        val = None
                    found.append((val, _quote(REGISTRY, text, k.lineno, v.end_lineno)))
    vals = {x for x, _ in found}
    if len(vals) != 1 or not (isinstance(next(iter(vals)), tuple) and len(next(iter(vals))) == 2):
        return f"{REGISTRY} maps {DRAFT_ARCH} to {len(vals)} literal (module, class) entries, not one"
    (mod, cls), quote = found[0]
    return mod, cls, quote


def _mixed_draft_config(text: str | None) -> dict:
    """What ``VllmConfig`` (config/vllm.py) does with a DFlash draft mixing sliding and full layers, read, not run.

    Recognized: a ``VllmConfig._dflash_needs_multi_kv_group`` that counts the draft's ``"sliding_attention"``
    entries of ``layer_types`` and returns ``0 < num_sliding < len(layer_types)`` (0.26.0-0.33.0), used as
    (a) ``if self._dflash_needs_multi_kv_group(): return True`` in ``use_v2_model_runner``, after the
    ``VLLM_USE_V2_MODEL_RUNNER`` override (:data:`CFG_FORCES_V2`), or (b) ``unsupported.append("...")`` in
    ``_get_v1_model_runner_unsupported_features``, which ``_validate_v1_model_runner`` raises as
    ``ValueError(f"Model Runner V1 does not support: {', '.join(unsupported)}")`` (:data:`CFG_V1_REFUSES`; the message
    recorded is the one it gives when that is the only unsupported feature). :data:`CFG_NONE` only where the name is
    absent and no line of the file names both DFlash and sliding; any other use or shape: ``checked`` False."""
    import ast

    if text is None:
        return {"checked": False, "why": f"no {CONFIG}"}
    pred = "_dflash_needs_multi_kv_group"
    if pred not in text:
        stray = [i for i, x in enumerate(text.splitlines(), 1) if "dflash" in x.lower() and "sliding" in x.lower()]
        if stray:
            return {"checked": False, "why": f"lines {stray} name DFlash and sliding, without {pred}"}
        return {"checked": True, "rules": [CFG_NONE], "quotes": []}
    tree = ast.parse(text)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "VllmConfig"), None)
    fns = {n.name: n for n in (cls.body if cls else []) if isinstance(n, ast.FunctionDef)}
    fn = fns.get(pred)
    if fn is None:
        return {"checked": False, "why": f"{pred} named but not a VllmConfig method"}
    stmts = list(ast.walk(fn))
    need = ('layer_types = getattr(draft_config.hf_config, "layer_types", None) or []',
            f'num_sliding = sum(lt == "{_SLIDING}" for lt in layer_types)',
            "return 0 < num_sliding < len(layer_types)")
    missing = [t for t in need if not any(_same(n, t) for n in stmts if isinstance(n, ast.stmt))]
    if missing or 'spec.method != "dflash"' not in ast.get_source_segment(text, fn):
        return {"checked": False, "why": f"VllmConfig.{pred} is not the mixed-draft test recognized: lacks "
                                         f"{missing or ['spec.method != dflash']}"}
    quotes = [_quote(CONFIG, text, n.lineno, n.end_lineno) for n in stmts
              if isinstance(n, ast.stmt) and any(_same(n, t) for t in need[1:])]
    parents = _parents(tree)
    rules, out = [], {}
    for call in [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _callee(n) == pred]:
        if not _same(call, f"self.{pred}()"):
            return {"checked": False, "why": f"line {call.lineno}: {pred} called otherwise than on self, no arguments"}
        where = next((f for f in fns.values() if f.lineno <= call.lineno <= f.end_lineno), None)
        iff = parents.get(id(call))
        if where is None or not isinstance(iff, ast.If) or iff.test is not call or iff.orelse:
            return {"checked": False, "why": f"line {call.lineno}: {pred}() is not the test of an if without else"}
        if where.name == "use_v2_model_runner" and len(iff.body) == 1 and _same(iff.body[0], "return True"):
            env = next((i for i, s in enumerate(where.body)
                        if _same(s, "if use_v2_model_runner is not None:\n    return use_v2_model_runner")), None)
            mine = next((i for i, s in enumerate(where.body) if s is iff), None)
            if (env is None or mine is None or env > mine or not any(
                    _same(s, "use_v2_model_runner = envs.VLLM_USE_V2_MODEL_RUNNER") for s in where.body[:env])):
                return {"checked": False, "why": f"line {call.lineno}: forces V2, but not after the environment's "
                                                 "override at the function's top"}
            rules.append(CFG_FORCES_V2)
            quotes.append(_quote(CONFIG, text, iff.lineno, iff.body[0].end_lineno))
        elif (where.name == "_get_v1_model_runner_unsupported_features" and len(iff.body) == 1
              and isinstance(iff.body[0], ast.Expr) and isinstance(iff.body[0].value, ast.Call)
              and _same(iff.body[0].value.func, "unsupported.append") and len(iff.body[0].value.args) == 1
              and isinstance(iff.body[0].value.args[0], ast.Constant)):
            feature = iff.body[0].value.args[0].value
            val = fns.get("_validate_v1_model_runner")
            tmpl = ("def _validate_v1_model_runner(self) -> None:\n"
                    "    unsupported = self._get_v1_model_runner_unsupported_features()\n"
                    "    if unsupported:\n"
                    "        raise ValueError(f\"Model Runner V1 does not support: {', '.join(unsupported)}\")")
            if val is None or not _same(val, tmpl):
                return {"checked": False, "why": "the V1 runner's unsupported features are not raised as recognized"}
            rules.append(CFG_V1_REFUSES)
            out["V1 refusal"] = {"exception": "ValueError", "message": f"Model Runner V1 does not support: {feature}"}
            quotes.append(_quote(CONFIG, text, iff.lineno, iff.body[0].end_lineno))
            quotes.append(_quote(CONFIG, text, val.body[-1].lineno, val.body[-1].end_lineno))
        else:
            return {"checked": False,
                    "why": f"line {call.lineno}: {pred}() used in {where.name} in a way not recognized"}
    if not rules:
        return {"checked": False, "why": f"{pred} defined but never called"}
    return {"checked": True, "rules": rules, **out, "quotes": quotes}


def draft_windows(texts: dict) -> dict:
    """What a release does with the DFlash draft's per-layer attention kinds (its config's ``layer_types``), read from
    its own source, not run: the record's :data:`DRAFT_WINDOWS` field.

    It looks, in order, for:

    1. the model registry's (``registry.py``) entry for :data:`DRAFT_ARCH`: it must name the ``qwen3_dflash`` module
       (the file read next, :data:`DFLASH_MODEL`) and a class defined there;
    2. :data:`WIN_IGNORED` where no line of that file names ``layer_types``, ``sliding`` or ``window`` (any case) and
       its ``Attention(`` calls pass no ``**`` arguments: no per-layer window reaches a draft layer (0.22.1-0.24.0).
       What the draft's layers then get from the engine-wide ``CacheConfig.sliding_window`` (the target's) is not
       read here (for 0.22.1 tests/test_models.py reads it: None for this target);
    3. otherwise the chain from the config to the attention layer, every link matched as syntax: each ``Attention(``
       call passes ``per_layer_sliding_window=<a parameter of its __init__>``; every construction of that attention
       class passes that parameter the first value of ``<resolver>(config, layer_idx)``; the resolver, a top-level
       function, reads ``layer_types = getattr(config, "layer_types", None)``, sets
       ``is_sliding = layer_types[layer_idx] == <"sliding_attention">``, under ``if is_sliding:`` takes
       ``sliding_window = dflash_config.get("swa_window_size", getattr(config, "sliding_window", None))`` and returns
       it first. Each ``raise`` of the resolver must then be one of two: under ``if sliding_window is None:`` (a
       sliding layer without a window size: recorded under "a sliding layer's window"), or the mixed-layer refusal,
       the test of an ``if`` (inside ``if layer_types is not None:`` at most) whose conjuncts are exactly the mixed
       test (``any_sliding`` and ``not all_sliding``, both counted from ``layer_types``, as in 0.25.x; or
       ``0 < num_sliding < len(layer_types)``, as from 0.26.0) plus, optionally,
       ``not get_current_vllm_config().use_v2_model_runner`` (refused only under the V1 runner). The verdict:
       :data:`WIN_REFUSED` (with the exception and its literal message), :data:`WIN_REFUSED_V1`, or, with no such
       raise, :data:`WIN_BUILT`.

    Beside it, under "config rule", :func:`_mixed_draft_config`: what ``VllmConfig`` does with such a draft (forces V2,
    or has the V1 runner refuse it), which decides which branch of a V1-only refusal a default engine takes.
    Anything not matching these patterns is recorded ``checked`` False with why, never a guess. ``quotes``: the
    lines (file, line numbers, text) the verdict rests on. Whether the V2 runner then runs such a draft, and how it
    groups the KV cache, is not read."""
    import ast

    def no(why, **kw):
        return {"checked": False, "why": why, **kw}

    b = _draft_builder(texts.get(REGISTRY))
    if isinstance(b, str):
        return no(b)
    mod, cls, q_reg = b
    if mod != "qwen3_dflash":
        return no(f"{DRAFT_ARCH} is built by {mod}.{cls}, not by {DFLASH_MODEL}", quotes=[q_reg])
    src = texts.get(DFLASH_MODEL)
    if src is None:
        return no(f"no {DFLASH_MODEL}", quotes=[q_reg])
    tree = ast.parse(src)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if cls not in classes:
        return no(f"no class {cls} in {DFLASH_MODEL}", quotes=[q_reg])
    base = {"file": DFLASH_MODEL, "draft architecture": f"{DRAFT_ARCH}: {mod}.{cls}",
            "config rule": _mixed_draft_config(texts.get(CONFIG))}
    attn = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _callee(n) == "Attention"]
    if not attn:
        return no(f"no Attention( call in {DFLASH_MODEL}", quotes=[q_reg])
    if any(k.arg is None for c in attn for k in c.keywords):
        return no("an Attention( call passes ** arguments", quotes=[q_reg])
    low = src.lower()
    if "layer_types" not in src and "sliding" not in low and "window" not in low:
        return {"checked": True, "mixed sliding and full layers": WIN_IGNORED, "reads layer_types": False,
                "per-layer sliding window": False, "refusal": None, "a sliding layer's window": None, **base,
                "rests on": f"no line of {DFLASH_MODEL} names layer_types, sliding or window; its Attention( "
                            "call(s), quoted, pass no per-layer window",
                "quotes": [q_reg] + [_quote(DFLASH_MODEL, src, c.lineno, c.end_lineno) for c in attn]}

    parents = _parents(tree)
    quotes = [q_reg]

    def enclosing(node, kind):
        while node is not None and not isinstance(node, kind):
            node = parents.get(id(node))
        return node

    # link 1: Attention(per_layer_sliding_window=<param>) inside <class>.__init__
    links = set()
    for c in attn:
        kw = next((k for k in c.keywords if k.arg == "per_layer_sliding_window"), None)
        init, klass = enclosing(c, ast.FunctionDef), enclosing(c, ast.ClassDef)
        params = {a.arg for a in (init.args.args + init.args.kwonlyargs)} if init else set()
        if (kw is None or not isinstance(kw.value, ast.Name) or init is None or init.name != "__init__"
                or klass is None or kw.value.id not in params):
            return no(f"line {c.lineno}: an Attention( call without per_layer_sliding_window=<a parameter of its "
                      "class's __init__>", **base, quotes=quotes)
        links.add((klass.name, kw.value.id))
        quotes.append(_quote(DFLASH_MODEL, src, c.lineno, c.end_lineno))
    # link 2: every construction of that class passes the parameter the resolver's first value
    resolvers = set()
    for klass, param in sorted(links):
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _callee(n) == klass]
        if not calls:
            return no(f"{klass} is never constructed in {DFLASH_MODEL}", **base, quotes=quotes)
        for c in calls:
            kw = next((k for k in c.keywords if k.arg == param), None)
            fn = enclosing(c, ast.FunctionDef)
            src_assign = None
            if kw is not None and isinstance(kw.value, ast.Name) and fn is not None:
                src_assign = next((s for s in ast.walk(fn) if isinstance(s, ast.Assign) and len(s.targets) == 1
                                   and isinstance(s.targets[0], ast.Tuple) and s.targets[0].elts
                                   and isinstance(s.targets[0].elts[0], ast.Name)
                                   and s.targets[0].elts[0].id == kw.value.id and isinstance(s.value, ast.Call)
                                   and isinstance(s.value.func, ast.Name)), None)
            if src_assign is None:
                return no(f"line {c.lineno}: {klass}( is not passed {param}= from a resolver's first value",
                          **base, quotes=quotes)
            resolvers.add(src_assign.value.func.id)
            quotes.append(_quote(DFLASH_MODEL, src, src_assign.lineno, src_assign.end_lineno))
    if len(resolvers) != 1:
        return no(f"the windows come from {len(resolvers)} resolvers, not one", **base, quotes=quotes)
    rname = resolvers.pop()
    rfn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == rname), None)
    if rfn is None or len(rfn.args.args) < 2:
        return no(f"no top-level function {rname}(config, layer_idx) in {DFLASH_MODEL}", **base, quotes=quotes)
    cfg_arg, idx_arg = rfn.args.args[0].arg, rfn.args.args[1].arg
    consts = {t.id: s.value.value for s in tree.body + rfn.body if isinstance(s, ast.Assign)
              for t in s.targets if isinstance(t, ast.Name) and isinstance(s.value, ast.Constant)}
    sliding = [k for k, v in consts.items() if v == _SLIDING]
    body = [n for n in ast.walk(rfn) if isinstance(n, ast.stmt) and n is not rfn]

    def find(template):
        return next((n for n in body if _same(n, template)), None)

    read = find(f'layer_types = getattr({cfg_arg}, "layer_types", None)')
    per_layer = next((n for n in (find(f"is_sliding = layer_types[{idx_arg}] == {s}")
                                  for s in sliding + [repr(_SLIDING)]) if n is not None), None)
    window = find(f'sliding_window = dflash_config.get("swa_window_size", getattr({cfg_arg}, "sliding_window", None))')
    rets = [n for n in body if isinstance(n, ast.Return)]
    gated = window is not None and _guards(window, rfn, parents) == ["is_sliding"]
    returned = rets and all(isinstance(r.value, ast.Tuple) and r.value.elts and _same(r.value.elts[0], "sliding_window")
                            for r in rets)
    if not (read and per_layer and gated and returned):
        return no(f"{rname} does not read layer_types into a per-layer window as recognized (layer_types read: "
                  f"{bool(read)}, per-layer test: {bool(per_layer)}, window under is_sliding: {bool(gated)}, returned "
                  f"first: {bool(returned)})", **base, quotes=quotes)
    quotes += [_quote(DFLASH_MODEL, src, n.lineno, n.end_lineno) for n in (read, per_layer, window)]

    count = [f"num_sliding = sum(lt == {s} for lt in layer_types)" for s in sliding + [repr(_SLIDING)]]
    counted = any(find(t) for t in count)
    mixed_tests = []
    if counted and find("any_sliding = num_sliding > 0") and find("all_sliding = num_sliding == len(layer_types)"):
        mixed_tests.append(["any_sliding", "not all_sliding"])
    if counted:
        mixed_tests.append(["0 < num_sliding < len(layer_types)"])
    refusal, window_error = None, None
    for r in (n for n in body if isinstance(n, ast.Raise)):
        g, what = _guards(r, rfn, parents), _raised(r)
        if g is None or what is None:
            return no(f"line {r.lineno}: a raise of {rname} not recognized", **base, quotes=quotes)
        if g == ["is_sliding", "sliding_window is None"]:
            window_error = {"exception": what[0], "message": what[1]}
            continue
        if g[:-1] not in ([], ["layer_types is not None"]):
            return no(f"line {r.lineno}: a raise of {rname} under {g}", **base, quotes=quotes)
        conj = _conjuncts(g[-1])
        rest = [c for c in conj if not any(c in t for t in mixed_tests)]
        mixed = next((t for t in mixed_tests if all(c in conj for c in t)), None)
        if mixed is None or rest not in ([], [_V1_ONLY]) or len(conj) != len(mixed) + len(rest) or refusal:
            return no(f"line {r.lineno}: a raise of {rname} under {g[-1]!r}, not the mixed-layer test recognized",
                      **base, quotes=quotes)
        refusal = {"exception": what[0], "message": what[1], "only if": rest[0] if rest else None,
                   "runner": "V1" if rest else None}
        iff = parents[id(r)]
        quotes.append(_quote(DFLASH_MODEL, src, iff.lineno, r.end_lineno))
    verdict = WIN_BUILT if refusal is None else WIN_REFUSED_V1 if refusal["runner"] else WIN_REFUSED
    return {"checked": True, "mixed sliding and full layers": verdict, "reads layer_types": True,
            "per-layer sliding window": True, "refusal": refusal,
            "a sliding layer's window": {"from": ast.unparse(window.value), "else": window_error}, **base,
            "rests on": f"{rname}(config, layer_idx) reads layer_types; its sliding window reaches "
                        "Attention(per_layer_sliding_window=...)" + (f"; it raises {refusal['exception']} for a draft "
                                                                      "mixing sliding and full layers" +
                                                                      (f" only if {refusal['only if']}"
                                                                       if refusal["runner"] else "")
                                                                      if refusal else "; no raise for a mixed draft"),
            "quotes": quotes}

def check(texts: dict) -> dict:
    """The facts of one release (``texts``: {file: text or None}) and its verdict (see the module's docstring)."""
    g, v1, fa, v2 = _grouping(texts), _v1(texts.get(RUNNER_V1)), _fa(texts.get(FA)), _v2(texts.get(RUNNER_V2))
    split = g.get("checked") and bool(g["reusing attention groups"])
    v1_path = (v1.get("checked") and v1["capture builds every group with its own builder"]
               and v1["run time reuses a same-spec group's metadata"] and not v1["reuse limited to Mamba"])
    fa_path = (fa.get("checked") and fa["supports update_block_table"] and fa["persistent scheduler_metadata buffer"]
               and fa.get("reusing group's graph reads the capture's schedule") is True)
    dr = (_default_runner(texts.get(CONFIG)) if v1["present"] or not v2.get("present")
          else {"read": True, "rule": "the only GPU runner", "default": "V2"})
    v2_safe = not v2.get("present") or v2["reuses metadata"] is False or v2.get("reuse limited to Mamba") is True
    if split and v1_path and fa_path:
        verdict = (PRESENT if dr.get("default") == "V1" else OPT_IN if dr.get("default") == "V2" and v2_safe
                   else UNDECIDED)
    elif not v1["present"] and v2.get("present") and v2_safe:
        verdict = ABSENT
    elif g.get("checked") and not split:
        verdict = ABSENT
    elif v1.get("checked") and fa.get("checked") and (not v1_path or fa.get("reusing group's graph reads the capture's schedule") is False):
        verdict = ABSENT if v2_safe else UNDECIDED
    else:
        verdict = UNDECIDED
    return {"verdict": verdict, "grouping": g, "v1 runner": v1, "flash_attn builder": fa, "v2 runner": v2,
            "default runner": dr, "dflash input kernel": texts.get(DFLASH_KERNEL),
            "recovered token": _recovered(texts.get(SAMPLER)), TORCH: texts.get(TORCH),
            DRAFT_WINDOWS: draft_windows(texts)}


def pinned_texts() -> dict:
    """The pinned 0.22.1's files (:mod:`dflash_lab.vllm_sources`, RECORD-checked), as :func:`check` takes them."""
    from .vllm_sources import read_source

    out = {}
    for f in FILES:
        try:
            out[f] = read_source(f)
        except LabError:
            out[f] = None
    kernel_file = "vllm/v1/spec_decode/utils.py"
    out[DFLASH_KERNEL] = kernel_file if DFLASH_KERNEL in read_source(kernel_file) else None
    try:
        out[TORCH] = torch_requirement(read_source(f"vllm-{PINNED}.dist-info/METADATA"))
    except LabError:
        out[TORCH] = None
    return out


# --- recording ----------------------------------------------------------------------------------------------------

def check_releases(versions: list[str], out: Path, command: str, index: dict | None = None,
                   wheel_dir: Path | None = None) -> list[dict]:
    """Download, verify and check each release, and merge the lines into ``out`` by version (a release checked again
    replaces its line; the others stay). Written at once, atomically, after every release succeeded: a failure
    leaves an existing file as it was. ``wheel_dir``: wheels already there (same names) are used instead of
    downloading, still sha256-checked. Returns the new lines."""
    from . import provenance

    out = Path(out)
    kept = load(out) if out.exists() else []          # a damaged record stops here, before any download
    index = index if index is not None else fetch_index()
    entries = {v: wheel_entry(v, index) for v in versions}   # every version checked before any download
    prov = provenance.collect(command)
    lines = []
    with tempfile.TemporaryDirectory(prefix="dflash-lab-wheels-") as tmp:
        for v, e in entries.items():
            local = Path(wheel_dir) / e["filename"] if wheel_dir else None
            path = local if local is not None and local.is_file() else download(e, Path(tmp))
            texts = read_wheel(path, e["sha256"], v)
            if path.parent == Path(tmp):
                path.unlink()
            lines.append({"version": v, **check(texts), "wheel": e["filename"], "wheel_sha256": e["sha256"],
                          "wheel_url": e["url"], "files": {f: (texts[f] is not None) for f in FILES},
                          "checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "command": command, "dflash_lab_commit": prov.get("git_commit"),
                          "python": prov.get("python")})
    merged = {r["version"]: r for r in kept} | {r["version"]: r for r in lines}
    rows = [merged[v] for v in sorted(merged, key=version_key)]
    atomic.write_text(out, "".join(json.dumps(x, sort_keys=True) + "\n" for x in rows))
    return lines


def load(path) -> list[dict]:
    """The recorded lines, each checked for the fields the notebook reads; LabError names a bad line."""
    from .runner import json_lines

    p = Path(path)
    if not p.is_file():
        raise LabError(f"{p}: no such file (record it with python -m dflash_lab upstream-check)")
    rows = []
    for n, r in json_lines(p):
        missing = [k for k in ("version", "verdict", "wheel_sha256", "v1 runner", "v2 runner", "grouping",
                               "flash_attn builder") if k not in r]
        if missing or r.get("verdict") not in VERDICTS:
            raise LabError(f"{p}:{n}: not an upstream-check line (missing {', '.join(missing) or 'a known verdict'})")
        rows.append(r)
    return rows


def _link4(rt: dict | None) -> str:
    if rt is None:
        return "not read"
    if not rt.get("present"):
        return "no V1 sampler kernel"
    how = [w for w, k in (("masked", "out-of-vocabulary lanes masked"), ("clamped", "recovered id clamped")) if rt.get(k)]
    kept = rt.get("recovered id kept inside the vocabulary")
    return f"no ({', '.join(how)})" if kept else "yes" if kept is False else "not decided"


def table(rows: list[dict]):
    """One row per release: the verdict and the facts behind it."""
    import pandas as pd

    def yn(x):
        return "-" if x is None else ("yes" if x else "no")

    out = []
    for r in sorted(rows, key=lambda r: version_key(r["version"])):
        g, v1, fa, v2 = r["grouping"], r["v1 runner"], r["flash_attn builder"], r["v2 runner"]
        out.append({
            "vLLM": r["version"],
            "target attention split (reusing groups)": (", ".join(f"{x['gid']} reuses {x['reuses']}"
                                                                  for x in g["reusing attention groups"]) or "none")
            if g.get("checked") else "not checked",
            f"with the published draft's {PUBLISHED_SHAPE['layers']} layers": _split_8(g.get(PUBLISHED_GROUPING)),
            "V1 runner": ("reuses same-spec metadata" if v1.get("run time reuses a same-spec group's metadata")
                          and not v1.get("reuse limited to Mamba") else "other reuse rule") if v1.get("checked")
            else ("absent" if not v1["present"] else "not checked"),
            "FA builder update_block_table leaves the graph's schedule stale":
                yn(fa.get("reusing group's graph reads the capture's schedule")) if fa.get("checked") else "not checked",
            "V2 runner reuse": ("Mamba groups only" if v2.get("reuse limited to Mamba") else
                                "not read" if v2.get("reuses metadata") and v2.get("reuse limited to Mamba") is None
                                else "any builder" if v2.get("reuses metadata") else "none") if v2["present"] else "absent",
            "default runner (its rule, read)": (r.get("default runner") or {}).get("default") or "not read",
            "DFlash input kernel": "absent" if r.get("dflash input kernel") is None else "present",
            "V1 sampler: NaN row can get an id >= vocabulary (link 4)": _link4(r.get("recovered token")),
            "torch": r.get(TORCH) or "not read",
            "a draft mixing sliding and full layers": _windows_cell(r.get(DRAFT_WINDOWS)),
            "verdict": r["verdict"],
        })
    return pd.DataFrame(out)


def _split_8(g) -> str:
    """The table's cell for the grouping with the published draft's shape (``grouping``'s :data:`PUBLISHED_GROUPING`)."""
    if not g or not g.get("checked"):
        return "not checked"
    return ", ".join(f"{x['gid']} reuses {x['reuses']} (layers {', '.join(map(str, x['layers']))})"
                     for x in g["reusing attention groups"]) or "none"


def _windows_cell(d) -> str:
    """The table's cell for :func:`draft_windows`: what the release does with a draft whose layers mix sliding and
    full attention (the published draft's may; the GPU runs' dummy drafts declare full attention only)."""
    if not d or not d.get("checked"):
        return "not read"
    short = {WIN_IGNORED: "ignored: all full attention", WIN_REFUSED: "refused",
             WIN_REFUSED_V1: "refused under V1 only, built under V2", WIN_BUILT: "built with its windows"}
    cell = short.get(d.get("mixed sliding and full layers"), "unrecognised verdict")
    rules = (d.get("config rule") or {}).get("rules") or []
    if CFG_FORCES_V2 in rules:
        cell += "; the config gives it V2 unless VLLM_USE_V2_MODEL_RUNNER is set"
    if CFG_V1_REFUSES in rules:
        cell += "; V1 refuses it at config validation"
    return cell


#: GPU runs of engines on a later release (runner key ``vllm_release``; ``ingest --kind release``)
RELEASE_RUNS = "data/upstream/runs/*.jsonl"
#: what makes a 0.22.1 line the same engine as a release line (beside the GPU session): the configuration keys
SAME_CONFIG = ("spec_method", "num_speculative_tokens", "cudagraph_mode", "cudagraph_capture_sizes", "enforce_eager",
               "drafter_enforce_eager", "tensor_parallel_size", "mode", "concurrency", "acceptance", "max_tokens",
               "temperature", "ignore_eos", "max_num_seqs", "max_model_len", "max_num_batched_tokens", "moe_backend",
               "async_scheduling", "prefix_caching", "engine_args", "env")


def _target(r) -> str | None:
    t = r.get("target")
    return t.get("name") if isinstance(t, dict) else t


def _cfg(r, key) -> str:
    """One configuration value of a line, comparable across lines (a missing or empty mapping is the same as {})."""
    v = r.get(key)
    if key in ("engine_args", "env") and not v:
        v = {}
    return json.dumps(v, sort_keys=True)


def _stock_plain(r) -> bool:
    """A 0.22.1 line with nothing of the lab inside its engine: no fix, diff, hook, probe or canary."""
    return not (r.get("fix") or r.get("vllm_diff") or r.get("hook") or r.get("probe") or r.get("canary")
                or r.get("sched_snapshot") or r.get("sched_ledger") or r.get("fa_splits") or r.get("first_step_requests"))


def gpu_runs(release_pattern: str = RELEASE_RUNS, controls_pattern: str = "data/runs/*.jsonl"):
    """Each later release's GPU runs beside the 0.22.1 controls of the same GPU session and configuration.

    One row per (release, GPU session, configuration): its runs (deadline cuts and start-up errors apart, as
    :func:`analysis.crash_table` counts them), crashes, the core dumps' kernels, vLLM's counted acceptance and the
    requests completed; then the same for the 0.22.1 lines (``data/runs/``) of that session whose configuration
    (:data:`SAME_CONFIG`, the target) is the same and whose engine ran nothing of the lab's (:func:`_stock_plain`).
    A release row without such a control says so: its runs alone say nothing about 0.22.1's crash."""
    import pandas as pd

    from .analysis import recorded_lines
    from .runner import is_deadline_cut
    from .verification import fault_kernel

    def counted(r):
        if r.get("outcome") == "startup_error" or is_deadline_cut(r):
            return False
        return True

    def summary(lines):
        runs = [r for r in lines if counted(r)]
        crashed = [r for r in runs if r.get("outcome") == "crash"]
        acc = [(r.get("spec_decode_metrics") or {}).get("acceptance_length") for r in runs]
        acc = [a for a in acc if isinstance(a, (int, float))]
        return {"runs": len(runs), "crashed": len(crashed),
                "completed": sum(1 for r in runs if r.get("outcome") == "ok"),
                "cores": ", ".join(sorted({fault_kernel(r) or "no core" for r in crashed})) or "-",
                "counted acceptance": (f"{min(acc):.2f}-{max(acc):.2f}" if acc else "-"),
                "requests completed": sum(int(r.get("requests_completed") or 0) for r in runs),
                "not counted": len(lines) - len(runs)}

    releases = [r for _, _, r in recorded_lines(release_pattern)] if glob_any(release_pattern) else []
    bad = [r.get("run_id") for r in releases if not r.get("vllm_release")]
    if bad:
        raise LabError(f"{release_pattern}: lines without vllm_release: {bad[:5]}")
    controls = [r for _, _, r in recorded_lines(controls_pattern)] if glob_any(controls_pattern) else []
    # a release engine with a vllm_diff (the fix's part 1 ported, say) is another engine than the stock one: a row of
    # its own, and no stock 0.22.1 line is its control
    key = lambda r: (r.get("vllm_release"), r.get("gpu_session"), _target(r), *(_cfg(r, k) for k in SAME_CONFIG),
                     r.get("vllm_diff") or "")
    groups: dict = {}
    for r in releases:
        groups.setdefault(key(r), []).append(r)
    out = []
    for k, lines in sorted(groups.items(), key=lambda kv: (version_key(kv[0][0]), str(kv[0][1]))):
        r0 = lines[0]
        ctrl = [c for c in controls if c.get("gpu_session") == r0.get("gpu_session") and _target(c) == _target(r0)
                and not c.get("vllm_release") and _stock_plain(c) and not r0.get("vllm_diff")
                and all(_cfg(c, x) == _cfg(r0, x) for x in SAME_CONFIG)]
        rel, c = summary(lines), summary(ctrl)
        out.append({
            "vLLM": r0["vllm_release"], "GPU session": r0.get("gpu_session"),
            "configuration": (f"{r0.get('cudagraph_mode') or 'eager'}, {r0.get('mode')}, TP={r0.get('tensor_parallel_size')}, "
                              f"concurrency {r0.get('concurrency')}, acceptance {r0.get('acceptance')}, "
                              f"{r0.get('max_tokens')} tokens, "
                              + ("greedy" if r0.get("temperature") == 0 else f"temperature {r0.get('temperature')}")
                              + (f", with {os.path.basename(str(r0['vllm_diff']))}" if r0.get("vllm_diff") else "")),
            "runs": rel["runs"], "crashed": rel["crashed"], "completed": rel["completed"], "cores": rel["cores"],
            "counted acceptance": rel["counted acceptance"], "requests completed": rel["requests completed"],
            "diff": os.path.basename(str(r0["vllm_diff"])) if r0.get("vllm_diff") else "",
            "0.22.1 controls (same session and configuration)": c["runs"],
            "0.22.1 crashed": c["crashed"], "0.22.1 cores": c["cores"],
            "matrices": ", ".join(sorted({x.get("matrix") for x in lines + ctrl})),
        })
    return pd.DataFrame(out)


def glob_any(pattern: str) -> bool:
    import glob

    return bool(glob.glob(pattern))


#: s66's question (pre-registered in the two matrices' headers): at an integer synthetic acceptance every step gains
#: exactly L tokens, so vLLM's own counters show lost tokens without any instrument of the lab's in the engine
ACC6_RELEASE_MATRIX = "release-0.26.0-acc6-c8-tp1"
ACC6_CONTROL_MATRIX = "release-control-0.22.1-acc6-c8-tp1"
#: the counted mean the predictions name for 7 of 8 requests losing one token per step (acceptance.lossy_counts(8, 7,
#: 6.0, 512): 5.107), with the 0.01 either side that s30's and s48's server runs spread over (5.11-5.12)
ACC6_LOSSY_RANGE = (5.10, 5.13)


def release_frame(matrices, release_pattern: str = RELEASE_RUNS, controls_pattern: str = "data/runs/*.jsonl"):
    """The run lines of ``matrices`` (names) from the release runs and the 0.22.1 runs, as one DataFrame
    (:func:`analysis.load_runs` of each), with ``vLLM`` the engine's version (its ``vllm_release``, else 0.22.1) and
    ``file`` the runs file's name, so that :func:`verification.output_record` finds a run's recorded outputs. Raises
    when neither pattern has a line of them."""
    import pandas as pd

    from .analysis import load_runs

    parts = []
    for pattern in (release_pattern, controls_pattern):
        if glob_any(pattern):
            d = load_runs(pattern)
            parts.append(d[d["matrix"].isin(list(matrices))] if "matrix" in d else d.iloc[0:0])
    d = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    if d.empty:
        raise LabError(f"no run lines of {', '.join(matrices)} in {release_pattern} or {controls_pattern}")
    rel = d["vllm_release"] if "vllm_release" in d else pd.Series([None] * len(d))
    d["vLLM"] = [v if isinstance(v, str) and v else "0.22.1" for v in rel]
    return d


def _nonfinite_logprobs(rec) -> int | None:
    """How many sampled tokens of a ``record_outputs`` record carry a NaN or infinite log-probability (None: no
    log-probabilities recorded)."""
    import math

    if not rec or "logprobs" not in rec:
        return None
    return sum(1 for req in rec["logprobs"] for v in req
               if v is not None and isinstance(v, (int, float)) and not math.isfinite(v))


def acc6_runs(d, data_dir: str = "data"):
    """One row per measured run line of the acceptance-6.0 matrices (:func:`release_frame`; start-up errors left
    out): vLLM, graph mode, temperature, outcome, the core's kernel, vLLM's counted acceptance and drafts, the
    requests completed, and for greedy runs the distinct outputs among its requests (every request has the same
    prompt) and the sampled tokens with a non-finite log-probability."""
    import pandas as pd

    from .runner import is_deadline_cut
    from .verification import fault_kernel, output_record

    rows = []
    for _, r in d.iterrows():
        if r.get("outcome") == "startup_error" or is_deadline_cut(dict(r)):
            continue
        sd = r.get("spec_decode_metrics") if isinstance(r.get("spec_decode_metrics"), dict) else {}
        # a run line says it recorded its outputs by its digests (the runner writes no record_outputs key)
        rec = output_record(r, data_dir) if isinstance(r.get("output_digests"), list) else None
        rows.append({"vLLM": r["vLLM"], "graphs": r["cudagraph_mode"], "run": r["run_id"],
                     "temperature": float(r["temperature"]), "outcome": r["outcome"],
                     "core": fault_kernel(r) or ("-" if r["outcome"] != "crash" else "no core"),
                     "counted acceptance": sd.get("acceptance_length"), "drafts counted": sd.get("num_drafts"),
                     "requests completed": int(r.get("requests_completed") or 0),
                     "distinct outputs": len({tuple(x) for x in rec["token_ids"]}) if rec else None,
                     "non-finite log-probabilities": _nonfinite_logprobs(rec),
                     "gpu_session": r.get("gpu_session"), "matrix": r["matrix"]})
    return pd.DataFrame(rows)


def acc6_predictions(release_pattern: str = RELEASE_RUNS, controls_pattern: str = "data/runs/*.jsonl",
                     data_dir: str = "data", matrices_dir: str | None = None):
    """The s66 matrices (:data:`ACC6_RELEASE_MATRIX`, :data:`ACC6_CONTROL_MATRIX`) against the predictions their
    headers wrote before the runs, one row each, ``held`` True, False or None (not decided: a planned run has no
    measured line). Returns (predictions, :func:`acc6_runs` table, :func:`verification.output_agreement` of 0.26.0's
    greedy FULL runs against its PIECEWISE runs of the same round). Raises when neither matrix has a line."""
    import math
    from pathlib import Path

    import pandas as pd

    from .verification import output_agreement, planned_runs

    d = release_frame([ACC6_RELEASE_MATRIX, ACC6_CONTROL_MATRIX], release_pattern, controls_pattern)
    t = acc6_runs(d, data_dir)
    mdir = Path(matrices_dir) if matrices_dir else Path(__file__).resolve().parents[1] / "matrices"
    plan = {m: planned_runs(mdir / f"{m}.yaml") for m in (ACC6_RELEASE_MATRIX, ACC6_CONTROL_MATRIX)}
    lo, hi = ACC6_LOSSY_RANGE

    def cell(vllm, graphs, greedy):
        if t.empty:
            return t
        return t[(t["vLLM"] == vllm) & (t["graphs"] == graphs) & ((t["temperature"] == 0) == greedy)]

    def planned(matrix, engine, greedy):
        runs = [x for x in plan[matrix] if x.startswith(engine + "/")]
        # the greedy entries are the matrix's second run entry: rounds r0, r1 after the three sampled ones
        return len(runs) - 3 if greedy else 3

    def counted(c):
        return ", ".join(f"{v:.3f}" if isinstance(v, (int, float)) and v == v else "not read"
                         for v in c["counted acceptance"]) or "none"

    def judge(c, n_planned, ok_run):
        """True when every planned run measured and each passes, False when a measured one fails, else None."""
        oks = [ok_run(r) for _, r in c.iterrows()]
        if not all(oks):
            return False
        return True if len(c) >= n_planned else None

    def is_num(v):
        return isinstance(v, (int, float)) and v == v

    def lossy(c):
        """(b) of the release and (a) of the control: every run completed and counted inside the lossy range."""
        return judge(c, 3, lambda r: r["outcome"] == "ok" and is_num(r["counted acceptance"])
                     and lo <= r["counted acceptance"] <= hi)

    def no_crash(matrix, vllm, predicted):
        """A matrix's no-crash prediction over every measured run of its vLLM: decided once all planned runs ran."""
        c = t[t["vLLM"] == vllm] if len(t) else t
        crashed = int((c["outcome"] == "crash").sum()) if len(c) else 0
        return {"matrix": matrix, "predicted": predicted, "measured": f"{crashed} of {len(c)} run(s) crashed",
                "held": False if crashed else (True if len(c) >= len(plan[matrix]) else None)}

    rows = []
    pw = cell("0.26.0", "PIECEWISE", False)
    rows.append({"matrix": ACC6_RELEASE_MATRIX, "predicted": "(a) 0.26.0 PIECEWISE counts exactly 6.000 in 3 of 3 runs at 8",
                 "measured": f"{len(pw)} run(s): {counted(pw)}",
                 "held": judge(pw, 3, lambda r: r["outcome"] == "ok" and is_num(r["counted acceptance"])
                               and abs(r["counted acceptance"] - 6.0) < 1e-9)})
    fu = cell("0.26.0", "FULL_AND_PIECEWISE", False)
    rows.append({"matrix": ACC6_RELEASE_MATRIX,
                 "predicted": f"(b) 0.26.0 FULL_AND_PIECEWISE counts below 6 in 3 of 3 runs at 8, each {lo:.2f}-{hi:.2f}",
                 "measured": f"{len(fu)} run(s): {counted(fu)}", "held": lossy(fu)})
    rel = d[d["matrix"] == ACC6_RELEASE_MATRIX]
    agree = pd.DataFrame()
    if len(rel):
        # per session, and said so: a matrix run again in a later session repeats its run ids
        agree = pd.concat([output_agreement(rel, s).assign(gpu_session=s) for s in sorted(set(rel["gpu_session"]))],
                          ignore_index=True)
    gf, gp = cell("0.26.0", "FULL_AND_PIECEWISE", True), cell("0.26.0", "PIECEWISE", True)
    n_greedy = planned(ACC6_RELEASE_MATRIX, "r0260-full-acc6", True)
    parts, verdicts = [], []
    for _, r in gf.iterrows():
        a = (agree[(agree["run"] == r["run"]) & (agree["gpu_session"] == r["gpu_session"])]
             if len(agree) and "run" in agree else agree.iloc[0:0])
        nonfin = r["non-finite log-probabilities"]
        if a.empty:
            parts.append(f"{r['run']}: no PIECEWISE run of its round")
            continue
        differs = not bool(a.iloc[0]["all identical"])
        parts.append(f"{r['run']}: {a.iloc[0]['identical requests']} requests identical to PIECEWISE, "
                     f"{nonfin if nonfin is not None else 'no'} non-finite log-probabilities")
        verdicts.append(differs or bool(nonfin))
    pw_nonfin = [x for x in gp["non-finite log-probabilities"] if x is not None and not (isinstance(x, float) and math.isnan(x))]
    parts.append(f"PIECEWISE greedy: {sum(pw_nonfin)} non-finite log-probabilities over {len(gp)} run(s)")
    c_held = (False if (verdicts and not all(verdicts)) or sum(pw_nonfin) else
              True if len(verdicts) >= n_greedy and len(gp) >= n_greedy else None)
    rows.append({"matrix": ACC6_RELEASE_MATRIX,
                 "predicted": "(c) greedy at 8: each 0.26.0 FULL run differs from the PIECEWISE run of its round in at least "
                              "one request's token ids, or carries a non-finite log-probability; no PIECEWISE request "
                              "carries one",
                 "measured": "; ".join(parts), "held": c_held})
    rows.append(no_crash(ACC6_RELEASE_MATRIX, "0.26.0", "(d) no run of either 0.26.0 engine crashes"))
    ct = cell("0.22.1", "FULL_AND_PIECEWISE", False)
    rows.append({"matrix": ACC6_CONTROL_MATRIX,
                 "predicted": f"(a) 0.22.1 stock FULL_AND_PIECEWISE counts below 6 in 3 of 3 runs at 8, each {lo:.2f}-{hi:.2f}",
                 "measured": f"{len(ct)} run(s): {counted(ct)}", "held": lossy(ct)})
    rows.append(no_crash(ACC6_CONTROL_MATRIX, "0.22.1", "(b) no 0.22.1 run crashes"))
    return pd.DataFrame(rows), t, agree


#: what two greedy runs must share (beside the target) for one's outputs to stand as the other's expected tokens: the
#: weights (dummy weights are seeded, so one architecture gives one model), the prompt (the runner sends one fixed
#: prompt; its length is what a line records), the length of the answer, and the drafter, whose tokens the synthetic
#: acceptance accepts
WORKLOAD_KEYS = ("weights", "prompt_tokens", "max_tokens", "ignore_eos", "spec_method", "num_speculative_tokens",
                 "draft")


def _reference_path(r) -> bool:
    """A stock engine with nothing of the lab inside it that replays no FULL graph: PIECEWISE or eager."""
    return _stock_plain(r) and (r.get("enforce_eager") is True or r.get("cudagraph_mode") == "PIECEWISE")


def run_pool(release_pattern: str = RELEASE_RUNS, controls_pattern: str = "data/runs/*.jsonl"):
    """Every recorded run line, 0.22.1's and the releases', as one frame (:func:`analysis.load_runs` of each pattern
    that matches a file): the pool :func:`greedy_against_reference` draws its references from."""
    import pandas as pd

    from .analysis import load_runs

    return pd.concat([load_runs(p) for p in (controls_pattern, release_pattern) if glob_any(p)], ignore_index=True)


def _lines_of(df) -> list[dict]:
    """A frame's rows as run lines again: a key another line had and this one lacks reads None, not NaN."""
    import math

    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
            for _, r in df.iterrows()] if len(df) else []


def _greedy_recorded(r) -> bool:
    return (r.get("outcome") == "ok" and isinstance(r.get("output_digests"), list)
            and isinstance(r.get("temperature"), (int, float)) and float(r["temperature"]) == 0.0)


def greedy_against_reference(runs, pool, data_dir: str = "data"):
    """Each request of each greedy run in ``runs`` (a :func:`release_frame`) against the tokens that reference-path
    runs of the same workload produced: every greedy, completed run in ``pool`` (:func:`release_frame` of any
    matrices, or :func:`analysis.load_runs`) on PIECEWISE or eager with nothing of the lab inside its engine, the same
    target and :data:`WORKLOAD_KEYS`, of any vLLM, concurrency or synthetic acceptance, and of none of the matrices
    ``runs`` belong to (a run under judgement, or its own matrix's PIECEWISE engine, is no reference for it: their
    pairing inside one session is :func:`acc6_predictions`' (c)). The synthetic acceptance
    accepts drafts whatever their token, so those differ only where the draft and the target would choose
    differently; the reference columns say what the references ran, so a reader can judge. Per request: whether its
    tokens equal a reference output, the tokens off the closest reference output (fewest differing positions), the
    first of them, how many fall on a step's end (positions k*L at an integer acceptance L: the token the target
    samples after the accepted drafts; None where vLLM counted less than L for the run, as a lost token moves the
    step ends), its non-finite log-probabilities (counts, and the positions for a figure), and the largest difference of
    its log-probabilities from request 0's along their common token prefix (the same prompt in another batch slot).
    ``reference outputs differ within the first`` N tokens: the references' own spread (their near-ties).
    Raises when a run has no reference."""
    import math

    import pandas as pd

    from .verification import _prefix_logprob_diff, output_record

    judged = _lines_of(runs)
    own = {x.get("matrix") for x in judged}
    refs, ref_lines = {}, {}
    for x in _lines_of(pool):
        if not (_greedy_recorded(x) and _reference_path(x)) or x.get("matrix") in own:
            continue
        rec = output_record(x, data_dir)
        if not rec:
            continue
        key = (_target(x),) + tuple(_cfg(x, k) for k in WORKLOAD_KEYS)
        refs.setdefault(key, set()).update(tuple(t) for t in rec["token_ids"])
        ref_lines.setdefault(key, []).append(x)

    out = []
    for r in judged:
        if not _greedy_recorded(r):
            continue
        key = (_target(r),) + tuple(_cfg(r, k) for k in WORKLOAD_KEYS)
        if key not in refs:
            raise LabError(f"{r['run_id']}: no greedy reference-path run (PIECEWISE or eager, stock) of the same "
                           f"target, {', '.join(WORKLOAD_KEYS)} has recorded outputs")
        rec = output_record(r, data_dir)
        if not rec:
            raise LabError(f"{r['run_id']}: its recorded outputs are missing under {data_dir}/gpu")
        # how far the reference outputs themselves spread: the engine's own near-ties between identical prompts
        spread = max((p + 1 for x in refs[key] for y in refs[key] for p, (u, v) in enumerate(zip(x, y)) if u != v),
                     default=0)
        acc = r.get("acceptance")
        sd = r.get("spec_decode_metrics") if isinstance(r.get("spec_decode_metrics"), dict) else {}
        counted = sd.get("acceptance_length")
        step = (int(acc) if isinstance(acc, (int, float)) and float(acc).is_integer() and acc >= 2
                and isinstance(counted, (int, float)) and abs(counted - acc) < 1e-9 else None)
        lines = ref_lines[key]
        logprobs = rec.get("logprobs") or [None] * len(rec["token_ids"])
        first_toks, first_lps = rec["token_ids"][0], logprobs[0]
        for i, (toks, lps) in enumerate(zip(rec["token_ids"], logprobs)):
            best = min(refs[key], key=lambda ref: (sum(a != b for a, b in zip(toks, ref)) + abs(len(toks) - len(ref))))
            off = [p for p, (a, b) in enumerate(zip(toks, best)) if a != b] + list(range(min(len(toks), len(best)),
                                                                                           max(len(toks), len(best))))
            nonfin = None if lps is None else [p for p, v in enumerate(lps)
                                               if v is not None and isinstance(v, (int, float)) and not math.isfinite(v)]
            out.append({"vLLM": r.get("vLLM") or r.get("vllm_release") or "0.22.1", "graphs": r.get("cudagraph_mode"),
                        # a matrix run again in a later session repeats its run ids: the session keeps runs apart
                        "GPU session": r.get("gpu_session") or "", "run": r["run_id"], "request": i, "tokens": len(toks),
                        "equals a reference output": tuple(toks) in refs[key],
                        "tokens off the reference": len(off), "first off": off[0] if off else None,
                        "off at step ends": (sum(1 for p in off if p and p % step == 0) if step else None),
                        "non-finite log-probabilities": None if nonfin is None else len(nonfin),
                        "first non-finite": (nonfin[0] if nonfin else None),
                        "off positions": off, "non-finite positions": nonfin,
                        "max |dlogprob| vs request 0": (None if lps is None or first_lps is None or i == 0 else
                                                        _prefix_logprob_diff(toks, lps, first_toks, first_lps)[1]),
                        "reference runs": len(lines), "reference outputs": len(refs[key]),
                        "reference outputs differ within the first": spread,
                        "reference acceptance": ", ".join(sorted({str(x.get("acceptance")) for x in lines})),
                        "reference vLLM": ", ".join(sorted({x.get("vllm_release") or "0.22.1" for x in lines})),
                        "reference graphs": ", ".join(sorted({"eager" if x.get("enforce_eager") is True
                                                              else str(x.get("cudagraph_mode")) for x in lines}))})
    return pd.DataFrame(out)


def _max_known(values):
    """The largest of the values that are numbers (NaN included: a NaN difference must show), None if none is."""
    import math

    vals = [float(v) for v in values if isinstance(v, (int, float))]
    return None if not vals else (math.nan if any(math.isnan(v) for v in vals) else max(vals))


def reference_summary(per_request):
    """:func:`greedy_against_reference` per run (GPU session and run id: a matrix run again repeats its ids): requests,
    those equal to a reference output, tokens off it (and of them on step ends), the earliest first-off position,
    non-finite log-probabilities, and the largest log-probability difference from request 0 along a common token
    prefix. Empty for no rows."""
    import pandas as pd

    rows = []
    if not len(per_request):
        return pd.DataFrame(rows)
    for (session, run), g in per_request.groupby(["GPU session", "run"], sort=False):
        firsts = [int(v) for v in g["first off"] if v is not None and v == v]
        ends = [v for v in g["off at step ends"] if v is not None and v == v]
        nf = [v for v in g["non-finite log-probabilities"] if v is not None and v == v]
        rows.append({"vLLM": g["vLLM"].iloc[0], "graphs": g["graphs"].iloc[0], "GPU session": session, "run": run,
                     "requests equal to a reference output": f"{int(g['equals a reference output'].sum())}/{len(g)}",
                     "tokens off the reference": int(g["tokens off the reference"].sum()),
                     "of them at step ends": int(sum(ends)) if ends else None,
                     "tokens": int(g["tokens"].sum()),
                     "earliest off position": min(firsts) if firsts else None,
                     "non-finite log-probabilities": int(sum(nf)) if nf else None,
                     # request 0 has no difference from itself (its None reads NaN in a frame): left out
                     "max |dlogprob| vs request 0": _max_known(g[g["request"] != 0]["max |dlogprob| vs request 0"])})
    return pd.DataFrame(rows)


#: s67's question for the next GPU session (pre-registered in the matrix's header): does the fix's part 1, ported to
#: 0.26.0 as a diff, give 0.26.0's FULL engine the reference-path tokens?
PART1_RELEASE_MATRIX = "release-0.26.0-part1-acc6-c8-tp1"


def part1_predictions(release_pattern: str = RELEASE_RUNS, controls_pattern: str = "data/runs/*.jsonl",
                      data_dir: str = "data", matrices_dir: str | None = None):
    """:data:`PART1_RELEASE_MATRIX` against the predictions its header wrote before its runs, one row each, ``held``
    True, False or None (not decided: a planned run has no measured line). Returns (predictions, the
    :func:`reference_summary` of its greedy runs). Raises when the matrix has no line."""
    from pathlib import Path

    import pandas as pd

    from .runner import is_deadline_cut
    from .verification import planned_runs

    d = release_frame([PART1_RELEASE_MATRIX], release_pattern, controls_pattern)
    mdir = Path(matrices_dir) if matrices_dir else Path(__file__).resolve().parents[1] / "matrices"
    plan = planned_runs(mdir / f"{PART1_RELEASE_MATRIX}.yaml")
    n_greedy = sum(1 for x in plan if "/greedy-" in x)
    from .vllmdiff import hunks_sha256

    lines = _lines_of(d)
    measured = [r for r in lines if r.get("outcome") != "startup_error" and not is_deadline_cut(r)]
    errors = [r for r in lines if r.get("outcome") == "startup_error"]
    rows = []

    def verdict(fail, complete):
        return False if fail else (True if complete else None)

    # that the runs ran the committed diff's code on the release: each measured line's overlay stamp names the
    # committed diff's hunks and, as the package it was made from, the release's own vllm folder
    diff_path = Path(__file__).resolve().parents[1] / "patches" / "vllm-0.26.0-part1.diff"
    want = hunks_sha256(diff_path.read_text())
    stamps = [r.get("vllm_diff_stamp") if isinstance(r.get("vllm_diff_stamp"), dict) else {} for r in measured]
    unstamped = [r["run_id"] for r, st in zip(measured, stamps)
                 if st.get("hunks_sha256") != want
                 or not str(st.get("source") or "").endswith(f"/{r.get('vllm_release')}/vllm")]
    rows.append({"predicted": "(a) the diff applies to the staged 0.26.0 and the engine starts: no startup_error",
                 "measured": f"{len(errors)} startup_error line(s)"
                             + (f" ({errors[0].get('error')})" if errors else "") + f", {len(measured)} run(s) measured"
                             + (f"; runs whose overlay stamp is not the committed diff on the release: {unstamped}"
                                if unstamped else ""),
                 "held": verdict(bool(errors) or bool(unstamped), len(measured) >= 1)})
    pool = run_pool(release_pattern, controls_pattern)
    greedy = d[[isinstance(x, list) for x in d["output_digests"]]] if "output_digests" in d else d.iloc[0:0]
    s = reference_summary(greedy_against_reference(greedy, pool, data_dir=data_dir)) if len(greedy) else pd.DataFrame()
    if len(s):
        conc = {r["run_id"]: int(r.get("concurrency") or 0) for r in lines}
        ok = [x == f"{conc[run]}/{conc[run]}" and nf == 0
              for run, x, nf in zip(s["run"], s["requests equal to a reference output"], s["non-finite log-probabilities"])]
        said = "; ".join(f"{r}: {x} requests equal a reference output, {nf} non-finite log-probabilities"
                         for r, x, nf in zip(s["run"], s["requests equal to a reference output"],
                                             s["non-finite log-probabilities"]))
    else:
        ok, said = [], "no greedy run measured"
    rows.append({"predicted": "(b) greedy: in each run 8 of 8 requests equal a reference-path output, no non-finite "
                              "log-probability",
                 "measured": said, "held": verdict(not all(ok), len(ok) >= n_greedy)})
    counted = [(r.get("spec_decode_metrics") or {}).get("acceptance_length") for r in measured
               if r.get("outcome") == "ok"]
    exact = [isinstance(c, (int, float)) and abs(c - 6.0) < 1e-9 for c in counted]
    rows.append({"predicted": "(c) vLLM counts exactly 6.000 tokens per step in every run",
                 "measured": ", ".join(f"{c:.3f}" if isinstance(c, (int, float)) else "not read" for c in counted)
                             or "none",
                 "held": verdict(not all(exact), len(exact) >= len(plan))})
    crashed = sum(1 for r in measured if r.get("outcome") == "crash")
    rows.append({"predicted": "(d) no run crashes", "measured": f"{crashed} of {len(measured)} run(s) crashed",
                 "held": verdict(crashed > 0, len(measured) >= len(plan))})
    return pd.DataFrame(rows), s


def session_agreement(matrices, release_pattern: str = RELEASE_RUNS, controls_pattern: str = "data/runs/*.jsonl",
                      data_dir: str = "data"):
    """Every greedy FULL_AND_PIECEWISE run of ``matrices`` (any mix, e.g. :data:`PART1_RELEASE_MATRIX` with
    :data:`ACC6_RELEASE_MATRIX`, whose PIECEWISE engine then serves as the reference) against the stock PIECEWISE run of
    the same GPU session, host, vLLM release, workload (target and :data:`WORKLOAD_KEYS`, synthetic acceptance),
    concurrency and round: identical requests (token ids) and the largest log-probability difference along each
    request's common prefix, beside both engines' own spread between requests of one run
    (:func:`verification.output_agreement`, :func:`verification.logprob_agreement`). A run with no such PIECEWISE run
    has no row: runs of two sessions or two hosts are never paired (a line without a session label pairs with none).
    Empty when none pairs."""
    import pandas as pd

    from .verification import logprob_agreement, output_agreement

    d = release_frame(matrices, release_pattern, controls_pattern)
    if d.empty or "gpu_session" not in d:
        return pd.DataFrame()

    # the workload key greedy_against_reference matches references by, plus session, release, host and acceptance
    keys = [(r.get("gpu_session"), r.get("vLLM") or r.get("vllm_release") or PINNED, r.get("host_boot_id"),
             _target(r), _cfg(r, "acceptance")) + tuple(_cfg(r, k) for k in WORKLOAD_KEYS) for r in _lines_of(d)]
    out = []
    for k in dict.fromkeys(keys):
        session, version = k[0], k[1]
        if not isinstance(session, str) or not session:
            continue
        g = d[[x == k for x in keys]]
        tok, lp = output_agreement(g, session), logprob_agreement(g, session, data_dir=data_dir)
        if tok.empty:
            continue
        cols = ["run", "positions compared", "max |dlogprob| vs reference", "max |dlogprob| within the FULL run",
                "max |dlogprob| within the reference run"]
        t = tok.merge(lp[cols], on="run", how="left") if len(lp) else tok.assign(**{c: None for c in cols[1:]})
        t.insert(0, "vLLM", version)
        t.insert(1, "GPU session", session)
        out.append(t)
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame()
