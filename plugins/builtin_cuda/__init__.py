"""The built-in CUDA platform: Triton and FlashInfer attention, CUDA graphs for decode.

Importing this package is cheap: torch and triton are imported by the worker, not here.
"""

from __future__ import annotations

import glob
import os
import sys

from sparrow.hookspecs import hookimpl
from sparrow_cuda.ops import sparrow_register_ops  # noqa: F401

# The hook-contract versions this plugin supports (sparrow.hookspecs.CONTRACT_VERSION).
SPARROW_CONTRACT = ">=1.0,<2"


def detect() -> str | None:
    """An NVIDIA GPU is present: driver device nodes, checked without importing torch."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return None
    torch = sys.modules.get("torch")
    if torch is not None:  # already paid for: ask it
        return "sparrow_cuda.platform:CudaPlatform" if torch.cuda.is_available() else None
    if not glob.glob("/dev/nvidia[0-9]*") and not glob.glob("/proc/driver/nvidia/gpus/*"):
        return None
    return "sparrow_cuda.platform:CudaPlatform"


@hookimpl
def sparrow_register_platforms(register) -> None:
    register("cuda", detect, priority=10)


@hookimpl
def sparrow_attention_backend(platform, requested: str):
    if platform.name != "cuda":
        return None
    from sparrow_cuda.attention import FlashInferAttentionBackend, TritonAttentionBackend

    if requested in ("auto", "triton"):
        return TritonAttentionBackend
    if requested == "flashinfer":
        return FlashInferAttentionBackend
    raise ValueError(f"attention_backend {requested!r} is not available on cuda; choose auto, triton or flashinfer")
