"""Triton grouped GEMM for the ``fused_moe`` op, and the op implementation serving it on CUDA.

A step's (token, expert) pairs are grouped by expert and each group padded to a multiple of
``BLOCK_M`` rows (:func:`align_pairs`, plain torch on the device, no host sync), so that every
``BLOCK_M`` tile of the sorted pair list belongs to one expert. One kernel launch then computes all
experts' products at once: a program takes one tile, gathers its tokens' rows of the input, and
multiplies them by its expert's weight. It runs twice per layer:

1. ``gate_up[pair] = hidden[pair // k] @ gate_up_proj[e].T``   (``[T*k, 2I]``)
2. ``out[pair] = weight[pair] * (silu(gate) * up)[pair] @ down_proj[e].T``   (``[T*k, H]``)

and the ``k`` rows of each token are summed. Accumulation is float32; float32 runs use IEEE dots
(no TF32), as the engine's float32 GEMMs do. The launchers take CPU tensors too, which Triton's
interpreter (``TRITON_INTERPRET=1``) runs: that is how they are tested without a GPU.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import triton
import triton.language as tl

from sparrow.ops.base import OpImpl
from sparrow.quantization.fp8 import Fp8FusedMoE
from sparrow_cuda import triton_fp8

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_pairs_ptr, tile_experts_ptr, a_scale_ptr, b_scale_ptr,
    num_pairs, N, K,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_bse,
    A_ROWS_PER_PAIR_DIV: tl.constexpr, MUL_WEIGHTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # grid: (num_tiles, cdiv(N, BLOCK_N)). c[pair, n] = sum_k a[pair // DIV, k] * b[e, n, k]; with
    # SCALED (fp8 operands) times a_scale[pair // DIV] * b_scale[e, n].
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    if expert < 0:  # a tile past the last expert's padded group
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)  # padding rows hold num_pairs
    row_ok = pairs < num_pairs
    a_rows = pairs // A_ROWS_PER_PAIR_DIV
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    b_base = b_ptr + expert * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_base + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if SCALED:
            acc += tl.dot(a, b)  # fp8 x fp8 on the tensor cores, float32 accumulation
        else:
            acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if SCALED:
        a_scale = tl.load(a_scale_ptr + a_rows, mask=row_ok, other=0.0)
        b_scale = tl.load(b_scale_ptr + expert * stride_bse + offs_n, mask=col_ok, other=0.0)
        acc = acc * a_scale[:, None] * b_scale[None, :]
    if MUL_WEIGHTS:
        weights = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * weights[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the ``T*k`` (token, expert) pairs by expert, each group padded to ``block_m`` rows.

    Returns ``sorted_pairs`` (int32 pair indices ``token * k + slot``; padding rows hold ``T*k``)
    and ``tile_experts`` (int32, the expert of each ``block_m`` tile, -1 for tiles past the last
    group). Sized by an upper bound so that nothing is read back to the host.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    # scatter_add, not bincount: bincount reads the largest id back to the host (no CUDA graphs).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    group_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank_in_group = torch.arange(num_pairs, device=device) - group_start[sorted_experts]
    dest = padded_start[sorted_experts] + rank_in_group
    # At most min(E, T*k) groups are non-empty, each padded by fewer than block_m rows.
    capacity = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    tile_starts = torch.arange(0, capacity, block_m, device=device)
    tile_experts = torch.searchsorted(padded_end, tile_starts, right=True)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1).to(torch.int32)
    return sorted_pairs, tile_experts


def _block_m(num_pairs: int, num_experts: int) -> int:
    # Small steps (decode) leave few pairs per expert: small tiles waste less padding.
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


class PairTiles(NamedTuple):
    """A step's (token, expert) pairs in ``block_m`` tiles of one expert each (:func:`align_pairs`)."""

    sorted_pairs: torch.Tensor
    tile_experts: torch.Tensor
    num_pairs: int
    block_m: int


GroupedGemm = Callable[[int, torch.Tensor, torch.Tensor, PairTiles, int, "torch.Tensor | None"], None]


def run_experts(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                gate_up_width: int, gemm: GroupedGemm) -> torch.Tensor:
    """What every ``fused_moe`` variant does around its grouped GEMM: tile the pairs, then

    1. ``gemm(0, hidden, gate_up, tiles, k, None)``: ``gate_up[pair] = hidden[pair // k] @ W13_e``;
    2. ``gemm(1, silu_and_mul(gate_up), out, tiles, 1, weights)``: ``out[pair] = weight * act @ W2_e``;

    and the ``k`` rows of each token summed. ``gemm`` is the variant's (dense, fp8, int4).
    """
    from sparrow_cuda.triton_elementwise import silu_and_mul

    num_tokens, hidden_size = hidden.shape
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                         f"both be [{num_tokens}, k]")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    block_m = _block_m(num_pairs, num_experts)
    tiles = PairTiles(*align_pairs(topk_ids, num_experts, block_m), num_pairs, block_m)
    gate_up = torch.empty(num_pairs, gate_up_width, dtype=hidden.dtype, device=hidden.device)
    gemm(0, hidden, gate_up, tiles, top_k, None)
    act = silu_and_mul(gate_up)  # [T*k, I]
    out = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    gemm(1, act, out, tiles, 1, topk_weights.reshape(-1).contiguous())
    return out.view(num_tokens, top_k, hidden_size).sum(dim=1)


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tiles: PairTiles, rows_per_pair_div: int,
                  weights: torch.Tensor | None, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """``scales``: (``a_scale [rows of a]``, ``b_scale [E, N]``) float32, for fp8 ``a`` and ``b``."""
    n, k = b.shape[1], b.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    # fp8 tensor-core dots take k in multiples of 32.
    block_k = 64 if scales is not None else min(64 if a.dtype != torch.float32 else 32,
                                                  max(16, triton.next_power_of_2(k)))
    a_scale, b_scale = scales if scales is not None else (c, c)
    grid = (tiles.tile_experts.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, tiles.sorted_pairs, tiles.tile_experts, a_scale, b_scale,
        tiles.num_pairs, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        b_scale.stride(0) if scales is not None else 0,
        A_ROWS_PER_PAIR_DIV=rows_per_pair_div, MUL_WEIGHTS=weights is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        # Triton's CPU interpreter computes bf16 tl.dot wrongly; it only ever runs on CPU tensors.
        DOT_IN_FP32=a.device.type == "cpu" and a.dtype == torch.bfloat16, SCALED=scales is not None,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4,
    )


