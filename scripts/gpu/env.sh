# GPU host: the environment of every engine a session starts (sourced by session.sh and detached.sh, in the checkout).
# vLLM 0.22.1 from the staged parts (setup.sh); tests point DFLASH_LAB_HOST_PYTHONPATH at the checkout instead.
export PYTHONPATH=${DFLASH_LAB_HOST_PYTHONPATH:-/tmp/vllm-site}
export VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 PYTHONUNBUFFERED=1
# NVLink multicast off in every process (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export DFLASH_LAB_COMMIT=$(cat .commit 2>/dev/null || echo unknown)
