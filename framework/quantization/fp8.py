"""``quantization="fp8"``: fp8 (e4m3) W8A8, dynamic per-token activations, on CUDA.

Weights come two ways:

* from an unquantized (bf16/fp16/fp32) checkpoint, quantized when the model is bound, per output
  channel: ``w ~= q[n, :] * s[n]``, ``s[n] = max|w[n, :]| / 448``;
* from an fp8 checkpoint (config.json ``quantization_config.quant_method == "fp8"``, the AutoFP8 /
  vLLM layout): ``weight`` in float8_e4m3fn and a per-tensor ``weight_scale`` per projection, loaded
  as they are (a fused layer's per-projection scales become per-channel ones, so nothing is
  requantized). A static ``input_scale`` (``activation_scheme: static``) is read and not used:
  activations are always scaled per token, which is at least as accurate. Block-wise checkpoints
  (``weight_block_size``) are refused.

Activations: ``x ~= q[m, :] * s[m]`` per token, computed on every call. The GEMM is
``torch._scaled_mm`` with row-wise scales on GPUs that have fp8 tensor cores (compute capability
8.9+); elsewhere (and on the CPU, which has the float8 dtypes but no fp8 GEMM) the same quantized
operands are multiplied in float32, which is how the arithmetic is tested without a GPU. On CUDA
the per-row quantization itself runs in one Triton launch that computes :func:`quantize_fp8_rows`'s
bits (``sparrow_cuda.triton_fp8``, through the ``quantize_rows`` hook of the op implementations).

Mixture-of-experts layers (:class:`Fp8FusedMoE`): every expert's projections per output channel,
each GEMM's input per row; on CUDA a Triton grouped GEMM on fp8 operands serves them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from sparrow.layers.linear import LinearBase
from sparrow.layers.linear_weights import DENSE, LinearWeights, WeightLayout
from sparrow.ops.base import OpImpl
from sparrow.quantization.common import BuiltinQuantization, config_error

if TYPE_CHECKING:
    from sparrow.config import EngineConfig

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a 2-D tensor: ``(q float8_e4m3fn [R, C], scale float32 [R])``, ``x ~= q * scale``."""
    x = x.float()
    scale = x.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x / scale.unsqueeze(1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float().unsqueeze(1)


class Fp8CheckpointWeights(LinearWeights):
    """An fp8 checkpoint's linear: ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale`` float32
    ``[num_shards]`` (one per fused projection), ``input_scale`` too when static."""

    name = "fp8"

    def __init__(self, static_input: bool) -> None:
        self.static_input = static_input

    def create_weights(self, layer: LinearBase) -> None:
        layer.add_weight("weight", torch.empty(layer.output_size_per_rank, layer.input_size_per_rank, dtype=FP8),
                         WeightLayout(output_dim=0, input_dim=1))
        layer.add_weight("weight_scale", torch.empty(len(layer.shards), dtype=torch.float32),
                         WeightLayout(per_shard=True))
        if self.static_input:
            layer.add_weight("input_scale", torch.empty(len(layer.shards), dtype=torch.float32),
                             WeightLayout(per_shard=True))

    @staticmethod
    def channel_scales(layer: LinearBase) -> torch.Tensor:
        """The per-projection scales repeated over each projection's rows: ``[N]``."""
        sizes = torch.tensor([shard.size for shard in layer.shards.values()], device=layer.weight_scale.device)
        return torch.repeat_interleave(layer.weight_scale.float(), sizes)

    def dense_weight(self, layer: LinearBase) -> torch.Tensor:
        return dequantize_fp8_rows(layer.weight, self.channel_scales(layer)).to(layer.params_dtype)


def _scaled_mm_works(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs here with row-wise scales (fp8 tensor cores)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(OpImpl):
    """``linear`` with fp8 weights (per channel) and fp8 activations (per token)."""

    name = "fp8_w8a8"

    def __init__(self, layer: Any) -> None:
        super().__init__(layer)
        self.use_scaled_mm = False

    @staticmethod
    def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`quantize_fp8_rows`, or a platform's kernel computing the same bits (a CUDA subclass
        puts its one-launch Triton kernel here: ``sparrow_cuda.triton_fp8.TritonFp8Linear``)."""
        return quantize_fp8_rows(x)

    def process_weights(self) -> None:
        layer = self.layer
        if layer.weights is DENSE:
            q, scale = self.quantize_rows(layer.weight.data)
        else:
            q, scale = layer.weight.data, Fp8CheckpointWeights.channel_scales(layer)
            for name in ("weight_scale", "input_scale"):
                if hasattr(layer, name):
                    delattr(layer, name)
        layer.weights = DENSE  # from here the layer holds fp8 ``weight`` and per-channel ``weight_scale``
        layer.replace_parameter("weight", q)
        layer.replace_parameter("weight_scale", scale.float().reshape(1, -1).contiguous())
        self.use_scaled_mm = _scaled_mm_works(q.device) and q.shape[0] % 16 == 0 and q.shape[1] % 16 == 0

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        layer = self.layer
        x2 = x.reshape(-1, x.shape[-1])
        q, x_scale = self.quantize_rows(x2)
        if self.use_scaled_mm and x2.shape[0] > 0:
            out = self._scaled_mm(q, x_scale, x.dtype)
        else:
            # Emulated: the same fp8 operands multiplied in float32.
            out = torch.mm(q.float(), layer.weight.t().float()) * (x_scale.unsqueeze(1) * layer.weight_scale)
            out = out.to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _scaled_mm(self, q: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        layer = self.layer
        if dtype == torch.bfloat16:  # row-wise scales inside the GEMM (bf16 output only)
            return torch._scaled_mm(q, layer.weight.t(), scale_a=x_scale.unsqueeze(1), scale_b=layer.weight_scale,
                                    out_dtype=dtype)
        one = torch.ones((), device=q.device, dtype=torch.float32)
        out = torch._scaled_mm(q, layer.weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return (out * (x_scale.unsqueeze(1) * layer.weight_scale)).to(dtype)


class Fp8FusedMoE(OpImpl):
    """``fused_moe`` with fp8 experts (per expert and output channel) and fp8 activations per row.

    The weights are quantized when bound from the layer's stacked dense experts, or stacked from
    an fp8 checkpoint's per-expert layers as they are (per-tensor scales repeated over the
    channels); ``gate_up_proj`` / ``down_proj`` then hold float8_e4m3fn ``[E, 2I, H]`` / ``[E, H, I]``
    and ``gate_up_scale`` / ``down_scale`` float32 ``[E, 2I]`` / ``[E, H]``. Each GEMM's input is
    quantized per row: every token's hidden state for gate/up, every (token, expert) pair's gated
    activation for down. This implementation multiplies the fp8 operands in float32 (emulated, as
    :class:`Fp8Linear` does without fp8 tensor cores); on CUDA a Triton grouped GEMM multiplies
    them on the tensor cores (``sparrow_cuda.triton_moe.TritonFp8FusedMoE``).
    """

    name = "fp8_w8a8"
    PROJECTIONS = ("gate_up_proj", "down_proj")

    @staticmethod
    def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`Fp8Linear.quantize_rows`: a platform's subclass may compute the same bits in a kernel."""
        return quantize_fp8_rows(x)

    @classmethod
    def supports(cls, layer: Any) -> bool:
        if layer.quantized:  # an fp8 checkpoint's experts, still per-expert linear layers
            return isinstance(layer.get_submodule("0").gate_up_proj.weights, Fp8CheckpointWeights)
        return layer.gate_up_proj.is_floating_point() and layer.gate_up_proj.dtype != FP8

    def process_weights(self) -> None:
        layer = self.layer
        stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if layer.quantized:
            for name, linears in layer.pop_expert_linears().items():
                stacks[name] = (torch.stack([linear.weight.data for linear in linears]),
                                torch.stack([Fp8CheckpointWeights.channel_scales(linear) for linear in linears]))
        else:
            for name in self.PROJECTIONS:
                dense = getattr(layer, name).data
                q, scale = self.quantize_rows(dense.reshape(-1, dense.shape[-1]))
                stacks[name] = (q.view(dense.shape), scale.view(dense.shape[:2]))
        for name, (q, scale) in stacks.items():
            layer.replace_parameter(name, q.contiguous())
            layer.replace_parameter(name.replace("_proj", "_scale"), scale.float().contiguous())

    def __call__(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        from sparrow.layers.fused_moe import mix_experts

        layer = self.layer
        inter = layer.gate_up_proj.shape[1] // 2
        quantize_rows = self.quantize_rows

        def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
            # Per-row quantization commutes with the gather by expert: the rows are the tokens'.
            w13 = dequantize_fp8_rows(layer.gate_up_proj[expert], layer.gate_up_scale[expert])
            gate_up = (dequantize_fp8_rows(*quantize_rows(x)) @ w13.t()).to(x.dtype)
            act = F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
            w2 = dequantize_fp8_rows(layer.down_proj[expert], layer.down_scale[expert])
            return (dequantize_fp8_rows(*quantize_rows(act.to(x.dtype))) @ w2.t()).to(x.dtype)

        return mix_experts(hidden, topk_weights, topk_ids, layer.num_experts, expert_mlp)


class Fp8Method(BuiltinQuantization):
    """fp8 W8A8: weights quantized on load, or an fp8 checkpoint loaded as it is."""

    name = "fp8"
    implementations: ClassVar[dict[str, dict[str, str]]] = {
        "cuda": {"linear": "sparrow_cuda.triton_fp8:TritonFp8Linear",
                 "fused_moe": "sparrow_cuda.triton_moe:TritonFp8FusedMoE"}}

    def check_config(self, config: EngineConfig) -> None:
        # Both unquantized and fp8 checkpoints are accepted: decide which before the shared checks.
        self.needs_checkpoint = bool(self.hf_quant_config)  # type: ignore[misc]
        super().check_config(config)

    def check_checkpoint(self, config: EngineConfig) -> None:
        quant = self.hf_quant_config
        if not quant:
            return
        if str(quant.get("quant_method", "")).lower() != "fp8":
            raise config_error("quantization", f"'fp8' loads fp8 checkpoints; this one's quant_method is "
                               f"{quant.get('quant_method')!r}")
        if quant.get("weight_block_size"):
            raise config_error("quantization", "'fp8': block-wise fp8 checkpoints (weight_block_size "
                               f"{quant['weight_block_size']}) are not supported")
        fmt = str(quant.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise config_error("quantization", f"'fp8' loads e4m3 checkpoints, not {fmt!r}")
        scheme = str(quant.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise config_error("quantization", f"'fp8': unknown activation_scheme {scheme!r}")

    def linear_weights(self, layer: LinearBase) -> LinearWeights | None:
        if not self.hf_quant_config:
            return None  # dense, quantized when bound
        return Fp8CheckpointWeights(str(self.hf_quant_config.get("activation_scheme", "dynamic")).lower() == "static")
