"""Linear layers split across tensor-parallel ranks.

Column-parallel layers split the output dimension (each rank holds a slice of the rows of the
``[out, in]`` weight); row-parallel layers split the input dimension and sum partial results over
the group. A fused layer (QKV, gate/up) is one column-parallel weight made of several shards; each
shard is sliced per rank separately so that rank r holds ``[q_r; k_r; v_r]``.

How a layer stores its weight is a :class:`~sparrow.layers.linear_weights.LinearWeights` (the
"create weights" seam, in ``sparrow.layers.linear_weights``); every parameter is registered with
:meth:`LinearBase.add_weight` and its :class:`WeightLayout`, so one loader slices every layout per
rank and per shard.

Every parameter carries ``param.weight_loader(param, loaded, shard_id=None)``, which takes the
*full* checkpoint tensor (or a lazy safetensors slice) and copies this rank's part into ``param``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.layers.linear_weights import DENSE, DenseWeights, LinearWeights, WeightLayout, new_tensor
from sparrow.layers.parallel import (
    ParallelContext,
    copy_checked,
    divide,
    loaded_shape,
    materialize,
    narrow_loaded,
    resolve_tp,
)
from sparrow.ops.base import CustomOp

__all__ = ["DENSE", "ColumnParallelLinear", "DenseWeights", "LinearBase", "LinearWeights", "MergedColumnParallelLinear",
           "OutputShard", "QKVParallelLinear", "RowParallelLinear", "WeightLayout"]


@dataclass(slots=True, frozen=True)
class OutputShard:
    """Where one logical output block (e.g. ``k``) of a fused weight lives."""

    param_offset: int  # first row of this shard in this rank's parameter
    size: int  # rows of this shard on this rank
    loaded_start: int  # first row this rank reads from the shard's checkpoint tensor
    fused_offset: int  # first row of the shard in a checkpoint that stores the fused tensor
    full_size: int  # rows of the shard's whole checkpoint tensor (all ranks)


class LinearBase(CustomOp):
    """The ``linear`` op: ``x @ W^T + bias``, the matrix product of every linear layer.

    The op call is ``(x, bias or None) -> x @ W^T + bias`` on this rank's weight; a platform's
    implementation does the GEMM only (and may pack ``weight`` into its own layout when bound).
    Tensor-parallel gathers and reductions stay in the layers' ``forward``, around the op call.

    Sizes every layer has: ``input_size`` / ``output_size`` (whole layer), ``input_size_per_rank``
    / ``output_size_per_rank`` (this rank's weight), ``shards`` (output blocks; one, ``None``, for
    an unfused layer), ``input_is_parallel`` (row-parallel), ``params_dtype``, ``weights`` (its
    :class:`LinearWeights`).
    """

    op_name = "linear"
    weight: nn.Parameter
    input_is_parallel = False

    def _create(self, *, input_size: int, output_size: int, input_size_per_rank: int,
                shards: dict[Hashable, OutputShard], bias: bool, params_dtype: torch.dtype | None) -> None:
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_rank = input_size_per_rank
        self.shards = shards
        self.output_size_per_rank = sum(shard.size for shard in shards.values())
        self.params_dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        from sparrow.quantization import linear_weights_for

        # The quantization method the model is being built under decides the parameters.
        self.weights: LinearWeights = linear_weights_for(self) or DENSE
        self.weights.create_weights(self)
        if bias:
            self.add_weight("bias", new_tensor(self.output_size_per_rank, dtype=self.params_dtype),
                            WeightLayout(output_dim=0))
        else:
            self.register_parameter("bias", None)

    def add_weight(self, name: str, tensor: torch.Tensor, layout: WeightLayout) -> nn.Parameter:
        """Register ``tensor`` as parameter ``name``, loaded per ``layout`` by this layer's loader.
        Raises ValueError when this rank's shards do not fall on whole stored elements (a
        packed or grouped dimension that the tensor-parallel split would cut)."""
        for shard_id, shard in self.shards.items():
            div = layout.output_div
            if layout.output_dim is not None and (shard.size % div or shard.param_offset % div
                                                  or shard.fused_offset % div):
                raise ValueError(f"{type(self).__name__} {name!r}: output shard {shard_id!r} of {shard.size} rows per "
                                 f"rank is not a multiple of {layout.output_div} (the rows one stored element holds)")
        if layout.input_dim is not None and self.input_size_per_rank % layout.input_div:
            raise ValueError(f"{type(self).__name__} {name!r}: {self.input_size_per_rank} input columns per rank are "
                             f"not a multiple of {layout.input_div} (the columns one stored element holds)")
        param = nn.Parameter(tensor, requires_grad=False)
        param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        param.linear_layout = layout  # type: ignore[attr-defined]
        self.register_parameter(name, param)
        return param

    def make_dense(self, weight: torch.Tensor) -> None:
        """Replace a quantized layout by the dense ``weight`` ``[out_per_rank, in_per_rank]``
        (an implementation that dequantizes once, when bound): the quantized parameters are
        released and the layer is an ordinary dense one from then on."""
        for name in [n for n, _ in self.named_parameters(recurse=False) if n != "bias"]:
            delattr(self, name)
        self.weights = DENSE
        self.replace_parameter("weight", weight)

    def forward_native(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weights = self.weights
        return F.linear(x, self.weight if weights is DENSE else weights.dense_weight(self).to(x.dtype), bias)

    # -- loading -------------------------------------------------------------------------------
    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        """Copy this rank's part of ``loaded`` (one shard's checkpoint tensor, or the whole fused
        tensor when ``shard_id`` is None) into ``param``."""
        layout: WeightLayout = getattr(param, "linear_layout", WeightLayout(0, 1))
        if shard_id in self.shards and (shard_id is not None or len(self.shards) == 1):
            targets, fused = [(shard_id, self.shards[shard_id])], False
        elif shard_id is None:
            targets, fused = list(self.shards.items()), True
        else:
            expected = sorted(map(repr, self.shards)) if None not in self.shards else "none"
            raise ValueError(f"unknown shard_id {shard_id!r} for {type(self).__name__}; expected one of {expected}")
        if layout.per_shard:
            self._load_per_shard(param, loaded, [sid for sid, _ in targets])
            return
        self._check_loaded_shape(param, loaded, layout, fused, targets[0][1])
        if layout.input_dim is not None and self.input_is_parallel:
            columns = self.input_size_per_rank // layout.input_div
            loaded = narrow_loaded(loaded, layout.input_dim, self.tp.rank * columns, columns)
        for _, shard in targets:
            if layout.output_dim is None:
                copy_checked(param.data, materialize(loaded))
                continue
            div = layout.output_div
            start = (shard.loaded_start + (shard.fused_offset if fused else 0)) // div
            rows = narrow_loaded(loaded, layout.output_dim, start, shard.size // div)
            copy_checked(param.data.narrow(layout.output_dim, shard.param_offset // div, shard.size // div), rows)

    def _check_loaded_shape(self, param: nn.Parameter, loaded: Any, layout: WeightLayout, fused: bool,
                            shard: OutputShard) -> None:
        expected = list(param.shape)
        if layout.output_dim is not None:
            full_rows = sum(s.full_size for s in self.shards.values()) if fused else shard.full_size
            expected[layout.output_dim] = full_rows // layout.output_div
        if layout.input_dim is not None and self.input_is_parallel:
            expected[layout.input_dim] = self.input_size_per_rank * self.tp.world_size // layout.input_div
        shape = loaded_shape(loaded)
        if shape != tuple(expected):
            raise ValueError(f"checkpoint shape {shape} does not match {type(self).__name__}: "
                             f"expected {tuple(expected)}")

    def _load_per_shard(self, param: nn.Parameter, loaded: Any, shard_ids: list[Hashable]) -> None:
        value = materialize(loaded).reshape(-1)
        if value.numel() != 1:
            raise ValueError(f"checkpoint shape {loaded_shape(loaded)} does not match {type(self).__name__}: "
                             "expected one value per projection")
        order = list(self.shards)
        for shard_id in shard_ids:
            param.data[order.index(shard_id)] = value[0]


class ColumnParallelLinear(LinearBase):
    """``y = x W^T + b`` with W's output rows split across ranks.

    With ``gather_output`` every rank returns the full output; otherwise its own slice.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        tp: ParallelContext | None = None,
        gather_output: bool = False,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = resolve_tp(tp)
        self.gather_output = gather_output
        shards = self._make_shards(output_size)
        self._create(input_size=input_size, output_size=sum(s.full_size for s in shards.values()),
                     input_size_per_rank=input_size, shards=shards, bias=bias, params_dtype=params_dtype)

    def _make_shards(self, output_size: int) -> dict[Hashable, OutputShard]:
        size = divide(output_size, self.tp.world_size, "output_size")
        return {None: OutputShard(0, size, self.tp.rank * size, 0, output_size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, input_size] -> [num_tokens, output_size_per_rank]
        impl = self._op_impl
        out = impl(x, self.bias) if impl is not None else self.forward_native(x, self.bias)
        if self.gather_output:
            out = self.tp.all_gather(out, dim=-1)
        return out

    def layer_repr(self) -> str:
        quantized = f", weights={self.weights.name}" if self.weights is not DENSE else ""
        return (
            f"in={self.input_size}, out_per_rank={self.output_size_per_rank}, "
            f"bias={self.bias is not None}, tp={self.tp.rank}/{self.tp.world_size}{quantized}"
        )


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate/up).

    Shards are numbered ``0..len(output_sizes)-1`` in ``output_sizes`` order.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        *,
        tp: ParallelContext | None = None,
        gather_output: bool = False,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(
            input_size, sum(self.output_sizes), bias,
            tp=tp, gather_output=gather_output, params_dtype=params_dtype,
        )

    def _make_shards(self, output_size: int) -> dict[Hashable, OutputShard]:
        shards: dict[Hashable, OutputShard] = {}
        param_offset = fused_offset = 0
        for index, full_size in enumerate(self.output_sizes):
            size = divide(full_size, self.tp.world_size, f"output_sizes[{index}]")
            shards[index] = OutputShard(
                param_offset, size, self.tp.rank * size, fused_offset, full_size
            )
            param_offset += size
            fused_offset += full_size
        return shards


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection: shards ``"q"``, ``"k"``, ``"v"``.

    Query heads are split across ranks. KV heads are split too, or replicated when the group has
    more ranks than KV heads (each rank then holds one KV head, shared by ``world_size /
    num_kv_heads`` ranks).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        *,
        tp: ParallelContext | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        tp = resolve_tp(tp)
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp.world_size, "num_attention_heads")
        if tp.world_size >= total_num_kv_heads:
            self.num_kv_head_replicas = divide(tp.world_size, total_num_kv_heads, "num_key_value_heads")
            self.num_kv_heads = 1
        else:
            self.num_kv_head_replicas = 1
            self.num_kv_heads = divide(total_num_kv_heads, tp.world_size, "num_key_value_heads")
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias, tp=tp, params_dtype=params_dtype)

    def _make_shards(self, output_size: int) -> dict[Hashable, OutputShard]:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        full_q, full_kv = self.total_num_heads * self.head_dim, self.total_num_kv_heads * self.head_dim
        kv_rank = self.tp.rank // self.num_kv_head_replicas
        return {
            "q": OutputShard(0, q_size, self.tp.rank * q_size, 0, full_q),
            "k": OutputShard(q_size, kv_size, kv_rank * kv_size, full_q, full_kv),
            "v": OutputShard(q_size + kv_size, kv_size, kv_rank * kv_size, full_q + full_kv, full_kv),
        }

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class RowParallelLinear(LinearBase):
    """``y = x W^T + b`` with W's input columns split across ranks; partial sums are all-reduced.

    The input is expected already split (the output of a column-parallel layer).
    """

    input_is_parallel = True

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        tp: ParallelContext | None = None,
        reduce_results: bool = True,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = resolve_tp(tp)
        self.reduce_results = reduce_results
        # The output is whole on every rank: one shard, read from row 0.
        self._create(input_size=input_size, output_size=output_size,
                     input_size_per_rank=divide(input_size, self.tp.world_size, "input_size"),
                     shards={None: OutputShard(0, output_size, 0, 0, output_size)}, bias=bias,
                     params_dtype=params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, input_size_per_rank] -> [num_tokens, output_size]
        # The bias is added once, by rank 0, so that the all-reduce sums it exactly once.
        bias = self.bias if self.tp.rank == 0 or not self.reduce_results else None
        impl = self._op_impl
        out = impl(x, bias) if impl is not None else self.forward_native(x, bias)
        if self.reduce_results:
            out = self.tp.all_reduce(out)
        return out

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        """Copy this rank's input columns of ``loaded`` (the bias whole) into ``param``."""
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear takes no shard_id, got {shard_id!r}")
        super().weight_loader(param, loaded, None)

    def layer_repr(self) -> str:
        quantized = f", weights={self.weights.name}" if self.weights is not DENSE else ""
        return (
            f"in_per_rank={self.input_size_per_rank}, out={self.output_size}, "
            f"bias={self.bias is not None}, tp={self.tp.rank}/{self.tp.world_size}{quantized}"
        )
