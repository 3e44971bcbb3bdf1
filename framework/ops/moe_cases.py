"""Conformance cases of the ``fused_moe`` op (see :mod:`sparrow.ops.cases` for the conventions).

Odd sizes on purpose: 5 experts, top-1 and top-3, an intermediate size that is no power of two,
batches where some experts get no token and one where a single expert gets most of them, and rank
1 of 2 under tensor parallelism (this rank's slice of every expert; the op's output is the partial
sum that the layer all-reduces).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sparrow.layers.parallel import ParallelContext
from sparrow.ops.base import CustomOp
from sparrow.ops.cases import _GEMM_TOL, ROWS, OpCase, _generator, _layer_builder, _randn, _tol

HIDDEN = 32
NUM_EXPERTS = 5


def fill_experts(layer: Any, gen: torch.Generator) -> None:
    """Every expert's full checkpoint tensors, through the layer's per-expert loader."""
    from sparrow.layers.fused_moe import DOWN, GATE, UP

    hidden, inter = layer.hidden_size, layer.intermediate_size
    for expert in range(layer.num_experts):
        for projection in (GATE, UP):
            full = torch.randn(inter, hidden, generator=gen) / hidden ** 0.5
            layer.gate_up_proj.weight_loader(layer.gate_up_proj, full, (projection, expert))
        full = torch.randn(hidden, inter, generator=gen) / inter ** 0.5
        layer.down_proj.weight_loader(layer.down_proj, full, (DOWN, expert))


def routing(gen: torch.Generator, rows: int, top_k: int, skewed: bool, weights_dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per row and normalised weights, as the router gives them."""
    scores = torch.rand(rows, NUM_EXPERTS, generator=gen)
    if skewed:
        scores[:, 2] += 1.0  # expert 2 in every row: one expert with many tokens
    ids = scores.argsort(dim=-1, descending=True)[:, :top_k]
    weights = torch.rand(rows, top_k, generator=gen) + 0.1
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(device=device, dtype=weights_dtype), ids.to(device)


def fused_moe_cases(dtype: torch.dtype, device: torch.device) -> list[OpCase]:
    from sparrow.layers.fused_moe import FusedMoE

    layouts: list[tuple[str, Callable[[], CustomOp], int, bool, torch.dtype]] = [
        # (label, build, top_k, skewed routing, routing weights' dtype)
        ("5 experts top-3, inter 40", lambda: FusedMoE(NUM_EXPERTS, HIDDEN, 40), 3, False, dtype),
        ("5 experts top-1, float32 weights", lambda: FusedMoE(NUM_EXPERTS, HIDDEN, 40), 1, False, torch.float32),
        ("5 experts top-2, one busy expert", lambda: FusedMoE(NUM_EXPERTS, HIDDEN, 24), 2, True, dtype),
        ("tp rank 1/2, top-3", lambda: FusedMoE(NUM_EXPERTS, HIDDEN, 48, tp=ParallelContext(1, 2)), 3, False,
         dtype),
    ]
    cases = []
    for index, (label, build, top_k, skewed, weights_dtype) in enumerate(layouts):
        make_layer = _layer_builder(build, fill_experts, dtype, device, 1400 + index)
        for rows in ROWS:
            gen = _generator(1500 + index, rows)
            hidden = _randn(gen, rows, HIDDEN, dtype=dtype, device=device)
            weights, ids = routing(gen, rows, top_k, skewed, weights_dtype, device)
            cases.append(OpCase("fused_moe", f"{label}, {rows} tokens", make_layer, (hidden, weights, ids),
                                **_tol(_GEMM_TOL, dtype)))
    return cases
