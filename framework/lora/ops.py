"""The ``add_lora`` kernel op: a batch where every token may use a different adapter.

One call adds every token's low-rank update to a linear layer's output::

    y[t] += scalings[s] * (x[t] @ lora_a[s].T) @ lora_b[s].T     where s = token_slots[t] >= 0

``lora_a`` / ``lora_b`` hold every adapter slot of one layer, stacked and zero-padded to the
largest rank (padding adds exact zeros). Tokens with slot -1 (the base model) are left alone.
This is the op a platform replaces with a segment GEMM (Triton on CUDA); the reference below
groups tokens by slot, so its cost grows with the number of adapters in the step, not the tokens.
"""

from __future__ import annotations

import torch


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             token_slots: torch.Tensor, scalings: torch.Tensor) -> torch.Tensor:
    """``y + delta``: y [T, out], x [T, in], lora_a [S, R, in], lora_b [S, out, R], token_slots [T]
    int64 (-1: no adapter), scalings [S] float32. May update ``y`` in place; callers use the
    returned tensor."""
    slots = torch.unique(token_slots).tolist()
    for slot in slots:
        if slot < 0:
            continue
        rows = torch.nonzero(token_slots == slot).squeeze(1)
        shrunk = x.index_select(0, rows).float() @ lora_a[slot].float().T  # [n, R]
        delta = (shrunk @ lora_b[slot].float().T) * scalings[slot].float()  # [n, out]
        y.index_add_(0, rows, delta.to(y.dtype))
    return y


def add_lora_cases(dtype: torch.dtype, device: torch.device) -> list:
    """Conformance cases: decode- and prefill-sized batches, tokens of two adapters interleaved with
    base tokens, an adapter padded to a smaller rank, an empty slot, and a step with no adapter."""
    from sparrow.ops.cases import _GEMM_TOL, OpCase, _generator, _tol

    cases = []
    for tokens, slots_pattern, label in (
        (1, [0], "1 token, slot 0"),
        (5, [-1, 1, 0, 1, -1], "5 tokens, two adapters and base"),
        (37, [2, -1, 0, 0, 1, 2, 2], "37 tokens, three adapters and base"),
        (5, [-1], "5 base tokens only"),
    ):
        gen = _generator(1400, tokens, len(slots_pattern))
        num_slots, rank, d_in, d_out = 4, 8, 48, 40
        x = torch.randn(tokens, d_in, generator=gen).to(device, dtype)
        y = torch.randn(tokens, d_out, generator=gen).to(device, dtype)
        a = (torch.randn(num_slots, rank, d_in, generator=gen) * 0.2)
        b = (torch.randn(num_slots, d_out, rank, generator=gen) * 0.2)
        a[1, 4:] = 0.0  # slot 1 holds a rank-4 adapter, zero-padded
        b[1, :, 4:] = 0.0
        a[3] = 0.0  # slot 3 is empty
        b[3] = 0.0
        slot_ids = torch.tensor([slots_pattern[i % len(slots_pattern)] for i in range(tokens)], dtype=torch.int64)
        scalings = torch.tensor([2.0, 0.5, 1.0, 0.0], dtype=torch.float32)
        cases.append(OpCase("add_lora", f"{label}, {tokens}x{d_in}->{d_out}, rank {rank}", None,
                            (y, x, a.to(device, dtype), b.to(device, dtype), slot_ids.to(device),
                             scalings.to(device)), **_tol(_GEMM_TOL, dtype)))
    return cases