def fused_moe(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` -> ``[T, H]``: the sum over each token's k experts of weight * gated MLP.

    ``gate_up_proj [E, 2I, H]`` (gate rows then up rows), ``down_proj [E, H, I]``, ``topk_weights``
    and ``topk_ids`` ``[T, k]``. ``hidden`` needs a unit inner stride.
    """
    hidden_size = hidden.shape[1]
    num_experts, two_inter, _ = gate_up_proj.shape
    if gate_up_proj.shape[2] != hidden_size or down_proj.shape != (num_experts, hidden_size, two_inter // 2):
        raise ValueError(f"expert weights {tuple(gate_up_proj.shape)} / {tuple(down_proj.shape)} do not fit "
                         f"hidden size {hidden_size}")
    if hidden.stride(1) != 1:
        raise ValueError("fused_moe needs hidden with a unit inner stride")
    projections = (gate_up_proj, down_proj)

    def gemm(stage: int, a: torch.Tensor, c: torch.Tensor, tiles: PairTiles, div: int,
             weights: torch.Tensor | None) -> None:
        _grouped_gemm(a, projections[stage], c, tiles, div, weights)

    return run_experts(hidden, topk_weights, topk_ids, num_experts, two_inter, gemm)


class TritonFusedMoE(OpImpl):
    """The experts of a mixture-of-experts layer in two grouped-GEMM launches."""

    name = "triton"

    @classmethod
    def supports(cls, layer: Any) -> bool:
        weight = layer.gate_up_proj
        return (weight.device.type == "cuda" and weight.dtype in SUPPORTED_DTYPES
                and layer.down_proj.dtype == weight.dtype)

    def __call__(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        if hidden.dtype != layer.gate_up_proj.dtype or hidden.dim() != 2 or hidden.stride(-1) != 1:
            return layer.forward_native(hidden, topk_weights, topk_ids)
        return fused_moe(hidden, layer.gate_up_proj, layer.down_proj, topk_weights, topk_ids)


def fused_moe_fp8(hidden: torch.Tensor, gate_up_proj: torch.Tensor, gate_up_scale: torch.Tensor,
                  down_proj: torch.Tensor, down_scale: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """:func:`fused_moe` with fp8 experts (``*_proj`` float8_e4m3fn, ``*_scale [E, N]`` float32 per
    output channel); each GEMM's input is quantized to fp8 per row first (see
    ``sparrow.quantization.fp8.Fp8FusedMoE``, whose emulated product this equals): on CUDA tensors
    in one Triton launch each (``sparrow_cuda.triton_fp8``), the torch reference's bits."""
    projections = ((gate_up_proj, gate_up_scale), (down_proj, down_scale))

    def gemm(stage: int, a: torch.Tensor, c: torch.Tensor, tiles: PairTiles, div: int,
             weights: torch.Tensor | None) -> None:
        weight, weight_scale = projections[stage]
        a_q, a_scale = triton_fp8.quantize_rows(a)  # per token (gate/up), per (token, expert) pair (down)
        _grouped_gemm(a_q, weight, c, tiles, div, weights, scales=(a_scale, weight_scale))

    return run_experts(hidden, topk_weights, topk_ids, gate_up_proj.shape[0], gate_up_proj.shape[1], gemm)


def fp8_dots_compile(device: torch.device) -> bool:
    """Whether Triton's fp8 (e4m3) dots run here: the interpreter, or compute capability 8.9+."""
    if device.type != "cuda":
        return True  # CPU tensors only ever run in the interpreter
    return torch.cuda.get_device_capability(device) >= (8, 9)


class TritonFp8FusedMoE(Fp8FusedMoE):
    """fp8 experts in two grouped-GEMM launches on the tensor cores (the emulated product where
    the GPU has no fp8 support, compute capability below 8.9)."""

    name = "triton_fp8"

    @staticmethod
    def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_fp8.quantize_rows(x)  # the Triton kernel on CUDA tensors (also when the weights are bound)

    def process_weights(self) -> None:
        super().process_weights()
        self.use_triton = fp8_dots_compile(self.layer.gate_up_proj.device)

    def __call__(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if not self.use_triton or hidden.dim() != 2:
            return super().__call__(hidden, topk_weights, topk_ids)
        layer = self.layer
        return fused_moe_fp8(hidden, layer.gate_up_proj, layer.gate_up_scale, layer.down_proj, layer.down_scale,
                             topk_weights, topk_ids)
