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


class DequantizedLinear(OpImpl):
    """``linear`` of a quantized layer (its ``weights.dense_weight``), dequantized at bind time."""

    name = "dequantized"
    platform: ClassVar[str] = "cpu"

    def __init__(self, layer: Any) -> None:
        super().__init__(layer)
        self.inner: OpImpl | None = None

    def process_weights(self) -> None:
        from sparrow.layers.linear import DENSE
        from sparrow.ops.binding import lookup_impl

        layer = self.layer
        if layer.weights is not DENSE:
            layer.make_dense(layer.weights.dense_weight(layer))
        inner_cls = lookup_impl("linear", self.platform)
        if inner_cls is not None and inner_cls.supports(layer):
            self.inner = inner_cls(layer)
            self.inner.process_weights()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.inner is not None:
            return self.inner(x, bias)
        return F.linear(x, self.layer.weight, bias)


class DequantizedFusedMoE(OpImpl):
    """``fused_moe`` of quantized experts (AWQ, GPTQ): every expert dequantized at bind time into
    the layer's stacked weights, then the platform's own ``fused_moe`` (the device's type names
    the platform, as for the built-in ones), else the torch reference."""

    name = "dequantized"

    def __init__(self, layer: Any) -> None:
        super().__init__(layer)
        self.inner: OpImpl | None = None

    def process_weights(self) -> None:
        from sparrow.ops.binding import lookup_impl

        layer = self.layer
        layer.dequantize_experts()  # before bind_ops reaches the experts' linear layers: they are gone
        inner_cls = lookup_impl("fused_moe", layer.gate_up_proj.device.type)
        if inner_cls is not None and inner_cls.supports(layer):
            self.inner = inner_cls(layer)
            self.inner.process_weights()

    def __call__(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.inner is not None:
            return self.inner(hidden, topk_weights, topk_ids)
        return self.layer.forward_native(hidden, topk_weights, topk_ids)
