"""AWQ and GPTQ checkpoints: int4 (GPTQ also int8) weights in groups along the input dimension,
each group with its own scale and zero point, ``w = (q - zero) * scale``.

Layouts, as AutoAWQ / AutoGPTQ / GPTQModel store them (and vLLM loads them), for a linear layer
``[out=N, in=K]`` with ``G = K / group_size`` groups (``group_size=-1``: one group):

* AWQ (``version: gemm``, ``zero_point: true``): ``qweight`` int32 ``[K, N/8]``, eight 4-bit values
  per int32 along the *output* dimension in the interleaved order 0,2,4,6,1,3,5,7 (nibble ``i``,
  bits ``4i..4i+3``, holds column ``AWQ_ORDER[i]`` of its block of 8); ``qzeros`` int32 ``[G, N/8]``
  packed the same way; ``scales`` ``[G, N]``.
* GPTQ: ``qweight`` int32 ``[K/pack, N]``, ``pack = 32 / bits`` values per int32 along the *input*
  dimension in order; ``qzeros`` int32 ``[G, N/pack]`` packed in order along the output; ``scales``
  ``[G, N]``; ``g_idx`` int32 ``[K]``: the group of every input column. With ``desc_act`` (act
  order) columns were quantized in a permuted order, so ``g_idx`` is not ``k // group_size``.
  The original ``gptq`` checkpoint format stores each zero point minus one (``gptq_v2`` does not).

Loading slices every tensor per tensor-parallel rank (sparrow.layers.linear reads the layouts
declared here). Serving: on the CPU the weight is dequantized once, when the model is bound, to
the compute dtype and multiplied by the platform's dense GEMM (memory is then that of the dense
model: the point is running the checkpoint, not saving memory); on CUDA a Triton GEMM dequantizes
each tile as it goes (sparrow_cuda.triton_quant).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from sparrow.layers.linear import LinearBase
from sparrow.layers.linear_weights import LinearWeights, WeightLayout
from sparrow.quantization.common import BuiltinQuantization, config_error, tp_shapes

if TYPE_CHECKING:
    from sparrow.config import EngineConfig

# Nibble i of an AWQ int32 holds column AWQ_ORDER[i] of its block; column j sits in nibble AWQ_NIBBLE[j].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)

# Mixture-of-experts layers: on the CPU the experts are dequantized when bound (memory of the dense
# experts); on CUDA they stay packed and a grouped GEMM dequantizes each tile as it goes.
CPU_IMPL = {"linear": "sparrow.quantization.dequant:DequantizedLinear",
            "fused_moe": "sparrow.quantization.dequant:DequantizedFusedMoE"}
CUDA_IMPL = {"linear": "sparrow_cuda.triton_quant:TritonInt4Linear",
             "fused_moe": "sparrow_cuda.triton_moe_int4:TritonInt4FusedMoE"}


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split every int32 of ``packed`` into ``32 / bits`` unsigned values along ``dim``, lowest
    bits first: ``[.., n, ..] -> [.., n * 32 / bits, ..]`` int32."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    dim = dim % packed.dim()
    expanded = packed.unsqueeze(dim + 1)
    shape = [1] * expanded.dim()
    shape[dim + 1] = per_word
    values = (expanded >> shifts.view(shape)) & ((1 << bits) - 1)  # & drops the arithmetic shift's sign bits
    new_shape = list(packed.shape)
    new_shape[dim] *= per_word
    return values.reshape(new_shape)


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of :func:`unpack`: ``32 / bits`` values per int32 along ``dim``, in order."""
    per_word = 32 // bits
    dim = dim % values.dim()
    shape = list(values.shape)
    shape[dim:dim + 1] = [shape[dim] // per_word, per_word]
    grouped = (values.to(torch.int64) & ((1 << bits) - 1)).reshape(shape)
    shifts = torch.arange(0, 32, bits, device=values.device, dtype=torch.int64)
    view = [1] * grouped.dim()
    view[dim + 1] = per_word
    words = (grouped << shifts.view(view)).sum(dim=dim + 1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # as signed int32 bits


class Int4Weights(LinearWeights):
    """Shared by AWQ and GPTQ: ``operands(layer)`` gives the weight as plain tensors that kernels
    take, whatever the checkpoint's packing: ``q`` int32 ``[K, N]`` unsigned values, ``zeros``
    ``[G, N]`` and ``scales`` ``[G, N]`` in the scales' dtype, ``group_of`` int64 ``[K]`` (the row of
    ``zeros``/``scales`` of each input column)."""

    bits = 4

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def groups(self, layer: LinearBase) -> tuple[int, int | None, int]:
        """(rows of zeros/scales on this rank, their layout's input_dim, input columns per row)."""
        if self.group_size == -1:
            return 1, None, 1
        return layer.input_size_per_rank // self.group_size, 0, self.group_size

    def operands(self, layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def dense_weight(self, layer: LinearBase) -> torch.Tensor:
        q, zeros, scales, group_of = self.operands(layer)
        weight = (q.float() - zeros.float()[group_of]) * scales.float()[group_of]  # [K, N]
        return weight.t().to(layer.params_dtype).contiguous()

    def _default_groups(self, layer: LinearBase, device: torch.device) -> torch.Tensor:
        columns = torch.arange(layer.input_size_per_rank, device=device)
        return torch.zeros_like(columns) if self.group_size == -1 else columns // self.group_size


class AwqWeights(Int4Weights):
    name = "awq"

    def create_weights(self, layer: LinearBase) -> None:
        k, n = layer.input_size_per_rank, layer.output_size_per_rank
        num_groups, group_dim, group_div = self.groups(layer)
        layer.add_weight("qweight", torch.empty(k, n // 8, dtype=torch.int32),
                         WeightLayout(output_dim=1, input_dim=0, output_div=8))
        layer.add_weight("qzeros", torch.empty(num_groups, n // 8, dtype=torch.int32),
                         WeightLayout(output_dim=1, input_dim=group_dim, output_div=8, input_div=group_div))
        layer.add_weight("scales", torch.empty(num_groups, n, dtype=layer.params_dtype),
                         WeightLayout(output_dim=1, input_dim=group_dim, input_div=group_div))

    @staticmethod
    def _columns(packed: torch.Tensor) -> torch.Tensor:
        values = unpack(packed, 4, dim=1)  # nibble order within each block of 8 columns
        blocks = values.view(values.shape[0], -1, 8)
        return blocks[:, :, list(AWQ_NIBBLE)].reshape(values.shape)

    def operands(self, layer: LinearBase):
        q = self._columns(layer.qweight)
        zeros = self._columns(layer.qzeros).to(layer.scales.dtype)
        return q, zeros, layer.scales, self._default_groups(layer, q.device)


class GptqWeights(Int4Weights):
    name = "gptq"

    def __init__(self, group_size: int, bits: int, desc_act: bool, zero_offset: int) -> None:
        super().__init__(group_size)
        self.bits = bits
        self.desc_act = desc_act
        self.zero_offset = zero_offset  # 1 for the original format (zeros stored minus one)

    def groups(self, layer: LinearBase) -> tuple[int, int | None, int]:
        if self.desc_act and self.group_size != -1 and layer.input_is_parallel:
            # Act order scatters a group's columns over the whole input: every rank keeps all the
            # groups and its columns' g_idx picks them (vLLM does the same).
            return -(-layer.input_size // self.group_size), None, 1
        return super().groups(layer)

    def create_weights(self, layer: LinearBase) -> None:
        k, n = layer.input_size_per_rank, layer.output_size_per_rank
        per_word = 32 // self.bits
        num_groups, group_dim, group_div = self.groups(layer)
        layer.add_weight("qweight", torch.empty(k // per_word, n, dtype=torch.int32),
                         WeightLayout(output_dim=1, input_dim=0, input_div=per_word))
        layer.add_weight("qzeros", torch.empty(num_groups, n // per_word, dtype=torch.int32),
                         WeightLayout(output_dim=1, input_dim=group_dim, output_div=per_word, input_div=group_div))
        layer.add_weight("scales", torch.empty(num_groups, n, dtype=layer.params_dtype),
                         WeightLayout(output_dim=1, input_dim=group_dim, input_div=group_div))
        layer.add_weight("g_idx", torch.empty(k, dtype=torch.int32), WeightLayout(input_dim=0))

    def operands(self, layer: LinearBase):
        q = unpack(layer.qweight, self.bits, dim=0)
        zeros = (unpack(layer.qzeros, self.bits, dim=1) + self.zero_offset).to(layer.scales.dtype)
        groups = layer.g_idx.long() if self.desc_act else self._default_groups(layer, q.device)
        return q, zeros, layer.scales, groups


def _field(quant: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if quant.get(name) is not None:
            return quant[name]
    return default


class _Int4Method(BuiltinQuantization):
    needs_checkpoint = True
    implementations: ClassVar[dict[str, dict[str, str]]] = {"cpu": CPU_IMPL, "cuda": CUDA_IMPL}
    supported_bits: ClassVar[tuple[int, ...]] = (4,)

    @property
    def quant(self) -> dict[str, Any]:
        return self.hf_quant_config or {}

    @property
    def bits(self) -> int:
        return int(_field(self.quant, "bits", "w_bit", default=4))

    @property
    def group_size(self) -> int:
        return int(_field(self.quant, "group_size", "q_group_size", default=128))

    def check_checkpoint(self, config: EngineConfig) -> None:
        method = str(self.quant.get("quant_method", "")).lower()
        if method != self.name:
            raise config_error("quantization", f"{self.name!r} loads {self.name} checkpoints; this one's "
                               f"quant_method is {method!r}")
        if self.bits not in self.supported_bits:
            raise config_error("quantization", f"{self.name!r} loads {' or '.join(map(str, self.supported_bits))}-bit "
                               f"checkpoints; this one has bits={self.bits}")
        if self.group_size != -1 and self.group_size < 1:
            raise config_error("quantization", f"the checkpoint's group_size {self.group_size} is invalid")
        skipped = _field(self.quant, "modules_to_not_convert", "dynamic")
        if skipped:
            raise config_error("quantization", f"{self.name!r}: checkpoints that leave some layers unquantized or "
                               f"quantize layers differently ({skipped!r}) are not supported")
        tp = config.parallel.tensor_parallel_size
        per_word = 32 // self.bits
        for what, size in tp_shapes(self.hf_config, tp).items():
            if size % per_word or (what != "key/value heads x head_dim" and self.group_size > 0
                                   and size % self.group_size and not self._whole_groups_ok()):
                raise config_error("tensor_parallel_size", f"{tp} leaves {size} of the model's {what} per rank, "
                                   f"which must be a multiple of {per_word} (values per int32) and of the "
                                   f"checkpoint's group_size {self.group_size}")

    def _whole_groups_ok(self) -> bool:
        return False


class AwqMethod(_Int4Method):
    """``quantization="awq"``: AutoAWQ's GEMM checkpoints (4-bit, zero point, any group size)."""

    name = "awq"

    def check_checkpoint(self, config: EngineConfig) -> None:
        super().check_checkpoint(config)
        version = str(self.quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise config_error("quantization", f"'awq' loads version 'gemm' checkpoints; this one is {version!r}")
        if not self.quant.get("zero_point", True):
            raise config_error("quantization", "'awq' loads checkpoints with zero points (zero_point: true)")

    def linear_weights(self, layer: LinearBase) -> LinearWeights:
        return AwqWeights(self.group_size)


class GptqMethod(_Int4Method):
    """``quantization="gptq"``: AutoGPTQ / GPTQModel checkpoints (4 or 8 bits, symmetric or not,
    any group size, act order with ``g_idx``)."""

    name = "gptq"
    supported_bits = (4, 8)

    @property
    def desc_act(self) -> bool:
        return bool(self.quant.get("desc_act", False))

    def _whole_groups_ok(self) -> bool:
        return self.desc_act  # act order keeps every group on every rank

    def check_checkpoint(self, config: EngineConfig) -> None:
        super().check_checkpoint(config)
        fmt = str(self.quant.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise config_error("quantization", f"'gptq' loads checkpoint_format 'gptq' or 'gptq_v2', not {fmt!r}")
        if self.quant.get("lm_head"):
            raise config_error("quantization", "'gptq' checkpoints with a quantized lm_head are not supported")

    def linear_weights(self, layer: LinearBase) -> LinearWeights:
        fmt = str(self.quant.get("checkpoint_format", "gptq")).lower()
        return GptqWeights(self.group_size, self.bits, self.desc_act, zero_offset=0 if fmt == "gptq_v2" else 1)
