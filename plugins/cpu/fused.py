"""The C++ element-wise kernels (``native_elementwise``) as the CPU's ``rms_norm``,
``rotary_embedding`` and ``silu_and_mul`` ops.

The torch layers spend several passes over memory per call (RMSNorm: square, mean, rsqrt, two
multiplies; rotary: an index, a cast, four multiplies, two adds and a cat for q and again for k).
On the 2-vCPU benchmark these layers cost about 1.4 s of a 10 s run; the kernels do each in one
pass. They take float32 only; any other dtype, or a tensor layout a kernel does not take, goes
through the layer's torch reference (``forward_native``).
"""

from __future__ import annotations

from typing import Any

import torch

from sparrow.ops.base import OpImpl
from sparrow_cpu.native import get_elementwise_ops


def _is_cpu_float(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


class _CppKernel(OpImpl):
    name = "cpp"

    def __init__(self, layer: Any) -> None:
        super().__init__(layer)
        self.ops = get_elementwise_ops()

    @classmethod
    def supports(cls, layer: Any) -> bool:
        tensors = [t for t in (*layer.parameters(), *layer.buffers())]
        return _is_cpu_float(*tensors) and get_elementwise_ops() is not None


class CppRMSNorm(_CppKernel):
    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        layer = self.layer
        if not _is_cpu_float(x, layer.weight) or x.shape[-1] != layer.hidden_size:
            return layer.forward_native(x, residual)
        if residual is None:
            if x.stride(-1) != 1 or x.dim() not in (2, 3):
                return layer.forward_native(x, residual)
            x3 = x if x.dim() == 3 else x.unsqueeze(1)
            out = torch.empty(x3.shape, dtype=x.dtype)
            self.ops.rms_norm(out, x3, layer.weight, layer.eps)
            return out.view(x.shape)
        if not (x.is_contiguous() and residual.is_contiguous() and residual.dtype == x.dtype
                and residual.shape == x.shape):
            return layer.forward_native(x, residual)
        self.ops.fused_add_rms_norm(x, residual, layer.weight, layer.eps)  # in place
        return x, residual


class CppRotary(_CppKernel):
    def __call__(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        layer = self.layer
        if (not _is_cpu_float(query, key, layer.cos_sin_cache) or query.dim() != 3 or key.dim() != 3
                or query.stride(-1) != 1 or key.stride(-1) != 1 or positions.dtype != torch.int64):
            return layer.forward_native(positions, query, key)
        self.ops.rotary_neox(positions.contiguous(), query, key, layer.cos_sin_cache, layer.rotary_dim)  # in place
        return query, key


class CppSiluAndMul(_CppKernel):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not _is_cpu_float(x) or not x.is_contiguous() or x.shape[-1] % 2:
            return self.layer.forward_native(x)
        out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype)
        self.ops.silu_and_mul(out, x)
        return out
