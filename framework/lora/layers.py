"""Adapter slots on the device: one stacked A/B pair per targeted linear layer, and the forward
hooks that add every token's adapter update to the layer's output.

Per decoder layer there are four LoRA-carrying layers; the fused ones stack their projections::

    qkv_proj      q_proj, k_proj, v_proj     A [S, 3R, hidden]   B [S, q + 2 kv, 3R]
    o_proj        o_proj                     A [S, R, q]         B [S, hidden, R]
    gate_up_proj  gate_proj, up_proj         A [S, 2R, hidden]   B [S, 2 I, 2R]
    down_proj     down_proj                  A [S, R, I]         B [S, hidden, R]

(S = max_loras slots, R = max_lora_rank.) Shard j of a fused layer owns rank columns
``[j R, j R + r)`` of A's rows and only its own output rows of B, so B is block-diagonal and one
``add_lora`` call gives every projection exactly its own update; a projection the adapter does not
target, and the rank padding, are zeros. The hooks do nothing while no token of the step uses an
adapter, so base-only steps run the base path (and the CUDA runner's graphs) untouched.

Tensor parallelism slices the slots as the base weights are sliced. Column-parallel layers
(qkv_proj, gate_up_proj) see the whole input: A is whole, B holds this rank's output rows of each
projection (the sizes above are then per rank). Row-parallel layers (o_proj, down_proj) see this
rank's input shard: A holds this rank's input columns, B is whole, and the shrink
``x_shard @ A_shard^T`` is a partial sum, all-reduced ([T, R]) before the expand
(:class:`_RowParallelHook`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from sparrow.lora.peft import LoRAWeights

# fused layer attribute -> (projections in output order, sub-module holding it)
LORA_LAYERS: dict[str, tuple[tuple[str, ...], str]] = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), "self_attn"),
    "o_proj": (("o_proj",), "self_attn"),
    "gate_up_proj": (("gate_proj", "up_proj"), "mlp"),
    "down_proj": (("down_proj",), "mlp"),
}


class StepLoRAState:
    """What this step's hooks read: ``token_slots`` [T] int64 (-1: base token), ``scalings`` [S]
    float32, and whether any token uses an adapter (``active``)."""

    __slots__ = ("active", "token_slots", "scalings")

    def __init__(self, scalings: torch.Tensor) -> None:
        self.active = False
        self.token_slots: torch.Tensor | None = None
        self.scalings = scalings


@dataclass(slots=True)
class LoRALayer:
    """One targeted linear layer's slots and its output sizes per projection."""

    layer_index: int
    name: str  # qkv_proj, o_proj, gate_up_proj, down_proj
    projections: tuple[str, ...]
    out_sizes: tuple[int, ...]  # this rank's output rows per projection, in fused order
    in_size: int  # this rank's input columns
    lora_a: torch.Tensor  # [S, len(projections) * R, in]
    lora_b: torch.Tensor  # [S, out, len(projections) * R]
    # Where this rank's part starts in the adapter's whole tensors: per projection, the first row
    # of its B (the base weight's ``OutputShard.loaded_start``), and the first column of A.
    out_starts: tuple[int, ...] = ()
    in_start: int = 0
    # Row-parallel layers whose output is all-reduced by the layer: the group to reduce the
    # shrink over (None: no reduction, one rank or a layer that leaves its output partial).
    tp: Any = None


