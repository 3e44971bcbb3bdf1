"""The CUDA worker: KV cache sized by a profiling run against gpu_memory_utilization."""

from __future__ import annotations

import logging

import torch

from sparrow.worker.worker_base import WorkerBase
from sparrow_cuda.model_runner import CudaModelRunner

logger = logging.getLogger(__name__)

GiB = 1 << 30


class CudaWorker(WorkerBase):
    model_runner_cls = CudaModelRunner

    def init_device(self) -> None:
        torch.cuda.set_device(self.device)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 runs stay exact
        super().init_device()

    def available_kv_cache_bytes(self) -> int:
        """``gpu_memory_utilization`` of the card minus weights, peak activations and memory
        other processes or non-torch allocations hold, all measured."""
        assert self.model_runner is not None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(total - free - torch.cuda.memory_reserved(self.device), 0)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model_runner.profile_run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak - non_torch
        logger.info(
            "GPU memory: total %.2f GiB, torch peak (weights + activations) %.2f GiB, non-torch %.2f GiB, "
            "KV cache %.2f GiB", total / GiB, peak / GiB, non_torch / GiB, budget / GiB)
        if budget <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache at gpu_memory_utilization="
                f"{self.config.cache.gpu_memory_utilization}: raise it or lower max_num_batched_tokens"
            )
        return budget

    def initialize_kv_cache(self, num_blocks: int) -> None:
        super().initialize_kv_cache(num_blocks)
        assert isinstance(self.model_runner, CudaModelRunner)
        if not self.config.device.enforce_eager:
            self.model_runner.capture_cuda_graphs()

    # -- sleep mode: graphs hold the addresses of the memory sleep releases --------------------
    def sleep(self, level: int = 1) -> dict[str, int]:
        assert isinstance(self.model_runner, CudaModelRunner)
        torch.cuda.synchronize(self.device)
        self.model_runner.drop_cuda_graphs()  # their pool is released too
        released = super().sleep(level)
        torch.cuda.empty_cache()  # back to the driver, for another process
        return released

    def wake_up(self, tags: list[str] | None = None) -> None:
        super().wake_up(tags)
        assert isinstance(self.model_runner, CudaModelRunner)
        if not self.sleep_state.sleeping and not self.config.device.enforce_eager:
            self.model_runner.capture_cuda_graphs()  # over the storages' new addresses
