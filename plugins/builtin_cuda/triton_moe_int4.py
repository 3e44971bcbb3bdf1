"""AWQ / GPTQ experts served packed on CUDA: a grouped GEMM that dequantizes each weight tile as it
goes, so a quantized mixture-of-experts model keeps its experts in int4 (or GPTQ int8) on the GPU.

It joins the two kernels beside it: the tiles are the grouped GEMM's (sparrow_cuda.triton_moe: a
step's (token, expert) pairs sorted by expert, each group padded to ``BLOCK_M`` rows, one launch for
all experts), and the weight tile is loaded and dequantized as the int4 GEMM's
(sparrow_cuda.triton_quant): ``W_e[k, n] = (q_e[k, n] - zeros_e[g_e[k], n]) * scales_e[g_e[k], n]``
with ``q_e`` packed ``32 / bits`` values per int32 along k. Every expert's checkpoint layers (AWQ or
GPTQ, act order included) are repacked into that layout once, when the layer is bound, and stacked:

* ``w13_qweight [E, H / pack, 2I]``, ``w13_zeros`` / ``w13_scales [E, G, 2I]``, ``w13_g_idx [E, H]``
* ``w2_qweight [E, I / pack, H]``, ``w2_zeros`` / ``w2_scales [E, G', H]``, ``w2_g_idx [E, I]``

The weights take ``bits / 8`` bytes per value plus the groups' zeros and scales, against the dense
dtype's 2 or 4 bytes when the experts are dequantized (sparrow.quantization.dequant). Accumulation is
float32; float32 inputs multiply in IEEE float32 (no TF32). The launcher takes CPU tensors too, which
Triton's interpreter (``TRITON_INTERPRET=1``) runs: that is how it is tested without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from sparrow.ops.base import OpImpl
from sparrow_cuda.triton_moe import PairTiles, run_experts


@triton.jit
def _grouped_int4_gemm_kernel(
    a_ptr, q_ptr, zeros_ptr, scales_ptr, gidx_ptr, c_ptr, weights_ptr, sorted_pairs_ptr, tile_experts_ptr,
    num_pairs, N, K,
    stride_am, stride_qe, stride_qk, stride_ge, stride_gg, stride_ie, stride_cm,
    A_ROWS_PER_PAIR_DIV: tl.constexpr, MUL_WEIGHTS: tl.constexpr, BITS: tl.constexpr,
    IEEE: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # grid: (num_tiles, cdiv(N, BLOCK_N)). c[pair, n] = sum_k a[pair // DIV, k] * W_e[k, n].
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    if expert < 0:  # a tile past the last expert's padded group
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)  # padding rows hold num_pairs
    row_ok = pairs < num_pairs
    a_rows = pairs // A_ROWS_PER_PAIR_DIV
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    per_word: tl.constexpr = 32 // BITS
    mask_bits: tl.constexpr = (1 << BITS) - 1
    q_base = q_ptr + expert * stride_qe
    zeros_base = zeros_ptr + expert * stride_ge
    scales_base = scales_ptr + expert * stride_ge
    gidx_base = gidx_ptr + expert * stride_ie
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        tile_ok = k_ok[:, None] & col_ok[None, :]
        words = tl.load(q_base + (ks // per_word)[:, None] * stride_qk + cols[None, :], mask=tile_ok, other=0)
        q = (words >> ((ks % per_word) * BITS)[:, None]) & mask_bits
        group = tl.load(gidx_base + ks, mask=k_ok, other=0)
        at = group[:, None] * stride_gg + cols[None, :]
        zero = tl.load(zeros_base + at, mask=tile_ok, other=0.0)
        scale = tl.load(scales_base + at, mask=tile_ok, other=0.0)
        w = (q.to(tl.float32) - zero.to(tl.float32)) * scale.to(tl.float32)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
        else:
            w = w.to(a.dtype)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if MUL_WEIGHTS:
        weights = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * weights[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


class PackedExperts:
    """One projection of every expert in the kernel's layout (see the module docstring)."""

    def __init__(self, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                 bits: int) -> None:
        self.qweight, self.zeros, self.scales, self.g_idx, self.bits = qweight, zeros, scales, g_idx, bits

    @property
    def in_features(self) -> int:
        return self.g_idx.shape[1]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[2]


