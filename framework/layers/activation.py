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
