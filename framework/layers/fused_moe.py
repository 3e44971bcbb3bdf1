"""Mixture-of-experts layers: the ``fused_moe`` op and the sparse MoE block the MoE models share.

The block routes each token to ``top_k`` of ``num_experts`` gated MLPs (HF transformers' rule:
softmax over the router logits in float32, top-k, optionally renormalised) and mixes their outputs
with the routing weights. The experts' weights are stacked, one tensor per projection:

* ``gate_up_proj``: ``[E, 2 * I_per_rank, H]`` (this rank's gate rows, then its up rows)
* ``down_proj``:    ``[E, H, I_per_rank]``

Tensor parallelism splits every expert's intermediate size, as a dense MLP is split (gate/up
column-parallel, down row-parallel): each rank computes a partial sum over its slice of the
intermediate features, and the layer all-reduces it. The op call itself is rank-local. With expert
parallelism (vLLM's ``enable_expert_parallel``) each rank holds whole experts instead, a contiguous
range of them (``expert_range``), and computes the pairs routed to those: the all-reduce then sums
the ranks' experts. The stacks hold the local experts only; an op implementation bound to the
layer receives the pairs of other ranks' experts with weight 0 (the native op skips them).

Built under a quantization method whose linear layers load a quantized checkpoint (AWQ, GPTQ), the
layer holds each expert as the linear layers a dense MLP has (children ``"0"``, ``"1"``...: a
merged ``gate_up_proj`` and a ``down_proj``), so that the checkpoint's per-expert ``qweight`` /
``qzeros`` / ``scales`` / ``g_idx`` load, and split over ranks, exactly as a dense layer's do;
the op implementation bound to the layer then takes them: on CUDA
``sparrow_cuda.triton_moe_int4.TritonInt4FusedMoE`` stacks them still packed, elsewhere
:meth:`FusedMoE.dequantize_experts` turns them into the stacked weights once
(``sparrow.quantization.dequant.DequantizedFusedMoE``).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from sparrow.layers.linear_weights import DENSE
from sparrow.layers.parallel import (
    ParallelContext,
    copy_checked,
    default_weight_loader,
    divide,
    loaded_shape,
    narrow_loaded,
    resolve_tp,
)
from sparrow.ops.base import CustomOp
from sparrow.quantization import building_method

# shard ids of one expert's checkpoint tensor: (projection, expert index)
GATE, UP, DOWN = "gate", "up", "down"


def expert_range(num_experts: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first expert, count) of ``rank`` under expert parallelism: contiguous ranges, the first
    ``num_experts % world_size`` ranks one expert more (as vLLM spreads a remainder)."""
    base, extra = divmod(num_experts, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` router logits -> (``[T, k]`` float32 weights, ``[T, k]`` int64 expert ids).

    Softmax in float32 over all experts, then the top k; with ``renormalize`` the k weights are
    divided by their sum (Mixtral always, Qwen3-MoE when ``norm_topk_prob``), as transformers does.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def mix_experts(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                expert_mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The ``fused_moe`` op's torch reference around ``expert_mlp(expert, rows [n, H]) -> [n, H]``.

    The (token, expert) pairs are sorted by expert so that each expert runs once over all its
    tokens; the Python loop is over experts, never over tokens. As transformers does, the routing
    weight multiplies each expert's output in the weights' dtype (float32 for Mixtral), then the
    products are summed per token in the model's dtype.
    """
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # [T*k] pair indices grouped by expert
    token_of_pair = order // top_k
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    x = hidden.index_select(0, token_of_pair)  # [T*k, H] in expert order
    expert_out = torch.empty_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            expert_out[start:start + count] = expert_mlp(expert, x[start:start + count])
            start += count
    weighted = (expert_out * topk_weights.reshape(-1)[order].unsqueeze(1)).to(hidden.dtype)
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    return out.index_add_(0, token_of_pair, weighted)


class FusedMoE(CustomOp):
    """The ``fused_moe`` op: every token's chosen experts' gated MLPs, mixed by routing weight.

    The op call is ``(hidden [T, H], topk_weights [T, k], topk_ids [T, k]) -> [T, H]`` on this
    rank's expert slices (a partial sum under tensor parallelism); ``forward`` adds the all-reduce.
    A platform's implementation may repack ``gate_up_proj`` / ``down_proj`` when bound.
    """

    op_name = "fused_moe"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 tp: ParallelContext | None = None, reduce_results: bool = True,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self.tp = resolve_tp(tp)
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.expert_parallel = self.tp.expert_parallel and self.tp.world_size > 1
        if self.expert_parallel:
            if num_experts < self.tp.world_size:
                raise ValueError(f"expert parallelism over {self.tp.world_size} ranks needs at least as many "
                                 f"experts; the model has {num_experts}")
            if building_method() is not None:
                raise ValueError("expert parallelism with a quantization method is not supported")
            self.first_expert, self.num_local_experts = expert_range(num_experts, self.tp.rank, self.tp.world_size)
            self.intermediate_size_per_rank = intermediate_size
        else:
            self.first_expert, self.num_local_experts = 0, num_experts
            self.intermediate_size_per_rank = divide(intermediate_size, self.tp.world_size, "moe_intermediate_size")
        self.reduce_results = reduce_results
        inter = self.intermediate_size_per_rank
        # Under a quantization method, an expert's linear layers tell whether the checkpoint
        # stores them quantized (their weights are then not DENSE).
        first = ExpertLinears(hidden_size, intermediate_size, self.tp, params_dtype) \
            if building_method() is not None else None
        if first is not None and first.gate_up_proj.weights is not DENSE:  # loaded as linear layers
            self.register_parameter("gate_up_proj", None)
            self.register_parameter("down_proj", None)
            self.add_module("0", first)
            for expert in range(1, num_experts):
                self.add_module(str(expert), ExpertLinears(hidden_size, intermediate_size, self.tp, params_dtype))
            return
        # Uninitialised on purpose: every value is overwritten by load_weights.
        local = self.num_local_experts
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * inter, hidden_size, dtype=params_dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(local, hidden_size, inter, dtype=params_dtype),
                                      requires_grad=False)
        self.gate_up_proj.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.down_proj.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    @property
    def quantized(self) -> bool:
        """Whether the experts are still the checkpoint's quantized linear layers."""
        return self.gate_up_proj is None

    def pop_expert_linears(self) -> dict[str, list[Any]]:
        """The quantized experts' linear layers, ``{"gate_up_proj": [E], "down_proj": [E]}``, taken
        out of the layer (an op implementation stacks them into its own layout when bound)."""
        experts = [self.get_submodule(str(expert)) for expert in range(self.num_experts)]
        for expert in range(self.num_experts):
            delattr(self, str(expert))
        return {name: [getattr(expert, name) for expert in experts] for name in ("gate_up_proj", "down_proj")}

    def dequantize_experts(self) -> None:
        """Quantized experts -> the stacked ``gate_up_proj`` / ``down_proj`` in the layer's dtype
        (their quantized parameters are released); nothing when the experts are dense."""
        if not self.quantized:
            return
        for name, linears in self.pop_expert_linears().items():
            stacked = torch.stack([linear.weights.dense_weight(linear) for linear in linears])
            setattr(self, name, nn.Parameter(stacked, requires_grad=False))

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        impl = self._op_impl
        if impl is not None and self.expert_parallel:  # other ranks' pairs: local expert 0, weight 0
            topk_weights, topk_ids, outside = self.local_routing(topk_weights, topk_ids)
            topk_ids = topk_ids.masked_fill(outside, 0)
        out = impl(hidden, topk_weights, topk_ids) if impl is not None else \
            self.forward_native(hidden, topk_weights, topk_ids)
        if self.reduce_results:
            out = self.tp.all_reduce(out)
        return out

    def forward_native(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized:  # not bound through a quantization method's op: dequantize here, once
            self.dequantize_experts()
        inter = self.gate_up_proj.shape[1] // 2
        local = self.num_local_experts
        if self.expert_parallel:  # other ranks' pairs go to a last, empty expert
            topk_weights, topk_ids, _ = self.local_routing(topk_weights, topk_ids)

        def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
            if expert == local:
                return torch.zeros_like(x)
            gate_up = F.linear(x, self.gate_up_proj[expert])  # [n, 2 * inter]
            return F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], self.down_proj[expert])  # [n, H]

        return mix_experts(hidden, topk_weights, topk_ids, local + 1 if self.expert_parallel else local, expert_mlp)

    def local_routing(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert parallelism: the ids as this rank's local ones, the pairs of other ranks' experts
        given id ``num_local_experts`` and weight 0; and the mask of those pairs."""
        local = topk_ids - self.first_expert
        outside = (local < 0) | (local >= self.num_local_experts)
        return (topk_weights.masked_fill(outside, 0), local.masked_fill(outside, self.num_local_experts),
                outside)

    # -- weight loading ------------------------------------------------------------------------

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        """Copy this rank's part of a checkpoint tensor into ``param``.

        ``shard_id`` is ``(projection, expert)`` for one expert's ``[I, H]`` gate or up tensor or
        ``[H, I]`` down tensor (the hub layout), or None for the whole stack of every expert
        (transformers 5's fused ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``).
        """
        inter, full = self.intermediate_size_per_rank, self.intermediate_size
        # Expert parallelism: whole experts (the intermediate size is not split), this rank's only.
        start = 0 if self.expert_parallel else self.tp.rank * inter
        first, local = self.first_expert, self.num_local_experts
        shape = loaded_shape(loaded)
        if shard_id is None:
            if param is self.gate_up_proj:
                self._check(shape, (self.num_experts, 2 * full, self.hidden_size), "gate_up_proj")
                mine = narrow_loaded(loaded, 0, first, local)
                copy_checked(param.data[:, :inter], narrow_loaded(mine, 1, start, inter))
                copy_checked(param.data[:, inter:], narrow_loaded(mine, 1, full + start, inter))
            else:
                self._check(shape, (self.num_experts, self.hidden_size, full), "down_proj")
                copy_checked(param.data, narrow_loaded(narrow_loaded(loaded, 0, first, local), 2, start, inter))
            return
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[0] in (GATE, UP, DOWN)
                and isinstance(shard_id[1], int) and 0 <= shard_id[1] < self.num_experts):
            raise ValueError(f"unknown shard_id {shard_id!r} for FusedMoE; expected (projection, expert) with "
                             f"projection one of {GATE!r}, {UP!r}, {DOWN!r} and expert < {self.num_experts}")
        projection, expert = shard_id
        if not first <= expert < first + local:
            return  # another rank's expert (expert parallelism)
        expert -= first
        if projection == DOWN:
            self._check(shape, (self.hidden_size, full), "down_proj")
            copy_checked(self.down_proj.data[expert], narrow_loaded(loaded, 1, start, inter))
        else:
            self._check(shape, (full, self.hidden_size), f"{projection}_proj")
            offset = 0 if projection == GATE else inter
            copy_checked(self.gate_up_proj.data[expert, offset:offset + inter], narrow_loaded(loaded, 0, start, inter))

    @staticmethod
    def _check(shape: tuple[int, ...], expected: tuple[int, ...], what: str) -> None:
        if tuple(shape) != expected:
            raise ValueError(f"checkpoint shape {tuple(shape)} does not match the experts' {what}: expected {expected}")

    def layer_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate_per_rank={self.intermediate_size_per_rank}, tp={self.tp.rank}/{self.tp.world_size}"
                + (f", local experts {self.first_expert}-{self.first_expert + self.num_local_experts - 1}"
                   if self.expert_parallel else "")
                + (", quantized" if self.quantized else ""))


class ExpertLinears(nn.Module):
    """One expert as a dense MLP's linear layers (how quantized experts load: see the module
    docstring); never called, only read into the stacks."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: ParallelContext,
                 params_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], False,
                                                       tp=tp, params_dtype=params_dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, tp=tp, params_dtype=params_dtype)


class MoeRouter(nn.Module):
    """The router's ``[E, H]`` weight, replicated on every rank (it is tiny and every rank routes)."""

    def __init__(self, hidden_size: int, num_experts: int, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=params_dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)  # [T, E]


class SparseMoeBlock(nn.Module):
    """Router (``gate``) and experts (``experts``): the MLP of a mixture-of-experts layer.

    ``weights_in_model_dtype``: Qwen3-MoE casts the routing weights to the model's dtype before
    they multiply the experts' outputs; Mixtral keeps them in float32.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, *,
                 renormalize: bool, weights_in_model_dtype: bool, tp: ParallelContext | None = None,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts "
                             f"({num_experts})")
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate = MoeRouter(hidden_size, num_experts, params_dtype)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, tp=tp, params_dtype=params_dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # [T, H] -> [T, H]
        weights, ids = select_experts(self.gate(hidden), self.top_k, self.renormalize)
        if self.weights_in_model_dtype:
            weights = weights.to(hidden.dtype)
        return self.experts(hidden, weights, ids)
