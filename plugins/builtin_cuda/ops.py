"""The CUDA platform's implementations of the kernel's element-wise ops (``sparrow.ops``).

Registered by import path: every process loads the plugins, and only a CUDA worker binding a
model imports the Triton module (torch and triton with it), so this module imports neither.
"""

from __future__ import annotations

from typing import Callable

from sparrow.hookspecs import hookimpl

PLATFORM = "cuda"

# op -> what serves it on CUDA: an OpImpl for a layer op, a function for a function op
TRITON_OPS = {
    "rms_norm": "sparrow_cuda.triton_elementwise:TritonRMSNorm",
    "silu_and_mul": "sparrow_cuda.triton_elementwise:TritonSiluAndMul",
    "rotary_embedding": "sparrow_cuda.triton_elementwise:TritonRotaryEmbedding",
    "fused_moe": "sparrow_cuda.triton_moe:TritonFusedMoE",
    "add_lora": "sparrow_cuda.triton_lora:triton_add_lora",
    "sample_from_logits": "sparrow_cuda.triton_sampling:sample_from_logits",
}


@hookimpl
def sparrow_register_ops(register: Callable[..., None]) -> None:
    for op, impl in TRITON_OPS.items():
        register(op, PLATFORM, impl)
