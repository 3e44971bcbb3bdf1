"""``quantization="int8"``: int8 W8A8 on the CPU, quantized on load from an unquantized checkpoint.

Weights: symmetric int8 per output channel, ``w ~= q_w * s_w[n]`` with ``s_w = max|w[n, :]| / 127``
(``/ 63`` on x86 CPUs without VNNI, where oneDNN's u8 x s8 products could otherwise saturate; see
sparrow_cpu.int8), computed once when the model is bound (the dense weight is released: a quarter
of fp32's memory).
Activations: symmetric int8 per token, dynamically, ``x ~= q_x * s_x[m]`` with
``s_x = max|x[m, :]| / 127``. The product is accumulated in int32 and scaled back,
``y[m, n] = s_x[m] * s_w[n] * sum_k q_x[m, k] q_w[n, k] + b[n]``.

Mixture-of-experts models (Qwen3-MoE, Mixtral): every expert's stacked ``gate_up_proj`` and
``down_proj`` are quantized the same way, per expert and per output channel, and run as int8 GEMMs
over the tokens routed to each expert (sparrow_cpu.int8.Int8FusedMoE, serving the ``fused_moe``
op); the router stays in full precision, as in vLLM. Under tensor parallelism ``down_proj``'s
scales are taken over each whole output row, every rank's slice of it, so each rank holds exactly
its slice of the single-device int8 weights.

vLLM has no online int8 method under this name (its W8A8 int8 comes from compressed-tensors
checkpoints, per-channel weights and dynamic per-token activations, the same scheme); ``int8`` is
Sparrow's name for it. The CPU kernel is sparrow_cpu.int8.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from sparrow.quantization.common import BuiltinQuantization

INT8_MAX = 127


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of a 2-D tensor: ``(q int8 [R, C], scale float32 [R])``, ``x ~= q * scale``.
    An all-zero row gets scale 1 (its values are 0 either way)."""
    x = x.float()
    scale = x.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / scale.unsqueeze(1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float().unsqueeze(1)


class Int8Method(BuiltinQuantization):
    """int8 weights per channel, int8 activations per token, int32 accumulation; CPU only."""

    name = "int8"
    implementations: ClassVar[dict[str, dict[str, str]]] = {
        "cpu": {"linear": "sparrow_cpu.int8:Int8Linear", "fused_moe": "sparrow_cpu.int8:Int8FusedMoE"}}
    dtypes = ("float32", "bfloat16")
