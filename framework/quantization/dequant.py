"""Serving a quantized checkpoint on a platform without a kernel for its format: the weight is
dequantized once, when the model is bound, into the compute dtype, and the platform's own dense
implementation (the CPU's packed oneDNN GEMM for ``linear``; its ``fused_moe``, or the Triton
grouped GEMM on CUDA, for a mixture-of-experts layer's experts) serves it from then on. Memory is
that of the dense model; outputs equal the dequantized weights' exactly."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from sparrow.ops.base import OpImpl


class _Dequantized(OpImpl):
    """Dequantize the layer's weights once (``dequantize``), then serve ``op`` with the platform's
    own implementation when it supports the dense layer (``inner``), else with ``native``."""

    name = "dequantized"
    op: ClassVar[str] = ""

    def __init__(self, layer: Any) -> None:
        super().__init__(layer)
        self.inner: OpImpl | None = None

    def dequantize(self) -> str:
        """Make the layer dense; returns the platform whose implementation serves it then."""
        raise NotImplementedError

    def process_weights(self) -> None:
        from sparrow.ops.binding import lookup_impl

        inner_cls = lookup_impl(self.op, self.dequantize())
        if inner_cls is not None and inner_cls.supports(self.layer):
            self.inner = inner_cls(self.layer)
            self.inner.process_weights()

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner(*args, **kwargs) if self.inner is not None else self.native(*args, **kwargs)

    def native(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError


class DequantizedLinear(_Dequantized):
    """``linear`` of a quantized layer (its ``weights.dense_weight``), dequantized at bind time."""

    op = "linear"
    platform: ClassVar[str] = "cpu"

    def dequantize(self) -> str:
        from sparrow.layers.linear_weights import DENSE

        layer = self.layer
        if layer.weights is not DENSE:
            layer.make_dense(layer.weights.dense_weight(layer))
        return self.platform

    def native(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.layer.weight, bias)


class DequantizedFusedMoE(_Dequantized):
    """``fused_moe`` of quantized experts (AWQ, GPTQ): every expert dequantized at bind time into
    the layer's stacked weights, then the platform's own ``fused_moe`` (the device's type names
    the platform, as for the built-in ones), else the torch reference."""

    op = "fused_moe"

    def dequantize(self) -> str:
        self.layer.dequantize_experts()  # before bind_ops reaches the experts' linear layers: they are gone
        return self.layer.gate_up_proj.device.type

    def native(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.layer.forward_native(hidden, topk_weights, topk_ids)
