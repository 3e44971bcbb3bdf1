"""Triton segment GEMMs for the ``add_lora`` function op (multi-LoRA), served on CUDA.

A step's tokens may each use a different adapter slot (``token_slots``, -1 for the base model).
The tokens are grouped by slot on the device (:func:`group_by_slot`: a stable argsort, per-slot
counts and starts; nothing is read back to the host, so the call can be captured in a CUDA graph),
and two launches then serve every slot at once, punica-style:

1. shrink: ``shrunk[t] = x[t] @ lora_a[s].T``   (``[T, R]`` float32), optionally split over ``in``
   (small steps leave too few token tiles to fill the GPU; split-K partial sums are added atomically)
2. expand: ``y[t] += scalings[s] * shrunk[t] @ lora_b[s].T``   (in place on ``y``)

Both grids are ``(token tiles, column tiles, slots)``: a program takes one ``BLOCK_M`` tile of its
slot's segment of the sorted token list and leaves at once when the segment is shorter, so the grid
depends only on shapes. Base tokens sit in no segment and are never touched. Accumulation is
float32; float32 runs use IEEE dots (no TF32), as the engine's float32 GEMMs do. ``y``, ``x`` and
the adapter stacks may have any strides (``y`` may be a column slice of a fused output).

Slot ids outside ``[0, S)`` are treated as base tokens (checking them would need a host sync).
The launcher takes CPU tensors too, which Triton's interpreter (``TRITON_INTERPRET=1``) runs: that
is how it is tested without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_BLOCK_R = 64  # ranks above this loop over rank tiles


@triton.jit
def _segment(order_ptr, counts_ptr, starts_ptr, slot, tile, BLOCK_M: tl.constexpr):
    """The token indices of ``tile`` of ``slot``'s segment, and which rows are real."""
    count = tl.load(counts_ptr + slot)
    start = tl.load(starts_ptr + slot)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < count
    tokens = tl.load(order_ptr + start + offs_m, mask=row_ok, other=0).to(tl.int64)
    return tokens, row_ok


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, order_ptr, counts_ptr, starts_ptr,
    R, K,
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_om, stride_or,
    SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # grid: (m_tiles * SPLIT_K, cdiv(R, BLOCK_R), S). out[tok, r] (+)= sum_k x[tok, k] * a[s, r, k].
    pid = tl.program_id(0)
    tile = pid // SPLIT_K
    split = pid % SPLIT_K
    slot = tl.program_id(2)
    if tile * BLOCK_M >= tl.load(counts_ptr + slot):  # past this slot's tokens (or an idle slot)
        return
    tokens, row_ok = _segment(order_ptr, counts_ptr, starts_ptr, slot, tile, BLOCK_M)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    # Split s takes the K chunks s, s + SPLIT_K, ...: every split reads a contiguous chunk at a time.
    for k0 in range(split * BLOCK_K, K, SPLIT_K * BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        xs = tl.load(x_ptr + tokens[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_base + offs_k[:, None] * stride_ak + offs_r[None, :] * stride_ar,
                     mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            xs = xs.to(tl.float32)
            at = at.to(tl.float32)
        acc += tl.dot(xs, at, input_precision=DOT_PRECISION)
    out = out_ptr + tokens[:, None] * stride_om + offs_r[None, :] * stride_or
    mask = row_ok[:, None] & r_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc, mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


@triton.jit
def _expand_kernel(
    s_ptr, b_ptr, y_ptr, scalings_ptr, order_ptr, counts_ptr, starts_ptr,
    N, R,
    stride_sm, stride_sr, stride_bs, stride_bn, stride_br, stride_ym, stride_yn,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # grid: (m_tiles, cdiv(N, BLOCK_N), S). y[tok, n] += scale[s] * sum_r shrunk[tok, r] * b[s, n, r].
    tile = tl.program_id(0)
    slot = tl.program_id(2)
    if tile * BLOCK_M >= tl.load(counts_ptr + slot):
        return
    tokens, row_ok = _segment(order_ptr, counts_ptr, starts_ptr, slot, tile, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        shrunk = tl.load(s_ptr + tokens[:, None] * stride_sm + offs_r[None, :] * stride_sr,
                         mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        # The float32 intermediate is not rounded to the adapter dtype (no fp16 overflow); the
        # weights widen exactly. Rank is small, so this dot is cheap next to the y traffic.
        bt = tl.load(b_base + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(shrunk, bt, input_precision=DOT_PRECISION)
    scale = tl.load(scalings_ptr + slot).to(tl.float32)
    y = y_ptr + tokens[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = row_ok[:, None] & n_ok[None, :]
    base = tl.load(y, mask=mask, other=0.0).to(tl.float32)
    tl.store(y, (base + acc * scale).to(y_ptr.dtype.element_ty), mask=mask)


def group_by_slot(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, counts, starts)``: int32 token indices sorted by slot (stable; base tokens last),
    and each slot's token count and start in ``order`` (``[S]`` int32). All on the device."""
    slots = token_slots.to(torch.int64)
    # Base tokens (and ids outside [0, S)) go to an extra bin S that no program reads.
    key = torch.where((slots >= 0) & (slots < num_slots), slots, num_slots)
    # scatter_add, not bincount: bincount reads the largest id back to the host (no CUDA graphs).
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slots.device).scatter_add_(
        0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True).to(torch.int32)
    return order, counts[:num_slots].to(torch.int32), starts[:num_slots].to(torch.int32)


def _block_m(num_tokens: int, num_slots: int) -> int:
    # Decode steps leave few tokens per slot: small tiles waste fewer masked rows.
    per_slot = num_tokens / max(1, min(num_slots, num_tokens))
    return 16 if per_slot <= 16 else 32 if per_slot <= 64 else 64


def _split_k(num_tokens: int, k: int, block_k: int) -> int:
    # Few token tiles cannot fill the GPU on their own: split the long ``in`` reduction instead,
    # keeping at least 4 K chunks per split.
    if num_tokens > 128:
        return 1
    return max(1, min(16, triton.cdiv(k, 4 * block_k)))


def _check_shapes(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  token_slots: torch.Tensor, scalings: torch.Tensor) -> None:
    if x.dim() != 2 or y.dim() != 2 or y.shape[0] != x.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must be [T, in] and [T, out]")
    num_tokens = x.shape[0]
    if lora_a.dim() != 3 or lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_a {tuple(lora_a.shape)} must be [S, R, {x.shape[1]}]")
    num_slots, rank = lora_a.shape[0], lora_a.shape[1]
    if lora_b.shape != (num_slots, y.shape[1], rank):
        raise ValueError(f"lora_b {tuple(lora_b.shape)} must be [{num_slots}, {y.shape[1]}, {rank}]")
    if token_slots.shape != (num_tokens,):
        raise ValueError(f"token_slots {tuple(token_slots.shape)} must be [{num_tokens}]")
    if scalings.shape != (num_slots,):
        raise ValueError(f"scalings {tuple(scalings.shape)} must be [{num_slots}]")


def _kernel_serves(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors; the torch reference serves the rest."""
    if x.dtype not in SUPPORTED_DTYPES or y.dtype not in SUPPORTED_DTYPES:
        return False
    if lora_a.dtype != x.dtype or lora_b.dtype != x.dtype:  # tl.dot wants one dtype on both sides
        return False
    devices = {t.device for t in (y, x, lora_a, lora_b)}
    if len(devices) != 1:
        return False
    device = devices.pop()
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def triton_add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    token_slots: torch.Tensor, scalings: torch.Tensor, *, split_k: int | None = None) -> torch.Tensor:
    """The ``add_lora`` op (``sparrow.lora.ops.add_lora``'s signature): ``y + delta``, written into
    ``y`` in place and returned. ``split_k`` forces the shrink's K split (tests)."""
    _check_shapes(y, x, lora_a, lora_b, token_slots, scalings)
    if not _kernel_serves(y, x, lora_a, lora_b):
        from sparrow.lora.ops import add_lora

        return add_lora(y, x, lora_a, lora_b, token_slots, scalings)
    num_tokens, k = x.shape
    num_slots, rank, _ = lora_a.shape
    n = y.shape[1]
    if num_tokens == 0 or num_slots == 0 or rank == 0 or n == 0:
        return y
    device = x.device
    order, counts, starts = group_by_slot(token_slots.to(device), num_slots)
    scalings = scalings.to(device=device, dtype=torch.float32)
    block_m = _block_m(num_tokens, num_slots)
    m_tiles = triton.cdiv(num_tokens, block_m)
    fp32 = x.dtype == torch.float32
    # Triton's CPU interpreter computes bf16 tl.dot wrongly; it only ever runs on CPU tensors.
    dot_in_fp32 = device.type == "cpu" and x.dtype == torch.bfloat16

    block_r = min(MAX_BLOCK_R, max(16, triton.next_power_of_2(rank)))
    block_k = min(32 if fp32 else 64, max(16, triton.next_power_of_2(k)))
    split = split_k if split_k is not None else _split_k(num_tokens, k, block_k)
    if split < 1:
        raise ValueError(f"split_k must be at least 1, got {split}")
    # Split-K partial sums are added atomically, so they need a zeroed buffer.
    shrunk = (torch.zeros if split > 1 else torch.empty)(num_tokens, rank, dtype=torch.float32, device=device)
    _shrink_kernel[(m_tiles * split, triton.cdiv(rank, block_r), num_slots)](
        x, lora_a, shrunk, order, counts, starts,
        rank, k,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        shrunk.stride(0), shrunk.stride(1),
        SPLIT_K=split, DOT_PRECISION="ieee" if fp32 else "tf32", DOT_IN_FP32=dot_in_fp32,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        num_warps=4,
    )
    block_n = min(32 if fp32 else 64, max(16, triton.next_power_of_2(n)))
    _expand_kernel[(m_tiles, triton.cdiv(n, block_n), num_slots)](
        shrunk, lora_b, y, scalings, order, counts, starts,
        n, rank,
        shrunk.stride(0), shrunk.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        # float32 operands either way: TF32 is close enough below a half-precision output.
        DOT_PRECISION="ieee" if fp32 or y.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        num_warps=4,
    )
    return y
