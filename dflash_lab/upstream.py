"""Later vLLM releases, read on the CPU: does the crash's precondition outlive 0.22.1?

A maintainer's first question after a root cause: is it still there? The GPU runs are all on the pinned 0.22.1.
This module reads each later release's own source text, from its published x86-64 wheel (sha256 checked against
PyPI's index, every file checked against the wheel's ``RECORD``), and asks of it what :mod:`dflash_lab.rootcause`
and :mod:`dflash_lab.kvgroups` ask of 0.22.1:

- **grouping**: vLLM's own grouping function of that release, run on the target (Qwen3.6-35B-A3B's 40 layers) with
  the 5-layer DFlash draft: are the target's attention layers split into groups of one spec, so that a later group
  reuses the first one's metadata?
- **V1 runner** (``vllm/v1/worker/gpu_model_runner.py``, ``_build_attention_metadata``): FULL-graph capture builds
  every group with its own builder, and at run time a later group of the same (spec, builder type) gets the first
  group's metadata through ``update_block_table``, for any builder that supports it;
- **FlashAttention builder**: it supports ``update_block_table`` and owns a persistent ``scheduler_metadata`` buffer;
- **the stale read**: that release's ``update_block_table``, executed verbatim in :func:`rootcause.simulate`'s two
  groups: does the reusing group's captured graph still read the capture's schedule, not the step's?
- **V2 runner** (``vllm/v1/worker/gpu/attn_utils.py``): is its metadata reuse restricted to Mamba groups (so every
  attention group builds its own), and does capture take the same reuse path as run time?

What this is not: a run. Which runner a release picks for this engine by default, and whether another change keeps
the stale schedule from being read, are not decided here; a GPU run of that release is. The results are recorded
(``data/upstream/releases.jsonl``, with provenance) by ``python -m dflash_lab upstream-check``, since each wheel is
250-340 MB; :func:`check` runs on the pinned 0.22.1 in the tests and when notebook 04 renders.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import tempfile
import time
import urllib.request
import zipfile
from collections import defaultdict
from pathlib import Path

from . import atomic
from .errors import LabError

INDEX_URL = "https://pypi.org/simple/vllm/"
PINNED = "0.22.1"
RUNNER_V1 = "vllm/v1/worker/gpu_model_runner.py"
RUNNER_V2 = "vllm/v1/worker/gpu/attn_utils.py"
FA = "vllm/v1/attention/backends/flash_attn.py"
KV_UTILS = "vllm/v1/core/kv_cache_utils.py"
KV_PLANNING = "vllm/v1/core/kv_cache_planning.py"   # where the grouping function lives in later releases
FILES = (RUNNER_V1, RUNNER_V2, FA, KV_UTILS, KV_PLANNING)
FA_BUILDER = "FlashAttentionMetadataBuilder"
#: the verdicts, one per release
PRESENT = "precondition present (V1 runner)"
ABSENT = "precondition absent"
UNDECIDED = "not decided from the source"


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
    import os

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
            out = {}
            for name in FILES:
                if name not in record:
                    out[name] = None
                    continue
                data = z.read(name)
                if _record_digest(data) != record[name]:
                    raise LabError(f"{path}: {name} differs from the wheel's RECORD")
                out[name] = data.decode("utf-8")
    except zipfile.BadZipFile:
        raise LabError(f"{path}: not a zip archive (a wheel cut short?)") from None
    return out


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


def _grouping(texts: dict) -> dict:
    """That release's grouping function on the target with the 5-layer DFlash draft: the reusing attention groups."""
    from . import kvgroups
    from .vllm_code import load_function

    quiet = logging.getLogger("dflash_lab.vllm.kv_cache_utils")
    quiet.setLevel(logging.ERROR)
    ns = {"defaultdict": defaultdict, "cdiv": lambda a, b: -(-a // b), "logger": quiet,
          "create_kv_cache_group_specs": lambda spec, grouped: [list(g) for g in grouped]}
    where = [f for f in (KV_UTILS, KV_PLANNING) if texts.get(f) and f"def {kvgroups.GROUPING_FN}(" in texts[f]]
    if not where:
        return {"checked": False, "why": f"no {kvgroups.GROUPING_FN} in {KV_UTILS} or {KV_PLANNING}"}
    try:
        fn = load_function(where[0], kvgroups.GROUPING_FN, namespace=ns, text=texts[where[0]])
        layers = {k: _Spec(v) for k, v in kvgroups.hybrid_layers(draft_layers=5).items()}
        gs = [{"gid": g, "spec": layers[names[0]], "layers": names} for g, names in enumerate(fn(layers))]
    except Exception as e:  # noqa: BLE001 - another release's function may need names 0.22.1's did not
        return {"checked": False, "file": where[0],
                "why": f"{kvgroups.GROUPING_FN} did not run as 0.22.1's does: {type(e).__name__}: {e}"}
    reusers = kvgroups.metadata_reusers(gs)
    return {"checked": True, "file": where[0], "groups": len(gs),
            "reusing attention groups": [{"gid": r["gid"], "reuses": r["reuses_gid"],
                                          "layers": [kvgroups.layer_index(x) for x in r["layers"]]} for r in reusers]}


def _v1(runner_text: str | None) -> dict:
    fn = _function(runner_text, "_build_attention_metadata", "GPUModelRunner")
    if runner_text is None:
        return {"present": False}
    if fn is None:
        return {"present": True, "checked": False, "why": "no GPUModelRunner._build_attention_metadata"}
    cap, reuse = fn.find("for_cudagraph_capture:"), fn.find("update_block_table(")
    key = re.search(r"cache_key = (.+)", fn)
    return {
        "present": True, "checked": True,
        "capture builds every group with its own builder": 0 <= cap < reuse,
        "run time reuses a same-spec group's metadata": reuse >= 0 and "cache_key in cached_attn_metadata" in fn
        and "cached_attn_metadata[cache_key] = " in fn,
        "reuse key": key.group(1).strip() if key else None,
        "reuse limited to Mamba": bool(key) and "Mamba" in key.group(1),
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
    """The V2 runner's metadata reuse: for which groups, and whether capture goes through it too (the reuse test
    before the capture branch: capture and run time then hand a group the same metadata)."""
    if text is None:
        return {"present": False}
    i = text.find("update_block_table(")
    if i < 0:
        return {"present": True, "reuses metadata": False}
    window = text[max(0, i - 1500):i + 800]
    rk = window.find("reuse_key in cached_metadata")
    start = window.rfind("reuse_key = None", 0, rk if rk >= 0 else None)
    cond = window[start if start >= 0 else 0:rk if rk >= 0 else None]
    cap = window.find("for_cudagraph_capture", rk) if rk >= 0 else -1
    return {"present": True, "reuses metadata": True, "reuse limited to Mamba": "MambaSpec" in cond,
            "capture takes the reuse path too": rk >= 0 and cap > rk}


def check(texts: dict) -> dict:
    """The facts of one release (``texts``: {file: text or None}) and its verdict (see the module's docstring)."""
    g, v1, fa, v2 = _grouping(texts), _v1(texts.get(RUNNER_V1)), _fa(texts.get(FA)), _v2(texts.get(RUNNER_V2))
    split = g.get("checked") and bool(g["reusing attention groups"])
    v1_path = (v1.get("checked") and v1["capture builds every group with its own builder"]
               and v1["run time reuses a same-spec group's metadata"] and not v1["reuse limited to Mamba"])
    fa_path = (fa.get("checked") and fa["supports update_block_table"] and fa["persistent scheduler_metadata buffer"]
               and fa.get("reusing group's graph reads the capture's schedule") is True)
    if split and v1_path and fa_path:
        verdict = PRESENT
    elif not v1["present"] and v2.get("present") and (not v2["reuses metadata"] or v2["reuse limited to Mamba"]):
        verdict = ABSENT
    elif g.get("checked") and not split:
        verdict = ABSENT
    elif v1.get("checked") and fa.get("checked") and (not v1_path or fa.get("reusing group's graph reads the capture's schedule") is False):
        verdict = ABSENT if not v2.get("present") or not v2["reuses metadata"] or v2["reuse limited to Mamba"] else UNDECIDED
    else:
        verdict = UNDECIDED
    return {"verdict": verdict, "grouping": g, "v1 runner": v1, "flash_attn builder": fa, "v2 runner": v2}


def pinned_texts() -> dict:
    """The pinned 0.22.1's files (:mod:`dflash_lab.vllm_sources`, RECORD-checked), as :func:`check` takes them."""
    from .vllm_sources import read_source

    out = {}
    for f in FILES:
        try:
            out[f] = read_source(f)
        except LabError:
            out[f] = None
    return out


# --- recording ----------------------------------------------------------------------------------------------------

def check_releases(versions: list[str], out: Path, command: str, index: dict | None = None,
                   wheel_dir: Path | None = None) -> list[dict]:
    """Download, verify and check each release; write every line to ``out`` at once (atomically, after all of them
    succeeded: a failure leaves an existing file as it was). ``wheel_dir``: wheels already there (same names) are
    used instead of downloading, still sha256-checked."""
    from . import provenance

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
                          "wheel_url": e["url"], "files": {f: (t is not None) for f, t in texts.items()},
                          "checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "command": command, "dflash_lab_commit": prov.get("git_commit"),
                          "python": prov.get("python")})
    atomic.write_text(Path(out), "".join(json.dumps(x, sort_keys=True) + "\n" for x in lines))
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
        if missing or r.get("verdict") not in (PRESENT, ABSENT, UNDECIDED):
            raise LabError(f"{p}:{n}: not an upstream-check line (missing {', '.join(missing) or 'a known verdict'})")
        rows.append(r)
    return rows


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
            "V1 runner": ("reuses same-spec metadata" if v1.get("run time reuses a same-spec group's metadata")
                          and not v1.get("reuse limited to Mamba") else "other reuse rule") if v1.get("checked")
            else ("absent" if not v1["present"] else "not checked"),
            "FA builder update_block_table leaves the graph's schedule stale":
                yn(fa.get("reusing group's graph reads the capture's schedule")) if fa.get("checked") else "not checked",
            "V2 runner reuse": ("Mamba groups only" if v2.get("reuse limited to Mamba") else
                                "any builder" if v2.get("reuses metadata") else "none") if v2["present"] else "absent",
            "verdict": r["verdict"],
        })
    return pd.DataFrame(out)
