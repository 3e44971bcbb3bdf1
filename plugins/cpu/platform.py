"""CPU platform definition (no heavy imports)."""

from __future__ import annotations

from sparrow.platforms.interface import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    default_block_size = 16
    # Smaller steps keep activations under glibc's mmap threshold and in cache: measured faster
    # than 8192 and 4096 on 2 cores (fewer page faults).
    default_max_num_batched_tokens = 2048
    default_dtype = "float32"
    supported_dtypes = ("float32", "bfloat16")
    worker_cls = "sparrow_cpu.worker:CpuWorker"
