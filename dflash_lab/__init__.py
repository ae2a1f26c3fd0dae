"""dflash-lab: find, prove and fix the DFlash + CUDA-graph crash of vLLM 0.22.1.

The library holds every piece of logic the notebooks use, so tests reach it:

- :mod:`dflash_lab.vllm_sources`  exact source text of the pinned vLLM 0.22.1 distribution
- :mod:`dflash_lab.capture`       CUDA-graph capture sizes and DFlash drafter buffer analysis
- :mod:`dflash_lab.kernels`       vLLM's Triton kernels, extracted from the pinned sources
- :mod:`dflash_lab.instrument`    a generic bounds instrumenter for Triton kernels
- :mod:`dflash_lab.records`       launch records (``.npz``) of ``copy_and_expand_dflash_inputs_kernel``
- :mod:`dflash_lab.replay`        replay of launch records, stock or patched kernel
- :mod:`dflash_lab.runner`        the GPU experiment runner (crash matrix and benchmarks)
- :mod:`dflash_lab.servebench`    the streamed-server client; metrics named and defined as ``vllm bench serve``
- :mod:`dflash_lab.coredump`      CUDA core dumps read with cuda-gdb: the faulting kernel of a crash
- :mod:`dflash_lab.hang`          a timed-out or deadline-cut run's GPU state, Python stacks, /proc state and on-demand core dump, before it is killed
- :mod:`dflash_lab.sigstages`     whose handler answers SIGUSR1 after each engine start-up stage (GPU host)
- :mod:`dflash_lab.probe`         per-step canaries and the FULL-graph-vs-reference divergence probe (in the engine)
- :mod:`dflash_lab.divergence`    reading the probe's logs for the notebooks
- :mod:`dflash_lab.vllm_code`     running small pieces of vLLM's own Python verbatim on the CPU
- :mod:`dflash_lab.kvgroups`      vLLM's KV-cache grouping of hybrid models, and which groups reuse metadata
- :mod:`dflash_lab.rootcause`     the root mechanism replayed on vLLM's own code
- :mod:`dflash_lab.patch`         the fix, as a vLLM general plugin (:mod:`dflash_lab.engine_state`: what it
                                  shares with the launch hook)
- :mod:`dflash_lab.verification`  the fix's GPU verification per session: counts, probe verdicts, canaries
- :mod:`dflash_lab.crashstates`   the report's crash states beside ours; crash rate per serving path
- :mod:`dflash_lab.bench`         the benchmark: cells, same-session ratios, recommendations, step-time models
- :mod:`dflash_lab.gpuclocks`     GPU clocks, power and temperature sampled through a device call, per run
- :mod:`dflash_lab.plan`          a bench matrix's device time, estimated from the recorded bench lines
"""

__version__ = "0.1.0"

VLLM_VERSION = "0.22.1"
