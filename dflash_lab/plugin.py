"""vLLM general plugin (entry point ``vllm.general_plugins`` -> ``dflash_lab``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers).
Nothing happens unless asked for:

- ``DFLASH_LAB_FIX=1``: apply the fix (:mod:`dflash_lab.patch`);
- ``DFLASH_LAB_HOOK=<folder>``: record and check every DFlash input-setup launch
  (:mod:`dflash_lab.hook`).

Each is logged once per process, so a log shows exactly which processes ran patched.
"""

from __future__ import annotations

import os

_done = set()


def register() -> None:
    from . import patch

    if patch.fix_enabled() and "fix" not in _done:
        _done.add("fix")
        what = patch.apply()
        patch.log_once("fix active: " + "; ".join(what))
    hook_dir = os.environ.get("DFLASH_LAB_HOOK")
    if hook_dir and "hook" not in _done:
        _done.add("hook")
        from . import hook

        hook.install(hook_dir)
        patch.log_once(f"launch hook active, writing to {hook_dir}")
