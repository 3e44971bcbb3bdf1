"""Install the C++ element-wise kernels (``native_elementwise``) on a loaded fp32 model.

The torch layers spend several passes over memory per call (RMSNorm: square, mean, rsqrt, two
multiplies; rotary: an index, a cast, four multiplies, two adds and a cat for q and again for k).
On the 2-vCPU benchmark these layers cost about 1.4 s of a 10 s run; the kernels do each in one
pass. They are installed as each layer's ``platform_forward`` and only for float32 models; any
other dtype, or a tensor layout a kernel does not take, goes through the torch code.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from sparrow.layers.activation import SiluAndMul
from sparrow.layers.layernorm import RMSNorm
from sparrow.layers.rotary import RotaryEmbedding

from sparrow_cpu.native import get_elementwise_ops

logger = logging.getLogger(__name__)


def _is_cpu_float(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


class NativeRMSNorm:
    def __init__(self, ops: Any, layer: RMSNorm) -> None:
        self.ops, self.layer = ops, layer

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        layer = self.layer
        if not _is_cpu_float(x, layer.weight) or x.shape[-1] != layer.hidden_size:
            return _torch_forward(layer, x, residual)
        if residual is None:
            if x.stride(-1) != 1 or x.dim() not in (2, 3):
                return _torch_forward(layer, x, residual)
            x3 = x if x.dim() == 3 else x.unsqueeze(1)
            out = torch.empty(x3.shape, dtype=x.dtype)
            self.ops.rms_norm(out, x3, layer.weight, layer.eps)
            return out.view(x.shape)
        if not (x.is_contiguous() and residual.is_contiguous() and residual.dtype == x.dtype
                and residual.shape == x.shape):
            return _torch_forward(layer, x, residual)
        self.ops.fused_add_rms_norm(x, residual, layer.weight, layer.eps)  # in place
        return x, residual


class NativeRotary:
    def __init__(self, ops: Any, layer: RotaryEmbedding) -> None:
        self.ops, self.layer = ops, layer

    def __call__(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        layer = self.layer
        if (not _is_cpu_float(query, key, layer.cos_sin_cache) or query.dim() != 3 or key.dim() != 3
                or query.stride(-1) != 1 or key.stride(-1) != 1 or positions.dtype != torch.int64):
            return _torch_forward(layer, positions, query, key)
        self.ops.rotary_neox(positions.contiguous(), query, key, layer.cos_sin_cache, layer.rotary_dim)  # in place
        return query, key


class NativeSiluAndMul:
    def __init__(self, ops: Any, layer: SiluAndMul) -> None:
        self.ops, self.layer = ops, layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not _is_cpu_float(x) or not x.is_contiguous() or x.shape[-1] % 2:
            return _torch_forward(self.layer, x)
        out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype)
        self.ops.silu_and_mul(out, x)
        return out


def _torch_forward(layer: nn.Module, *args: Any) -> Any:
    return layer.forward_native(*args)


KERNELS = {RMSNorm: NativeRMSNorm, RotaryEmbedding: NativeRotary, SiluAndMul: NativeSiluAndMul}


def install_fused_ops(model: nn.Module, dtype: torch.dtype) -> int:
    """Give every RMSNorm, rotary and SiLU-and-mul layer of an fp32 model its C++ kernel."""
    if dtype != torch.float32:
        return 0
    ops = get_elementwise_ops()
    if ops is None:
        return 0
    installed = 0
    for module in model.modules():
        kernel = KERNELS.get(type(module))
        if kernel is not None:
            module.platform_forward = kernel(ops, module)
            installed += 1
    logger.debug("installed %d C++ element-wise kernels", installed)
    return installed