def grouped_int4_gemm(a: torch.Tensor, experts: PackedExperts, c: torch.Tensor, tiles: PairTiles,
                      rows_per_pair_div: int, weights: torch.Tensor | None) -> None:
    """``c[pair] = a[pair // rows_per_pair_div] @ W_e`` (times ``weights[pair]``) for every pair."""
    n, k = experts.out_features, experts.in_features
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(32, max(16, triton.next_power_of_2(k)))
    grid = (tiles.tile_experts.shape[0], triton.cdiv(n, block_n))
    _grouped_int4_gemm_kernel[grid](
        a, experts.qweight, experts.zeros, experts.scales, experts.g_idx, c,
        weights if weights is not None else c, tiles.sorted_pairs, tiles.tile_experts,
        tiles.num_pairs, n, k,
        a.stride(0), experts.qweight.stride(0), experts.qweight.stride(1), experts.scales.stride(0),
        experts.scales.stride(1), experts.g_idx.stride(0), c.stride(0),
        A_ROWS_PER_PAIR_DIV=rows_per_pair_div, MUL_WEIGHTS=weights is not None, BITS=experts.bits,
        IEEE=a.dtype == torch.float32,
        # Triton's CPU interpreter computes bf16 tl.dot wrongly; it only ever runs on CPU tensors.
        DOT_IN_FP32=a.device.type == "cpu" and a.dtype == torch.bfloat16,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4,
    )


def fused_moe_int4(hidden: torch.Tensor, w13: PackedExperts, w2: PackedExperts, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` -> ``[T, H]`` as :func:`sparrow_cuda.triton_moe.fused_moe`, the experts packed."""
    projections = (w13, w2)

    def gemm(stage: int, a: torch.Tensor, c: torch.Tensor, tiles: PairTiles, div: int,
             weights: torch.Tensor | None) -> None:
        grouped_int4_gemm(a, projections[stage], c, tiles, div, weights)

    return run_experts(hidden.contiguous(), topk_weights, topk_ids, w13.qweight.shape[0], w13.out_features, gemm)


def pack_experts(linears: list[Any]) -> PackedExperts:
    """Every expert's quantized linear layer (one projection) -> the stacked kernel layout; each
    expert is unpacked and repacked in turn, so only one expert's values are ever unpacked."""
    from sparrow_cuda.triton_quant import repack_along_k

    bits = linears[0].weights.bits
    parts: dict[str, list[torch.Tensor]] = {"qweight": [], "zeros": [], "scales": [], "g_idx": []}
    for linear in linears:
        q, zeros, scales, group_of = linear.weights.operands(linear)
        parts["qweight"].append(repack_along_k(q, bits))
        parts["zeros"].append(zeros.to(scales.dtype))
        parts["scales"].append(scales)
        parts["g_idx"].append(group_of.to(torch.int32))
        del q
    stacked = {name: torch.stack(tensors).contiguous() for name, tensors in parts.items()}
    return PackedExperts(stacked["qweight"], stacked["zeros"], stacked["scales"], stacked["g_idx"], bits)


class TritonInt4FusedMoE(OpImpl):
    """``fused_moe`` of AWQ / GPTQ experts on CUDA in two grouped GEMMs that dequantize as they go."""

    name = "triton_int4"
    PROJECTIONS = (("w13", "gate_up_proj"), ("w2", "down_proj"))

    @classmethod
    def supports(cls, layer: Any) -> bool:
        from sparrow.quantization.int4 import Int4Weights

        if not getattr(layer, "quantized", False):
            return False
        first = layer.get_submodule("0")
        return all(isinstance(getattr(first, name).weights, Int4Weights) for _, name in cls.PROJECTIONS)

    def process_weights(self) -> None:
        layer = self.layer
        linears = layer.pop_expert_linears()  # before bind_ops reaches the experts' linear layers
        packed = {prefix: pack_experts(linears[name]) for prefix, name in self.PROJECTIONS}
        for prefix, experts_packed in packed.items():
            for field in ("qweight", "zeros", "scales", "g_idx"):
                layer.replace_parameter(f"{prefix}_{field}", getattr(experts_packed, field))
        self.bits = packed["w13"].bits
        self.dtype = packed["w13"].scales.dtype

    def _packed(self, prefix: str) -> PackedExperts:
        layer = self.layer
        fields = ("qweight", "zeros", "scales", "g_idx")
        return PackedExperts(*(getattr(layer, f"{prefix}_{field}") for field in fields), bits=self.bits)

    def __call__(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # The layer has no dense weights to fall back on: other dtypes compute in the scales' dtype.
        x = hidden.to(self.dtype) if hidden.dtype != self.dtype else hidden
        out = fused_moe_int4(x, self._packed("w13"), self._packed("w2"), topk_weights, topk_ids)
        return out.to(hidden.dtype) if out.dtype != hidden.dtype else out
