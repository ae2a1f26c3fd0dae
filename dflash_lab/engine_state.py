"""What the fix (:mod:`dflash_lab.patch`) and the launch hook (:mod:`dflash_lab.hook`) both need.

Neither imports the other: both import this module.

- :func:`fix_enabled`: the ``DFLASH_LAB_FIX`` flag (``DFLASH_LAB_FIX_PARTS`` narrows it to some parts);
- :func:`track_first_pass` / :func:`current_first_pass`: the DFlash first pass in flight (its
  common attention metadata and proposer), which the kernel launch needs for ``seq_lens``;
- :class:`KernelProxy`: stands in for ``copy_and_expand_dflash_inputs_kernel`` inside
  ``vllm.v1.spec_decode.dflash``; the fix sets its ``launcher``, the hook its ``monitor``;
- :func:`log_once`: one line on stderr, tagged with the process id.
"""

from __future__ import annotations

import os
import sys

ENV_FIX = "DFLASH_LAB_FIX"
ENV_FIX_PARTS = "DFLASH_LAB_FIX_PARTS"  # comma-separated subset of the fix's parts (unset: all of them)


def fix_enabled() -> bool:
    return os.environ.get(ENV_FIX, "0") not in ("", "0", "false", "False")


def fix_part_names(value: str | None = None) -> list[str]:
    """The part names ``DFLASH_LAB_FIX_PARTS`` (or ``value``) lists, unchecked; empty: all parts."""
    raw = os.environ.get(ENV_FIX_PARTS, "") if value is None else value
    return [x.strip() for x in raw.split(",") if x.strip()]


def fix_kernel_patched() -> bool:
    """Whether the fix runs the patched DFlash kernel: the fix is on and ``DFLASH_LAB_FIX_PARTS`` is unset
    or names ``dflash_kernel_edits`` (a part-1-only engine launches the stock kernel)."""
    names = fix_part_names()
    return fix_enabled() and (not names or "dflash_kernel_edits" in names)


def log_once(msg: str) -> None:
    print(f"dflash-lab [{os.getpid()}]: {msg}", file=sys.stderr, flush=True)


_CURRENT: dict = {}


def track_first_pass(P) -> None:
    """Make the attention metadata and proposer of the first pass in flight visible to the kernel proxy.

    Installed once per process, by the hook or the fix, whichever comes first.
    """
    if getattr(P.set_inputs_first_pass, "_dflash_lab", False):
        return
    orig = P.set_inputs_first_pass

    def set_inputs_first_pass(self, *a, **kw):
        cad = kw.get("cad") if "cad" in kw else a[5]
        _CURRENT["cad"] = (cad, self)
        try:
            return orig(self, *a, **kw)
        finally:
            _CURRENT["cad"] = None

    set_inputs_first_pass._dflash_lab = True
    P.set_inputs_first_pass = set_inputs_first_pass


def current_first_pass():
    """(common attention metadata, proposer) of the DFlash first pass in flight, or None."""
    return _CURRENT.get("cad")


class KernelProxy:
    """Stands in for the kernel object in ``vllm.v1.spec_decode.dflash``: ``proxy[grid](**kw)``.

    ``launcher(grid, kwargs)``, when set (by the fix), launches instead of the stock kernel;
    ``monitor.after_launch(grid, kwargs)``, when set (by the hook), sees every launch.
    """

    instance = None

    def __init__(self, real):
        self.real = real
        self.launcher = None
        self.monitor = None

    @classmethod
    def install(cls, dflash_mod) -> "KernelProxy":
        cur = dflash_mod.copy_and_expand_dflash_inputs_kernel
        if isinstance(cur, KernelProxy):
            return cur
        proxy = cls(cur)
        dflash_mod.copy_and_expand_dflash_inputs_kernel = proxy
        cls.instance = proxy
        return proxy

    def __getitem__(self, grid):
        def launch(**kwargs):
            if self.launcher is not None:
                self.launcher(grid, kwargs)
            else:
                self.real[grid](**kwargs)
            if self.monitor is not None:
                self.monitor.after_launch(grid, kwargs)

        return launch
