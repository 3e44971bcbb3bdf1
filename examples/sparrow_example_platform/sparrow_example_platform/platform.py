"""The platform's identity and defaults; no heavy imports (the frontend may instantiate it)."""

from __future__ import annotations

from sparrow.platforms.interface import Platform


class CpuSdpaPlatform(Platform):
    name = "cpu_sdpa"
    device_type = "cpu"  # the torch device tensors live on
    dist_backend = "gloo"  # torch.distributed backend for tensor parallel on this device
    # Larger blocks than the built-in cpu platform: fewer, longer rows to gather per request.
    default_block_size = 32
    default_dtype = "float32"
    supported_dtypes = ("float32", "bfloat16")
    worker_cls = "sparrow_example_platform.worker:CpuSdpaWorker"
