"""CUDA platform definition (no heavy imports)."""

from __future__ import annotations

from typing import Any

from sparrow.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    default_block_size = 16
    default_dtype = "bfloat16"
    supported_dtypes = ("bfloat16", "float16", "float32")
    worker_cls = "sparrow_cuda.worker:CudaWorker"

    def device_for_rank(self, local_rank: int) -> Any:
        """``cuda:<local_rank>``; with more ranks than visible GPUs (data-parallel engines of a
        small model), the engines share them round-robin. Tensor-parallel ranks of one engine
        cannot share a GPU (NCCL refuses), which the worker checks."""
        import torch

        count = torch.cuda.device_count()
        return torch.device("cuda", local_rank % count if count else local_rank)
