"""CUDA platform definition (no heavy imports)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparrow.platforms.interface import Platform

if TYPE_CHECKING:
    from sparrow.config import EngineConfig


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    default_block_size = 16
    default_dtype = "bfloat16"
    supported_dtypes = ("bfloat16", "float16", "float32")
    # fp8 / fp8_e4m3: a float8_e4m3fn paged cache with per-layer scales (both built-in backends).
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3")
    worker_cls = "sparrow_cuda.worker:CudaWorker"

    def check_and_update_config(self, config: EngineConfig) -> None:
        kv_cache_dtype = config.cache.kv_cache_dtype
        if kv_cache_dtype == "auto":
            return
        import torch

        # Asked here only when this process already holds CUDA (initializing it would cost the
        # frontend a context on the GPU); the CUDA model runner asks again at start-up.
        if torch.cuda.is_initialized():
            try:
                check_fp8_kv_cache_capability(kv_cache_dtype, torch.cuda.get_device_capability())
            except ValueError as exc:
                from sparrow.config import ConfigError

                raise ConfigError(f"invalid engine argument 'kv_cache_dtype': {exc}") from None

    def device_for_rank(self, local_rank: int) -> Any:
        """``cuda:<local_rank>``; with more ranks than visible GPUs (data-parallel engines of a
        small model), the engines share them round-robin. Tensor-parallel ranks of one engine
        cannot share a GPU (NCCL refuses), which the worker checks."""
        import torch

        count = torch.cuda.device_count()
        return torch.device("cuda", local_rank % count if count else local_rank)


def check_fp8_kv_cache_capability(kv_cache_dtype: str, capability: tuple[int, int]) -> None:
    """Triton converts to and from e4m3 (fp8e4nv) only on compute capability 8.9+ (Ada, Hopper
    and newer)."""
    if tuple(capability) < (8, 9):
        raise ValueError(f"{kv_cache_dtype!r} needs a GPU of compute capability 8.9 or newer (this one is "
                         f"{capability[0]}.{capability[1]}); use kv_cache_dtype='auto'")
