"""The CPU platform's implementations of the kernel's ops (``sparrow.ops.KERNEL_OPS``).

Registered by import path, so listing them (``sparrow plugins``) imports neither torch nor the
C++ kernels; each is imported when a model is first bound on the CPU. Ops not listed here (the
embedding, the sampler's steps) run the torch reference.
"""

from __future__ import annotations

from sparrow.hookspecs import hookimpl

CPU_OPS = {
    "linear": "sparrow_cpu.gemm:OneDnnLinear",
    "lm_head": "sparrow_cpu.gemm:OneDnnLinear",
    "rms_norm": "sparrow_cpu.fused:CppRMSNorm",
    "rotary_embedding": "sparrow_cpu.fused:CppRotary",
    "silu_and_mul": "sparrow_cpu.fused:CppSiluAndMul",
}


@hookimpl
def sparrow_register_ops(register) -> None:
    for op, impl in CPU_OPS.items():
        register(op, "cpu", impl)
