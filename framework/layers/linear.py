"""Linear layers split across tensor-parallel ranks.

Column-parallel layers split the output dimension (each rank holds a slice of the rows of the
``[out, in]`` weight); row-parallel layers split the input dimension and sum partial results over
the group. A fused layer (QKV, gate/up) is one column-parallel weight made of several shards; each
shard is sliced per rank separately so that rank r holds ``[q_r; k_r; v_r]``.

Every weight carries ``weight.weight_loader(param, loaded, shard_id=None)``, which takes the *full*
checkpoint tensor (or a lazy safetensors slice) and copies this rank's part into ``param``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch
import torch.nn.functional as F
from torch import nn

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


class LinearBase(CustomOp):
    """The ``linear`` op: ``x @ W^T + bias``, the matrix product of every linear layer.

    The op call is ``(x, bias or None) -> x @ W^T + bias`` on this rank's weight; a platform's
    implementation does the GEMM only (and may pack ``weight`` into its own layout when bound).
    Tensor-parallel gathers and reductions stay in the layers' ``forward``, around the op call.
    """

    op_name = "linear"
    weight: nn.Parameter

    def forward_native(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


def _new_parameter(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    # Uninitialised on purpose: every value is overwritten by load_weights.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


@dataclass(slots=True, frozen=True)
class OutputShard:
    """Where one logical output block (e.g. ``k``) of a fused weight lives."""

    param_offset: int  # first row of this shard in this rank's parameter
    size: int  # rows of this shard on this rank
    loaded_start: int  # first row this rank reads from the shard's checkpoint tensor
    fused_offset: int  # first row of the shard in a checkpoint that stores the fused tensor
    full_size: int  # rows of the shard's whole checkpoint tensor (all ranks)


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
        self.input_size = input_size
        self.gather_output = gather_output
        self.shards = self._make_shards(output_size)
        self.output_size_per_rank = sum(shard.size for shard in self.shards.values())
        self.weight = _new_parameter(self.output_size_per_rank, input_size, dtype=params_dtype)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _new_parameter(self.output_size_per_rank, dtype=params_dtype)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

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

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        """Copy this rank's rows of ``loaded`` (one shard, or the whole fused tensor) into ``param``."""
        if shard_id in self.shards:
            self._load_shard(param, loaded, self.shards[shard_id], fused=False)
        elif shard_id is None:
            for shard in self.shards.values():
                self._load_shard(param, loaded, shard, fused=True)
        else:
            raise ValueError(
                f"unknown shard_id {shard_id!r} for {type(self).__name__}; "
                f"expected one of {sorted(map(repr, self.shards))}"
            )

    def _load_shard(self, param: nn.Parameter, loaded: Any, shard: OutputShard, fused: bool) -> None:
        expected_rows = sum(s.full_size for s in self.shards.values()) if fused else shard.full_size
        shape = loaded_shape(loaded)
        if shape[0] != expected_rows or shape[1:] != tuple(param.shape[1:]):
            raise ValueError(
                f"checkpoint shape {shape} does not match {type(self).__name__}: expected "
                f"{(expected_rows, *param.shape[1:])}"
            )
        start = shard.loaded_start + (shard.fused_offset if fused else 0)
        rows = narrow_loaded(loaded, 0, start, shard.size)
        copy_checked(param.data.narrow(0, shard.param_offset, shard.size), rows)

    def layer_repr(self) -> str:
        return (
            f"in={self.input_size}, out_per_rank={self.output_size_per_rank}, "
            f"bias={self.bias is not None}, tp={self.tp.rank}/{self.tp.world_size}"
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
        self.output_size = output_size
        self.input_size_per_rank = divide(input_size, self.tp.world_size, "input_size")
        self.reduce_results = reduce_results
        self.weight = _new_parameter(output_size, self.input_size_per_rank, dtype=params_dtype)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _new_parameter(output_size, dtype=params_dtype)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

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
        if param is self.bias:
            copy_checked(param.data, materialize(loaded))
            return
        start = self.tp.rank * self.input_size_per_rank
        if len(loaded_shape(loaded)) != 2 or loaded_shape(loaded)[1] < start + self.input_size_per_rank:
            raise ValueError(
                f"checkpoint shape {loaded_shape(loaded)} does not fit RowParallelLinear "
                f"[{self.output_size}, {self.input_size_per_rank} x {self.tp.world_size}]"
            )
        copy_checked(param.data, narrow_loaded(loaded, 1, start, self.input_size_per_rank))

    def layer_repr(self) -> str:
        return (
            f"in_per_rank={self.input_size_per_rank}, out={self.output_size}, "
            f"bias={self.bias is not None}, tp={self.tp.rank}/{self.tp.world_size}"
        )
