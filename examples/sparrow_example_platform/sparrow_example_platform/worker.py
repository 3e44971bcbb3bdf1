"""The worker: WorkerBase does the model, the KV cache and the step; a platform says how much
memory the cache may take and prepares its device."""

from __future__ import annotations

import logging
import os

import torch

from sparrow.worker.worker_base import WorkerBase

logger = logging.getLogger(__name__)

# Without kv_cache_memory_bytes: a fixed budget. A vendor's worker measures free device memory
# after a profiling forward instead; a fixed size keeps this example predictable.
DEFAULT_KV_CACHE_BYTES = 512 << 20
THREADS_ENV = "SPARROW_CPU_SDPA_THREADS"


class CpuSdpaWorker(WorkerBase):
    def init_device(self) -> None:
        # Device bring-up goes here (select the card of local_rank, set the stream...).
        threads = os.environ.get(THREADS_ENV)
        if threads:
            if not threads.isdigit() or int(threads) < 1:
                raise ValueError(f"{THREADS_ENV} must be a positive integer, got {threads!r}")
            torch.set_num_threads(int(threads))
        super().init_device()  # seeds torch and joins the tensor-parallel group if any

    def available_kv_cache_bytes(self) -> int:
        configured = self.config.cache.kv_cache_memory_bytes
        if configured is not None:
            return configured
        logger.info("cpu_sdpa KV cache: %d MiB (set kv_cache_memory_bytes to change)", DEFAULT_KV_CACHE_BYTES >> 20)
        return DEFAULT_KV_CACHE_BYTES
