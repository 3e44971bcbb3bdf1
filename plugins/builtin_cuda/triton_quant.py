"""A Triton GEMM that dequantizes AWQ / GPTQ int4 (GPTQ int8 too) weights tile by tile on CUDA.

``int4_gemm(x, qweight, zeros, scales, g_idx, bits)`` computes ``x @ W`` where
``W[k, n] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]`` and ``q`` is packed
``32 / bits`` values per int32 along k, in order (GPTQ's layout): ``qweight [K / pack, N]``. Both
checkpoint formats are repacked into it once, when the model is bound (AWQ packs along the output
in an interleaved order; GPTQ's zero points are stored minus one): ``zeros`` and ``scales`` are
``[groups, N]`` in the scales' dtype and ``g_idx`` the group of every input row, so act order costs
nothing extra. Each program owns a ``BLOCK_M x BLOCK_N`` tile of the output and walks K, loading
the packed words of its ``BLOCK_K x BLOCK_N`` weight tile once per value they hold (the cache
serves the repeats), unpacking, scaling and multiplying with ``tl.dot`` in float32 accumulation;
float32 inputs are multiplied in full float32 precision (no TF32), so results match the layer's
dequantizing torch reference to float32 rounding.

The launcher takes CPU tensors too, which Triton's interpreter (``TRITON_INTERPRET=1``) runs: that
is how it is tested without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from sparrow.ops.base import OpImpl


@triton.jit
def _int4_gemm_kernel(x_ptr, q_ptr, zeros_ptr, scales_ptr, gidx_ptr, bias_ptr, out_ptr, M, N, K,
                      stride_xm, stride_qk, stride_gn, stride_om,
                      BITS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    per_word: tl.constexpr = 32 // BITS
    mask_bits: tl.constexpr = (1 << BITS) - 1
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        tile_ok = k_ok[:, None] & col_ok[None, :]
        words = tl.load(q_ptr + (ks // per_word)[:, None] * stride_qk + cols[None, :], mask=tile_ok, other=0)
        q = (words >> ((ks % per_word) * BITS)[:, None]) & mask_bits
        group = tl.load(gidx_ptr + ks, mask=k_ok, other=0)
        zero = tl.load(zeros_ptr + group[:, None] * stride_gn + cols[None, :], mask=tile_ok, other=0.0)
        scale = tl.load(scales_ptr + group[:, None] * stride_gn + cols[None, :], mask=tile_ok, other=0.0)
        w = ((q.to(tl.float32) - zero.to(tl.float32)) * scale.to(tl.float32)).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor, bits: int = 4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W [K, N] (+ bias)`` with W dequantized on the fly; out in x's dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else (32 if m <= 64 else 64)
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](x, qweight, zeros, scales, g_idx, bias if bias is not None else x, out, m, n, k,
                            x.stride(0), qweight.stride(0), zeros.stride(0), out.stride(0),
                            BITS=bits, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def repack_along_k(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values ``[K, N]`` -> int32 ``[K / pack, N]``, ``pack = 32 / bits`` per word in order."""
    from sparrow.quantization.int4 import pack

    return pack(q, bits, dim=0)


class TritonInt4Linear(OpImpl):
    """``linear`` of an AWQ or GPTQ layer on CUDA, through :func:`int4_gemm`."""

    name = "triton_int4"

    @classmethod
    def supports(cls, layer: Any) -> bool:
        from sparrow.quantization.int4 import Int4Weights

        return isinstance(getattr(layer, "weights", None), Int4Weights)

    def process_weights(self) -> None:
        layer = self.layer
        weights = layer.weights
        q, zeros, scales, group_of = weights.operands(layer)
        self.bits = weights.bits
        packed = repack_along_k(q, self.bits)
        zeros = zeros.to(scales.dtype).contiguous()
        scales = scales.contiguous()
        g_idx = group_of.to(torch.int32).contiguous()
        for name in [n for n, _ in layer.named_parameters(recurse=False) if n != "bias"]:
            delattr(layer, name)
        for name, tensor in (("qweight", packed), ("zeros", zeros), ("scales", scales), ("g_idx", g_idx)):
            layer.replace_parameter(name, tensor)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        layer = self.layer
        x2 = x.reshape(-1, x.shape[-1])
        out = int4_gemm(x2, layer.qweight, layer.zeros, layer.scales, layer.g_idx, self.bits, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])
