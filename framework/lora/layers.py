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
    out_sizes: tuple[int, ...]  # output rows per projection, in fused order
    in_size: int
    lora_a: torch.Tensor  # [S, len(projections) * R, in]
    lora_b: torch.Tensor  # [S, out, len(projections) * R]


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
    tp = getattr(model, "tp", None)
    if tp is not None and tp.world_size > 1:
        raise ValueError("enable_lora: tensor_parallel_size > 1 is not supported with LoRA")
    built: list[LoRALayer] = []
    for layer_index, decoder_layer in enumerate(layers):
        for name, (projections, parent) in LORA_LAYERS.items():
            linear = getattr(getattr(decoder_layer, parent, None), name, None)
            if linear is None or not hasattr(linear, "shards"):
                raise ValueError(f"enable_lora: {type(model).__name__} layer {layer_index} has no {parent}.{name} "
                                 "linear layer; LoRA supports the llama-family decoder")
            out_sizes = _out_sizes(linear, len(projections))
            rank_rows = len(projections) * max_lora_rank
            built.append(LoRALayer(
                layer_index=layer_index, name=name, projections=projections, out_sizes=out_sizes,
                in_size=linear.input_size,
                lora_a=torch.zeros(max_loras, rank_rows, linear.input_size, dtype=dtype, device=device),
                lora_b=torch.zeros(max_loras, sum(out_sizes), rank_rows, dtype=dtype, device=device),
            ))
    return built


def attach_hooks(model: Any, lora_layers: list[LoRALayer], state: StepLoRAState,
                 op: Callable[..., torch.Tensor]) -> list[Any]:
    """Register one forward hook per targeted layer; returns the handles."""
    handles = []
    for layer in lora_layers:
        parent = LORA_LAYERS[layer.name][1]
        linear = getattr(getattr(model.model.layers[layer.layer_index], parent), layer.name)
        handles.append(linear.register_forward_hook(_AddLoRAHook(layer, state, op)))
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
    for shard, (projection, out_size) in enumerate(zip(layer.projections, layer.out_sizes)):
        pair = adapter.modules.get((layer.layer_index, projection))
        if pair is not None:
            lora_a, lora_b = pair  # [r, in], [out, r]
            rank = lora_a.shape[0]
            first = shard * max_lora_rank
            a[first:first + rank].copy_(lora_a)
            b[out_offset:out_offset + out_size, first:first + rank].copy_(lora_b)
        out_offset += out_size
