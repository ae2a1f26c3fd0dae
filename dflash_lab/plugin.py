"""vLLM general plugin (entry point ``vllm.general_plugins`` -> ``dflash_lab``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers).
Nothing happens unless asked for:

- ``DFLASH_LAB_FIX=1``: apply the fix (:mod:`dflash_lab.patch`; ``DFLASH_LAB_FIX_PARTS`` names a subset of its parts);
- ``DFLASH_LAB_HOOK=<folder>``: record and check every DFlash input-setup launch
  (:mod:`dflash_lab.hook`);
- ``DFLASH_LAB_PROBE=<folder>`` / ``DFLASH_LAB_CANARY=1``: per-step invariants of the target
  forward and the FULL-graph-versus-reference divergence check (:mod:`dflash_lab.probe`);
- ``DFLASH_LAB_FA_SPLITS=drafter:N`` / ``target:N``: FA3's split bound for FULL graphs on one side of the
  speculative pair only (:mod:`dflash_lab.splits`).
- ``DFLASH_LAB_SCHED_SNAPSHOT=<folder>``: every FA builder's persistent FA3 schedule, once, when the first served
  step begins (:mod:`dflash_lab.schedsnap`).
- ``DFLASH_LAB_SCHED_LEDGER=<folder>``: the engine core's scheduler counters when it has scheduled nothing for 10 s
  while requests run, with the steps that led there (:mod:`dflash_lab.schedledger`).
- ``DFLASH_LAB_ADMIT=K/N``: the engine core's first step admits at most K of the first N requests, after all N
  arrived (:mod:`dflash_lab.admit`).
- ``DFLASH_LAB_STACKS=<folder>``: all threads' Python stacks to ``<folder>/stacks.<pid>.txt`` on ``SIGUSR1``, which the
  runner sends to a run that timed out (:mod:`dflash_lab.hang`).
- ``DFLASH_LAB_VLLM_RELEASE=<version>=<folder>``: the runner started this engine on a later vLLM release staged in
  that folder; every process checks that the vllm it imported is that release from there, and stops if not
  (:mod:`dflash_lab.release`).
- ``DFLASH_LAB_VLLM_DIFF=<overlay>``: the runner started this engine on vLLM with the upstream diff applied; every
  process checks that the vllm it imported is that overlay's, and stops if not (:mod:`dflash_lab.vllmdiff`).

Each is logged once per process, so a log shows exactly which processes ran patched.
"""

from __future__ import annotations

import os

_done = set()


def register() -> None:
    from .engine_state import fix_enabled, log_once
    from . import vllmdiff

    if os.environ.get(vllmdiff.ENV) and "vllm_diff" not in _done:
        log_once(vllmdiff.check_loaded())   # raises in a process that did not import the overlay (and is not marked done)
        _done.add("vllm_diff")

    from . import release

    if os.environ.get(release.ENV) and "vllm_release" not in _done:
        log_once(release.check_loaded())   # raises in a process that imported another vllm (and is not marked done)
        _done.add("vllm_release")

    from . import hang

    stacks_dir = os.environ.get(hang.ENV)
    if stacks_dir and not hang.installed_here():   # per pid: a forked child must register its own file
        log_once(hang.install(stacks_dir, log=log_once))

    if fix_enabled() and "fix" not in _done:
        _done.add("fix")
        from . import patch

        what = patch.apply()
        log_once("fix active: " + "; ".join(what))
    hook_dir = os.environ.get("DFLASH_LAB_HOOK")
    if hook_dir and "hook" not in _done:
        _done.add("hook")
        from . import hook

        hook.install(hook_dir)
        log_once(f"launch hook active, writing to {hook_dir}")
    from . import splits

    if os.environ.get(splits.ENV) and "splits" not in _done:
        _done.add("splits")
        log_once(splits.install())
    from . import schedsnap

    snap_dir = os.environ.get(schedsnap.ENV)
    if snap_dir and "snapshot" not in _done:
        _done.add("snapshot")
        log_once(schedsnap.install(snap_dir))
    from . import schedledger

    ledger_dir = os.environ.get(schedledger.ENV)
    if ledger_dir and "ledger" not in _done:
        _done.add("ledger")
        log_once(schedledger.install(ledger_dir))
    from . import probe

    if probe.enabled() and "probe" not in _done:
        _done.add("probe")
        p = probe.install()
        log_once(f"step probe active: canaries {'raise' if p.raise_on_violation else 'record'}, "
                 f"reference pass {'on' if p.reference else 'off'}, log {p.path}")
    from . import admit

    admit_value = os.environ.get(admit.ENV)
    if admit_value and "admit" not in _done:
        _done.add("admit")
        log_once(admit.install(admit_value))
