"""RMSNorm, with the residual add of the pre-norm transformer block fused into the call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.ops.base import CustomOp


class RMSNorm(CustomOp):
    """``weight * x / sqrt(mean(x^2) + eps)``, normalised over the last dimension.

    Statistics are computed in float32; the normalised value is cast back to the input dtype
    before the weight is applied, as Hugging Face's Llama/Qwen norms do, so bf16 results match.
    The weight is replicated on every tensor-parallel rank.
    """

    op_name = "rms_norm"

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        # Uninitialised on purpose: load_weights overwrites it.
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype), requires_grad=False)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; or, given ``residual``, ``(norm(x + residual), x + residual)``.

        x, residual: [..., hidden_size]. The torch reference (never in place); a platform's
        implementation may work in place on ``x`` and ``residual``.
        """
        if residual is None:
            return self._normalize(x)
        x = x + residual
        return self._normalize(x), x

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused kernel; the same arithmetic as below when nothing is cast.
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        input_dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        normed = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * normed.to(input_dtype)

    def layer_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
