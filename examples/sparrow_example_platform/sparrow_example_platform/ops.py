"""The platform's own implementation of one kernel op: RMSNorm (and the fused residual add).

A vendor writes its device kernel here; this one is plain torch, so that the example runs
anywhere, but it plugs in exactly as a kernel would: an :class:`~sparrow.ops.OpImpl` subclass,
registered for this platform by import path in ``sparrow_register_ops`` (``__init__.py``), built
once per RMSNorm layer after the weights load, then called on every forward with the arguments of
``RMSNorm.forward_native``. ``sparrow plugins --check cpu_sdpa`` compares it with that reference.
"""

from __future__ import annotations

import torch

from sparrow.ops import OpImpl


class TorchRMSNorm(OpImpl):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension; with ``residual``,
    ``(norm(x + residual), x + residual)``. Statistics in float32, the normalised value cast back
    to the input dtype before the weight, as the reference (and Hugging Face) do."""

    name = "example:TorchRMSNorm"

    @classmethod
    def supports(cls, layer: torch.nn.Module) -> bool:
        # A device kernel would accept only what it was compiled for; layers it declines keep
        # the torch reference.
        return layer.weight.dtype in (torch.float32, torch.bfloat16)

    def process_weights(self) -> None:
        # Read once here rather than on every call: the layer's settings never change after loading.
        self.weight = self.layer.weight
        self.eps = self.layer.eps

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual  # the new residual stream, returned alongside the normalised value
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * normed.to(x.dtype)
        return out if residual is None else (out, x)
