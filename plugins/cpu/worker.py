"""The CPU worker: thread count and OpenMP waiting (``sparrow_cpu.threads``), KV cache sized from
kv_cache_memory_bytes, else SPARROW_CPU_KVCACHE_SPACE, else from free RAM. Its kernels are ops
registered in ``sparrow_cpu.ops``, bound to the model's layers by the kernel when the model loads."""

from __future__ import annotations

import logging
import os

from sparrow_cpu import threads

# Before torch loads in this process (the engine core imports torch here first): libgomp reads its
# wait policy once, when it is loaded.
OPENMP_CONFIGURED = threads.configure_openmp()

import torch  # noqa: E402

from sparrow.executor.topology import nnodes_from_env  # noqa: E402
from sparrow.worker.model_runner import ModelRunner  # noqa: E402
from sparrow.worker.worker_base import WorkerBase  # noqa: E402
from sparrow_cpu.platform import ENV_KVCACHE_SPACE, kvcache_space_from_env  # noqa: E402, F401 - re-exported

logger = logging.getLogger(__name__)

# Without kv_cache_memory_bytes: ENV_KVCACHE_SPACE GiB if set (vLLM's VLLM_CPU_KVCACHE_SPACE),
# else this share of the available RAM, at most DEFAULT_MAX_BYTES.
DEFAULT_RAM_FRACTION = 0.25
DEFAULT_MAX_BYTES = 1 << 30


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class CpuModelRunner(ModelRunner):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.config.cache.kv_cache_dtype == "bfloat16":
            # The cache in bfloat16 whatever the model's dtype (sparrow_cpu.attention converts).
            self.kv_cache_dtype = torch.bfloat16

    def padded_num_tokens(self, num_tokens: int) -> int:
        """Round the step's token count up to a bucket (multiples of 8 up to 128, then of 64).

        oneDNN builds a matmul kernel for every new (M, K, N) it sees, a few ms each; without
        buckets every decode step of a shrinking batch pays for new shapes. Padding rows cost
        almost nothing at small M, where the matmuls are bound by reading the weights.
        """
        multiple = 8 if num_tokens <= 128 else 64
        return -(-num_tokens // multiple) * multiple


class CpuWorker(WorkerBase):
    model_runner_cls = CpuModelRunner

    def init_device(self) -> None:
        count, source = threads.num_threads(self.engine_processes_on_machine())
        torch.set_num_threads(count)
        if self.rank == 0:
            waiting = threads.wait_policy() if OPENMP_CONFIGURED else "as the caller set it before importing torch"
            logger.info("CPU threads: %d per engine process (%s); OpenMP threads wait: %s", count, source, waiting)
        super().init_device()

    def engine_processes_on_machine(self) -> int:
        """Processes computing on this machine: data-parallel engines times local tensor-parallel ranks."""
        parallel = self.config.parallel
        nnodes = parallel.nnodes or nnodes_from_env()
        return parallel.data_parallel_size * max(1, self.world_size // max(1, nnodes))

    def thread_settings(self) -> dict[str, object]:
        """What this process computes with (for tests and ``collective_rpc``)."""
        variables = (*threads.USER_WAIT_SETTINGS, threads.ENV_CPU_THREADS)
        return {"num_threads": torch.get_num_threads(), "openmp_configured_before_load": OPENMP_CONFIGURED,
                **{name: os.environ.get(name) for name in variables}}

    def available_kv_cache_bytes(self) -> int:
        if self.config.cache.kv_cache_memory_bytes is not None:
            return self.config.cache.kv_cache_memory_bytes
        budget = kvcache_space_from_env()
        if budget is not None:
            logger.info("CPU KV cache: %.2f GiB (from %s)", budget / (1 << 30), ENV_KVCACHE_SPACE)
            return budget
        budget = min(int(available_ram_bytes() * DEFAULT_RAM_FRACTION), DEFAULT_MAX_BYTES)
        logger.info("CPU KV cache: %.2f GiB (set kv_cache_memory_bytes or %s to change)", budget / (1 << 30),
                    ENV_KVCACHE_SPACE)
        return budget
