"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparrow.ops.base import CustomOp


class SiluAndMul(CustomOp):
    """``silu(gate) * up`` for the fused gate/up projection output ``[..., 2 * d]`` -> ``[..., d]``."""

    op_name = "silu_and_mul"

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]).mul_(x[..., d:])  # in place on silu's fresh output: one pass less


class GeluAndMul(CustomOp):
    """``gelu_tanh(gate) * up`` for ``[..., 2 * d]`` -> ``[..., d]``: Gemma's MLP, whose
    ``gelu_pytorch_tanh`` is torch's tanh approximation of GELU."""

    op_name = "gelu_and_mul"

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh").mul_(x[..., d:])


def gelu_and_mul_cases(dtype: torch.dtype, device: torch.device) -> list:
    """Conformance cases of ``gelu_and_mul`` (see :mod:`sparrow.ops.cases`)."""
    from sparrow.ops.cases import _ELEMENTWISE_TOL, ROWS, OpCase, _generator, _randn, _tol

    tol = _tol(_ELEMENTWISE_TOL, dtype)
    cases = []
    for rows in ROWS:
        x = _randn(_generator(1200, rows), rows, 2 * 48, dtype=dtype, device=device, scale=4.0)
        cases.append(OpCase("gelu_and_mul", f"{rows}x96", GeluAndMul, (x,), **tol))
    x3 = _randn(_generator(1201), 2, 3, 2 * 24, dtype=dtype, device=device)
    cases.append(OpCase("gelu_and_mul", "3D 2x3x48", GeluAndMul, (x3,), **tol))
    return cases