class _AddLoRAHook:
    """``register_forward_hook`` callable: the layer's output plus its adapters' updates."""

    __slots__ = ("layer", "state", "op")

    def __init__(self, layer: LoRALayer, state: StepLoRAState, op: Callable[..., torch.Tensor]) -> None:
        self.layer, self.state, self.op = layer, state, op

    def __call__(self, module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
        state = self.state
        if not state.active:
            return None  # keep the output as is
        x = args[0]
        return self.op(output, x, self.layer.lora_a, self.layer.lora_b, state.token_slots, state.scalings)


class _RowParallelHook(_AddLoRAHook):
    """A row-parallel layer over several ranks that all-reduces its own output: the hook runs
    after that reduction, so ``output`` is whole on every rank while ``x`` is this rank's input
    shard. ``x_shard @ A_shard^T`` summed over ranks is ``x @ A^T``: the [T, R] shrink is
    all-reduced through the layer's tensor-parallel group, then expanded with the whole B and the
    whole update added on every rank (each rank holds the same reduced output).

    Both halves go through the ``add_lora`` op unchanged, so a platform's kernel serves them: the
    shrink with B = identity and scaling 1 into a float32 zero buffer (base tokens keep zero rows,
    and the partial sums are reduced in float32), the expand with A = identity and the real
    scalings. Every rank runs the same step (same batch, same adapters), so every rank reaches the
    collective."""

    __slots__ = ("eye", "ones")

    def __init__(self, layer: LoRALayer, state: StepLoRAState, op: Callable[..., torch.Tensor]) -> None:
        super().__init__(layer, state, op)
        num_slots, rank_rows, _ = layer.lora_a.shape
        eye = torch.eye(rank_rows, dtype=layer.lora_a.dtype, device=layer.lora_a.device)
        self.eye = eye.expand(num_slots, rank_rows, rank_rows).contiguous()  # [S, R, R]
        self.ones = torch.ones(num_slots, dtype=torch.float32, device=layer.lora_a.device)

    def __call__(self, module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
        state = self.state
        if not state.active:
            return None
        x, layer = args[0], self.layer
        shrunk = torch.zeros(x.shape[0], self.eye.shape[1], dtype=torch.float32, device=x.device)
        shrunk = self.op(shrunk, x, layer.lora_a, self.eye, state.token_slots, self.ones)
        shrunk = layer.tp.all_reduce(shrunk)
        # The expand reads the reduced shrink in the adapter's dtype (as vLLM's punica expand
        # does), so the kernel takes one dtype on both sides of its dot.
        return self.op(output, shrunk.to(layer.lora_b.dtype), self.eye, layer.lora_b, state.token_slots,
                       state.scalings)


def module_shapes(model: Any) -> dict[str, tuple[int, int]]:
    """projection -> (in, out) of the whole (unsharded) projection in this model."""
    first = model.model.layers[0]
    shapes: dict[str, tuple[int, int]] = {}
    for name, (projections, parent) in LORA_LAYERS.items():
        linear = getattr(getattr(first, parent), name)
        for projection, out_size in zip(projections, _out_sizes(linear, len(projections))):
            shapes[projection] = (linear.input_size, out_size)
    return shapes


def _out_sizes(linear: Any, num_projections: int) -> tuple[int, ...]:
    shards = list(linear.shards.values())
    if len(shards) != num_projections:
        raise ValueError(f"{type(linear).__name__} has {len(shards)} output shards, expected {num_projections}")
    return tuple(shard.full_size for shard in shards)


def build_lora_layers(model: Any, max_loras: int, max_lora_rank: int, device: torch.device,
                      dtype: torch.dtype) -> list[LoRALayer]:
    """Zeroed slots for every targeted layer of a llama-family decoder; ValueError naming
    ``enable_lora`` when the model's decoder layers do not have these projections."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"enable_lora: {type(model).__name__} has no model.layers decoder stack")
    built: list[LoRALayer] = []
    for layer_index, decoder_layer in enumerate(layers):
        for name, (projections, parent) in LORA_LAYERS.items():
            linear = getattr(getattr(decoder_layer, parent, None), name, None)
            if linear is None or not all(hasattr(linear, a) for a in ("shards", "input_size", "input_size_per_rank")):
                raise ValueError(f"enable_lora: {type(model).__name__} layer {layer_index} has no {parent}.{name} "
                                 "linear layer; LoRA supports the llama-family decoder")
            _out_sizes(linear, len(projections))  # the fused layer has one shard per projection
            shards = list(linear.shards.values())
            rank_rows = len(projections) * max_lora_rank
            in_size = linear.input_size_per_rank
            tp = getattr(linear, "tp", None)
            world_size = tp.world_size if tp is not None else 1
            row_parallel = bool(getattr(linear, "input_is_parallel", False)) and world_size > 1
            if getattr(linear, "gather_output", False) and world_size > 1:
                # Its output is whole while B would hold this rank's rows: no such layer in llama.
                raise ValueError(f"enable_lora: layer {layer_index} {parent}.{name} gathers its output across "
                                 "ranks; LoRA slices column-parallel outputs per rank")
            built.append(LoRALayer(
                layer_index=layer_index, name=name, projections=projections,
                out_sizes=tuple(shard.size for shard in shards), in_size=in_size,
                lora_a=torch.zeros(max_loras, rank_rows, in_size, dtype=dtype, device=device),
                lora_b=torch.zeros(max_loras, sum(shard.size for shard in shards), rank_rows, dtype=dtype,
                                   device=device),
                out_starts=tuple(shard.loaded_start for shard in shards),
                in_start=tp.rank * in_size if row_parallel else 0,
                # A row-parallel layer that leaves its output partial (reduce_results=False, reduced
                # later by the model) needs no reduction here: each rank adds its own partial update
                # (x_shard A_shard^T) B^T, and the model's reduction sums them into the whole one.
                tp=tp if row_parallel and getattr(linear, "reduce_results", True) else None,
            ))
    return built


def attach_hooks(model: Any, lora_layers: list[LoRALayer], state: StepLoRAState,
                 op: Callable[..., torch.Tensor]) -> list[Any]:
    """Register one forward hook per targeted layer; returns the handles."""
    handles = []
    for layer in lora_layers:
        parent = LORA_LAYERS[layer.name][1]
        linear = getattr(getattr(model.model.layers[layer.layer_index], parent), layer.name)
        hook = (_RowParallelHook if layer.tp is not None else _AddLoRAHook)(layer, state, op)
        handles.append(linear.register_forward_hook(hook))
    return handles


def write_slot(layer: LoRALayer, slot: int, adapter: LoRAWeights | None, max_lora_rank: int) -> None:
    """Copy ``adapter``'s weights for ``layer`` into ``slot`` (zeros where it has none; all
    zeros for None)."""
    a, b = layer.lora_a[slot], layer.lora_b[slot]
    a.zero_()
    b.zero_()
    if adapter is None:
        return
    out_offset = 0
    out_starts = layer.out_starts or (0,) * len(layer.projections)
    for shard, (projection, out_size, out_start) in enumerate(zip(layer.projections, layer.out_sizes, out_starts)):
        pair = adapter.modules.get((layer.layer_index, projection))
        if pair is not None:
            lora_a, lora_b = pair  # [r, in], [out, r] of the whole projection
            rank = lora_a.shape[0]
            first = shard * max_lora_rank
            # This rank's part, cut as the base weight's: its input columns of A (row-parallel)
            # and its output rows of B (column-parallel; a replicated KV head's rows on each of its ranks).
            a[first:first + rank].copy_(lora_a[:, layer.in_start:layer.in_start + layer.in_size])
            b[out_offset:out_offset + out_size, first:first + rank].copy_(lora_b[out_start:out_start + out_size])
        out_offset += out_size
