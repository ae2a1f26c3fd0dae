"""Run an engine on a later vLLM release staged on the GPU host (the runner's engine key ``vllm_release``).

Notebook 04 reads from each later release's own source whether the crash's precondition is still there
(:mod:`upstream`, ``data/upstream/releases.jsonl``); only a run says whether that release still crashes. The GPU host
has torch 2.11.0+cu130 and nothing reaches a package registry from it (``../shared/gpu/README.md``), so it can run
the releases that pin that torch (0.23.0-0.26.0; 0.27.0 and later pin torch 2.13 or 2.14, which would have to travel too).

- Staging (``scripts/gpu/stage-release.sh VERSION OUTDIR``, on this machine): the release's wheel, slimmed as
  ``../shared/gpu/stage.sh`` slims 0.22.1's, with the packages :func:`release_wheels` lists: the ones 0.22.1's staging
  ships (``../shared/gpu/gpu-extra-wheels.txt``), each pin replaced where the release's own requirements exclude it.
  Packages the host already has (torch, triton, transformers) must satisfy the release's requirements, else the
  release cannot run there and staging stops with that reason.
- On the host, the parts assemble into ``ROOT/VERSION`` (``ROOT`` = ``$DFLASH_LAB_RELEASES``, default
  ``/tmp/vllm-releases``), apart from 0.22.1's ``/tmp/vllm-site``.
- The engine (:mod:`runner`): its ``PYTHONPATH`` is that folder, then the runner's entries that hold no ``vllm``
  (:func:`pythonpath`: nothing of 0.22.1's staging mixes in), and
  ``DFLASH_LAB_VLLM_RELEASE=VERSION=FOLDER``; the plugin calls :func:`check_loaded` in every engine process, which
  stops the process unless the ``vllm`` it imported is that release from that folder. No line can claim a release it
  did not run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import LabError

ENV = "DFLASH_LAB_VLLM_RELEASE"
ROOT_ENV = "DFLASH_LAB_RELEASES"
DEFAULT_ROOT = "/tmp/vllm-releases"
#: what the GPU host has installed and the staging does not ship (../shared/gpu/README.md)
HOST_PACKAGES = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0"}
#: the platform the host's Python runs on, for the requirements' environment markers
HOST_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.0", "platform_machine": "x86_64",
                "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
                "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
_VERSION = re.compile(r"^\d+\.\d+\.\d+(?:\.post\d+)?$")


def check_version(version) -> str:
    """A release's version as the staging folder and the runner name it: ``X.Y.Z`` or ``X.Y.Z.postN``."""
    if not isinstance(version, str) or not _VERSION.match(version):
        raise LabError(f"vllm_release must be a release version such as '0.26.0', not {version!r}")
    from . import VLLM_VERSION

    if version == VLLM_VERSION:
        raise LabError(f"vllm_release {version} is the version under investigation: leave vllm_release out")
    return version


def site(version: str, root: str | os.PathLike | None = None) -> Path:
    """The host folder a release is staged in."""
    return Path(root or os.environ.get(ROOT_ENV) or DEFAULT_ROOT) / check_version(version)


def pythonpath(release_site: str | os.PathLike, current: str | None) -> str:
    """An engine's ``PYTHONPATH`` for a release: its folder first, then the entries of ``current`` that hold no
    ``vllm`` package (0.22.1's staging, ``/tmp/vllm-site``, is left out whole, with the packages staged for it)."""
    keep = [p for p in (current or "").split(os.pathsep) if p and not (Path(p) / "vllm").exists()]
    return os.pathsep.join([str(release_site), *keep])


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(metadata_text: str) -> dict:
    """``{normalized name: SpecifierSet}`` of a wheel's ``Requires-Dist`` lines that apply on the GPU host without
    extras (a package required twice gets both specifiers)."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import SpecifierSet

    out: dict = {}
    for line in metadata_text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        text = line.split(":", 1)[1].strip()
        try:
            req = Requirement(text)
        except InvalidRequirement as e:
            raise LabError(f"release metadata: unreadable requirement {text!r} ({e})") from None
        if req.marker is not None and not req.marker.evaluate(HOST_MARKERS):
            continue
        name = _norm(req.name)
        out[name] = (out[name] & req.specifier) if name in out else SpecifierSet(str(req.specifier))
    return out


def release_wheels(base_pins: list[str], metadata_text: str, host: dict | None = None) -> tuple[list[str], list[str]]:
    """What travels with a release: ``(requirement lines for pip download, what changed against the base list)``.

    ``base_pins``: 0.22.1's staging list (``name==version`` lines; blank lines and ``#`` comments ignored). Each pin
    the release's requirements accept is kept; one they exclude becomes the release's exact pin (``==``) or, for a
    range, the range itself (pip then takes the newest version in it). Raises :class:`LabError` when a package the
    host has installed (``host``, default :data:`HOST_PACKAGES`) is outside the release's range: that release cannot
    run on the host as it is.
    """
    reqs = requirements(metadata_text)
    if "vllm" in reqs:
        reqs.pop("vllm")
    for name, have in sorted((host or HOST_PACKAGES).items()):
        spec = reqs.get(_norm(name))
        if spec is not None and not spec.contains(have, prereleases=True):
            raise LabError(f"the release requires {name}{spec}; the GPU host has {name} {have}, which the staging "
                           "does not replace: this release cannot run there")
    out, changed = [], []
    for raw in base_pins:
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.match(r"^([A-Za-z0-9._-]+)==(\S+)$", line)
        if not m:
            raise LabError(f"base wheel list: {line!r} is not a name==version pin")
        name, ver = m.groups()
        spec = reqs.get(_norm(name))
        if spec is None or spec.contains(ver, prereleases=True):
            out.append(line)
            continue
        exact = [s.version for s in spec if s.operator in ("==", "===")]
        new = f"{name}=={exact[0]}" if len(exact) == 1 and "*" not in exact[0] else f"{name}{spec}"
        out.append(new)
        changed.append(f"{line} -> {new}")
    return out, changed


def check_loaded() -> str:
    """In an engine process started with ``DFLASH_LAB_VLLM_RELEASE=VERSION=FOLDER``: the ``vllm`` it imports must be
    that release, from that folder. Returns what the plugin logs; raises :class:`LabError` otherwise."""
    value = os.environ.get(ENV, "")
    version, sep, folder = value.partition("=")
    if not sep or not folder:
        raise LabError(f"{ENV}={value!r}: expected VERSION=FOLDER")
    import vllm

    got = getattr(vllm, "__version__", None)
    where = Path(vllm.__file__).resolve()
    if got != version:
        raise LabError(f"{ENV}: this process imported vllm {got} from {where}, not {version}")
    if Path(folder).resolve() in where.parents:
        return f"vllm release {version} from {folder}"
    # a vllm_diff engine on a release imports the overlay made from that release (its stamp names the package it was
    # made from; vllmdiff.check_loaded checks the overlay's files in the same process)
    from . import vllmdiff

    ov = os.environ.get(vllmdiff.ENV)
    stamp = Path(ov) / vllmdiff.STAMP if ov else None
    if stamp is not None and stamp.is_file() and Path(ov).resolve() in where.parents:
        import json

        source = Path(json.loads(stamp.read_text()).get("source") or "/nonexistent").resolve()
        if source.parent == Path(folder).resolve():
            return f"vllm release {version} from {folder}, through the overlay {ov} made from it"
    raise LabError(f"{ENV}: this process imported vllm {got} from {where}, not from {folder}")
