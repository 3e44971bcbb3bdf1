"""Gated activations."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for the fused gate/up projection output ``[..., 2 * d]`` -> ``[..., d]``."""

    # A platform may install a faster kernel with the same signature and semantics as forward
    # (sparrow_cpu.fused installs C++ ones); it may compute in place on its inputs.
    platform_forward: Callable[..., Any] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.platform_forward is not None:
            return self.platform_forward(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]).mul_(x[..., d:])  # in place on silu's fresh output: one pass less
